"""The long capture record: queries, keys and log-sum-exp on disk, exact weights on demand.

A folder holds, per recorded model layer ``L`` (three digits), ``q_L.npy`` ``[head, T, dim]``,
``k_L.npy`` ``[kv_head, T, dim]`` (float32, float16, or bfloat16 stored as its uint16 bits)
and ``lse_L.npy`` ``[head, T]`` (float32), and ``long.json``, the sidecar (see
``docs/long.md``). Every read is memory-mapped; every number derived from them is computed in
chunks of query rows (:mod:`attnviz.long.kernels`), so memory grows as ``T x dim``.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, cast

import numpy as np

from attnviz.capture_checks import (  # noqa: F401  (the bounds every record shares, re-exported)
    MAX_BLOCK,
    MAX_TILE,
    MAX_TOPK,
    MIN_BLOCK,
    SINK_THRESHOLD,
    check_block,
    check_head,
    check_k,
    check_layer,
    check_span,
    check_threshold,
    check_tile,
    dense_size_check,
    largest_block,
    seen_counts,
)
from attnviz.errors import DumpError, ModelLoadError, UsageError

if TYPE_CHECKING:
    import torch

    from attnviz.capture import Capture
    from attnviz.long.scan import Summary

FORMAT_NAME = "attnviz-long-capture"
FORMAT_VERSION = 1
SIDECAR = "long.json"
STORAGE_DTYPES = ("float32", "float16", "bfloat16")
#: Values read at a time when a layer's arrays are checked for NaN and infinities.
FINITE_CHUNK = 1 << 22
#: Largest score a layer's queries and keys may make (scores below -1e29 mean masked keys).
MAX_SCORE = 1e28
#: The hint of every damaged-folder error.
_DAMAGED = "the long capture folder is damaged: capture again"


class LongUnsupported(ModelLoadError):
    """The model cannot be captured as queries, keys and log-sum-exp (its attention does not
    go through transformers' attention functions, or adds a bias, softcapping or sinks the
    weights here would miss); capture it the usual way instead."""


def layer_file(kind: str, layer: int) -> str:
    """File name of one layer's ``q``, ``k`` or ``lse`` array."""
    return f"{kind}_{layer:03d}.npy"


def to_storage(tensor: torch.Tensor, dtype: str) -> np.ndarray:
    """A CPU numpy array of ``tensor`` in the storage type (bfloat16 as its uint16 bits)."""
    import torch

    if dtype == "bfloat16":
        return tensor.detach().to("cpu", torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    return tensor.detach().to("cpu", getattr(torch, dtype)).numpy()


def _from_storage(array: np.ndarray, dtype: str) -> torch.Tensor:
    """float32 torch copy of a stored slice."""
    import torch

    data = np.ascontiguousarray(array)
    if dtype == "bfloat16":
        return torch.from_numpy(data.view(np.int16).copy()).view(torch.bfloat16).float()
    return torch.from_numpy(data.astype(np.float32, copy=True))


def _npy_writer(data: np.ndarray) -> Callable[[IO[bytes]], None]:
    def write(handle: IO[bytes]) -> None:
        np.save(handle, data, allow_pickle=False)

    return write


def write_sidecar(folder: Path, sidecar: dict[str, Any]) -> None:
    """Write ``long.json`` atomically (last, so a folder with a sidecar is complete)."""
    from attnviz.fileio import atomic_write_text

    body = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION,
            "axes": {"q": ["head", "token", "dim"], "k": ["kv_head", "token", "dim"],
                     "lse": ["head", "token"]},
            **sidecar}
    atomic_write_text(folder / SIDECAR, json.dumps(body, ensure_ascii=False, indent=1),
                      root=folder)


def check_summary(size: int, block: int | None, k: int) -> int:
    """Check a summary's atlas ``block`` and top ``k``; returns the block (by default the
    finest from 64 up that keeps the grid within 512 x 512 cells).

    Raises:
        UsageError: a block that is not a power of two from 16 to :data:`MAX_BLOCK`, or ``k``
            outside 0 to :data:`MAX_TOPK`.
    """
    from attnviz.long.scan import auto_block

    block = check_block(size, auto_block(size) if block is None else block)
    if not 0 <= int(k) <= MAX_TOPK:
        raise UsageError(f"k must be between 0 and {MAX_TOPK}, got {k}")
    return block


def load_long(folder: str | Path, mmap: bool = True) -> LongCapture:
    """Open a long capture saved by :func:`attnviz.long.capture_long` or
    :meth:`LongCapture.save` (memory-mapped unless ``mmap`` is off).

    Raises:
        DumpError: the folder, its sidecar or its arrays are missing or disagree.
    """
    return LongCapture.open(Path(folder), mmap=mmap)


class LongCapture:
    """Queries, keys and log-sum-exp of one text; exact attention weights on demand.

    Attributes:
        tokens, display_tokens, word_ids, special: one entry per token.
        layers: the model layers recorded. num_layers, num_heads, num_kv_heads: the model's.
        num_tokens: ``T``. causal: whether query ``i`` sees only keys ``<= i``.
        window: the sliding window (keys ``i - window < j <= i``) of the windowed layers, or
            ``None``; ``windows`` gives it per recorded layer.
        scales: per recorded layer, the ``scaling`` the attention function got.
        model, text, pair, meta, folder, dtype: where it came from and where it lives.
        device: where the arithmetic runs (``"cpu"`` by default; any torch device).
        measure, measure_label, rows_sum_to_one: as a full capture's: a long
            capture holds attention weights (the measures of :mod:`attnviz.measures` need the
            full path).
    """

    measure = "weights"
    measure_label = ""
    rows_sum_to_one = True

    def __init__(self, folder: Path, sidecar: dict[str, Any], mmap: bool = True) -> None:
        from attnviz.capture_build import escape_controls
        from attnviz.long.sidecar import read_sidecar

        self.folder = folder
        self._sidecar = sidecar
        checked = read_sidecar(sidecar)  # ValueError: what is wrong with it
        self.model = escape_controls(checked.model)  # titles print it
        self.text = checked.text
        self.pair: str | None = checked.pair
        # Token text reaches terminals and pages: control characters as their escapes.
        self.tokens: list[str] = [escape_controls(t) for t in checked.tokens]
        self.display_tokens: list[str] = [escape_controls(t) for t in checked.display_tokens]
        self.word_ids: list[int | None] = list(checked.word_ids)
        self.special: list[bool] = list(checked.special)
        self.layers: list[int] = list(checked.layers)
        self.num_layers = checked.num_layers
        self.num_heads = checked.num_heads
        self.num_kv_heads = checked.num_kv_heads
        self.head_dim = checked.head_dim
        self.dtype: str = checked.dtype
        self.causal = checked.causal
        self.scales = dict(zip(self.layers, checked.scales))
        self.windows: dict[int, int | None] = dict(zip(self.layers, checked.windows))
        windows = [w for w in self.windows.values() if w is not None]
        self.window: int | None = max(windows) if windows else None
        self.meta: dict[str, Any] = dict(checked.meta or {})
        self.num_tokens = len(self.tokens)
        self.device = "cpu"
        self._mmap = mmap
        self._arrays: dict[tuple[str, int], np.ndarray] = {}
        self._finite: set[int] = set()  # layers whose arrays were checked for NaN and inf
        self._summary: Summary | None = None
        self._cleanup: weakref.finalize | None = None
        self._check()

    # ------------------------------------------------------------------ files
    @classmethod
    def open(cls, folder: Path, *, mmap: bool = True) -> LongCapture:
        from attnviz.reading import read_text

        path = folder / SIDECAR
        try:
            sidecar = json.loads(read_text(path))
        except FileNotFoundError:
            raise DumpError(f"{folder} is not a long capture: it has no {SIDECAR}",
                            "pass the folder capture_long or LongCapture.save wrote") from None
        except (OSError, ValueError) as exc:  # UnicodeDecodeError, JSONDecodeError included
            raise DumpError(f"cannot read {path}: {exc}", _DAMAGED) from None
        except RecursionError:
            raise DumpError(f"cannot read {path}: its JSON is nested too deeply",
                            _DAMAGED) from None
        if not isinstance(sidecar, dict) or sidecar.get("format") != FORMAT_NAME:
            raise DumpError(f"{path} is not a long capture sidecar (format "
                            f"{sidecar.get('format') if isinstance(sidecar, dict) else None!r})")
        version = sidecar.get("format_version")
        if not isinstance(version, int) or version > FORMAT_VERSION:
            raise DumpError(f"{path} has format_version {version!r}; this attnviz reads "
                            f"{FORMAT_VERSION}", "upgrade attnviz to read it")
        try:
            return cls(folder, sidecar, mmap)
        except ValueError as exc:  # the sidecar's own problem, in one line
            raise DumpError(f"{path} is damaged: {exc}", _DAMAGED) from None

    def _array(self, kind: str, layer: int) -> np.ndarray:
        key = (kind, layer)
        if key not in self._arrays:
            from attnviz.reading import load_npy

            self._arrays[key] = load_npy(self.folder / layer_file(kind, layer), mmap=self._mmap,
                                         hint="the long capture folder is incomplete: "
                                              "capture again")
        return self._arrays[key]

    def _check(self) -> None:
        if self.dtype not in STORAGE_DTYPES:
            raise ValueError(f"dtype {self.dtype!r}")
        if self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads is not a multiple of num_kv_heads")
        stored = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}
        size, heads, kv, dim = self.num_tokens, self.num_heads, self.num_kv_heads, self.head_dim
        for layer in self.layers:
            for kind, shape, dtype in (("q", (heads, size, dim), stored[self.dtype]),
                                       ("k", (kv, size, dim), stored[self.dtype]),
                                       ("lse", (heads, size), np.float32)):
                array = self._array(kind, layer)
                if array.shape != shape or array.dtype != dtype:
                    raise DumpError(
                        f"{self.folder / layer_file(kind, layer)} holds {array.dtype} "
                        f"{array.shape}, the sidecar says {np.dtype(dtype)} {shape}",
                        _DAMAGED)
        self._check_agreement()

    def _check_agreement(self) -> None:
        """Refuse a sidecar whose causal flag, windows or scales, or a log-sum-exp, do not
        describe the queries and keys: sampled rows must sum to 1
        (:mod:`attnviz.long.consistency`)."""
        from attnviz.long.consistency import check_rows

        for position, layer in enumerate(self.layers):
            problem = check_rows(self.folder, layer, position, q=self._array("q", layer),
                                 k=self._array("k", layer), lse=self._array("lse", layer),
                                 dtype=self.dtype, causal=self.causal,
                                 window=self.windows[layer], scale=self.scales[layer])
            if problem is not None:
                raise DumpError(problem, _DAMAGED)

    def save(self, folder: str | Path) -> Path:
        """Copy the capture's files into ``folder``; returns the folder.

        The files are written into a hidden folder inside ``folder`` and moved into place
        once all are written (the sidecar last), as ``attnviz dump --long`` does; then any
        other capture attnviz saved in ``folder`` (a full one, other layers) is removed, so
        ``--from`` reads this one. An interrupted save leaves ``folder`` as it was.
        """
        from attnviz.capture_files import StagedDump
        from attnviz.fileio import atomic_write

        target = Path(folder)
        with StagedDump(target) as staged:
            for layer in self.layers:
                for kind in ("q", "k", "lse"):
                    atomic_write(staged.path / layer_file(kind, layer),
                                 _npy_writer(self._array(kind, layer)), root=staged.path)
            write_sidecar(staged.path, {k: v for k, v in self._sidecar.items()
                                        if k not in ("format", "format_version", "axes")})
            staged.commit()
        return target

    def close(self) -> None:
        """Drop the memory maps (and remove a temporary folder)."""
        self._arrays.clear()
        if self._cleanup is not None:
            self._cleanup()

    @property
    def model_label(self) -> str:
        """The model's name for titles: a local folder's name, not its path
        (:func:`~attnviz.capture_build.model_label`); :attr:`model` keeps the path."""
        from attnviz.capture_build import model_label

        return model_label(self.model)

    def __repr__(self) -> str:
        return (f"LongCapture(model={self.model_label!r}, tokens={self.num_tokens}, "
                f"layers={len(self.layers)}, heads={self.num_heads}, "
                f"kv_heads={self.num_kv_heads}, dtype={self.dtype}, folder='{self.folder}')")

    # ------------------------------------------------------------------ checks
    def _layer(self, layer: int) -> int:
        return check_layer(int(layer), self.num_layers, self.layers)

    def _head(self, head: int | str) -> int | None:
        """``None`` for the mean over heads."""
        return check_head(head, self.num_heads, self.heads)

    def _span(self, start: int, stop: int | None, what: str) -> tuple[int, int]:
        return check_span(start, stop, self.num_tokens, what)

    # ------------------------------------------------------------------ the record's questions
    # (attnviz.record.AttentionRecord: the surface every storage answers)
    @property
    def heads(self) -> list[int]:
        """Every head of the model: a long capture keeps them all."""
        return list(range(self.num_heads))

    def layer_index(self, layer: int) -> int:
        """The model layer of ``layer`` (negative counts from the end), checked held."""
        return self._layer(layer)

    def head_index(self, head: int | str) -> int | None:
        """The model head of ``head``; ``None`` for ``"mean"``."""
        return self._head(head)

    @property
    def finest_block(self) -> int:
        """The smallest atlas block answered (weights are computed on demand)."""
        return MIN_BLOCK

    @property
    def prepared_block(self) -> int | None:
        """The block of the atlas :meth:`summarise` kept (coarser levels are pooled from it
        with no pass over a head), or ``None`` before it ran."""
        return None if self._summary is None else int(self._summary.block)

    def window_of(self, layer: int) -> int | None:
        """The sliding window of ``layer``, or ``None``."""
        return self.windows[self._layer(layer)]

    @property
    def title_start(self) -> str:
        """The start of every title: ``model: ``."""
        return f"{self.model_label}: "

    @property
    def mean_label(self) -> str:
        """How the mean over heads is named in titles."""
        return "mean of all heads"

    def dense(self, what: str) -> Capture:
        """Every weight of the recorded layers at once, as a
        :class:`~attnviz.capture.Capture` (for ``what``: a view that re-normalises whole
        rows, rollout, a whole-matrix report).

        Raises:
            UsageError: more than :data:`attnviz.record.MAX_DENSE` weights.
        """
        from attnviz.capture import Capture

        dense_size_check(self, what)
        size = self.num_tokens
        weights = np.empty((len(self.layers), self.num_heads, size, size), dtype=np.float32)
        for position, layer in enumerate(self.layers):
            for head in range(self.num_heads):
                weights[position, head] = self.tile(layer, head, 0, size, 0, size)
        return Capture(tokens=list(self.tokens), word_ids=list(self.word_ids),
                       special=list(self.special), weights=weights, layers=list(self.layers),
                       heads=self.heads, num_layers=self.num_layers,
                       num_heads=self.num_heads, model=self.model, causal=self.causal,
                       text=self.text, pair=self.pair, display_tokens=list(self.display_tokens),
                       meta=dict(self.meta))

    # ------------------------------------------------------------------ tensors
    def _queries(self, layer: int, heads: list[int] | None, q0: int, q1: int) -> torch.Tensor:
        """``[head, q1 - q0, dim]`` float32 on the capture's device."""
        array = self._array("q", layer)
        part = array[:, q0:q1] if heads is None else array[heads, q0:q1]
        return _from_storage(part, self.dtype).to(self.device)

    def _keys(self, layer: int, kv_heads: list[int] | None = None) -> torch.Tensor:
        array = self._array("k", layer)
        part = array if kv_heads is None else array[kv_heads]
        return _from_storage(part, self.dtype).to(self.device)

    def _lse(self, layer: int, heads: list[int] | None, q0: int, q1: int) -> torch.Tensor:
        import torch

        array = self._array("lse", layer)
        part = array[:, q0:q1] if heads is None else array[heads, q0:q1]
        return torch.from_numpy(np.array(part, dtype=np.float32)).to(self.device)

    def _check_finite(self, layer: int) -> None:
        """Refuse a layer whose stored queries, keys or log-sum-exp hold NaN or infinities,
        or whose queries and keys are so large that a score could overflow (by
        Cauchy-Schwarz, ``|scale * q.k| <= scale * |q| * |k|``). Read in chunks of token
        rows; once per layer."""
        if layer in self._finite:
            return
        largest = {}
        for kind in ("q", "k", "lse"):
            array = self._array(kind, layer)
            per_token = max(1, array.size // max(1, array.shape[1]))
            step = max(1, FINITE_CHUNK // per_token)
            norm = 0.0
            for start in range(0, array.shape[1], step):
                part = array[:, start:start + step]
                if kind == "lse":
                    bad = not bool(np.isfinite(part).all())
                else:
                    values = _from_storage(part, self.dtype)  # float32: an inf norm is too large
                    bad = not bool(values.isfinite().all())
                    if not bad and values.numel():
                        norm = max(norm, float(values.norm(dim=-1).max()))
                if bad:
                    raise DumpError(f"{self.folder / layer_file(kind, layer)} holds NaN or "
                                    "infinite values", _DAMAGED)
            largest[kind] = norm
        if self.scales[layer] * largest["q"] * largest["k"] > MAX_SCORE:
            raise DumpError(f"the queries and keys of layer {layer} in {self.folder} are too "
                            "large: their scores would not be finite numbers", _DAMAGED)
        self._finite.add(layer)

    def _finite_result(self, layer: int, *results: np.ndarray) -> None:
        """Refuse weights that came out NaN or infinite (finite but huge queries or keys)."""
        if not all(bool(np.isfinite(r).all()) for r in results):
            raise DumpError(f"the weights of layer {layer} in {self.folder} are not finite "
                            "numbers: its queries or keys are too large", _DAMAGED)

    def _operands(self, layer: int, head: int | None, q0: int, q1: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and lse of one head (or of every head when ``head`` is None)."""
        self._check_finite(layer)
        if head is None:
            return (self._queries(layer, None, q0, q1), self._keys(layer),
                    self._lse(layer, None, q0, q1))
        group = self.num_heads // self.num_kv_heads
        return (self._queries(layer, [head], q0, q1), self._keys(layer, [head // group]),
                self._lse(layer, [head], q0, q1))

    # ------------------------------------------------------------------ weights
    def tile(self, layer: int, head: int | str, q0: int, q1: int, k0: int, k1: int
             ) -> np.ndarray:
        """Exact weights ``A[q0:q1, k0:k1]`` of one head (or ``"mean"`` over heads).

        Returns:
            ``[q1 - q0, k1 - k0]`` float32; 0 where the causal or window mask hides a key.

        Raises:
            UsageError: a layer not recorded, a bad head, a range outside the text, or a tile
                of more than :data:`MAX_TILE` weights.
        """
        import torch

        import attnviz.long.kernels as kernels

        layer = self._layer(layer)
        index = self._head(head)
        q0, q1 = self._span(q0, q1, "query")
        k0, k1 = self._span(k0, k1, "key")
        check_tile(q1 - q0, k1 - k0)
        q, k, lse = self._operands(layer, index, q0, q1)
        k = k[:, k0:k1]
        scale, window = self.scales[layer], self.windows[layer]
        out = torch.zeros(q1 - q0, k1 - k0, dtype=torch.float32, device=self.device)
        heads = q.shape[0]
        for h in range(heads):  # one head at a time: memory of one tile
            kv = k[h // (heads // k.shape[0]) if index is None else 0]
            s = kernels.scores(q[h:h + 1], kv[None], scale)[0]  # [rows, keys]
            s -= lse[h, :, None]
            kernels.apply_mask(s, q0, k0, self.causal, window)
            out += s.exp_()
        if index is None:
            out /= heads
        weights = out.cpu().numpy()
        self._finite_result(layer, weights)
        return weights

    def rows(self, layer: int, head: int | str, q0: int, q1: int) -> np.ndarray:
        """Exact weights of queries ``q0..q1`` against every key: ``[q1 - q0, T]`` float32."""
        return self.tile(layer, head, q0, q1, 0, self.num_tokens)

    def topk(self, layer: int, head: int | str, k: int, q0: int = 0, q1: int | None = None,
             *, progress: Callable[[int, int], None] | None = None
             ) -> tuple[np.ndarray, np.ndarray]:
        """The ``k`` keys each query in ``q0..q1`` attends to most, strongest first.

        Returns:
            ``(indices, values)``: ``[q1 - q0, k]`` int64 key positions and float32 weights.
            A query that sees fewer than ``k`` keys (early rows of a causal model) gets
            index ``-1`` and weight 0 in the places left over. ``progress(rows done, rows)``
            follows the pass.
        """
        from attnviz.long.scan import topk_head

        layer = self._layer(layer)
        index = self._head(head)
        q0, q1 = self._span(q0, q1, "query")
        k = check_k(k)
        indices, values = topk_head(self, layer, index, min(int(k), self.num_tokens), q0, q1,
                                     progress=progress)
        self._finite_result(layer, values)
        return indices, values

    def atlas(self, layer: int, head: int | str, block: int) -> tuple[np.ndarray, np.ndarray]:
        """Block-aggregated weights of one head (or ``"mean"``): for ``block``-token blocks of
        queries and keys, the sum and the largest weight in each block pair.

        Args:
            block: a power of two from 16 (64, 256 and 1024 make a pyramid).

        Returns:
            ``(sums, maxes)``: ``[nb, nb]`` float32 each, ``nb = ceil(T / block)``. Row ``r``
            of ``sums`` divided by the number of queries in block ``r`` is the mean share of
            attention those queries give each key block; a row of ``sums`` adds up to that
            number of queries.
        """
        from attnviz.long.scan import atlas_head

        layer = self._layer(layer)
        index = self._head(head)
        block = check_block(self.num_tokens, block)
        sums, maxes = atlas_head(self, layer, index, block)
        self._finite_result(layer, sums, maxes)
        return sums, maxes

    # ------------------------------------------------------------------ whole-capture scans
    def summarise(self, *, block: int | None = None, k: int = 0, mean: bool = False,
                  progress: Callable[[int, int], None] | None = None) -> Summary:
        """One streamed pass over every recorded layer and head: head statistics, attention
        received, the atlas at ``block`` (coarser levels are pooled from it; by default the
        finest block from 64 up that keeps the grid within 512 x 512; with ``mean``, the
        mean over heads' block maxima too) and, with ``k > 0``, every head's top-``k`` keys
        per query. Kept, so later calls are free; ``progress(rows done, rows in all)``."""
        from attnviz.long.scan import summarise

        block = check_summary(self.num_tokens, block, k)
        held = self._summary
        if held is None or held.block > block or held.k < k or (mean and not held.mean):
            if held is not None:  # what the held summary had is kept
                k, mean = max(int(k), held.k), mean or held.mean
            summary = summarise(self, block=block, k=min(int(k), self.num_tokens), mean=mean,
                                progress=progress)
            for position, layer in enumerate(self.layers):
                self._finite_result(layer, summary.received[position])
            self._summary = summary
        return cast("Summary", self._summary)

    def prepare(self, *, block: int | None = None, k: int = 0,
                progress: Callable[[int, int], None] | None = None) -> None:
        """:meth:`summarise`: every whole-record answer in one streamed pass, kept
        (``progress(rows done, rows)`` follows the pass)."""
        self.summarise(block=block, k=k, progress=progress)

    def head_stats(self) -> dict[str, np.ndarray]:
        """Statistic -> ``[layer, head]`` mean over query rows, with the definitions of
        :mod:`attnviz.analysis.stats` (``entropy`` divides by the log of the keys a row can
        see, the window included)."""
        return self.summarise().means()

    def received(self, layer: int, head: int | str) -> np.ndarray:
        """Attention received by each key: the column sums ``sum_i A[i, j]`` (``[T]``,
        float64); ``"mean"`` averages them over heads. Key ``j`` of a causal model is seen by
        ``T - j`` queries (fewer under a window), so late keys receive less by construction:
        divide by :meth:`seen_by` for a mean."""
        layer = self._layer(layer)
        index = self._head(head)
        summary = self.summarise()
        data = summary.received[self.layers.index(layer)]  # [head, T]
        return data.mean(axis=0) if index is None else data[index].copy()

    def seen_by(self, layer: int | None = None) -> np.ndarray:
        """How many queries see each key: ``[T]`` int64 (of ``layer``'s window)."""
        window = self.window if layer is None else self.windows[self._layer(layer)]
        return seen_counts(self.num_tokens, self.causal, window)

    def sinks(self, threshold: float = SINK_THRESHOLD) -> np.ndarray:
        """Attention sinks (Gu et al., 2024): for each token ``j``, the fraction of recorded
        (layer, head) pairs whose mean attention to ``j`` over the queries that see it
        exceeds ``threshold``. ``[T]`` float64."""
        threshold = check_threshold(threshold)
        summary = self.summarise()
        total = np.zeros(self.num_tokens)
        for position, layer in enumerate(self.layers):
            mean = summary.received[position] / self.seen_by(layer)[None, :]  # [head, T]
            total += (mean > threshold).sum(axis=0)
        return total / (len(self.layers) * self.num_heads)
