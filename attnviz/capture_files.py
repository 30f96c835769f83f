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
#: A staging folder: ``.attnviz-dump.PID.HEX.tmp`` (a dump), ``.attnviz-export.PID.HEX.tmp``
#: (an export's text folder being replaced).
_STAGING = re.compile(r"^\.attnviz-(?:dump|export)\.(?P<pid>[0-9]+)\.[0-9a-f]{8}\.tmp$")
#: The temporary folder of a long capture held in no folder of the caller's (``--long``
#: commands): ``attnviz-long-PID-RANDOM`` in the system's temporary folder.
LONG_TEMP_PREFIX = "attnviz-long-"
_LONG_TEMP = re.compile(r"^attnviz-long-(?P<pid>[0-9]+)-[A-Za-z0-9_]+$")


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


def check_one_capture(folder: Path) -> None:
    """Refuse a folder that holds two captures attnviz wrote, a full one and a long one
    (left by a version that did not replace the other kind, or copied in by hand): which one
    was saved last is not known, so neither is read.

    Raises:
        DumpError: both ``capture.json`` and ``long.json`` are attnviz's sidecars.
    """
    names = list_folder(folder, folder)
    if "capture.json" in names and LONG_SIDECAR in names and _ours(folder / "capture.json") \
            and _ours(folder / LONG_SIDECAR):
        raise DumpError(f"{folder} holds two captures, a full one (capture.json, "
                        f"attention.npy) and a long one ({LONG_SIDECAR}, q_/k_/lse_LLL.npy), "
                        "and which was saved last is not known",
                        "save the capture you want into this folder again (the other one is "
                        "then removed), or move one of them to its own folder")


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


def remove_other_sidecars(folder: Path, keep: str) -> list[str]:
    """Before a capture is written into ``folder``: remove the sidecar attnviz wrote there of
    the other kind (``long.json`` before a full capture is saved, ``capture.json`` before a
    long one), so that while the new files are written no sidecar describes another capture.
    Returns the capture files attnviz owned there before (:func:`owned_capture_files`): pass
    them to :func:`remove_other_captures` once the new capture is complete."""
    with signals_held():
        owned = owned_capture_files(folder)
        for name in _SIDECARS:
            if name != keep and name in owned:
                remove_file(folder / name, folder)
    return owned


class StagedDump:
    """One dump into the folder ``folder``, written into a hidden folder inside it first.

    :meth:`commit` moves every staged file into ``folder`` (the sidecar last) and removes the
    files of any other capture there (:func:`remove_other_captures`). Leaving the block without
    :meth:`commit` (an error, Ctrl-C, SIGTERM) removes the staged files, and ``folder`` itself
    when this dump made it and it is empty.
    """

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.path = self.folder / staging_name("dump")
        self._created: list[Path] = []
        self._done = False

    def __enter__(self) -> StagedDump:
        with signals_held():  # the folders made are known to __exit__ before a signal lands
            ensure_dir(self.folder, created=self._created)
            remove_stale_staging(self.folder)
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


def staging_name(kind: str) -> str:
    """A new staging folder's name, ``.attnviz-KIND.PID.HEX.tmp`` (``kind``: ``dump`` or
    ``export``): the process that owns it is in the name."""
    return f".attnviz-{kind}.{os.getpid()}.{secrets.token_hex(4)}.tmp"


def _stale(pattern: re.Pattern[str], name: str) -> bool:
    """Whether ``name`` matches ``pattern`` and the process named in it is gone."""
    from attnviz.fileio import _pid_alive

    match = pattern.match(name)
    return match is not None and not _pid_alive(int(match.group("pid")))


def _real_dir(path: Path) -> bool:
    import stat

    try:
        info = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_uid == getattr(os, "getuid", lambda: 0)()


def remove_stale_staging(folder: Path) -> None:
    """Remove the staging folders a killed dump or export (SIGKILL, a power cut) left in
    ``folder``: only ours (the name), only real folders (not links), only of processes that
    are gone."""
    for name in list_folder(folder, folder):
        if _stale(_STAGING, name) and _real_dir(folder / name):
            shutil.rmtree(folder / name, ignore_errors=True)


def long_temp_folder() -> Path:
    """A new temporary folder for a long capture, named after this process
    (``attnviz-long-PID-RANDOM``), so that once the process is gone the folder can be told
    stale (:func:`remove_stale_long_folders`)."""
    import tempfile

    return Path(tempfile.mkdtemp(prefix=f"{LONG_TEMP_PREFIX}{os.getpid()}-"))


def remove_stale_long_folders(parent: Path | None = None) -> tuple[int, int]:
    """Remove the temporary long-capture folders (:func:`long_temp_folder`) that processes
    killed before they could remove them (SIGKILL, a power cut) left in ``parent`` (the
    system's temporary folder by default): only ours (the name, this user's), only real
    folders, only of processes that are gone. Returns how many folders and bytes."""
    import tempfile

    parent = Path(tempfile.gettempdir()) if parent is None else parent
    folders = size = 0
    try:
        names = os.listdir(parent)
    except OSError:
        return 0, 0
    for name in names:
        path = parent / name
        if not _stale(_LONG_TEMP, name) or not _real_dir(path):
            continue
        held = 0
        for root, _dirs, files in os.walk(path):
            for file in files:
                try:
                    held += os.lstat(os.path.join(root, file)).st_size
                except OSError:
                    pass
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            folders += 1
            size += held
    return folders, size
