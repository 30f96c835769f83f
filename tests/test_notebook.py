"""Inline views: a real notebook run by a real kernel, its saved outputs, and both front ends.

The notebook is executed with nbformat + nbclient + ipykernel, offline, by a kernel that runs
this test's own Python (a kernel spec named ``python3`` written to a temporary folder). Each view
is saved as two outputs: the widget (``application/vnd.jupyter.widget-view+json`` with its state
in the notebook's metadata) and its static copy (``text/html``), which is then opened in headless
Chromium with every request outside the page blocked. ``test_notebook_frontends.py`` opens the
same kind of notebook in JupyterLab and Notebook 7. The widget's own ES module is driven in
the browser too, with a stand-in for the anywidget model.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import traitlets

import attnviz
from attnviz.capture import Capture, load_capture
from attnviz.errors import UsageError
from attnviz.notebook import MAX_REPR_WEIGHTS, preview_page, static_html
from attnviz.render.html import read_report_data
from tests._browser import hover_until, wait_until, watch

pytestmark = pytest.mark.slow

WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
STATE_MIME = "application/vnd.jupyter.widget-state+json"
GPT2_TEXT = "the cat sat on the mat and looked at the dog"
MINILM_TEXT = "The cat sat on the mat because it was warm."
STEP_8BIT = 1 / 255  # the views carry 8-bit weights: error at most half a step, plus display

CELLS = [
    # 0: a model the user already holds, loaded with the default (sdpa) attention.
    """import json, attnviz
from transformers import AutoModel, AutoTokenizer
model = AutoModel.from_pretrained({gpt2!r})
tokenizer = AutoTokenizer.from_pretrained({gpt2!r})
cap_gpt2 = attnviz.capture(model, tokenizer, {gpt2_text!r})
cap_gpt2.save({out!r} + "/gpt2")
print(model.config._attn_implementation)""",
    # 1: the bundled MiniLM through the warm default session.
    """cap_minilm = attnviz.capture_text({minilm_text!r})
cap_minilm.save({out!r} + "/minilm")""",
    # 2, 3: two views in two cells.
    """first = attnviz.show(cap_gpt2, view="heatmap", layer=1, head=2)
first""",
    """second = cap_minilm.show("head", layer=5)
second""",
    # 4: change the head from Python, and show the view again.
    """second.head = 7
second.layer = 3
print(json.dumps({{"first": [first.layer, first.heads], "second": [second.layer, second.head]}}))
second""",
]


@pytest.fixture(scope="module")
def kernel_specs(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Kernel specs holding one named python3 that runs this interpreter (the venv's python)."""
    from jupyter_client.kernelspec import KernelSpecManager

    folder = tmp_path_factory.mktemp("kernels")
    spec = folder / "python3"
    spec.mkdir()
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (attnviz tests)", "language": "python"}))
    return KernelSpecManager(kernel_dirs=[str(folder)])


@pytest.fixture(scope="module")
def executed(tmp_path_factory: pytest.TempPathFactory, tiny_gpt2_dir: Path,
             kernel_specs: Any) -> tuple[Any, Path]:
    """The notebook, executed and saved to disk, read back; and the folder of its captures."""
    import nbformat
    from jupyter_client.manager import KernelManager
    from nbclient import NotebookClient

    out = tmp_path_factory.mktemp("notebook")
    values = {"gpt2": str(tiny_gpt2_dir), "gpt2_text": GPT2_TEXT, "minilm_text": MINILM_TEXT,
              "out": str(out)}
    notebook = nbformat.v4.new_notebook()
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                       "language": "python"}
    notebook.cells = [nbformat.v4.new_code_cell(cell.format(**values)) for cell in CELLS]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", MPLBACKEND="Agg",
               ATTNVIZ_CACHE_DIR=str(out / "cache"), PYDEVD_DISABLE_FILE_VALIDATION="1")
    manager = KernelManager(kernel_name="python3", kernel_spec_manager=kernel_specs)
    client = NotebookClient(notebook, km=manager, timeout=300, store_widget_state=True,
                            resources={"metadata": {"path": str(out)}})
    client.execute(env=env)
    path = out / "views.ipynb"
    nbformat.write(notebook, path)
    return nbformat.read(path, as_version=4), out


def _display(cell: Any) -> dict[str, Any]:
    """A view's two outputs in one dict: the widget (its view and text) and its static copy."""
    outputs = [dict(o.data) for o in cell.outputs
               if o.output_type in ("execute_result", "display_data")]
    assert len(outputs) == 2
    widget, copy = outputs
    assert set(widget) == {WIDGET_MIME, "text/plain"} and set(copy) == {"text/html", "text/plain"}
    assert widget["text/plain"].startswith("AttentionView(") and "\n" not in widget["text/plain"]
    return {WIDGET_MIME: widget[WIDGET_MIME], "text/html": copy["text/html"]}


def _stream(cell: Any) -> str:
    return "".join(o.text for o in cell.outputs if o.output_type == "stream")


def test_saved_notebook_holds_the_widgets_and_the_fallback(executed) -> None:
    notebook, out = executed
    cells = notebook.cells
    assert all(o.output_type != "error" for cell in cells for o in cell.outputs)
    assert _stream(cells[0]).split() == ["sdpa"]  # the model was given back as it came
    assert json.loads(_stream(cells[4])) == {"first": [1, [2]], "second": [3, 7]}
    state = notebook.metadata["widgets"][STATE_MIME]["state"]
    cap_gpt2, cap_minilm = load_capture(out / "gpt2"), load_capture(out / "minilm")
    expected = {2: (cap_gpt2, "heatmap", 1, [2]), 3: (cap_minilm, "head", 3, [7]),
                4: (cap_minilm, "head", 3, [7])}
    ids = {}
    for index, (capture, view, layer, heads) in expected.items():
        data = _display(cells[index])
        ids[index] = data[WIDGET_MIME]["model_id"]
        widget = state[ids[index]]
        assert widget["model_name"] == "AnyModel"
        synced = widget["state"]
        # The state saved last: the second view's head was changed from Python.
        assert (synced["view"], synced["layer"], synced["heads"]) == (view, layer, heads)
        assert "attnvizMount" in synced["_esm"] and "export default" in synced["_esm"]
        doc = synced["_report"]["docs"][0]
        assert doc["tokens"] == capture.tokens and doc["text"] == capture.text
        assert data["text/html"].startswith('<div class="attnviz-static"')
        assert f'data-attnviz-static="{synced["_view_key"]}"' in data["text/html"]
        assert "srcdoc=" in data["text/html"] and "data:image/png;base64," in data["text/html"]
    assert ids[3] == ids[4] != ids[2]  # two views, two models; the second shown twice
    assert cap_gpt2.causal and cap_gpt2.meta["model_attn_implementation"] == "sdpa"


def _srcdoc(fragment: str) -> str:
    import html as html_module
    import re

    match = re.search(r'srcdoc="([^"]*)"', fragment)
    assert match is not None
    return html_module.unescape(match.group(1))


class Page:
    """A page open in a fresh context; every request but file: and data: is blocked, recorded."""

    def __init__(self, browser: Any, width: int = 1100, height: int = 900) -> None:
        self.context = browser.new_context(viewport={"width": width, "height": height})
        self.outside: list[str] = []
        self.errors: list[str] = []
        self.page = self.context.new_page()
        watch(self.context, self.page, ("file:", "data:"), self.outside, self.errors,
              requests=True)

    def assert_clean(self) -> None:
        assert self.outside == [], "the view reached for the network"
        assert self.errors == []




def _report_frame(opened: Page, path: Path) -> Any:
    opened.page.goto(path.as_uri())
    frames = [f for f in opened.page.frames if f != opened.page.main_frame]
    assert len(frames) == 1
    frame = frames[0]
    wait_until(frame, "document.documentElement.dataset.ready === '1'")
    return frame


def _tooltip_weights(frame: Any) -> list[tuple[int, float]]:
    rows = frame.eval_on_selector_all(
        "#tooltip tr.entry", "rows => rows.map(r => [Number(r.dataset.index), "
                             "r.querySelector('.w').textContent])")
    return [(int(i), float(w)) for i, w in rows]


def test_fallback_paints_offline_and_shows_the_capture(executed, browser,
                                                       tmp_path: Path) -> None:
    from PIL import Image

    notebook, out = executed
    cap_gpt2, cap_minilm = load_capture(out / "gpt2"), load_capture(out / "minilm")
    tolerance = STEP_8BIT / 2 + 0.5e-3 + 1e-6
    opened = Page(browser)
    try:
        # The GPT-2 heatmap of layer 1, head 2: each hovered cell shows the capture's weight.
        page_path = tmp_path / "first.html"
        fallback = _display(notebook.cells[2])["text/html"]
        page_path.write_text(f"<!DOCTYPE html><html><body>{fallback}</body></html>")
        frame = _report_frame(opened, page_path)
        data = read_report_data(_srcdoc(fallback))
        assert data["docs"][0]["tokens"] == cap_gpt2.tokens
        assert "layer 1, head 2" in frame.get_attribute("#hm-canvas", "aria-label")
        assert frame.is_visible("#view-heatmap") and not frame.is_visible("#view-head")
        canvas = frame.locator("#hm-canvas")
        matrix = cap_gpt2.matrix(1, 2)
        for row, col in [(0, 0), (3, 1), (cap_gpt2.num_tokens - 1, 4)]:

            def cell_centre(row: int = row, col: int = col) -> tuple[float, float]:
                # The frame is shorter than the heatmap: scroll the row into its viewport. The
                # layout is read on every try: the host may resize the frame, which redraws.
                x0, y0, cell = frame.eval_on_selector(
                    "#hm-canvas", "c => [Number(c.dataset.x0), Number(c.dataset.y0), "
                                  "Number(c.dataset.cell)]")
                frame.evaluate("y => window.scrollTo(0, document.getElementById('hm-canvas')"
                               ".offsetTop + y - 100)", y0 + row * cell)
                box = canvas.bounding_box()
                return (box["x"] + x0 + (col + 0.5) * cell, box["y"] + y0 + (row + 0.5) * cell)

            hover_until(opened.page, cell_centre, lambda row=row, col=col: frame.evaluate(
                f"document.getElementById('tooltip').dataset.query === '{row}' && "
                f"document.getElementById('tooltip').dataset.key === '{col}'"),
                what=f"the tooltip of query {row}, key {col}")
            ((index, weight),) = _tooltip_weights(frame)
            assert index == col and abs(weight - matrix[row, col]) <= tolerance
        shot = tmp_path / "first.png"
        canvas.screenshot(path=str(shot))
        pixels = np.asarray(Image.open(shot).convert("RGB"), dtype=np.float32)
        assert pixels.shape[0] > 100 and pixels.std() > 10  # painted, not blank

        # The MiniLM head view after the head was changed from Python: layer 3, head 7.
        page_path = tmp_path / "second.html"
        fallback = _display(notebook.cells[4])["text/html"]
        page_path.write_text(f"<!DOCTYPE html><html><body>{fallback}</body></html>")
        frame = _report_frame(opened, page_path)
        labels = frame.eval_on_selector_all("#hv-left .tok", "ts => ts.map(t => t.textContent)")
        assert labels == cap_minilm.display_tokens
        assert frame.input_value("#layer") == "3"
        pressed = frame.eval_on_selector_all(
            "#heads .chip[aria-pressed='true']", "cs => cs.map(c => c.textContent)")
        assert pressed == ["7"]
        query = 4
        frame.hover(f"#hv-left .tok[data-i='{query}']")
        rows = _tooltip_weights(frame)
        strongest = np.sort(cap_minilm.matrix(3, 7)[query])[::-1]
        assert len(rows) == 5
        for (index, weight), best in zip(rows, strongest):
            assert abs(weight - cap_minilm.matrix(3, 7)[query, index]) <= tolerance
            assert abs(weight - best) <= tolerance
        opened.assert_clean()
    finally:
        opened.context.close()


# --------------------------------------------------------------------------- the widget's module
def test_widget_module_two_views_on_one_page_sync_both_ways(browser, minilm_capture: Capture,
                                                            tmp_path: Path) -> None:
    """The ES module the widget ships, run as anywidget runs it, twice on one page."""
    views = [attnviz.show(minilm_capture, view="head", layer=2),
             attnviz.show(minilm_capture.select(layers=[4, 5], heads=[1, 2, 3]),
                          view="heatmap", layer=5, head=3)]
    assert views[0]._esm == views[1]._esm
    opened = Page(browser)
    try:
        page = opened.page
        page.set_content(preview_page(views))
        for i in range(2):
            page.wait_for_selector(f"#view{i}[data-ready='1']", timeout=60_000)
        # Same element ids in both views, each inside its own shadow root.
        labels = page.eval_on_selector_all("#view0 #hv-left .tok", "ts => ts.map(t => "
                                           "t.textContent)")
        assert labels == minilm_capture.display_tokens
        assert page.eval_on_selector("#view1 #layer", "s => s.options.length") == 2
        assert "layer 5, head 3" in page.get_attribute("#view1 #hm-canvas", "aria-label")
        assert page.evaluate("document.getElementById('hv-left')") is None  # no global ids
        # Browser -> model: a click in the first view sets its model only, and saves it.
        page.click("#view0 #heads .chip[data-head='4']", modifiers=["Shift"])
        models = "window.attnvizModels"
        assert page.evaluate(f"[{models}[0].values.heads, {models}[0].saves > 0]") == [[4], True]
        assert page.evaluate(f"[{models}[1].values.heads, {models}[1].saves]") == [[3], 0]
        page.click("#view0 .tabs button[data-view=model]")
        assert page.evaluate("attnvizModels[0].values.view") == "model"
        assert page.locator("#view0 #mv-grid canvas").count() == 6 * 12
        # Model -> browser (what a change from Python does): the second view follows.
        page.evaluate("attnvizModels[1].set('layer', 4); attnvizModels[1].set('heads', [1])")
        wait_until(page, "document.getElementById('view1').shadowRoot.getElementById('hm-canvas')"
                    ".getAttribute('aria-label').includes('layer 4, head 1')")
        assert page.input_value("#view1 #layer") == "0"  # position of layer 4 in [4, 5]
        assert page.evaluate("attnvizModels[1].saves") == 0  # nothing echoed back
        assert page.input_value("#view0 #layer") == "2"  # the first view did not move
        # The colour scale is part of the selection, both ways.
        page.select_option("#view1 #scale", "log")
        assert page.evaluate(f"{models}[1].values.scale") == "log"
        page.evaluate("attnvizModels[1].set('vmax', 1)")
        wait_until(page, "document.getElementById('view1').shadowRoot.getElementById('hm-canvas')"
                    ".dataset.scale === 'log scale, top = 1.00 (fixed)'")
        # Arrow keys move the focused view only.
        page.click("#view1 #hm-canvas")
        page.keyboard.press("ArrowDown")
        assert page.evaluate(f"[{models}[1].values.layer, {models}[0].values.layer]") == [5, 2]
        # Tearing a view down leaves the other working.
        page.evaluate("window.attnvizCleanups[0]()")
        page.evaluate("attnvizModels[1].set('heads', [2])")
        wait_until(page, "document.getElementById('view1').shadowRoot.getElementById('hm-canvas')"
                    ".getAttribute('aria-label').includes('head 2')")
        opened.assert_clean()
    finally:
        opened.context.close()


# --------------------------------------------------------------------------- Python side
def test_traits_check_layers_heads_and_views(minilm_capture: Capture) -> None:
    view = attnviz.show(minilm_capture.select(layers=[1, 3]), view="model", layer=-3)
    assert (view.view, view.layer, view.heads, view.head) == ("model", 3, list(range(12)), None)
    view.head = -1
    assert view.heads == [11] and view.head == 11
    view.heads = [5, 2, 5]
    assert view.heads == [2, 5]
    with pytest.raises(traitlets.TraitError, match="layer 2 is not in this capture"):
        view.layer = 2
    with pytest.raises(traitlets.TraitError, match="unknown view"):
        view.view = "graph"
    assert view.layer == 3 and view.view == "model"
    with pytest.raises(UsageError, match="unknown view 'graph'"):
        attnviz.show(minilm_capture, view="graph")
    with pytest.raises(UsageError, match="head 12 is out of range"):
        minilm_capture.show("heatmap", head=12)
    with pytest.raises(UsageError, match="not both"):
        attnviz.show(minilm_capture, head=1, heads=[1, 2])


def test_fallback_follows_the_selection_and_big_captures_are_refused(
        minilm_capture: Capture, monkeypatch: pytest.MonkeyPatch) -> None:
    view = attnviz.show(minilm_capture, view="heatmap", layer=4, head=9, words=True)
    view.heads = [1, 2]
    data, _ = view._repr_mimebundle_()
    assert set(data) >= {"text/plain", WIDGET_MIME, "text/html"}
    initial = read_report_data(_srcdoc(data["text/html"]))["initial"]
    assert (initial["view"], initial["layer"], initial["heads"], initial["words"]) == (
        "heatmap", 4, [1, 2], True)
    # A bare capture shows the same report inline; a large one only a summary.
    assert 'sandbox="allow-scripts allow-downloads"' in minilm_capture._repr_html_()
    cap = minilm_capture
    monkeypatch.setattr("attnviz.notebook.MAX_REPR_WEIGHTS", cap.weights.size - 1)
    summary = cap._repr_html_()
    assert "<iframe" not in summary and "capture.show()" in summary
    monkeypatch.setattr("attnviz.notebook.MAX_VIEW_WEIGHTS", cap.weights.size - 1)
    with pytest.raises(UsageError, match=r"(?s)too many for an inline view .*capture.select"):
        attnviz.show(cap)
    with pytest.raises(UsageError, match="too many"):
        static_html(cap)
    assert MAX_REPR_WEIGHTS < (1 << 24)
