"""Captured weights equal an independent recomputation from each layer's own projections."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from attnviz.models.hf import HFSource, guess_word_ids
from tests.conftest import SENTENCE


def _grab_inputs(module: torch.nn.Module, store: dict) -> torch.utils.hooks.RemovableHandle:
    def pre_hook(mod, args, kwargs):
        store["hidden"] = args[0] if args else kwargs["hidden_states"]
        store["kwargs"] = kwargs

    return module.register_forward_pre_hook(pre_hook, with_kwargs=True)


def _softmax(scores: torch.Tensor) -> np.ndarray:
    return torch.softmax(scores.double(), dim=-1).float().numpy()


# --------------------------------------------------------------------------- BERT (MiniLM)
@pytest.mark.parametrize("layer", [0, 3, 5])
def test_minilm_equals_recomputation(minilm, layer):
    """softmax(Q K^T / sqrt(d_k) + mask) from the layer's own query/key projections."""
    module = minilm.model.encoder.layer[layer].attention.self
    store: dict = {}
    handle = _grab_inputs(module, store)
    try:
        capture = minilm.capture("The quick brown fox jumps over the lazy dog.",
                                 "It was not amused.")
    finally:
        handle.remove()
    hidden = store["hidden"][0]  # (T, d_model)
    T = hidden.shape[0]
    d_k = module.attention_head_size
    with torch.no_grad():
        q = module.query(hidden).view(T, -1, d_k).transpose(0, 1)  # (H, T, d_k)
        k = module.key(hidden).view(T, -1, d_k).transpose(0, 1)
        mask = torch.zeros(T, T)  # one unpadded sequence: the additive mask is all zeros
        expected = _softmax(q @ k.transpose(-1, -2) / math.sqrt(d_k) + mask)
    for head in (0, 5, 11):
        np.testing.assert_allclose(capture.matrix(layer, head), expected[head], atol=1e-5)
    np.testing.assert_allclose(capture.weights.sum(-1), 1.0, atol=1e-5)


def test_minilm_weights_are_real(minilm, minilm_capture):
    """Eager attention is used: weights exist, differ across heads and are not uniform."""
    assert minilm.model.config._attn_implementation == "eager"
    w = minilm_capture.weights
    assert w.shape == (6, 12, 8, 8)
    assert np.isfinite(w).all()
    assert w.std() > 0.05  # uniform attention would have std 0
    assert not np.allclose(w[0, 0], w[0, 1])
    assert minilm_capture.causal is False


def test_sdpa_default_gives_no_attentions():
    """Why attnviz forces eager: transformers' default sdpa returns no weights."""
    from transformers import AutoModel, AutoTokenizer

    from attnviz.models.hf import bundled_model_path

    path = bundled_model_path()
    model = AutoModel.from_pretrained(path).eval()
    inputs = AutoTokenizer.from_pretrained(path)(SENTENCE, return_tensors="pt")
    with torch.no_grad():
        out = model(**inputs, output_attentions=True)
    if model.config._attn_implementation == "eager":
        pytest.skip("this transformers version loads eager attention by default")
    assert out.attentions is None or all(a is None for a in out.attentions)


def test_minilm_tokens_word_ids_pair(minilm):
    capture = minilm.capture("Unbelievable tokenization", "Second one")
    assert capture.tokens[0] == "[CLS]" and capture.tokens[-1] == "[SEP]"
    assert capture.special[0] and capture.special[-1]
    pieces = [t for t in capture.tokens if t.startswith("##")]
    assert pieces, capture.tokens  # WordPiece split something
    # Pieces of one word share its id; the second sentence continues the numbering.
    first_sep = capture.tokens.index("[SEP]")
    first_ids = {w for w in capture.word_ids[:first_sep] if w is not None}
    second_ids = {w for w in capture.word_ids[first_sep:] if w is not None}
    assert first_ids == {0, 1} and second_ids == {2, 3}
    assert all(not d.startswith("##") for d in capture.display_tokens)


def test_minilm_selection(minilm):
    capture = minilm.capture(SENTENCE, layers=[1, 4], heads=[0, 11])
    full = minilm.capture(SENTENCE)
    assert capture.weights.shape == (2, 2, 8, 8)
    np.testing.assert_allclose(capture.matrix(4, 11), full.matrix(4, 11), atol=1e-6)


def test_truncation_warns_and_counts(minilm):
    text = " ".join(["word"] * 600)
    capture = minilm.capture(text)
    assert capture.num_tokens == 512
    assert "dropped 90" in capture.meta["warnings"][0]
    from attnviz.errors import InputError

    with pytest.raises(InputError, match="more than the limit of 512"):
        minilm.capture(text, truncate=False)
    assert minilm.capture(SENTENCE, max_tokens=5).num_tokens == 5


# --------------------------------------------------------------------------- decoders
@pytest.fixture(scope="module")
def gpt2(tiny_gpt2_dir):
    return HFSource(str(tiny_gpt2_dir), device="cpu")


def test_gpt2_causal_and_recomputed(gpt2):
    layer = 1
    attn = gpt2.model.h[layer].attn
    store: dict = {}
    handle = _grab_inputs(attn, store)
    try:
        capture = gpt2.capture(SENTENCE)
    finally:
        handle.remove()
    assert capture.causal is True
    upper = np.triu(np.ones(capture.weights.shape[-2:], bool), 1)
    assert (capture.weights[..., upper] == 0).all()  # exactly zero
    hidden = store["hidden"][0]
    T, d = hidden.shape
    H = gpt2.num_heads
    with torch.no_grad():
        q, k, _ = attn.c_attn(hidden).split(d, dim=-1)
        q = q.view(T, H, d // H).transpose(0, 1)
        k = k.view(T, H, d // H).transpose(0, 1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(d // H)
        scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        expected = _softmax(scores)
    np.testing.assert_allclose(capture.weights[layer], expected, atol=1e-5)
    np.testing.assert_allclose(capture.weights.sum(-1), 1.0, atol=1e-5)


def test_llama_causal_and_recomputed(tiny_llama_dir):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    llama = HFSource(str(tiny_llama_dir), device="cpu")
    layer = 0
    attn = llama.model.layers[layer].self_attn
    store: dict = {}
    handle = _grab_inputs(attn, store)
    try:
        capture = llama.capture(SENTENCE)
    finally:
        handle.remove()
    assert capture.causal is True
    hidden = store["hidden"]  # (1, T, d)
    cos, sin = store["kwargs"]["position_embeddings"]
    B, T, _ = hidden.shape
    d_k = attn.head_dim
    with torch.no_grad():
        q = attn.q_proj(hidden).view(B, T, -1, d_k).transpose(1, 2)
        k = attn.k_proj(hidden).view(B, T, -1, d_k).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)  # grouped-query attention
        scores = (q @ k.transpose(-1, -2))[0] / math.sqrt(d_k)
        scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        expected = _softmax(scores)
    np.testing.assert_allclose(capture.weights[layer], expected, atol=1e-5)


def test_guess_word_ids():
    tokens = ["[CLS]", "un", "##believ", "##able", "cat", "[SEP]"]
    assert guess_word_ids(tokens, [True, False, False, False, False, True]) == [
        None, 0, 0, 0, 1, None]
    bpe = ["\u0120The", "\u0120un", "believ", "able"]
    assert guess_word_ids(bpe, [False] * 4) == [0, 1, 1, 1]
    sp = ["<s>", "\u2581The", "\u2581cat", "s", "</s>"]
    assert guess_word_ids(sp, [True, False, False, False, True]) == [None, 0, 1, 1, None]


@pytest.mark.parametrize("arch", ["t5", "distilbert", "roberta"])
def test_other_architectures(tmp_path, arch):
    """Encoder-decoder (encoder self-attention) and other encoders load and capture."""
    from transformers import (
        AutoTokenizer,
        DistilBertConfig,
        DistilBertModel,
        RobertaConfig,
        RobertaModel,
        T5Config,
        T5Model,
    )

    from attnviz.models.hf import bundled_model_path

    if arch == "t5":
        model = T5Model(T5Config(vocab_size=30522, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                 num_heads=4, decoder_start_token_id=0))
    elif arch == "distilbert":
        model = DistilBertModel(DistilBertConfig(vocab_size=30522, dim=32, n_layers=2, n_heads=4,
                                                 hidden_dim=64))
    else:
        model = RobertaModel(RobertaConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2,
                                           num_attention_heads=4, intermediate_size=64,
                                           max_position_embeddings=40))
    model.save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(bundled_model_path()).save_pretrained(tmp_path)
    source = HFSource(str(tmp_path), device="cpu")
    capture = source.capture(SENTENCE, "A second one.")
    assert capture.weights.shape == (2, 4, capture.num_tokens, capture.num_tokens)
    assert not capture.causal
    np.testing.assert_allclose(capture.weights.sum(-1), 1.0, atol=1e-5)
    assert capture.meta["model_type"] == arch
    if arch == "roberta":
        assert source.max_tokens == 38  # 40 positions minus RoBERTa's padding offset
