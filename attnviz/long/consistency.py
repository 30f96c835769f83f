"""Whether a long capture's sidecar describes its arrays: a few rows recomputed when it opens.

A long capture's weights are ``exp(scale * q.k - lse)`` under the causal mask and window that
``long.json`` declares. If the sidecar's ``causal``, ``windows`` or ``scales`` do not describe
the arrays, or ``lse_LLL.npy`` is not the log-sum-exp of ``q`` and ``k``, every weight read is
wrong, silently: rows that sum to 67 or to 0.008. So when a capture opens, a sample of query
rows of every recorded layer (the first, the last and some between, in the heads of one key
head: one read of that key head) is recomputed from the stored queries and keys (summed in
float64) under the declared mask, window and scale, and each row's weights must sum to 1 within
:data:`ROW_SUM_TOLERANCE`. Row 0 tells causal from bidirectional attention (causally it sees
one key, bidirectionally all of them) and the middle and last rows the window and the scale.

The cost is a few rows against every key of one key head per layer: one key head's share of
reading the keys once, and none of the queries but the sampled rows.

A sample that holds NaN or infinities, or scores too large for finite weights, is left to the
full check of :meth:`LongCapture._check_finite`, which names the file when the layer is read.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

#: How far a sampled row's weights may sum from 1 (relative). A capture's own rows differ
#: from 1 by float32 rounding, below 2e-6 at 64k tokens (tests/test_long_consistency.py);
#: a disagreeing sidecar moves them by orders of magnitude more.
ROW_SUM_TOLERANCE = 1e-3
#: Query rows sampled per layer (the first and last included).
SAMPLE_ROWS = 8
#: Query heads sampled per layer, all reading one key head.
SAMPLE_HEADS = 2
#: Rounding allowed per unit of a row's largest score or lse: a few float32 epsilons.
_FLOAT32_SLACK = 4 * float(np.finfo(np.float32).eps)
#: Scores beyond this are left to the full finiteness check (as ``record.MAX_SCORE``).
_LARGEST_SCORE = 1e28


def sample_rows(size: int, layer: int) -> list[int]:
    """The query rows checked in ``layer``: first, last, the quartiles and a few more drawn
    from a generator seeded by the layer (the same rows every time)."""
    fixed = {0, size - 1, size // 4, size // 2, (3 * size) // 4}
    extra = np.random.default_rng(layer).integers(0, size, size=SAMPLE_ROWS)
    rows = sorted(fixed)
    for row in extra.tolist():
        if len(rows) >= SAMPLE_ROWS:
            break
        if row not in rows:
            rows.append(int(row))
    return sorted(rows)


def sample_heads(position: int, heads: int, kv_heads: int) -> list[int]:
    """Query heads checked in the ``position``-th recorded layer: the first and last heads of
    one key head's group, a different group from layer to layer."""
    group = heads // kv_heads
    first = (position % kv_heads) * group
    return sorted({first, first + group - 1})[:SAMPLE_HEADS]


def visible(row: int, size: int, causal: bool, window: int | None) -> np.ndarray:
    """``[size]`` bool: the keys query ``row`` sees (causal: ``j <= row``; window:
    ``j > row - window``)."""
    j = np.arange(size)
    seen = j <= row if causal else np.ones(size, dtype=bool)
    if window:
        seen &= j > row - window
    return seen


def _describe(causal: bool, window: int | None, scale: float) -> str:
    shown = "none" if window is None else str(window)
    return (f"\"causal\": {'true' if causal else 'false'}, window {shown} and scale "
            f"{scale:.6g}")


def _mass(line: np.ndarray, seen: np.ndarray) -> float:
    """``sum(exp(line[seen]))`` without overflow for a lying ``lse`` (capped near 1e304)."""
    part = line[seen]
    top = part.max()
    return float(np.exp(min(top + np.log(np.exp(part - top).sum()), 700.0)))


def _diagnosis(line: np.ndarray, row: int, causal: bool, window: int | None) -> str:
    """What the arrays say instead, where a simple change of the sidecar explains them.

    Args:
        line: one row's log-weights ``scale * q.k - lse`` against every key.
    """
    size = line.shape[0]

    def fits(flag: bool, width: int | None) -> bool:
        return abs(_mass(line, visible(row, size, flag, width)) - 1.0) <= ROW_SUM_TOLERANCE

    if fits(not causal, None):
        return f"; the arrays are those of {'bidirectional' if causal else 'causal'} attention"
    if causal and row > 0:
        # Mass of the last w keys up to the query, for every w: a window shows where it is 1.
        behind = np.cumsum(np.exp(np.minimum(line[row::-1], 700.0)))
        width = int(np.argmin(np.abs(behind - 1.0))) + 1
        if abs(behind[width - 1] - 1.0) <= ROW_SUM_TOLERANCE:
            if width > row:
                return "; the arrays have no sliding window"
            return f"; the arrays have a sliding window of {width} keys"
    return "; its scale, causal flag or window, or lse, do not match q and k"


def to_float32(stored: np.ndarray, dtype: str) -> np.ndarray:
    """Stored queries or keys as float32 (``bfloat16`` is kept as its uint16 bits)."""
    data = np.asarray(stored)
    if dtype == "bfloat16":
        return (data.astype(np.uint32) << 16).view(np.float32)
    return data.astype(np.float32, copy=False)


def check_rows(folder: Path, layer: int, position: int, *, q: np.ndarray, k: np.ndarray,
               lse: np.ndarray, dtype: str, causal: bool, window: int | None, scale: float,
               tolerance: float = ROW_SUM_TOLERANCE) -> str | None:
    """Recompute sampled rows of one layer; ``None`` when they agree, else the problem.

    Scores are float32 products (an error near 1e-6 of a score: far below the tolerance),
    summed in float64.

    Args:
        position: the layer's place among the recorded layers (picks the key head).
        q: ``[head, T, dim]``, ``k``: ``[kv_head, T, dim]`` as stored (memory-mapped) in
            ``dtype``; ``lse``: ``[head, T]`` float32.
        tolerance: how far a row may sum from 1.
    """
    heads, size, _ = q.shape
    kv_heads = k.shape[0]
    group = heads // kv_heads
    rows = sample_rows(size, layer)
    chosen = sample_heads(position, heads, kv_heads)
    keys = to_float32(k[chosen[0] // group], dtype)  # [T, dim]: one read of one key head
    if not np.isfinite(keys).all():
        return None  # the full check names the file
    for head in chosen:
        queries = to_float32(q[head, rows], dtype)  # [rows, dim]
        stored = np.asarray(lse[head, rows], dtype=np.float64)
        if not (np.isfinite(queries).all() and np.isfinite(stored).all()):
            return None
        with np.errstate(over="ignore", invalid="ignore"):
            scores = (queries @ keys.T).astype(np.float64) * scale  # [rows, T]
        if not np.isfinite(scores).all() or np.abs(scores).max() > _LARGEST_SCORE:
            return None
        for at, row in enumerate(rows):
            line = scores[at] - stored[at]
            seen = visible(row, size, causal, window)
            mass = _mass(line, seen)
            # float32 holds lse and the scores to a relative 6e-8: at magnitudes in the
            # thousands that is more than the tolerance, so it is allowed on top.
            rounding = _FLOAT32_SLACK * max(abs(stored[at]), float(np.abs(scores[at][seen]).max()))
            if not abs(mass - 1.0) <= tolerance + rounding:
                return (f"{folder / 'long.json'} disagrees with the arrays of layer {layer}: "
                        f"under its {_describe(causal, window, scale)}, the weights of "
                        f"query {row} in head {head} sum to {mass:.4g}, not 1 (lse_"
                        f"{layer:03d}.npy against q_{layer:03d}.npy and k_{layer:03d}.npy)"
                        + _diagnosis(line, row, causal, window))
    return None
