"""Figures measured by their artists' boxes: heatmaps in the user's own axes stay inside them,
a short colour bar stays near its plot, and token labels are cut only without room."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.text import Text  # noqa: E402

from attnviz.capture import Capture  # noqa: E402
from attnviz.render import heatmap  # noqa: E402
from attnviz.render.layout import LABEL_IN, MAX_LABEL_IN, text_width  # noqa: E402


def _uniform(tokens: list[str], heads: int = 2) -> Capture:
    size = len(tokens)
    rng = np.random.default_rng(3)
    weights = rng.random((1, heads, size, size)).astype(np.float32)
    weights /= weights.sum(axis=-1, keepdims=True)
    return Capture.from_attentions([weights], tokens, model="test-model")


def _texts(fig: Figure) -> list[Text]:
    return [t for t in fig.findobj(Text) if t.get_text() and t.get_visible()]


# --------------------------------------------------------------------------- your own axes
@pytest.mark.parametrize("size", [(12, 5), (6.4, 4.8), (8, 3)])  # 6.4 x 4.8: plt's default
def test_two_heatmaps_in_a_1x2_figure_do_not_overlap(minilm_capture, size):
    """Narrow panels: axis names are shortened ("key"), then wrapped, within their room."""
    fig = Figure(figsize=size, dpi=80)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 2)
    owned = []
    for ax, (layer, head) in zip(axes, ((5, 3), (2, 1))):
        before = set(_texts(fig))
        minilm_capture.heatmap(layer, head, ax=ax)
        owned.append([t for t in _texts(fig) if t not in before])  # what this call drew
    renderer = fig.canvas.get_renderer()
    left = [axes[0].get_tightbbox(renderer)] + [t.get_window_extent(renderer) for t in owned[0]]
    right = [axes[1].get_tightbbox(renderer)] + [t.get_window_extent(renderer)
                                                for t in owned[1]]
    assert max(box.x1 for box in left) <= min(box.x0 for box in right)
    labels = [t for t in owned[0]
              if " ".join(t.get_text().split()).startswith("attention weight")]
    assert len(labels) == 1  # the left colour bar's label is among the left panel's artists
    for box in left + right:  # and everything is inside the figure
        assert box.x0 >= 0 and box.y0 >= 0
        assert box.x1 <= fig.bbox.x1 + 0.5 and box.y1 <= fig.bbox.y1 + 0.5


def test_a_heatmap_in_your_axes_follows_a_layout_engine(minilm_capture):
    """The colour bar is an inset of the heatmap's axes and its texts belong to it, so
    ``tight_layout`` sees them and moves them together."""
    fig = Figure(figsize=(10, 4), dpi=80)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 2)
    for ax in axes:
        minilm_capture.heatmap(5, 3, ax=ax)
    assert len(fig.axes) == 2 and all(len(ax.child_axes) == 1 for ax in axes)
    fig.tight_layout()
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    left, right = (ax.get_tightbbox(renderer) for ax in axes)
    assert left.x1 <= right.x0
    bar = axes[0].child_axes[0].get_window_extent(renderer)
    plot = axes[0].get_window_extent(renderer)
    assert bar.x0 > plot.x1 and abs(bar.height - plot.height) < 1.0


# --------------------------------------------------------------------------- short windows
@pytest.mark.parametrize("window", [{"tokens": "2:3"}, {"queries": "2:3"}, {"tokens": "1:3"}])
def test_a_short_windows_colour_bar_stays_near_the_plots_height(minilm_capture, window):
    fig, ax = minilm_capture.heatmap(5, 3, **window)
    FigureCanvasAgg(fig)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    (bar_axes,) = [a for a in fig.axes if a is not ax]
    bar = bar_axes.get_window_extent(renderer)
    plot = ax.get_window_extent(renderer)
    assert bar.height <= 2.05 * plot.height  # it was 3.5 times a one-cell window's height
    label = next(t for t in fig.texts if t.get_rotation() == 90)  # the colour bar's label
    assert " ".join(label.get_text().split()).startswith("attention weight sqrt scale")
    box = label.get_window_extent(renderer)
    assert box.height <= bar.height + 1.0  # wrapped to the bar, not reaching past it
    for text in _texts(fig):  # nothing falls off the figure
        extent = text.get_window_extent(renderer)
        assert extent.x0 >= 0 and extent.x1 <= fig.bbox.x1 + 0.5


# --------------------------------------------------------------------------- label room
def test_long_labels_are_cut_only_without_room():
    words = ["[CLS]", "representations", "internationalization", "uninterpretable", "of",
             "x" * 60, "[SEP]"]
    artists = heatmap.draw_head_artists(_uniform(words).matrix(0, 0), words, words,
                                        title="t")
    fig = artists.fig
    FigureCanvasAgg(fig)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    shown = [t.get_text() for t in artists.ax.texts if t.get_rotation() == 0
             and t.get_text() and t.get_position()[0] == 0.0]
    assert shown[:5] == words[:5]  # whole: the figure makes room for them
    assert shown[5].endswith("\u2026") and len(shown[5]) < 60  # past the bound: cut
    assert artists.layout is not None
    assert artists.layout.row_label_in == artists.layout.col_label_in == MAX_LABEL_IN
    assert LABEL_IN < text_width(shown[5], 9.0) <= MAX_LABEL_IN  # as long as the room allows
    for text in _texts(fig):
        extent = text.get_window_extent(renderer)
        assert extent.x0 >= 0 and extent.y0 >= 0


def test_short_labels_keep_the_standard_layout():
    words = ["[CLS]", "the", "cat", "sat", "[SEP]"]
    layout = heatmap.head_layout(5, row_labels=words, col_labels=words)
    assert layout.row_label_in == layout.col_label_in == LABEL_IN
    assert (layout.width, layout.height) == heatmap.head_figure_size(5)


# --------------------------------------------------------------------------- seaborn's maps
SEABORN = ("rocket", "mako", "flare", "crest", "vlag", "icefire")


@pytest.mark.parametrize("name", [*SEABORN, "rocket_r", "icefire_r"])
def test_seaborn_colour_maps_by_name_are_seaborns_colours(name):
    import seaborn

    from attnviz.render.colours import SEABORN_CMAPS, check_cmap, colour_table

    assert set(SEABORN_CMAPS) == set(SEABORN)
    assert check_cmap(name) == name
    table = colour_table(name)
    reference = seaborn.color_palette(name, as_cmap=True)
    index = np.arange(reference.N)
    np.testing.assert_array_equal(table.rgb, reference(index, bytes=True)[:, :3])
    # ... which are seaborn's own lookup tables (256 colours), reversed for "_r".
    lut = np.asarray(getattr(seaborn.cm, f"_{name.removesuffix('_r')}_lut"))
    lut = lut[::-1] if name.endswith("_r") else lut
    np.testing.assert_allclose(table.rgb / 255.0, lut, atol=1 / 255 + 1e-9)


def test_seaborn_is_imported_only_for_its_colour_maps():
    import subprocess
    import sys

    code = ("import sys\nfrom attnviz.render.colours import colour_table\n"
            "colour_table('viridis'); print('seaborn' in sys.modules)\n"
            "colour_table('mako'); print('seaborn' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=True)
    assert done.stdout.split() == ["False", "True"]


def test_cmap_by_seaborn_name_in_heatmap_export_compare_and_python(invoke, tmp_path):
    from PIL import Image

    def colours(path):
        with Image.open(path) as image:
            return {tuple(c) for c in np.asarray(image.convert("RGB")).reshape(-1, 3)}

    capture = _uniform(["[CLS]", "the", "cat", "sat", "[SEP]"])
    capture.save(tmp_path / "cap")
    result = invoke("heatmap", "--from", tmp_path / "cap", "-l", "0", "--head", "0",
                    "--cmap", "mako", "-o", tmp_path / "h.png")
    assert result.exit_code == 0, result.output
    import seaborn  # after the command: it must not rely on the test importing seaborn

    top = tuple(int(v) for v in seaborn.color_palette("mako", as_cmap=True)(255, bytes=True)[:3])
    viridis_top = tuple(int(v) for v in matplotlib.colormaps["viridis"](255, bytes=True)[:3])
    drawn = colours(tmp_path / "h.png")
    assert top in drawn and viridis_top not in drawn  # the largest weight, and the bar's top
    exported = invoke("export", "--from", tmp_path / "cap", "--cmap", "mako", "--jobs", "1",
                      "--figures", "heads", "-o", tmp_path / "out")
    assert exported.exit_code == 0, exported.output
    head = next((tmp_path / "out").rglob("L00_H00.png"))
    assert top in colours(head)
    compared = invoke("compare", "--from", tmp_path / "cap", "--from", tmp_path / "cap",
                      "--cmap", "mako", "-l", "0", "--head", "0", "-o", tmp_path / "c.png")
    assert compared.exit_code == 0, compared.output
    assert top in colours(tmp_path / "c.png")
    fig, _ = capture.heatmap(0, 0, cmap="mako")
    buffer = tmp_path / "py.png"
    fig.savefig(buffer)
    assert top in colours(buffer)
    wrong = invoke("heatmap", "--from", tmp_path / "cap", "-l", "0", "--head", "0",
                   "--cmap", "mak")
    assert wrong.exit_code == 2 and "mako" in wrong.stderr
