"""Measures beyond raw attention weights, each shaped like the weights: [layer, head, query, key].

``weights`` is the attention itself. The others are computed from one hooked forward pass of a
Hugging Face model (see docs/analysis.md for each definition and its conventions):

- ``norm``: Kobayashi et al. 2020, ||alpha_ij f(x_j)||;
- ``norm-res-ln``: Kobayashi et al. 2021, with the residual and LayerNorm;
- ``alti``: Ferrando et al. 2022, per layer (rollout combines layers);
- ``value-zeroing``: Mohebbi et al. 2023.

The public contract (used by models/, the session, the CLI and the server):

- ``MEASURES``: the names, ``weights`` first;
- ``check_measure(name) -> str``: the canonical name, or ``UsageError`` naming the choices;
- ``conventions(name) -> dict``: what the sidecar records about the measure;
- ``check_supported(name, config) -> str``: the same check ``compute`` makes, from the config
  alone (before the weights load);
- ``compute(name, model, inputs, config) -> list[torch.Tensor]``: one float32 tensor per layer,
  ``[batch, head, query, key]``, for every layer and head of the model.
"""

from __future__ import annotations

from typing import Any

from attnviz.errors import UsageError

MEASURES: tuple[str, ...] = ("weights", "norm", "norm-res-ln", "alti", "value-zeroing")


def check_measure(name: str) -> str:
    """The canonical measure name, or a UsageError naming the choices."""
    canonical = name.strip().lower().replace("_", "-")
    if canonical not in MEASURES:
        raise UsageError(f"unknown measure {name!r}: choose one of {', '.join(MEASURES)}")
    return canonical


_CONVENTIONS: dict[str, dict[str, Any]] = {
    "norm": {
        "label": "norm ||αf(x)||",
        "reference": "Kobayashi et al. 2020, Attention is Not Only a Weight (EMNLP)",
        "formula": "||alpha^h_ij (x_j W_V^h + b_V^h) W_O^h||",
        "per_head": True,
        "rows": "not normalised",
        "biases": "value bias included; output bias left out (added once, to no token)",
    },
    "norm-res-ln": {
        "label": "norm ||LN(Σαf(x) + x)||",
        "reference": "Kobayashi et al. 2021, Incorporating Residual and Normalization Layers "
                     "into Analysis of Masked Language Models (EMNLP)",
        "formula": "||gamma * (z_ij - mean(z_ij)) / sqrt(var(LN input_i) + eps)||, "
                   "z_ij = sum_h alpha^h_ij f_h(x_j) + [i == j] x_i",
        "per_head": False,
        "rows": "not normalised",
        "biases": "output bias and LayerNorm bias left out; value bias included",
    },
    "alti": {
        "label": "ALTI contributions",
        "reference": "Ferrando et al. 2022, Measuring the Mixing of Contextual Information in "
                     "the Transformer (EMNLP)",
        "formula": "max(0, ||y_i||_1 - ||y_i - T_i(x_j)||_1), rows normalised",
        "per_head": False,
        "rows": "sum to 1",
        "biases": "y_i includes every bias; T_i(x_j) none but the value bias",
    },
    "value-zeroing": {
        "label": "value zeroing",
        "reference": "Mohebbi et al. 2023, Quantifying Context Mixing in Transformers (EACL)",
        "formula": "cosine distance between layer output i with and without token j's value, "
                   "rows normalised",
        "per_head": False,
        "rows": "sum to 1",
        "biases": "the whole value vector (with its bias) is zeroed",
    },
}


def conventions(name: str) -> dict[str, Any]:
    """What a capture's sidecar records about its measure (name, reference, conventions).

    ``weights`` records only its name. ``per_head`` is ``False`` for the measures defined per
    layer: their one ``[query, key]`` matrix is repeated for every head. Every measure is
    computed in float64 and stored as float32.
    """
    canonical = check_measure(name)
    if canonical == "weights":
        return {"name": canonical}
    return {"name": canonical, **_CONVENTIONS[canonical], "computed_in": "float64",
            "see": "docs/analysis.md"}


def check_supported(name: str, config: Any) -> str:
    """The canonical measure name if ``config``'s model type supports it, else a UsageError
    naming the model type and the measures that work (read from ``config.json`` alone, so it can
    run before any weights load)."""
    canonical = check_measure(name)
    if canonical != "weights":
        from attnviz.measures._collect import adapter_for

        adapter_for(config, canonical)
    return canonical


def compute(name: str, model: Any, inputs: dict[str, Any], config: Any) -> list[Any]:
    """One float32 tensor per layer, ``[batch, head, query, key]``, of measure ``name``.

    The tensors are on the model's device. The measures defined per layer (``per_head`` false
    in :func:`conventions`) repeat the layer's matrix for every head.

    Args:
        name: a measure (see :data:`MEASURES`).
        model: a Hugging Face model loaded with eager attention, of a model type with an
            adapter (:func:`attnviz.measures._adapters.supported_text` lists the types and
            the measures each supports; docs/analysis.md has the table).
        inputs: the model's keyword arguments (``input_ids``, ``attention_mask``, ...).
        config: the model's configuration (its ``model_type`` picks the architecture).

    Raises:
        UsageError: unknown measure, or a measure not defined for the model type.
        ModelLoadError: no eager attention weights, or the model's own pass differs from what
            the adapter rebuilds from its parameters (an option the adapter does not model).
    """
    canonical = check_measure(name)
    if canonical == "weights":
        from attnviz.measures._collect import eager_weights

        return eager_weights(model, inputs)
    if canonical == "norm":
        from attnviz.measures.norm import norm_layers

        return norm_layers(model, inputs, config)
    if canonical == "norm-res-ln":
        from attnviz.measures.norm_res_ln import norm_res_ln_layers

        return norm_res_ln_layers(model, inputs, config)
    if canonical == "alti":
        from attnviz.measures.alti import alti_layers

        return alti_layers(model, inputs, config)
    from attnviz.measures.value_zeroing import value_zeroing_layers

    return value_zeroing_layers(model, inputs, config)
