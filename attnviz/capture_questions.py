"""How a materialised capture (:class:`attnviz.capture.Capture`) answers the record's
questions (:class:`attnviz.record.AttentionRecord`) from its array.

The answers have the types, bounds and errors of every other storage: a tile is exact
float32, top-k puts ``-1`` and 0 where a query sees fewer keys and breaks ties by the lower key
position, the atlas sums and takes the largest weight over blocks of tokens, received
attention is a column sum in float64.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from attnviz.capture_checks import (
    check_block,
    check_k,
    check_span,
    check_tile,
    seen_counts,
)

if TYPE_CHECKING:
    import numpy as np


class Capture(Protocol):
    """What these answers read of a :class:`attnviz.capture.Capture` (named structurally:
    the record imports this module)."""

    weights: Any
    layers: list[int]
    heads: list[int]
    causal: bool
    @property
    def num_tokens(self) -> int: ...

    def layer_position(self, layer: int) -> int: ...

    def head_index(self, head: int | str) -> int | None: ...

    def matrix(self, layer: int, head: int) -> np.ndarray: ...

    def mean_matrix(self, layer: int) -> np.ndarray: ...


def head_matrix(capture: Capture, layer: int, head: int | str) -> np.ndarray:
    """The ``[query, key]`` float32 matrix of one head, or the mean of the held heads."""
    index = capture.head_index(head)
    return capture.mean_matrix(layer) if index is None else capture.matrix(layer, index)


def tile(capture: Capture, layer: int, head: int | str, q0: int, q1: int, k0: int, k1: int
         ) -> np.ndarray:
    import numpy as np

    position = capture.layer_position(layer)
    index = capture.head_index(head)
    q0, q1 = check_span(q0, q1, capture.num_tokens, "query")
    k0, k1 = check_span(k0, k1, capture.num_tokens, "key")
    check_tile(q1 - q0, k1 - k0)
    block = capture.weights[position]
    if index is None:
        part = np.asarray(block[:, q0:q1, k0:k1], dtype=np.float32).mean(axis=0)
    else:
        part = block[capture.heads.index(index), q0:q1, k0:k1]
    return np.array(part, dtype=np.float32)


def topk(capture: Capture, layer: int, head: int | str, k: int, q0: int = 0,
         q1: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    import numpy as np

    k = check_k(k)
    q0, q1 = check_span(q0, q1, capture.num_tokens, "query")
    matrix = head_matrix(capture, layer, head)[q0:q1]
    size = capture.num_tokens
    width = min(k, size)  # as every record: k past the keys lists them all
    order = np.argsort(-matrix, axis=1, kind="stable")[:, :width]  # ties: lower key first
    values = np.take_along_axis(matrix, order, axis=1).astype(np.float32)
    indices = order.astype(np.int64)
    if capture.causal:  # keys after the query are masked: never listed
        hidden = indices > np.arange(q0, q1)[:, None]
        indices = np.where(hidden, -1, indices)
        values = np.where(hidden, np.float32(0), values)
        # a masked key may sort before a visible key of weight 0: visible ones first
        keep = np.argsort(hidden, axis=1, kind="stable")
        indices = np.take_along_axis(indices, keep, axis=1)
        values = np.take_along_axis(values, keep, axis=1)
    return indices, values.astype(np.float32)


def atlas(capture: Capture, layer: int, head: int | str, block: int
          ) -> tuple[np.ndarray, np.ndarray]:
    import numpy as np

    block = check_block(capture.num_tokens, block, finest=1)
    matrix = head_matrix(capture, layer, head)
    size = capture.num_tokens
    nb = -(-size // block)
    pad = nb * block - size
    padded = np.pad(matrix.astype(np.float64), ((0, pad), (0, pad)))
    shaped = padded.reshape(nb, block, nb, block)
    return (shaped.sum(axis=(1, 3)).astype(np.float32),
            shaped.max(axis=(1, 3)).astype(np.float32))


def head_stats(capture: Any) -> dict[str, np.ndarray]:
    from attnviz.capture_stats import stat_sums

    return stat_sums(capture).means()


def received(capture: Capture, layer: int, head: int | str) -> np.ndarray:
    import numpy as np

    position = capture.layer_position(layer)
    index = capture.head_index(head)
    block = capture.weights[position]
    if index is None:
        return np.asarray(block, dtype=np.float64).sum(axis=1).mean(axis=0)
    return np.asarray(block[capture.heads.index(index)], dtype=np.float64).sum(axis=0)


def seen_by(capture: Capture, layer: int | None = None) -> np.ndarray:
    if layer is not None:
        capture.layer_position(layer)
    return seen_counts(capture.num_tokens, capture.causal, None)
