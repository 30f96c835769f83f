"""Hook capture: equals output_attentions, keeps only what was selected, always cleans up."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnviz.models.hf import HFSource
from attnviz.models.hooks import (
    StopForward,
    _check_weights,
    find_attention_modules,
    is_causal_block,
    record_attention,
)
from tests.conftest import SENTENCE

TEXT = "The quick brown fox jumps over the lazy dog, and the dog does not mind."


@pytest.fixture(scope="module")
def gpt2(tiny_gpt2_dir):
    return HFSource(str(tiny_gpt2_dir), device="cpu")


@pytest.fixture(scope="module")
def llama(tiny_llama_dir):
    return HFSource(str(tiny_llama_dir), device="cpu")


@pytest.fixture(params=["minilm", "gpt2", "llama"])
def source(request, minilm, gpt2, llama):
    chosen = {"minilm": minilm, "gpt2": gpt2, "llama": llama}[request.param]
    yield chosen
    chosen.fused_other_layers = True


def _reference(source: HFSource, text: str) -> np.ndarray:
    """Every layer from output_attentions=True: [layer, head, query, key]."""
    enc, _ = source.encode(text, None, None)
    return np.stack([a[0].numpy() for a in source.forward_attentions(enc)])


def test_modules_found_per_layer(minilm, gpt2, llama):
    expected = {id(minilm): "BertSelfAttention", id(gpt2): "GPT2Attention",
                id(llama): "LlamaAttention"}
    for source in (minilm, gpt2, llama):
        modules = source.attention_modules
        assert modules is not None and len(modules) == source.num_layers
        assert {type(m).__name__ for m in modules} == {expected[id(source)]}
        assert len({id(m) for m in modules}) == source.num_layers
    # Found by position too: the modules of the layer stack, in order.
    assert minilm.attention_modules == [layer.attention.self
                                        for layer in minilm.model.encoder.layer]


def test_shared_layers_are_not_hookable():
    """ALBERT runs one attention module for every layer: no one-to-one map, so no hooks."""
    from transformers import AlbertConfig, AlbertModel

    model = AlbertModel(AlbertConfig(vocab_size=100, embedding_size=16, hidden_size=32,
                                     num_hidden_layers=3, num_attention_heads=4,
                                     intermediate_size=64))
    assert find_attention_modules(model, 3) is None


@pytest.mark.parametrize("layers,heads", [([0], None), ([-1], [0, 2]), (None, [1]),
                                          ([1, 0], [3, 1])])
def test_hooks_equal_output_attentions_exactly(source, layers, heads):
    """With every layer eager, hooked weights are bit-identical to output_attentions."""
    source.fused_other_layers = False
    capture = source.capture(TEXT, layers=layers, heads=heads)
    assert capture.meta["method"] == "hooks"
    reference = _reference(source, TEXT)
    expected = reference[np.ix_(capture.layers, capture.heads)]
    np.testing.assert_array_equal(capture.weights, expected)
    if layers is not None:
        assert capture.layers == [i % source.num_layers for i in layers]


@pytest.mark.parametrize("layer", [0, -1])
def test_fused_other_layers_within_1e6(source, layer):
    """Unselected layers on the fused kernel change the captured weights by float32 noise only.

    The fused and eager kernels sum in different orders; the hidden states entering the last
    layer differ by ~1e-7, which moves single weights by up to ~1e-6 depending on the threads.
    """
    capture = source.capture(TEXT, layers=[layer])
    reference = _reference(source, TEXT)
    np.testing.assert_allclose(capture.weights[0], reference[layer], rtol=0, atol=2e-6)
    np.testing.assert_allclose(capture.weights.sum(-1), 1.0, atol=1e-5)


def test_causal_flag(minilm, gpt2, llama):
    assert not minilm.capture(SENTENCE, layers=[-1]).causal
    assert gpt2.capture(SENTENCE, layers=[-1]).causal
    assert llama.capture(SENTENCE, layers=[0]).causal


def _watch(modules: list[torch.nn.Module]) -> tuple[dict[int, str], list]:
    """Record per layer whether its module ran and whether it built attention weights."""
    seen: dict[int, str] = {}
    handles = []
    for index, module in enumerate(modules):
        def hook(mod, args, output, index=index):
            built = isinstance(output, tuple) and isinstance(output[1], torch.Tensor)
            seen[index] = "weights" if built else "fused"
        handles.append(module.register_forward_hook(hook))
    return seen, handles


def test_unselected_layers_not_materialised_nor_kept(minilm):
    """Layers before the selected one never build weights; layers after it never run."""
    modules = minilm.attention_modules
    assert modules is not None
    seen, handles = _watch(modules)
    try:
        capture = minilm.capture(TEXT, layers=[2], heads=[5])
    finally:
        for handle in handles:
            handle.remove()
    assert seen == {0: "fused", 1: "fused", 2: "weights"}  # 3..5 skipped
    assert capture.weights.shape == (1, 1, capture.num_tokens, capture.num_tokens)
    assert capture.layers == [2] and capture.heads == [5]


def _hook_ids(modules: list[torch.nn.Module]) -> list[list[int]]:
    # transformers keeps its own output-capturing hooks installed: compare, do not expect none
    return [sorted(m._forward_hooks) for m in modules]


def test_hooks_and_configs_removed(minilm):
    modules = minilm.attention_modules
    assert modules is not None
    before = _hook_ids(modules)
    minilm.capture(SENTENCE, layers=[3])
    assert _hook_ids(modules) == before
    assert all(m.config is minilm.model.config for m in modules)
    assert minilm.model.config._attn_implementation == "eager"


def test_hooks_removed_when_the_sink_fails(minilm):
    modules = minilm.attention_modules
    assert modules is not None
    enc, _ = minilm.encode(SENTENCE, None, None)
    before = _hook_ids(modules)

    def sink(layer, weights):
        raise KeyError("sink failed")

    with pytest.raises(KeyError), torch.inference_mode(), record_attention(
            modules, [4], None, sink, fused_other_layers=True):
        assert modules[0].config._attn_implementation == "sdpa"
        minilm.model(**{k: v for k, v in enc.items() if k != "special_tokens_mask"})
    assert _hook_ids(modules) == before
    assert all(m.config is minilm.model.config for m in modules)


def test_record_attention_stops_after_last(minilm):
    modules = minilm.attention_modules
    assert modules is not None
    enc, _ = minilm.encode(SENTENCE, None, None)
    got: dict[int, np.ndarray] = {}
    with torch.inference_mode(), record_attention(
            modules, [1, 0], [0, 11], lambda layer, w: got.update({layer: w.numpy().copy()}),
            num_heads=12) as recording:
        with pytest.raises(StopForward):
            minilm.model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"])
    assert recording.complete and sorted(got) == [0, 1]
    assert got[0].shape == (1, 2, 8, 8)


def test_unhookable_model_falls_back(tmp_path):
    """T5's attention module returns its position bias second: caught, output_attentions used."""
    from transformers import AutoTokenizer, T5Config, T5Model

    from attnviz.models.hf import bundled_model_path

    torch.manual_seed(0)
    T5Model(T5Config(vocab_size=30522, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                     decoder_start_token_id=0)).save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(bundled_model_path()).save_pretrained(tmp_path)
    source = HFSource(str(tmp_path), device="cpu")
    capture = source.capture(SENTENCE, layers=[1], heads=[2])
    assert capture.meta["method"] == "output_attentions"
    assert source.attention_modules is None  # not tried again
    reference = _reference(source, SENTENCE)
    np.testing.assert_array_equal(capture.weights[0, 0], reference[1, 2])


def test_check_weights_rejects_non_softmax():
    good = torch.softmax(torch.randn(1, 2, 5, 5), dim=-1)
    assert _check_weights(good, 2) is None
    assert "no weights" in str(_check_weights(None, 2))
    assert "heads" in str(_check_weights(good, 3))
    assert "sum to 1" in str(_check_weights(good * 2, 2))
    assert "sum to 1" in str(_check_weights(torch.full((1, 2, 5, 5), float("nan")), 2))
    assert "shape" in str(_check_weights(torch.ones(1, 2, 5, 4), 2))


def test_is_causal_block_chunks():
    rng = np.random.default_rng(0)
    lower = torch.from_numpy(np.tril(rng.random((3, 7, 7)))).float()
    assert is_causal_block(lower, rows=2)
    for row, col in [(0, 1), (5, 6), (2, 6)]:
        broken = lower.clone()
        broken[1, row, col] = 1e-9
        assert not is_causal_block(broken, rows=2)
    assert not is_causal_block(torch.ones(1, 1, 1))
