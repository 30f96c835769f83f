"""A measure (``norm``, ``alti``...) in place of the attention weights of a Hugging Face capture.

:meth:`~attnviz.models.hf.HFSource.capture` runs the model's usual eager pass (which says
whether the model is causal), then asks :func:`attnviz.measures.compute` for the measure and
keeps the selected layers and heads of it, exactly as it keeps attention weights. The record's
``meta`` names the measure and its conventions, so every figure, table and dump shows it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from attnviz.errors import ModelLoadError, UsageError

if TYPE_CHECKING:
    import numpy as np

TOY_MODEL = "toy"  # attnviz.models.TOY_MODEL (that package imports this module's users)


def check_measure_for(model: str, measure: str | None) -> str:
    """The canonical measure name, checked against the model: the toy model has attention
    weights only (its blocks have no value projection or LayerNorm a measure reads).

    Raises:
        UsageError: an unknown measure, or a measure other than weights for the toy model.
    """
    from attnviz.measures import check_measure

    if measure is not None and not isinstance(measure, str):
        raise UsageError(f"measure must be a name such as \"norm\", not {measure!r:.40}",
                         "the measures are weights, norm, norm-res-ln, alti and value-zeroing")
    name = check_measure(measure or "weights")
    if name != "weights" and model == TOY_MODEL:
        raise UsageError(f"the toy model gives attention weights only, not the measure {name}",
                         "use --measure weights, or a Hugging Face model such as --model "
                         "minilm")
    return name


def measure_meta(measure: str) -> dict[str, Any]:
    """What a capture of ``measure`` adds to its ``meta`` (nothing for attention weights)."""
    from attnviz.measures import conventions

    if measure == "weights":
        return {}
    return {"measure": measure, "measure_conventions": conventions(measure)}


def fill_measure(measure: str, model: Any, inputs: dict[str, Any], config: Any,
                 layers: Sequence[int], heads: Sequence[int], array: np.ndarray, *,
                 name: str) -> None:
    """Compute ``measure`` for one encoded text and copy its selected layers and heads into
    ``array`` (``[layer, head, query, key]``, in memory or a memory map).

    Raises:
        ModelLoadError: the measure returned the wrong number of layers or shapes, or values
            that are not finite.
    """
    import numpy as np

    from attnviz.measures import compute
    from attnviz.models._torch import to_numpy

    tokens = int(array.shape[-1])
    per_layer = compute(measure, model, inputs, config)
    if len(per_layer) <= max(layers, default=-1):
        raise ModelLoadError(f"the measure {measure} gave {len(per_layer)} layers for {name}, "
                             f"which has more", "report this: the measure does not fit "
                             "this model")
    for position, layer in enumerate(layers):
        block = per_layer[layer]  # [batch, head, query, key]
        if tuple(block.shape[-2:]) != (tokens, tokens) or block.shape[1] <= max(heads):
            raise ModelLoadError(f"the measure {measure} gave layer {layer} the shape "
                                 f"{tuple(block.shape)} for {tokens} tokens of {name}",
                                 "report this: the measure does not fit this model")
        values = to_numpy(block[0, list(heads)])  # [head, query, key]
        if not np.isfinite(values).all():
            raise ModelLoadError(f"the measure {measure} is not finite in layer {layer} of "
                                 f"{name} (NaN or infinity)",
                                 "try --dtype float32, or --measure weights")
        array[position] = values
