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
"""

from __future__ import annotations

from typing import Literal

import numpy as np

from attnviz.capture import Capture
from attnviz.errors import UsageError

HeadFusion = Literal["mean", "max", "min"]
FUSIONS: tuple[str, ...] = ("mean", "max", "min")


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


def rollout_weights(weights: np.ndarray, head_fusion: str = "mean") -> np.ndarray:
    """Rollout of a stack of consecutive layers.

    Args:
        weights: ``[layer, head, query, key]`` attention of consecutive layers, lowest first.
        head_fusion: ``mean``, ``max`` or ``min`` over the heads.

    Returns:
        ``[query, key]`` float64 matrix whose rows sum to 1.
    """
    if weights.ndim != 4 or weights.shape[0] == 0:
        raise ValueError("rollout needs weights [layer, head, query, key] with at least one layer")
    per_layer = residual_matrix(fuse_heads(weights, head_fusion))  # [layer, query, key]
    result = per_layer[0]
    for matrix in per_layer[1:]:
        result = matrix @ result
    return result


def rollout(capture: Capture, head_fusion: str = "mean", start_layer: int = 0) -> np.ndarray:
    """Attention rollout of a capture from ``start_layer`` to its last layer.

    Args:
        capture: weights ``[layer, head, query, key]``; the layers from ``start_layer`` to the
            capture's last layer must all be held (heads may be a subset: they are fused).
        head_fusion: ``mean``, ``max`` or ``min``.
        start_layer: the model layer to start from (negative counts from the end).

    Returns:
        ``[query, key]`` float64 matrix; row ``i`` is token ``i``'s rolled-out attention.

    Raises:
        UsageError: the start layer is not held, or a layer above it is missing.
    """
    from attnviz.selection import resolve_index

    start = resolve_index(start_layer, capture.num_layers, "layer")
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
    return rollout_weights(np.asarray(capture.weights[positions], dtype=np.float64), head_fusion)
