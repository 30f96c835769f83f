"""``compare`` aligns the two sides: position by position when the lengths match (changed
tokens marked), word by word with difflib otherwise (and says what was aligned)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from attnviz.analysis.compare import ARROW, align_positions, align_words, compare_captures
from attnviz.models.toy import ToyConfig, ToySource
from attnviz.render.analysis import CHANGED_COLOUR


def toy(text: str, **options: object):
    return ToySource(ToyConfig(heads=2, **options), device="cpu").capture(text)


def test_equal_lengths_pair_position_by_position() -> None:
    alignment = align_positions(["[CLS]", "the", "cat", "sat", "[SEP]"],
                                ["[CLS]", "the", "dog", "sat", "[SEP]"])
    assert alignment.method == "positions"
    assert alignment.a == alignment.b == [0, 1, 2, 3, 4]
    assert alignment.labels[2] == f"cat{ARROW}dog" and alignment.changed == [2]
    assert alignment.marked() == ([2], [2])
    same = align_positions(["The", "cat"], ["the", "CAT"])
    assert same.method == "tokens" and not same.changed and same.labels == ["The", "cat"]
    with pytest.raises(ValueError, match="lengths differ"):
        align_positions(["a"], ["a", "b"])


def test_unequal_lengths_pair_words_with_difflib() -> None:
    a = ["[CLS]", "the", "bank", "of", "the", "river", "[SEP]"]
    b = ["[CLS]", "the", "old", "bank", "of", "the", "sea", "!", "[SEP]"]
    alignment = align_words(a, b)
    assert alignment.method == "words"
    pairs = list(zip(alignment.a, alignment.b))
    # "old" was inserted; river pairs with sea (a replaced run), "!" is left over.
    assert pairs == [(0, 0), (1, 1), (2, 3), (3, 4), (4, 5), (5, 6), (6, 8)]
    assert alignment.labels[5] == f"river{ARROW}sea" and alignment.changed == [5]
    assert alignment.unmatched_a == [] and alignment.unmatched_b == ["old", "!"]
    assert alignment.marked() == ([5], [2, 6, 7])
    note = alignment.note("word")
    assert "7 of 7 words of A" in note and "'old', '!'" in note
    replaced = align_words(["a", "x", "y"], ["a", "p", "q", "r"])  # a run replaced by another
    assert list(zip(replaced.a, replaced.b)) == [(0, 0), (1, 1), (2, 2)]
    assert replaced.changed == [1, 2] and replaced.unmatched_b == ["r"]
    assert align_words(["x", "y"], ["p", "q", "r"]).size == 0  # nothing in common
    assert align_words(["x"], []).size == 0


def test_changed_word_difference_equals_b_minus_a() -> None:
    a, b = toy("The cat sat on the mat"), toy("The dog sat on the mat")
    comparison = compare_captures(a, b, layer=0, head=1, top=5)
    assert comparison.aligned and comparison.alignment is not None
    assert comparison.alignment.method == "positions" and comparison.alignment.changed == [1]
    expected = b.matrix(0, 1).astype(np.float64) - a.matrix(0, 1)
    np.testing.assert_allclose(comparison.diff, expected, atol=1e-7)
    top = comparison.changes[0]
    flat = np.abs(expected).ravel()
    i, j = divmod(int(flat.argmax()), expected.shape[1])
    assert (top["query_index"], top["key_index"]) == (i, j)
    assert top["delta"] == pytest.approx(expected[i, j])
    assert f"cat{ARROW}dog" in {c["query"] for c in comparison.changes} | {
        c["key"] for c in comparison.changes}
    assert "1 token differs" in comparison.title


def test_different_lengths_difference_over_the_paired_words() -> None:
    a, b = toy("The cat sat on the mat"), toy("The big cat sat on the mat")
    comparison = compare_captures(a, b, layer=0, head=0)
    alignment = comparison.alignment
    assert alignment is not None and alignment.method == "words"
    assert alignment.a == [0, 1, 2, 3, 4, 5] and alignment.b == [0, 2, 3, 4, 5, 6]
    assert alignment.unmatched_b == ["big"]
    ma = a.matrix(0, 0)[np.ix_(alignment.a, alignment.a)].astype(np.float64)
    mb = b.matrix(0, 0)[np.ix_(alignment.b, alignment.b)].astype(np.float64)
    # B's rows give some weight to "big": both sides are renormalised over the paired words.
    assert comparison.renormalised and mb.sum(axis=1).max() < 0.999
    ra, rb = ma / ma.sum(axis=1, keepdims=True), mb / mb.sum(axis=1, keepdims=True)
    np.testing.assert_allclose(comparison.diff, rb - ra, atol=1e-7)
    # The toy model has no positions: with "big" taken out, B's rows are A's rows.
    np.testing.assert_allclose(comparison.diff, 0.0, atol=1e-6)
    change = comparison.changes[0]
    assert change["b_query_index"] == alignment.b[change["query_index"]]  # type: ignore[index]
    assert "aligned by word" in comparison.title and "'big'" in comparison.note


def test_nothing_shared_means_no_difference_map() -> None:
    comparison = compare_captures(toy("alpha beta"), toy("gamma delta epsilon"), layer=0,
                                  head=0)
    assert comparison.aligned is False and comparison.diff is None
    assert "share no word" in comparison.mismatch


# --------------------------------------------------------------------------- CLI
def _red_pixels(path: Path) -> int:
    red = np.array([int(CHANGED_COLOUR[i:i + 2], 16) for i in (1, 3, 5)])
    with Image.open(path) as image:
        pixels = np.asarray(image.convert("RGB")).astype(int)
    return int((np.abs(pixels - red).max(axis=2) < 40).sum())


def test_cli_changed_word_draws_the_difference_and_marks_it(invoke, tmp_path: Path) -> None:
    out = tmp_path / "cat-dog.png"
    result = invoke("compare", "The cat sat on the mat", "The dog sat on the mat", "--model",
                    "toy", "--head", "0", "-o", out)
    assert result.exit_code == 0, result.output
    assert "Largest changes" in result.stdout and f"cat{ARROW}dog" in result.stdout
    assert "aligned position by position" in result.stderr and "do not line up" not in (
        result.stdout + result.stderr)
    with Image.open(out) as image:
        pixels = np.asarray(image.convert("RGB")).astype(int)
    reds = ((pixels[..., 0] > 150) & (pixels[..., 2] < 100)).sum()
    blues = ((pixels[..., 2] > 150) & (pixels[..., 0] < 100)).sum()
    assert reds > 50 and blues > 50  # the diverging difference panel
    assert _red_pixels(out) > 30  # the changed token's labels
    same = tmp_path / "same.png"
    assert invoke("compare", "The cat sat", "The CAT sat", "--model", "toy", "-o",
                  same).exit_code == 0
    assert _red_pixels(same) < _red_pixels(out)


def test_cli_json_says_what_was_aligned(invoke, tmp_path: Path) -> None:
    result = invoke("compare", "The cat sat on the mat", "The big cat sat on the mat",
                    "--model", "toy", "--head", "1", "--format", "json", "-o",
                    tmp_path / "c.png")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["aligned"] is True
    alignment = data["alignment"]
    assert alignment["method"] == "words" and alignment["unmatched_b"] == ["big"]
    assert alignment["pairs"] == [[0, 0], [1, 2], [2, 3], [3, 4], [4, 5], [5, 6]]
    assert "aligned by word" in alignment["note"]
    assert "aligned by word (difflib)" in result.stderr
    assert len(data["changes"]) == 10


def test_cli_windows_zoom_both_sides(invoke, tmp_path: Path) -> None:
    out = tmp_path / "w.png"
    result = invoke("compare", "The cat sat on the mat", "The dog sat on the mat", "--model",
                    "toy", "--tokens", "1:4", "-o", out)
    assert result.exit_code == 0, result.output
    full = tmp_path / "full.png"
    assert invoke("compare", "The cat sat on the mat", "The dog sat on the mat", "--model",
                  "toy", "-o", full).exit_code == 0
    with Image.open(out) as zoomed, Image.open(full) as whole:
        assert zoomed.size[0] < whole.size[0]
    bad = invoke("compare", "The cat sat", "The dog sat", "--model", "toy", "--keys", "zebra",
                 "-o", tmp_path / "bad.png")
    assert bad.exit_code == 2 and "no token 'zebra'" in bad.stderr


def test_compare_figure_reads_cleanly(invoke, cli_minilm, tmp_path) -> None:
    """Bold changed tokens clear the axis name; no '-0.00' cells; the title names the mean."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from attnviz.analysis.compare import compare_captures
    from attnviz.render import analysis as figures

    a = cli_minilm.capture("The cat sat on the mat")
    b = cli_minilm.capture("The dog sat on the mat")
    comparison = compare_captures(a, b, 2, "mean")
    assert comparison.title.startswith("Compare: layer 2, mean of the heads")
    result = invoke("compare", "The cat sat on the mat", "The dog sat on the mat", "-l", "2",
                    "-o", tmp_path / "c.png")
    assert result.exit_code == 0, result.output
    from attnviz.cli.compare import _panels

    panel_a, panel_b, panel_d, _, _ = _panels(comparison, ("A", "B"), None, None, None)
    fig = figures.draw_comparison(panel_a, panel_b, titles=("A", "B"), title=comparison.title,
                                  diff=panel_d, annot=True)
    renderer = FigureCanvasAgg(fig).get_renderer()
    checked = 0
    for ax in fig.axes:
        names = [t for t in ax.texts if t.get_text().startswith("key (attended to)")]
        ticks = [t for t in ax.texts if t.get_rotation() == 90 and t.get_text()
                 and not t.get_text().startswith(("key (", "query ("))]
        if not names:
            continue
        assert ticks, ax.get_title()
        checked += 1
        bottom = min(t.get_window_extent(renderer).y0 for t in ticks)
        assert names[0].get_window_extent(renderer).y1 <= bottom - 2, ax.get_title()  # a gap
    assert checked == 3
    cells = [t.get_text() for ax in fig.axes for t in ax.texts]
    assert "-0.00" not in cells and "0.00" in cells
