"""One toy attention head for one query token, step by step, with the model's own numbers.

``X -> Q, K, V -> q.k -> q.k / sqrt(d_k) -> softmax -> sum_j w_j V_j``: the trace comes from
:func:`attnviz.models.toy.trace_head` (torch); everything here is numpy on that trace.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from attnviz.models.toy import HeadTrace, ToyConfig


@dataclass
class Explanation:
    """The attention of one query token in one toy head.

    Attributes:
        config: the toy model's settings.
        trace: every intermediate of the head (``x``, ``q``, ``k``, ``v`` ``(T, d)``; ``scores``,
            ``scaled``, ``masked``, ``weights`` ``(T, T)``; ``output`` ``(T, d_k)``).
        query: position of the query token.
        weights: ``(T,)`` the query's softmax weights (sum to 1).
        visible: ``(T,)`` whether each key is visible to the query (not causally masked).
        other: ``(T,)`` the weights with the other choice of scaling (same Q and K): how much
            the softmax saturates without ``1/sqrt(d_k)``, or would without ``--no-scale``.
        contributions: ``(T, d_k)`` ``weights[j] * V[j]``; the rows sum to the output row.
    """

    config: ToyConfig
    trace: HeadTrace
    query: int
    weights: np.ndarray
    visible: np.ndarray
    other: np.ndarray
    contributions: np.ndarray

    def to_dict(self) -> dict[str, Any]:
        """Every number at full precision (masked scores as ``None``), for json output."""
        trace, query = self.trace, self.query

        def listed(values: np.ndarray) -> list[Any]:
            return [None if not np.isfinite(v) else float(v) for v in values]

        return {
            "model": "toy", "config": asdict(self.config), "layer": trace.layer,
            "head": trace.head, "tokens": trace.tokens, "query_index": query,
            "query": trace.tokens[query], "scale": trace.scale, "x": trace.x.tolist(),
            "q": trace.q.tolist(), "k": trace.k.tolist(), "v": trace.v.tolist(),
            "scores": listed(trace.scores[query]), "scaled": listed(trace.scaled[query]),
            "masked": [not bool(v) for v in self.visible], "weights": listed(self.weights),
            "weights_sum": float(self.weights.sum()), "output": listed(trace.output[query]),
            "other_scaling_weights": listed(self.other),
        }


def explain_head(text: str, token: str, layer: int = 0, head: int = 0,
                 config: ToyConfig | None = None) -> Explanation:
    """Trace one toy head on ``text`` for the query ``token``.

    Args:
        text: the input (split into words as the toy model does).
        token: the query: a word (first occurrence), ``WORD:N`` for the N-th, or a position.
        layer: block, 0-based (negative counts from the end).
        head: head, 0-based (negative counts from the end).
        config: the toy model (default :class:`~attnviz.models.toy.ToyConfig`).

    Raises:
        UsageError: the layer, head or token does not exist, or the config is invalid.
    """
    from attnviz.analysis.tokens import find_token
    from attnviz.models.toy import ToyConfig, ToySource, trace_head

    config = config or ToyConfig()
    source = ToySource(config, device="cpu")
    trace = trace_head(source, text, layer, head)
    query = find_token(trace.tokens, token, words_option=False)  # explain has no --words
    weights = trace.weights[query]
    visible = np.isfinite(trace.masked[query])
    # The other choice of scaling, for the saturation note: same Q and K, other divisor.
    other_scale = 1.0 if config.scale else 1.0 / np.sqrt(config.d_k)
    other_scores = np.where(visible, trace.scores[query] * other_scale, -np.inf)
    other = np.exp(other_scores - other_scores.max())
    other /= other.sum()
    contributions = weights[:, None] * trace.v  # (T, d_k)
    return Explanation(config, trace, query, weights, visible, other, contributions)
