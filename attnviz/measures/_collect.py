"""One hooked forward pass that collects what every measure needs, layer by layer.

Each supported architecture has an adapter that knows where a layer keeps its value and output
projections and its LayerNorm. The pass records, per layer:

* the layer's input (the residual stream that the attention block adds back);
* the attention's input (the same tensor in a post-LN model such as BERT; the pre-norm output
  ``LN(x)`` or ``RMSNorm(x)`` in GPT-2 and Llama);
* the attention probabilities from the eager attention module, ``[batch, head, query, key]``;
* the layer's own arguments and output (value zeroing reruns the layer with them).

Value vectors are recomputed from the attention input and the layer's parameters in float64,
so every measure is computed in float64 and returned as float32.

The architectures and their adapters are in :mod:`attnviz.measures._adapters`. Every layer's
value path is checked against the model's own output projection before a number is returned
(:func:`check_value_path`), so an option the adapter does not model is an error, never a
silently wrong number.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from attnviz.errors import ModelLoadError
from attnviz.measures._adapters import ADAPTERS, Adapter, adapter_for, supported_text

__all__ = ["ADAPTERS", "Adapter", "LayerParts", "LayerRecord", "adapter_for", "block_vectors",
           "check_value_path", "collect", "eager_weights", "layer_parts", "layers_of",
           "mismatch_error", "per_layer", "probs64", "relative_mismatch", "supported_text",
           "transformed", "value_columns", "values_of"]

if TYPE_CHECKING:
    import torch
    from torch import nn

def _path(root: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        root = getattr(root, part)
    return root


def layers_of(model: nn.Module, adapter: Adapter) -> list[nn.Module]:
    """The model's layers, lowest first (the base model of a model with a head is found)."""
    candidates = [model]
    prefix = getattr(model, "base_model_prefix", "")
    if prefix and hasattr(model, prefix):
        candidates.insert(0, getattr(model, prefix))
    for candidate in candidates:
        with contextlib.suppress(AttributeError):
            return list(_path(candidate, adapter.stack))
    raise ModelLoadError(
        f"cannot find the layers of this {adapter.model_type} model (looked for "
        f"'{adapter.stack}')", "load the model with transformers' AutoModel classes")


def value_columns(adapter: Adapter, width: int, num_heads: int,
                  head_dim: int) -> tuple[int, int]:
    """The ``[start, stop)`` columns of the value module's output that hold the values."""
    if adapter.fused == "thirds":
        return 2 * width // 3, width
    if adapter.fused == "qkv":  # [query heads | kv heads' keys | kv heads' values]
        queries = num_heads * head_dim
        return queries + (width - queries) // 2, width
    return 0, width


@dataclass
class LayerParts:
    """The float64 parameters of one layer that the measures read.

    Attributes:
        w_value: ``[kv_head, model, head_dim]``: ``v = x @ w_value[g] + b_value[g]``.
        b_value: ``[kv_head, head_dim]`` or ``None``.
        w_out: ``[head, head_dim, model]``: head ``h``'s rows of the output projection.
        b_out: ``[model]`` or ``None`` (added once after the heads are summed).
        value_clip: values are clamped to ``[-clip, clip]`` (OLMo's ``clip_qkv``), or ``None``.
        ln_weight, ln_bias, ln_eps: the LayerNorm after the residual sum (post-LN only).
        out_gain, out_eps: the RMSNorm on the attention's output (``offset + weight``), if any.
        multiplier: the factor on the attention's output before the residual sum (Granite).
    """

    w_value: torch.Tensor
    b_value: torch.Tensor | None
    w_out: torch.Tensor
    b_out: torch.Tensor | None
    value_clip: float | None = None
    ln_weight: torch.Tensor | None = None
    ln_bias: torch.Tensor | None = None
    ln_eps: float = 0.0
    out_gain: torch.Tensor | None = None
    out_eps: float = 0.0
    multiplier: float = 1.0


def _eps_of(norm: nn.Module) -> float:
    for name in ("eps", "variance_epsilon", "epsilon"):
        value = getattr(norm, name, None)
        if isinstance(value, (int, float)):
            return float(value)
    raise ModelLoadError(f"cannot read the epsilon of the norm {type(norm).__name__}",
                         "use --measure weights")


def layer_parts(layer: nn.Module, adapter: Adapter, num_heads: int) -> LayerParts:
    """Read one layer's value and output projections (and norms) in float64."""
    import torch

    value = _path(layer, adapter.value)
    out = _path(layer, adapter.out_proj)
    w_v = value.weight.detach().to(torch.float64)
    w_v = w_v if adapter.conv1d else w_v.T  # [in, out]
    b_v = None if value.bias is None else value.bias.detach().to(torch.float64)
    w_o = out.weight.detach().to(torch.float64)
    w_o = w_o if adapter.conv1d else w_o.T  # [in (head * head_dim), model]
    head_dim = w_o.shape[0] // num_heads
    start, stop = value_columns(adapter, w_v.shape[1], num_heads, head_dim)
    w_v = w_v[:, start:stop]
    b_v = None if b_v is None else b_v[start:stop]
    kv_heads = (stop - start) // head_dim
    parts_ = LayerParts(
        w_value=w_v.reshape(w_v.shape[0], kv_heads, head_dim).permute(1, 0, 2),
        b_value=None if b_v is None else b_v.reshape(kv_heads, head_dim),
        w_out=w_o.reshape(num_heads, head_dim, w_o.shape[1]),
        b_out=None if out.bias is None else out.bias.detach().to(torch.float64))
    if adapter.clip_qkv:
        clip = getattr(getattr(_path(layer, adapter.attention), "config", None), "clip_qkv", None)
        parts_.value_clip = None if clip is None else float(clip)
    if adapter.layer_norm is not None:
        norm = _path(layer, adapter.layer_norm)
        parts_.ln_weight = norm.weight.detach().to(torch.float64)
        parts_.ln_bias = None if norm.bias is None else norm.bias.detach().to(torch.float64)
        parts_.ln_eps = float(norm.eps)
    if adapter.out_norm is not None:
        norm = _path(layer, adapter.out_norm)
        parts_.out_gain = norm.weight.detach().to(torch.float64) + adapter.norm_offset
        parts_.out_eps = _eps_of(norm)
    if adapter.residual_multiplier:
        parts_.multiplier = float(cast(Any, layer).residual_multiplier)
    return parts_


def _check_layout(layers: list[nn.Module], adapter: Adapter) -> None:
    """Every module the adapter reads exists (a model of this type written differently, e.g.
    by remote code, is an error that says so rather than an AttributeError)."""
    import torch

    wanted = [adapter.attention, adapter.value, adapter.out_proj]
    wanted += [name for name in (adapter.layer_norm, adapter.out_norm) if name is not None]
    for index, layer in enumerate(layers):
        for name in wanted:
            try:
                module = _path(layer, name)
            except AttributeError:
                module = None
            weight = getattr(module, "weight", None)
            needs_weight = name != adapter.attention
            if module is None or (needs_weight and not (isinstance(weight, torch.Tensor)
                                                        and weight.dim() >= 1)):
                raise ModelLoadError(
                    f"layer {index} of this {adapter.model_type} model has no '{name}' with "
                    f"weights, where attnviz's measures expect it for {adapter.model_type} "
                    "models (a model written differently, e.g. by remote code)",
                    "use --measure weights (raw attention works for every model)")


@dataclass
class LayerRecord:
    """What one layer saw during the hooked pass (tensors in the model's dtype and device).

    Attributes:
        residual: ``[batch, token, model]``: the layer's input.
        attn_input: ``[batch, token, model]``: what the value projection reads.
        probs: ``[batch, head, query, key]``: the attention probabilities.
        args, kwargs: the layer's own call arguments (for a rerun).
        output: ``[batch, token, model]``: the layer's output.
        projected: ``[batch, token, model]``: the output projection's real output.
        after: ``[batch, token, model]``: the real output of the attention block (the residual
            stream after the attention; in a post-LN model, the LayerNorm's output).
    """

    residual: torch.Tensor | None = None
    attn_input: torch.Tensor | None = None
    probs: torch.Tensor | None = None
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    output: torch.Tensor | None = None
    projected: torch.Tensor | None = None
    after: torch.Tensor | None = None


def _hidden_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return args[0] if args else kwargs.get("hidden_states")


def _tensor_of(output: Any) -> Any:
    return output[0] if isinstance(output, tuple) else output


@contextlib.contextmanager
def _eval_mode(model: nn.Module) -> Iterator[None]:
    """Dropout off for the pass (a model in training mode would give random measures)."""
    training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(training)


def collect(model: nn.Module, inputs: dict[str, Any], adapter: Adapter,
            keep_layer_calls: bool = False) -> list[LayerRecord]:
    """Run the model once with hooks on every layer; one :class:`LayerRecord` per layer.

    Args:
        model: a Hugging Face model of ``adapter.model_type`` loaded with eager attention.
        inputs: the model's keyword arguments (``input_ids``, ``attention_mask``, ...).
        adapter: the architecture's adapter.
        keep_layer_calls: also keep each layer's call arguments and output (value zeroing).

    Raises:
        ModelLoadError: the attention modules return no weights (a fused kernel).
    """
    import torch

    layers = layers_of(model, adapter)
    _check_layout(layers, adapter)
    records = [LayerRecord() for _ in layers]
    handles: list[Any] = []

    def on_layer_input(record: LayerRecord) -> Callable[..., None]:
        def hook(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            record.residual = _hidden_of(args, kwargs)
            if keep_layer_calls:
                record.args, record.kwargs = tuple(args), dict(kwargs)
        return hook

    def on_layer_output(record: LayerRecord) -> Callable[..., None]:
        def hook(_module: nn.Module, _args: Any, _kwargs: Any, output: Any) -> None:
            record.output = _tensor_of(output)
        return hook

    def on_projection(record: LayerRecord) -> Callable[..., None]:
        def hook(_module: nn.Module, _args: Any, output: Any) -> None:
            record.projected = _tensor_of(output)
        return hook

    def on_block_output(record: LayerRecord) -> Callable[..., None]:
        def hook(_module: nn.Module, _args: Any, output: Any) -> None:
            record.after = _tensor_of(output)
        return hook

    def on_stream_after(record: LayerRecord) -> Callable[..., None]:
        def hook(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            record.after = _hidden_of(args, kwargs)
        return hook

    def on_attention(record: LayerRecord) -> Callable[..., None]:
        def hook(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                 output: Any) -> None:
            record.attn_input = _hidden_of(args, kwargs)
            weights = output[1] if isinstance(output, tuple) and len(output) > 1 else None
            record.probs = weights if isinstance(weights, torch.Tensor) else None
        return hook

    try:
        for layer, record in zip(layers, records):
            handles.append(layer.register_forward_pre_hook(on_layer_input(record),
                                                           with_kwargs=True))
            if keep_layer_calls:
                handles.append(layer.register_forward_hook(on_layer_output(record),
                                                           with_kwargs=True))
            handles.append(_path(layer, adapter.attention).register_forward_hook(
                on_attention(record), with_kwargs=True))
            handles.append(_path(layer, adapter.out_proj).register_forward_hook(
                on_projection(record)))
            if adapter.layer_norm is not None:
                handles.append(_path(layer, adapter.layer_norm).register_forward_hook(
                    on_block_output(record)))
            elif adapter.after_attention is not None:
                with contextlib.suppress(AttributeError):  # e.g. a parallel block has none
                    handles.append(_path(layer, adapter.after_attention).register_forward_pre_hook(
                        on_stream_after(record), with_kwargs=True))
        with torch.inference_mode(), _eval_mode(model):
            model(**inputs)
    finally:
        for handle in handles:
            handle.remove()
    for index, record in enumerate(records):
        if record.probs is None or record.attn_input is None or record.residual is None:
            raise ModelLoadError(
                f"layer {index} of this {adapter.model_type} model returned no attention "
                "weights (a fused attention kernel)",
                "load the model with attn_implementation=\"eager\"")
    return records


def values_of(record: LayerRecord, parts: LayerParts, num_heads: int) -> torch.Tensor:
    """``[batch, head, token, head_dim]`` float64 value vectors, one per query head.

    Grouped-query attention: query head ``h`` reads key/value head ``h // (heads / kv_heads)``.
    """
    import torch

    assert record.attn_input is not None
    x = record.attn_input.to(torch.float64)  # [B, T, D]
    values = torch.einsum("btd,gde->bgte", x, parts.w_value)  # [B, kv, T, dh]
    if parts.b_value is not None:
        values = values + parts.b_value[None, :, None, :]
    if parts.value_clip is not None:
        values = values.clamp(-parts.value_clip, parts.value_clip)
    groups = num_heads // values.shape[1]
    return values.repeat_interleave(groups, dim=1)  # [B, H, T, dh]


def transformed(record: LayerRecord, parts: LayerParts, num_heads: int) -> torch.Tensor:
    """``f_h(x_j) = v_j^h W_O^h``, ``[batch, head, token, model]`` float64 (no output bias)."""
    import torch

    return torch.einsum("bhte,hed->bhtd", values_of(record, parts, num_heads), parts.w_out)


def probs64(record: LayerRecord) -> torch.Tensor:
    """The attention probabilities ``[batch, head, query, key]`` in float64."""
    import torch

    assert record.probs is not None
    return record.probs.to(torch.float64)


def relative_mismatch(got: torch.Tensor, real: torch.Tensor) -> float | None:
    """The relative difference of ``got`` (float64) from ``real`` when it exceeds what the
    model's dtype can explain, else ``None``."""
    import torch

    real64 = real.to(torch.float64)
    tolerance = max(1e-4, 16 * torch.finfo(real.dtype).eps)
    scale = float(real64.norm())
    difference = float((got - real64).norm()) / max(scale, 1e-30)
    return difference if difference > tolerance else None


def mismatch_error(adapter: Adapter, what: str, difference: float) -> ModelLoadError:
    return ModelLoadError(
        f"{what} of this {adapter.model_type} model differs from what attnviz rebuilds from "
        f"the layer's parameters (by {difference:.1%}): the model has an option on the value "
        "path that attnviz's measures do not model, so no number is returned",
        "use --measure weights (raw attention works for every model)")


def check_value_path(record: LayerRecord, parts: LayerParts, num_heads: int, adapter: Adapter,
                     index: int) -> torch.Tensor:
    """``f_h(x_j)`` (see :func:`transformed`), after checking that
    ``sum_h alpha^h f_h(x) + b_O`` equals the output projection's real output.

    Raises:
        ModelLoadError: they differ by more than the model's dtype explains.
    """
    import torch

    fx = transformed(record, parts, num_heads)  # [B, H, key, D]
    if record.projected is not None:
        rebuilt = torch.einsum("bhqk,bhkd->bqd", probs64(record), fx)
        if parts.b_out is not None:
            rebuilt = rebuilt + parts.b_out
        difference = relative_mismatch(rebuilt, record.projected)
        if difference is not None:
            raise mismatch_error(adapter, f"the attention output of layer {index}",
                                  difference)
    return fx


def eager_weights(model: nn.Module, inputs: dict[str, Any]) -> list[torch.Tensor]:
    """The raw attention of every layer (``output_attentions``), float32, for any model."""
    import torch

    with torch.inference_mode(), _eval_mode(model):
        outputs = model(**inputs, output_attentions=True)
    attentions = getattr(outputs, "attentions", None)
    if not attentions or any(a is None for a in attentions):
        raise ModelLoadError("the model returned no attention weights (a fused kernel)",
                             "load the model with attn_implementation=\"eager\"")
    return [a.to(torch.float32) for a in attentions]


#: Bytes of float64 ``[batch, query, key, model]`` vectors held at once (queries are chunked).
CHUNK_BYTES = 1 << 26


def block_vectors(record: LayerRecord, parts: LayerParts, num_heads: int,
                  adapter: Adapter, index: int
                  ) -> Iterator[tuple[slice, torch.Tensor, torch.Tensor]]:
    """The attention block's output of each query, split by source token, in query chunks.

    ``z_ij = sum_h alpha^h_ij f_h(x_j) + [i == j] x_i`` (attention plus residual). In a post-LN
    model the LayerNorm after the sum is linear once its scale is fixed by the real input's
    standard deviation ``s_i``, so ``T_i(x_j) = gamma * (z_ij - mean(z_ij)) / s_i`` and the
    block's output is ``y_i = sum_j T_i(x_j) + gamma * (b_O - mean(b_O)) / s_i + beta``. In a
    pre-LN model the norm is inside ``f`` (it acts on each token alone), ``T_i(x_j) = z_ij`` and
    ``y_i = sum_j z_ij + b_O``. An RMSNorm on the attention's output (Gemma 2/3, OLMo 2/3) is
    made linear the same way, by fixing its scale to its real input's root mean square
    ``r_i``: the attention terms become ``g * (sum_h alpha^h_ij f_h(x_j)) / r_i``; Granite's
    residual multiplier ``m`` scales them (and ``b_O``) by ``m``. The rebuilt ``y`` is checked
    against the block's real output.

    Raises:
        ModelLoadError: the rebuilt ``y`` differs from the real block output.

    Yields:
        ``(rows, T, y)``: the query slice, ``T`` ``[batch, query, key, model]`` and ``y``
        ``[batch, query, model]``, float64.
    """
    import torch

    assert record.residual is not None
    post_ln = adapter.post_ln
    fx = check_value_path(record, parts, num_heads, adapter, index)  # [B, H, key, D]
    probs = probs64(record)  # [B, H, query, key]
    residual = record.residual.to(torch.float64)  # [B, T, D]
    batch, tokens, width = residual.shape
    step = max(1, CHUNK_BYTES // max(1, batch * tokens * width * 8))
    b_out = parts.b_out if parts.b_out is not None else residual.new_zeros(width)
    # The factor on each query's attention terms: [B, T, D] (an output norm), or a scalar.
    factor: torch.Tensor | float = parts.multiplier
    if parts.out_gain is not None:
        attended = torch.einsum("bhqk,bhkd->bqd", probs, fx) + b_out  # the norm's real input
        rms = (attended.pow(2).mean(-1, keepdim=True) + parts.out_eps).sqrt()  # [B, T, 1]
        factor = parts.out_gain * parts.multiplier / rms
    b_block = b_out * factor  # [D] or [B, T, D]
    for start in range(0, tokens, step):
        rows = slice(start, min(tokens, start + step))
        # z[b, q, k] = sum_h probs[b, h, q, k] * fx[b, h, k]: one fused multiply-add per head
        # is many times faster than an einsum, which becomes tiny batched matrix products.
        z = residual.new_zeros(batch, rows.stop - rows.start, tokens, width)  # [B, q, key, D]
        for head in range(num_heads):
            z.addcmul_(probs[:, head, rows, :, None], fx[:, head, None, :, :])
        if isinstance(factor, float):
            bias = b_block
            if factor != 1.0:
                z *= factor
        else:
            z *= factor[:, rows, None, :]
            bias = b_block[:, rows]
        diagonal = torch.arange(rows.start, rows.stop, device=z.device)
        z[:, diagonal - rows.start, diagonal] += residual[:, rows]
        if not post_ln:
            vectors, output = z, z.sum(2) + bias
        else:
            assert parts.ln_weight is not None
            pre = z.sum(2) + bias  # [B, q, D]: the LayerNorm's real input
            scale = (pre.var(-1, unbiased=False) + parts.ln_eps).sqrt()  # [B, q]
            vectors = parts.ln_weight * (z - z.mean(-1, keepdim=True)) / scale[:, :, None, None]
            bias = parts.ln_weight * (bias - bias.mean(-1, keepdim=True)) / scale[:, :, None]
            if parts.ln_bias is not None:
                bias = bias + parts.ln_bias
            output = vectors.sum(2) + bias
        if record.after is not None:
            difference = relative_mismatch(output, record.after[:, rows])
            if difference is not None:
                raise mismatch_error(adapter, f"the attention block's output of layer {index}",
                                      difference)
        yield rows, vectors, output


def per_layer(matrix: torch.Tensor, num_heads: int) -> torch.Tensor:
    """A layer's ``[batch, query, key]`` repeated for every head, float32 ``[b, h, q, k]``."""
    import torch

    return matrix[:, None].expand(-1, num_heads, -1, -1).to(torch.float32).contiguous()
