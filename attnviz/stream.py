"""Write a capture to disk layer by layer: a memory-mapped ``.npy`` first, the JSON sidecar last.

A capture of every layer of a long input can be bigger than memory: 32 layers x 32 heads x
4096 x 4096 tokens is 64 GiB in float32 (32 GiB in float16). :class:`CaptureWriter` creates
``attention.npy`` as a memory map (``numpy.lib.format.open_memmap``) the model writes into one
layer at a time, as each layer finishes (see ``allocate`` in
:meth:`attnviz.models.hf.HFSource.capture`), so only one layer is ever held in memory. The file
is reserved at full size up front (a full disk is reported before the model runs), written
under a temporary name and renamed into place; the sidecar is written last, so a folder with a
sidecar always holds a complete capture. Read it back slice by slice with
``load_capture(path, mmap=True)``.

Only numpy and the standard library are imported here.
"""

from __future__ import annotations

import contextlib
import errno
import inspect
import json
import os
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, cast

import numpy as np

import attnviz.diskfull as diskfull
from attnviz.capture import _paths_for_save
from attnviz.capture_files import FULL_FILES, remove_other_captures
from attnviz.fileio import atomic_path

if TYPE_CHECKING:
    from attnviz.capture import Capture
    from attnviz.models import AttentionSource


def _reserve(path: Path) -> None:
    """Allocate the file's blocks now: writing a sparse memory map on a full disk kills the
    process with SIGBUS instead of raising an error."""
    fallocate = getattr(os, "posix_fallocate", None)
    if fallocate is None:  # macOS, Windows: the write itself reports a full disk
        return
    with open(path, "r+b") as handle:
        try:
            fallocate(handle.fileno(), 0, os.fstat(handle.fileno()).st_size)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise


class _Abandoned(Exception):  # noqa: N818 - a signal to the temporary-file context
    """The writer was closed without :meth:`CaptureWriter.commit`."""


class CaptureWriter:
    """Writes one capture: ``attention.npy`` through a memory map, then ``capture.json``.

    Use it as a context manager; if the block raises (or :meth:`commit` is never called), the
    temporary weights file is removed and nothing at the destination changes::

        with CaptureWriter("cat/", float16=True) as writer:
            capture = source.capture(text, allocate=writer.allocate)
            writer.commit(capture)

    Args:
        path: a folder (gets ``attention.npy`` + ``capture.json``) or a ``.npy`` path (gets a
            ``.json`` sidecar beside it), as in :meth:`attnviz.capture.Capture.save`.
        float16: store the weights as float16 (half the size; error at most ~2.4e-4).
    """

    def __init__(self, path: Path | str, *, float16: bool = False) -> None:
        self.npy_path, self.json_path = _paths_for_save(Path(path))
        self.dtype = np.dtype(np.float16 if float16 else np.float32)
        self._stack = contextlib.ExitStack()
        self._array: np.memmap | None = None
        self._committed = False
        self._made_folders: list[Path] = []  # created for this capture, removed on failure
        self._tmp_path = self.npy_path

    def __enter__(self) -> CaptureWriter:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> bool | None:
        if self._committed:
            return None
        self._array = None  # unmap before the temporary file is removed
        try:
            if kind is None:  # left without commit(): abandon, never publish half a capture
                with contextlib.suppress(_Abandoned):
                    self._stack.__exit__(_Abandoned, _Abandoned(), None)
                return None
            return self._stack.__exit__(kind, error, trace)
        finally:
            for folder in self._made_folders:  # deepest first; only if still empty
                with contextlib.suppress(OSError):
                    folder.rmdir()

    @property
    def array(self) -> np.memmap:
        """The memory-mapped ``[layer, head, query, key]`` weights being written."""
        if self._array is None:
            raise RuntimeError("call allocate(shape) first")
        return self._array

    def allocate(self, shape: tuple[int, ...]) -> np.ndarray:
        """Create the weights file for ``shape`` ``[layer, head, query, key]``; returns its map.

        Raises:
            OutputError: the destination cannot be written or the disk is too small (raised
                when the ``with`` block exits, with the temporary file removed).
        """
        if self._array is not None:
            raise RuntimeError("allocate() was already called for this capture")
        folder = self.npy_path.parent
        while not folder.exists() and folder != folder.parent:
            self._made_folders.append(folder)
            folder = folder.parent
        tmp = self._stack.enter_context(atomic_path(self.npy_path))
        self._tmp_path = tmp
        array = np.lib.format.open_memmap(tmp, mode="w+", dtype=self.dtype,
                                          shape=tuple(int(n) for n in shape))
        _reserve(tmp)
        self._array = array
        return array

    def write_layer(self, index: int, block: np.ndarray) -> None:
        """Write the ``[head, query, key]`` weights at position ``index`` of the layer axis."""
        self.array[index] = block

    def copy_from(self, capture: Capture) -> None:
        """Allocate and fill the file from a capture already in memory, one layer at a time."""
        self.allocate(tuple(capture.weights.shape))
        for index in range(capture.weights.shape[0]):
            self.write_layer(index, np.asarray(capture.weights[index], dtype=np.float32))

    def commit(self, capture: Capture) -> Path:
        """Move the weights into place, then write the sidecar; returns the ``.npy`` path.

        ``capture`` describes the weights (tokens, layers, heads, ...). If its weights are this
        writer's memory map, they are replaced by a read-only map of the final file.
        """
        array = self.array
        if tuple(capture.weights.shape) != tuple(array.shape):
            raise ValueError(f"the capture has shape {tuple(capture.weights.shape)} but "
                             f"{tuple(array.shape)} was allocated")
        sidecar = capture.sidecar()
        sidecar["dtype"] = str(self.dtype)
        sidecar["weights_file"] = self.npy_path.name
        reopen = capture.weights is array
        array.flush()
        if reopen:
            capture.weights = np.empty((0, 0, 0, 0), dtype=self.dtype)
        del array
        self._array = None  # the last reference: the file is unmapped before it is renamed
        text = json.dumps(sidecar, ensure_ascii=False, indent=1).encode("utf-8")
        moved = False
        try:
            with atomic_path(self.json_path) as json_tmp:
                with open(json_tmp, "wb") as handle:
                    diskfull.write_chunk(handle, text)  # every output byte goes there
                    handle.flush()
                    os.fsync(handle.fileno())
                with open(self._tmp_path, "rb+") as handle:
                    os.fsync(handle.fileno())
                # An old sidecar beside the new weights would describe the wrong data.
                with contextlib.suppress(FileNotFoundError):
                    self.json_path.unlink()
                self._stack.close()  # renames the temporary weights onto attention.npy
                moved = True
            # Leaving the block renames the sidecar into place: the capture is complete.
        except BaseException:
            if moved:  # weights without a sidecar are not a capture
                with contextlib.suppress(OSError):
                    self.npy_path.unlink()
            raise
        self._committed = True
        if (self.npy_path.name, self.json_path.name) == FULL_FILES:  # the folder's capture
            remove_other_captures(self.npy_path.parent, FULL_FILES)
        if reopen:
            capture.weights = np.load(self.npy_path, mmap_mode="r", allow_pickle=False)
        return self.npy_path


def write_capture(capture: Capture, path: Path | str, *, float16: bool = False) -> Path:
    """Save a capture layer by layer (a memory-mapped capture is never read whole).

    The result is the same as :meth:`~attnviz.capture.Capture.save`, without holding a full
    float16 copy in memory. Returns the path of the ``.npy`` file.
    """
    with CaptureWriter(path, float16=float16) as writer:
        writer.copy_from(capture)
        return writer.commit(capture)


def _takes_allocate(source: Any) -> bool:
    try:
        return "allocate" in inspect.signature(source.capture).parameters
    except (TypeError, ValueError):
        return False


def stream_capture(source: AttentionSource, text: str, path: Path | str, *,
                   pair: str | None = None, layers: list[int] | None = None,
                   heads: list[int] | None = None, max_tokens: int | None = None,
                   truncate: bool = True, float16: bool = False,
                   measure: str = "weights") -> tuple[Path, Capture]:
    """Run a model and write its capture straight to disk, one layer at a time.

    With a Hugging Face source each selected layer goes from the model into the memory-mapped
    file as soon as it has run, so a capture bigger than memory can be written; other sources
    capture in memory first and are then written layer by layer.

    Args:
        source: a loaded model (:func:`attnviz.models.load_source`).
        text: the input text.
        path: a folder or a ``.npy`` path, as in :meth:`~attnviz.capture.Capture.save`.
        pair, layers, heads, max_tokens, truncate: as in the source's ``capture``.
        float16: store the weights as float16.
        measure: ``weights`` or a measure of :mod:`attnviz.measures` (the sidecar names it).

    Returns:
        The ``.npy`` path and the capture, whose weights are a read-only memory map of the
        written file (Hugging Face sources) or the in-memory array.
    """
    with CaptureWriter(path, float16=float16) as writer:
        options: dict[str, Any] = {"layers": layers, "heads": heads, "max_tokens": max_tokens,
                                   "truncate": truncate}
        if measure != "weights":
            options["measure"] = measure
        if _takes_allocate(source):
            capture_into = cast(Callable[..., "Capture"], source.capture)
            capture = capture_into(text, pair, allocate=writer.allocate, **options)
        else:
            capture = source.capture(text, pair, **options)
            writer.copy_from(capture)
        npy_path = writer.commit(capture)
    return npy_path, capture
