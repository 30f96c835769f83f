"""``alti``: Ferrando et al. (2022), "Measuring the Mixing of Contextual Information in the
Transformer" (EMNLP 2022; ALTI, Aggregation of Layer-wise Token-to-token Interactions).

The attention block's output for token ``i`` is split by source token into transformed vectors
``T_i(x_j)`` (attention, residual and, in a post-LN model, the LayerNorm made linear by fixing
its scale; see :func:`attnviz.measures._collect.block_vectors`), and ``y_i`` is the block's
real output (every bias included). The contribution of ``j`` to ``i`` is how much closer
``T_i(x_j)`` is to ``y_i`` than the zero vector, in L1 distance, clipped at zero and
normalised::

    c_ij = max(0, ||y_i||_1 - ||y_i - T_i(x_j)||_1) / sum_k max(0, ||y_i||_1 - ||y_i - T_i(x_k)||_1)

Rows sum to 1 (a row whose every term is clipped stays 0). ALTI is defined per layer (the
residual is not split among heads): the one ``[query, key]`` matrix is repeated for every head.
:func:`compute` returns these per-layer contributions; the paper's ALTI across layers is their
rollout (``attnviz rollout --measure alti``).

For pre-LN models (GPT-2, Llama) the norm before the attention acts on each token alone, so it
is part of ``f(x_j)`` exactly, ``T_i(x_j) = sum_h alpha^h_ij f_h(LN(x_j)) + [i == j] x_i`` and
``y_i`` is the residual stream after the attention (``+ b_O``). An RMSNorm on the attention's
output before the residual sum (Gemma 2/3, OLMo 2/3) is made linear by fixing its scale to its
real input's root mean square, as the post-LN LayerNorm is; Granite's residual multiplier scales
the attention terms. The rebuilt ``y_i`` is checked against the model's real block output.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from attnviz.measures._collect import (
    adapter_for,
    block_vectors,
    collect,
    layer_parts,
    layers_of,
    per_layer,
)

if TYPE_CHECKING:
    import torch


def alti_layers(model: Any, inputs: dict[str, Any], config: Any) -> list[torch.Tensor]:
    """ALTI contributions of every layer, float32 ``[batch, head, query, key]``, rows sum to 1."""
    import torch

    adapter = adapter_for(config, "alti")
    records = collect(model, inputs, adapter)
    result = []
    for index, (layer, record) in enumerate(zip(layers_of(model, adapter), records)):
        assert record.probs is not None
        batch, heads, tokens, _ = record.probs.shape
        parts = layer_parts(layer, adapter, heads)
        out = torch.zeros(batch, tokens, tokens, dtype=torch.float64,
                          device=record.probs.device)
        for rows, vectors, output in block_vectors(record, parts, heads, adapter, index):
            distance = (output[:, :, None, :] - vectors).abs().sum(-1)  # [B, q, key]
            closeness = (output.abs().sum(-1)[:, :, None] - distance).clamp(min=0)
            total = closeness.sum(-1, keepdim=True)
            out[:, rows] = closeness / torch.where(total > 0, total, torch.ones_like(total))
        result.append(per_layer(out, heads))
    return result
