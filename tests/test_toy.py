"""The toy model: hand-computed softmax, causal mask, determinism across processes."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest

from attnviz.errors import UsageError
from attnviz.models.toy import ToyConfig, ToySource, split_words, word_embedding


def test_three_token_hand_computed():
    """softmax(Q K^T / sqrt(d_k)) computed with numpy from the model's own matrices."""
    config = ToyConfig(d_model=4, heads=2, seed=3)
    source = ToySource(config, device="cpu")
    capture = source.capture("red green blue")
    block = source.model.blocks[0]
    X = np.stack([word_embedding(w, 4, 3) for w in ["red", "green", "blue"]]).astype(np.float64)
    W_Q = block.W_Q.detach().numpy().astype(np.float64)
    W_K = block.W_K.detach().numpy().astype(np.float64)
    for head in range(2):
        cols = slice(head * 2, head * 2 + 2)
        Q, K = X @ W_Q[:, cols], X @ W_K[:, cols]
        scores = Q @ K.T / math.sqrt(2)
        expected = np.exp(scores - scores.max(1, keepdims=True))
        expected /= expected.sum(1, keepdims=True)
        np.testing.assert_allclose(capture.matrix(0, head), expected, atol=1e-6)


def test_causal_zeroes_upper_triangle():
    capture = ToySource(ToyConfig(causal=True, layers=2), device="cpu").capture(
        "one two three four five")
    upper = np.triu(np.ones((5, 5), bool), 1)
    assert (capture.weights[..., upper] == 0).all()
    assert capture.causal
    np.testing.assert_allclose(capture.weights.sum(-1), 1.0, atol=1e-6)


def test_no_scale_saturates():
    text = "the quick brown fox jumps over the lazy dog"
    scaled = ToySource(ToyConfig(d_model=64, heads=1), device="cpu").capture(text)
    raw = ToySource(ToyConfig(d_model=64, heads=1, scale=False), device="cpu").capture(text)
    assert raw.weights.max(-1).mean() > scaled.weights.max(-1).mean()


def test_repeated_word_same_embedding():
    capture = ToySource(device="cpu").capture("the cat and the dog")
    # Rows of the two "the" tokens are identical in a bidirectional single block.
    np.testing.assert_array_equal(capture.weights[0, :, 0], capture.weights[0, :, 3])
    assert split_words("Hello, world!") == ["Hello", ",", "world", "!"]


def test_same_seed_identical_across_processes():
    code = ("from attnviz.models.toy import ToySource, ToyConfig; "
            "c = ToySource(ToyConfig(seed=7, layers=2), device='cpu').capture('a b c a'); "
            "import sys; sys.stdout.buffer.write(c.weights.tobytes())")
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, check=True).stdout
            for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 2 * 2 * 4 * 4 * 4
    here = ToySource(ToyConfig(seed=7, layers=2), device="cpu").capture("a b c a")
    assert here.weights.tobytes() == runs[0]
    other = ToySource(ToyConfig(seed=8, layers=2), device="cpu").capture("a b c a")
    assert other.weights.tobytes() != runs[0]


def test_bad_config():
    with pytest.raises(UsageError, match="not divisible"):
        ToyConfig(d_model=10, heads=3)


def test_a_toy_pair_records_where_its_second_segment_starts(tmp_path):
    """The toy joins a pair without a separator, so it says where the pair's text begins."""
    from attnviz.analysis.tokens import pair_start, token_view
    from attnviz.capture import load_capture

    source = ToySource(ToyConfig(), device="cpu")
    capture = source.capture("the cat sat", "a dog ran")
    assert capture.tokens[pair_start(capture):] == ["a", "dog", "ran"]
    assert pair_start(source.capture("the cat sat")) is None
    assert pair_start(source.capture("the cat sat", "a dog ran", max_tokens=3)) is None
    capture.save(tmp_path / "pair")
    assert pair_start(load_capture(tmp_path / "pair")) == 3
    assert pair_start(token_view(capture, words=True)) == 3
