"""Head statistics and labels: hand-built matrices with known answers, real captures, the CLI."""

from __future__ import annotations

import csv
import io
import json
import math

import numpy as np
import pytest
from PIL import Image

from attnviz.analysis import stats
from attnviz.analysis.stats import head_table, label_head, layer_table, stat_sums
from attnviz.analysis.tokens import exclude_special, merge_words
from attnviz.capture import Capture
from tests.conftest import SENTENCE

CONTRACT_KEYS = {"layer", "head", "label", "entropy", "entropy_nats", "distance", "max_weight",
                 "self", "previous", "next", "first", "sep", "punct"}


def make_capture(matrices: list[np.ndarray], tokens: list[str] | None = None, *,
                 causal: bool = False, special: list[bool] | None = None) -> Capture:
    """A one-layer capture holding the given ``[query, key]`` matrices as its heads."""
    weights = np.stack(matrices)[None].astype(np.float32)
    size = weights.shape[-1]
    tokens = tokens or [f"w{i}" for i in range(size)]
    special = special or [False] * size
    return Capture(tokens=tokens, word_ids=[None if s else i for i, s in enumerate(special)],
                   special=special, weights=weights, layers=[0],
                   heads=list(range(len(matrices))), num_layers=1, num_heads=len(matrices),
                   model="hand", causal=causal, text=" ".join(tokens))


def shifted(size: int, offset: int) -> np.ndarray:
    """Row i puts all weight on i + offset (clipped to the edges)."""
    matrix = np.zeros((size, size))
    for i in range(size):
        matrix[i, min(max(i + offset, 0), size - 1)] = 1.0
    return matrix


def column(size: int, j: int) -> np.ndarray:
    matrix = np.zeros((size, size))
    matrix[:, j] = 1.0
    return matrix


def causal_uniform(size: int) -> np.ndarray:
    return np.tril(np.ones((size, size))) / np.arange(1, size + 1)[:, None]


def reference_row_stats(matrix: np.ndarray, tokens: list[str], special: list[bool],
                        causal: bool) -> dict[str, float]:
    """The statistics of one head by plain loops over rows, straight from the definitions."""
    size = matrix.shape[0]
    values: dict[str, list[float]] = {k: [] for k in stats.STAT_KEYS}
    for i in range(size):
        row = [float(v) for v in matrix[i]]
        visible = i + 1 if causal else size
        if visible < 2 or sum(row) <= 1e-6:
            continue
        nats = -sum(p * math.log(p) for p in row if p > 0)
        values["entropy_nats"].append(nats)
        values["entropy"].append(nats / math.log(visible))
        values["distance"].append(sum(p * abs(i - j) for j, p in enumerate(row)))
        values["max_weight"].append(max(row))
        values["self"].append(row[i])
        values["first"].append(row[0])
        if i >= 1:
            values["previous"].append(row[i - 1])
        if i + 1 < size:
            values["next"].append(row[i + 1])
        values["sep"].append(sum(p for j, p in enumerate(row) if special[j] and j > 0))
        values["punct"].append(sum(p for j, p in enumerate(row)
                                   if not special[j] and tokens[j] in {".", ",", "!", "?", ";"}))
        values["local"].append(sum(p for j, p in enumerate(row) if abs(i - j) <= 2))
    return {k: (sum(v) / len(v) if v else 0.0) for k, v in values.items()}


# --------------------------------------------------------------------------- known answers
@pytest.mark.parametrize(("matrix", "label", "key", "expected"), [
    (np.eye(8), "self", "self", 1.0),
    (shifted(8, -1), "previous-token", "previous", 1.0),
    (shifted(8, +1), "next-token", "next", 1.0),
    (column(8, 0), "first-token/[CLS]", "first", 1.0),
    (np.full((8, 8), 1 / 8), "broad", "entropy", 1.0),
])
def test_hand_built_heads_get_their_label(matrix, label, key, expected):
    row = head_table(make_capture([matrix]))[0]
    assert row["label"] == label
    assert row[key] == pytest.approx(expected, abs=1e-6)


def test_identity_and_uniform_values():
    size = 8
    identity, uniform = head_table(make_capture([np.eye(size), np.full((size, size), 1 / size)]))
    assert identity["entropy"] == pytest.approx(0.0, abs=1e-6)
    assert identity["entropy_nats"] == pytest.approx(0.0, abs=1e-6)
    assert identity["distance"] == pytest.approx(0.0, abs=1e-6)
    assert identity["max_weight"] == pytest.approx(1.0)
    assert identity["previous"] == pytest.approx(0.0) and identity["next"] == pytest.approx(0.0)
    assert identity["first"] == pytest.approx(1 / size)  # only row 0 looks at position 0
    assert uniform["entropy_nats"] == pytest.approx(math.log(size), rel=1e-6)
    assert uniform["max_weight"] == pytest.approx(1 / size, rel=1e-6)
    # mean |i - j| of a uniform T x T matrix: (T^2 - 1) / (3T)
    assert uniform["distance"] == pytest.approx((size ** 2 - 1) / (3 * size), rel=1e-6)


def test_shifted_identity_counts_only_rows_with_a_previous_token():
    row = head_table(make_capture([shifted(6, -1)]))[0]
    assert row["previous"] == pytest.approx(1.0)  # row 0 has no previous token: not counted
    assert row["self"] == pytest.approx(1 / 6)  # row 0 attends to itself
    assert row["distance"] == pytest.approx(5 / 6)


def test_sep_and_punctuation_labels():
    tokens = ["[CLS]", "the", "cat", ".", "sat", "[SEP]"]
    special = [True, False, False, False, False, True]
    capture = make_capture([column(6, 5), column(6, 3)], tokens, special=special)
    sep_row, punct_row = head_table(capture)
    assert sep_row["label"] == "[SEP]" and sep_row["sep"] == pytest.approx(1.0)
    assert sep_row["punct"] == pytest.approx(0.0)
    assert punct_row["label"] == "punctuation" and punct_row["punct"] == pytest.approx(1.0)
    assert punct_row["sep"] == pytest.approx(0.0)


def test_local_and_mixed_labels():
    size = 12
    band = np.zeros((size, size))
    for i in range(size):
        for j in range(max(0, i - 2), min(size, i + 3)):
            band[i, j] = 1.0
    band /= band.sum(axis=1, keepdims=True)
    far = np.zeros((size, size))
    far[:, size // 2] = 0.4  # 40 % to the middle token, the rest to the last two
    far[:, -1] = 0.3
    far[:, -2] = 0.3
    local_row, mixed_row = head_table(make_capture([band, far]))
    assert local_row["label"] == "local" and local_row["local"] == pytest.approx(1.0)
    assert mixed_row["label"] == "mixed"


def test_label_rules_and_thresholds():
    base = dict.fromkeys(stats.STAT_KEYS, 0.0)
    assert label_head({**base, "first": 0.5}) == "first-token/[CLS]"
    assert label_head({**base, "first": 0.49, "entropy": 0.5}) == "mixed"
    assert label_head({**base, "entropy": 0.9}) == "broad"
    assert label_head({**base, "local": 0.7}) == "local"
    assert label_head({**base, "self": 0.6, "previous": 0.7}) == "previous-token"
    assert label_head({**base, "self": 0.9}, induction=0.3) == "induction"
    assert label_head({**base, "self": 0.9}, induction=0.29) == "self"
    assert set(stats.SHORT_LABELS) == set(stats.LABELS)


def test_causal_entropy_uses_visible_keys_and_skips_row_zero():
    size = 7
    row = head_table(make_capture([causal_uniform(size)], causal=True))[0]
    assert row["entropy"] == pytest.approx(1.0, abs=1e-6)  # uniform over what each row sees
    assert row["label"] == "broad"
    # Row 0 (forced onto itself) is skipped: mean nats over rows 1..6 of ln(i + 1).
    assert row["entropy_nats"] == pytest.approx(np.mean(np.log(np.arange(2, size + 1))),
                                                rel=1e-6)
    assert row["next"] == pytest.approx(0.0)


def test_rows_with_no_weight_are_skipped():
    tokens = ["[CLS]", "a", "b", "[SEP]"]
    special = [True, False, False, True]
    matrix = np.array([[1, 0, 0, 0], [0.5, 0.5, 0, 0], [0, 0, 0, 1.0], [0, 0.5, 0.5, 0]])
    view = exclude_special(make_capture([matrix], tokens, special=special))
    # Row "b" only looked at [SEP]: it is all zero now and must not count as a row.
    assert view.weights[0, 0, 1].sum() == 0
    row = head_table(view)[0]
    assert row["self"] == pytest.approx(1.0)  # the one remaining row ("a") attends to itself
    assert row["sep"] == 0.0


def test_degenerate_single_token_reports_zeros():
    row = head_table(make_capture([np.ones((1, 1))]))[0]
    assert all(row[k] == 0.0 for k in stats.STAT_KEYS)
    assert row["label"] == "mixed"


# --------------------------------------------------------------------------- real captures
def test_contract_on_minilm(minilm_capture):
    rows = head_table(minilm_capture)
    assert len(rows) == 6 * 12
    assert [(r["layer"], r["head"]) for r in rows] == [
        (layer, head) for layer in range(6) for head in range(12)]
    for row in rows:
        assert CONTRACT_KEYS <= set(row)
        assert isinstance(row["label"], str) and row["label"] in stats.LABELS
        for key in stats.STAT_KEYS:
            assert isinstance(row[key], float) and math.isfinite(row[key])


def test_invariants_on_minilm(minilm_capture):
    size = minilm_capture.num_tokens
    for row in head_table(minilm_capture):
        assert 0.0 <= row["entropy"] <= 1.0 + 1e-6
        assert 0.0 <= row["entropy_nats"] <= math.log(size) + 1e-6
        assert 0.0 <= row["distance"] <= size - 1
        assert 1.0 / size - 1e-6 <= row["max_weight"] <= 1.0 + 1e-6
        for key in ("self", "previous", "next", "first", "sep", "punct", "local"):
            assert -1e-6 <= row[key] <= 1.0 + 1e-6
        assert row["self"] <= row["local"] + 1e-6


def test_minilm_statistics_equal_a_loop_over_rows(minilm):
    capture = minilm.capture("Hello, world! The cat sat.", layers=[0, 3], heads=[0, 2, 5])
    tokens = capture.display_tokens
    for row in head_table(capture):
        matrix = capture.matrix(row["layer"], row["head"]).astype(np.float64)
        expected = reference_row_stats(matrix, tokens, capture.special, capture.causal)
        for key in stats.STAT_KEYS:
            assert row[key] == pytest.approx(expected[key], abs=1e-6), key


def test_minilm_has_the_previous_token_head(minilm_capture):
    # Layer 0, head 2 of all-MiniLM-L6-v2 attends to the previous token almost exclusively.
    row = next(r for r in head_table(minilm_capture) if (r["layer"], r["head"]) == (0, 2))
    assert row["label"] == "previous-token"
    assert row["previous"] > 0.9


def test_corpus_average_is_weighted_by_tokens(minilm):
    short = minilm.capture("Hi.", layers=[1])
    long = minilm.capture("The quick brown fox jumps over the lazy dog, twice.", layers=[1])
    total = stat_sums(short) + stat_sums(long)
    assert total.texts == 2 and total.tokens == short.num_tokens + long.num_tokens
    means = total.means()
    for key in ("self", "entropy"):
        a, b = stat_sums(short), stat_sums(long)
        expected = (a.sums[key] + b.sums[key]) / (a.counts[key] + b.counts[key])
        assert np.allclose(means[key], expected)
        # ... which is not the plain mean of the two texts' means
        plain = (a.means()[key] + b.means()[key]) / 2
        assert not np.allclose(means[key], plain)
    assert total.counts["self"][0, 0] == short.num_tokens + long.num_tokens


def test_layer_table_means_over_heads(minilm_capture):
    rows = head_table(minilm_capture)
    layers = layer_table(rows)
    assert [entry["layer"] for entry in layers] == list(range(6))
    for entry in layers:
        members = [r for r in rows if r["layer"] == entry["layer"]]
        assert entry["sep"] == pytest.approx(np.mean([m["sep"] for m in members]))
        assert sum(entry["labels"].values()) == 12


def test_words_view_statistics(minilm):
    capture = minilm.capture("Unbelievable snowboarders jumped.", layers=[2])
    merged = merge_words(capture)
    assert merged.num_tokens < capture.num_tokens
    rows = head_table(merged)
    for row in rows:
        matrix = merged.matrix(2, row["head"]).astype(np.float64)
        expected = reference_row_stats(matrix, merged.display_tokens, merged.special, False)
        assert row["sep"] == pytest.approx(expected["sep"], abs=1e-6)
        assert row["entropy"] == pytest.approx(expected["entropy"], abs=1e-6)


# --------------------------------------------------------------------------- CLI
def test_heads_json_equals_library(invoke, cli_minilm, minilm_capture):
    result = invoke("heads", SENTENCE, "--format", "json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["texts"] == 1 and data["tokens"] == minilm_capture.num_tokens
    assert data["induction_test"] is None
    expected = head_table(minilm_capture)
    assert len(data["heads"]) == len(expected) == 72
    for got, want in zip(data["heads"], expected):
        assert got["label"] == want["label"]
        for key in stats.STAT_KEYS:
            assert got[key] == pytest.approx(want[key], abs=1e-9)
    assert [entry["layer"] for entry in data["layers"]] == list(range(6))


def test_heads_table_csv_markdown_and_sort(invoke, cli_minilm, tmp_path):
    table = invoke("heads", SENTENCE, "--layers", "0", "--heads", "0-3")
    assert table.exit_code == 0, table.output
    assert "previous-token" in table.stdout and "Per layer" in table.stdout
    assert "\u2026" not in table.stdout  # nothing truncated, even at 80 columns

    result = invoke("heads", SENTENCE, "--format", "csv", "--sort", "entropy", "--layers", "0-1")
    assert result.exit_code == 0, result.output
    rows = list(csv.DictReader(io.StringIO(result.stdout)))
    assert len(rows) == 24
    entropies = [float(r["entropy"]) for r in rows]
    assert entropies == sorted(entropies, reverse=True)

    result = invoke("heads", SENTENCE, "--format", "csv", "--sort", "previous", "--ascending")
    values = [float(r["previous"]) for r in csv.DictReader(io.StringIO(result.stdout))]
    assert values == sorted(values)

    out = tmp_path / "heads.md"
    result = invoke("heads", SENTENCE, "--format", "markdown", "-o", out, "--layers", "5")
    assert result.exit_code == 0, result.output
    text = out.read_text()
    assert text.count("\n| 5 |") == 13  # 12 heads + the per-layer row
    assert "Per layer" in text


def test_heads_plot(invoke, cli_minilm, tmp_path):
    out = tmp_path / "sep.png"
    result = invoke("heads", SENTENCE, "--plot", out, "--stat", "sep", "--format", "csv")
    assert result.exit_code == 0, result.output
    assert str(out) in result.stderr  # the table owns standard output
    with Image.open(out) as image:
        pixels = np.asarray(image.convert("RGB"))
    assert pixels.shape[1] > 600 and pixels.std() > 10


def test_heads_corpus_text_and_jsonl(invoke, cli_minilm, minilm, tmp_path):
    texts = ["The cat sat on the mat.", "A dog barked, loudly!", "Birds fly."]
    plain = tmp_path / "corpus.txt"
    plain.write_text(texts[0] + "\n\n" + "\n".join(texts[1:]) + "\n", encoding="utf-8")
    result = invoke("heads", "--input", plain, "--format", "json", "--layers", "4")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    captures = [minilm.capture(t, layers=[4]) for t in texts]
    assert data["texts"] == 3
    assert data["tokens"] == sum(c.num_tokens for c in captures)
    assert "skipped 1 blank" in result.stderr
    # Pooled over every row of every text.
    first_column = np.concatenate([c.weights[0, 7][:, 0] for c in captures])  # every row
    expected_first = first_column.mean()
    head7 = next(r for r in data["heads"] if r["head"] == 7)
    assert head7["first"] == pytest.approx(float(expected_first), abs=1e-6)

    jsonl = tmp_path / "corpus.jsonl"
    jsonl.write_text("\n".join(json.dumps({"text": t}) for t in texts), encoding="utf-8")
    again = json.loads(invoke("heads", "--input", jsonl, "--format", "json", "--layers",
                              "4").stdout)
    assert again["heads"] == data["heads"]


@pytest.mark.parametrize(("args", "content", "code", "fragment"), [
    (["heads", "text", "--input", "{file}"], "a\n", 2, "not several"),
    (["heads", "--input", "{file}"], "{\"text\": 1}\n", 2, "line 1 has no \"text\""),
    (["heads", "--input", "{file}"], "{\"text\": \"ok\"}\n{bad\n", 2, "line 2 is not valid JSON"),
    (["heads", "--input", "{file}"], "\n  \n", 2, "holds no texts"),
    (["heads", "--input", "{missing}"], "", 2, "does not exist"),
    (["heads", "The cat", "--sort", "induction", "--model", "toy"], "", 2, "--sort induction"),
    (["heads", "The cat", "--plot", "{dir}/x.gif", "--model", "toy"], "", 2, "image format"),
    (["heads", "--input", "{file}", "--pair", "b"], "a\n", 2, "--pair cannot be used"),
])
def test_heads_errors(invoke, tmp_path, args, content, code, fragment):
    corpus = tmp_path / "input.txt"
    corpus.write_text(content, encoding="utf-8")
    filled = [a.format(file=corpus, missing=tmp_path / "nope.txt", dir=tmp_path) for a in args]
    result = invoke(*filled)
    output = result.stdout + result.stderr
    assert result.exit_code == code, output
    assert fragment in output
    assert "Traceback" not in output
    assert not list(tmp_path.glob("*.gif"))


def test_heads_from_dump_and_words(invoke, cli_minilm, minilm, tmp_path):
    capture = minilm.capture("Unbelievable snowboarders jumped.")
    capture.save(tmp_path / "cap")
    result = invoke("heads", "--from", tmp_path / "cap", "--words", "--format", "json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["words"] is True
    expected = head_table(merge_words(capture))
    assert data["tokens"] == merge_words(capture).num_tokens
    for got, want in zip(data["heads"], expected):
        assert got["punct"] == pytest.approx(want["punct"], abs=1e-6)
        assert got["label"] == want["label"]
    # --induction needs a live model
    result = invoke("heads", "--from", tmp_path / "cap", "--induction")
    assert result.exit_code == 2 and "live model" in result.stderr


def test_heads_help_documents_definitions(invoke):
    result = invoke("heads", "--help")
    assert result.exit_code == 0
    text = " ".join(result.stdout.split())
    for fragment in ("normalised", "no smoothing", "causal", "[SEP]", "0.5", "0.9", "0.7",
                     "weighted by tokens", "Clark"):
        assert fragment in text, fragment


def test_heads_loads_the_model_once_and_uses_the_cache(invoke, monkeypatch):
    import attnviz.models as models

    real = models.load_source
    loads: list[str] = []

    def counting(spec=None):
        loads.append(getattr(spec, "name", str(spec)))
        return real(spec)

    monkeypatch.setattr(models, "load_source", counting)
    args = ["heads", "The cat sat on the mat", "--model", "toy", "--format", "json"]
    first = invoke(*args)
    assert first.exit_code == 0, first.output
    assert loads == ["toy"]
    again = invoke(*args)
    assert loads == ["toy"]  # served from the capture cache: no model needed
    assert json.loads(again.stdout)["heads"] == json.loads(first.stdout)["heads"]
    # A causal model needs the model for the induction test: loaded once, not twice.
    loads.clear()
    result = invoke(*args, "--causal", "--no-cache")
    assert result.exit_code == 0, result.output
    assert loads == ["toy"]


def test_cli_choices_follow_the_library():
    from attnviz.cli import heads as cli

    assert cli._STATS == stats.STAT_KEYS
    assert [m.value for m in cli.StatName] == [*stats.STAT_KEYS, "induction"]
    assert [m.value for m in cli.SortKey] == ["layer", "label", *stats.STAT_KEYS, "induction"]
    assert set(cli._SHORT) == {*stats.STAT_KEYS, "induction"}
