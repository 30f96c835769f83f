"""What every attention record shares (:class:`attnviz.record.AttentionRecord`), so that each
storage gives the same answers and the same errors: index checks, the bounds of a question
and the sinks rule. Imported by the full capture (:mod:`attnviz.capture`) and the long one
(:mod:`attnviz.long.record`) alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from attnviz.errors import UsageError

if TYPE_CHECKING:
    import numpy as np

#: Largest tile (query rows x keys) one call returns: 64 Mi weights, 256 MiB of float32.
MAX_TILE = 64 << 20
#: Largest ``k`` of :meth:`AttentionRecord.topk`.
MAX_TOPK = 1024
#: Largest atlas block of any capture (a capture's own bound: :func:`largest_block`).
MAX_BLOCK = 1 << 20
#: The smallest atlas block a record that computes its weights on demand answers.
MIN_BLOCK = 16
#: Most weights :meth:`AttentionRecord.dense` gathers at once (layers x heads x T x T).
MAX_DENSE = 64 << 20
#: The default threshold of :meth:`AttentionRecord.sinks` (Gu et al., 2024).
SINK_THRESHOLD = 0.3



class _Answers(Protocol):
    """The part of a record :func:`sink_fractions` and :func:`dense_size_check` ask."""

    layers: list[int]
    @property
    def num_tokens(self) -> int: ...

    @property
    def heads(self) -> list[int]: ...

    def received(self, layer: int, head: int | str) -> np.ndarray: ...

    def seen_by(self, layer: int | None = None) -> np.ndarray: ...


# --------------------------------------------------------------------------- shared checks
def format_indices(indices: Sequence[int]) -> str:
    return ", ".join(str(i) for i in indices) if len(indices) <= 12 else (
        f"{indices[0]}..{indices[-1]} ({len(indices)} in all)")


def check_layer(layer: int, num_layers: int, held: Sequence[int]) -> int:
    """The model layer of ``layer`` (negative counts from the end).

    Raises:
        UsageError: not a whole number, out of the model's range, or not held.
    """
    from attnviz.selection import resolve_index

    absolute = resolve_index(layer, num_layers, "layer")
    if absolute not in held:
        raise UsageError(f"layer {layer} is not in this capture: it holds layers "
                         f"{format_indices(held)}",
                         "capture again with that layer selected, or pick one of those")
    return absolute


def check_head(head: int | str, num_heads: int, held: Sequence[int]) -> int | None:
    """The model head of ``head`` (negative counts from the end); ``None`` for ``"mean"``.

    Raises:
        UsageError: not a whole number or ``"mean"``, out of the model's range, or not held.
    """
    from attnviz.selection import resolve_index

    if isinstance(head, str):
        if head.strip().lower() == "mean":
            return None
        try:
            head = int(head)
        except ValueError:
            raise UsageError(f"invalid head {head!r:.40}: expected a number or \"mean\"") \
                from None
    absolute = resolve_index(head, num_heads, "head")
    if absolute not in held:
        raise UsageError(f"head {head} is not in this capture: it holds heads "
                         f"{format_indices(held)}",
                         "capture again with that head selected, or pick one of those")
    return absolute


def check_span(start: int, stop: int | None, size: int, what: str) -> tuple[int, int]:
    """``(start, stop)`` of a ``what`` (query, key) range of a text of ``size`` tokens.

    Raises:
        UsageError: not ``0 <= start < stop <= size``.
    """
    stop = size if stop is None else int(stop)
    start = int(start)
    if not 0 <= start < stop <= size:
        raise UsageError(f"the {what} range {start}:{stop} is outside this capture's "
                         f"{size} tokens", f"give 0 <= start < stop <= {size}")
    return start, stop


def check_tile(rows: int, cols: int) -> None:
    """Refuse a tile of more than :data:`MAX_TILE` weights."""
    if rows * cols > MAX_TILE:
        raise UsageError(f"a tile of {rows} x {cols} weights is too big (at most "
                         f"{MAX_TILE} weights per call)", "ask for smaller tiles")


def check_k(k: int) -> int:
    """``k`` of a top-k question, from 1 to :data:`MAX_TOPK`."""
    if isinstance(k, bool) or not 1 <= int(k) <= MAX_TOPK:
        raise UsageError(f"k must be between 1 and {MAX_TOPK}, got {k}")
    return int(k)


def largest_block(size: int) -> int:
    """The largest atlas block of a text of ``size`` tokens: the smallest power of two that
    holds the text (at least 1024, so the 64-256-1024 pyramid always works), at most
    :data:`MAX_BLOCK`. A larger block would be one cell, padded at great cost."""
    return min(MAX_BLOCK, max(1024, 1 << max(0, int(size) - 1).bit_length()))


def check_block(size: int, block: int, finest: int = MIN_BLOCK) -> int:
    """``block`` as an int, checked for a text of ``size`` tokens.

    Raises:
        UsageError: not a power of two from ``finest`` (16; a record with every weight at
            hand answers smaller blocks too) to :func:`largest_block`.
    """
    block, largest = int(block), largest_block(size)
    if block < finest or block > largest or block & (block - 1):  # one message for every record
        raise UsageError(f"block must be a power of two from {MIN_BLOCK} to {largest} for this "
                         f"capture of {size} tokens, got {block}", "use 64, 256 or 1024")
    return block


def check_threshold(threshold: float) -> float:
    if not 0.0 < float(threshold) < 1.0:
        raise UsageError(f"threshold must be between 0 and 1, got {threshold}")
    return float(threshold)


def seen_counts(size: int, causal: bool, window: int | None) -> np.ndarray:
    """How many queries see each key of a text of ``size`` tokens: ``[T]`` int64."""
    import numpy as np

    j = np.arange(size)
    count = size - j if causal else np.full(size, size)
    return np.minimum(count, window) if window else count


def sink_fractions(record: _Answers, threshold: float) -> np.ndarray:
    """:meth:`AttentionRecord.sinks` from the record's own received attention."""
    import numpy as np

    threshold = check_threshold(threshold)
    total = np.zeros(record.num_tokens)
    for layer in record.layers:
        seen = record.seen_by(layer)
        for head in record.heads:
            mean = np.asarray(record.received(layer, head), dtype=np.float64) / seen
            total += mean > threshold
    return total / (len(record.layers) * len(record.heads))


def dense_size_check(record: Any, what: str) -> None:
    """Refuse :meth:`AttentionRecord.dense` past :data:`MAX_DENSE` weights."""
    size = len(record.layers) * len(record.heads) * record.num_tokens ** 2
    if size > MAX_DENSE:
        raise UsageError(f"{what} needs every weight at once, and this capture of "
                         f"{record.num_tokens} tokens holds {size:,} ({len(record.layers)} "
                         f"layers x {len(record.heads)} heads x {record.num_tokens}^2), more "
                         f"than {MAX_DENSE:,}",
                         "use heatmap, top-k or heads on it, or capture a shorter input "
                         "(--max-tokens N)")
