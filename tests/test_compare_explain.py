"""``compare`` (side by side and B - A) and ``explain`` (the toy model step by step)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from PIL import Image

from attnviz.analysis.compare import difference, largest_changes, tokens_line_up
from attnviz.models.toy import ToyConfig, ToySource, word_embedding
from tests.conftest import SENTENCE


def toy_capture(**options):
    return ToySource(ToyConfig(**options), device="cpu").capture(SENTENCE)


def assert_clean(result, code: int, fragment: str) -> None:
    output = result.stdout + result.stderr
    assert result.exit_code == code, output
    assert fragment in output, output
    assert "Traceback" not in output


# --------------------------------------------------------------------------- compare: library
def test_largest_changes_equal_an_argsort():
    rng = np.random.default_rng(0)
    a, b = rng.random((5, 5)), rng.random((5, 5))
    tokens = list("abcde")
    changes = largest_changes(a, b, tokens, k=4)
    flat = np.abs(b - a).ravel()
    expected = np.argsort(-flat)[:4]
    assert [(c["query_index"], c["key_index"]) for c in changes] == [
        divmod(int(i), 5) for i in expected]
    for change in changes:
        i, j = change["query_index"], change["key_index"]
        assert change["delta"] == pytest.approx(b[i, j] - a[i, j])
        assert change["query"] == tokens[i] and change["key"] == tokens[j]
    assert np.array_equal(difference(a, b), b - a)
    with pytest.raises(ValueError):
        difference(a, b[:4])


def test_tokens_line_up():
    a, b = toy_capture(), toy_capture(causal=True)
    assert tokens_line_up(a, b)
    other = ToySource(ToyConfig(), device="cpu").capture("The dog sat on the mat")
    assert not tokens_line_up(a, other)


# --------------------------------------------------------------------------- compare: CLI
def test_compare_vs_causal(invoke, tmp_path):
    out = tmp_path / "vs.png"
    result = invoke("compare", SENTENCE, "--model", "toy", "--vs-causal", "--layer", "0",
                    "--head", "1", "--format", "json", "-o", out, "--top", "5")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["aligned"] is True and data["image"] == str(out)
    assert data["a"]["causal"] is False and data["b"]["causal"] is True
    a = toy_capture().matrix(0, 1)
    b = toy_capture(causal=True).matrix(0, 1)
    expected = largest_changes(a, b, toy_capture().display_tokens, 5)
    assert data["changes"] == expected
    # Causal B puts nothing above the diagonal, so those changes are all negative.
    for change in data["changes"]:
        if change["key_index"] > change["query_index"]:
            assert change["b"] == 0 and change["delta"] < 0
    with Image.open(out) as image:
        pixels = np.asarray(image.convert("RGB")).astype(int)
    reds = ((pixels[..., 0] > 150) & (pixels[..., 2] < 100)).sum()
    blues = ((pixels[..., 2] > 150) & (pixels[..., 0] < 100)).sum()
    assert reds > 100 and blues > 100  # the diverging difference panel is there


def test_compare_two_texts_that_differ(invoke, cli_minilm, tmp_path):
    out = tmp_path / "bank.png"
    # Same length, other words: aligned position by position, the changed tokens marked.
    result = invoke("compare", "The bank of the river", "The bank approved the loan",
                    "--layer", "2", "-o", out)
    assert result.exit_code == 0, result.output
    assert "Largest changes" in result.stdout and "of\u2192approved" in result.stdout
    assert "aligned position by position; 2 differ (of\u2192approved, river\u2192loan)" \
        in result.stderr
    # Another length: aligned word by word (difflib), the unpaired words named.
    result = invoke("compare", "The bank of the river", "The bank of the sea!", "--format",
                    "json", "-o", tmp_path / "sea.png")
    data = json.loads(result.stdout)
    assert data["aligned"] is True and data["alignment"]["method"] == "words"
    assert data["alignment"]["unmatched_b"] == ["!"] and len(data["changes"]) == 10
    # The uncased tokenizer makes these two texts the same tokens: three panels, no change.
    same = tmp_path / "same.png"
    result = invoke("compare", "The bank of the river", "THE BANK OF THE RIVER", "--format",
                    "json", "-o", same)
    data = json.loads(result.stdout)
    assert data["aligned"] is True
    assert all(abs(c["delta"]) < 1e-6 for c in data["changes"])
    with Image.open(tmp_path / "sea.png") as words, Image.open(same) as three_panels:
        assert three_panels.size[0] > 1000 and words.size[0] > 1000


def test_compare_two_models_with_words_and_special_excluded(invoke, cli_minilm, tmp_path):
    plain = invoke("compare", SENTENCE, "--model-a", "toy", "--model-b", "minilm", "-o",
                   tmp_path / "a.png")
    assert plain.exit_code == 0, plain.output
    assert "aligned by word (difflib): 6 of 6 words of A" in plain.stderr
    result = invoke("compare", SENTENCE, "--model-a", "toy", "--model-b", "minilm", "--words",
                    "--exclude-special", "--format", "json", "-o", tmp_path / "b.png")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["aligned"] is True
    assert data["a"]["model"] == "toy" and data["b"]["model"] == "minilm"
    assert data["a"]["layer"] == 0 and data["b"]["layer"] == 5  # -1 of each model
    assert len(data["changes"]) == 10


def test_compare_from_two_dumps(invoke, tmp_path):
    first, second = toy_capture(seed=0), toy_capture(seed=1)
    first.save(tmp_path / "a")
    second.save(tmp_path / "b")
    result = invoke("compare", "--from", tmp_path / "a", "--from", tmp_path / "b", "--head",
                    "0", "--layer", "0", "--format", "csv", "-o", tmp_path / "ab.png")
    assert result.exit_code == 0, result.output
    lines = result.stdout.strip().splitlines()
    assert lines[0] == "query_index,query,key_index,key,a,b,delta"
    top = lines[1].split(",")
    delta = second.matrix(0, 0) - first.matrix(0, 0)
    assert float(top[6]) == pytest.approx(float(np.abs(delta).max()) * np.sign(
        delta.ravel()[np.abs(delta).argmax()]), abs=1e-6)
    table = invoke("compare", "--from", tmp_path / "a", "--from", tmp_path / "b", "-o",
                   tmp_path / "t.png")
    assert table.exit_code == 0 and "Largest changes" in table.stdout


@pytest.mark.parametrize(("args", "fragment"), [
    ([SENTENCE], "nothing to compare"),
    ([SENTENCE, "--model", "toy"], "nothing to compare"),
    ([], "give a TEXT_A"),
    (["--from", "a"], "compare needs it twice"),
    ([SENTENCE, "--from", "a", "--from", "b"], "not both"),
    ([SENTENCE, "--vs-causal", "--model", "minilm"], "toy model"),
    ([SENTENCE, "--vs-causal", "--model", "toy", "--causal"], "drop --causal"),
    ([SENTENCE, "--vs-causal", "--model", "toy", "--head", "7"], "head 7 is out of range"),
    ([SENTENCE, "--vs-causal", "--model", "toy", "--head", "x"], "invalid head"),
    ([SENTENCE, "--vs-causal", "--model", "toy", "-o", "a.bmp"], "image format"),
])
def test_compare_errors(invoke, tmp_path, monkeypatch, args, fragment):
    monkeypatch.chdir(tmp_path)
    assert_clean(invoke("compare", *args), 2, fragment)
    assert not list(tmp_path.iterdir())


# --------------------------------------------------------------------------- explain
def independent_head(text: str, head: int, *, d_model: int = 16, heads: int = 2,
                     scale: bool = True, causal: bool = False) -> dict[str, np.ndarray]:
    """Block 0 of the toy model recomputed in numpy from its parameters and embeddings."""
    config = ToyConfig(d_model=d_model, heads=heads, scale=scale, causal=causal)
    source = ToySource(config, device="cpu")
    block = source.model.blocks[0]
    words = text.split()
    x = np.stack([word_embedding(w, d_model, 0) for w in words]).astype(np.float64)
    cols = slice(head * config.d_k, (head + 1) * config.d_k)
    q = x @ block.W_Q.detach().numpy().astype(np.float64)[:, cols]
    k = x @ block.W_K.detach().numpy().astype(np.float64)[:, cols]
    v = x @ block.W_V.detach().numpy().astype(np.float64)[:, cols]
    scores = q @ k.T
    scaled = scores / np.sqrt(config.d_k) if scale else scores
    if causal:
        scaled = np.where(np.triu(np.ones_like(scaled, dtype=bool), 1), -np.inf, scaled)
    weights = np.exp(scaled - scaled.max(axis=1, keepdims=True))
    weights /= weights.sum(axis=1, keepdims=True)
    return {"x": x, "q": q, "k": k, "v": v, "scores": scores, "weights": weights,
            "output": weights @ v, "capture": source.capture(text).matrix(0, head)}


def test_explain_json_equals_the_model(invoke):
    result = invoke("explain", SENTENCE, "--token", "cat", "--head", "1", "--format", "json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    ref = independent_head(SENTENCE, 1)
    query = data["query_index"]
    assert query == 1 and data["query"] == "cat"
    for key in ("x", "q", "k", "v"):
        assert np.allclose(data[key], ref[key], atol=1e-5), key
    assert np.allclose(data["scores"], ref["scores"][query], atol=1e-4)
    assert np.allclose(data["scaled"], ref["scores"][query] / np.sqrt(8), atol=1e-4)
    assert np.allclose(data["weights"], ref["capture"][query], atol=1e-7)  # the capture itself
    assert np.allclose(data["weights"], ref["weights"][query], atol=1e-5)
    assert data["weights_sum"] == pytest.approx(1.0, abs=1e-6)
    assert np.allclose(data["output"], ref["output"][query], atol=1e-5)


def parse_rows(text: str) -> dict[str, list[str]]:
    """Rows of rich tables as {first cell: other cells}, for lines with a │ separator."""
    rows: dict[str, list[str]] = {}
    for line in text.splitlines():
        if "\u2502" in line:
            cells = [c.strip() for c in line.split("\u2502")]
            rows.setdefault(cells[0], cells[1:])
    return rows


def test_explain_table_prints_the_capture_numbers(invoke):
    result = invoke("explain", SENTENCE, "--token", "the:2", "--digits", "6")
    assert result.exit_code == 0, result.output
    ref = independent_head(SENTENCE, 0)
    query = 4  # the second "the"
    text = result.stdout
    assert "Query token: the (position 4)" in text
    scores_section = text[text.index("3. Scores"):text.index("4. Output")]
    rows = parse_rows(scores_section)
    for j, word in enumerate(SENTENCE.split()):
        raw, scaled, weight = rows[f"{j}:{word}"]
        assert float(weight) == pytest.approx(float(ref["capture"][query, j]), abs=1e-6)
        assert float(raw) == pytest.approx(float(ref["scores"][query, j]), abs=2e-5)
        assert float(scaled) == pytest.approx(float(ref["scores"][query, j]) / np.sqrt(8),
                                              abs=2e-5)
    assert float(rows["sum"][-1]) == pytest.approx(1.0, abs=1e-6)
    output_section = text[text.index("4. Output"):]
    output = [float(v) for v in parse_rows(output_section)["output"][1:]]
    assert np.allclose(output, ref["output"][query], atol=2e-5)
    x_rows = parse_rows(text[text.index("1. X"):text.index("2. Q")])
    assert np.allclose([float(v) for v in x_rows["4:the"][:8]], ref["x"][4, :8], atol=1e-6)
    assert "Without 1/sqrt(d_k)" in text


def test_explain_no_scale_saturates(invoke):
    args = ["explain", SENTENCE, "--token", "mat", "--d-model", "64", "--format", "json"]
    scaled = json.loads(invoke(*args).stdout)
    unscaled = json.loads(invoke(*args, "--no-scale").stdout)
    assert unscaled["scale"] == 1.0 and unscaled["scaled"] == unscaled["scores"]
    ref = independent_head(SENTENCE, 0, d_model=64, scale=False)
    assert np.allclose(unscaled["weights"], ref["capture"][5], atol=1e-7)
    assert max(unscaled["weights"]) > max(scaled["weights"])
    assert np.allclose(unscaled["other_scaling_weights"], scaled["weights"], atol=1e-5)
    table = invoke(*args[:-2], "--no-scale")
    assert "scaled (= raw)" in table.stdout and "With 1/sqrt(d_k)" in table.stdout


def test_explain_causal_and_deeper_layer(invoke):
    result = invoke("explain", SENTENCE, "--token", "sat", "--causal", "--format", "json")
    data = json.loads(result.stdout)
    assert data["masked"] == [False, False, False, True, True, True]
    assert data["weights"][3:] == [0.0, 0.0, 0.0] and data["scaled"][3] is not None
    ref = independent_head(SENTENCE, 0, causal=True)
    assert np.allclose(data["weights"], ref["capture"][2], atol=1e-7)
    table = invoke("explain", SENTENCE, "--token", "sat", "--causal")
    assert "masked (-inf)" in table.stdout

    deep = json.loads(invoke("explain", SENTENCE, "-t", "cat", "--toy-layers", "3", "--layer",
                             "-1", "--head", "1", "--format", "json").stdout)
    capture = ToySource(ToyConfig(layers=3), device="cpu").capture(SENTENCE)
    assert deep["layer"] == 2
    assert np.allclose(deep["weights"], capture.matrix(2, 1)[1], atol=1e-7)


@pytest.mark.parametrize(("args", "fragment"), [
    (["--token", "dog"], "no token 'dog'"),
    (["--token", "cat", "--layer", "2"], "layer 2 is out of range"),
    (["--token", "cat", "--head", "5"], "head 5 is out of range"),
    (["--token", "cat", "--d-model", "15"], "not divisible"),
])
def test_explain_errors(invoke, args, fragment):
    assert_clean(invoke("explain", SENTENCE, *args), 2, fragment)


def test_analysis_help_is_light():
    """--help of the analysis commands must not import torch, transformers or matplotlib."""
    import subprocess
    import sys

    code = ("import sys\n"
            "from attnviz.cli import main\n"
            "for cmd in ('heads', 'rollout', 'compare', 'explain'):\n"
            "    try:\n"
            "        main([cmd, '--help'])\n"
            "    except SystemExit:\n"
            "        pass\n"
            "heavy = [m for m in ('torch', 'transformers', 'matplotlib', 'seaborn', 'PIL')\n"
            "         if m in sys.modules]\n"
            "print('HEAVY', heavy)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "HEAVY []" in done.stdout
    assert re.search(r"Usage: .*explain", done.stdout)


def test_dollar_signs_are_drawn_as_text(invoke, tmp_path):
    """A pair of $ in a title or token would start matplotlib's mathtext and can crash it."""
    text = "a $\\frac{$ b"
    result = invoke("compare", text, "--model", "toy", "--vs-causal", "-o", tmp_path / "c.png")
    assert result.exit_code == 0, result.output
    result = invoke("rollout", text, "--model", "toy", "-o", tmp_path / "r.png")
    assert result.exit_code == 0, result.output
    result = invoke("heads", text, "--model", "toy", "--plot", tmp_path / "h.png")
    assert result.exit_code == 0, result.output
