"""A model's attention shape read from what it returns, not from its configuration.

Configurations do not always say how many heads a layer runs (ConvBERT's ``head_ratio``
halves them), which layers have attention at all (hybrid models interleave state-space or
recurrent layers and return weights for the attention layers only), or whether the weights
are a ``token x token`` matrix: some models return extra key columns (attention sinks,
compressed memory entries, global tokens), a band of local attention whose columns are
offsets rather than key positions (Longformer, LED, LongT5), or 3-D weights (YOSO).
:func:`probe` runs the model once on a few tokens and reads ``outputs.attentions``; every
path then uses the layer and head counts found there, and refuses, in one line, a model whose
weights are not ``[head, query, key]`` over the tokens (attnviz never drops or guesses a
column).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: The probe's text: a few ordinary words, so every tokenizer gives several tokens.
PROBE_TEXT = "The cat sat on the mat by the door"


@dataclass
class AttentionShape:
    """What the model's own ``outputs.attentions`` hold."""

    num_layers: int  # layers that return attention weights
    num_heads: int  # heads per layer (the same in every layer when ``problem`` is None)
    problem: str | None = None  # why the weights are not token x token; None: they are
    causal: bool = False  # no weight above the diagonal in any layer or head
    #: Every row sums to 1: weights without a sink's share (gpt-oss returns rows that sum to
    #: less, its sink logit taking the rest; GraniteSWA scales its output instead).
    rows_sum_to_one: bool = True


def describe(attentions: Any, size: int, name: str) -> AttentionShape | None:
    """The shape of one run's ``outputs.attentions`` for ``size`` tokens (``None`` when the
    run returned no weights at all: the caller's own message says so).

    Args:
        attentions: the per-layer tensors, ``[batch, head, query, key]`` when all is well.
        size: the number of tokens of the run.
        name: the model's name, for messages.
    """
    if not attentions:
        return None
    layers = [a for a in attentions if a is not None]
    if not layers:
        return None
    what = ("attnviz shows attention between tokens, and does not drop or guess columns")
    for index, weights in enumerate(layers):
        shape = tuple(int(s) for s in weights.shape)
        if len(shape) != 4:
            return AttentionShape(len(layers), 0, (
                f"{name} returns attention weights of shape {shape} in layer {index}, not "
                f"[batch, head, query, key]: {what}"))
        if shape[-2] != size or shape[-1] != size:
            extra = shape[-1] - size
            kind = (f"{extra} key column{'s' if extra != 1 else ''} more than there are tokens "
                    "(attention sinks, memory or global tokens, or a band of local attention "
                    "whose columns are offsets)" if extra > 0 and shape[-2] == size else
                    "a band or block layout of local attention, not query x key positions")
            return AttentionShape(len(layers), int(shape[1]), (
                f"{name} returns attention of shape {shape[1:]} in layer {index} for {size} "
                f"tokens: {kind}; {what}"))
    heads = sorted({int(a.shape[1]) for a in layers})
    if len(heads) > 1:
        return AttentionShape(len(layers), heads[-1], (
            f"{name}'s layers run different numbers of heads ({', '.join(map(str, heads))}); "
            "a capture holds the same heads in every layer"))
    causal = size > 1 and not any(bool(a[..., :size, :size].triu(1).any()) for a in layers)
    sums = [float((a.float().sum(-1) - 1).abs().max()) for a in layers]
    return AttentionShape(len(layers), heads[0], causal=causal,
                          rows_sum_to_one=max(sums) < 1e-4)


def probe(source: Any) -> AttentionShape | None:
    """Run ``source``'s model once on :data:`PROBE_TEXT` with eager attention and describe
    its ``outputs.attentions`` (``None`` when the run fails or returns no weights: the
    capture's own messages then say why).

    Args:
        source: an :class:`~attnviz.models.hf.HFSource` whose model and tokenizer are set.
    """
    import torch

    from attnviz.errors import AttnvizError
    from attnviz.models._torch import routed_attention
    from attnviz.models.hooks import StopForward

    try:
        enc = source.tokenizer(PROBE_TEXT, return_tensors="pt")
        size = int(enc["input_ids"].shape[1])
        inputs = source._model_inputs(enc)
    except Exception:  # noqa: BLE001 - a tokenizer that cannot encode it: the capture says why
        return None
    try:
        with torch.inference_mode(), routed_attention(source.model, "eager"):
            outputs = source._call(inputs, output_attentions=True)
    except (AttnvizError, StopForward):
        return None
    attentions = getattr(outputs, "attentions", None)
    if attentions is None:
        attentions = getattr(outputs, "encoder_attentions", None)
    return describe(attentions, size, source.name)
