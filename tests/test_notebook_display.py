"""What a notebook receives from a view and a capture, and what a view accepts from the browser.

No browser and no kernel here: the widget's messages are handed to it as ipywidgets hands the
front end's ``update`` messages over (``Widget._handle_msg``), and the outputs are taken from
``_ipython_display_`` as IPython calls it. ``tests/test_notebook_frontends.py`` shows the same
outputs in JupyterLab and Notebook 7.
"""

from __future__ import annotations

import html
import re
from typing import Any

import numpy as np
import pytest
import traitlets

import attnviz
from attnviz.capture import Capture
from attnviz.errors import UsageError
from attnviz.notebook import FRAME_MAX_PX, AttentionView, frame_height, static_html
from attnviz.render.html import read_report_data

WIDGET_MIME = "application/vnd.jupyter.widget-view+json"


@pytest.fixture(scope="module")
def capture() -> Capture:
    rng = np.random.default_rng(1)
    tokens = ["[CLS]", "the", "cat", "sat", "on", "the", "mat", ".", "[SEP]"]
    weights = rng.dirichlet(np.full(len(tokens), 0.3), size=(3, 4, len(tokens)))
    return Capture.from_attentions(weights.astype(np.float32), tokens, model="toy",
                                   text="the cat sat on the mat.")


def _from_browser(view: AttentionView, state: dict[str, Any]) -> None:
    """An ``update`` message as the widget's front end sends it (``model.save_changes()``)."""
    view._handle_msg({"content": {"data": {"method": "update", "state": state,
                                           "buffer_paths": []}},
                      "buffers": []})


def _srcdoc_data(fragment: str) -> dict[str, Any]:
    match = re.search(r'srcdoc="([^"]*)"', fragment)
    assert match is not None
    return read_report_data(html.unescape(match.group(1)))


def test_the_browser_may_set_the_selection_only(capture: Capture,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    view = attnviz.show(capture, view="heatmap", layer=1, head=2)
    report = view._report
    esm = view._esm
    sent: list[list[str]] = []
    original = view.send_state
    monkeypatch.setattr(view, "send_state",
                        lambda key=None: (sent.append(list(key or [])), original(key))[1])
    # The data and the code flow from Python only: such messages change nothing at all.
    for state in ({"_report": {}}, {"_esm": "export default {}"}, {"_report": {}, "layer": 0},
                  {"_view_key": "x"}):
        _from_browser(view, state)
        assert view._report is report and view._esm == esm
        assert (view.layer, view.heads, view._view_key != "x") == (1, [2], True)
    # A selection that does not check is refused, and the browser is told what Python holds.
    _from_browser(view, {"layer": 7})
    _from_browser(view, {"heads": [0], "scale": "cubic"})
    assert (view.layer, view.heads, view.scale) == (1, [2], "power")
    assert sent[-2:] == [["layer"], ["heads", "scale"]]
    # The selection itself is taken, checked and normalised.
    _from_browser(view, {"layer": -1, "heads": [3, 0, 3], "view": "model", "words": True,
                         "special": False, "scale": "log", "gamma": 2, "vmax": 1})
    assert (view.layer, view.heads, view.view, view.words, view.special) == (
        2, [0, 3], "model", True, False)
    assert (view.scale, view.gamma, view.vmax) == ("log", 2.0, 1.0)
    # The static copy and the display keep working, and show that selection.
    initial = _srcdoc_data(view.static_html(image=False))["initial"]
    assert {key: initial[key] for key in ("view", "layer", "heads", "scale", "vmax")} == {
        "view": "model", "layer": 2, "heads": [0, 3], "scale": "log", "vmax": 1.0}
    data, _ = view._repr_mimebundle_()
    assert WIDGET_MIME in data and "<iframe" in data["text/html"]


def test_colour_scale_from_python(capture: Capture) -> None:
    view = attnviz.show(capture, view="heatmap", scale="linear", vmax=1)
    assert (view.scale, view.gamma, view.vmax) == ("linear", 0.5, 1.0)
    assert view._report["initial"]["scale"] == "linear"
    default = attnviz.show(capture)
    assert (default.scale, default.gamma, default.vmax) == ("power", 0.5, "auto")
    view.vmax = "0.25"
    view.gamma = 3
    assert (view.vmax, view.gamma) == (0.25, 3.0)
    for name, value in (("scale", "cubic"), ("gamma", 9), ("vmax", 0), ("vmax", "lots")):
        with pytest.raises(traitlets.TraitError):
            setattr(view, name, value)
    with pytest.raises(UsageError, match=r"gamma only applies to scale='power', not "
                                         r"scale='log'"):
        attnviz.show(capture, scale="log", gamma=0.3)
    with pytest.raises(UsageError, match=r"gamma=9 is out of range"):
        attnviz.show(capture, gamma=9)
    with pytest.raises(UsageError, match=r"vmax='lots' is not a number"):
        static_html(capture, vmax="lots")
    with pytest.raises(UsageError, match="unknown colour scale 'cubic'"):
        capture.show(scale="cubic")


def _displayed(view: AttentionView, monkeypatch: pytest.MonkeyPatch,
               in_kernel: bool) -> list[dict[str, Any]]:
    import IPython.display

    shown: list[dict[str, Any]] = []
    monkeypatch.setattr("attnviz.notebook._in_kernel", lambda: in_kernel)
    monkeypatch.setattr(IPython.display, "display",
                        lambda data, **kwargs: shown.append(dict(data)))
    view._ipython_display_()
    return shown


def test_a_view_is_the_widget_and_its_static_copy(capture: Capture,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    view = attnviz.show(capture, view="model")
    widget, copy = _displayed(view, monkeypatch, in_kernel=True)
    assert set(widget) == {WIDGET_MIME, "text/plain"}
    assert widget["text/plain"] == repr(view) == (
        "AttentionView(model view of toy: 9 tokens, layer 0, 4 heads)")
    key = view._view_key
    assert re.fullmatch(r"[0-9a-f]{32}", key) and attnviz.show(capture)._view_key != key
    page = copy["text/html"]
    assert page.startswith(f'<div class="attnviz-static" style="display: grid;" '
                           f'data-attnviz-static="{key}">')
    assert "\n" not in copy["text/plain"]
    # The style sheet names this view only: the live widget hides its copy, a missing one
    # (no kernel) its placeholder.
    style = page[page.index("<style>"):]
    assert style.count(key) == 5 and 'data-attnviz-live="' + key in style
    assert f'height: {frame_height(capture, "model")}px' in page
    assert "data:image/png;base64," in page and "Trust Notebook" in page
    assert _srcdoc_data(page)["fit"] is True
    # Outside a kernel (Colab, a terminal): one output, the widget with the copy inside.
    (single,) = _displayed(view, monkeypatch, in_kernel=False)
    assert set(single) == {WIDGET_MIME, "text/plain", "text/html"}
    assert "<style>" not in single["text/html"] and "data-attnviz-static" not in single[
        "text/html"]


def test_the_static_image_shows_the_selection(capture: Capture) -> None:
    import base64
    import io

    from PIL import Image

    page = static_html(capture, view="heatmap", layer=2, heads=[1, 3], scale="log")
    match = re.search(r'src="data:image/png;base64,([^"]+)"', page)
    assert match is not None
    image = Image.open(io.BytesIO(base64.b64decode(match.group(1))))
    assert 300 <= image.width <= 880 and image.height > 200
    assert "layer 2, mean of 2 heads" in page
    pixels = np.asarray(image.convert("RGB"), dtype=np.float32)
    assert pixels.std() > 20  # a drawn heatmap, not a blank figure
    assert "layer 0, head 1" in static_html(capture, view="head", head=1)
    assert "every layer and head" in static_html(capture, view="model")
    assert "<img" not in static_html(capture, image=False)


def test_frames_are_sized_per_view(capture: Capture) -> None:
    heights = {view: frame_height(capture, view) for view in ("head", "model", "heatmap")}
    assert heights["model"] < heights["heatmap"]  # 3 rows of thumbnails; 9 rows of 36 px
    long = Capture.from_attentions(np.full((1, 1, 300, 300), 1 / 300, dtype=np.float32),
                                   [f"t{i}" for i in range(300)], model="toy")
    assert frame_height(long, "head") == FRAME_MAX_PX  # past it, the head view scrolls
    for view, height in heights.items():
        assert f"height: {height}px" in static_html(capture, view=view, image=False)


def test_text_reprs_are_one_line(capture: Capture) -> None:
    from IPython.core.formatters import PlainTextFormatter

    text = PlainTextFormatter()(capture)
    assert text == repr(capture) == (
        "Capture('toy': 9 tokens, 3 layers x 4 heads, text='the cat sat on the mat.')")
    big = Capture.from_attentions(np.full((6, 12, 400, 400), 1 / 400, dtype=np.float32),
                                  [f"t{i}" for i in range(400)], model="minilm",
                                  text="word " * 400)
    line = PlainTextFormatter()(big)
    assert "\n" not in line and len(line) < 120 and "6 layers x 12 heads" in line
    assert "400 tokens" in line and "\u2026" in line
    view = attnviz.show(capture, view="heatmap", heads=[0, 2])
    assert PlainTextFormatter()(view) == (
        "AttentionView(heatmap view of toy: 9 tokens, layer 0, 2 heads)")


def test_two_outputs_only_where_the_copy_can_hide(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    import types

    import IPython

    from attnviz.notebook import _in_kernel

    class ZMQInteractiveShell:  # the name ipykernel's shell has
        def __init__(self) -> None:
            self.user_ns: dict[str, Any] = {}

    class TerminalInteractiveShell(ZMQInteractiveShell):
        pass

    shell = ZMQInteractiveShell()
    monkeypatch.setattr(IPython, "get_ipython", lambda: shell)
    assert _in_kernel()  # JupyterLab, Notebook 7, nbclient
    shell.user_ns["__vsc_ipynb_file__"] = "/work/views.ipynb"  # VS Code sets it
    assert not _in_kernel()
    del shell.user_ns["__vsc_ipynb_file__"]
    monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
    assert not _in_kernel()
    monkeypatch.delitem(sys.modules, "google.colab")
    monkeypatch.setattr(IPython, "get_ipython", lambda: TerminalInteractiveShell())
    assert not _in_kernel()
    monkeypatch.setattr(IPython, "get_ipython", lambda: None)
    assert not _in_kernel()


@pytest.mark.parametrize("height", [0, 99, 10_001, 2.5, True, "500"])
def test_frame_height_is_bounded(capture: Capture, height: Any) -> None:
    with pytest.raises(UsageError, match="height must be a whole number of pixels from 100 to "
                                         "10000"):
        static_html(capture, height=height, image=False)
    with pytest.raises(UsageError, match="height must be"):
        attnviz.show(capture).static_html(height=height, image=False)
    assert 'height: 640px' in static_html(capture, height=640, image=False)
