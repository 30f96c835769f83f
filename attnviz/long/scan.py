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
    """

    block: int
    k: int
    stats: StatSums
    received: np.ndarray
    atlas_sums: np.ndarray
    atlas_maxes: np.ndarray
    top_indices: np.ndarray | None
    top_values: np.ndarray | None

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
    values, index = torch.topk(s, width, dim=-1)  # [g, rows, width]
    masked = values < kernels.MASKED_BELOW
    index = torch.where(masked, torch.full_like(index, -1), index + k0)
    weights = torch.where(masked, torch.zeros_like(values), values.exp())
    if width < k:
        pad = (0, k - width)
        index = torch.nn.functional.pad(index, pad, value=-1)
        weights = torch.nn.functional.pad(weights, pad, value=0.0)
    return index, weights


def topk_head(capture: LongCapture, layer: int, head: int | None, k: int, q0: int,
              q1: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-``k`` keys per query of one head (``None``: the mean over heads)."""
    q, keys, lse = capture._operands(layer, head, q0, q1)
    scale, window = capture.scales[layer], capture.windows[layer]
    indices = np.empty((q1 - q0, k), dtype=np.int64)
    values = np.empty((q1 - q0, k), dtype=np.float32)
    for a0, a1, k0, s in kernels.log_weight_chunks(q, keys, lse, scale, capture.causal, window,
                                                   q0, q1):
        if head is None:
            # The mean's ranking needs the mean weights; masked keys get a weight of -1 so
            # they rank below every visible key.
            masked = s[0] < kernels.MASKED_BELOW
            mean = s.exp_().mean(dim=0)
            mean = torch.where(masked, torch.full_like(mean, -1.0), mean)
            width = min(k, mean.shape[-1])
            top, index = torch.topk(mean, width, dim=-1)
            index = torch.where(top < 0, torch.full_like(index, -1), index + k0)
            top = top.clamp(min=0.0)
            if width < k:
                index = torch.nn.functional.pad(index, (0, k - width), value=-1)
                top = torch.nn.functional.pad(top, (0, k - width), value=0.0)
            indices[a0 - q0:a1 - q0], values[a0 - q0:a1 - q0] = index.cpu(), top.cpu()
        else:
            index, top = _topk_chunk(s, k, k0)
            indices[a0 - q0:a1 - q0], values[a0 - q0:a1 - q0] = index[0].cpu(), top[0].cpu()
    return indices, values


def atlas_head(capture: LongCapture, layer: int, head: int | None,
               block: int) -> tuple[np.ndarray, np.ndarray]:
    """The atlas of one head (``None``: the mean): held levels are pooled, others scanned."""
    held = capture._summary
    if held is not None and block >= held.block and head is not None:
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
    """``[T, 2]``: special tokens after position 0 (``sep``) and punctuation (``punct``)."""
    special = np.asarray(capture.special, dtype=bool)
    sep = special & (np.arange(capture.num_tokens) > 0)
    punct = np.array([not s and is_punctuation(t)
                      for t, s in zip(capture.display_tokens, capture.special)], dtype=bool)
    return torch.from_numpy(np.stack([sep, punct], axis=1).astype(np.float32))


def auto_block(size: int) -> int:
    """The finest atlas block that keeps a grid at most 512 x 512 (64 at 32k tokens, 256 at
    128k), so every head's atlas of a long text stays small."""
    block = 64
    while -(-size // block) > 512:
        block *= 2
    return block


def summarise(capture: LongCapture, *, block: int, k: int) -> Summary:
    """Statistics, received attention, the atlas and (``k > 0``) top-k of every head.

    Chunks never straddle a ``block`` boundary of queries, so the column sums and maxima of
    a chunk (``[head, keys]``, which give the attention received too) are its atlas row.
    """
    size, heads = capture.num_tokens, capture.num_heads
    layers = len(capture.layers)
    nb = -(-size // block)
    features = _key_features(capture).to(capture.device)
    sums = {key: np.zeros((layers, heads)) for key in STAT_KEYS}
    counts = {key: np.zeros((layers, heads)) for key in STAT_KEYS}
    received = np.zeros((layers, heads, size))
    atlas_sums = np.zeros((layers, heads + 1, nb, nb), dtype=np.float32)
    atlas_maxes = np.zeros((layers, heads + 1, nb, nb), dtype=np.float32)
    atlas_maxes[:, heads] = np.nan
    top_indices = np.empty((layers, heads, size, k), dtype=np.int64) if k else None
    top_values = np.empty((layers, heads, size, k), dtype=np.float32) if k else None
    for position, layer in enumerate(capture.layers):
        q, keys, lse = capture._operands(layer, None, 0, size)
        scale, window = capture.scales[layer], capture.windows[layer]
        right = _right_side(keys, features)
        grid_sums = torch.zeros(heads, nb, nb, device=capture.device)
        grid_maxes = torch.zeros(heads, nb, nb, device=capture.device)
        got = torch.zeros(heads, size, dtype=torch.float64, device=capture.device)
        layer_sums = {key: torch.zeros(heads, dtype=torch.float64, device=capture.device)
                      for key in STAT_KEYS}
        layer_counts = {key: torch.zeros(heads, dtype=torch.float64, device=capture.device)
                        for key in STAT_KEYS}
        for a0, a1, k0, s in kernels.log_weight_chunks(q, keys, lse, scale, capture.causal,
                                                       window, 0, size, budget=SCAN_BYTES,
                                                       max_rows=block, align=block):
            width = s.shape[-1]
            if top_indices is not None and top_values is not None:
                index, top = _topk_chunk(s, k, k0)
                top_indices[position, :, a0:a1] = index.cpu().numpy()
                top_values[position, :, a0:a1] = top.cpu().numpy()
                largest = top[..., 0]
            else:
                largest = s.amax(-1).exp_()
            weights = s.exp_()  # [head, rows, keys]: the log-weights are not needed again
            chunk = _Chunk(weights, q[:, a0:a1], keys[:, k0:k0 + width], lse[:, a0:a1], scale,
                           a0, k0, size, capture.causal, window)
            _row_stats(chunk, right[:, k0:k0 + width], largest, layer_sums, layer_counts)
            # Column sums as a product with ones: on the CPU, several times faster than a
            # reduction over the middle axis.
            ones = weights.new_ones(heads, 1, weights.shape[1])
            column_sums = torch.bmm(ones, weights)[:, 0]  # [head, keys]
            got[:, k0:k0 + width] += column_sums
            row = a0 // block
            c0, cells = _blocks(column_sums, k0, block, "sum")
            grid_sums[:, row, c0:c0 + cells.shape[-1]] += cells
            # Maxima within key blocks first (contiguous), then over the chunk's rows.
            c0, cells = _blocks(weights, k0, block, "max")
            cells = cells.amax(dim=1)  # [head, key blocks]
            target = grid_maxes[:, row, c0:c0 + cells.shape[-1]]
            torch.maximum(target, cells, out=target)
        for key in STAT_KEYS:
            sums[key][position] = layer_sums[key].cpu().numpy()
            counts[key][position] = layer_counts[key].cpu().numpy()
        received[position] = got.cpu().numpy()
        atlas_sums[position, :heads] = grid_sums.cpu().numpy()
        atlas_sums[position, heads] = atlas_sums[position, :heads].mean(axis=0)  # linear
        atlas_maxes[position, :heads] = grid_maxes.cpu().numpy()
    stats = StatSums(layers=list(capture.layers), heads=list(range(heads)), sums=sums,
                     counts=counts, texts=1, tokens=size, model=capture.model,
                     causal=capture.causal)
    return Summary(block=block, k=k, stats=stats, received=received, atlas_sums=atlas_sums,
                   atlas_maxes=atlas_maxes, top_indices=top_indices, top_values=top_values)


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


def _right_side(keys: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
    """``[kv_head, T, dim + 4]``: each key, its position, ``sep``, ``punct`` and 1."""
    kv_heads, size, _dim = keys.shape
    positions = torch.arange(size, device=keys.device, dtype=torch.float32)[:, None]
    extra = torch.cat([positions, features, torch.ones(size, 1, device=keys.device)], dim=1)
    return torch.cat([keys, extra.expand(kv_heads, size, 4)], dim=2)


def _row_stats(chunk: _Chunk, right: torch.Tensor, largest: torch.Tensor,
               sums: dict[str, torch.Tensor], counts: dict[str, torch.Tensor]) -> None:
    """Add one chunk's per-row statistics (see :mod:`attnviz.analysis.stats`).

    The sums over keys that are linear in the weights come from one matrix product of the
    weights with ``right``, the chunk's keys of :func:`_right_side`: the entropy from
    ``sum_j a_ij log a_ij = scale * q_i . (sum_j a_ij k_j) - lse_i * sum_j a_ij``, the
    causal distance from ``sum_j a_ij (i - j)``.
    """
    weights = chunk.weights
    heads, rows, width = weights.shape
    kv_heads, _keys, dim = chunk.k.shape
    group = heads // kv_heads
    device = weights.device
    a0, k0, size = chunk.a0, chunk.k0, chunk.size
    i = torch.arange(a0, a0 + rows, device=device)
    visible = kernels.visible_counts(a0, a0 + rows, size, chunk.causal, chunk.window, device)
    mixed = torch.bmm(weights.reshape(kv_heads, group * rows, width), right)
    mixed = mixed.view(heads, rows, dim + 4)
    row_sum = mixed[..., dim + 3]
    expected_logs = chunk.scale * (chunk.q * mixed[..., :dim]).sum(-1) - chunk.lse * row_sum
    nats = -expected_logs
    offset = i.to(torch.float32)[None, :]
    if chunk.causal:
        distance = offset * row_sum - mixed[..., dim]
    else:
        positions = torch.arange(k0, k0 + width, device=device, dtype=torch.float32)
        distances = (positions[None, :] - offset.T).abs()  # [rows, keys]
        distance = (weights * distances).sum(-1)

    def at(step: int) -> torch.Tensor:
        column = i + step - k0  # [rows]
        valid = (column >= 0) & (column < width) & (i + step < size)
        picked = weights.gather(-1, column.clamp(0, width - 1)[None, :, None]
                                .expand(heads, rows, 1))[..., 0]
        return picked * valid

    near = {step: at(step) for step in range(-LOCAL_WINDOW, LOCAL_WINDOW + 1)}
    per_row = {
        "entropy": nats / torch.log(visible.clamp(min=2).to(torch.float32)),
        "entropy_nats": nats, "distance": distance, "max_weight": largest,
        "self": near[0], "previous": near[-1], "next": near[1],
        "first": weights[:, :, 0] if k0 == 0 else torch.zeros_like(row_sum),
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
