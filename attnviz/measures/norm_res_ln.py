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
every head. Rows are not normalised. Decoders (GPT-2, Llama, Gemma 2, ...) have no LayerNorm
after the residual sum, so the measure is not defined for them (a UsageError).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from attnviz.measures._collect import (
    adapter_for,
    check_value_path,
    collect,
    layer_parts,
    layers_of,
    per_layer,
    probs64,
)

if TYPE_CHECKING:
    import torch


def norm_res_ln_layers(model: Any, inputs: dict[str, Any], config: Any) -> list[torch.Tensor]:
    """``||LN-transformed attention + residual||`` of every layer, float32 ``[b, h, q, k]``.

    The ``[query, key, model]`` vectors are never built: centring and ``gamma`` are linear, so
    with ``c_h(j) = gamma * centre(f_h(x_j))`` and ``c_r(i) = gamma * centre(x_i)``,
    ``||sum_h alpha^h_ij c_h(j) + [i == j] c_r(i)||^2`` is a quadratic form in the heads'
    weights over the per-token Gram matrix ``<c_h(j), c_g(j)>`` (``tokens * heads^2`` numbers).
    """
    import torch

    adapter = adapter_for(config, "norm-res-ln")
    records = collect(model, inputs, adapter)
    result = []
    for index, (layer, record) in enumerate(zip(layers_of(model, adapter), records)):
        assert record.probs is not None and record.residual is not None
        assert adapter.post_ln
        heads = int(record.probs.shape[1])
        parts = layer_parts(layer, adapter, heads)
        assert parts.ln_weight is not None
        gamma = parts.ln_weight
        fx = check_value_path(record, parts, heads, adapter, index)  # [B, H, T, D]
        probs = probs64(record)  # [B, H, query, key]
        residual = record.residual.to(torch.float64)  # [B, T, D]
        pre = torch.einsum("bhqk,bhkd->bqd", probs, fx) + residual  # the LayerNorm's input
        if parts.b_out is not None:
            pre = pre + parts.b_out
        scale = (pre.var(-1, unbiased=False) + parts.ln_eps).sqrt()  # [B, query]
        c_heads = gamma * (fx - fx.mean(-1, keepdim=True))  # [B, H, key, D]
        c_res = gamma * (residual - residual.mean(-1, keepdim=True))  # [B, T, D]
        gram = torch.einsum("bhkd,bgkd->bhgk", c_heads, c_heads)  # [B, H, H, key]
        squared = torch.zeros_like(probs[:, 0])  # [B, query, key]
        for h in range(heads):
            mixed = (gram[:, h, :, None, :] * probs).sum(1)  # sum_g <c_h, c_g> alpha^g
            squared += probs[:, h] * mixed
        # the residual sits on the diagonal: + 2 sum_h alpha^h_ii <c_h(i), c_r(i)> + ||c_r(i)||^2
        cross = torch.einsum("bhid,bid->bhi", c_heads, c_res)  # [B, H, T]
        diagonal = torch.diagonal(probs, dim1=-2, dim2=-1)  # [B, H, T]
        extra = 2 * (diagonal * cross).sum(1) + (c_res ** 2).sum(-1)  # [B, T]
        squared = squared + torch.diag_embed(extra)
        lengths = squared.clamp(min=0).sqrt() / scale[:, :, None]
        result.append(per_layer(lengths, heads))
    return result
