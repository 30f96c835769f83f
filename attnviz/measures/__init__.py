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


def conventions(name: str) -> dict[str, Any]:
    """What a capture's sidecar records about its measure (name, reference, conventions)."""
    return {"name": check_measure(name)}


def compute(name: str, model: Any, inputs: dict[str, Any], config: Any) -> list[Any]:
    """One float32 tensor per layer, [batch, head, query, key], of measure ``name``."""
    raise NotImplementedError(f"measure {check_measure(name)!r} is not implemented yet")
