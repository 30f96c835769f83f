"""The measures on every architecture family they support, against an independent recomputation.

Each family is a tiny random-weight model built from its own config class (matrices scaled so
the attention is far from uniform), saved with ``save_pretrained`` and loaded back with
``AutoModel.from_pretrained(..., attn_implementation="eager")``. The references read the
parameters from the model's ``state_dict`` by name, the layer inputs from
``output_hidden_states`` and the attention from ``output_attentions``, apply each family's norms
by their published formulas in numpy float64 and loop over heads explicitly; the block's real
output is read from the model by a hook on a module that follows it. Value zeroing is checked
by rerunning the whole float64 model with one token's value zeroed.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from attnviz import measures
from attnviz.errors import ModelLoadError, UsageError

TOL = 1e-5
IDS = [[5, 17, 42, 8, 9, 23, 61]]
DIFFS: dict[str, float] = {}  # the largest difference / scale per family and measure

COMMON = {"vocab_size": 100, "hidden_size": 32, "intermediate_size": 48,
          "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 64,
          "initializer_range": 0.3}
DECODER = {**COMMON, "num_key_value_heads": 2}


@dataclass(frozen=True)
class Spec:
    """How one family's layer is written, in the test's own words (state_dict names, formulas).

    ``pre`` is the norm before the attention: ``rms`` (x / rms * w), ``rms1p`` (Gemma:
    x / rms * (1 + w)), ``ln`` (LayerNorm with weight and bias), ``plain-ln`` (OLMo: no
    parameters, eps 1e-5), ``ln1p`` (Nemotron: LayerNorm scaled by 1 + w), ``none`` (OLMo 2/3,
    EXAONE 4) or ``post-ln`` (the encoders: LayerNorm after the residual sum). ``post`` is the
    RMSNorm on the attention's output before the residual sum (its scale read like ``pre``'s).
    """

    config: str
    model: str
    kwargs: dict[str, Any]
    pre: str
    eps: str = "rms_norm_eps"
    value: str = "self_attn.v_proj"
    out: str = "self_attn.o_proj"
    fused_qkv: bool = False
    post: str | None = None
    multiplier: str | None = None
    clip: str | None = None
    after: str = "post_attention_layernorm"  # its input is the stream after the attention
    pre_name: str = "input_layernorm"
    prefix: str = "layers.{}."
    measures: tuple[str, ...] = ("norm", "alti", "value-zeroing")
    extra: dict[str, Any] = field(default_factory=dict)


_ENCODER = {"pre": "post-ln", "eps": "layer_norm_eps", "value": "attention.self.value",
            "out": "attention.output.dense", "after": "attention.output.LayerNorm",
            "prefix": "encoder.layer.{}.",
            "measures": ("norm", "norm-res-ln", "alti", "value-zeroing")}

SPECS: dict[str, Spec] = {
    "mistral": Spec("MistralConfig", "MistralModel", {**DECODER, "sliding_window": 4}, "rms"),
    "qwen2": Spec("Qwen2Config", "Qwen2Model", DECODER, "rms"),  # q/k/v biases
    "qwen3": Spec("Qwen3Config", "Qwen3Model", {**DECODER, "head_dim": 16,
                                                "attention_bias": True}, "rms"),
    "gemma": Spec("GemmaConfig", "GemmaModel", {**DECODER, "head_dim": 8}, "rms1p"),
    "gemma2": Spec("Gemma2Config", "Gemma2Model",
                   {**DECODER, "head_dim": 8, "attn_logit_softcapping": 5.0,
                    "query_pre_attn_scalar": 12, "sliding_window": 4}, "rms1p",
                   post="post_attention_layernorm", after="pre_feedforward_layernorm"),
    "gemma3_text": Spec("Gemma3TextConfig", "Gemma3TextModel",
                        {**DECODER, "head_dim": 8, "sliding_window": 4,
                         "query_pre_attn_scalar": 12}, "rms1p",
                        post="post_attention_layernorm", after="pre_feedforward_layernorm"),
    "phi3": Spec("Phi3Config", "Phi3Model", {**DECODER, "pad_token_id": 0}, "rms",
                 value="self_attn.qkv_proj", fused_qkv=True),
    "olmo": Spec("OlmoConfig", "OlmoModel", {**DECODER, "clip_qkv": 1.5, "pad_token_id": 0},
                 "plain-ln", clip="clip_qkv"),
    "olmo2": Spec("Olmo2Config", "Olmo2Model", {**DECODER, "pad_token_id": 0}, "none",
                  post="post_attention_layernorm", after="mlp"),
    "olmo3": Spec("Olmo3Config", "Olmo3Model", {**DECODER, "pad_token_id": 0,
                                                "sliding_window": 4}, "none",
                  post="post_attention_layernorm", after="mlp"),
    "granite": Spec("GraniteConfig", "GraniteModel",
                    {**DECODER, "residual_multiplier": 0.5, "attention_multiplier": 0.3},
                    "rms", multiplier="residual_multiplier"),
    "stablelm": Spec("StableLmConfig", "StableLmModel",
                     {**DECODER, "use_qkv_bias": True, "qk_layernorm": True,
                      "partial_rotary_factor": 0.5}, "ln", eps="layer_norm_eps"),
    "starcoder2": Spec("Starcoder2Config", "Starcoder2Model", {**DECODER, "use_bias": True},
                       "ln", eps="norm_epsilon"),
    "ministral": Spec("MinistralConfig", "MinistralModel", {**DECODER, "sliding_window": 4,
                                                           "head_dim": 8},
                      "rms"),
    "helium": Spec("HeliumConfig", "HeliumModel", {**DECODER, "head_dim": 8}, "rms"),
    "smollm3": Spec("SmolLM3Config", "SmolLM3Model", {**DECODER, "pad_token_id": 0}, "rms"),
    "seed_oss": Spec("SeedOssConfig", "SeedOssModel", {**DECODER, "attention_bias": True,
                                                     "attention_out_bias": True}, "rms"),
    "arcee": Spec("ArceeConfig", "ArceeModel", DECODER, "rms"),
    "hunyuan_v1_dense": Spec("HunYuanDenseV1Config", "HunYuanDenseV1Model",
                             {**DECODER, "pad_token_id": 0, "head_dim": 8}, "rms"),
    "glm": Spec("GlmConfig", "GlmModel", {**DECODER, "pad_token_id": 0}, "rms"),
    "nemotron": Spec("NemotronConfig", "NemotronModel",
                     {**DECODER, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
                     "ln1p", eps="norm_eps"),
    "apertus": Spec("ApertusConfig", "ApertusModel", {**DECODER, "pad_token_id": 0}, "rms",
                    pre_name="attention_layernorm", after="feedforward_layernorm"),
    "exaone4": Spec("Exaone4Config", "Exaone4Model", {**DECODER, "pad_token_id": 0}, "none",
                    post="post_attention_layernorm", after="mlp"),
    "glm4": Spec("Glm4Config", "Glm4Model", {**DECODER, "pad_token_id": 0}, "rms",
                 post="post_self_attn_layernorm"),
    "mixtral": Spec("MixtralConfig", "MixtralModel",
                    {**DECODER, "num_local_experts": 4, "num_experts_per_tok": 2}, "rms",
                    measures=("norm", "alti")),
    "roberta": Spec("RobertaConfig", "RobertaModel", {**COMMON, "pad_token_id": 1},
                    **_ENCODER),
    "xlm-roberta": Spec("XLMRobertaConfig", "XLMRobertaModel", {**COMMON, "pad_token_id": 1},
                        **_ENCODER),
    "electra": Spec("ElectraConfig", "ElectraModel", {**COMMON, "embedding_size": 16},
                    **_ENCODER),
}
FAMILIES = list(SPECS)


# ------------------------------------------------------------------------------ the models
def _build(spec: Spec, folder: Path) -> Any:
    import transformers

    torch.manual_seed(0)
    config = getattr(transformers, spec.config)(**spec.kwargs)
    model = getattr(transformers, spec.model)(config)
    with torch.no_grad():  # sharper attention and larger values than the initialiser gives
        for name, parameter in model.named_parameters():
            if parameter.dim() > 1:
                continue  # initializer_range 0.3 (15 times the usual) makes them large
            if "norm" in name.lower() or "ln" in name.lower():
                parameter.add_(0.3 * torch.randn_like(parameter))
            else:
                parameter.add_(0.2 * torch.randn_like(parameter))
    model.save_pretrained(folder)
    return transformers.AutoModel.from_pretrained(folder, attn_implementation="eager").eval()


class Case:
    """A family's model, its inputs and the float64 numpy pieces the references read."""

    def __init__(self, name: str, spec: Spec, model: Any, ids: list[list[int]] = IDS) -> None:
        self.name, self.spec, self.model, self.config = name, spec, model, model.config
        tensor = torch.tensor(ids)
        self.inputs = {"input_ids": tensor, "attention_mask": torch.ones_like(tensor)}
        with torch.no_grad():
            out = model(**self.inputs, output_hidden_states=True, output_attentions=True)
        self.hidden = [h[0].double().numpy() for h in out.hidden_states]
        self.attn = [a[0].double().numpy() for a in out.attentions]  # [H, T, T]
        self.state = {k: v.double().numpy() for k, v in model.state_dict().items()}
        self.layers = len(self.attn)
        self.heads = self.attn[0].shape[0]
        self.tokens = self.attn[0].shape[-1]

    def p(self, layer: int, name: str) -> np.ndarray:
        return self.state[self.spec.prefix.format(layer) + name]

    def has(self, layer: int, name: str) -> bool:
        return self.spec.prefix.format(layer) + name in self.state

    def eps(self) -> float:
        return float(getattr(self.config, self.spec.eps))

    def _rms(self, x: np.ndarray, layer: int, name: str) -> np.ndarray:
        weight = self.p(layer, name + ".weight")
        offset = 1.0 if self.spec.pre == "rms1p" else 0.0  # Gemma scales by 1 + w
        return x / np.sqrt((x ** 2).mean(-1, keepdims=True) + self.eps()) * (offset + weight)

    def attn_input(self, layer: int) -> np.ndarray:
        """What the value projection reads."""
        x = self.hidden[layer]
        kind = self.spec.pre
        if kind in ("none", "post-ln"):
            return x
        if kind in ("rms", "rms1p"):
            return self._rms(x, layer, self.spec.pre_name)
        centred = x - x.mean(-1, keepdims=True)
        if kind == "plain-ln":
            return centred / np.sqrt((centred ** 2).mean(-1, keepdims=True) + 1e-5)
        normed = centred / np.sqrt((centred ** 2).mean(-1, keepdims=True) + self.eps())
        scale = self.p(layer, self.spec.pre_name + ".weight") + (1.0 if kind == "ln1p" else 0.0)
        return normed * scale + self.p(layer, self.spec.pre_name + ".bias")

    def head_dim(self) -> int:
        return int(getattr(self.config, "head_dim", None)
                   or self.config.hidden_size // self.heads)

    def head_maps(self, layer: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Per head: (W_V^h [D, dh], b_V^h [dh], W_O^h [dh, D])."""
        dh = self.head_dim()
        kv = int(getattr(self.config, "num_key_value_heads", None) or self.heads)
        w_v = self.p(layer, self.spec.value + ".weight").T  # [D, out]
        b_v = (self.p(layer, self.spec.value + ".bias") if self.has(
            layer, self.spec.value + ".bias") else np.zeros(w_v.shape[1]))
        if self.spec.fused_qkv:  # Phi-3: [queries | keys | values]
            start = (self.heads + kv) * dh
            w_v, b_v = w_v[:, start:], b_v[start:]
        w_o = self.p(layer, self.spec.out + ".weight").T  # [H * dh, D]
        maps = []
        for h in range(self.heads):
            g = h // (self.heads // kv)
            maps.append((w_v[:, g * dh:(g + 1) * dh], b_v[g * dh:(g + 1) * dh],
                         w_o[h * dh:(h + 1) * dh]))
        return maps

    def out_bias(self, layer: int) -> np.ndarray:
        name = self.spec.out + ".bias"
        return self.p(layer, name) if self.has(layer, name) else np.zeros(
            self.hidden[0].shape[-1])

    def transformed(self, layer: int) -> np.ndarray:
        """``f_h(x_j)``: ``[H, T, D]`` (value with its bias and clip, then W_O^h)."""
        x = self.attn_input(layer)
        clip = None if self.spec.clip is None else getattr(self.config, self.spec.clip)
        out = []
        for w_v, b_v, w_o in self.head_maps(layer):
            rows = []
            for j in range(self.tokens):
                v = x[j] @ w_v + b_v
                if clip is not None:
                    v = np.clip(v, -clip, clip)
                rows.append(v @ w_o)
            out.append(rows)
        return np.array(out)

    def block(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """``(T_i(x_j) [T, T, D], y_i [T, D])``: the attention block split by source token."""
        fx = self.transformed(layer)
        t, d = self.tokens, fx.shape[-1]
        attended = np.zeros((t, t, d))  # sum_h alpha^h_ij f_h(x_j)
        for h in range(self.heads):
            for i in range(t):
                for j in range(t):
                    attended[i, j] += self.attn[layer][h, i, j] * fx[h, j]
        bias = np.broadcast_to(self.out_bias(layer), (t, d)).copy()
        if self.spec.post is not None:  # RMSNorm of the real attention output, scale fixed
            real = attended.sum(1) + bias
            gain = self.p(layer, self.spec.post + ".weight") + (
                1.0 if self.spec.pre == "rms1p" else 0.0)
            factor = gain / np.sqrt((real ** 2).mean(-1, keepdims=True) + self.eps())
            attended, bias = attended * factor[:, None, :], bias * factor
        if self.spec.multiplier is not None:
            m = float(getattr(self.config, self.spec.multiplier))
            attended, bias = attended * m, bias * m
        z = attended.copy()
        for i in range(t):
            z[i, i] += self.hidden[layer][i]
        if self.spec.pre != "post-ln":
            return z, z.sum(1) + bias
        gamma = self.p(layer, "attention.output.LayerNorm.weight")
        beta = self.p(layer, "attention.output.LayerNorm.bias")
        pre = z.sum(1) + bias
        std = np.sqrt(pre.var(-1) + self.eps())
        vectors = gamma * (z - z.mean(-1, keepdims=True)) / std[:, None, None]
        b = gamma * (bias - bias.mean(-1, keepdims=True)) / std[:, None]
        return vectors, vectors.sum(1) + b + beta

    def real_block_output(self, layer: int) -> np.ndarray:
        """The stream after the attention block, read from the model by a hook."""
        seen: dict[str, Any] = {}
        module = self.model.get_submodule(self.spec.prefix.format(layer) + self.spec.after)
        if self.spec.pre == "post-ln":
            handle = module.register_forward_hook(
                lambda _m, _a, out: seen.__setitem__("y", out))
        else:
            handle = module.register_forward_pre_hook(
                lambda _m, args: seen.__setitem__("y", args[0]))
        try:
            with torch.no_grad():
                self.model(**self.inputs)
        finally:
            handle.remove()
        return seen["y"][0].double().numpy()


@pytest.fixture(scope="module", params=FAMILIES)
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Case:
    name = request.param
    spec = SPECS[name]
    return Case(name, spec, _build(spec, tmp_path_factory.mktemp(f"tiny-{name}")))


def _compute(case: Case, name: str) -> list[np.ndarray]:
    result = measures.compute(name, case.model, case.inputs, case.config)
    assert len(result) == case.layers
    for layer in result:
        assert layer.dtype == torch.float32
        assert tuple(layer.shape) == (1, case.heads, case.tokens, case.tokens)
    return [layer[0].double().numpy() for layer in result]


def _record(case: Case, measure: str, got: np.ndarray, expected: np.ndarray) -> None:
    """float32 results against float64 references: within 1e-5 of the largest value (or 1e-5
    absolute when the values are below 1)."""
    scale = max(1.0, float(np.abs(expected).max()))
    key = f"{case.name}/{measure}"
    DIFFS[key] = max(DIFFS.get(key, 0.0), float(np.abs(got - expected).max()) / scale)
    np.testing.assert_allclose(got, expected, atol=TOL * scale, rtol=0)


def _skip_unless(case: Case, measure: str) -> None:
    if measure not in case.spec.measures:
        pytest.skip(f"{measure} is refused for {case.name} (tested below)")


# ------------------------------------------------------------------------------ the tests
def test_the_model_type_is_the_family(case: Case) -> None:
    assert case.config.model_type == case.name


def test_hooked_attention_is_the_models_own_eager_attention(case: Case) -> None:
    """The probabilities every measure uses equal ``outputs.attentions``, and the attention is
    far from uniform (so the comparisons below mean something)."""
    from attnviz.measures._collect import adapter_for, collect

    records = collect(case.model, case.inputs, adapter_for(case.config, "norm"))
    for record, attn in zip(records, case.attn):
        assert record.probs is not None
        _record(case, "weights", record.probs[0].double().numpy(), attn)
        np.testing.assert_array_equal(record.probs[0].double().numpy(), attn)  # exactly
        assert attn[:, -1].max() > 2.5 / case.tokens  # the last query sees every key


def test_norm_equals_alpha_times_length_of_f(case: Case) -> None:
    got = _compute(case, "norm")
    for layer in range(case.layers):
        fx = case.transformed(layer)
        lengths = np.linalg.norm(fx, axis=-1)  # [H, T]
        expected = case.attn[layer] * lengths[:, None, :]
        _record(case, "norm", got[layer], expected)
        assert expected.max() > 100 * TOL


def test_alti_equals_the_l1_formula(case: Case) -> None:
    _skip_unless(case, "alti")
    got = _compute(case, "alti")
    for layer in range(case.layers):
        vectors, y = case.block(layer)
        # the decomposition adds up to the block output the model really computes
        np.testing.assert_allclose(y, case.real_block_output(layer), atol=1e-4, rtol=1e-5)
        expected = np.zeros((case.tokens, case.tokens))
        for i in range(case.tokens):
            for j in range(case.tokens):
                expected[i, j] = max(0.0, np.abs(y[i]).sum() - np.abs(y[i] - vectors[i, j]).sum())
            expected[i] /= expected[i].sum()
        for h in range(case.heads):
            _record(case, "alti", got[layer][h], expected)
        if case.spec.pre != "post-ln":  # causal: nothing from later tokens
            assert np.all(np.triu(got[layer][0], 1) == 0)


def test_norm_res_ln_on_encoders_and_refused_on_decoders(case: Case) -> None:
    if "norm-res-ln" not in case.spec.measures:
        with pytest.raises(UsageError) as info:
            measures.compute("norm-res-ln", case.model, case.inputs, case.config)
        message = str(info.value)
        assert f"model type '{case.name}'" in message and "before the" in message
        assert f"measures that work for {case.name}: weights, norm" in message
        return
    got = _compute(case, "norm-res-ln")
    for layer in range(case.layers):
        vectors, _ = case.block(layer)
        expected = np.linalg.norm(vectors, axis=-1)
        for h in range(case.heads):
            _record(case, "norm-res-ln", got[layer][h], expected)


def _layer_output(case: Case, model: Any, layer: int, zero: int | None) -> np.ndarray:
    """The whole model rerun; layer ``layer``'s output with token ``zero``'s value zeroed."""
    prefix = case.spec.prefix.format(layer)
    seen: dict[str, Any] = {}
    start = 0
    if case.spec.fused_qkv:
        kv = case.config.num_key_value_heads
        start = (case.heads + kv) * case.head_dim()

    def zero_value(_module: Any, _args: Any, out: torch.Tensor) -> torch.Tensor:
        out = out.clone()
        out[:, zero, start:] = 0.0
        return out

    def keep(_module: Any, _args: Any, out: Any) -> None:
        seen["out"] = out[0] if isinstance(out, tuple) else out

    handles = [model.get_submodule(prefix.rstrip(".")).register_forward_hook(keep)]
    if zero is not None:
        handles.append(model.get_submodule(prefix + case.spec.value).register_forward_hook(
            zero_value))
    try:
        with torch.no_grad():
            model(**case.inputs)
    finally:
        for handle in handles:
            handle.remove()
    return seen["out"][0].numpy()


def test_value_zeroing_equals_rerunning_the_model(case: Case) -> None:
    if "value-zeroing" not in case.spec.measures:
        with pytest.raises(UsageError, match="mixture-of-experts") as info:
            measures.compute("value-zeroing", case.model, case.inputs, case.config)
        assert f"measures that work for {case.name}: weights, norm, alti" in str(info.value)
        return
    got = _compute(case, "value-zeroing")
    model64 = copy.deepcopy(case.model).double()
    for layer in (case.layers - 1,):  # the top layer (its input comes through the one below)
        original = _layer_output(case, model64, layer, None)
        expected = np.zeros((case.tokens, case.tokens))
        for j in range(case.tokens):
            changed = _layer_output(case, model64, layer, j)
            for i in range(case.tokens):
                a, b = original[i], changed[i]
                expected[i, j] = 1 - a @ b / (np.linalg.norm(a) * np.linalg.norm(b))
        expected = np.clip(expected, 0, None)
        expected /= expected.sum(-1, keepdims=True)
        for h in range(case.heads):
            _record(case, "value-zeroing", got[layer][h], expected)


# --------------------------------------------------------------------- refusals and guards
def _tiny(config_name: str, model_name: str, **kwargs: Any) -> Any:
    import transformers

    torch.manual_seed(0)
    config = getattr(transformers, config_name)(**kwargs)
    return getattr(transformers, model_name)._from_config(
        config, attn_implementation="eager").eval()


REFUSED: dict[str, Callable[[], Any]] = {
    # pre-LN encoders with BERT's module names: the post-LN adapter would be wrong for them
    "xlm-roberta-xl": lambda: _tiny("XLMRobertaXLConfig", "XLMRobertaXLModel", **COMMON),
    "roberta-prelayernorm": lambda: _tiny("RobertaPreLayerNormConfig",
                                          "RobertaPreLayerNormModel", **COMMON),
    # parallel attention + MLP with a fused, per-head interleaved q/k/v projection
    "gpt_neox": lambda: _tiny("GPTNeoXConfig", "GPTNeoXModel", **COMMON),
}


@pytest.mark.parametrize("kind", list(REFUSED))
@pytest.mark.parametrize("measure", ["norm", "alti", "value-zeroing"])
def test_families_not_modelled_are_refused_in_one_line(kind: str, measure: str) -> None:
    model = REFUSED[kind]()
    with pytest.raises(UsageError) as info:
        measures.compute(measure, model, {"input_ids": torch.tensor(IDS)}, model.config)
    message = info.value.message
    assert "\n" not in message and info.value.exit_code == 2
    assert f"measure {measure!r} is not defined for model type {kind!r}" in message
    assert "mistral" in message and "roberta" in message  # names what works
    assert "--measure weights" in str(info.value.hint)


def test_parallel_residual_refuses_alti_and_keeps_norm() -> None:
    model = _tiny("StableLmConfig", "StableLmModel", **DECODER, use_parallel_residual=True)
    inputs = {"input_ids": torch.tensor(IDS)}
    with pytest.raises(UsageError) as info:
        measures.compute("alti", model, inputs, model.config)
    assert "use_parallel_residual=True" in str(info.value)
    assert "measures that work for stablelm: weights, norm, value-zeroing" in str(info.value)
    assert measures.check_supported("alti", _tiny(
        "StableLmConfig", "StableLmModel", **DECODER).config) == "alti"
    with torch.no_grad():
        attn = model(**inputs, output_attentions=True).attentions
    norm = measures.compute("norm", model, inputs, model.config)
    assert all(float(n.sum()) > 0 and n.shape == a.shape for n, a in zip(norm, attn))


def test_a_value_path_the_adapter_does_not_model_is_an_error_not_a_number(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With OLMo's clip_qkv ignored (as an adapter that did not know it would), the rebuilt
    attention output no longer equals the model's: an error, never a silently wrong number."""
    from attnviz.measures import _adapters

    model = _tiny("OlmoConfig", "OlmoModel", **DECODER, clip_qkv=0.05, pad_token_id=0)
    inputs = {"input_ids": torch.tensor(IDS)}
    assert measures.compute("norm", model, inputs, model.config)  # the real adapter: fine
    blind = dataclasses.replace(_adapters.ADAPTERS["olmo"], clip_qkv=False)
    monkeypatch.setitem(_adapters.ADAPTERS, "olmo", blind)
    for name in ("norm", "alti"):
        with pytest.raises(ModelLoadError, match="differs from what attnviz rebuilds"):
            measures.compute(name, model, inputs, model.config)


def test_a_block_output_the_adapter_does_not_model_is_an_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Gemma 2's RMSNorm on the attention output left out: ALTI's rebuilt block output is
    checked against the model's and refused."""
    from attnviz.measures import _adapters

    model = _tiny("Gemma2Config", "Gemma2Model", **DECODER, head_dim=8)
    blind = dataclasses.replace(_adapters.ADAPTERS["gemma2"], out_norm=None)
    monkeypatch.setitem(_adapters.ADAPTERS, "gemma2", blind)
    with pytest.raises(ModelLoadError, match="block's output of layer 0"):
        measures.compute("alti", model, {"input_ids": torch.tensor(IDS)}, model.config)


def test_every_adapter_family_is_tested_here() -> None:
    """Each supported type is either in SPECS or shares its adapter with one that is."""
    from attnviz.measures._adapters import ADAPTERS

    tested = {ADAPTERS[name] for name in SPECS} | {ADAPTERS["bert"], ADAPTERS["gpt2"],
                                                   ADAPTERS["llama"]}
    for name, adapter in ADAPTERS.items():
        same = [t for t in tested if dataclasses_equal_but_type(t, adapter)]
        assert same, f"{name} has an adapter no test exercises"


def dataclasses_equal_but_type(a: Any, b: Any) -> bool:
    return dataclasses.replace(a, model_type="") == dataclasses.replace(b, model_type="")


def test_the_cli_path_gives_the_reference_numbers(invoke: Any, tmp_path: Path) -> None:
    """A Gemma 2 folder (with a tokenizer) through ``attnviz dump --measure``: the saved
    numbers equal the independent reference; a type no adapter knows is one clean line."""
    from transformers import AutoModel, AutoTokenizer

    from attnviz.capture import load_capture
    from attnviz.models.hf import bundled_model_path
    from tests.conftest import SENTENCE

    spec = SPECS["gemma2"]
    folder = tmp_path / "gemma2"
    _build(dataclasses.replace(spec, kwargs={**spec.kwargs, "vocab_size": 30522}), folder)
    AutoTokenizer.from_pretrained(bundled_model_path()).save_pretrained(folder)
    ids = AutoTokenizer.from_pretrained(folder)(SENTENCE)["input_ids"]
    model = AutoModel.from_pretrained(folder, attn_implementation="eager").eval()
    case = Case("gemma2", spec, model, [ids])
    for name in ("norm", "alti"):
        result = invoke("dump", SENTENCE, "--model", str(folder), "--measure", name,
                        "-o", tmp_path / name)
        assert result.exit_code == 0, result.output
        saved = load_capture(tmp_path / name)
        assert saved.measure == name and saved.weights.shape[-1] == len(ids)
        for layer in range(case.layers):
            if name == "norm":
                lengths = np.linalg.norm(case.transformed(layer), axis=-1)
                expected = case.attn[layer] * lengths[:, None, :]
            else:
                vectors, y = case.block(layer)
                closeness = np.clip(np.abs(y).sum(-1)[:, None]
                                    - np.abs(y[:, None] - vectors).sum(-1), 0, None)
                expected = np.broadcast_to(closeness / closeness.sum(-1, keepdims=True),
                                           case.attn[layer].shape)
            _record(case, f"cli-{name}", saved.weights[layer].astype(np.float64), expected)
    neox = tmp_path / "neox"
    REFUSED["gpt_neox"]().save_pretrained(neox)
    AutoTokenizer.from_pretrained(bundled_model_path()).save_pretrained(neox)
    refused = invoke("heads", SENTENCE, "--model", str(neox), "--measure", "norm")
    output = refused.stdout + refused.stderr
    assert refused.exit_code == 2, output
    assert "measure 'norm' is not defined for model type 'gpt_neox'" in output
    assert "Traceback" not in output and output.count("Error:") == 1


def test_the_docs_table_lists_every_supported_type_with_its_measures() -> None:
    """docs/analysis.md's family table says exactly what the adapters support."""
    import re

    from attnviz.measures._adapters import ADAPTERS

    text = (Path(__file__).resolve().parents[1] / "docs" / "analysis.md").read_text("utf-8")
    header = "| family (block shape) | model types | `norm` | `norm-res-ln` | `alti` | " \
             "`value-zeroing` |"
    rows = text[text.index(header):].split("\n\n")[0].splitlines()[2:]
    listed: dict[str, tuple[str, ...]] = {}
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        works = tuple(name for name, cell in zip(
            ("norm", "norm-res-ln", "alti", "value-zeroing"), cells[2:]) if cell.startswith("yes"))
        for kind in re.findall(r"`([^`]+)`", cells[1]):
            listed[kind] = ("weights", *works)
    assert listed == {name: adapter.measures for name, adapter in ADAPTERS.items()}
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text("utf-8")
    for name in ("RoBERTa", "ELECTRA", "Mistral", "Qwen3", "Gemma 2", "Phi-3", "OLMo 2/3",
                 "Granite", "StableLM", "Mixtral"):
        assert name in " ".join(readme.split())


def test_a_model_of_a_known_type_written_differently_is_an_error() -> None:
    """A ``mistral`` whose attention has no ``v_proj`` (as remote code might write it)."""
    model = _tiny("MistralConfig", "MistralModel", **DECODER)
    for layer in model.layers:
        layer.self_attn.values = layer.self_attn.v_proj
        del layer.self_attn.v_proj
    with pytest.raises(ModelLoadError, match="has no 'self_attn.v_proj'"):
        measures.compute("norm", model, {"input_ids": torch.tensor(IDS)}, model.config)
