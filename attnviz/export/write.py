"""Export: a text folder's files, export.json, resume, and the output folder's lock.

Names of every file an export writes, reading and writing them without following links,
the manifest that says whether a folder is complete (and with which settings), the staging
folder that keeps an earlier export whole until its replacement is complete (every exporter:
local, Ray's workers, ``--long``), and the lock that lets one export at a time write to
OUT_DIR (the local and the Ray engine both hold it).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from attnviz._version import __version__

if TYPE_CHECKING:
    from attnviz.capture import Capture

MANIFEST = "export.json"
TOPK_CSV = "topk.csv"
HEADS_DIR = "heads"
LAYERS_DIR = "layers"
FORMATS = ("png", "svg", "pdf")
LOCK_NAME = ".attnviz-export.lock"  # held (flock) while an export writes to OUT_DIR
MANIFEST_FORMAT = "attnviz-export"
CAPTURE_FILES = ("attention.npy", "capture.json")  # the capture, as Capture.save writes it
LONG_FILES = ("heads.csv", "sinks.json")  # written by export --long beside topk.csv


# --------------------------------------------------------------------------- names
def head_file(layer: int, head: int, fmt: str, digits: int = 2) -> str:
    """Relative path of a head's figure, e.g. ``heads/L03_H11.png``."""
    return f"{HEADS_DIR}/L{layer:0{digits}d}_H{head:0{digits}d}.{fmt}"


def layer_file(layer: int, fmt: str, digits: int = 2) -> str:
    """Relative path of a layer's grid, e.g. ``layers/L03.png``."""
    return f"{LAYERS_DIR}/L{layer:0{digits}d}.{fmt}"


def overview_file(fmt: str) -> str:
    """Relative path of the model overview."""
    return f"overview.{fmt}"


def digits(capture: Capture) -> int:
    """Digits of the layer and head numbers in file names (at least 2)."""
    return max(2, len(str(max(capture.num_layers, capture.num_heads) - 1)))


def text_files(capture: Capture, fmt: str, figures: Collection[str]) -> list[str]:
    """Every file of a complete text folder but export.json, relative to the folder."""
    files = [*CAPTURE_FILES, TOPK_CSV]
    width = digits(capture)
    if "heads" in figures:
        files += [head_file(layer, head, fmt, width)
                  for layer in capture.layers for head in capture.heads]
    if "layers" in figures:
        files += [layer_file(layer, fmt, width) for layer in capture.layers]
    if "overview" in figures:
        files.append(overview_file(fmt))
    return files


# --------------------------------------------------------------------------- files
def is_file(path: Path) -> bool:
    """A regular file (a link standing there is not one: it is replaced, never followed)."""
    import stat

    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def is_dir(path: Path) -> bool:
    """A real folder (not a link to one)."""
    import stat

    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def read_json(path: Path) -> dict[str, Any] | None:
    """A JSON object from a regular file; ``None`` for a link, a missing or broken file."""
    if not is_file(path):  # a link is not ours: never read through it
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


def write_json(path: Path, data: Any) -> None:
    """Write ``data`` as indented JSON, atomically."""
    from attnviz.fileio import atomic_write_text

    atomic_write_text(path, json.dumps(data, ensure_ascii=False, indent=1))


def clean_temporaries(folder: Path, root: Path | None = None) -> None:
    """Remove temporary files an interrupted run (killed mid-write) left behind: only our own
    names (``.NAME.PID.RANDOM.tmp`` of a process that is gone), never through a link."""
    from attnviz.fileio import clean_temporaries as clean

    root = folder.parent if root is None else root
    for sub in (folder, folder / HEADS_DIR, folder / LAYERS_DIR):
        clean(sub, root)


def check_folder(folder: Path, out_dir: Path) -> None:
    """Refuse a text folder (or its ``heads/``, ``layers/``) that is a symbolic link.

    Raises:
        LinkError: a link; the text fails, nothing is written through it.
    """
    from attnviz.fileio import check_folder as check

    if check(folder, out_dir):
        for sub in (HEADS_DIR, LAYERS_DIR):
            check(folder / sub, out_dir)


def output_files(folder: Path, out_dir: Path) -> list[str]:
    """The files of an earlier export in ``folder`` (only names this package writes, so
    nothing else in the folder is ever touched), relative to it; export.json first."""
    from attnviz.fileio import list_folder

    names = [MANIFEST, TOPK_CSV, *CAPTURE_FILES, *LONG_FILES,
             *(overview_file(fmt) for fmt in FORMATS)]
    for sub in (HEADS_DIR, LAYERS_DIR):  # listed without following links (see fileio)
        names += [f"{sub}/{name}" for name in list_folder(folder / sub, out_dir)
                  if name.rsplit(".", 1)[-1] in FORMATS and name.startswith("L")]
    return [name for name in names if is_file(folder / name)]


# --------------------------------------------------------------------------- replacing
def staging_folder(folder: Path, out_dir: Path, resume: bool) -> Path:
    """Where a text's files are written: ``folder`` itself when it holds no earlier export
    or the one being resumed (same text and settings), else a hidden staging folder inside
    it (``.attnviz-export.PID.HEX.tmp``): the earlier export stays whole until the new one is
    complete (:func:`replace_outputs`), so an interrupted ``--force`` loses nothing. Staging
    folders of killed runs are removed first."""
    from attnviz.capture_files import remove_stale_staging, staging_name
    from attnviz.fileio import signals_held

    if not is_dir(folder):
        return folder
    remove_stale_staging(folder)
    if resume or not output_files(folder, out_dir):
        return folder
    staging = folder / staging_name("export")
    with signals_held():  # made and known together: an interruption never leaves it behind
        staging.mkdir()
    return staging


def drop_staging(folder: Path, work: Path) -> None:
    """Remove the staging folder ``work`` of ``folder`` (nothing when it is ``folder``)."""
    import shutil

    if work != folder and is_dir(work):
        shutil.rmtree(work, ignore_errors=True)


def replace_outputs(folder: Path, work: Path, files: Collection[str], out_dir: Path) -> None:
    """Move a complete text's ``files`` from its staging folder ``work`` into ``folder``,
    removing the earlier export's files that are not among them; nothing when ``work`` is
    ``folder``. Call it with signals held, then write the new export.json.

    The old export.json goes first: while files move, the folder never claims to be complete.

    Raises:
        OutputError: a file cannot be moved into place.
    """
    import shutil

    from attnviz.errors import OutputError
    from attnviz.fileio import remove_file

    if work == folder:
        return
    check_folder(folder, out_dir)  # LinkError: nothing is moved through a link
    keep = set(files)
    for name in output_files(folder, out_dir):
        if name == MANIFEST or name not in keep:
            remove_file(folder / name, out_dir)
    for name in sorted(files):  # a link standing there is replaced, never followed
        if "/" in name and not is_dir(folder / name.split("/", 1)[0]):
            try:
                os.mkdir(folder / name.split("/", 1)[0])
            except OSError as exc:
                raise OutputError(f"cannot write {folder / name}: {exc.strerror or exc}"
                                  ) from None
        try:
            os.replace(work / name, folder / name)
        except OSError as exc:
            raise OutputError(f"cannot write {folder / name}: {exc.strerror or exc}") from None
    shutil.rmtree(work, ignore_errors=True)


def finished_export(folder: Path, settings: dict[str, Any], text: str, pair: str | None,
                    force: bool) -> dict[str, Any] | None:
    """The manifest of ``folder`` when an earlier run exported this text there completely
    with these settings (the text is skipped), else ``None`` (always with ``force``)."""
    if force:
        return None
    manifest = read_json(folder / MANIFEST)
    if manifest is not None and same_export(manifest, settings, text, pair) \
            and is_complete(manifest, folder):
        return manifest
    return None


# --------------------------------------------------------------------------- manifests
def new_manifest(settings: dict[str, Any], origin: str, ident: str | None, text: str,
                 pair: str | None, capture: Capture) -> dict[str, Any]:
    """The export.json of a text folder being written (``"complete": false``, no files)."""
    return {
        "format": MANIFEST_FORMAT, "format_version": 1, "attnviz": __version__,
        "complete": False, "settings": settings, "origin": origin, "id": ident,
        "text": text, "pair": pair, "model": capture.model,
        "num_tokens": capture.num_tokens, "layers": list(capture.layers),
        "heads": list(capture.heads), "files": [],
    }


def same_export(manifest: dict[str, Any] | None, settings: dict[str, Any], text: str,
                pair: str | None) -> bool:
    """Whether ``manifest`` is of this text, exported with these settings (so it resumes)."""
    return (manifest is not None and manifest.get("format") == MANIFEST_FORMAT
            and manifest.get("settings") == settings and manifest.get("text") == text
            and manifest.get("pair") == pair)


def is_complete(manifest: dict[str, Any], folder: Path) -> bool:
    """Whether ``manifest`` says its folder is complete and every file it lists is there."""
    return bool(manifest.get("complete")) and all(is_file(folder / f)
                                                  for f in manifest.get("files", []))


# --------------------------------------------------------------------------- the lock
@contextlib.contextmanager
def export_lock(out_dir: Path) -> Iterator[None]:
    """Hold OUT_DIR's export lock (created if needed) while the block runs.

    A second export into the folder fails at once with an :class:`OutputError` naming the
    first one's process, and a folder created here is removed again if the block ends with
    nothing written in it.
    """
    from attnviz.fileio import FolderLock, ensure_dir, remove_empty_dirs

    created: list[Path] = []
    ensure_dir(out_dir, created=created)
    lock = FolderLock(out_dir, LOCK_NAME, "another export")
    try:
        lock.acquire()
        yield
    finally:
        lock.release()
        remove_empty_dirs(created)  # only folders left empty: a failed start
