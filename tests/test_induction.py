"""Induction-head detection: a hand-built two-layer induction circuit is found, random models
have none."""

from __future__ import annotations

import json

import numpy as np
import pytest

from attnviz.analysis.induction import (
    induction_heads,
    induction_scores,
    induction_stripe,
    repeated_sequence,
)
from attnviz.analysis.stats import INDUCTION_SCORE, head_table
from attnviz.capture import Capture


def softmax_causal(scores: np.ndarray) -> np.ndarray:
    size = scores.shape[0]
    masked = np.where(np.triu(np.ones((size, size), dtype=bool), 1), -np.inf, scores)
    masked = masked - masked.max(axis=1, keepdims=True)
    weights = np.exp(masked)
    return weights / weights.sum(axis=1, keepdims=True)


class AttentionOnlyModel:
    """A two-layer, two-head, attention-only causal transformer with one-hot embeddings.

    The residual stream has three blocks: the token (one-hot), the position (one-hot) and a
    "previous token" slot. With ``hand_built=True`` the weights implement the classic induction
    circuit (Elhage et al., 2021):

    * layer 0, head 0 is a previous-token head: query ``i`` matches key ``i - 1`` by position,
      and its OV circuit writes the attended token into the previous-token slot;
    * layer 1, head 0 is the induction head (K-composition): its query is the current token, its
      key the previous-token slot, so it attends to the position right after an earlier
      occurrence of the current token.

    The second head of each layer has small random QK weights and writes nothing. With
    ``hand_built=False`` every matrix is random.
    """

    num_layers = 2
    num_heads = 2

    def __init__(self, hand_built: bool, vocab: int = 60, positions: int = 160,
                 sharpness: float = 30.0, seed: int = 0) -> None:
        self.vocab_size = vocab  # tokens 0..vocab-1 are drawn; token `vocab` is BOS
        self.prefix_ids = [vocab]
        self.max_tokens = positions
        size = vocab + 1
        self.tok, self.pos, self.prev = 0, size, size + positions
        self.width = 2 * size + positions
        rng = np.random.default_rng(seed)
        d = self.width

        def random(scale: float, cols: int = d) -> np.ndarray:
            return rng.normal(0.0, scale, (d, cols))

        if not hand_built:
            self.qk = [[(random(1.0), random(1.0)) for _ in range(2)] for _ in range(2)]
            self.ov = [[random(1.0 / np.sqrt(d)) for _ in range(2)] for _ in range(2)]
            return
        prev_q, prev_k = np.zeros((d, positions)), np.zeros((d, positions))
        for i in range(1, positions):
            prev_q[self.pos + i, i - 1] = sharpness  # query at i looks for position i - 1
        for j in range(positions):
            prev_k[self.pos + j, j] = 1.0
        copy = np.zeros((d, d))
        for t in range(size):
            copy[self.tok + t, self.prev + t] = 1.0  # token -> previous-token slot
        ind_q, ind_k = np.zeros((d, size)), np.zeros((d, size))
        for t in range(size):
            ind_q[self.tok + t, t] = sharpness  # the current token ...
            ind_k[self.prev + t, t] = 1.0  # ... against the token before each key
        self.qk = [[(prev_q, prev_k), (random(0.05), random(0.05))],
                   [(ind_q, ind_k), (random(0.05), random(0.05))]]
        self.ov = [[copy, np.zeros((d, d))], [np.zeros((d, d)), np.zeros((d, d))]]

    def attention_on_ids(self, ids: list[int]) -> np.ndarray:
        """Attention ``[layer, head, T, T]`` on a sequence of token ids."""
        size = len(ids)
        x = np.zeros((size, self.width))
        x[np.arange(size), self.tok + np.asarray(ids)] = 1.0
        x[np.arange(size), self.pos + np.arange(size)] = 1.0
        layers = []
        for layer in range(2):
            patterns, update = [], np.zeros_like(x)
            for head in range(2):
                w_q, w_k = self.qk[layer][head]
                pattern = softmax_causal((x @ w_q) @ (x @ w_k).T)
                patterns.append(pattern)
                update += pattern @ (x @ self.ov[layer][head])
            x = x + update
            layers.append(patterns)
        return np.asarray(layers)


def test_stripe_of_a_perfect_induction_pattern():
    length, prefix = 6, 1
    size = prefix + 2 * length
    attention = np.zeros((1, 2, size, size))
    attention[0, 1] = np.eye(size)
    for k in range(length):
        attention[0, 0, prefix + length + k] = 0
        attention[0, 0, prefix + length + k, prefix + k + 1] = 1.0
    scores = induction_stripe(attention, length, prefix)
    assert scores[0, 0] == pytest.approx(1.0)
    assert scores[0, 1] == pytest.approx(0.0)


def test_repeated_sequence_has_distinct_tokens_twice():
    rng = np.random.RandomState(0)
    ids = repeated_sequence(np.arange(100), 20, rng, prefix=[999])
    assert ids[0] == 999 and len(ids) == 41
    assert ids[1:21] == ids[21:] and len(set(ids[1:21])) == 20


def test_hand_built_induction_head_is_found():
    model = AttentionOnlyModel(hand_built=True)
    result = induction_scores(model, length=40, sequences=3)
    assert result.scores.shape == (2, 2)
    assert result.scores[1, 0] > 0.95
    found = induction_heads(result)
    assert [(layer, head) for layer, head, _ in found] == [(1, 0)]
    # The previous-token head scores nothing on the induction stripe.
    assert result.scores[0, 0] < 0.05


def test_hand_built_heads_get_their_labels():
    model = AttentionOnlyModel(hand_built=True)
    ids = repeated_sequence(np.arange(model.vocab_size), 30, np.random.RandomState(1),
                            model.prefix_ids)
    weights = model.attention_on_ids(ids).astype(np.float32)
    size = len(ids)
    capture = Capture(tokens=[f"t{i}" for i in ids], word_ids=list(range(size)),
                      special=[False] * size, weights=weights, layers=[0, 1], heads=[0, 1],
                      num_layers=2, num_heads=2, model="hand", causal=True, text="ids")
    scores = induction_scores(model, length=30).scores
    labels = {(r["layer"], r["head"]): r["label"] for r in head_table(capture, scores)}
    assert labels[(0, 0)] == "previous-token"
    assert labels[(1, 0)] == "induction"
    assert labels[(0, 1)] != "induction" and labels[(1, 1)] != "induction"


def test_random_attention_only_model_has_no_induction_head():
    for seed in range(3):
        result = induction_scores(AttentionOnlyModel(hand_built=False, seed=seed), length=40)
        assert result.scores.max() < INDUCTION_SCORE
        assert induction_heads(result) == []


def test_random_gpt2_has_no_induction_head(tiny_gpt2_dir):
    from attnviz.models.hf import HFSource

    source = HFSource(str(tiny_gpt2_dir), device="cpu")
    result = induction_scores(source)
    assert result.scores.shape == (2, 4)
    assert result.length == 32  # fits the model's 64 positions
    assert result.scores.max() < INDUCTION_SCORE
    assert np.isfinite(result.scores).all()


def test_toy_model_has_no_induction_head():
    from attnviz.models.toy import ToyConfig, ToySource

    source = ToySource(ToyConfig(layers=2, heads=2, causal=True), device="cpu")
    result = induction_scores(source, length=20, sequences=2)
    assert result.scores.shape == (2, 2)
    assert result.scores.max() < INDUCTION_SCORE


def test_heads_cli_runs_the_induction_test_for_causal_models(invoke):
    result = invoke("heads", "The cat sat on the mat", "--model", "toy", "--causal",
                    "--toy-layers", "2", "--format", "json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["induction_test"]["length"] == 50
    assert all("induction" in row and row["label"] != "induction" for row in data["heads"])
    assert all(0.0 <= row["induction"] < INDUCTION_SCORE for row in data["heads"])

    off = json.loads(invoke("heads", "The cat sat on the mat", "--model", "toy", "--causal",
                            "--no-induction", "--format", "json").stdout)
    assert off["induction_test"] is None and "induction" not in off["heads"][0]

    encoder = json.loads(invoke("heads", "The cat sat", "--model", "toy", "--format",
                                "json").stdout)
    assert encoder["induction_test"] is None  # not causal: not run by default


def test_heads_cli_on_a_hugging_face_decoder(invoke, tiny_gpt2_dir, tmp_path):
    out = tmp_path / "induct.png"
    result = invoke("heads", "The cat sat on the mat", "--model", tiny_gpt2_dir, "--format",
                    "json", "--sort", "induction", "--plot", out, "--stat", "induction")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["causal"] is True
    scores = [row["induction"] for row in data["heads"]]
    assert scores == sorted(scores, reverse=True)
    assert out.stat().st_size > 1000
