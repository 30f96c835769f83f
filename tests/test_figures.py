"""Figures that stay readable at real lengths: windows, colour scales, sizes from content,
titles that fit, sentence-pair dividers, marked subword pieces, and the export's speed knobs.

Every check reads real pixels, sizes or texts of the drawn figure.
"""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import matplotlib
import numpy as np
import pytest
from PIL import Image

matplotlib.use("Agg")

from attnviz.analysis.tokens import (  # noqa: E402
    CONTINUATION_MARK,
    figure_view,
    pair_start,
    parse_window,
    piece_labels,
)
from attnviz.capture import Capture, load_capture  # noqa: E402
from attnviz.errors import UsageError  # noqa: E402
from attnviz.render import analysis, fast, heatmap  # noqa: E402


# --------------------------------------------------------------------------- helpers
def make_capture(tokens: list[str], *, layers: int = 1, heads: int = 2, seed: int = 0,
                 word_ids: list[int | None] | None = None, special: list[bool] | None = None,
                 pair: str | None = None, model: str = "synthetic",
                 weights: np.ndarray | None = None) -> Capture:
    """A capture with random row-stochastic weights ``[layer, head, query, key]``."""
    n = len(tokens)
    if weights is None:
        rng = np.random.default_rng(seed)
        raw = rng.random((layers, heads, n, n)) ** 4
        weights = (raw / raw.sum(axis=-1, keepdims=True)).astype(np.float32)
    special = special if special is not None else [t.startswith("[") for t in tokens]
    if word_ids is None:
        word_ids = []
        word = -1
        for token, is_special in zip(tokens, special):
            if is_special:
                word_ids.append(None)
                continue
            word += 0 if token.startswith("##") else 1
            word_ids.append(word)
    return Capture(tokens=tokens, word_ids=word_ids, special=special, weights=weights,
                   layers=list(range(weights.shape[0])), heads=list(range(weights.shape[1])),
                   num_layers=weights.shape[0], num_heads=weights.shape[1], model=model,
                   causal=False, text=" ".join(tokens), pair=pair)


def pixels(fig: matplotlib.figure.Figure, dpi: float | None = None) -> np.ndarray:
    """The figure as saved to PNG, ``[height, width, 3]`` int."""
    data = heatmap.figure_bytes(fig, "png", dpi)
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB")).astype(int)


def cell_pixel(fig: matplotlib.figure.Figure, ax: matplotlib.axes.Axes, row: int,
               col: int) -> tuple[int, int]:
    """Pixel ``(y, x)`` at the centre of cell ``[row, col]`` of a heatmap axes."""
    x, y = ax.transData.transform((col, row))
    height = fig.bbox.height
    return int(round(height - y - 0.5)), int(round(x - 0.5))


def renderer_of(fig: matplotlib.figure.Figure) -> object:
    """An Agg renderer of the figure (figures made with ``Figure()`` have no canvas yet)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    return FigureCanvasAgg(fig).get_renderer()


def colour(name: str, unit: float) -> np.ndarray:
    return np.asarray(matplotlib.colormaps[name](unit, bytes=True)[:3], dtype=int)


# --------------------------------------------------------------------------- colour scale
def test_cells_take_the_colour_of_their_share_of_vmax(tmp_path: Path) -> None:
    weights = np.zeros((1, 1, 4, 4), np.float32)
    weights[0, 0] = [[0.4, 0.3, 0.2, 0.1]] * 4
    weights[0, 0, 3] = [0.1, 0.1, 0.4, 0.4]
    capture = make_capture(["a", "b", "c", "d"], weights=weights)
    # Linear, top = the largest weight shown (0.4): 0.4 is the top colour, 0.2 the middle.
    fig, ax = capture.heatmap(0, 0, scale="linear", vmax="auto", annot=False)
    image = pixels(fig)
    assert np.array_equal(image[cell_pixel(fig, ax, 0, 0)], colour("viridis", 1.0))
    assert np.abs(image[cell_pixel(fig, ax, 0, 2)] - colour("viridis", 0.5)).max() <= 1
    # --vmax 1 keeps the fixed 0..1 scale: 0.4 is the colour of 0.4.
    fig, ax = capture.heatmap(0, 0, scale="linear", vmax=1, annot=False)
    image = pixels(fig)
    assert np.abs(image[cell_pixel(fig, ax, 0, 0)] - colour("viridis", 0.4)).max() <= 1
    # Power 0.5 (the default): a quarter of the top gets half the colour range.
    fig, ax = capture.heatmap(0, 0, annot=False)
    image = pixels(fig)
    quarter = image[cell_pixel(fig, ax, 0, 3)]  # 0.1 = 0.4 / 4
    assert np.abs(quarter - colour("viridis", 0.5)).max() <= 1
    # Log: three decades below the top; 0.04 (a decade down) is two thirds up.
    fig, ax = capture.heatmap(0, 0, scale="log", annot=False, cmap="magma")
    image = pixels(fig)
    assert np.array_equal(image[cell_pixel(fig, ax, 0, 0)], colour("magma", 1.0))


def test_colour_bar_states_the_maximum() -> None:
    weights = np.full((1, 1, 3, 3), 1 / 3, np.float32)
    weights[0, 0, 0] = [0.43, 0.37, 0.2]
    capture = make_capture(["x", "y", "z"], weights=weights)
    fig, _ = capture.heatmap(0, 0)
    texts = [t.get_text() for t in fig.texts]
    assert "0.43" in texts  # the top tick is the largest weight shown
    assert any("top = max shown" in t for t in texts)
    fig, _ = capture.heatmap(0, 0, vmax=1)
    texts = [t.get_text() for t in fig.texts]
    assert "1.00" in texts and any("top = 1.00 (fixed)" in t for t in texts)


@pytest.mark.parametrize(("scale", "gamma", "vmax", "fragment"), [
    ("cubic", 0.5, "auto", "unknown colour scale"),
    ("power", 0.0, "auto", "--gamma 0 is out of range"),
    ("power", 0.5, "-1", "--vmax -1 is out of range"),
    ("power", 0.5, "lots", "is not a number"),
])
def test_bad_scales_say_what_to_use(scale: str, gamma: float, vmax: str, fragment: str) -> None:
    with pytest.raises(UsageError, match=fragment):
        heatmap.ColourScale.of(scale, gamma, vmax)


def test_fast_renderer_paints_the_same_scale() -> None:
    rng = np.random.default_rng(4)
    labels = [f"t{i}" for i in range(40)]
    matrix = rng.random((40, 40)).astype(np.float32) ** 3 * 0.3
    for scale in (heatmap.ColourScale("power", 0.5, None), heatmap.ColourScale("log"),
                  heatmap.ColourScale("linear", 1.0, 1.0)):
        template = fast.head_template(labels, labels, titles=["t"], scale=scale)
        ours = template.compose([matrix], "t")
        box = template.boxes[0]
        resolved = scale.resolve(matrix)
        expected = fast.colour_table("viridis").rgb[
            fast.colour_table("viridis").unit_bins(resolved.unit(matrix))]
        assert np.array_equal(ours[box.cell_rows[:, None], box.cell_cols[None, :]], expected)
        reference = pixels(heatmap.draw_head(matrix, labels, labels, title="t", scale=scale))
        difference = np.abs(ours.astype(int) - reference).max(axis=2)
        assert difference.mean() < 1.0  # the colour bar's labels follow the top as well


# --------------------------------------------------------------------------- sizes
@pytest.mark.parametrize("count", [8, 40, 128, 305])
def test_labels_are_legible_and_thinned_past_the_bound(count: int) -> None:
    capture = make_capture([f"w{i}" for i in range(count)], heads=1)
    artists = heatmap.capture_head_figure(capture, 0, 0)
    fig, ax = artists.fig, artists.ax
    renderer = renderer_of(fig)
    layout = artists.layout
    assert layout is not None
    labels = [t for t in ax.texts if t.get_text().startswith("w")]
    assert all(t.get_fontsize() >= 8 for t in labels)
    rows = sorted((t for t in labels if t.get_rotation() == 0),
                  key=lambda t: -t.get_window_extent(renderer).y0)
    assert len(rows) == math.ceil(count / layout.row_step)
    boxes = [t.get_window_extent(renderer) for t in rows]
    assert all(upper.y0 >= lower.y1 - 0.5 for upper, lower in zip(boxes, boxes[1:]))  # apart
    axis_labels = " ".join(t.get_text() for t in ax.texts)
    if layout.row_step > 1:
        assert count * heatmap.CELL_LABEL_IN > heatmap.MAX_PLOT_IN
        assert f"every {heatmap._ordinal(layout.row_step)} token labelled" in axis_labels
    else:
        assert "labelled" not in axis_labels
    width, height = fig.get_size_inches()
    assert width <= heatmap.MAX_PLOT_IN + 4 and height <= heatmap.MAX_PLOT_IN + 4


def test_cell_values_only_where_they_are_legible() -> None:
    small = make_capture([f"w{i}" for i in range(30)], heads=1)
    artists = heatmap.capture_head_figure(small, 0, 0)
    assert len(artists.cells) == 30 * 30
    assert all(t.get_fontsize() >= 8 for t in artists.cells)
    cell = artists.ax.get_window_extent().width / 30 / artists.fig.dpi * 72  # points
    assert cell >= 3 * 8 * 0.6  # "0.00" at 8 pt fits its cell
    assert not heatmap.capture_head_figure(make_capture([f"w{i}" for i in range(31)], heads=1),
                                           0, 0).cells
    big = make_capture([f"w{i}" for i in range(128)], heads=1)
    forced = heatmap.capture_head_figure(big, 0, 0, options=heatmap.FigureOptions(annot=True))
    assert not forced.cells and forced.layout is not None
    assert "cell values left out" in forced.layout.dropped_values


def test_cli_warns_when_asked_values_do_not_fit(invoke, tmp_path: Path) -> None:
    make_capture([f"w{i}" for i in range(100)], heads=1).save(tmp_path / "cap")
    result = invoke("heatmap", "--from", tmp_path / "cap", "--layer", "0", "--head", "0",
                    "--annot", "-o", tmp_path / "h.png")
    assert result.exit_code == 0, result.output
    assert "cell values left out" in result.stderr


def test_grids_give_each_head_a_pixel_per_token(tmp_path: Path) -> None:
    capture = make_capture([f"w{i}" for i in range(305)], layers=2, heads=3)
    artists = heatmap.draw_grid_artists(np.asarray(capture.weights),
                                        ["layer 0", "layer 1"], ["h0", "h1", "h2"],
                                        title="overview")
    for image in artists.images:
        box = image.get_window_extent()
        assert box.width >= 305 - 1e-6 and box.height >= 305 - 1e-6
    assert "downsampled" not in artists.title.get_text()
    path = heatmap.save_figure(artists.fig, tmp_path / "o.png")
    with Image.open(path) as saved:
        assert saved.size == (round(artists.fig.bbox.width), round(artists.fig.bbox.height))
    # At 20 dpi 305 tokens cannot get a pixel each within the size bound: the title says so.
    low = heatmap.draw_grid_artists(np.asarray(capture.weights), ["layer 0", "layer 1"],
                                    ["h0", "h1", "h2"], title="overview", dpi=20)
    assert "downsampled: 305 tokens in" in low.title.get_text()
    head = heatmap.capture_head_figure(make_capture([f"w{i}" for i in range(500)], heads=1), 0,
                                       0, options=heatmap.FigureOptions(dpi=20))
    assert any("downsampled: 500 tokens in" in t.get_text() for t in head.ax.texts)


def test_one_layer_grid_panels_for_many_tokens(invoke, tmp_path: Path) -> None:
    make_capture([f"w{i}" for i in range(300)], layers=1, heads=12).save(tmp_path / "cap")
    result = invoke("heatmap", "--from", tmp_path / "cap", "--layer", "0", "-o",
                    tmp_path / "g.png")
    assert result.exit_code == 0, result.output
    with Image.open(tmp_path / "g.png") as image:
        width, height = image.size
    assert width >= 4 * 300 and height >= 3 * 300  # 12 heads wrap into 4 x 3 panels


LONG_MODEL = ("/home/someone/models/a-fine-tuned-bert-base-multilingual-cased-checkpoint-12000"
              "-with-a-very-long-folder-name")


def _title_boxes_inside(fig: matplotlib.figure.Figure) -> None:
    renderer = renderer_of(fig)
    fig.draw(renderer)  # type: ignore[arg-type]
    width, height = fig.bbox.width, fig.bbox.height
    titles = [t for t in fig.texts if t.get_text()] + [
        ax.title for ax in fig.axes if ax.title.get_text()]
    assert titles
    for title in titles:
        box = title.get_window_extent(renderer)
        assert box.x0 >= 0 and box.x1 <= width, (title.get_text(), box, width)
        assert box.y0 >= 0 and box.y1 <= height, (title.get_text(), box, height)


def test_long_titles_fit_inside_every_figure() -> None:
    tokens = ["[CLS]", *[f"w{i}" for i in range(6)], "[SEP]"]
    capture = make_capture(tokens, layers=2, heads=3, model=LONG_MODEL, pair="w3 w4 w5")
    options = heatmap.FigureOptions(exclude_special=True, words=True, tokens="1:5")
    _title_boxes_inside(heatmap.capture_head_figure(capture, 1, "mean", options=options).fig)
    _title_boxes_inside(heatmap.capture_grid_figure(capture, 1, options=options))
    _title_boxes_inside(heatmap.capture_grid_figure(capture, None, options=options))
    matrix = np.asarray(capture.weights[0, 0])
    long = f"{LONG_MODEL}: attention rollout from layer 0 (mean of heads, 0.5 A + 0.5 I)"
    _title_boxes_inside(analysis.draw_matrix(matrix, tokens, tokens, title=long))
    _title_boxes_inside(analysis.draw_token_bars(matrix[0], tokens, title=long))
    _title_boxes_inside(analysis.draw_stat_grid(np.ones((2, 3)), [["x"] * 3] * 2, [0, 1],
                                                [0, 1, 2], stat="entropy", title=long))
    panel = analysis.Panel(matrix, tokens, tokens, f"A: {LONG_MODEL}: The cat sat on the mat")
    _title_boxes_inside(analysis.draw_comparison(panel, panel, title=long, diff=matrix * 0))
    # The README's clipped sample: a mean head with special tokens excluded.
    mean = "minilm: layer 2, mean of all heads (special tokens excluded, rows renormalised)"
    _title_boxes_inside(heatmap.draw_head(matrix[:6, :6], tokens[:6], tokens[:6], title=mean))


def test_long_titles_fit_in_fast_frames_too() -> None:
    labels = [f"t{i}" for i in range(6)]
    titles = [f"{LONG_MODEL}: layer {i}, head {i} (special tokens excluded, rows renormalised)"
              for i in range(3)]
    template = fast.head_template(labels, labels, titles=titles)
    matrix = np.full((6, 6), 1 / 6, np.float32)
    ours = template.compose([matrix], titles[2]).astype(int)
    reference = pixels(heatmap.draw_head(matrix, labels, labels, title=titles[2]))
    assert ours.shape == reference.shape
    assert np.abs(ours - reference).max(axis=2).mean() < 1.0


# --------------------------------------------------------------------------- windows
@pytest.mark.parametrize(("spec", "expected"), [
    ("2:5", (2, 5)), ("-3:", (7, 10)), (":4", (0, 4)), ("7", (7, 8)), ("bank:loan", (3, 8)),
    ("BANK", (3, 4)), ("bank:-1", (3, 9)), ("", (0, 10)), ("·ing", (5, 6)), ("ing:loan", (5, 8)),
])
def test_windows(spec: str, expected: tuple[int, int]) -> None:
    tokens = ["[CLS]", "the", "river", "bank", "fish", "·ing", "the", "loan", "!", "[SEP]"]
    window = parse_window(spec, tokens)
    assert (window.start, window.stop) == expected and window.total == 10


@pytest.mark.parametrize(("spec", "fragment"), [
    ("4:2", "is empty"), ("0:11", "out of range"), ("-11:", "out of range"),
    ("zebra", "no token 'zebra'"), ("1:2:3", "more than one ':'"), ("loan:bank", "no token"),
])
def test_bad_windows_name_the_fix(spec: str, fragment: str) -> None:
    tokens = ["[CLS]", "the", "river", "bank", "fish", "·ing", "the", "loan", "!", "[SEP]"]
    with pytest.raises(UsageError, match=fragment):
        parse_window(spec, tokens)


def test_out_of_range_window_names_the_valid_positions() -> None:
    with pytest.raises(UsageError) as error:
        parse_window("5:9", ["the", "cat", "sat", "on", "it"])
    message = error.value.message
    assert "the input has 5 tokens (positions 0..4, or -5..-1 from the end" in message
    assert "5 means through the last token" in message
    assert parse_window("2:5", ["the", "cat", "sat", "on", "it"]).stop == 5


@pytest.mark.parametrize(("spec", "expected"), [
    ("0:40", (0, 10)), ("-40:", (0, 10)), ("-40:3", (0, 3)), ("8:99", (8, 10)), ("2:5", (2, 5)),
])
def test_clipped_windows_cut_at_the_ends(spec: str, expected: tuple[int, int]) -> None:
    tokens = [f"w{i}" for i in range(10)]
    window = parse_window(spec, tokens, clip=True)
    assert (window.start, window.stop) == expected


@pytest.mark.parametrize(("spec", "fragment"), [
    ("40:60", "is empty"), ("12", "out of range"), ("zebra:", "no token 'zebra'"),
])
def test_clipped_windows_still_refuse_what_shows_nothing(spec: str, fragment: str) -> None:
    with pytest.raises(UsageError, match=fragment):
        parse_window(spec, [f"w{i}" for i in range(10)], clip=True)


def test_export_cuts_one_window_at_each_texts_end(invoke, tmp_path: Path) -> None:
    """--tokens 0:20 over texts of 8 and 30 tokens: the short one whole, the long one cut."""
    inputs = tmp_path / "texts.txt"
    inputs.write_text("a b c d e f\n" + " ".join(f"w{i}" for i in range(28)) + "\n")
    out = tmp_path / "out"
    result = invoke("export", "--input", inputs, "--model", "toy", "--toy-layers", "1",
                    "--toy-heads", "1", "--tokens", "0:20", "--figures", "heads", "--jobs", "1",
                    "-o", out)
    assert result.exit_code == 0, result.output
    sizes = {}
    for manifest in out.glob("*/export.json"):
        data = json.loads(manifest.read_text(encoding="utf-8"))
        with Image.open(manifest.parent / "heads" / "L00_H00.png") as image:
            sizes[data["num_tokens"]] = image.size
    assert sorted(sizes) == [6, 28]
    for shown, tokens in ((6, 6), (20, 28)):
        width, height = heatmap.head_figure_size(shown)
        assert sizes[tokens] == (round(width * 100), round(height * 100))
    # A window that is empty for a text fails that text (exit 1), the others are drawn.
    result = invoke("export", "--input", inputs, "--model", "toy", "--toy-layers", "1",
                    "--toy-heads", "1", "--tokens", "10:20", "--figures", "heads", "--jobs",
                    "1", "-o", tmp_path / "second")
    assert result.exit_code == 1 and "--tokens 10:20 is empty" in result.output
    index = json.loads((tmp_path / "second" / "index.json").read_text(encoding="utf-8"))
    assert sorted(e["status"] for e in index["texts"]) == ["exported", "failed"]


def test_a_window_draws_its_true_labels_and_says_so() -> None:
    tokens = [f"w{i}" for i in range(50)]
    capture = make_capture(tokens, heads=1, seed=3)
    artists = heatmap.capture_head_figure(
        capture, 0, 0, options=heatmap.FigureOptions(queries="10:13", keys="w20:w29",
                                                     scale="linear", vmax="1", annot=False))
    labels = [t.get_text() for t in artists.ax.texts if t.get_text().startswith("w")]
    assert [t for t in labels if t in tokens[10:13]] == tokens[10:13]
    assert set(labels) == set(tokens[10:13]) | set(tokens[20:30])
    assert "queries 10:13, keys 20:30 of 50" in artists.title.get_text()
    image = pixels(artists.fig)
    matrix = capture.matrix(0, 0)
    for row, col in ((0, 0), (2, 9), (1, 4)):
        expected = colour("viridis", float(matrix[10 + row, 20 + col]))
        assert np.abs(image[cell_pixel(artists.fig, artists.ax, row, col)] - expected).max() <= 1


def test_windows_in_cli_heatmap_and_export(invoke, tmp_path: Path) -> None:
    tokens = [f"w{i}" for i in range(60)]
    make_capture(tokens, layers=2, heads=2).save(tmp_path / "cap")
    result = invoke("heatmap", "--from", tmp_path / "cap", "--layer", "1", "--head", "0",
                    "--tokens", "-12:", "-o", tmp_path / "w.png")
    assert result.exit_code == 0, result.output
    width, height = heatmap.head_figure_size(12)
    with Image.open(tmp_path / "w.png") as image:
        assert image.size == (round(width * 100), round(height * 100))
    result = invoke("heatmap", "--from", tmp_path / "cap", "--layer", "1", "--tokens", "w70",
                    "-o", tmp_path / "x.png")
    assert result.exit_code == 2 and "no token 'w70'" in result.stderr
    assert not (tmp_path / "x.png").exists()
    out = tmp_path / "export"
    result = invoke("export", "--from", tmp_path / "cap", "--tokens", "5:17", "--vmax", "1",
                    "--jobs", "1", "-o", out)
    assert result.exit_code == 0, result.output
    folder = next(p for p in out.iterdir() if p.is_dir())
    manifest = json.loads((folder / "export.json").read_text(encoding="utf-8"))
    assert manifest["settings"]["tokens"] == "5:17" and manifest["settings"]["vmax"] == 1.0
    with Image.open(folder / "heads" / "L01_H00.png") as image:
        assert image.size == (round(width * 100), round(height * 100))
    # A window that fits no text fails that text, with its message, and writes nothing.
    result = invoke("export", "--from", tmp_path / "cap", "--tokens", "zebra:", "--jobs", "1",
                    "-o", tmp_path / "bad")
    assert result.exit_code == 1 and "no token 'zebra'" in result.output


# --------------------------------------------------------------------------- pairs and pieces
PAIR_TOKENS = ["[CLS]", "the", "bank", "[SEP]", "a", "loan", "[SEP]"]


def test_pair_divider_between_the_segments(tmp_path: Path) -> None:
    capture = make_capture(PAIR_TOKENS, heads=1, pair="a loan")
    assert pair_start(capture) == 4
    artists = heatmap.capture_head_figure(capture, 0, 0, options=heatmap.FigureOptions(
        annot=False))
    assert "sentence pair" in artists.title.get_text()
    image = pixels(artists.fig)
    fig, ax = artists.fig, artists.ax
    top, left = cell_pixel(fig, ax, 0, 0)
    bottom, right = cell_pixel(fig, ax, 6, 6)
    x = int(round(ax.transData.transform((3.5, 0))[0]))  # between keys 3 and 4
    column = image[top:bottom, x - 1:x + 1]
    assert (column == 255).all(axis=2).any(axis=1).all()  # white all the way down
    assert not (image[top:bottom, left] == 255).all()  # the cells themselves are not white
    # Views carry the boundary: without [CLS]/[SEP] the second segment starts at 2.
    view = figure_view(capture, exclude_special=True)
    assert view.row_divider == 2 and view.col_divider == 2
    # The fast renderer draws the same white divider.
    template = fast.head_template(piece_labels(capture), piece_labels(capture), titles=["t"],
                                  annot=False, row_divider=4, col_divider=4)
    ours = template.compose([capture.matrix(0, 0)], "t").astype(int)
    reference = pixels(heatmap.draw_head(capture.matrix(0, 0), PAIR_TOKENS, PAIR_TOKENS,
                                         title="t", annot=False, row_divider=4, col_divider=4))
    assert np.abs(ours - reference).max(axis=2).mean() < 1.0
    assert (ours[top:bottom, x - 1:x + 1] == 255).all(axis=2).any(axis=1).all()


PIECES = ["[CLS]", "the", "un", "##bel", "##ie", "##va", "##bly", "lamp", "[SEP]"]


def test_continuation_pieces_are_marked_unless_words() -> None:
    capture = make_capture(PIECES, heads=1)
    assert piece_labels(capture) == ["[CLS]", "the", "un", "·bel", "·ie", "·va", "·bly", "lamp",
                                     "[SEP]"]
    assert CONTINUATION_MARK == "\u00b7"
    view = figure_view(capture, words=True)
    assert view.row_labels == ["[CLS]", "the", "unbelievably", "lamp", "[SEP]"]
    drawn = heatmap.capture_head_figure(capture, 0, 0)
    assert {"·bel", "·bly"} <= {t.get_text() for t in drawn.ax.texts}


def test_topk_tables_mark_pieces(invoke, tmp_path: Path) -> None:
    make_capture(PIECES, heads=1).save(tmp_path / "cap")
    result = invoke("top-k", "--from", tmp_path / "cap", "-l", "0", "--head", "0", "-f",
                    "markdown", "-k", "9")
    assert result.exit_code == 0, result.output
    assert "| 3 | ·bel |" in result.stdout and "·va (" in result.stdout
    merged = invoke("top-k", "--from", tmp_path / "cap", "-l", "0", "--head", "0", "-f",
                    "markdown", "--words")
    assert "unbelievably" in merged.stdout and "·" not in merged.stdout
    out = tmp_path / "export"
    assert invoke("export", "--from", tmp_path / "cap", "--figures", "overview", "--jobs", "1",
                  "-o", out).exit_code == 0
    folder = next(p for p in out.iterdir() if p.is_dir())
    topk = (folder / "topk.csv").read_text(encoding="utf-8")
    assert ",·bel," in topk


# --------------------------------------------------------------------------- the Python API
def test_capture_heatmap_is_what_the_cli_draws(invoke, tmp_path: Path) -> None:
    capture = make_capture(PAIR_TOKENS, heads=2, pair="a loan")
    capture.save(tmp_path / "cap")
    result = invoke("heatmap", "--from", tmp_path / "cap", "--layer", "0", "--head", "1",
                    "--scale", "log", "--tokens", "1:6", "-o", tmp_path / "cli.png")
    assert result.exit_code == 0, result.output
    fig, ax = load_capture(tmp_path / "cap").heatmap(0, 1, scale="log", tokens="1:6")
    ours = heatmap.save_figure(fig, tmp_path / "api.png")
    assert ours.read_bytes() == (tmp_path / "cli.png").read_bytes()
    assert ax in fig.axes
    # Into an axes of your own figure.
    own = matplotlib.figure.Figure(figsize=(6, 5))
    axes = own.add_subplot()
    fig2, ax2 = capture.heatmap(0, 1, ax=axes)
    assert fig2 is own and ax2 is axes and len(axes.images) == 1
    assert axes.images[0].get_array().shape == (7, 7, 3)
    with pytest.raises(UsageError, match="unknown figure option 'colour'"):
        capture.heatmap(0, 1, colour="red")


# --------------------------------------------------------------------------- export speed
def test_png_writer_reuses_runs_byte_for_byte() -> None:
    rng = np.random.default_rng(9)
    base = rng.integers(0, 256, size=(200, 90, 3), dtype=np.uint8)
    base[40:120] = base[40]  # repeated rows
    other = base.copy()
    other[60:70, 10:20] = 7  # a change in the middle: the rows around it stay the same
    writer = fast.PngWriter(200, 90)
    first, second = writer.encode(base), writer.encode(other)
    assert second == fast.PngWriter(200, 90).encode(other)  # reuse gives the same bytes
    assert first == fast.PngWriter(200, 90).encode(base)
    decoded = np.asarray(Image.open(io.BytesIO(second)))
    assert np.array_equal(decoded, other)


def test_jobs_default_follows_the_size_of_the_input() -> None:
    from attnviz.export import SMALL_JOB_TEXTS, ExportItem, jobs_for

    texts = [ExportItem(text=f"text {i}") for i in range(10)]
    assert jobs_for(texts[:1], 16) == 1
    assert jobs_for(texts[:SMALL_JOB_TEXTS - 1], 16) == 1
    assert jobs_for([*texts[:2], ExportItem(blank=True), ExportItem(error="bad")], 16) == 1
    assert jobs_for(texts[:8], 2) == 2
    assert jobs_for(texts[:8], 16) == 4  # at least two texts per worker


@pytest.mark.parametrize(("tokens", "x_label", "y_label"), [
    (["Hi"], "key", "query"),
    (["Hi", "there"], "key (attended to)", "query (attending)"),
    ([f"w{i}" for i in range(12)], "key (attended to)", "query (attending)"),
])
def test_axis_labels_stay_clear_of_the_colour_bar(tokens: list[str], x_label: str,
                                                  y_label: str) -> None:
    """A one-token figure: the long axis names would run into the colour bar, so they shorten."""
    artists = heatmap.capture_head_figure(make_capture(tokens, heads=1), 0, 0)
    fig, ax = artists.fig, artists.ax
    renderer = renderer_of(fig)
    texts = {t.get_text(): t for t in ax.texts}
    assert x_label in texts and y_label in texts
    label_box = texts[x_label].get_window_extent(renderer)
    bar_box = next(a for a in fig.axes if a is not ax).get_window_extent(renderer)
    assert label_box.x1 < bar_box.x0
    y_box = texts[y_label].get_window_extent(renderer)
    assert 0 <= y_box.y0 and y_box.y1 <= artists.title.get_window_extent(renderer).y0
