"""Word-level view: WordPiece (##), byte-level BPE (Ġ) and SentencePiece (▁) tokenizers.

Tiny tokenizers are trained here with the ``tokenizers`` library (no downloads) and saved with
tiny random models, so the word ids come from the real Hugging Face tokenizer code path.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from attnviz.analysis.tokens import find_token, merge_words, word_groups
from attnviz.capture import Capture
from attnviz.errors import UsageError

CORPUS = [
    "The cat sat on the mat.", "The dog sat on the log.", "A bird flew over the house.",
    "Snow fell on the hills, and the children played.", "Boarders jumped over snow banks.",
    "Unbelievably, the quick brown fox jumps over the lazy dog!",
] * 4
TEXT = "The snowboarders jumped over the cat."


def direct_merge(weights: np.ndarray, word_ids: list[int | None]) -> np.ndarray:
    """Clark et al.'s merge by brute force: to a word = sum over pieces, from a word = mean."""
    groups: dict[object, list[int]] = {}
    for position, word in enumerate(word_ids):
        groups.setdefault(("special", position) if word is None else word, []).append(position)
    ordered = sorted(groups.values(), key=lambda g: g[0])
    merged = np.zeros((*weights.shape[:2], len(ordered), len(ordered)))
    for a, rows in enumerate(ordered):
        for b, cols in enumerate(ordered):
            block = weights[:, :, rows][:, :, :, cols]  # [layer, head, |rows|, |cols|]
            merged[:, :, a, b] = block.sum(axis=-1).mean(axis=-1)
    return merged


def check_merge(capture: Capture, tokenizer_word_ids: list[int | None]) -> Capture:
    """Merge, and compare with the direct computation on the tokenizer's own word ids."""
    assert capture.word_ids == tokenizer_word_ids
    merged = merge_words(capture)
    expected = direct_merge(capture.weights.astype(np.float64), tokenizer_word_ids)
    assert merged.weights.shape == expected.shape
    assert np.allclose(merged.weights, expected, atol=1e-6)
    assert np.allclose(merged.weights.sum(axis=-1), 1.0, atol=1e-5)
    assert merged.meta["words_merged"] is True
    words = {w for w in tokenizer_word_ids if w is not None}
    specials = sum(1 for w in tokenizer_word_ids if w is None)
    assert merged.num_tokens == len(words) + specials
    assert "\u2423" not in "".join(merged.display_tokens)  # no bare-marker pieces glued in
    return merged


# --------------------------------------------------------------------------- hand-built
def test_merge_words_on_a_hand_built_capture():
    rng = np.random.default_rng(0)
    word_ids: list[int | None] = [None, 0, 0, 1, 2, 2, 2, None]
    weights = rng.random((2, 3, 8, 8))
    weights /= weights.sum(axis=-1, keepdims=True)
    tokens = ["[CLS]", "un", "##able", "to", "snow", "##board", "##ers", "[SEP]"]
    capture = Capture(tokens=tokens, word_ids=word_ids,
                      special=[True, False, False, False, False, False, False, True],
                      weights=weights.astype(np.float32), layers=[0, 1], heads=[0, 1, 2],
                      num_layers=2, num_heads=3, model="hand", causal=False, text="x")
    merged = check_merge(capture, word_ids)
    assert merged.display_tokens == ["[CLS]", "unable", "to", "snowboarders", "[SEP]"]
    assert merged.special == [True, False, False, False, True]
    assert merged.word_ids == [None, 0, 1, 2, None]
    assert word_groups(capture) == [[0], [1, 2], [3], [4, 5, 6], [7]]
    # by hand: attention from "unable" to "snowboarders"
    manual = weights[1, 2, 1:3, 4:7].sum(axis=1).mean()
    assert merged.weights[1, 2, 1, 3] == pytest.approx(manual, abs=1e-6)


def test_merge_words_keeps_causal_rows_lower_triangular():
    rng = np.random.default_rng(1)
    weights = rng.random((1, 1, 6, 6)) * np.tril(np.ones((6, 6)))
    weights /= weights.sum(axis=-1, keepdims=True)
    word_ids: list[int | None] = [0, 0, 1, 2, 2, 2]
    capture = Capture(tokens=["a", "b", "c", "d", "e", "f"], word_ids=word_ids,
                      special=[False] * 6, weights=weights.astype(np.float32), layers=[0],
                      heads=[0], num_layers=1, num_heads=1, model="hand", causal=True, text="x")
    merged = check_merge(capture, word_ids)
    assert np.allclose(np.triu(merged.weights[0, 0], 1), 0.0)


# --------------------------------------------------------------------------- WordPiece
def test_wordpiece_minilm(minilm):
    capture = minilm.capture("The snowboarders were unbelievably fast.")
    assert any(t.startswith("##") for t in capture.tokens)
    enc = minilm.tokenizer("The snowboarders were unbelievably fast.")
    merged = check_merge(capture, enc.word_ids())
    assert merged.display_tokens == ["[CLS]", "the", "snowboarders", "were", "unbelievably",
                                     "fast", ".", "[SEP]"]


def test_wordpiece_pair_continues_word_numbering(minilm):
    capture = minilm.capture("Snowboarders jumped.", "Unbelievably high!")
    enc = minilm.tokenizer("Snowboarders jumped.", "Unbelievably high!")
    first_words = 1 + max(w for w, s in zip(enc.word_ids(), enc.sequence_ids()) if s == 0)
    expected = [None if w is None else (w + first_words if s == 1 else w)
                for w, s in zip(enc.word_ids(), enc.sequence_ids())]
    merged = check_merge(capture, expected)
    assert merged.display_tokens == ["[CLS]", "snowboarders", "jumped", ".", "[SEP]",
                                     "unbelievably", "high", "!", "[SEP]"]


# --------------------------------------------------------------------------- tiny tokenizers
def _save(model_cls, config, tokenizer, folder: Path) -> Path:
    import torch

    torch.manual_seed(0)
    model_cls(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level BPE tokenizer (GPT-2 style, Ġ marks a leading space) with a tiny GPT-2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GPT2Config, GPT2Model, PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<|endoftext|>",
                                   eos_token="<|endoftext|>", unk_token="<|endoftext|>")
    config = GPT2Config(vocab_size=len(fast), n_positions=64, n_embd=32, n_layer=2, n_head=4)
    return _save(GPT2Model, config, fast, tmp_path_factory.mktemp("bpe-gpt2"))


@pytest.fixture(scope="module")
def sentencepiece_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SentencePiece-style BPE tokenizer (▁ marks a word start, <s> ... </s>) with a tiny
    Llama."""
    from tokenizers import processors
    from tokenizers.implementations import SentencePieceBPETokenizer
    from transformers import LlamaConfig, LlamaModel, PreTrainedTokenizerFast

    sp = SentencePieceBPETokenizer()
    sp.train_from_iterator(CORPUS, vocab_size=200, min_frequency=1,
                           special_tokens=["<unk>", "<s>", "</s>"])
    inner = sp._tokenizer
    inner.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> $B </s>",
        special_tokens=[("<s>", sp.token_to_id("<s>")), ("</s>", sp.token_to_id("</s>"))])
    fast = PreTrainedTokenizerFast(tokenizer_object=inner, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")
    config = LlamaConfig(vocab_size=len(fast), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128)
    return _save(LlamaModel, config, fast, tmp_path_factory.mktemp("sp-llama"))


def test_byte_level_bpe(bpe_dir):
    from attnviz.models.hf import HFSource

    source = HFSource(str(bpe_dir), device="cpu")
    capture = source.capture(TEXT)
    assert any(t.startswith("\u0120") for t in capture.tokens)
    enc = source.tokenizer(TEXT)
    merged = check_merge(capture, enc.word_ids())
    # The tokenizer's word ids (not a guess from markers) decide: "." has no Ġ but is a word.
    assert merged.display_tokens == ["The", "snowboarders", "jumped", "over", "the", "cat", "."]
    assert capture.causal and np.allclose(np.triu(merged.weights[0, 0], 1), 0.0)
    # An unseen word starts with a bare "Ġ" piece, shown as a visible space on its own.
    rare = source.capture("The xylophones jumped.")
    assert "\u0120" in rare.tokens and "\u2423" in rare.display_tokens
    merged = check_merge(rare, source.tokenizer("The xylophones jumped.").word_ids())
    assert merged.display_tokens == ["The", "xylophones", "jumped", "."]


def test_sentencepiece(sentencepiece_dir):
    from attnviz.models.hf import HFSource

    source = HFSource(str(sentencepiece_dir), device="cpu")
    capture = source.capture("The snowboarders banked over the cat.")
    assert any(t.startswith("\u2581") for t in capture.tokens)
    assert capture.special[0] and capture.special[-1]
    enc = source.tokenizer("The snowboarders banked over the cat.")
    merged = check_merge(capture, enc.word_ids())
    assert merged.display_tokens == ["<s>", "The", "snowboarders", "banked", "over", "the",
                                     "cat.", "</s>"]


def test_heads_words_cli_on_bpe(invoke, bpe_dir):
    result = invoke("heads", TEXT, "--model", bpe_dir, "--words", "--format", "json",
                    "--no-induction")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["tokens"] == 7 and data["words"] is True
    # "." is a punctuation word: every head's punct share is the weight on that one column.
    from attnviz.analysis.stats import head_table
    from attnviz.models.hf import HFSource

    merged = merge_words(HFSource(str(bpe_dir), device="cpu").capture(TEXT))
    for got, want in zip(data["heads"], head_table(merged)):
        assert got["punct"] == pytest.approx(want["punct"], abs=1e-6)
        assert got["punct"] > 0


# --------------------------------------------------------------------------- --token
def test_find_token():
    tokens = ["[CLS]", "the", "cat", "the", "5", "[SEP]"]
    assert find_token(tokens, "cat") == 2
    assert find_token(tokens, "The") == 1
    assert find_token(tokens, "the:2") == 3
    assert find_token(tokens, "-1") == 5
    assert find_token(tokens, "0") == 0
    assert find_token(tokens, "5:1") == 4  # a token that reads as a number
    with pytest.raises(UsageError, match="no token 'dog'"):
        find_token(tokens, "dog")
    with pytest.raises(UsageError, match="occurs 2"):
        find_token(tokens, "the:3")
    with pytest.raises(UsageError, match="out of range"):
        find_token(tokens, "6")


def test_words_then_exclude_special_order() -> None:
    """Both views: words merged first, then specials dropped and rows renormalised (as the
    docs state), computed here by hand from the raw weights."""
    rng = np.random.default_rng(7)
    raw = rng.random((1, 1, 6, 6)) ** 3
    raw /= raw.sum(-1, keepdims=True)
    tokens = ["[CLS]", "snow", "##board", "##ers", "jump", "[SEP]"]
    word_ids: list[int | None] = [None, 0, 0, 0, 1, None]
    capture = Capture(tokens=tokens, word_ids=word_ids, special=[w is None for w in word_ids],
                      weights=raw.astype(np.float32), layers=[0], heads=[0], num_layers=1,
                      num_heads=1, model="hand", causal=False, text="snowboarders jump")
    from attnviz.analysis.tokens import token_view

    view = token_view(capture, words=True, exclude_special=True)
    assert view.tokens == ["snowboarders", "jump"]
    pieces = raw[0, 0][[1, 2, 3]][:, 1:5]  # the word's pieces' rows, special columns dropped
    row = np.array([pieces[:, :3].sum(-1).mean(), pieces[:, 3].mean()])
    np.testing.assert_allclose(view.weights[0, 0, 0], row / row.sum(), atol=1e-6)
    # The other order (renormalise pieces first, then merge) gives other numbers here.
    renormalised = pieces / pieces.sum(-1, keepdims=True)
    other = np.array([renormalised[:, :3].sum(-1).mean(), renormalised[:, 3].mean()])
    assert np.abs(other - row / row.sum()).max() > 1e-3
