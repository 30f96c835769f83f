"""Capturing from a model object already in memory, and from an ``outputs.attentions`` tuple.

The reference everywhere is :class:`HFSource` loading the same folder with eager attention,
the path the CLI takes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import attnviz
from attnviz.capture import Capture, load_capture
from attnviz.errors import InputError, ModelLoadError, UsageError
from attnviz.models.hf import HFSource, bundled_model_path
from attnviz.models.own import eager_attention

TEXT = "The cat sat on the mat because it was warm."
PAIR = "A dog barked at the moon."


@pytest.fixture(scope="module")
def tiny_bert_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight BERT saved with save_pretrained (MiniLM's tokenizer)."""
    from transformers import AutoTokenizer, BertConfig, BertModel

    config = BertConfig(vocab_size=30522, hidden_size=32, intermediate_size=64,
                        num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=128)
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("tiny-bert")
    BertModel(config).save_pretrained(out)
    AutoTokenizer.from_pretrained(bundled_model_path()).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def folders(tiny_bert_dir: Path, tiny_gpt2_dir: Path, tiny_llama_dir: Path) -> dict[str, Path]:
    return {"bert": tiny_bert_dir, "gpt2": tiny_gpt2_dir, "llama": tiny_llama_dir}


def _load_sdpa(folder: Path, cls_name: str = "AutoModel") -> tuple[object, object]:
    import transformers

    model = getattr(transformers, cls_name).from_pretrained(folder, attn_implementation="sdpa")
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    return model, tokenizer


def _implementations(model: torch.nn.Module) -> list[str | None]:
    """The attention implementation of every configuration the model's modules hold."""
    seen: dict[int, str | None] = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            seen[id(config)] = config._attn_implementation
    return list(seen.values())


@pytest.mark.parametrize("kind", ["bert", "gpt2", "llama"])
def test_sdpa_model_equals_the_eager_capture_and_is_left_as_it_was(folders, kind: str) -> None:
    folder = folders[kind]
    pair = PAIR if kind == "bert" else None
    reference = HFSource(str(folder), device="cpu").capture(TEXT, pair)
    model, tokenizer = _load_sdpa(folder)
    assert model.config._attn_implementation == "sdpa"
    before = _implementations(model)
    assert set(before) == {"sdpa"}
    inputs = tokenizer(TEXT, pair, return_tensors="pt")
    with torch.no_grad():
        plain = model(**inputs, output_attentions=True)
        hidden_before = plain.last_hidden_state.clone()
    assert not plain.attentions  # sdpa gives no weights: the capture has to switch

    captured = attnviz.capture(model, tokenizer, TEXT, pair)

    assert captured.tokens == reference.tokens
    assert captured.word_ids == reference.word_ids
    assert captured.special == reference.special
    assert captured.causal == reference.causal == (kind != "bert")
    assert captured.weights.dtype == np.float32
    assert captured.weights.shape == reference.weights.shape
    np.testing.assert_allclose(captured.weights, reference.weights, atol=1e-5, rtol=0)
    assert captured.meta["attn_implementation"] == "eager"
    assert captured.meta["model_attn_implementation"] == "sdpa"
    assert "back to sdpa" in captured.meta["attn_switch"]
    # Left as it was: implementation everywhere, eval/train flags, and what it computes.
    assert model.config._attn_implementation == "sdpa"
    assert _implementations(model) == before
    assert not model.training
    with torch.no_grad():
        hidden_after = model(**inputs).last_hidden_state
    assert torch.equal(hidden_before, hidden_after)


def test_layer_and_head_selection(folders) -> None:
    reference = HFSource(str(folders["llama"]), device="cpu").capture(TEXT)
    model, tokenizer = _load_sdpa(folders["llama"])
    part = attnviz.capture(model, tokenizer, TEXT, layers="1", heads=[0, -1])
    assert (part.layers, part.heads) == ([1], [0, 3])
    np.testing.assert_allclose(part.weights, reference.weights[1:2][:, [0, 3]], atol=1e-5)
    with pytest.raises(UsageError, match="layer 5 is out of range"):
        attnviz.capture(model, tokenizer, TEXT, layers=[5])
    assert model.config._attn_implementation == "sdpa"


def test_lm_head_model_in_training_mode(folders) -> None:
    """A ...ForCausalLM with dropout, left in training mode: captured without dropout."""
    reference = HFSource(str(folders["gpt2"]), device="cpu").capture(TEXT)
    model, tokenizer = _load_sdpa(folders["gpt2"], "AutoModelForCausalLM")
    model.train()
    model.lm_head.eval()  # a mixed state must come back exactly as it was
    flags = [m.training for m in model.modules()]
    captured = attnviz.capture(model, tokenizer, TEXT)
    np.testing.assert_allclose(captured.weights, reference.weights, atol=1e-5)
    assert [m.training for m in model.modules()] == flags
    assert any("training mode" in w for w in captured.meta["warnings"])
    assert model.config._attn_implementation == "sdpa"


def test_bfloat16_model_gives_float32_weights_close_to_float32(folders) -> None:
    reference = HFSource(str(folders["gpt2"]), device="cpu").capture(TEXT)
    model, tokenizer = _load_sdpa(folders["gpt2"])
    model = model.to(torch.bfloat16)
    captured = attnviz.capture(model, tokenizer, TEXT)
    assert captured.weights.dtype == np.float32
    assert captured.meta["dtype"] == "bfloat16"
    assert float(np.abs(captured.weights - reference.weights).max()) < 0.02
    np.testing.assert_allclose(captured.weights.sum(-1), 1.0, atol=0.02)


def test_failed_capture_still_restores_the_model(folders) -> None:
    model, tokenizer = _load_sdpa(folders["gpt2"])
    with pytest.raises(InputError, match="limit of 4 tokens"):
        attnviz.capture(model, tokenizer, TEXT, max_tokens=4, truncate=False)
    assert set(_implementations(model)) == {"sdpa"}
    with pytest.raises(RuntimeError), eager_attention(model) as was:
        assert was == "sdpa" and model.config._attn_implementation == "eager"
        raise RuntimeError("boom")
    assert set(_implementations(model)) == {"sdpa"}


def test_wrong_objects_say_what_to_pass(folders) -> None:
    model, tokenizer = _load_sdpa(folders["gpt2"])
    with pytest.raises(UsageError, match="swapped"):
        attnviz.capture(tokenizer, model, TEXT)
    with pytest.raises(UsageError, match="from_attentions"):
        attnviz.capture(torch.nn.Linear(2, 2), tokenizer, TEXT)
    with pytest.raises(UsageError, match="tokenizer"):
        attnviz.capture(model, "gpt2", TEXT)
    with pytest.raises(InputError, match="empty"):
        attnviz.capture(model, tokenizer, "   ")


def test_model_that_cannot_switch_gets_a_clear_error(folders) -> None:
    model, tokenizer = _load_sdpa(folders["gpt2"])
    model._can_set_attn_implementation = lambda: False  # an attention that is not pluggable
    with pytest.raises(ModelLoadError, match="cannot switch to eager") as info:
        attnviz.capture(model, tokenizer, TEXT)
    assert "attn_implementation=\"eager\"" in str(info.value.hint)
    assert model.config._attn_implementation == "sdpa"


# --------------------------------------------------------------------------- from_attentions
def test_from_attentions_of_a_padded_batch_equals_the_capture(minilm) -> None:
    texts = [TEXT, "Short one.", "The bank of the river"]
    tokenizer = minilm.tokenizer
    enc = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        outputs = minilm.model(**enc, output_attentions=True)
    assert len(outputs.attentions) == 6
    for row, text in enumerate(texts):
        reference = minilm.capture(text)
        tokens = tokenizer.convert_ids_to_tokens(enc["input_ids"][row])
        assert len(tokens) > reference.num_tokens or row == 0  # the short rows are padded
        built = Capture.from_attentions(outputs.attentions, tokens, batch_index=row,
                                        attention_mask=enc["attention_mask"],
                                        tokenizer=tokenizer, model="minilm", text=text)
        assert built.tokens == reference.tokens
        assert built.special == reference.special
        assert built.word_ids == reference.word_ids
        assert built.causal is False and built.meta["warnings"] == []
        np.testing.assert_allclose(built.weights, reference.weights, atol=1e-5, rtol=0)
    # Ids work as tokens with the tokenizer; the whole batch of ids is indexed too.
    by_ids = Capture.from_attentions(outputs.attentions, enc["input_ids"], batch_index=-2,
                                     attention_mask=enc["attention_mask"], tokenizer=tokenizer)
    assert by_ids.tokens == minilm.capture(texts[1]).tokens
    assert by_ids.text == "short one."


def test_from_attentions_left_padding_numpy_and_save_round_trip(minilm_capture: Capture,
                                                                tmp_path: Path) -> None:
    cap = minilm_capture
    layers, heads, size = cap.weights.shape[:3]
    pad = 3
    batch = np.random.default_rng(1).random((layers, 2, heads, size + pad, size + pad))
    batch = batch.astype(np.float32)
    batch[:, 1, :, pad:, pad:] = cap.weights  # row 1: left padded
    mask = np.zeros((2, size + pad), dtype=np.int64)
    mask[1, pad:] = 1
    mask[0, :] = 1
    tokens = ["[PAD]"] * pad + cap.tokens
    built = Capture.from_attentions(tuple(batch), tokens, batch_index=1, attention_mask=mask,
                                    model=cap.model, text=cap.text)
    np.testing.assert_array_equal(built.weights, cap.weights)
    assert built.tokens == cap.tokens and built.special == cap.special
    assert built.word_ids == cap.word_ids  # guessed from ## markers
    # Stacked [layer, batch, head, query, key] torch bfloat16 gives the same within bf16.
    stacked = torch.from_numpy(batch).to(torch.bfloat16)
    again = Capture.from_attentions(stacked, cap.tokens, batch_index=1, attention_mask=mask)
    assert float(np.abs(again.weights - cap.weights).max()) < 4e-3
    built.save(tmp_path / "mine")
    loaded = load_capture(tmp_path / "mine")
    np.testing.assert_array_equal(loaded.weights, cap.weights)
    assert loaded.tokens == cap.tokens and loaded.text == cap.text


def test_from_attentions_subset_and_causal_detection() -> None:
    size = 5
    weights = np.tril(np.ones((size, size), dtype=np.float32))
    weights /= weights.sum(-1, keepdims=True)
    per_layer = [np.broadcast_to(weights, (1, 2, size, size)).copy() for _ in range(2)]
    tokens = ["Ġthe", "Ġcat", "Ġsat", "Ġon", "Ġit"]
    built = Capture.from_attentions(per_layer, tokens, layers=[3, 7], heads=[1, 4],
                                    num_layers=12, num_heads=8)
    assert built.causal is True
    assert (built.layers, built.heads, built.num_layers, built.num_heads) == (
        [3, 7], [1, 4], 12, 8)
    np.testing.assert_array_equal(built.matrix(7, 4), weights)
    assert built.display_tokens == ["the", "cat", "sat", "on", "it"]
    assert built.text == "the cat sat on it"


def test_from_attentions_refuses_what_does_not_fit() -> None:
    good = [np.full((1, 2, 4, 4), 0.25, dtype=np.float32)]
    tokens = ["a", "b", "c", "d"]
    with pytest.raises(UsageError, match="eager"):
        Capture.from_attentions((), tokens)
    with pytest.raises(UsageError, match="eager"):
        Capture.from_attentions((None, None), tokens)
    with pytest.raises(UsageError, match="batch index 3 is out of range"):
        Capture.from_attentions(good, tokens, batch_index=3)
    with pytest.raises(UsageError, match="attention mask has shape"):
        Capture.from_attentions(good, tokens, attention_mask=np.ones((1, 6)))
    with pytest.raises(UsageError, match="got 3 tokens for 4 positions"):
        Capture.from_attentions(good, tokens[:3])
    with pytest.raises(UsageError, match="differ in shape"):
        Capture.from_attentions(good + [np.ones((1, 2, 3, 3))], tokens)
    with pytest.raises(UsageError, match="not one string"):
        Capture.from_attentions(good, "a b c d")
    with pytest.raises(UsageError, match="NaN"):
        Capture.from_attentions([np.full((1, 2, 4, 4), np.nan)], tokens)
    # Rows that do not sum to 1 would save a capture that load_capture refuses.
    with pytest.raises(UsageError, match="must sum to 1"):
        Capture.from_attentions([np.full((1, 2, 4, 4), 0.5, dtype=np.float32)], tokens)
