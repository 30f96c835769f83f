"""Capture from a model you already hold: a transformers model and its tokenizer, in memory.

Notebook users usually have the model object already (fine-tuned, on a GPU, in bfloat16,
perhaps modified). :func:`capture` takes it as it is, without reloading it and without
changing it for good::

    import attnviz
    cap = attnviz.capture(model, tokenizer, "The cat sat on the mat")
    attnviz.show(cap)

The tokenisation, hooks and capture building are :class:`~attnviz.models.hf.HFSource`'s own;
only loading is skipped. transformers 5 runs models with ``sdpa`` by default, and fused
kernels never build the attention matrix, so for the call the model is switched to
``eager`` attention (``model.set_attn_implementation``) and to eval mode, and both are put
back exactly as they were afterwards, also when the capture fails. A model that cannot switch
gets a clear error that says how to load it instead.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

from attnviz.capture import Capture
from attnviz.errors import ModelLoadError, UsageError
from attnviz.models._torch import attention_configs
from attnviz.models.hf import HFSource

EAGER = "eager"
_MISSING = object()

# One lock per model object: a capture switches the model's attention implementation for the
# duration of the call, so two threads must not capture from the same model at once.
_LOCKS: weakref.WeakKeyDictionary[Any, threading.Lock] = weakref.WeakKeyDictionary()
_LOCKS_GUARD = threading.Lock()


def _lock_for(model: Any) -> threading.Lock:
    with _LOCKS_GUARD:
        lock = _LOCKS.get(model)
        if lock is None:
            lock = _LOCKS[model] = threading.Lock()
        return lock


def attention_implementation(model: Any) -> str | None:
    """The attention implementation a transformers model runs with (``eager``, ``sdpa``...)."""
    config = getattr(model, "config", None)
    value = getattr(config, "_attn_implementation", None)
    return None if value is None else str(value)


@contextlib.contextmanager
def eager_attention(model: Any) -> Iterator[str | None]:
    """Run the block with the model on eager attention; restore every configuration after.

    Yields:
        The implementation the model had (``None`` when it did not say), so callers can
        report it. Every configuration's stored implementation is put back as it was, in
        ``finally``.

    Raises:
        ModelLoadError: the model runs with a fused kernel and refuses to switch.
    """
    before = attention_implementation(model)
    configs = attention_configs(model)
    saved = [(config, config.__dict__.get("_attn_implementation_internal", _MISSING))
             for config in configs]
    if all(getattr(config, "_attn_implementation", EAGER) in (EAGER, None)
           for config in configs):
        yield before
        return
    try:
        _switch_to_eager(model)
        yield before
    finally:
        for config, value in saved:
            if value is _MISSING:
                config.__dict__.pop("_attn_implementation_internal", None)
            else:
                config.__dict__["_attn_implementation_internal"] = value


def _switch_to_eager(model: Any) -> None:
    switch = getattr(model, "set_attn_implementation", None)
    can_switch = getattr(model, "_can_set_attn_implementation", None)
    if callable(switch) and (not callable(can_switch) or can_switch()):
        try:
            switch(EAGER)
        except (ValueError, TypeError, AttributeError, ImportError) as exc:
            raise _cannot_switch(model, str(exc)) from None
        return
    if callable(switch):  # the model says it cannot switch (its attention is not pluggable)
        raise _cannot_switch(model, "it does not support setting its attention implementation")
    # transformers before set_attn_implementation: the configuration attribute.
    config = model.config
    try:
        config._attn_implementation = EAGER
    except (AttributeError, TypeError, ValueError) as exc:
        raise _cannot_switch(model, str(exc)) from None


def _cannot_switch(model: Any, why: str) -> ModelLoadError:
    name = type(model).__name__
    return ModelLoadError(
        f"{name} runs with {attention_implementation(model)!r} attention, which never builds "
        f"the attention weights, and it cannot switch to eager attention for the capture ({why})",
        "load it with attn_implementation=\"eager\", e.g. "
        "AutoModel.from_pretrained(name, attn_implementation=\"eager\"), or pass its "
        "outputs.attentions to Capture.from_attentions(...)")


@contextlib.contextmanager
def eval_mode(model: Any) -> Iterator[bool]:
    """Run the block in eval mode (no dropout); put every module's training flag back after.

    Yields:
        Whether any module was in training mode.
    """
    modules = list(model.modules()) if callable(getattr(model, "modules", None)) else []
    flags = [(module, bool(module.training)) for module in modules]
    training = any(flag for _, flag in flags)
    if training:
        model.eval()
    try:
        yield training
    finally:
        if training:
            for module, flag in flags:
                module.training = flag


def _model_name(model: Any) -> str:
    config = getattr(model, "config", None)
    name = str(getattr(config, "_name_or_path", "") or "").strip()
    return name or type(model).__name__


class OwnModelSource(HFSource):
    """An :class:`HFSource` around a model and tokenizer that are already loaded.

    Nothing is loaded, moved or cast: inputs go to the device of the model's embeddings, and
    the model keeps its dtype. Use :func:`capture` rather than this class: it also switches the
    model to eager attention and eval mode for the call and back.

    Args:
        model: a transformers model (``AutoModel``, ``...ForCausalLM``, ...), any device/dtype.
        tokenizer: its tokenizer.
        name: the model's name in captures and figures; default ``config._name_or_path``.
    """

    def __init__(self, model: Any, tokenizer: Any, *, name: str | None = None) -> None:
        import torch

        _check_objects(model, tokenizer)
        self.name = name or _model_name(model)
        self.device_map = None
        self.max_memory = None
        self.offload_folder = None
        self.fused_other_layers = True
        self.revision = None
        self.location = ""
        self.is_local = False
        self.tokenizer = tokenizer
        self.dtype = getattr(model, "dtype", None) or torch.float32
        self.owner = model
        self._adopt(model, model.config, place=False)

    def identity(self) -> dict[str, object]:
        """An in-memory model has no files to fingerprint: its captures are never cached."""
        return {"model": self.name, "object": id(self.owner), "dtype": str(self.dtype)}

    def encode(self, text: str, pair: str | None, max_tokens: int | None,
               truncate: bool = True) -> tuple[Any, list[str]]:
        """:meth:`HFSource.encode`, and a check that the ids fit the model's vocabulary."""
        enc, warnings = super().encode(text, pair, max_tokens, truncate)
        _check_vocabulary(self.owner, self.tokenizer, enc["input_ids"])
        return enc, warnings


def _check_objects(model: Any, tokenizer: Any) -> None:
    if not hasattr(model, "config") or not callable(model):
        if hasattr(tokenizer, "config") and callable(getattr(model, "convert_ids_to_tokens",
                                                             None)):
            raise UsageError("the model and the tokenizer are swapped",
                             "call attnviz.capture(model, tokenizer, text)")
        raise UsageError(
            f"attnviz.capture needs a transformers model, got {type(model).__name__}",
            "for any other model, run it yourself and pass the attention weights to "
            "Capture.from_attentions(attentions, tokens)")
    if not callable(tokenizer) or not callable(getattr(tokenizer, "convert_ids_to_tokens", None)):
        raise UsageError(f"attnviz.capture needs the model's tokenizer, got "
                         f"{type(tokenizer).__name__}",
                         "pass AutoTokenizer.from_pretrained(<the model's name>)")


def _check_placed(model: Any) -> None:
    """Refuse a model whose weights were never loaded (still on the ``meta`` device)."""
    if getattr(model, "hf_device_map", None):
        return  # dispatched by Accelerate: offloaded weights sit on meta until their turn
    parameters = getattr(model, "parameters", None)
    if not callable(parameters):
        return
    for parameter in parameters():
        if getattr(getattr(parameter, "device", None), "type", None) == "meta":
            raise UsageError(
                f"{type(model).__name__} has its weights on the meta device: they were never "
                "loaded, so it cannot run",
                "load the weights, e.g. AutoModel.from_pretrained(name), or "
                "model.to_empty(device=\"cpu\") and load a state dict")


def _check_vocabulary(model: Any, tokenizer: Any, ids: Any) -> None:
    """Refuse token ids past the model's embedding table: the tokenizer is another model's."""
    try:
        embeddings = model.get_input_embeddings()
        size = int(embeddings.num_embeddings)
    except (AttributeError, NotImplementedError, TypeError, ValueError):
        return
    largest = int(ids.max()) if getattr(ids, "numel", lambda: 0)() else -1
    if largest >= size:
        try:
            known = f"; {type(tokenizer).__name__} has {len(tokenizer)} tokens"
        except TypeError:
            known = ""
        raise UsageError(
            f"the tokenizer does not match the model: it gives token id {largest}, but the "
            f"model's vocabulary has {size} tokens (ids 0..{size - 1}){known}",
            "pass the tokenizer saved with the model: "
            "AutoTokenizer.from_pretrained(<the model's name or folder>)")


def capture(model: Any, tokenizer: Any, text: str, pair: str | None = None, *,
            layers: str | int | Sequence[int] | None = None,
            heads: str | int | Sequence[int] | None = None,
            max_tokens: int | None = None, truncate: bool = True,
            name: str | None = None, measure: str = "weights") -> Capture:
    """Capture the attention of a model you already hold on ``text`` (and ``pair``).

    The model is neither reloaded nor moved; for the call it runs with eager attention and in
    eval mode, and both are restored afterwards (``capture.meta["attn_implementation"]`` is
    what the capture ran with, ``"eager"``; ``meta["model_attn_implementation"]`` the model's
    own setting, and ``meta["attn_switch"]`` says when it was switched). Captures of in-memory
    models are not cached: the model may change between calls.

    Args:
        model: a transformers model on any device, in any dtype.
        tokenizer: its tokenizer.
        text: the input text; ``pair`` an optional second sentence.
        layers: layers to keep, as ``"0,2-4"``, an int or a list of ints (``None``: all).
        heads: heads to keep, likewise.
        max_tokens: token limit; ``truncate`` whether to cut past it (with a warning in
            ``capture.meta["warnings"]``) or raise :class:`~attnviz.errors.InputError`.
        name: the model's name in the capture; default ``config._name_or_path``.
        measure: ``weights`` (attention) or a measure of :mod:`attnviz.measures` (``norm``,
            ``norm-res-ln``, ``alti``, ``value-zeroing``), computed from the same model.

    Returns:
        The capture, weights ``[layer, head, query, key]`` in float32.

    Raises:
        UsageError: not a model and tokenizer (or a tokenizer of another model), a model
            whose weights are on the meta device, or a layer/head out of range.
        InputError: the text is empty or too long (with ``truncate=False``).
        ModelLoadError: the model cannot give attention weights (e.g. a fused kernel only).
    """
    from attnviz.checks import _checked_request, _resolve
    from attnviz.models._measure import check_measure_for

    measure = check_measure_for("", measure)
    # Texts, selections (floats, booleans, strings in lists, [] refused) and max_tokens.
    layer_text, head_text = _checked_request(text, pair, layers, heads, max_tokens)
    _check_objects(model, tokenizer)
    _check_placed(model)
    with _lock_for(model), eager_attention(model) as before, eval_mode(model) as training:
        source = OwnModelSource(model, tokenizer, name=name)
        layer_list, head_list = _resolve(source, layer_text, head_text)
        try:
            result = source.capture(text, pair, layers=layer_list, heads=head_list,
                                    max_tokens=max_tokens, truncate=truncate, measure=measure)
        except ModelLoadError as error:
            switched = before not in (None, EAGER)
            note = (f" (the model runs with {before!r} attention and was switched to eager "
                    "for the capture)") if switched else ""
            hint = error.hint
            if error.message.startswith("the forward pass"):
                # HFSource's hint names command-line flags; say what to do in Python instead.
                hint = ("check that the model runs on this input by itself: "
                        "model(**tokenizer(text, return_tensors=\"pt\").to(model.device))"
                        + ("; if it fails only with eager attention, it cannot give its "
                           "attention weights" if switched else ""))
            raise ModelLoadError(f"{error.message}{note}", hint) from None
    meta = result.meta
    meta["source"] = "model object"
    meta["attn_implementation"] = EAGER  # what the weights come from
    meta["model_attn_implementation"] = before or EAGER
    if before not in (None, EAGER):
        meta["attn_switch"] = f"ran with eager attention for the capture, then back to {before}"
    if training:
        meta.setdefault("warnings", []).append(
            "the model was in training mode: captured in eval mode (no dropout), then switched "
            "back to training mode")
    return result


__all__ = ["capture", "eager_attention", "eval_mode", "attention_implementation",
           "OwnModelSource"]
