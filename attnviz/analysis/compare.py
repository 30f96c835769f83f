"""Compare two attention maps: the same text in two models, two texts in one model, a mask on/off.

The difference is ``B - A`` and only defined when the two maps are over the same tokens; then
positive cells are where B attends more than A.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from attnviz.capture import Capture


@dataclass
class Side:
    """One side of a comparison: a ``[query, key]`` matrix and what it shows."""

    capture: Capture
    matrix: np.ndarray  # [query, key]
    layer: int  # model layer index
    head: str  # model head index as text, or "mean"

    @property
    def tokens(self) -> list[str]:
        return self.capture.display_tokens


def side_of(capture: Capture, layer: int, head: int | str) -> Side:
    """The matrix of one layer and head (an index, or ``"mean"`` of the held heads).

    Raises:
        UsageError: the layer or head is not in the capture.
    """
    from attnviz.selection import resolve_index

    shown_layer = resolve_index(layer, capture.num_layers, "layer")
    if head == "mean":
        return Side(capture, capture.mean_matrix(layer), shown_layer, "mean")
    matrix = capture.matrix(layer, int(head))
    return Side(capture, matrix, shown_layer, str(resolve_index(int(head), capture.num_heads,
                                                                "head")))


def tokens_line_up(a: Capture, b: Capture) -> bool:
    """Whether two captures are over the same tokens (display text, ignoring case)."""
    return a.num_tokens == b.num_tokens and all(
        x.lower() == y.lower() for x, y in zip(a.display_tokens, b.display_tokens))


def difference(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``b - a`` of two ``[query, key]`` matrices of the same shape."""
    if a.shape != b.shape:
        raise ValueError(f"matrices differ in shape: {a.shape} vs {b.shape}")
    return np.asarray(b, dtype=np.float64) - np.asarray(a, dtype=np.float64)


def largest_changes(a: np.ndarray, b: np.ndarray, tokens: list[str], k: int = 10
                    ) -> list[dict[str, object]]:
    """The ``k`` cells with the largest ``|b - a|``, largest first (ties: row-major order).

    Returns:
        Dicts with ``query_index``, ``query``, ``key_index``, ``key``, ``a``, ``b`` and
        ``delta`` (``b - a``).
    """
    delta = difference(a, b)
    flat = np.abs(delta).ravel()
    order = np.argsort(-flat, kind="stable")[:max(k, 0)]
    size = delta.shape[1]
    changes: list[dict[str, object]] = []
    for index in order:
        i, j = divmod(int(index), size)
        changes.append({"query_index": i, "query": tokens[i], "key_index": j, "key": tokens[j],
                        "a": float(a[i, j]), "b": float(b[i, j]), "delta": float(delta[i, j])})
    return changes
