"""Attention rollout (Abnar and Zuidema, 2020, "Quantifying Attention Flow in Transformers").

Per layer, fuse the heads (mean, max or min), account for the residual connection by mixing in
the identity and renormalising the rows::

    A_l = rownorm(0.5 * fuse(heads of layer l) + 0.5 * I)

then multiply the layers from the first upward::

    R_start = A_start,    R_l = A_l @ R_{l-1}

Row ``i`` of the result says how much of token ``i``'s representation at the top layer can be
traced back to each input token. Every ``A_l`` is row-stochastic, so the rows of ``R`` sum to 1.
In a causal model the matrices are lower triangular and the product piles weight on the first
tokens, which every later token can see: rollout favours early tokens there.

A capture of another measure (``norm``, ``alti``...; ``capture.measure``) is rolled out (or
flowed) the same way from its per-layer matrices. The rows of ``norm`` and ``norm-res-ln`` are
amounts, not distributions: each head's rows are first scaled to sum to 1, and titles say so;
``alti`` and ``value-zeroing`` rows already sum to 1 and are used as they are. ``norm-res-ln``,
``alti`` and ``value-zeroing`` already hold the residual connection, so their layers are
multiplied as they are, without the identity mixed in (``R_l = A_l @ R_{l-1}`` with
``A_l = rownorm(fuse(heads))``), as their authors roll them out (Ferrando et al.'s
``compute_joint_attention(..., res=False)``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from attnviz.analysis.stats import row_normalised
from attnviz.capture import Capture
from attnviz.errors import UsageError

HeadFusion = Literal["mean", "max", "min"]
FUSIONS: tuple[str, ...] = ("mean", "max", "min")
#: Measures whose per-layer matrices already include the residual connection.
RESIDUAL_INSIDE: frozenset[str] = frozenset({"norm-res-ln", "alti", "value-zeroing"})


def fuse_heads(weights: np.ndarray, how: str = "mean") -> np.ndarray:
    """Combine the heads of each layer: ``[layer, head, query, key]`` -> ``[layer, query, key]``.

    ``max`` and ``min`` rows no longer sum to 1; :func:`residual_matrix` renormalises them.
    """
    if how not in FUSIONS:
        raise UsageError(f"unknown head fusion {how!r}", "use mean, max or min")
    data = np.asarray(weights, dtype=np.float64)
    if how == "mean":
        return data.mean(axis=1)
    if how == "max":
        return data.max(axis=1)
    return data.min(axis=1)


def residual_matrix(fused: np.ndarray) -> np.ndarray:
    """``rownorm(0.5 A + 0.5 I)`` for a ``[query, key]`` (or ``[layer, query, key]``) array."""
    size = fused.shape[-1]
    mixed = 0.5 * fused + 0.5 * np.eye(size)
    return mixed / mixed.sum(axis=-1, keepdims=True)  # > 0: the diagonal is at least 0.5


def layer_matrices(weights: np.ndarray, head_fusion: str = "mean", *,
                   residual: bool = True) -> np.ndarray:
    """``[layer, query, key]`` row-stochastic matrices of a stack of layers: the fused heads with
    the identity mixed in (:func:`residual_matrix`), or, with ``residual=False`` (a measure that
    holds the residual already), the fused heads' rows scaled to sum to 1."""
    fused = fuse_heads(weights, head_fusion)
    if residual:
        return residual_matrix(fused)
    sums = fused.sum(axis=-1, keepdims=True)
    return np.divide(fused, sums, out=np.zeros_like(fused), where=sums > 0)


def rollout_weights(weights: np.ndarray, head_fusion: str = "mean", *,
                    residual: bool = True) -> np.ndarray:
    """Rollout of a stack of consecutive layers.

    Args:
        weights: ``[layer, head, query, key]`` attention of consecutive layers, lowest first.
        head_fusion: ``mean``, ``max`` or ``min`` over the heads.
        residual: mix in the identity for the residual connection (see :func:`layer_matrices`).

    Returns:
        ``[query, key]`` float64 matrix whose rows sum to 1.
    """
    if weights.ndim != 4 or weights.shape[0] == 0:
        raise ValueError("rollout needs weights [layer, head, query, key] with at least one layer")
    per_layer = layer_matrices(weights, head_fusion, residual=residual)  # [layer, query, key]
    result = per_layer[0]
    for matrix in per_layer[1:]:
        result = matrix @ result
    return result


def rollout(capture: Capture, head_fusion: str = "mean", start_layer: int = 0,
            combine: Callable[..., np.ndarray] = rollout_weights) -> np.ndarray:
    """Attention rollout of a capture from ``start_layer`` to its last layer.

    Args:
        capture: weights ``[layer, head, query, key]``; the layers from ``start_layer`` to the
            capture's last layer must all be held (heads may be a subset: they are fused).
        head_fusion: ``mean``, ``max`` or ``min``.
        start_layer: the model layer to start from (negative counts from the end).
        combine: how the stack of layers becomes one matrix: :func:`rollout_weights`, or
            attention flow (:func:`attnviz.analysis.flow.flow_weights`).

    Returns:
        ``[query, key]`` float64 matrix; row ``i`` is token ``i``'s rolled-out attention.

    Raises:
        UsageError: the start layer is not held, or a layer above it is missing.
    """
    from attnviz.selection import resolve_index

    try:
        start = resolve_index(start_layer, capture.num_layers, "layer")
    except UsageError as error:  # name the option: "layer 10" alone reads like --layer
        raise UsageError(f"--start-layer: {error.message}", error.hint) from None
    top = max(capture.layers)
    if start > top:
        raise UsageError(f"--start-layer {start_layer} is above the last layer in the capture "
                         f"({top})", f"pick a start layer between {min(capture.layers)} and {top}")
    needed = list(range(start, top + 1))
    missing = [layer for layer in needed if layer not in capture.layers]
    if missing:
        raise UsageError(
            f"rollout needs every layer from {start} to {top}, but the capture lacks "
            f"{', '.join(str(m) for m in missing)}",
            "capture all layers (drop --layers from dump), or raise --start-layer")
    positions = [capture.layers.index(layer) for layer in needed]
    weights = np.asarray(capture.weights[positions], dtype=np.float64)
    if not capture.rows_sum_to_one:  # a measure's amounts (norm): each head's rows to sum to 1
        weights = row_normalised(weights)
    if capture.measure in RESIDUAL_INSIDE:  # the residual is in the measure already
        combine = functools.partial(combine, residual=False)
    return combine(weights, head_fusion)


@dataclass
class RolloutResult:
    """The rollout of one capture, with what a figure of it needs.

    Attributes:
        matrix: ``[query, key]`` float64 rolled-out attention; rows sum to 1.
        tokens: label of each token (both axes).
        index: the token whose row the bar chart shows.
        span: the layers multiplied, e.g. ``"layers 0-5"`` or ``"layer 5"``.
        title: heatmap title (model, span, head fusion and view notes).
        bar_title: title of the bar chart of row ``index``.
    """

    matrix: np.ndarray
    tokens: list[str]
    index: int
    span: str
    title: str
    bar_title: str
    name: str = "Rolled-out attention"

    def summary(self, k: int = 5) -> str:
        """One line with the ``k`` keys of row ``index`` that get the most, largest first."""
        row = self.matrix[self.index]
        order = np.argsort(-row, kind="stable")[:k]
        top = ", ".join(f"{self.tokens[j]} {row[j]:.3f}" for j in order)
        return (f"{self.name} of {self.tokens[self.index]!r} (position {self.index}): "
                f"{top}")


def rollout_view(view: Capture, head_fusion: str = "mean", start_layer: int = 0,
                 token: str | None = None,
                 combine: Callable[..., np.ndarray] = rollout_weights,
                 method: str = "rollout") -> RolloutResult:
    """Rollout of a capture (as shown: words merged or specials dropped) and its titles.

    Args:
        view: weights ``[layer, head, query, key]``; see :func:`rollout` for the layers needed.
        head_fusion: ``mean``, ``max`` or ``min``.
        start_layer: the model layer to start from (negative counts from the end).
        token: the token whose row to single out: a token as shown (first occurrence),
            ``WORD:N`` or a position (see :func:`~attnviz.analysis.tokens.find_token`).
            Default: the last token of a causal model, else position 0 ([CLS]).
        combine: see :func:`rollout` (attention flow passes its own).
        method: ``rollout`` or ``flow``: the name in the titles and the summary.

    Raises:
        UsageError: a layer is missing (see :func:`rollout`), or no such token.
    """
    from attnviz.analysis.tokens import find_token, view_notes
    from attnviz.selection import resolve_index

    matrix = rollout(view, head_fusion, start_layer, combine)
    tokens = view.display_tokens
    index = find_token(tokens, token) if token is not None else (
        view.num_tokens - 1 if view.causal else 0)
    first = resolve_index(start_layer, view.num_layers, "layer")
    span = f"layers {first}-{max(view.layers)}" if first < max(view.layers) else f"layer {first}"
    notes = view_notes(view)
    if not view.rows_sum_to_one:
        notes.append(f"each head's {view.measure} rows scaled to sum to 1")
    title = (f"{view.title_start}attention {method}, {span}, heads fused by {head_fusion}"
             + (f" ({', '.join(notes)})" if notes else ""))
    bar_title = f"{view.title_start}{method} of {tokens[index]!r} (position {index}), {span}"
    name = "Attention flow" if method == "flow" else "Rolled-out attention"
    return RolloutResult(matrix, tokens, index, span, title, bar_title, name)


def save_matrix(path: Path, matrix: np.ndarray) -> Path:
    """Write a matrix as a float32 ``.npy`` file, atomically."""
    from attnviz.fileio import atomic_write

    data = np.ascontiguousarray(matrix, dtype=np.float32)
    return atomic_write(path, lambda handle: np.save(handle, data, allow_pickle=False))
