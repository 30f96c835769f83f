"""``norm-res-ln``: Kobayashi et al. (2021), attention, residual and LayerNorm together.

"Incorporating Residual and Normalization Layers into Analysis of Masked Language Models"
(EMNLP 2021). In a post-LN layer (BERT) the attention block computes
``y_i = LN(sum_j sum_h alpha^h_ij f_h(x_j) + b_O + x_i)``. Splitting the sum by source token,
``z_ij = sum_h alpha^h_ij f_h(x_j) + [i == j] x_i``, and fixing LayerNorm's scale to the real
input's standard deviation ``s_i`` makes LayerNorm linear, so::

    norm-res-ln[i, j] = || gamma * (z_ij - mean(z_ij)) / s_i ||,  s_i = sqrt(var(LN input_i) + eps)

As in the reference: the residual ``x_i`` goes to ``j = i`` alone; each ``z_ij`` is centred by
its own mean; ``var`` is the biased variance of the real LayerNorm input (which includes
``b_O``); ``b_O`` and LayerNorm's ``beta`` are attributed to no token. The measure is defined per
layer (the residual is not split among heads): the one ``[query, key]`` matrix is repeated for
every head. Rows are not normalised. Pre-LN models (GPT-2, Llama) have no LayerNorm after the
residual sum, so the measure is not defined for them (a UsageError).
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


def norm_res_ln_layers(model: Any, inputs: dict[str, Any], config: Any) -> list[torch.Tensor]:
    """``||LN-transformed attention + residual||`` of every layer, float32 ``[b, h, q, k]``."""
    import torch

    adapter = adapter_for(config, "norm-res-ln")
    records = collect(model, inputs, adapter)
    result = []
    for layer, record in zip(layers_of(model, adapter), records):
        assert record.probs is not None
        batch, heads, tokens, _ = record.probs.shape
        parts = layer_parts(layer, adapter, heads)
        out = torch.zeros(batch, tokens, tokens, dtype=torch.float64,
                          device=record.probs.device)
        for rows, vectors, _ in block_vectors(record, parts, heads, adapter.post_ln):
            out[:, rows] = vectors.norm(dim=-1)
        result.append(per_layer(out, heads))
    return result
