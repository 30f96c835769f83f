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

    def keep(_module: Any, _args: Any, out: torch.Tensor) -> None:
        captured["out"] = out

    handle = dense.register_forward_hook(keep)
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


# ------------------------------------------------------------------------ alti, norm-res-ln
def _block_output(case: Case, layer: int) -> np.ndarray:
    """The attention block's real output, read from the model by a hook: ``[T, D]``."""
    captured: dict[str, Any] = {}
    if case.kind == "bert":
        module = case.model.encoder.layer[layer].attention
    else:
        module = case.model.h[layer].attn if case.kind == "gpt2" else case.model.layers[
            layer].self_attn

    def keep(_module: Any, _args: Any, out: Any) -> None:
        captured["out"] = out[0]

    handle = module.register_forward_hook(keep)
    try:
        with torch.no_grad():
            case.model(**case.inputs)
    finally:
        handle.remove()
    out = captured["out"][0].double().numpy()
    return out if case.kind == "bert" else out + case.hidden[layer]  # pre-LN: + residual


def _reference_vectors(case: Case, layer: int) -> tuple[np.ndarray, np.ndarray]:
    z = case.vectors(layer)
    if case.kind == "bert":
        return case.bert_ln(layer, z)
    return z, z.sum(1) + case.out_bias(layer)


def test_alti_equals_the_l1_formula_and_rows_sum_to_one(case: Case) -> None:
    got = _compute(case, "alti")
    for layer in range(case.layers):
        vectors, y = _reference_vectors(case, layer)
        # The decomposition adds up to what the model really computes.
        np.testing.assert_allclose(y, _block_output(case, layer), atol=2e-4, rtol=0)
        t = y.shape[0]
        expected = np.zeros((t, t))
        for i in range(t):
            for j in range(t):
                expected[i, j] = max(0.0, np.abs(y[i]).sum() - np.abs(y[i] - vectors[i, j]).sum())
            expected[i] /= expected[i].sum()
        for h in range(case.heads):  # one matrix per layer, repeated for every head
            np.testing.assert_allclose(got[layer][h], expected, atol=TOL, rtol=0)
        np.testing.assert_allclose(got[layer].sum(-1), 1.0, atol=1e-6)
        if case.kind != "bert":  # causal: a token gets nothing from later tokens
            assert np.all(np.triu(got[layer][0], 1) == 0)


def test_norm_res_ln_is_the_length_of_the_layernormed_vectors(bert_case: Case) -> None:
    case = bert_case
    got = _compute(case, "norm-res-ln")
    for layer in range(case.layers):
        vectors, _ = _reference_vectors(case, layer)
        expected = np.linalg.norm(vectors, axis=-1)
        for h in range(case.heads):
            np.testing.assert_allclose(got[layer][h], expected, atol=TOL, rtol=0)
        # the residual makes the diagonal large: each token mostly keeps itself
        assert np.all(np.diag(expected) > expected.mean())


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_norm_res_ln_is_not_defined_for_pre_ln_models(kind: str,
                                                      request: pytest.FixtureRequest) -> None:
    case = request.getfixturevalue(f"{kind}_case")
    with pytest.raises(UsageError) as info:
        measures.compute("norm-res-ln", case.model, case.inputs, case.config)
    message = str(info.value)
    assert f"model type '{kind}'" in message and "pre-LN" in message
    assert f"measures that work for {kind}: weights, norm, alti, value-zeroing" in message


def test_padded_batch_rows_equal_single_runs(tiny_gpt2_dir) -> None:
    """A padded batch gives each row what that text gives alone (padding is masked)."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(tiny_gpt2_dir, attn_implementation="eager").eval()
    ids = torch.tensor([[5, 6, 7, 8, 9], [5, 6, 7, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    for name in ("norm", "alti", "value-zeroing"):
        batch = measures.compute(name, model, {"input_ids": ids, "attention_mask": mask},
                                 model.config)
        alone = measures.compute(name, model, {"input_ids": ids[1:, :3]}, model.config)
        for both, one in zip(batch, alone):
            np.testing.assert_allclose(both[1, :, :3, :3].numpy(), one[0].numpy(), atol=1e-6)


# ---------------------------------------------------------------------------- value zeroing
def _value_module(model: Any, kind: str, layer: int) -> tuple[Any, slice]:
    d = model.config.hidden_size if kind != "gpt2" else model.config.n_embd
    if kind == "bert":
        return model.encoder.layer[layer].attention.self.value, slice(None)
    if kind == "gpt2":
        return model.h[layer].attn.c_attn, slice(2 * d, 3 * d)
    return model.layers[layer].self_attn.v_proj, slice(None)


def _layer_module(model: Any, kind: str, layer: int) -> Any:
    return {"bert": lambda: model.encoder.layer[layer], "gpt2": lambda: model.h[layer],
            "llama": lambda: model.layers[layer]}[kind]()


def _layer_output(model: Any, kind: str, inputs: dict[str, Any], layer: int,
                  zero: int | None) -> np.ndarray:
    """Run the whole model; layer ``layer``'s output, with token ``zero``'s value zeroed."""
    seen: dict[str, torch.Tensor] = {}

    def zero_value(_module: Any, _args: Any, out: torch.Tensor) -> torch.Tensor:
        out = out.clone()
        out[:, zero, part] = 0.0
        return out

    def keep(_module: Any, _args: Any, out: Any) -> None:
        seen["out"] = out[0] if isinstance(out, tuple) else out

    value, part = _value_module(model, kind, layer)
    handles = [_layer_module(model, kind, layer).register_forward_hook(keep)]
    if zero is not None:
        handles.append(value.register_forward_hook(zero_value))
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        for handle in handles:
            handle.remove()
    return seen["out"][0].numpy()


def test_value_zeroing_equals_rerunning_the_model_with_each_value_zeroed(case: Case) -> None:
    import copy

    got = _compute(case, "value-zeroing")
    model64 = copy.deepcopy(case.model).double()
    tokens = case.attn[0].shape[-1]
    # MiniLM: the first, a middle and the last layer (each needs tokens + 1 whole passes).
    chosen = [0, 2, case.layers - 1] if case.kind == "bert" else range(case.layers)
    for layer in chosen:
        original = _layer_output(model64, case.kind, case.inputs, layer, None)
        expected = np.zeros((tokens, tokens))
        for j in range(tokens):
            changed = _layer_output(model64, case.kind, case.inputs, layer, j)
            for i in range(tokens):
                a, b = original[i], changed[i]
                expected[i, j] = 1 - a @ b / (np.linalg.norm(a) * np.linalg.norm(b))
        expected = np.clip(expected, 0, None)
        expected /= expected.sum(-1, keepdims=True)
        for h in range(case.heads):
            np.testing.assert_allclose(got[layer][h], expected, atol=TOL, rtol=0)
        np.testing.assert_allclose(got[layer].sum(-1), 1.0, atol=1e-6)
        if case.kind != "bert":
            assert np.all(np.triu(got[layer][0], 1) < 1e-9)


def test_value_zeroing_batches_of_copies_do_not_change_the_result(gpt2_case: Case,
                                                                  monkeypatch) -> None:
    """Rerunning one zeroed copy at a time gives what the batched copies give."""
    import attnviz.measures.value_zeroing as vz

    batched = _compute(gpt2_case, "value-zeroing")
    monkeypatch.setattr(vz, "CHUNK_BYTES", 1)  # one copy per rerun
    single = _compute(gpt2_case, "value-zeroing")
    for one, many in zip(single, batched):
        np.testing.assert_allclose(one, many, atol=1e-9)


def test_check_supported_reads_the_config_alone(gpt2_case: Case) -> None:
    assert measures.check_supported("ALTI", gpt2_case.config) == "alti"
    assert measures.check_supported("weights", object()) == "weights"
    with pytest.raises(UsageError, match="measures that work for gpt2"):
        measures.check_supported("norm-res-ln", gpt2_case.config)


def test_small_query_chunks_give_the_same_numbers(bert_case: Case, monkeypatch) -> None:
    import attnviz.measures._collect as collect_module

    whole = {name: _compute(bert_case, name) for name in ("alti",)}
    monkeypatch.setattr(collect_module, "CHUNK_BYTES", 1)  # one query at a time
    for name, layers in whole.items():
        for one, chunked in zip(layers, _compute(bert_case, name)):
            np.testing.assert_allclose(chunked, one, atol=1e-9)


def test_a_fused_attention_kernel_is_a_clear_error(tiny_gpt2_dir) -> None:
    from transformers import AutoModel

    from attnviz.errors import ModelLoadError

    model = AutoModel.from_pretrained(tiny_gpt2_dir, attn_implementation="sdpa").eval()
    for name in ("norm", "weights"):
        with pytest.raises(ModelLoadError) as info:
            measures.compute(name, model, {"input_ids": torch.tensor([[5, 6, 7]])}, model.config)
        assert "attn_implementation=\"eager\"" in str(info.value)
