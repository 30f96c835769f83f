"""The files a capture is made of, and a dump into a folder that is all or nothing.

A folder holds one capture at a time: a full capture (``attention.npy`` + ``capture.json``) or
a long one (``q_LLL.npy``, ``k_LLL.npy``, ``lse_LLL.npy`` per layer + ``long.json``). Once a dump
into a folder is complete, :func:`remove_other_captures` removes the files of any other capture
attnviz wrote there (one whose sidecar is attnviz's), so ``--from DIR`` reads exactly what was
dumped last; nothing else in the folder is ever touched.

:class:`StagedDump` writes a long capture into a hidden folder inside the destination and moves
the files into place only when every one of them is written, with Ctrl-C and SIGTERM held off
for those few renames. A dump that fails or is interrupted removes what it wrote (and the
destination, when it made it), and what was in the folder before stays as it was::

    with StagedDump(Path("book")) as staged:
        write_long_capture_into(staged.path)
        staged.commit()

Only the standard library and :mod:`attnviz.fileio` are imported here.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType

from attnviz.diskfull import is_no_space, no_space_error
from attnviz.errors import DumpError, OutputError
from attnviz.fileio import (
    ensure_dir,
    list_folder,
    remove_empty_dirs,
    remove_file,
    signals_held,
)

#: A full capture in a folder: the weights, then the sidecar (written last).
FULL_FILES = ("attention.npy", "capture.json")
#: A long capture's sidecar (written last) and its per-layer arrays.
LONG_SIDECAR = "long.json"
_LONG_ARRAY = re.compile(r"^(?:q|k|lse)_\d{3,}\.npy$")
#: Sidecars first: with its sidecar gone, a half-removed capture reads as incomplete.
_SIDECARS = ("capture.json", LONG_SIDECAR)
_STAGING = re.compile(r"^\.attnviz-dump\.(?P<pid>[0-9]+)\.[0-9a-f]{8}\.tmp$")


def is_long_array(name: str) -> bool:
    """Whether ``name`` is one of a long capture's arrays (``q_000.npy``, ``lse_012.npy``)."""
    return _LONG_ARRAY.match(name) is not None


def capture_files(names: Iterable[str]) -> list[str]:
    """attnviz's own capture files among ``names``, sidecars first."""
    own = [name for name in names
           if name in FULL_FILES or name == LONG_SIDECAR or is_long_array(name)]
    return sorted(own, key=lambda name: (name not in _SIDECARS, name))


def check_not_incomplete_long(folder: Path) -> None:
    """Say so when ``folder`` holds a long capture's arrays but no ``long.json``: an
    interrupted ``dump --long`` (the sidecar is written last).

    Raises:
        DumpError: the folder holds ``q_``/``k_``/``lse_`` files and no sidecar.
    """
    if not folder.is_dir() or (folder / LONG_SIDECAR).exists():
        return
    if any(is_long_array(name) for name in list_folder(folder, folder)):
        raise DumpError(f"{folder} holds an incomplete long capture: {LONG_SIDECAR} is "
                        "missing: an interrupted dump --long?", "dump it again")


#: The ``format`` of each sidecar attnviz writes (a file of that name without it is not ours).
_FORMATS = {"capture.json": "attnviz-capture", LONG_SIDECAR: "attnviz-long-capture"}


def _ours(path: Path) -> bool:
    """Whether ``path`` is a sidecar attnviz wrote: a JSON object whose ``format`` is ours."""
    import json

    try:
        if path.is_symlink() or not path.is_file():
            return False
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(data, dict) and data.get("format") == _FORMATS.get(path.name)


def owned_capture_files(folder: Path) -> list[str]:
    """The files of the captures attnviz wrote in ``folder``, sidecars first: a capture's
    files count only when its sidecar is there and is attnviz's (a user's ``q_001.npy`` or
    ``long.json`` of their own is never counted)."""
    names = list_folder(folder, folder)  # the folder as the user named it (".", a link)
    owned: list[str] = []
    if "capture.json" in names and _ours(folder / "capture.json"):
        owned += [name for name in FULL_FILES if name in names]
    if LONG_SIDECAR in names and _ours(folder / LONG_SIDECAR):
        owned += [LONG_SIDECAR] + [name for name in names if is_long_array(name)]
    return capture_files(owned)


def remove_other_captures(folder: Path, keep: Iterable[str],
                          owned: Iterable[str] | None = None) -> list[str]:
    """Remove the capture files attnviz wrote in ``folder`` (``owned``, by default
    :func:`owned_capture_files` now) that are not in ``keep`` (the files of the capture just
    written), sidecars first; never a link's target, never anything else. Signals are held
    off while it runs. Returns the names removed."""
    kept = set(keep)
    removed: list[str] = []
    with signals_held():
        names = owned_capture_files(folder) if owned is None else capture_files(owned)
        for name in names:
            if name not in kept and remove_file(folder / name, folder):
                removed.append(name)
    return removed


class StagedDump:
    """One dump into the folder ``folder``, written into a hidden folder inside it first.

    :meth:`commit` moves every staged file into ``folder`` (the sidecar last) and removes the
    files of any other capture there (:func:`remove_other_captures`). Leaving the block without
    :meth:`commit` (an error, Ctrl-C, SIGTERM) removes the staged files, and ``folder`` itself
    when this dump made it and it is empty.
    """

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.path = self.folder / f".attnviz-dump.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        self._created: list[Path] = []
        self._done = False

    def __enter__(self) -> StagedDump:
        with signals_held():  # the folders made are known to __exit__ before a signal lands
            ensure_dir(self.folder, created=self._created)
            _remove_stale_staging(self.folder)
            try:
                os.mkdir(self.path)
            except OSError as exc:
                remove_empty_dirs(self._created)
                if is_no_space(exc):
                    raise no_space_error(self.folder) from None
                raise OutputError(f"cannot write into {self.folder}: "
                                  f"{exc.strerror or exc}") from None
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        if self._done:
            return
        with signals_held():
            shutil.rmtree(self.path, ignore_errors=True)
            remove_empty_dirs(self._created)

    def commit(self, sidecar: str = LONG_SIDECAR) -> list[str]:
        """Move the staged files into the folder, ``sidecar`` last, and remove the files of
        any other capture there; returns the names moved.

        Raises:
            OutputError: a folder stands where a file goes (nothing is moved then).
        """
        names = sorted(os.listdir(self.path), key=lambda name: (name == sidecar, name))
        for name in names:
            if (self.folder / name).is_dir() and not (self.folder / name).is_symlink():
                raise OutputError(f"cannot write {self.folder / name}: it is a folder",
                                  "remove it, or choose another folder with -o")
        with signals_held():
            owned = owned_capture_files(self.folder)  # the earlier capture, if attnviz's
            for old in _SIDECARS:  # no sidecar describes the folder while files move
                if old in owned:
                    remove_file(self.folder / old, self.folder)
            for name in names:  # a link in the way is replaced, never followed
                try:
                    os.replace(self.path / name, self.folder / name)
                except OSError as exc:
                    raise OutputError(f"cannot write {self.folder / name}: "
                                      f"{exc.strerror or exc}") from None
            remove_other_captures(self.folder, names, owned)
            os.rmdir(self.path)
            self._done = True
        return names


def _remove_stale_staging(folder: Path) -> None:
    """Remove the staging folders a killed dump (SIGKILL, a power cut) left in ``folder``:
    only ours (the name), only real folders (not links), only of processes that are gone."""
    from attnviz.fileio import _pid_alive

    for name in list_folder(folder, folder):
        match = _STAGING.match(name)
        if match is None or _pid_alive(int(match.group("pid"))):
            continue
        path = folder / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
