"""Attention flow against an independent linear program, and through ``attnviz rollout``."""

from __future__ import annotations

import numpy as np
import pytest

from attnviz.analysis.flow import check_flow_size, flow_weights
from attnviz.analysis.rollout import rollout_weights
from attnviz.errors import UsageError
from tests.conftest import SENTENCE


def _random_weights(layers: int, heads: int, tokens: int, seed: int,
                    causal: bool = False) -> np.ndarray:
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(layers, heads, tokens, tokens)) * 2
    if causal:
        logits = np.where(np.tril(np.ones((tokens, tokens))) > 0, logits, -np.inf)
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    return weights / weights.sum(-1, keepdims=True)


def _lp_flow(weights: np.ndarray) -> np.ndarray:
    """Maximum flow by linear programming (scipy), written from the definition."""
    from scipy.optimize import linprog

    layers, _, tokens, _ = weights.shape
    fused = weights.mean(axis=1)
    capacity = [(fused[k] + np.eye(tokens)) / (fused[k] + np.eye(tokens)).sum(-1, keepdims=True)
                for k in range(layers)]
    edges = [((k + 1, i), (k, j), capacity[k][i, j])
             for k in range(layers) for i in range(tokens) for j in range(tokens)]
    nodes = [(k, t) for k in range(layers + 1) for t in range(tokens)]
    result = np.zeros((tokens, tokens))
    for i in range(tokens):
        for j in range(tokens):
            source, sink = (layers, i), (0, j)
            rows = []
            for node in nodes:  # conservation at every node but the source and the sink
                if node in (source, sink):
                    continue
                rows.append([(1.0 if e[1] == node else 0.0) - (1.0 if e[0] == node else 0.0)
                             for e in edges])
            objective = [-(1.0 if e[0] == source else 0.0) + (1.0 if e[1] == source else 0.0)
                         for e in edges]
            solved = linprog(objective, A_eq=np.array(rows), b_eq=np.zeros(len(rows)),
                             bounds=[(0, e[2]) for e in edges], method="highs")
            assert solved.status == 0
            result[i, j] = -solved.fun
    return result / result.sum(-1, keepdims=True)


@pytest.mark.parametrize(("layers", "tokens", "causal", "seed"),
                         [(1, 4, False, 0), (2, 4, False, 1), (3, 4, True, 2), (3, 5, False, 3)])
def test_flow_equals_linear_programming(layers: int, tokens: int, causal: bool,
                                        seed: int) -> None:
    weights = _random_weights(layers, 2, tokens, seed, causal)
    got = flow_weights(weights)
    np.testing.assert_allclose(got, _lp_flow(weights), atol=1e-7)
    np.testing.assert_allclose(got.sum(-1), 1.0, atol=1e-12)
    if causal:
        assert np.all(np.triu(got, 1) == 0)


def test_one_layer_flow_is_rollout() -> None:
    """Through one layer the only path is the edge itself: flow equals rollout."""
    weights = _random_weights(1, 3, 6, 7)
    np.testing.assert_allclose(flow_weights(weights), rollout_weights(weights), atol=1e-12)
    np.testing.assert_allclose(flow_weights(weights, "max"), rollout_weights(weights, "max"),
                               atol=1e-12)


def test_flow_differs_from_rollout_over_several_layers() -> None:
    weights = _random_weights(3, 2, 5, 11)
    assert np.abs(flow_weights(weights) - rollout_weights(weights)).max() > 1e-3


def test_flow_token_bound_names_the_option() -> None:
    with pytest.raises(UsageError) as info:
        flow_weights(_random_weights(1, 1, 6, 0), max_tokens=5)
    assert "bound is 5 tokens (--max-flow-tokens)" in str(info.value)
    assert "--method rollout" in str(info.value)
    with pytest.raises(UsageError, match="1 to 64"):
        check_flow_size(3, 500)


# --------------------------------------------------------------------------- CLI
def test_rollout_cli_method_flow(invoke, cli_minilm, minilm_capture, tmp_path,
                                 monkeypatch) -> None:
    (tmp_path / "cwd").mkdir()
    out = tmp_path / "flow.png"
    result = invoke("rollout", SENTENCE, "--method", "flow", "-o", out, "--token", "cat")
    assert result.exit_code == 0, result.output
    matrix = np.load(tmp_path / "flow.npy")
    want = flow_weights(minilm_capture.weights.astype(np.float64))
    np.testing.assert_allclose(matrix, want, atol=1e-6)
    assert "Attention flow of 'cat'" in result.stdout
    # without -o the default names say flow (a rollout's are not overwritten)
    monkeypatch.chdir(tmp_path / "cwd")
    result = invoke("rollout", SENTENCE, "--method", "flow", "--token", "cat")
    assert result.exit_code == 0, result.output
    names = sorted(p.name for p in (tmp_path / "cwd").iterdir())
    assert len(names) == 3 and all("_flow" in n and "rollout" not in n for n in names), names
    # the default stays rollout
    result = invoke("rollout", SENTENCE, "-o", tmp_path / "roll.png")
    assert result.exit_code == 0, result.output
    np.testing.assert_allclose(np.load(tmp_path / "roll.npy"),
                               rollout_weights(minilm_capture.weights.astype(np.float64)),
                               atol=1e-6)


@pytest.mark.parametrize(("args", "fragment"), [
    (["--method", "flow", "--max-flow-tokens", "4"], "bound is 4 tokens (--max-flow-tokens)"),
    (["--method", "flow", "--max-flow-tokens", "65"], "--max-flow-tokens"),
    (["--method", "maxflow"], "maxflow"),
])
def test_rollout_cli_flow_errors(invoke, tmp_path, monkeypatch, args, fragment) -> None:
    monkeypatch.chdir(tmp_path)
    result = invoke("rollout", "The cat sat on the mat", "--model", "toy", *args)
    output = result.stdout + result.stderr
    assert result.exit_code == 2, output
    assert fragment in output
    assert "Traceback" not in output
    assert not list(tmp_path.iterdir())


def test_readme_flow_command_runs(invoke, cli_minilm, tmp_path, monkeypatch) -> None:
    import shlex
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    line = next(x for x in readme.splitlines() if x.startswith("attnviz rollout")
                and "--method flow" in x)
    assert "--max-flow-tokens (default 16, at most 64" in readme.replace("`", "")
    monkeypatch.chdir(tmp_path)
    result = invoke(*shlex.split(line)[1:])
    assert result.exit_code == 0, result.output
    assert "Attention flow of 'it'" in result.stdout
    matrix = np.load(next(tmp_path.glob("*.npy")))
    np.testing.assert_allclose(matrix.sum(-1), 1.0, atol=1e-5)
