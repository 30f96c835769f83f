"""Batched capture: padding never shows, and every text equals its unbatched capture."""

from __future__ import annotations

import numpy as np
import pytest

from attnviz.errors import InputError, UsageError
from attnviz.models.hf import HFSource

TEXTS = [
    "The cat sat on the mat.",
    "Hi",
    "A much longer sentence, with quite a few more tokens in it than any of the others.",
    "Dogs bark.",
    "Unbelievable tokenization of antidisestablishmentarianism",
    "Attention is all you need",
]


def _sharpen(source: HFSource, *names: str) -> HFSource:
    """Scale the query/key projections of random weights: peaked, position-sensitive maps
    instead of near-uniform ones, so a padding mistake cannot hide below the tolerance."""
    import torch

    assert source.attention_modules is not None
    with torch.no_grad():
        for module in source.attention_modules:
            for name in names:
                getattr(module, name).weight.mul_(8)
    return source


@pytest.fixture(scope="module")
def gpt2(tiny_gpt2_dir):
    return _sharpen(HFSource(str(tiny_gpt2_dir), device="cpu"), "c_attn")


@pytest.fixture(scope="module")
def llama(tiny_llama_dir):
    return _sharpen(HFSource(str(tiny_llama_dir), device="cpu"), "q_proj", "k_proj")


def assert_same(batched, single, atol=1e-5):
    assert batched.tokens == single.tokens
    assert batched.word_ids == single.word_ids
    assert batched.special == single.special
    assert batched.display_tokens == single.display_tokens
    assert batched.causal == single.causal
    assert (batched.layers, batched.heads) == (single.layers, single.heads)
    assert batched.weights.shape == single.weights.shape  # no padded rows or columns
    np.testing.assert_allclose(batched.weights, single.weights, rtol=0, atol=atol)
    np.testing.assert_allclose(batched.weights.sum(-1), 1.0, atol=1e-5)


_SINGLES: dict[str, list] = {}


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("name", ["minilm", "gpt2", "llama"])
def test_batched_equals_unbatched(name, side, minilm, gpt2, llama):
    source = {"minilm": minilm, "gpt2": gpt2, "llama": llama}[name]
    if name not in _SINGLES:  # the unbatched reference, computed once per model
        _SINGLES[name] = [source.capture(t) for t in TEXTS]
    singles = _SINGLES[name]
    batched = source.capture_batch(TEXTS, batch_size=4, padding_side=side)
    assert [c.text for c in batched] == TEXTS  # input order kept
    lengths = {c.num_tokens for c in batched}
    assert len(lengths) > 2  # the batches really were padded
    for b, s in zip(batched, singles):
        assert_same(b, s)
        assert b.meta["method"] == "hooks"
    if name != "minilm":
        assert all(c.causal for c in batched)
        for c in batched:
            assert np.all(np.triu(c.weights, 1) == 0)


def test_left_padding_needs_position_ids(gpt2):
    """GPT-2's learned absolute positions: without position ids a left-padded row is wrong."""
    import torch

    from attnviz.models.hooks import record_attention

    enc = gpt2.tokenizer(TEXTS[:2], padding=True, padding_side="left", return_tensors="pt")
    got = {}
    assert gpt2.attention_modules is not None
    with torch.inference_mode(), record_attention(
            gpt2.attention_modules, [1], None, lambda layer, w: got.update(w=w.clone()),
            stop_after_last=False):
        gpt2.model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"])
    short = gpt2.capture(TEXTS[1], layers=[1])
    n = short.num_tokens
    naive = got["w"][1, :, -n:, -n:].numpy()
    assert np.abs(naive - short.weights[0]).max() > 0.05  # the test model can tell
    fixed = gpt2.capture_batch(TEXTS[:2], layers=[1], padding_side="left")[1]
    np.testing.assert_allclose(fixed.weights, short.weights, rtol=0, atol=1e-5)


def test_left_padding_passes_position_ids(llama):
    """Left-padded rows count positions from their first real token, as unpadded runs do."""
    import torch

    enc = llama.tokenizer(TEXTS[:2], padding=True, padding_side="left", return_tensors="pt")
    inputs = llama._model_inputs(enc)
    mask = enc["attention_mask"]
    pad = int((mask[1] == 0).sum())
    assert pad > 0
    expected = torch.cat([torch.zeros(pad, dtype=torch.long),
                          torch.arange(mask.shape[1] - pad)])
    assert torch.equal(inputs["position_ids"][1], expected)
    assert torch.equal(inputs["position_ids"][0], torch.arange(mask.shape[1]))
    assert inputs["use_cache"] is False
    right = llama.tokenizer(TEXTS[:2], padding=True, return_tensors="pt")
    assert "position_ids" not in llama._model_inputs(right)  # the default arange is right


def test_pairs_selection_and_mixed_batches(minilm):
    pairs = ["Second one.", None, "It was not amused at all.", None, "Yes", None]
    singles = [minilm.capture(t, p, layers=[1, 4], heads=[0, 11]) for t, p in zip(TEXTS, pairs)]
    batched = minilm.capture_batch(TEXTS, pairs, batch_size=3, layers=[1, 4], heads=[0, 11])
    for b, s in zip(batched, singles):
        assert_same(b, s)
        assert b.pair == s.pair


def test_order_kept_across_windows(minilm):
    """More texts than one sorting window (4 x batch size): still one capture per text, in order."""
    texts = [" ".join(["word"] * n) for n in (9, 1, 7, 3, 12, 2, 5, 4, 8, 6, 11)]
    batched = minilm.capture_batch(texts, batch_size=2, layers=[0])
    assert [c.text for c in batched] == texts
    assert [c.num_tokens for c in batched] == [n + 2 for n in (9, 1, 7, 3, 12, 2, 5, 4, 8, 6, 11)]


def test_tokenizer_without_pad_token(tiny_gpt2_dir):
    """GPT-2 tokenizers have no pad token: one is set, and padding still never shows."""
    source = HFSource(str(tiny_gpt2_dir), device="cpu")
    source.tokenizer.pad_token = None
    assert source.tokenizer.pad_token is None
    batched = source.capture_batch(TEXTS[:3], batch_size=3, padding_side="left")
    assert source.tokenizer.pad_token is not None
    for b, text in zip(batched, TEXTS[:3]):
        assert_same(b, source.capture(text))


def test_truncation_per_text(minilm):
    long = " ".join(["word"] * 600)
    batched = minilm.capture_batch(["Short text.", long], layers=[0])
    assert batched[1].num_tokens == 512
    assert "text 2 of 2 is 602 tokens long" in batched[1].meta["warnings"][0]
    assert batched[0].meta["warnings"] == []
    with pytest.raises(InputError, match="text 2 of 2 is 602 tokens long, more than the limit"):
        minilm.capture_batch(["Short text.", long], truncate=False)
    capped = minilm.capture_batch(["Short text.", long], max_tokens=5, layers=[0])
    assert [c.num_tokens for c in capped] == [5, 5]
    assert "set by --max-tokens" in capped[1].meta["warnings"][0]


def test_bad_batches(minilm):
    with pytest.raises(InputError, match="text 2 of 3 is empty"):
        minilm.capture_batch(["ok", "  ", "fine"])
    with pytest.raises(UsageError, match="at least 1"):
        minilm.capture_batch(["ok"], batch_size=0)
    with pytest.raises(UsageError, match="2 texts but 1 pairs"):
        minilm.capture_batch(["ok", "fine"], ["x"])
    with pytest.raises(UsageError, match="padding side"):
        minilm.capture_batch(["ok"], padding_side="middle")
    with pytest.raises(UsageError, match="layer 9 is out of range"):
        minilm.capture_batch(["ok"], layers=[9])
    assert minilm.capture_batch([]) == []


def test_capture_many_for_any_source(minilm):
    from attnviz.models import capture_many, load_source

    toy = load_source("toy")
    captured = list(capture_many(toy, ["a b c", "d e"], batch_size=4))
    assert [c.num_tokens for c in captured] == [3, 2]
    np.testing.assert_array_equal(captured[0].weights, toy.capture("a b c").weights)
    hf = list(capture_many(minilm, TEXTS[:3], batch_size=2, layers=[2]))
    for b, text in zip(hf, TEXTS[:3]):
        assert_same(b, minilm.capture(text, layers=[2]))
