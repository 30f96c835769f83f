"""Attention rollout against a direct implementation of Abnar and Zuidema's formula."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from attnviz.analysis.rollout import fuse_heads, rollout, rollout_weights
from attnviz.capture import Capture
from attnviz.errors import UsageError
from tests.conftest import SENTENCE


def random_stochastic(rng: np.random.Generator, layers: int, heads: int, size: int,
                      causal: bool = False) -> np.ndarray:
    weights = rng.random((layers, heads, size, size)) ** 3  # peaky rows
    if causal:
        weights = weights * np.tril(np.ones((size, size)))
    return weights / weights.sum(axis=-1, keepdims=True)


def direct_rollout(weights: np.ndarray, fusion: str) -> np.ndarray:
    """Straight from the paper, one layer at a time, with plain loops for the renormalisation."""
    size = weights.shape[-1]
    result = None
    for layer in range(weights.shape[0]):
        heads = weights[layer]
        fused = {"mean": np.mean, "max": np.max, "min": np.min}[fusion](heads, axis=0)
        mixed = 0.5 * fused + 0.5 * np.eye(size)
        for i in range(size):
            mixed[i] = mixed[i] / mixed[i].sum()
        result = mixed if result is None else mixed @ result
    assert result is not None
    return result


def as_capture(weights: np.ndarray, causal: bool = False) -> Capture:
    layers, heads, size, _ = weights.shape
    return Capture(tokens=[f"t{i}" for i in range(size)], word_ids=list(range(size)),
                   special=[False] * size, weights=weights.astype(np.float32),
                   layers=list(range(layers)), heads=list(range(heads)), num_layers=layers,
                   num_heads=heads, model="random", causal=causal, text="random")


@pytest.mark.parametrize("fusion", ["mean", "max", "min"])
@pytest.mark.parametrize("causal", [False, True])
def test_rollout_matches_direct_formula(fusion, causal):
    rng = np.random.default_rng(7)
    for layers, heads, size in ((1, 1, 3), (3, 4, 6), (6, 12, 10)):
        weights = random_stochastic(rng, layers, heads, size, causal)
        got = rollout_weights(weights, fusion)
        want = direct_rollout(weights, fusion)
        assert np.allclose(got, want, atol=1e-12)
        assert np.allclose(got.sum(axis=1), 1.0, atol=1e-12)
        assert (got >= 0).all()
        if causal:
            assert np.allclose(np.triu(got, 1), 0.0)


def test_single_layer_rollout_is_half_attention_half_identity():
    rng = np.random.default_rng(0)
    weights = random_stochastic(rng, 1, 2, 5)
    expected = 0.5 * weights[0].mean(axis=0) + 0.5 * np.eye(5)
    assert np.allclose(rollout_weights(weights, "mean"), expected)


def test_fuse_heads_and_bad_fusion():
    weights = np.arange(2 * 3 * 2 * 2, dtype=float).reshape(2, 3, 2, 2)
    assert np.array_equal(fuse_heads(weights, "max"), weights.max(axis=1))
    assert np.array_equal(fuse_heads(weights, "min"), weights.min(axis=1))
    with pytest.raises(UsageError):
        fuse_heads(weights, "median")


def test_capture_rollout_and_start_layer():
    rng = np.random.default_rng(3)
    weights = random_stochastic(rng, 4, 3, 5)
    capture = as_capture(weights)
    assert np.allclose(rollout(capture), direct_rollout(weights.astype(np.float32), "mean"),
                       atol=1e-6)
    assert np.allclose(rollout(capture, "max", start_layer=2),
                       direct_rollout(weights[2:].astype(np.float32), "max"), atol=1e-6)
    assert np.allclose(rollout(capture, start_layer=-1),
                       direct_rollout(weights[3:].astype(np.float32), "mean"), atol=1e-6)


def test_rollout_needs_consecutive_layers():
    rng = np.random.default_rng(4)
    capture = as_capture(random_stochastic(rng, 4, 2, 4)).select(layers=[0, 1, 3])
    with pytest.raises(UsageError, match="lacks 2"):
        rollout(capture)
    assert rollout(capture, start_layer=3).shape == (4, 4)  # from 3 up is complete
    with pytest.raises(UsageError, match="out of range"):
        rollout(capture, start_layer=9)


def test_minilm_rollout_rows_sum_to_one(minilm_capture):
    matrix = rollout(minilm_capture)
    assert matrix.shape == (minilm_capture.num_tokens,) * 2
    assert np.allclose(matrix.sum(axis=1), 1.0, atol=1e-6)
    assert np.allclose(matrix, direct_rollout(minilm_capture.weights.astype(np.float64), "mean"))


# --------------------------------------------------------------------------- CLI
def test_rollout_cli_writes_heatmap_matrix_and_bars(invoke, cli_minilm, minilm_capture, tmp_path):
    out = tmp_path / "roll.png"
    result = invoke("rollout", SENTENCE, "-o", out, "--token", "cat", "--head-fusion", "max")
    assert result.exit_code == 0, result.output
    npy, bar = tmp_path / "roll.npy", tmp_path / "roll_bar_cat.png"
    lines = result.stdout.splitlines()
    assert lines[:3] == [str(out), str(npy), str(bar)]
    matrix = np.load(npy)
    assert matrix.dtype == np.float32
    assert np.allclose(matrix, direct_rollout(minilm_capture.weights.astype(np.float64), "max"),
                       atol=1e-6)
    assert np.allclose(matrix.sum(axis=1), 1.0, atol=1e-5)
    for path in (out, bar):
        with Image.open(path) as image:
            assert np.asarray(image.convert("RGB")).std() > 10
    assert "'cat' (position 2)" in lines[3]  # the summary follows the paths on stdout
    assert "favours early tokens" not in result.stderr


def test_rollout_cli_options_from_dump(invoke, minilm_capture, tmp_path):
    minilm_capture.save(tmp_path / "cap")
    result = invoke("rollout", "--from", tmp_path / "cap", "-o", tmp_path / "r.svg",
                    "--npy", tmp_path / "m.npy", "--bar", tmp_path / "b.pdf", "--start-layer",
                    "3", "--token", "-1")
    assert result.exit_code == 0, result.output
    matrix = np.load(tmp_path / "m.npy")
    want = direct_rollout(minilm_capture.weights[3:].astype(np.float64), "mean")
    assert np.allclose(matrix, want, atol=1e-6)
    assert (tmp_path / "r.svg").read_text().lstrip().startswith("<?xml")
    assert (tmp_path / "b.pdf").read_bytes()[:4] == b"%PDF"


def test_rollout_cli_causal_warning(invoke, tmp_path):
    result = invoke("rollout", "The cat sat on the mat", "--model", "toy", "--causal",
                    "--toy-layers", "3", "-o", tmp_path / "c.png")
    assert result.exit_code == 0, result.output
    assert "favours early tokens" in result.stderr
    matrix = np.load(tmp_path / "c.npy")
    assert np.allclose(np.triu(matrix, 1), 0.0)
    assert "'mat' (position 5)" in result.stdout  # default token of a causal model: the last
    assert (tmp_path / "c_bar_mat.png").is_file()


@pytest.mark.parametrize(("args", "fragment"), [
    (["--token", "dog"], "no token 'dog'"),
    (["--token", "99"], "out of range"),
    (["--token", "the:3"], "occurs 2 times"),
    (["--head-fusion", "median"], "median"),
    (["-o", "x.gif"], "image format"),
    (["--npy", "m.txt"], "must end in .npy"),
    (["--start-layer", "5"], "out of range"),
])
def test_rollout_cli_errors(invoke, tmp_path, monkeypatch, args, fragment):
    monkeypatch.chdir(tmp_path)
    result = invoke("rollout", "The cat sat on the mat", "--model", "toy", *args)
    output = result.stdout + result.stderr
    assert result.exit_code == 2, output
    assert fragment in output
    assert "Traceback" not in output
    assert not list(tmp_path.iterdir())  # no partial files
