"""Streamed passes over a long capture: top-k, the atlas, head statistics, attention received.

Each pass walks the query axis in chunks (:func:`attnviz.long.kernels.log_weight_chunks`) and
reduces every chunk at once, so memory is one chunk of scores plus the results
(``[head, T]`` vectors and ``[nb, nb]`` atlas grids), never ``T x T``.

Statistics follow :mod:`attnviz.analysis.stats` row by row; the entropy is taken from the
log-weights (``-sum_j a_ij log a_ij`` with ``log a_ij = s_ij - lse_i``), so it needs no extra
logarithm.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

import attnviz.long.kernels as kernels
from attnviz.analysis.stats import LOCAL_WINDOW, STAT_KEYS, StatSums, is_punctuation
from attnviz.analysis.topk import top_keys

# The capture is an attnviz.long.record.LongCapture; it imports this module, not the reverse.
LongCapture = Any


@dataclass
class Summary:
    """What :meth:`LongCapture.summarise` computes in one pass.

    Attributes:
        block: the atlas's finest block size.
        k: keys per query in ``top_indices`` (0: none kept).
        stats: the statistics as :class:`attnviz.analysis.stats.StatSums` (``[layer, head]``).
        received: ``[layer, head, T]`` float64 column sums.
        atlas_sums, atlas_maxes: ``[layer, head + 1, nb, nb]`` float32; entry ``head`` (the
            last) is the mean over heads, whose maxima are not scanned here (NaN): the mean's
            maximum needs the mean matrix, which :func:`atlas_head` builds when asked.
        top_indices, top_values: ``[layer, head, T, k]`` (int64, float32), or ``None``.
        mean: whether the mean's atlas maxima were scanned too (else they are NaN).
    """

    block: int
    k: int
    stats: StatSums
    received: np.ndarray
    atlas_sums: np.ndarray
    atlas_maxes: np.ndarray
    top_indices: np.ndarray | None
    top_values: np.ndarray | None
    mean: bool = False

    def means(self) -> dict[str, np.ndarray]:
        return self.stats.means()

    def atlas(self, position: int, head: int | None, block: int) -> tuple[np.ndarray,
                                                                            np.ndarray]:
        """The atlas of one recorded layer at a block a power-of-two multiple of
        :attr:`block`, pooled from the finest level."""
        slot = -1 if head is None else head
        sums = self.atlas_sums[position, slot]
        maxes = self.atlas_maxes[position, slot]
        return pool(sums, maxes, block // self.block)


def pool(sums: np.ndarray, maxes: np.ndarray, factor: int) -> tuple[np.ndarray, np.ndarray]:
    """Merge ``factor x factor`` groups of atlas cells (sum of sums, max of maxes)."""
    if factor == 1:
        return sums.copy(), maxes.copy()
    n = sums.shape[0]
    factor = max(1, min(factor, n))  # one cell holds it all: no padding beyond the grid
    m = -(-n // factor)
    pad = m * factor - n
    s = np.pad(sums, ((0, pad), (0, pad))).reshape(m, factor, m, factor)
    x = np.pad(maxes, ((0, pad), (0, pad))).reshape(m, factor, m, factor)
    return s.sum(axis=(1, 3)), x.max(axis=(1, 3))


def _blocks(values: torch.Tensor, start: int, block: int,
            reduce: str) -> tuple[int, torch.Tensor]:
    """Reduce the last axis of ``values`` (positions from ``start``) by ``block``-aligned
    blocks; returns the first block index and ``[..., blocks]``."""
    size = values.shape[-1]
    first = start // block
    if start % block == 0:  # aligned (the scans ask for it): one reshape, and a short tail
        whole = size // block * block
        parts = [_reduce(values[..., :whole].unflatten(-1, (whole // block, block)), reduce)]
        if whole < size:
            parts.append(_reduce(values[..., whole:], reduce)[..., None])
        return first, torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]
    edges = list(range((first + 1) * block, start + size, block))
    parts = []
    begin = 0
    # The leading partial block, the aligned middle in one view, the trailing partial block.
    lead = min(size, edges[0] - start) if edges else size
    if lead:
        parts.append(_reduce(values[..., :lead], reduce)[..., None])
        begin = lead
    middle = (size - begin) // block * block
    if middle:
        shaped = values[..., begin:begin + middle].unflatten(-1, (middle // block, block))
        parts.append(_reduce(shaped, reduce))
        begin += middle
    if begin < size:
        parts.append(_reduce(values[..., begin:], reduce)[..., None])
    return first, torch.cat(parts, dim=-1)


def _reduce(values: torch.Tensor, reduce: str) -> torch.Tensor:
    return values.sum(-1) if reduce == "sum" else values.amax(-1)


def _topk_chunk(s: torch.Tensor, k: int, k0: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` of log-weights ``[g, rows, keys]``: key positions (``-1`` where masked) and
    weights."""
    width = min(k, s.shape[-1])
    index = top_keys(s, width)  # [g, rows, width]: ties to the earlier key
    values = s.gather(-1, index)
    masked = values < kernels.MASKED_BELOW
    index = torch.where(masked, torch.full_like(index, -1), index + k0)
    weights = torch.where(masked, torch.zeros_like(values), values.exp())
    if width < k:
        pad = (0, k - width)
        index = torch.nn.functional.pad(index, pad, value=-1)
        weights = torch.nn.functional.pad(weights, pad, value=0.0)
    return index, weights


def topk_head(capture: LongCapture, layer: int, head: int | None, k: int, q0: int,
              q1: int, progress: Any = None) -> tuple[np.ndarray, np.ndarray]:
    """Top-``k`` keys per query of one head (``None``: the mean over heads);
    ``progress(rows done, rows)`` after each chunk."""
    q, keys, lse = capture._operands(layer, head, q0, q1)
    scale, window = capture.scales[layer], capture.windows[layer]
    indices = np.empty((q1 - q0, k), dtype=np.int64)
    values = np.empty((q1 - q0, k), dtype=np.float32)
    if progress is not None:
        progress(0, q1 - q0)
    for a0, a1, k0, s in kernels.log_weight_chunks(q, keys, lse, scale, capture.causal, window,
                                                   q0, q1):
        if head is None:
            # The mean's ranking needs the mean weights; masked keys get a weight of -1 so
            # they rank below every visible key.
            masked = s[0] < kernels.MASKED_BELOW
            mean = s.exp_().mean(dim=0)
            mean = torch.where(masked, torch.full_like(mean, -1.0), mean)
            width = min(k, mean.shape[-1])
            index = top_keys(mean, width)
            top = mean.gather(-1, index)
            index = torch.where(top < 0, torch.full_like(index, -1), index + k0)
            top = top.clamp(min=0.0)
            if width < k:
                index = torch.nn.functional.pad(index, (0, k - width), value=-1)
                top = torch.nn.functional.pad(top, (0, k - width), value=0.0)
            indices[a0 - q0:a1 - q0], values[a0 - q0:a1 - q0] = index.cpu(), top.cpu()
        else:
            index, top = _topk_chunk(s, k, k0)
            indices[a0 - q0:a1 - q0], values[a0 - q0:a1 - q0] = index[0].cpu(), top[0].cpu()
        if progress is not None:
            progress(a1 - q0, q1 - q0)
    return indices, values


def atlas_head(capture: LongCapture, layer: int, head: int | None,
               block: int) -> tuple[np.ndarray, np.ndarray]:
    """The atlas of one head (``None``: the mean): held levels are pooled, others scanned."""
    held = capture._summary
    if held is not None and block >= held.block and (head is not None or held.mean):
        return held.atlas(capture.layers.index(layer), head, block)
    size = capture.num_tokens
    nb = -(-size // block)
    sums = torch.zeros(nb, nb, dtype=torch.float32, device=capture.device)
    maxes = torch.zeros(nb, nb, dtype=torch.float32, device=capture.device)
    q, keys, lse = capture._operands(layer, head, 0, size)
    scale, window = capture.scales[layer], capture.windows[layer]
    for a0, _a1, k0, s in kernels.log_weight_chunks(q, keys, lse, scale, capture.causal, window,
                                                    0, size, max_rows=block, align=block):
        weights = s.exp_().mean(dim=0)  # [rows, keys]: one head, or the mean over heads
        row = a0 // block  # a chunk lies within one block of queries
        column_sums = torch.mv(weights.T, weights.new_ones(weights.shape[0]))  # [keys]
        c0, cells = _blocks(column_sums, k0, block, "sum")
        sums[row, c0:c0 + cells.shape[-1]] += cells
        c0, cells = _blocks(weights, k0, block, "max")
        cells = cells.amax(dim=0)
        target = maxes[row, c0:c0 + cells.shape[-1]]
        torch.maximum(target, cells, out=target)
    return sums.cpu().numpy(), maxes.cpu().numpy()


def _key_features(capture: LongCapture) -> torch.Tensor:
    return key_features(capture.display_tokens, capture.special)


def key_features(display_tokens: list[str], special: list[bool]) -> torch.Tensor:
    """``[T, 2]``: special tokens after position 0 (``sep``) and punctuation (``punct``)."""
    flags = np.asarray(special, dtype=bool)
    sep = flags & (np.arange(len(flags)) > 0)
    punct = np.array([not s and is_punctuation(t) for t, s in zip(display_tokens, special)],
                     dtype=bool)
    return torch.from_numpy(np.stack([sep, punct], axis=1).astype(np.float32))


def auto_block(size: int) -> int:
    """The finest atlas block that keeps a grid at most 512 x 512 (64 at 32k tokens, 256 at
    128k), so every head's atlas of a long text stays small."""
    block = 64
    while -(-size // block) > 512:
        block *= 2
    return block


def summarise(capture: LongCapture, *, block: int, k: int, mean: bool = False,
              progress: Any = None) -> Summary:
    """Statistics, received attention, the atlas (with ``mean``, the mean's maxima too) and
    (``k > 0``) top-k of every head, one layer at a time with :func:`scan_layer` (the
    log-sum-exp recomputed on the way); ``progress(done, total)`` after each chunk of rows."""
    features = _key_features(capture).to(capture.device)
    scans = []
    layers = list(capture.layers)
    size = capture.num_tokens
    if progress is not None:
        progress(0, len(layers) * size)
    for number, layer in enumerate(layers):
        q, keys, _lse = capture._operands(layer, None, 0, size)
        tick = None if progress is None else (
            lambda done, n=number: progress(n * size + done, len(layers) * size))
        scans.append(scan_layer(q, keys, capture.scales[layer], capture.causal,
                                capture.windows[layer], features, block=block, k=k,
                                mean=mean, progress=tick))
    return build_summary(scans, layers=layers, block=block, k=k, model=capture.model,
                         causal=capture.causal)


@dataclass
class LayerScan:
    """One layer's part of a :class:`Summary`, and its log-sum-exp ``[head, T]``."""

    lse: torch.Tensor
    sums: dict[str, np.ndarray]
    counts: dict[str, np.ndarray]
    received: np.ndarray  # [head, T] float64
    atlas_sums: np.ndarray  # [head, nb, nb]
    atlas_maxes: np.ndarray
    top_indices: np.ndarray | None  # [head, T, k]
    top_values: np.ndarray | None
    mean_maxes: np.ndarray | None = None  # [nb, nb]: the mean over heads' block maxima


def build_summary(scans: list[LayerScan], *, layers: list[int], block: int, k: int,
                  model: str, causal: bool) -> Summary:
    """Stack the layers' scans into a :class:`Summary` (the mean's atlas sums added)."""
    heads = scans[0].received.shape[0]
    size = scans[0].received.shape[1]
    stats = StatSums(layers=list(layers), heads=list(range(heads)),
                     sums={key: np.stack([s.sums[key] for s in scans]) for key in STAT_KEYS},
                     counts={key: np.stack([s.counts[key] for s in scans])
                             for key in STAT_KEYS},
                     texts=1, tokens=size, model=model, causal=causal)
    per_head = np.stack([s.atlas_sums for s in scans])  # [layer, head, nb, nb]
    atlas_sums = np.concatenate([per_head, per_head.mean(axis=1, keepdims=True)], axis=1)
    maxes = np.stack([s.atlas_maxes for s in scans])
    mean = all(s.mean_maxes is not None for s in scans)
    mean_maxes = (np.stack([s.mean_maxes for s in scans])[:, None]  # type: ignore[misc]
                  if mean else np.full_like(maxes[:, :1], np.nan))
    atlas_maxes = np.concatenate([maxes, mean_maxes], axis=1)
    top_indices = np.stack([s.top_indices for s in scans]) if k else None  # type: ignore[misc]
    top_values = np.stack([s.top_values for s in scans]) if k else None  # type: ignore[misc]
    return Summary(block=block, k=k, stats=stats,
                   received=np.stack([s.received for s in scans]), atlas_sums=atlas_sums,
                   atlas_maxes=atlas_maxes, top_indices=top_indices, top_values=top_values,
                   mean=mean)


def scan_layer(q: torch.Tensor, keys: torch.Tensor, scale: float, causal: bool,
               window: int | None, features: torch.Tensor, *, block: int, k: int,
               budget: int | None = None, mean: bool = False,
               progress: Any = None) -> LayerScan:
    """Every head's log-sum-exp, statistics, received attention, atlas and top-``k`` of one
    layer, in one pass over its scores.

    Each chunk of query rows is scored against all the keys it sees once: the key-block
    maxima of the scores give each row's maximum, the atlas maxima
    (``exp(block max - lse)``) and the top-k candidates (the ``k`` largest weights of a row
    lie in the ``k`` blocks of largest maxima); the scores are then exponentiated in place
    (``e = exp(s - max)``), and one product with :func:`_right_side` gives each row's sum
    ``z`` (so ``lse = max + log z``) and the statistics' linear sums, one more the column sums
    weighted by ``1 / z``. The weights ``e / z`` are never formed.

    Args:
        q: ``[head, T, dim]`` float32; ``keys``: ``[kv_head, T, dim]`` float32.
        features: ``[T, 2]`` float32 key features (:func:`_key_features`).
        block: the atlas block (a power of two); chunks never straddle one.
        k: top keys kept per query (0: none).
        mean: also the block maxima of the mean over heads (``sum_h e_h / z_h / heads``).
        progress: called with the rows done after each chunk.
    """
    heads, size, dim = q.shape
    kv_heads = keys.shape[0]
    group = heads // kv_heads
    device = q.device
    nb = -(-size // block)
    rows = min(kernels.chunk_rows(heads, size, SCAN_BYTES if budget is None else budget), block)
    # Both products read their key-side operand as [dim, keys] rows (a tenth faster on the
    # CPU than the transposed view of [keys, dim]): the keys, and the statistics' right side.
    keys_t = keys.transpose(1, 2).contiguous()  # [kv_head, dim, T]
    right_t = _right_side(keys, features).transpose(1, 2).contiguous()  # [kv, dim + 4, T]
    lse = torch.empty(heads, size, dtype=torch.float32, device=device)
    grid_sums = torch.zeros(heads, nb, nb, device=device)
    grid_maxes = torch.zeros(heads, nb, nb, device=device)
    mean_maxes = torch.zeros(nb, nb, device=device) if mean else None
    got = torch.zeros(heads, size, dtype=torch.float64, device=device)
    sums = {key: torch.zeros(heads, dtype=torch.float64, device=device) for key in STAT_KEYS}
    counts = {key: torch.zeros(heads, dtype=torch.float64, device=device) for key in STAT_KEYS}
    top_indices = np.empty((heads, size, k), dtype=np.int64) if k else None
    top_values = np.empty((heads, size, k), dtype=np.float32) if k else None
    for a0 in range(0, size, rows):
        a1 = min(size, a0 + rows)
        k0, k1 = kernels.key_range(a0, a1, size, causal, window)
        k0, k1 = k0 - k0 % block, min(size, -(-k1 // block) * block)
        width = k1 - k0
        grouped = (q[:, a0:a1] * scale).reshape(kv_heads, group * (a1 - a0), dim)
        s = torch.bmm(grouped, keys_t[:, :, k0:k1]).view(heads, a1 - a0, width)
        kernels.apply_mask(s, a0, k0, causal, window)
        _c0, block_max = _blocks(s, k0, block, "max")  # [head, rows, key blocks]
        top = block_max.amax(-1, keepdim=True)  # [head, rows, 1]
        if top_indices is not None:
            best, positions = _top_scores(s, block_max, k, block)
        weights = s.sub_(top).exp_()  # e = exp(s - max), in place: the scores are spent
        mixed = torch.bmm(right_t[:, :, k0:k1],
                          weights.reshape(kv_heads, group * (a1 - a0), width).transpose(1, 2))
        mixed = mixed.transpose(1, 2).reshape(heads, a1 - a0, dim + 4)  # [head, rows, dim+4]
        factor = 1.0 / mixed[..., dim + 3]  # 1 / z: the row's largest weight, too
        chunk_lse = top[..., 0] - factor.log()
        lse[:, a0:a1] = chunk_lse
        mixed *= factor[..., None]
        if top_indices is not None and top_values is not None:
            index, value = _topk_weights(best, positions, chunk_lse, k, k0)
            top_indices[:, a0:a1] = index.cpu().numpy()
            top_values[:, a0:a1] = value.cpu().numpy()
        chunk = _Chunk(weights, q[:, a0:a1], keys[:, k0:k1], chunk_lse, scale, a0, k0, size,
                       causal, window, factor)
        _row_stats(chunk, mixed, factor, sums, counts)
        # Column sums as a product (weights 1 / z): on the CPU, several times faster than a
        # reduction over the middle axis.
        column_sums = torch.bmm(factor[:, None, :], weights)[:, 0]  # [head, keys]
        got[:, k0:k1] += column_sums
        row = a0 // block  # a chunk lies within one block of queries
        c0, cells = _blocks(column_sums, k0, block, "sum")
        grid_sums[:, row, c0:c0 + cells.shape[-1]] += cells
        cells = (block_max - chunk_lse[..., None]).exp_().amax(dim=1)  # [head, key blocks]
        target = grid_maxes[:, row, c0:c0 + cells.shape[-1]]
        torch.maximum(target, cells, out=target)
        if mean_maxes is not None:
            average = weights[0] * (factor[0] / heads)[:, None]  # [rows, keys]
            for h in range(1, heads):
                average.addcmul_(weights[h], (factor[h] / heads)[:, None])
            c0, cells = _blocks(average, k0, block, "max")
            target = mean_maxes[row, c0:c0 + cells.shape[-1]]
            torch.maximum(target, cells.amax(dim=0), out=target)
        if progress is not None:
            progress(a1)
    return LayerScan(lse=lse, sums={key: value.cpu().numpy() for key, value in sums.items()},
                     counts={key: value.cpu().numpy() for key, value in counts.items()},
                     received=got.cpu().numpy(), atlas_sums=grid_sums.cpu().numpy(),
                     atlas_maxes=grid_maxes.cpu().numpy(), top_indices=top_indices,
                     top_values=top_values,
                     mean_maxes=None if mean_maxes is None else mean_maxes.cpu().numpy())


def _top_scores(s: torch.Tensor, block_max: torch.Tensor, k: int,
                block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``min(k, keys)`` largest scores of each row and their key positions in the chunk
    (``[head, rows, width]`` each), strongest first. A row's ``k`` largest scores lie in its
    ``k`` blocks of largest maxima: only those are ranked when they are fewer keys than the
    row (positions past the chunk's keys score :data:`kernels.MASKED` times 2)."""
    width = s.shape[-1]
    blocks = min(k, block_max.shape[-1])
    if blocks * block >= width:
        order = top_keys(s, min(k, width))
        return s.gather(-1, order), order
    # Blocks tied at the cut go to the earlier block, and the candidates lie in key order, so
    # ties among them go to the earlier key, as the rule of top_keys says.
    picked = top_keys(block_max, blocks).sort(dim=-1).values
    offsets = torch.arange(block, device=s.device)
    positions = (picked[..., None] * block + offsets).flatten(-2)  # [head, rows, c]
    inside = positions < width
    candidates = torch.where(inside, s.gather(-1, positions.clamp(max=width - 1)),
                             2 * kernels.MASKED)
    order = top_keys(candidates, min(k, width))
    return candidates.gather(-1, order), positions.gather(-1, order)


def _topk_weights(values: torch.Tensor, positions: torch.Tensor, lse: torch.Tensor, k: int,
                  k0: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top scores to key positions (``-1`` where masked) and weights ``exp(score - lse)``,
    padded to ``k``."""
    width = values.shape[-1]
    masked = values < kernels.MASKED_BELOW
    index = torch.where(masked, -1, positions + k0)
    weights = torch.where(masked, 0.0, (values - lse[..., None]).exp())
    if width < k:
        index = torch.nn.functional.pad(index, (0, k - width), value=-1)
        weights = torch.nn.functional.pad(weights, (0, k - width), value=0.0)
    return index, weights


#: Bytes of scores per chunk in a whole-capture scan (bigger chunks, fewer torch calls).
SCAN_BYTES = 8 << 20


@dataclass
class _Chunk:
    """One chunk of a layer: weights ``[head, rows, keys]`` and what they came from."""

    weights: torch.Tensor
    q: torch.Tensor  # [head, rows, dim]
    k: torch.Tensor  # [kv_head, keys, dim]
    lse: torch.Tensor  # [head, rows]
    scale: float
    a0: int
    k0: int
    size: int
    causal: bool
    window: int | None
    factor: torch.Tensor  # [head, rows]: the weights are ``weights * factor[..., None]``


def _right_side(keys: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
    """``[kv_head, T, dim + 4]``: each key, its position, ``sep``, ``punct`` and 1."""
    kv_heads, size, _dim = keys.shape
    positions = torch.arange(size, device=keys.device, dtype=torch.float32)[:, None]
    extra = torch.cat([positions, features, torch.ones(size, 1, device=keys.device)], dim=1)
    return torch.cat([keys, extra.expand(kv_heads, size, 4)], dim=2)


def _row_stats(chunk: _Chunk, mixed: torch.Tensor, largest: torch.Tensor,
               sums: dict[str, torch.Tensor], counts: dict[str, torch.Tensor]) -> None:
    """Add one chunk's per-row statistics (see :mod:`attnviz.analysis.stats`).

    ``mixed`` is the product of the weights with :func:`_right_side`'s keys
    (``[head, rows, dim + 4]``), which holds every sum over keys that is linear in the
    weights: the entropy from ``sum_j a_ij log a_ij = scale * q_i . (sum_j a_ij k_j) - lse_i
    * sum_j a_ij``, the causal distance from ``sum_j a_ij (i - j)``.
    """
    weights, factor = chunk.weights, chunk.factor
    heads, rows, width = weights.shape
    dim = chunk.k.shape[-1]
    device = weights.device
    a0, k0, size = chunk.a0, chunk.k0, chunk.size
    i = torch.arange(a0, a0 + rows, device=device)
    visible = kernels.visible_counts(a0, a0 + rows, size, chunk.causal, chunk.window, device)
    row_sum = mixed[..., dim + 3]
    expected_logs = chunk.scale * (chunk.q * mixed[..., :dim]).sum(-1) - chunk.lse * row_sum
    nats = -expected_logs
    offset = i.to(torch.float32)[None, :]
    if chunk.causal:
        distance = offset * row_sum - mixed[..., dim]
    else:
        positions = torch.arange(k0, k0 + width, device=device, dtype=torch.float32)
        distances = (positions[None, :] - offset.T).abs()  # [rows, keys]
        distance = (weights * distances).sum(-1) * factor

    def at(step: int) -> torch.Tensor:
        column = i + step - k0  # [rows]
        valid = (column >= 0) & (column < width) & (i + step < size)
        picked = weights.gather(-1, column.clamp(0, width - 1)[None, :, None]
                                .expand(heads, rows, 1))[..., 0]
        return picked * factor * valid

    near = {step: at(step) for step in range(-LOCAL_WINDOW, LOCAL_WINDOW + 1)}
    per_row = {
        "entropy": nats / torch.log(visible.clamp(min=2).to(torch.float32)),
        "entropy_nats": nats, "distance": distance, "max_weight": largest,
        "self": near[0], "previous": near[-1], "next": near[1],
        "first": weights[:, :, 0] * factor if k0 == 0 else torch.zeros_like(row_sum),
        "sep": mixed[..., dim + 1], "punct": mixed[..., dim + 2],
        "local": sum(near.values(), torch.zeros_like(row_sum)),
    }
    eligible = (row_sum > 1e-6) & (visible >= 2)[None, :]
    masks = dict.fromkeys(STAT_KEYS, eligible)
    masks["previous"] = eligible & (i >= 1)[None, :]
    masks["next"] = eligible & (i <= size - 2)[None, :]
    for key in STAT_KEYS:
        mask = masks[key]
        sums[key] += torch.where(mask, per_row[key], 0.0).sum(-1, dtype=torch.float64)
        counts[key] += mask.sum(-1).to(torch.float64)
