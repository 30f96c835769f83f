"""``compare`` of texts of different lengths compares like with like: each paired row is
renormalised over the paired keys on both sides, and the command says so."""

from __future__ import annotations

import csv
import io
import json

import numpy as np
import pytest

from attnviz.analysis.compare import compare_captures, renormalise_rows
from attnviz.analysis.tokens import token_view

A = "The cat sat on the mat"
B = "The big fluffy cat sat quietly on the mat!"
LAYER, HEAD = 2, 3


@pytest.fixture(scope="module")
def captures(minilm):
    return minilm.capture(A), minilm.capture(B)


def _expected(cap_a, cap_b, pairs_a, pairs_b):
    """B - A recomputed by hand: word views, the paired cells, rows renormalised."""
    out = []
    for cap, pairs in ((cap_a, pairs_a), (cap_b, pairs_b)):
        words = token_view(cap, words=True)
        raw = words.matrix(LAYER, HEAD).astype(np.float64)[np.ix_(pairs, pairs)]
        out.append((raw, raw / raw.sum(axis=1, keepdims=True)))
    return out


def test_paired_rows_sum_to_one_and_changes_go_both_ways(captures):
    cap_a, cap_b = captures
    comparison = compare_captures(cap_a, cap_b, LAYER, HEAD, top=10)
    alignment = comparison.alignment
    assert alignment is not None and alignment.method == "words"
    assert alignment.unmatched_b == ["big", "fluffy", "quietly", "!"]
    assert comparison.renormalised
    (raw_a, want_a), (raw_b, want_b) = _expected(cap_a, cap_b, alignment.a, alignment.b)
    # Before: B's paired rows lose the weight given to unpaired words; A's lose none.
    assert raw_b.sum(axis=1).min() < 0.9 and np.allclose(raw_a.sum(axis=1), 1, atol=1e-5)
    np.testing.assert_allclose(comparison.paired_share_b, raw_b.sum(axis=1), atol=1e-9)
    np.testing.assert_allclose(comparison.paired_share_a, raw_a.sum(axis=1), atol=1e-9)
    # After: every paired row sums to 1 on both sides, and B - A is that difference.
    for aligned in (comparison.aligned_a, comparison.aligned_b):
        np.testing.assert_allclose(np.asarray(aligned).sum(axis=1), 1.0, atol=1e-9)
    np.testing.assert_allclose(comparison.aligned_a, want_a, atol=1e-9)
    np.testing.assert_allclose(comparison.aligned_b, want_b, atol=1e-9)
    np.testing.assert_allclose(comparison.diff, want_b - want_a, atol=1e-9)
    deltas = [float(c["delta"]) for c in comparison.changes]
    assert any(d > 0 for d in deltas) and any(d < 0 for d in deltas)
    assert abs(deltas[0]) == pytest.approx(float(np.abs(want_b - want_a).max()))
    for change in comparison.changes:
        i, j = int(change["query_index"]), int(change["key_index"])
        assert change["a"] == pytest.approx(want_a[i, j])
        assert change["b"] == pytest.approx(want_b[i, j])
        assert change["a_raw"] == pytest.approx(raw_a[i, j])
        assert change["b_raw"] == pytest.approx(raw_b[i, j])
    assert "rows renormalised over the paired words" in comparison.title
    assert "renormalised" in comparison.diff_title


def test_equal_lengths_are_left_as_they_are(captures, minilm):
    cap_a = captures[0]
    cap_b = minilm.capture("The dog sat on the mat")
    comparison = compare_captures(cap_a, cap_b, LAYER, HEAD)
    assert not comparison.renormalised and comparison.renormalised_note == ""
    assert "renormalised" not in comparison.title
    assert all("a_raw" not in change for change in comparison.changes)
    expected = cap_b.matrix(LAYER, HEAD).astype(np.float64) - cap_a.matrix(LAYER, HEAD)
    np.testing.assert_allclose(comparison.diff, expected, atol=1e-7)


def test_renormalise_rows_keeps_rows_of_zeros():
    matrix = np.array([[0.2, 0.2], [0.0, 0.0], [0.1, 0.3]])
    np.testing.assert_allclose(renormalise_rows(matrix), [[0.5, 0.5], [0, 0], [0.25, 0.75]])


def test_the_command_says_what_it_did(invoke, cli_minilm, tmp_path):
    image = tmp_path / "c.png"
    result = invoke("compare", A, B, "--layer", LAYER, "--head", HEAD, "--format", "json",
                    "-o", image)
    assert result.exit_code == 0, result.output
    notes = [line for line in result.stderr.split("\n") if line.startswith("Note: ")]
    assert len(notes) == 2, result.stderr
    assert "renormalised over the 8 paired words" in notes[1]
    assert "none of A's rows" in notes[1] and "of B's rows (mean" in notes[1]
    data = json.loads(result.stdout)
    alignment = data["alignment"]
    assert alignment["renormalised"] is True
    assert alignment["renormalised_note"] in notes[1]
    shares_b = np.array(alignment["paired_share_b"])
    assert len(shares_b) == 8 and shares_b.min() < 0.9
    assert np.allclose(alignment["paired_share_a"], 1.0, atol=1e-5)
    deltas = [change["delta"] for change in data["changes"]]
    assert max(deltas) > 0 > min(deltas)
    for change in data["changes"]:
        assert change["b"] == pytest.approx(change["b_raw"] / shares_b[change["query_index"]],
                                            abs=1e-5)
    table = invoke("compare", A, B, "--layer", LAYER, "--head", HEAD, "-o", image)
    assert "rows renormalised over the paired words" in table.stdout
    assert "A raw" in table.stdout and "B raw" in table.stdout


def test_csv_and_markdown_carry_the_raw_weights(invoke, cli_minilm, tmp_path):
    image = tmp_path / "c.png"
    result = invoke("compare", A, B, "--layer", LAYER, "--head", HEAD, "--format", "csv",
                    "-o", image)
    assert result.exit_code == 0, result.output
    rows = list(csv.DictReader(io.StringIO(result.stdout)))
    assert list(rows[0]) == ["query_index", "query", "key_index", "key", "a", "b", "delta",
                             "a_raw", "b_raw"]
    assert any(float(r["delta"]) > 0 for r in rows) and any(float(r["delta"]) < 0 for r in rows)
    assert any(float(r["b_raw"]) < float(r["b"]) for r in rows)  # B's rows were scaled up
    markdown = invoke("compare", A, B, "--layer", LAYER, "--head", HEAD, "--format",
                      "markdown", "-o", image).stdout
    assert "rows renormalised over the paired keys" in markdown.split("\n")[0]
    assert "| A raw | B raw |" in markdown
