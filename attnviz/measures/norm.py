"""``norm``: the norm-based analysis of Kobayashi et al. (2020), "Attention is Not Only a Weight".

Head ``h`` of a layer writes ``sum_j alpha^h_ij f_h(x_j)`` into token ``i``, where
``f_h(x) = (x W_V^h + b_V^h) W_O^h`` is the value projection followed by head ``h``'s rows of the
output projection. The contribution of token ``j`` to token ``i`` in head ``h`` is the length of
that term::

    norm[h, i, j] = || alpha^h_ij f_h(x_j) || = alpha^h_ij || f_h(x_j) ||

Biases: the value bias ``b_V`` is part of ``f_h(x_j)`` (it is added to every value vector before
the weighting, as in the reference code); the output bias ``b_O`` is added once after the heads
are summed, belongs to no token and is left out. ``x`` is what the value projection reads: the
layer's input in BERT, the pre-norm output ``LN(x)`` / ``RMSNorm(x)`` in GPT-2 and Llama. In
grouped-query attention, head ``h`` uses its group's value head. Rows are not normalised.
``f`` ends at the output projection: a norm or factor applied to the attention's output later
(Gemma 2/3's and OLMo 2/3's output RMSNorm, Granite's residual multiplier) is not part of it,
as BERT's LayerNorm is not (``alti`` includes them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from attnviz.measures._collect import (
    adapter_for,
    check_value_path,
    collect,
    layer_parts,
    layers_of,
)

if TYPE_CHECKING:
    import torch


def norm_layers(model: Any, inputs: dict[str, Any], config: Any) -> list[torch.Tensor]:
    """``||alpha f(x)||`` of every layer: one float32 ``[batch, head, query, key]`` per layer."""
    import torch

    adapter = adapter_for(config, "norm")
    records = collect(model, inputs, adapter)
    layers = layers_of(model, adapter)
    result = []
    for index, (layer, record) in enumerate(zip(layers, records)):
        assert record.probs is not None
        heads = int(record.probs.shape[1])
        parts = layer_parts(layer, adapter, heads)
        lengths = check_value_path(record, parts, heads, adapter, index).norm(dim=-1)  # [B,H,k]
        probs = record.probs.to(torch.float64)  # [B, H, query, key]
        result.append((probs * lengths[:, :, None, :]).to(torch.float32))
    return result
