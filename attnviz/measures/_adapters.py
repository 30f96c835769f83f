"""Which architectures the measures know, where their layers keep what the measures read, and the
one-line refusal for everything else.

An adapter names, inside one layer, the attention module (it returns ``(output, weights)``), the
module whose output holds the value vectors, the output projection and the norms around the
attention block. Three block shapes are known:

* **post-LN encoders** (BERT and its relatives): ``y = LN(attention(x) + x)``;
* **pre-norm decoders** (GPT-2, Llama and the models built like it): ``y = x + attention(N(x))``;
* **sandwich-norm decoders** (Gemma 2/3, GLM-4, OLMo 2/3, EXAONE 4):
  ``y = x + N_out(attention(N_in(x)))``, where ``N_out`` is an RMSNorm on the attention's output
  before the residual sum (OLMo 2/3 and EXAONE 4 have no ``N_in``).

Details that change only the attention probabilities (rotary or partial rotary positions, q/k
norms, logit softcapping, sliding windows, query scaling) need nothing: the probabilities are
the eager module's own. Details on the value path are honoured exactly (value and output biases,
grouped-query attention, fused q/k/v projections, OLMo's ``clip_qkv``, Granite's residual
multiplier) or refused in :func:`adapter_for` (a parallel attention and MLP block has no
residual stream after the attention, so ALTI is refused there; a mixture-of-experts block does
not run in float64, so value zeroing is refused there). Every number is also checked against
the model's own pass (see :func:`attnviz.measures._collect.check_value_path`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from attnviz.errors import UsageError

#: The measures each block shape supports (``weights`` works for every model).
POST_LN_MEASURES: tuple[str, ...] = ("weights", "norm", "norm-res-ln", "alti", "value-zeroing")
PRE_LN_MEASURES: tuple[str, ...] = ("weights", "norm", "alti", "value-zeroing")
PARALLEL_MEASURES: tuple[str, ...] = ("weights", "norm", "value-zeroing")
MOE_MEASURES: tuple[str, ...] = ("weights", "norm", "alti")


@dataclass(frozen=True)
class Adapter:
    """Where one architecture keeps what the measures need.

    Attributes:
        model_type: the ``config.model_type`` it serves.
        stack: the attribute path of the ``nn.ModuleList`` of layers in the base model.
        attention: the attribute path, inside a layer, of the module that computes the softmax
            and returns ``(output, weights)``.
        value: the attribute path of the module whose output holds the value vectors.
        out_proj: the attribute path of the output projection.
        fused: ``None`` (a value projection of its own), ``"thirds"`` (GPT-2's ``c_attn``: q, k
            and v of equal width) or ``"qkv"`` (Phi-3's ``qkv_proj``: query heads, then the
            key/value heads' keys, then their values).
        conv1d: projections store ``[in, out]`` weights (GPT-2's ``Conv1D``), not ``[out, in]``.
        layer_norm: the LayerNorm after the residual sum (post-LN encoders only).
        out_norm: an RMSNorm on the attention's output before the residual sum (Gemma 2/3,
            OLMo 2/3).
        norm_offset: the RMSNorm scales by ``norm_offset + weight`` (Gemma: 1).
        residual_multiplier: the layer scales the attention's output by its
            ``residual_multiplier`` before the residual sum (Granite).
        clip_qkv: the config's ``clip_qkv`` (when set) clamps the value vectors (OLMo).
        parallel: the config attribute that, when true, makes attention and MLP read the same
            input and add to the residual together (StableLM's ``use_parallel_residual``).
        moe: the feed-forward block is a mixture of experts whose kernels do not run in float64,
            which value zeroing's reruns need (Mixtral, Qwen MoE).
        after_attention: a module of the layer whose input is the residual stream after the
            attention block (pre-norm); ``None`` for post-LN, where ``layer_norm``'s output is.
        family: the block shape in words, for messages.
    """

    model_type: str
    stack: str
    attention: str
    value: str
    out_proj: str
    fused: str | None = None
    conv1d: bool = False
    layer_norm: str | None = None
    out_norm: str | None = None
    norm_offset: float = 0.0
    residual_multiplier: bool = False
    clip_qkv: bool = False
    parallel: str | None = None
    moe: bool = False
    after_attention: str | None = None
    family: str = "pre-norm decoder"

    @property
    def post_ln(self) -> bool:
        """LayerNorm follows the residual sum (BERT) rather than preceding the attention."""
        return self.layer_norm is not None

    @property
    def measures(self) -> tuple[str, ...]:
        if self.moe:
            return MOE_MEASURES
        return POST_LN_MEASURES if self.post_ln else PRE_LN_MEASURES


_BERT = Adapter("bert", stack="encoder.layer", attention="attention.self",
                value="attention.self.value", out_proj="attention.output.dense",
                layer_norm="attention.output.LayerNorm", family="post-LN encoder")
_LLAMA = Adapter("llama", stack="layers", attention="self_attn", value="self_attn.v_proj",
                 out_proj="self_attn.o_proj", after_attention="post_attention_layernorm")
_GEMMA2 = dataclasses.replace(_LLAMA, model_type="gemma2", out_norm="post_attention_layernorm",
                              norm_offset=1.0, after_attention="pre_feedforward_layernorm",
                              family="sandwich-norm decoder")
_OLMO2 = dataclasses.replace(_LLAMA, model_type="olmo2", out_norm="post_attention_layernorm",
                             after_attention="mlp", family="sandwich-norm decoder")

_TABLE: list[Adapter] = [
    # post-LN encoders with BERT's modules (attention.self, attention.output.{dense,LayerNorm})
    *(dataclasses.replace(_BERT, model_type=name) for name in (
        "bert", "roberta", "xlm-roberta", "camembert", "electra", "ernie", "data2vec-text")),
    Adapter("gpt2", stack="h", attention="attn", value="attn.c_attn", out_proj="attn.c_proj",
            fused="thirds", conv1d=True, after_attention="ln_2"),
    # pre-RMSNorm decoders with q/k/v/o projections (biases, GQA, q/k norms, sliding windows)
    *(dataclasses.replace(_LLAMA, model_type=name) for name in (
        "llama", "mistral", "ministral", "qwen2", "qwen3", "gemma", "starcoder2", "helium",
        "smollm3", "seed_oss", "arcee", "hunyuan_v1_dense", "glm", "nemotron")),
    dataclasses.replace(_LLAMA, model_type="apertus", after_attention="feedforward_layernorm"),
    *(dataclasses.replace(_LLAMA, model_type=name, moe=True) for name in (
        "mixtral", "qwen2_moe", "qwen3_moe")),
    dataclasses.replace(_LLAMA, model_type="phi3", value="self_attn.qkv_proj", fused="qkv"),
    dataclasses.replace(_LLAMA, model_type="olmo", clip_qkv=True),
    dataclasses.replace(_LLAMA, model_type="granite", residual_multiplier=True),
    dataclasses.replace(_LLAMA, model_type="stablelm", parallel="use_parallel_residual"),
    _GEMMA2, dataclasses.replace(_GEMMA2, model_type="gemma3_text"),
    _OLMO2, dataclasses.replace(_OLMO2, model_type="olmo3"),
    dataclasses.replace(_OLMO2, model_type="exaone4"),
    dataclasses.replace(_GEMMA2, model_type="glm4", out_norm="post_self_attn_layernorm",
                        norm_offset=0.0, after_attention="post_attention_layernorm"),
]
ADAPTERS: dict[str, Adapter] = {adapter.model_type: adapter for adapter in _TABLE}


def supported_text() -> str:
    """The model types per set of measures, e.g. ``bert, roberta (norm, ...); gpt2, ...``."""
    groups: dict[tuple[str, ...], list[str]] = {}
    for name, adapter in ADAPTERS.items():
        groups.setdefault(adapter.measures, []).append(name)
    return "; ".join(f"{', '.join(names)} ({', '.join(m for m in measures if m != 'weights')})"
                     for measures, names in groups.items())


def _is_parallel(adapter: Adapter, config: Any) -> bool:
    return adapter.parallel is not None and bool(getattr(config, adapter.parallel, False))


def measures_for(adapter: Adapter, config: Any) -> tuple[str, ...]:
    """The measures that work for this adapter with this configuration."""
    return PARALLEL_MEASURES if _is_parallel(adapter, config) else adapter.measures


def adapter_for(config: Any, measure: str) -> Adapter:
    """The adapter of a model's type, or a UsageError naming the types and measures that work."""
    model_type = str(getattr(config, "model_type", "unknown"))
    adapter = ADAPTERS.get(model_type)
    if adapter is None:
        raise UsageError(
            f"measure {measure!r} is not defined for model type {model_type!r}: attnviz reads "
            "the value vectors and norms the measures need only in these model types: "
            f"{supported_text()}",
            "use --measure weights (raw attention works for every model), or a model of one of "
            "the types above (docs/analysis.md: what each measure supports and why)")
    works = measures_for(adapter, config)
    if measure in works:
        return adapter
    if _is_parallel(adapter, config):
        why = (f"its {adapter.parallel}=True adds attention and MLP to the residual stream "
               "together, so there is no stream after the attention for ALTI to decompose")
    elif adapter.moe and measure == "value-zeroing":
        why = ("its mixture-of-experts block does not run in float64, which value zeroing's "
               "reruns of each layer need")
    elif adapter.out_norm is not None:
        why = (f"a {adapter.family}: its norm acts on the attention's output before the "
               "residual sum, so there is no LayerNorm after the residual sum to decompose")
    else:
        why = ("a pre-LN model: its LayerNorm comes before the attention, so there is no "
               "LayerNorm after the residual sum to decompose")
    raise UsageError(f"measure {measure!r} is not defined for model type {model_type!r} ({why})",
                     f"measures that work for {model_type}: {', '.join(works)}")
