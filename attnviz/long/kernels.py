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


def _additive(mask: torch.Tensor, size: int, dtype: torch.dtype) -> torch.Tensor:
    """The ``[..., T, T]`` corner of a boolean (``True``: visible) or additive mask, as the
    additive mask of ``dtype`` the fused kernels take (sdpa converts a boolean mask so too)."""
    mask = mask[..., :size, :size]
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
            ~mask, float("-inf"))
    return mask.to(dtype)


def kernel_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     mask: torch.Tensor | None, scale: float, causal: bool
                     ) -> tuple[torch.Tensor, torch.Tensor, str] | None:
    """The attention output and each row's log-sum-exp from one call of torch's fused kernel,
    the call ``scaled_dot_product_attention`` makes for these inputs.

    On the CPU that is ``_scaled_dot_product_flash_attention_for_cpu`` (any mask, as an
    additive mask); on CUDA ``_scaled_dot_product_flash_attention`` (16-bit inputs, no mask)
    or ``_scaled_dot_product_efficient_attention`` (a mask as a bias). Grouped key heads are
    expanded as transformers' ``repeat_kv`` does.

    Args:
        query: ``[1, head, T, dim]``; key, value: ``[1, kv_head, T, dim]`` (same dtype).
        mask: ``None``, or the model's mask (``[1 or B, 1 or head, >= T, >= T]``, boolean or
            additive), already checked to be the causal/window pattern.
        scale: the attention function's ``scaling``; causal: whether query ``i`` sees keys
            ``<= i`` (used when there is no mask).

    Returns:
        ``(output [1, head, T, dim] in the input dtype, lse [head, T] float32, kernel name)``,
        or ``None`` where no fused kernel returning the log-sum-exp takes the inputs (another
        device, head sizes that differ): the caller computes it with :func:`lse_chunked`.
    """
    size, heads = int(query.shape[2]), int(query.shape[1])
    if query.shape[-1] != value.shape[-1] or query.dtype != key.dtype:
        return None
    group = heads // int(key.shape[1])
    if group > 1:  # transformers' repeat_kv: query head h reads key head h // group
        key = key.repeat_interleave(group, dim=1)
        value = value.repeat_interleave(group, dim=1)
    is_causal = causal and mask is None and size > 1
    if query.device.type == "cpu":
        bias = None if mask is None else _additive(mask, size, query.dtype)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, 0.0, is_causal, attn_mask=bias, scale=scale)
        return out, lse[0, :, :size].float(), "flash (CPU)"
    if query.device.type != "cuda":  # pragma: no cover - other accelerators
        return None
    try:  # pragma: no cover - needs CUDA
        if mask is None and query.dtype in (torch.float16, torch.bfloat16) \
                and query.shape[-1] <= 256:
            found = torch.ops.aten._scaled_dot_product_flash_attention(
                query, key, value, 0.0, is_causal, False, scale=scale)
            return found[0], found[1][0, :, :size].float(), "flash (CUDA)"
        bias = None if mask is None else _additive(mask, size, query.dtype).expand(
            1, heads, size, size)
        found = torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, bias, True, 0.0, is_causal, scale=scale)
        return found[0], found[1][0, :, :size].float(), "memory-efficient (CUDA)"
    except torch.OutOfMemoryError:  # pragma: no cover - not a refusal of the inputs
        raise
    except RuntimeError:  # pragma: no cover - a kernel that does not take these inputs
        return None


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


def lse_rows(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool,
             window: int | None, rows: torch.Tensor,
             budget: int = DEFAULT_CHUNK_BYTES) -> torch.Tensor:
    """:func:`lse_chunked` of some query rows only (any order).

    Args:
        q: ``[head, T, dim]`` float32; ``k``: ``[kv_head, T, dim]`` float32.
        rows: ``[n]`` int64 query positions.

    Returns:
        ``[head, n]`` float32.
    """
    heads, size, _ = q.shape
    out = torch.empty(heads, len(rows), dtype=torch.float32, device=q.device)
    step = chunk_rows(heads, size, budget)
    j = torch.arange(size, device=q.device)[None, :]
    for a in range(0, len(rows), step):
        picked = rows[a:a + step].to(q.device)
        s = scores(q[:, picked], k, scale)  # [head, n, T]
        i = picked[:, None]
        hidden = (j > i) if causal else torch.zeros_like(j > i)
        if window:
            hidden = hidden | (j <= i - window)
        s.masked_fill_(hidden, MASKED)
        top = s.amax(dim=-1, keepdim=True)
        out[:, a:a + step] = top[..., 0] + s.sub_(top).exp_().sum(dim=-1).log_()
    return out


def sample_rows(q: torch.Tensor, per_head: int = 8) -> torch.Tensor:
    """Query rows where a log-sum-exp is most likely off: the first and last rows, a few
    between, and each head's rows of the largest query norm (the largest scores, whose float32
    rounding matters most). ``q``: ``[head, T, dim]``; returns sorted unique positions."""
    size = int(q.shape[1])
    picks = [torch.arange(min(4, size)), torch.arange(max(0, size - 8), size),
             torch.linspace(0, size - 1, 8).long()]
    norms = q.norm(dim=-1)  # [head, T]
    picks.append(norms.topk(min(per_head, size), dim=-1).indices.flatten().cpu())
    return torch.unique(torch.cat(picks))


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
