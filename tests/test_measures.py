"""The measures against an independent numpy recomputation from each layer's own parameters.

The references below read the parameters from the model's ``state_dict`` by name, the layer
inputs from ``output_hidden_states`` and the attention from ``output_attentions`` (not from the
measures' hooks), and loop over heads and tokens explicitly in float64.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from attnviz import measures
from attnviz.errors import UsageError
from tests.conftest import SENTENCE

TOL = 1e-5


class Case:
    """A model, its inputs and the float64 numpy pieces the references need."""

    def __init__(self, model: Any, inputs: dict[str, Any]) -> None:
        self.model = model
        self.config = model.config
        self.kind = model.config.model_type
        self.inputs = inputs
        with torch.no_grad():
            out = model(**inputs, output_hidden_states=True, output_attentions=True)
        self.hidden = [h[0].double().numpy() for h in out.hidden_states]  # [T, D] per layer
        self.attn = [a[0].double().numpy() for a in out.attentions]  # [H, T, T]
        self.state = {k: v.double().numpy() for k, v in model.state_dict().items()}
        self.layers = len(self.attn)
        self.heads = self.attn[0].shape[0]

    def p(self, layer: int, name: str) -> np.ndarray:
        prefix = {"bert": f"encoder.layer.{layer}.", "gpt2": f"h.{layer}.",
                  "llama": f"layers.{layer}."}[self.kind]
        return self.state[prefix + name]

    def attn_input(self, layer: int) -> np.ndarray:
        """What the value projection reads: x (BERT), LayerNorm(x) (GPT-2), RMSNorm(x) (Llama)."""
        x = self.hidden[layer]
        if self.kind == "bert":
            return x
        if self.kind == "gpt2":
            mu = x.mean(-1, keepdims=True)
            var = ((x - mu) ** 2).mean(-1, keepdims=True)
            eps = self.config.layer_norm_epsilon
            return (x - mu) / np.sqrt(var + eps) * self.p(layer, "ln_1.weight") + self.p(
                layer, "ln_1.bias")
        eps = self.config.rms_norm_eps
        return x / np.sqrt((x ** 2).mean(-1, keepdims=True) + eps) * self.p(
            layer, "input_layernorm.weight")

    def head_maps(self, layer: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Per head: (W_V^h [D, dh], b_V^h [dh], W_O^h [dh, D])."""
        d = self.hidden[0].shape[-1]
        heads = self.heads
        dh = d // heads
        out = []
        for h in range(heads):
            if self.kind == "bert":
                wv = self.p(layer, "attention.self.value.weight").T[:, h * dh:(h + 1) * dh]
                bv = self.p(layer, "attention.self.value.bias")[h * dh:(h + 1) * dh]
                wo = self.p(layer, "attention.output.dense.weight").T[h * dh:(h + 1) * dh]
            elif self.kind == "gpt2":
                wv = self.p(layer, "attn.c_attn.weight")[:, 2 * d + h * dh:2 * d + (h + 1) * dh]
                bv = self.p(layer, "attn.c_attn.bias")[2 * d + h * dh:2 * d + (h + 1) * dh]
                wo = self.p(layer, "attn.c_proj.weight")[h * dh:(h + 1) * dh]
            else:
                group = h // (heads // self.config.num_key_value_heads)
                wv = self.p(layer, "self_attn.v_proj.weight").T[:, group * dh:(group + 1) * dh]
                bv = np.zeros(dh)
                wo = self.p(layer, "self_attn.o_proj.weight").T[h * dh:(h + 1) * dh]
            out.append((wv, bv, wo))
        return out

    def out_bias(self, layer: int) -> np.ndarray:
        d = self.hidden[0].shape[-1]
        if self.kind == "bert":
            return self.p(layer, "attention.output.dense.bias")
        if self.kind == "gpt2":
            return self.p(layer, "attn.c_proj.bias")
        return np.zeros(d)

    def vectors(self, layer: int) -> np.ndarray:
        """``z[i, j] = sum_h alpha^h_ij f_h(x_j) + [i == j] x_i``: ``[T, T, D]``."""
        x = self.attn_input(layer)
        resid = self.hidden[layer]
        t, d = x.shape
        z = np.zeros((t, t, d))
        for h, (wv, bv, wo) in enumerate(self.head_maps(layer)):
            for j in range(t):
                fx = (x[j] @ wv + bv) @ wo
                z[:, j, :] += self.attn[layer][h, :, j, None] * fx[None, :]
        for i in range(t):
            z[i, i] += resid[i]
        return z

    def bert_ln(self, layer: int, z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Post-LN: the LayerNorm-transformed vectors and the block's output ``y``."""
        gamma = self.p(layer, "attention.output.LayerNorm.weight")
        beta = self.p(layer, "attention.output.LayerNorm.bias")
        eps = self.config.layer_norm_eps
        pre = z.sum(1) + self.out_bias(layer)  # [T, D]: the LayerNorm's actual input
        std = np.sqrt(pre.var(-1) + eps)  # biased variance, as nn.LayerNorm
        centred = z - z.mean(-1, keepdims=True)
        t = gamma * centred / std[:, None, None]
        bias = gamma * (self.out_bias(layer) - self.out_bias(layer).mean()) / std[:, None]
        return t, t.sum(1) + bias + beta


def _hf_case(folder: Any) -> Case:
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(folder, attn_implementation="eager").eval()
    tok = AutoTokenizer.from_pretrained(folder)
    enc = tok("The cat sat on the mat because it was warm", return_tensors="pt")
    inputs = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}
    return Case(model, inputs)


@pytest.fixture(scope="module")
def bert_case(minilm) -> Case:
    enc = minilm.tokenizer(SENTENCE, return_tensors="pt")
    return Case(minilm.model, minilm._model_inputs(enc))


@pytest.fixture(scope="module")
def gpt2_case(tiny_gpt2_dir) -> Case:
    return _hf_case(tiny_gpt2_dir)


@pytest.fixture(scope="module")
def llama_case(tiny_llama_dir) -> Case:
    return _hf_case(tiny_llama_dir)


@pytest.fixture(params=["bert", "gpt2", "llama"])
def case(request: pytest.FixtureRequest) -> Case:
    return request.getfixturevalue(f"{request.param}_case")


def _compute(case: Case, name: str) -> list[np.ndarray]:
    result = measures.compute(name, case.model, case.inputs, case.config)
    assert len(result) == case.layers
    for layer in result:
        assert layer.dtype == torch.float32
        assert tuple(layer.shape) == (1, case.heads) + case.attn[0].shape[1:]
    return [layer[0].double().numpy() for layer in result]


# ------------------------------------------------------------------------------------ norm
def test_norm_equals_alpha_times_length_of_f(case: Case) -> None:
    got = _compute(case, "norm")
    for layer in range(case.layers):
        x = case.attn_input(layer)
        expected = np.zeros_like(case.attn[layer])
        for h, (wv, bv, wo) in enumerate(case.head_maps(layer)):
            for i in range(x.shape[0]):
                for j in range(x.shape[0]):
                    vector = case.attn[layer][h, i, j] * ((x[j] @ wv + bv) @ wo)
                    expected[h, i, j] = np.linalg.norm(vector)
        np.testing.assert_allclose(got[layer], expected, atol=TOL, rtol=0)
        assert expected.max() > 10 * TOL  # the comparison is not between two near-zero arrays


def test_norm_heads_sum_to_the_layer_output(bert_case: Case) -> None:
    """The vectors whose lengths norm measures add up to the attention's real output."""
    case = bert_case
    layer = 1
    x = case.attn_input(layer)
    total = np.zeros_like(x)
    for h, (wv, bv, wo) in enumerate(case.head_maps(layer)):
        total += case.attn[layer][h] @ ((x @ wv + bv) @ wo)
    captured: dict[str, torch.Tensor] = {}
    dense = case.model.encoder.layer[layer].attention.output.dense
    handle = dense.register_forward_hook(lambda _m, _i, out: captured.setdefault("out", out))
    try:
        with torch.no_grad():
            case.model(**case.inputs)
    finally:
        handle.remove()
    real = captured["out"][0].double().numpy()
    np.testing.assert_allclose(total + case.out_bias(layer), real, atol=1e-4, rtol=0)


def test_weights_measure_is_the_attention(case: Case) -> None:
    got = _compute(case, "weights")
    for layer in range(case.layers):
        np.testing.assert_allclose(got[layer], case.attn[layer], atol=1e-7, rtol=0)


# ------------------------------------------------------------------------------------ errors
def test_unknown_model_type_names_the_types_that_work(tmp_path) -> None:
    from transformers import DistilBertConfig, DistilBertModel

    config = DistilBertConfig(vocab_size=50, dim=16, n_layers=1, n_heads=2, hidden_dim=32)
    model = DistilBertModel(config).eval()
    with pytest.raises(UsageError) as info:
        measures.compute("norm", model, {"input_ids": torch.tensor([[1, 2, 3]])}, config)
    message = str(info.value)
    assert "'distilbert'" in message and "bert" in message and "gpt2" in message
    assert "llama" in message and "--measure weights" in message
    assert info.value.exit_code == 2


def test_unknown_measure_is_a_usage_error(bert_case: Case) -> None:
    with pytest.raises(UsageError, match="choose one of weights, norm"):
        measures.compute("attention-flow", bert_case.model, bert_case.inputs, bert_case.config)


def test_conventions_are_json_and_name_the_reference() -> None:
    import json

    for name in measures.MEASURES:
        record = measures.conventions(name)
        assert record["name"] == name
        assert json.loads(json.dumps(record)) == record
    assert measures.conventions("weights") == {"name": "weights"}
    assert "Kobayashi" in measures.conventions("norm")["reference"]
