"""Reading user input safely and naming files: bounded reads, portable slugs, stable hashes.

The lowest layer under :mod:`attnviz.fileio` (which re-exports these names): an endless device
or a huge line never exhausts memory, and a slug is a valid file name on Linux, macOS and
Windows.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import stat
import unicodedata
from pathlib import Path
from typing import IO

from attnviz.errors import InputError, OutputError

# Names Windows refuses whatever the extension.
_WINDOWS_RESERVED = {
    "con", "prn", "aux", "nul",
    *(f"com{i}" for i in range(10)),
    *(f"lpt{i}" for i in range(10)),
}  # fmt: skip


def _shorten(path: Path | str, limit: int = 120) -> str:
    text = str(path)
    return text if len(text) <= limit else f"{text[:limit // 2]}...{text[-limit // 3:]}"


# --------------------------------------------------------------------------- reading input
INPUT_LINE_LIMIT = 1 << 20  # bytes in one line of an --input file (1 MiB)


def open_input(path: Path | str, what: str = "input file") -> IO[bytes]:
    """Open an input file for reading: regular files, pipes and devices (``<(cmd)``,
    ``/dev/stdin``) are fine; a missing path or a folder is a clear :class:`InputError`.

    Read it with :func:`read_line` (bounded lines), so an endless device cannot exhaust memory.
    """
    path = Path(path)
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise InputError(f"{what} {path} does not exist",
                         "give a text file with one text per line, or JSONL") from None
    except OSError as exc:
        if exc.errno == errno.ENAMETOOLONG:
            raise InputError(f"{what} {_shorten(path)}: the name is too long") from None
        raise InputError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    if stat.S_ISDIR(info.st_mode):
        raise InputError(f"{what} {path} is a folder",
                         "give a text file with one text per line, or JSONL")
    try:
        return open(path, "rb")  # noqa: SIM115 - the caller closes it
    except OSError as exc:
        raise InputError(f"cannot read {what} {path}: {exc.strerror or exc}") from None


def read_line(handle: IO[bytes], limit: int = INPUT_LINE_LIMIT) -> bytes | None:
    """The next line of ``handle`` (with its newline), ``None`` at the end.

    Raises:
        ValueError: the line is longer than ``limit`` bytes; the rest of it is not read.
    """
    line = handle.readline(limit + 1)
    if not line:
        return None
    if len(line) > limit and not line.endswith(b"\n"):
        raise ValueError(f"a line is longer than {limit} bytes")
    return line


INPUT_SIZE_LIMIT = 1 << 30  # bytes of an --input file read whole (1 GiB)


def read_input_text(path: Path | str, what: str = "input file", *,
                    line_limit: int = INPUT_LINE_LIMIT, size_limit: int = INPUT_SIZE_LIMIT
                    ) -> str:
    """The whole of a UTF-8 input file, read in bounded lines (see :func:`open_input`).

    Raises:
        InputError: missing, a folder, a line over ``line_limit`` bytes, or more than
            ``size_limit`` bytes in all (an endless device such as ``/dev/zero`` stops at its
            first line).
        UnicodeDecodeError: the bytes are not UTF-8 (the caller says where).
    """
    parts: list[bytes] = []
    total = 0
    with open_input(path, what) as handle:
        number = 0
        while True:
            try:
                line = read_line(handle, line_limit)
            except ValueError:
                raise InputError(f"line {number + 1} of {what} {path} is longer than the limit "
                                 f"of {line_limit >> 20} MiB",
                                 "give one text per line") from None
            except OSError as exc:
                raise InputError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
            if line is None:
                break
            number += 1
            total += len(line)
            if total > size_limit:
                raise InputError(f"{what} {path} is larger than the limit of "
                                 f"{size_limit >> 20} MiB", "split it into smaller files")
            parts.append(line)
    return b"".join(parts).decode("utf-8")


# --------------------------------------------------------------------------- names
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
