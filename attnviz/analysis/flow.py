"""Attention flow (Abnar and Zuidema, 2020, "Quantifying Attention Flow in Transformers").

The layers form a graph: one node per token per layer boundary (``layer 0`` holds the input
tokens, ``layer l + 1`` the outputs of model layer ``l``), and an edge from token ``i`` above
layer ``l`` to token ``j`` below it whose capacity is the residual-augmented, row-normalised,
head-fused attention of that layer, the same matrix rollout multiplies::

    A_l = rownorm(0.5 * fuse(heads of layer l) + 0.5 * I)

The flow from top token ``i`` to input token ``j`` is the value of the maximum flow from node
``(top, i)`` to node ``(0, j)`` (networkx's preflow-push). Each row is then divided by
its sum, as in the reference code (``samiraabnar/attention_flow``), so rows sum to 1 like
rollout's. Where rollout multiplies the layers (a sum over every path of the product of its
weights), flow is limited by the narrowest cut between the two tokens.

Cost: ``tokens ** 2`` maximum-flow problems, each on a graph of ``layers * tokens ** 2`` edges;
peaked real attention needs many augmentations. On MiniLM (6 layers), on a busy two-core
machine: about 1 s at 8 tokens, 10 s at 16, 3 minutes at 32. :data:`DEFAULT_MAX_TOKENS` bounds
it.
"""

from __future__ import annotations

import numpy as np

from attnviz.analysis.rollout import RolloutResult, layer_matrices, rollout_view
from attnviz.capture import Capture
from attnviz.errors import UsageError

#: Tokens above which flow refuses to run unless asked (``--max-flow-tokens``).
DEFAULT_MAX_TOKENS = 16
#: The largest ``--max-flow-tokens`` accepted: 64 tokens take most of an hour.
MAX_TOKENS_LIMIT = 64
METHODS: tuple[str, ...] = ("rollout", "flow")


def check_flow_size(tokens: int, max_tokens: int = DEFAULT_MAX_TOKENS) -> None:
    """A UsageError when ``tokens`` exceeds the bound (or the bound its limit)."""
    if not 1 <= max_tokens <= MAX_TOKENS_LIMIT:
        raise UsageError(f"--max-flow-tokens {max_tokens} is out of range: use 1 to "
                         f"{MAX_TOKENS_LIMIT}")
    if tokens > max_tokens:
        raise UsageError(
            f"attention flow over {tokens} tokens is too slow: it solves tokens^2 "
            f"maximum-flow problems on a graph of layers x tokens^2 edges, and the bound is "
            f"{max_tokens} tokens (--max-flow-tokens)",
            f"shorten the text (--max-tokens {max_tokens}), raise --max-flow-tokens (at most "
            f"{MAX_TOKENS_LIMIT}), or use --method rollout")


def flow_weights(weights: np.ndarray, head_fusion: str = "mean",
                 max_tokens: int = DEFAULT_MAX_TOKENS, *, residual: bool = True) -> np.ndarray:
    """Attention flow through a stack of consecutive layers.

    Args:
        weights: ``[layer, head, query, key]`` attention of consecutive layers, lowest first.
        head_fusion: ``mean``, ``max`` or ``min`` over the heads.
        max_tokens: refuse more tokens than this (see the module's note on cost).
        residual: mix in the identity for the residual connection (``False`` for a measure
            that holds it already; see :func:`attnviz.analysis.rollout.layer_matrices`).

    Returns:
        ``[query, key]`` float64 matrix: row ``i`` is the maximum flow from token ``i`` at the top
        to each input token, divided by the row's sum (rows sum to 1).

    Raises:
        UsageError: more tokens than ``max_tokens``.
    """
    import networkx as nx
    from networkx.algorithms.flow import build_residual_network, preflow_push

    if weights.ndim != 4 or weights.shape[0] == 0:
        raise ValueError("flow needs weights [layer, head, query, key] with at least one layer")
    layers, tokens = weights.shape[0], weights.shape[-1]
    check_flow_size(tokens, max_tokens)
    per_layer = layer_matrices(weights, head_fusion, residual=residual)  # [layer, query, key]
    graph = nx.DiGraph()
    for layer in range(layers):
        for i in range(tokens):
            for j in range(tokens):
                if per_layer[layer, i, j] > 0:
                    graph.add_edge((layer + 1, i), (layer, j),
                                   capacity=float(per_layer[layer, i, j]))
    residual = build_residual_network(graph, "capacity")  # built once, reset by each solve
    flows = np.zeros((tokens, tokens))
    for i in range(tokens):
        for j in range(tokens):
            if graph.has_node((0, j)):
                solved = preflow_push(graph, (layers, i), (0, j), residual=residual,
                                      value_only=True)
                flows[i, j] = solved.graph["flow_value"]
    return flows / flows.sum(axis=-1, keepdims=True)  # > 0: (top, i) reaches (0, i)


def flow_view(view: Capture, head_fusion: str = "mean", start_layer: int = 0,
              token: str | None = None, max_tokens: int = DEFAULT_MAX_TOKENS) -> RolloutResult:
    """Attention flow of a capture (as shown) and its titles, like
    :func:`attnviz.analysis.rollout.rollout_view`.

    Raises:
        UsageError: a layer is missing, no such token, or more tokens than ``max_tokens``.
    """
    from functools import partial

    check_flow_size(view.num_tokens, max_tokens)  # before anything else is computed
    return rollout_view(view, head_fusion, start_layer, token,
                        combine=partial(flow_weights, max_tokens=max_tokens), method="flow")
