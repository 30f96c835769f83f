"""A full disk, said one way everywhere: what was being written (as the user knows it), that
the disk is full, and what to do.

Every output file attnviz writes goes through :class:`OutputFile` (see
:func:`attnviz.fileio.atomic_open`), whose :func:`write_chunk` is the one place bytes reach a
file: numpy, matplotlib and the JSON writers all call it, so an ``ENOSPC`` from the system
keeps its error number (``numpy.save`` on a real file calls ``fwrite`` itself and reports
only "8008 requested and 7136 written"). :func:`no_space_error` words the message:

* an output folder's file names the path the user chose (a dump's hidden staging folder is
  left out: ``book/q_000.npy``, not ``book/.attnviz-dump.123.ab12cd34.tmp/q_000.npy``);
* a long capture's temporary folder (``$TMPDIR/attnviz-long-...``) says so and names
  ``TMPDIR``;
* a server answers 507 with :attr:`~attnviz.errors.NoSpaceError.public`, no path at all.

Only the standard library and :mod:`attnviz.errors` are imported here.
"""

from __future__ import annotations

import errno
import io
import os
import re
import tempfile
from pathlib import Path
from typing import IO, Any

from attnviz.errors import NoSpaceError

#: The system's "no space" errors: the disk is full, or the user's quota is.
NO_SPACE_ERRNOS = frozenset(e for e in (errno.ENOSPC, getattr(errno, "EDQUOT", None))
                            if e is not None)
# What numpy's ``tofile``/``save`` raises on a short write (no error number).
_SHORT_WRITE = re.compile(r"\d+ requested and \d+ written")
# Hidden folders and files of attnviz's own between the user's folder and a file.
_HIDDEN = re.compile(r"^\..+\.[0-9]+\.[0-9a-f]{8}\.tmp$")
_LONG_TEMP = "attnviz-long-"


def is_no_space(exc: BaseException) -> bool:
    """Whether ``exc`` says the disk (or a quota) is full."""
    if not isinstance(exc, OSError):
        return False
    if exc.errno in NO_SPACE_ERRNOS:
        return True
    return exc.errno is None and bool(_SHORT_WRITE.search(str(exc)))


def shown_path(path: Path | str) -> Path:
    """``path`` as the user knows it: attnviz's hidden staging folders and temporary names
    left out (``out/.attnviz-dump.12.ab12cd34.tmp/q_000.npy`` -> ``out/q_000.npy``;
    ``out/.a.png.12.ab12cd34.tmp`` -> ``out/a.png``)."""
    parts = Path(path).parts
    kept = [part for part in parts[:-1] if not _HIDDEN.match(part)]
    last = parts[-1] if parts else ""
    if _HIDDEN.match(last):
        last = last[1:].rsplit(".", 3)[0]  # ".a.png.12.ab12cd34.tmp" -> "a.png"
    return Path(*kept, last) if (kept or last) else Path(path)


def _long_temp_root(path: Path) -> Path | None:
    """The temporary folder holding ``path`` when it is inside a long capture's own
    temporary folder (``$TMPDIR/attnviz-long-...``), else ``None``."""
    for parent in (path, *path.parents):
        if parent.name.startswith(_LONG_TEMP):
            return parent.parent
    return None


def no_space_error(path: Path | str) -> NoSpaceError:
    """The message for a full disk while writing ``path``."""
    path = Path(path)
    temp = _long_temp_root(path)
    if temp is not None:
        return NoSpaceError(
            f"no space left on the device holding the temporary folder {temp}, where the "
            "long capture's arrays go: the disk is full",
            "free some disk space there, point TMPDIR at a folder on a disk with room "
            f"(now {tempfile.gettempdir()}), or shorten the input (--max-tokens N)")
    return NoSpaceError(f"no space left on the device while writing {shown_path(path)}: the "
                        "disk is full",
                        "free some disk space or choose another output folder with -o")


def write_chunk(handle: IO[bytes], data: Any) -> int:
    """Write ``data`` (bytes, a memoryview) to ``handle``: every byte of every output file
    attnviz writes passes here."""
    return int(handle.write(data) or 0)


class OutputFile(io.BufferedIOBase):
    """A binary output file whose writes go through :func:`write_chunk`.

    Not an ``io.BufferedWriter``, so numpy writes it with ``write`` (in chunks) rather than
    with ``fwrite`` on the descriptor, which loses the error number of a full disk; and no
    ``fileno``, so other writers (Pillow) also call ``write``. Closing it leaves the file open:
    its owner closes that.
    """

    def __init__(self, raw: IO[bytes]) -> None:
        super().__init__()
        self._raw = raw

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return bool(self._raw.seekable())

    def write(self, data: Any, /) -> int:
        if self.closed:
            raise ValueError("write to a closed file")
        view = memoryview(data)
        write_chunk(self._raw, view)
        return view.nbytes

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        return int(self._raw.seek(offset, whence))

    def tell(self) -> int:
        return int(self._raw.tell())

    def flush(self) -> None:
        if not self.closed and not self._raw.closed:
            self._raw.flush()
