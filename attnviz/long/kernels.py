"""The tensor arithmetic of long captures: scores, masks, log-sum-exp and weight tiles.

Every function works on one layer's queries ``[head, query, dim]`` and keys
``[kv_head, key, dim]`` (grouped-query attention: query head ``h`` reads key head
``h // group``, as transformers' ``repeat_kv`` does) and walks the query axis in chunks, so no
``T x T`` tensor ever exists: a chunk holds ``heads x rows x keys`` scores, and ``rows`` is
chosen from a byte budget (:func:`chunk_rows`).

Weights are ``exp(scale * q.k - lse)`` under the mask. Key ``j`` is visible to query ``i``
when ``j <= i`` (causal) and ``j > i - window`` (sliding window, as in transformers'
``sliding_window_overlay``).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

#: Score given to masked positions: finite, so ``0 * score`` is 0 (never NaN) after ``exp``.
MASKED = -1e30
#: Scores below this are masked positions.
MASKED_BELOW = -1e29
#: Default bytes one chunk of float32 scores may take: small enough to stay in the CPU's cache
#: (measured fastest on the CPU from 4 to 128 MiB); a few such buffers are live at once.
DEFAULT_CHUNK_BYTES = 8 << 20


def chunk_rows(heads: int, keys: int, budget: int = DEFAULT_CHUNK_BYTES) -> int:
    """Query rows per chunk: a power of two from 16 to 4096 whose ``heads x rows x keys``
    float32 scores fit in ``budget`` bytes (16 rows when even those do not)."""
    rows = max(1, budget // max(1, 4 * heads * keys))
    power = 16
    while power * 2 <= min(rows, 4096):
        power *= 2
    return power


def key_range(q0: int, q1: int, size: int, causal: bool, window: int | None) -> tuple[int, int]:
    """The keys ``[k0, k1)`` that any query in ``[q0, q1)`` can see."""
    k1 = q1 if causal else size
    k0 = max(0, q0 - window + 1) if window else 0
    return k0, k1


def scores(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """``scale * q.k`` for grouped heads.

    Args:
        q: ``[head, rows, dim]`` float32.
        k: ``[kv_head, keys, dim]`` float32; ``head`` is a multiple of ``kv_head``.
        scale: the attention function's ``scaling``.

    Returns:
        ``[head, rows, keys]`` float32.
    """
    heads, rows, dim = q.shape
    kv_heads = k.shape[0]
    group = heads // kv_heads
    grouped = (q * scale).reshape(kv_heads, group * rows, dim)  # [kv_head, group*rows, dim]
    out = torch.bmm(grouped, k.transpose(1, 2))  # [kv_head, group*rows, keys]
    return out.view(heads, rows, k.shape[1])


def apply_mask(s: torch.Tensor, q0: int, k0: int, causal: bool, window: int | None) -> None:
    """Set the masked positions of a ``[..., rows, keys]`` score block to :data:`MASKED`,
    in place; rows start at query ``q0`` and keys at ``k0``."""
    rows, keys = s.shape[-2], s.shape[-1]
    if not causal and not window:
        return
    i = torch.arange(q0, q0 + rows, device=s.device)[:, None]
    j = torch.arange(k0, k0 + keys, device=s.device)[None, :]
    if causal:
        # Only keys from q0 on can lie after a query of the chunk.
        start = max(0, q0 - k0)
        if start < keys:
            s[..., start:].masked_fill_(j[:, start:] > i, MASKED)
    if window:
        # Only keys before q0 + rows - window can fall out of a query's window.
        stop = min(keys, q0 + rows - window + 1 - k0)
        if stop > 0:
            s[..., :stop].masked_fill_(j[:, :stop] <= i - window, MASKED)


def visible_counts(q0: int, q1: int, size: int, causal: bool, window: int | None,
                   device: torch.device | str = "cpu") -> torch.Tensor:
    """How many keys each query in ``[q0, q1)`` sees: ``[rows]`` int64."""
    i = torch.arange(q0, q1, device=device)
    count = i + 1 if causal else torch.full_like(i, size)
    if window:
        count = count.clamp(max=window)
    return count


def lse_chunked(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool,
                window: int | None, budget: int = DEFAULT_CHUNK_BYTES) -> torch.Tensor:
    """Each query row's log-sum-exp of its visible scores, chunk by chunk.

    Args:
        q: ``[head, T, dim]`` float32; ``k``: ``[kv_head, T, dim]`` float32.

    Returns:
        ``[head, T]`` float32.
    """
    heads, size, _ = q.shape
    out = torch.empty(heads, size, dtype=torch.float32, device=q.device)
    rows = chunk_rows(heads, size, budget)
    for q0 in range(0, size, rows):
        q1 = min(size, q0 + rows)
        k0, k1 = key_range(q0, q1, size, causal, window)
        s = scores(q[:, q0:q1], k[:, k0:k1], scale)  # [head, rows, keys]
        apply_mask(s, q0, k0, causal, window)
        # In place: torch.logsumexp's temporaries cost a third more time.
        top = s.amax(dim=-1, keepdim=True)  # [head, rows, 1]
        out[:, q0:q1] = top[..., 0] + s.sub_(top).exp_().sum(dim=-1).log_()
    return out


def log_weight_chunks(q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, scale: float,
                      causal: bool, window: int | None, q0: int, q1: int, *,
                      budget: int = DEFAULT_CHUNK_BYTES, max_rows: int | None = None,
                      align: int = 1) -> Iterator[tuple[int, int, int, torch.Tensor]]:
    """Log-weights ``scale * q.k - lse`` of queries ``[q0, q1)`` against every key they may
    see, in chunks of rows (``exp`` of them are the exact weights).

    The log-sum-exp rides in the matrix product as one more dimension (``[scale * q, -lse]``
    against ``[k, 1]``), which saves a pass over every chunk.

    Args:
        q: ``[head, q1 - q0, dim]`` float32: the queries of rows ``q0..q1`` only.
        k: ``[kv_head, T, dim]`` float32: every key.
        lse: ``[head, q1 - q0]`` float32.
        max_rows: at most this many rows per chunk (a power of two: chunks then never straddle
            a ``max_rows`` boundary when ``q0`` is a multiple of it).
        align: widen each chunk's keys to multiples of this (the extra keys are masked), so
            block reductions over keys are plain reshapes.

    Yields:
        ``(a0, a1, k0, log_weights)``: rows ``a0..a1``, keys from ``k0``, log-weights
        ``[head, a1 - a0, keys]`` float32, :data:`MASKED` where masked.
    """
    size = k.shape[1]
    heads, _rows, dim = q.shape
    kv_heads = k.shape[0]
    group = heads // kv_heads
    widest = key_range(q0, q1, size, causal, window)
    rows = chunk_rows(heads, widest[1] - widest[0], budget)
    if max_rows is not None:
        rows = min(rows, max_rows)
    keys = torch.cat([k, k.new_ones(kv_heads, size, 1)], dim=2)  # [kv_head, T, dim + 1]
    for a0 in range(q0, q1, rows):
        a1 = min(q1, a0 + rows)
        k0, k1 = key_range(a0, a1, size, causal, window)
        k0, k1 = k0 - k0 % align, min(size, -(-k1 // align) * align)
        part = slice(a0 - q0, a1 - q0)
        left = torch.cat([q[:, part] * scale, -lse[:, part, None]], dim=2)  # [head, r, dim+1]
        s = torch.bmm(left.reshape(kv_heads, group * (a1 - a0), dim + 1),
                      keys[:, k0:k1].transpose(1, 2)).view(heads, a1 - a0, k1 - k0)
        apply_mask(s, a0, k0, causal, window)
        yield a0, a1, k0, s
