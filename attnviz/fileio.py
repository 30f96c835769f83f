"""Writing files safely: atomically, inside a chosen folder, with names valid everywhere."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import tempfile
import unicodedata
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

from attnviz.errors import OutputError

# Names Windows refuses whatever the extension.
_WINDOWS_RESERVED = {
    "con", "prn", "aux", "nul",
    *(f"com{i}" for i in range(10)),
    *(f"lpt{i}" for i in range(10)),
}  # fmt: skip


def _describe_os_error(exc: OSError, path: Path) -> OutputError:
    if exc.errno == errno.ENOSPC:
        return OutputError(f"no space left on the device while writing {path}",
                           "free some disk space or choose another output folder with -o")
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return OutputError(f"cannot write {path}: permission denied",
                           "choose a writable output location with -o")
    if exc.errno == errno.ENOTDIR or exc.errno == errno.EEXIST:
        return OutputError(f"cannot write {path}: a file stands where a folder is needed",
                           "choose another output location with -o")
    if exc.errno == errno.EISDIR:
        return OutputError(f"cannot write {path}: it is a folder",
                           "give a file name, e.g. -o attention.png")
    if exc.errno == errno.ENAMETOOLONG:
        return OutputError(f"cannot write {path}: the file name is too long",
                           "choose a shorter output name with -o")
    return OutputError(f"cannot write {path}: {exc.strerror or exc}")


def ensure_dir(path: Path) -> Path:
    """Create ``path`` (and parents) as a folder, with an :class:`OutputError` on failure."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise OutputError(f"cannot use {path} as a folder: a file with that name exists",
                          "choose another output folder with -o") from None
    except OSError as exc:
        raise _describe_os_error(exc, path) from None
    return path


@contextlib.contextmanager
def atomic_path(target: Path | str) -> Iterator[Path]:
    """Yield a temporary path in the target's folder; rename it onto ``target`` on success.

    The temporary file is removed if the body raises (including ``KeyboardInterrupt``), so an
    interrupted write never leaves a half-written ``target``. OS errors become
    :class:`OutputError` with a message that says what to do.
    """
    target = Path(target)
    folder = target.parent if str(target.parent) else Path(".")
    if folder.exists() and not folder.is_dir():
        raise OutputError(f"cannot write {target}: {folder} is a file, not a folder",
                          "choose another output location with -o")
    if target.is_dir():
        raise OutputError(f"cannot write {target}: it is a folder",
                          "give a file name, e.g. -o attention.png")
    ensure_dir(folder)
    try:
        fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name[:80]}.", suffix=".tmp", dir=folder)
    except OSError as exc:
        raise _describe_os_error(exc, target) from None
    os.close(fd)
    tmp = Path(tmp_name)
    # mkstemp creates 0600 files; give the result the permissions a normal file would get.
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)
    try:
        yield tmp
        os.replace(tmp, target)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise _describe_os_error(exc, target) from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write(target: Path | str, write: Callable[[IO[bytes]], object]) -> Path:
    """Write ``target`` atomically by calling ``write(binary_file)`` on a temporary file."""
    target = Path(target)
    with atomic_path(target) as tmp:
        try:
            with open(tmp, "wb") as handle:
                write(handle)
                handle.flush()
                os.fsync(handle.fileno())
        except OSError as exc:
            raise _describe_os_error(exc, target) from None
    return target


def atomic_write_text(target: Path | str, text: str) -> Path:
    """Write UTF-8 text atomically."""
    return atomic_write(target, lambda handle: handle.write(text.encode("utf-8")))


def slugify(text: str, max_length: int = 40) -> str:
    """A file-name-safe slug of ``text``: ASCII letters, digits, ``-`` and ``_`` only.

    The result is never empty, never a Windows reserved name, and at most ``max_length``
    characters, so it is valid on Linux, macOS and Windows.
    """
    normal = unicodedata.normalize("NFKD", text)
    ascii_text = normal.encode("ascii", "ignore").decode("ascii").lower()
    slug = re.sub(r"[^a-z0-9]+", "-", ascii_text).strip("-")[:max_length].strip("-")
    if not slug:
        slug = "text"
    if slug.split(".")[0] in _WINDOWS_RESERVED:
        slug = f"{slug}-"
    return slug


def short_hash(*parts: str, length: int = 8) -> str:
    """A short, stable hex digest of the given strings."""
    digest = hashlib.sha256("\x1f".join(parts).encode("utf-8", "surrogatepass")).hexdigest()
    return digest[:length]


def safe_child(root: Path, name: str) -> Path:
    """``root / name``, refusing anything that would resolve outside ``root``."""
    candidate = (root / name).resolve()
    if candidate.parent != root.resolve():
        raise OutputError(f"refusing to write {name!r} outside {root}")
    return root / name
