"""Capture post-softmax attention from the selected layers only, with forward hooks.

Asking a model for ``output_attentions=True`` keeps every layer's ``[batch, head, query, key]``
weights alive until the forward pass ends, so peak memory grows with the number of layers times
the square of the input length. Here a forward hook sits on the attention module of each
selected layer only (the TransformerLens hook-point idea: a pass-through right after the
softmax, removed in ``finally``). With eager attention, every Hugging Face attention module of
transformers 5 returns ``(attn_output, attn_weights)``; the hook hands the weights of the
selected heads to a *sink* (which copies them into a preallocated or memory-mapped array) and
the model drops its own reference when the layer returns. Optionally:

* the layers that are not selected run with the fused ``sdpa`` kernel, which never builds the
  ``[query, key]`` matrix at all (they still run: later layers depend on them);
* the forward pass stops right after the last selected layer, since nothing after it can
  change the captured weights.

A hook that finds no weights, or weights that are not a softmax, marks the recording as failed
and the caller falls back to ``output_attentions=True``.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import cast

import torch
from torch import nn

# (model layer, weights [batch, selected head, query, key]) -> None
LayerSink = Callable[[int, torch.Tensor], None]

# How far a row of captured weights may sum from 1 (bfloat16 weights of long rows drift).
_ROW_SUM_TOLERANCE = 0.05


class StopForward(Exception):  # noqa: N818 - a control-flow signal, not an error
    """Raised by the hook of the last selected layer to skip the rest of the forward pass."""


def _is_self_attention(name: str, module: nn.Module) -> bool:
    kind = type(module).__name__
    if not kind.endswith("Attention") or "cross" in kind.lower() or "cross" in name.lower():
        return False
    return not bool(getattr(module, "is_cross_attention", False))


def _first_attention(layer: nn.Module) -> nn.Module | None:
    found = [(n, m) for n, m in layer.named_modules() if n and _is_self_attention(n, m)]
    for _, module in found:
        if type(module).__name__.endswith("SelfAttention"):
            return module
    return found[0][1] if found else None


def find_attention_modules(model: nn.Module, num_layers: int) -> list[nn.Module] | None:
    """The self-attention module of every layer, in layer order.

    Tries, in turn: modules whose class name ends in ``Attention`` and that carry their layer
    index (``layer_idx``, set by transformers for every recent architecture); then the first
    ``...SelfAttention`` / ``...Attention`` module inside each entry of the model's stack of
    layers (the ``nn.ModuleList`` with ``num_layers`` entries: ``encoder.layer``, ``h``,
    ``layers``). Cross-attention modules are skipped.

    Returns:
        ``num_layers`` distinct modules, or ``None`` when the layers cannot be mapped one to one
        (e.g. ALBERT, whose layers share one module); callers then use ``output_attentions``.
    """
    if num_layers < 1:
        return None
    by_index: dict[int, nn.Module] = {}
    duplicated = False
    for name, module in model.named_modules():
        index = getattr(module, "layer_idx", None)
        if not _is_self_attention(name, module) or not isinstance(index, int) or isinstance(
                index, bool):
            continue
        if index in by_index and by_index[index] is not module:
            duplicated = True
        by_index.setdefault(index, module)
    if not duplicated and sorted(by_index) == list(range(num_layers)):
        return [by_index[i] for i in range(num_layers)]
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) == num_layers:
            found = [_first_attention(layer) for layer in module]
            if all(m is not None for m in found) and len({id(m) for m in found}) == num_layers:
                return [m for m in found if m is not None]
    return None


@dataclass
class Recording:
    """What the hooks saw during one forward pass."""

    layers: list[int]
    seen: list[int] = field(default_factory=list)
    problem: str | None = None

    @property
    def complete(self) -> bool:
        """Every selected layer handed valid weights to the sink."""
        return self.problem is None and sorted(self.seen) == sorted(self.layers)


def _check_weights(weights: object, num_heads: int | None) -> str | None:
    """Why ``weights`` is not a ``[batch, head, query, key]`` softmax, or ``None`` if it is."""
    if not isinstance(weights, torch.Tensor):
        return "the attention module returned no weights"
    if weights.dim() != 4 or weights.shape[-1] != weights.shape[-2]:
        return f"the attention module returned a tensor of shape {tuple(weights.shape)}"
    if num_heads is not None and weights.shape[1] != num_heads:
        return f"the attention module returned {weights.shape[1]} heads, not {num_heads}"
    if weights.numel():
        sums = weights.sum(dim=-1, dtype=torch.float32)  # [batch, head, query]
        deviation = float((sums - 1.0).abs().max())
        if not deviation <= _ROW_SUM_TOLERANCE:  # also catches NaN
            return "the attention module returned weights whose rows do not sum to 1"
    return None


@contextlib.contextmanager
def record_attention(
    modules: Sequence[nn.Module],
    layers: Sequence[int],
    heads: Sequence[int] | None,
    sink: LayerSink,
    *,
    num_heads: int | None = None,
    stop_after_last: bool = True,
    fused_other_layers: bool = False,
) -> Iterator[Recording]:
    """Hook the attention modules of ``layers`` for the forward passes run inside the block.

    Args:
        modules: one attention module per model layer (:func:`find_attention_modules`).
        layers: model layers to capture (absolute indices).
        heads: heads to keep (absolute indices); all when ``None``.
        sink: called as ``sink(layer, weights)`` with weights ``[batch, head, query, key]`` of
            the kept heads, on the model's device and dtype; it must copy what it keeps.
        num_heads: the model's heads per layer, to check what the modules return.
        stop_after_last: raise :class:`StopForward` after the last selected layer; the caller
            catches it (the rest of the network cannot change the captured weights).
        fused_other_layers: run the unselected layers before the last selected one with
            ``sdpa``, which never materialises their attention matrices. Their outputs then
            differ from eager attention in the last bits (about 1e-7).

    Yields:
        A :class:`Recording` that says which layers were captured and what went wrong, if
        anything. Hooks and swapped configurations are removed in ``finally``.
    """
    recording = Recording(layers=list(layers))
    if not layers:
        yield recording
        return
    last = max(layers)
    index = torch.as_tensor(list(heads), dtype=torch.long) if heads is not None else None
    handles: list[torch.utils.hooks.RemovableHandle] = []
    swapped: list[tuple[nn.Module, object]] = []

    def make_hook(layer: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: object, output: object) -> None:
            weights = output[1] if isinstance(output, tuple) and len(output) > 1 else None
            problem = _check_weights(weights, num_heads)
            if problem is not None:
                recording.problem = f"layer {layer}: {problem}"
                raise StopForward
            weights = cast(torch.Tensor, weights)
            if index is not None:
                weights = weights.index_select(1, index.to(weights.device))
            sink(layer, weights)
            recording.seen.append(layer)
            if stop_after_last and layer == last:
                raise StopForward

        return hook

    try:
        for layer in sorted(set(layers)):
            handles.append(modules[layer].register_forward_hook(make_hook(layer)))
        if fused_other_layers:
            selected = set(layers)
            for layer, module in enumerate(modules):
                if layer in selected or layer > last:
                    continue
                config = getattr(module, "config", None)
                if config is None or not hasattr(config, "_attn_implementation"):
                    continue
                fused = copy.copy(config)
                # Set the private field directly: the property setter would also rewrite the
                # sub-configurations, which the copy shares with the model.
                fused.__dict__["_attn_implementation_internal"] = "sdpa"
                swapped.append((module, config))
                setattr(module, "config", fused)  # noqa: B010 - nn.Module's typed __setattr__
        yield recording
    finally:
        for handle in handles:
            handle.remove()
        for module, config in swapped:
            setattr(module, "config", config)  # noqa: B010


def is_causal_block(weights: torch.Tensor, rows: int = 256) -> bool:
    """Whether every head puts exactly zero weight above the diagonal.

    Args:
        weights: ``[head, query, key]`` with query and key of equal length.
        rows: query rows checked at a time, to keep the extra memory small.
    """
    size = weights.shape[-1]
    if size < 2:
        return False
    for start in range(0, size, rows):
        block = weights[:, start : start + rows, :]  # [head, rows, key]
        if bool(torch.triu(block, diagonal=start + 1).any()):
            return False
    return True
