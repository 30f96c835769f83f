"""Reading saved files: regular files only, an array's size checked against its file.

Every loader of something attnviz saved (a full capture, a long capture, a generation) opens
its files here. A FIFO, a device, a socket or a folder standing where a file should be is
refused before anything is read from it (reading a FIFO blocks until a writer comes, a device
never ends), and a ``.npy`` header that claims more data than its file holds is refused
before any memory is taken for it::

    sidecar = json.loads(read_text(folder / "long.json"))
    keys = load_npy(folder / "k_000.npy", mmap=True)

numpy is imported only by :func:`load_npy`.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from attnviz.errors import DumpError

if TYPE_CHECKING:
    import numpy as np

_O_BINARY = getattr(os, "O_BINARY", 0)
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)  # opening a FIFO does not wait for a writer
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "folder"), (stat.S_ISFIFO, "FIFO (named pipe)"),
                       (stat.S_ISSOCK, "socket"), (stat.S_ISCHR, "character device"),
                       (stat.S_ISBLK, "block device")):
        if test(mode):
            return name
    return "special file"


def not_regular(path: Path) -> DumpError:
    """The error for ``path``, which is not a regular file (``mode`` tells what it is)."""
    try:
        kind = _kind(os.stat(path).st_mode)
    except OSError:
        kind = "special file"
    return DumpError(f"{path} is a {kind}, not a regular file: attnviz reads only the "
                     "files it wrote", "replace it with the file that was saved there, or "
                     "save the capture again")


def check_regular(path: Path) -> None:
    """Refuse ``path`` when it exists (links followed) and is not a regular file.

    Raises:
        DumpError: a FIFO, device, socket or folder.
    """
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return  # missing or unreachable: the caller's open says so in its own words
    if not stat.S_ISREG(mode):
        raise not_regular(path)


def open_regular(path: Path) -> int:
    """A file descriptor for reading ``path``, which must be a regular file (links are
    followed). Opened without waiting, so a FIFO is refused rather than waited on.

    Raises:
        OSError: as :func:`os.open` (``FileNotFoundError`` for a missing file).
        DumpError: not a regular file.
    """
    fd = os.open(path, os.O_RDONLY | _O_NONBLOCK | _O_CLOEXEC | _O_BINARY)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise not_regular(path)
        if _O_NONBLOCK:
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_text(path: Path) -> str:
    """The UTF-8 text of the regular file ``path``.

    Raises:
        OSError: the file cannot be opened or read. UnicodeDecodeError: not UTF-8.
        DumpError: not a regular file.
    """
    with os.fdopen(open_regular(path), "rb") as handle:
        return handle.read().decode("utf-8")


def _memory() -> int | None:
    """This machine's physical memory in bytes, where the system says."""
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, ValueError, OSError):
        return None


def _size(size: int) -> str:
    for unit, step in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= step:
            return f"{size / step:.1f} {unit}"
    return f"{size} bytes"


def load_npy(path: Path, *, mmap: bool, hint: str) -> np.ndarray:
    """Read the ``.npy`` file ``path`` (memory-mapped with ``mmap``), numbers only.

    The header's shape and type must fit in the file (a lying header claiming terabytes is
    refused, not allocated), and an array read whole must fit in this machine's memory.

    Raises:
        DumpError: missing, not a regular file, not a ``.npy`` file, a header that does not
            fit its file, Python objects, or too big to read whole (``hint`` is the fix).
    """
    import numpy as np
    from numpy.lib import format as npy

    try:
        fd = open_regular(path)
    except OSError as exc:
        raise DumpError(f"cannot read {path}: {exc.strerror or exc}", hint) from None
    with os.fdopen(fd, "rb") as handle:
        try:
            version = npy.read_magic(handle)
            if version == (1, 0):
                shape, fortran, dtype = npy.read_array_header_1_0(handle)
            elif version == (2, 0):
                shape, fortran, dtype = npy.read_array_header_2_0(handle)
            else:
                raise ValueError(f"npy format version {version[0]}.{version[1]} is not read "
                                 "here")
        except (OSError, ValueError, EOFError, SyntaxError) as exc:
            raise DumpError(f"cannot read {path}: {exc}", hint) from None
        if dtype.hasobject:
            raise DumpError(f"cannot read {path}: it holds Python objects, not numbers", hint)
        count = 1
        for extent in shape:
            count *= int(extent)
        need = count * dtype.itemsize
        offset = handle.tell()
        held = os.fstat(handle.fileno()).st_size - offset
        if held < need:
            raise DumpError(f"cannot read {path}: it is truncated or its header is wrong: "
                            "the header says "
                            f"{dtype} {tuple(shape)} ({_size(need)}), the file holds "
                            f"{_size(max(held, 0))}", hint)
        order: Literal["F", "C"] = "F" if fortran else "C"
        memory: int | None = None
        if count == 0:
            return np.zeros(shape, dtype=dtype, order=order)
        try:
            if mmap:
                return np.memmap(handle, dtype=dtype, mode="r", offset=offset, shape=shape,
                                 order=order)
            memory = _memory()
            if memory is not None and need > memory:
                raise MemoryError
            data = np.fromfile(handle, dtype=dtype, count=count)
        except MemoryError:
            raise DumpError(f"{path} holds {_size(need)}, more than this machine's memory "
                            f"can hold at once" + (f" ({_size(memory)})" if memory else ""),
                            "read it memory-mapped (mmap=True), as the command line does"
                            ) from None
        except (OSError, ValueError) as exc:
            raise DumpError(f"cannot read {path}: {exc}", hint) from None
        if data.size != count:
            raise DumpError(f"{path} is truncated: {data.size} of {count} values", hint)
        with contextlib.suppress(ValueError):
            return data.reshape(shape, order=order)
        raise DumpError(f"cannot read {path}: its shape {tuple(shape)} does not fit", hint)
