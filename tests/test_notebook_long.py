"""The notebook's zoomable long-context view: the kernel's answers and the widget's module.

The answers to the browser's requests (tiles, atlas levels, statistics) are compared with the
capture's own; then the widget's ES module runs in headless Chromium with a stand-in for the
anywidget model whose messages go to the widget's own handler in this process, and a hovered
token-level cell shows the capture's weight.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from attnviz.errors import AttnvizError
from attnviz.notebook_long import LongAttentionView, show_long
from attnviz.render.html import script_json
from tests._browser import wait_until, watch
from tests.long_fixtures import build_tiny_llama, build_tiny_mistral, capture_tiny_llama

TOKENS = 600


@pytest.fixture(scope="module")
def cap(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from attnviz.long import load_long

    model = build_tiny_llama(tmp_path_factory.mktemp("tiny-llama-nb"), positions=1024)
    return load_long(capture_tiny_llama(model, TOKENS,
                                        tmp_path_factory.mktemp("long-nb") / "capture"))


def _floats(data: bytes, shape: list[int]) -> np.ndarray:
    return np.frombuffer(data, "<f4").reshape(shape)


def test_the_kernel_answers_tiles_atlas_levels_and_statistics(cap: Any) -> None:
    view = show_long(cap)
    assert view._info["num_tokens"] == TOKENS and view._info["atlas"]["blocks"][0] == 16
    assert view._info["display_tokens"] == list(cap.display_tokens)
    reply, buffers = view.answer({"request": 1, "kind": "tile", "layer": 1, "head": "mean",
                                  "q0": 100, "q1": 180, "k0": 50, "k1": 400})
    assert reply == {"shape": [80, 350]}
    np.testing.assert_array_equal(_floats(buffers[0], [80, 350]),
                                  cap.tile(1, "mean", 100, 180, 50, 400))
    for block in (16, 64, 256):
        reply, buffers = view.answer({"request": 2, "kind": "atlas", "layer": 0, "head": 3,
                                      "block": block})
        n = -(-TOKENS // block)
        values = np.frombuffer(buffers[0], "<f4")
        sums, maxes = cap.atlas(0, 3, block)
        np.testing.assert_allclose(values[:n * n].reshape(n, n), sums, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(values[n * n:].reshape(n, n), maxes, rtol=1e-6, atol=1e-7)
    reply, buffers = view.answer({"request": 3, "kind": "stats"})
    assert buffers == []
    for name, values in cap.head_stats().items():
        np.testing.assert_allclose(np.asarray(reply["stats"]["stats"][name], float), values,
                                   atol=1e-6)


@pytest.mark.parametrize(("content", "words"), [
    ({"request": 1, "kind": "file", "path": "/etc/passwd"}, "unknown request"),
    ({"request": 1, "kind": "tile", "layer": 0, "head": 0, "q0": 0, "q1": 601, "k0": 0,
      "k1": 1}, "600 tokens"),
    ({"request": 1, "kind": "tile", "layer": 0, "head": True, "q0": 0, "q1": 1, "k0": 0,
      "k1": 1}, "'head'"),
    ({"request": 1, "kind": "tile", "layer": 0, "head": 0, "q0": 0, "q1": 100, "k0": 0,
      "k1": 11}, "at most 1,000"),
    ({"request": 1, "kind": "atlas", "layer": 0, "head": 0, "block": 16}, "at most 1,000"),
    ({"request": 1, "kind": "atlas", "layer": 0, "head": 0, "block": 48}, "power of two"),
    ({"request": 1, "kind": "atlas", "layer": 2, "head": 0, "block": 64}, "layer 2"),
    ({"request": 1, "kind": "atlas", "layer": 0, "head": "all", "block": 64}, "'head'"),
    ({"request": 1, "kind": "stats", "extra": 1}, "unknown field"),
    ([1, 2], "unknown request"),
])
def test_bad_requests_get_an_error_answer(cap: Any, content: Any, words: str) -> None:
    view = LongAttentionView(cap, max_values=1000)
    with pytest.raises(AttnvizError) as caught:
        view.answer(content)
    assert words in caught.value.message + (caught.value.hint or "")
    sent: list[tuple[Any, Any]] = []
    view.send = lambda content, buffers=None: sent.append((content, buffers))  # type: ignore[method-assign]
    view._on_message(view, content, [])
    assert sent[0][0]["kind"] == "answer" and words in sent[0][0]["error"]
    assert sent[0][1] == []


def _stand_in_page(view: LongAttentionView) -> str:
    return ("<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>long</title>"
            "</head><body><div id=\"view\"></div>"
            f'<script type="application/json" id="info">{script_json(view._info)}</script>'
            "<script type=\"module\">" + view._esm.replace("</", "<\\/") + """
const handlers = {};
const model = {
  get(key) { return key === "_info" ? JSON.parse(document.getElementById("info").textContent)
                                    : undefined; },
  on(name, h) { (handlers[name] = handlers[name] || []).push(h); },
  off(name, h) { handlers[name] = (handlers[name] || []).filter((x) => x !== h); },
  async send(content) {
    const answer = await window.attnvizKernel(content);
    const buffers = answer.buffers.map((text) => new DataView(
      Uint8Array.from(atob(text), (c) => c.charCodeAt(0)).buffer));
    for (const h of handlers["msg:custom"] || []) h(answer.content, buffers);
  },
};
render({ model, el: document.getElementById("view") });
</script></body></html>""")




SHADOW = "document.getElementById('view').shadowRoot"


@pytest.mark.slow
def test_the_widget_zooms_to_exact_weights_asked_of_the_kernel(browser: Any, cap: Any,
                                                               tmp_path: Path) -> None:
    view = show_long(cap)
    sent: list[tuple[Any, Any]] = []
    view.send = lambda content, buffers=None: sent.append((content, buffers))  # type: ignore[method-assign]
    asked: list[str] = []

    def kernel(content: Any) -> dict[str, Any]:
        asked.append(str(content.get("kind")))
        view._on_message(view, content, [])
        reply, buffers = sent.pop()
        return {"content": reply,
                "buffers": [base64.b64encode(bytes(b)).decode("ascii") for b in buffers or []]}

    context = browser.new_context(viewport={"width": 1300, "height": 1000})
    page = context.new_page()
    outside: list[str] = []
    errors: list[str] = []
    watch(context, page, ["about:"], outside, errors, requests=True)
    page.expose_function("attnvizKernel", kernel)
    try:
        page.set_content(_stand_in_page(view))
        wait_until(page, "document.getElementById('view').dataset.longReady === '1'")
        wait_until(page, f"{SHADOW}.getElementById('long-level').dataset.level === 'atlas'")
        assert page.evaluate(f"{SHADOW}.getElementById('long-level').dataset.block") == "16"
        canvas = page.locator("#view #long-canvas").bounding_box()
        plot = page.evaluate("document.getElementById('view').attnvizLong.plot()")
        x = canvas["x"] + plot["left"] + 0.4 * plot["side"] + 0.5
        y = canvas["y"] + plot["top"] + 0.7 * plot["side"] + 0.5
        page.mouse.move(x, y)
        for _ in range(6):
            page.mouse.wheel(0, -400)
            page.wait_for_timeout(60)
        wait_until(page, f"{SHADOW}.getElementById('long-level').dataset.level === 'exact'")
        page.mouse.move(x - 40, y + 60)
        shown = page.evaluate(f"Object.assign({{}}, {SHADOW}.getElementById('long-readout')"
                              ".dataset)")
        assert shown["kind"] == "exact"
        q, k = int(shown["q"]), int(shown["k"])
        value = float(cap.tile(0, 0, q, q + 1, k, k + 1)[0, 0])
        assert q >= k and value > 0
        assert float(shown["value"]) == pytest.approx(value, abs=1e-6)
        assert {"atlas", "tile", "stats"} <= set(asked)
        # the kernel answered: the widget is live (its static copy hides itself)
        assert page.evaluate("document.getElementById('view').hasAttribute('data-attnviz-live')")
        wait_until(page, f"{SHADOW}.getElementById('long-stats').rows.length === 5")  # 4 heads
    finally:
        context.close()
    assert outside == [] and errors == []


def _connect(page: Any, view: LongAttentionView) -> None:
    sent: list[tuple[Any, Any]] = []
    view.send = lambda content, buffers=None: sent.append((content, buffers))  # type: ignore[method-assign]

    def kernel(content: Any) -> dict[str, Any]:
        view._on_message(view, content, [])
        reply, buffers = sent.pop()
        return {"content": reply,
                "buffers": [base64.b64encode(bytes(b)).decode("ascii") for b in buffers or []]}

    page.expose_function("attnvizKernel", kernel)


@pytest.mark.slow
def test_keys_outside_a_sliding_window_are_drawn_as_masked(browser: Any,
                                                           tmp_path: Path) -> None:
    from attnviz.long import load_long

    model = build_tiny_mistral(tmp_path / "mistral", window=16)
    cap = load_long(capture_tiny_llama(model, 300, tmp_path / "capture"))
    assert cap.windows[0] == 16
    view = show_long(cap)
    assert view._info["windows"] == [16, 16]
    context = browser.new_context(viewport={"width": 1300, "height": 1000})
    page = context.new_page()
    errors: list[str] = []
    watch(context, page, ["about:"], [], errors)
    _connect(page, view)
    try:
        page.set_content(_stand_in_page(view))
        wait_until(page, "document.getElementById('view').dataset.longReady === '1'")
        page.evaluate("document.getElementById('view').attnvizLong"
                      ".setView({x0: 100, y0: 150, span: 40})")
        wait_until(page, f"{SHADOW}.getElementById('long-level').dataset.level === 'exact'")
        box = page.locator("#view #long-canvas").bounding_box()
        plot = page.evaluate("document.getElementById('view').attnvizLong.plot()")
        size = plot["side"] / 40  # pixels a token

        def at(q: int, k: int) -> tuple[float, float]:
            return (box["x"] + plot["left"] + (k - 100 + 0.5) * size,
                    box["y"] + plot["top"] + (q - 150 + 0.5) * size)

        # queries 150..189, keys 100..139: a query sees its last 16 keys (q - k < 16)
        for q, k, hidden in ((150, 139, False), (152, 137, False), (150, 135, False),
                             (151, 135, True), (185, 100, True), (150, 134, True)):
            page.mouse.move(*at(q, k))
            shown = page.evaluate(f"Object.assign({{}}, {SHADOW}.getElementById("
                                  "'long-readout').dataset)")
            assert (int(shown["q"]), int(shown["k"])) == (q, k)
            value = float(cap.tile(0, 0, q, q + 1, k, k + 1)[0, 0])
            assert float(shown["value"]) == pytest.approx(value, abs=1e-6)
            assert shown["masked"] == ("1" if hidden else "0")
            assert (value == 0) == hidden
            x, y = at(q, k)
            pixel = page.evaluate(
                f"(() => {{ const c = {SHADOW}.getElementById('long-canvas'); "
                "const r = c.getBoundingClientRect(); const d = window.devicePixelRatio; "
                "return Array.from(c.getContext('2d')"
                f".getImageData(({x} - r.left - c.clientLeft) * d, ({y} - r.top - c.clientTop) "
                "* d, 1, 1).data.slice(0, 3)); })()")
            assert (pixel == [232, 233, 236]) == hidden
    finally:
        context.close()
    assert errors == []


def test_a_saved_notebook_keeps_a_static_copy_of_the_view(cap: Any) -> None:
    """The widget's bundle carries the offline long report as its text/html (what a notebook
    reopened without the kernel, or with one but no widget state, shows), keyed to the view
    so the live widget hides it while it is on the page."""
    import html
    import re

    from attnviz.render.long_html import read_long_report

    view = show_long(cap)
    data, _metadata = view._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in data
    copy = data["text/html"]
    assert f'data-attnviz-static="{view._view_key}"' in copy
    assert f'[data-attnviz-live="{view._view_key}"]' in copy  # the style sheet that hides it
    assert 'data-attnviz-live' in view._esm and "_view_key" in view._esm
    document = html.unescape(re.search(r'srcdoc="([^"]*)"', copy).group(1))
    report = read_long_report(document)
    assert report["num_tokens"] == TOKENS
    levels = {level["block"]: level for level in report["atlas"]["levels"]}
    from attnviz.render.long_html import unpack_level

    finest = min(levels)
    sums, maxes = unpack_level(levels[finest]["heads"]["0"]["1"], levels[finest]["n"])
    np.testing.assert_allclose(sums, cap.atlas(0, 1, finest)[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(maxes, cap.atlas(0, 1, finest)[1], rtol=1e-6, atol=1e-7)
    assert '<img alt="' in copy and "Trust Notebook" in copy  # where frames are stripped
    assert view.static_html() is view.static_html()  # made once


@pytest.mark.slow
def test_the_static_copy_shows_the_view_with_no_kernel_and_no_network(
        browser: Any, cap: Any, tmp_path: Path) -> None:
    view = show_long(cap)
    page_file = tmp_path / "saved.html"
    page_file.write_text("<!DOCTYPE html><html><head><meta charset='utf-8'><title>saved</title>"
                         "</head><body>" + view.static_html() + "</body></html>",
                         encoding="utf-8")
    context = browser.new_context(viewport={"width": 1100, "height": 1000})
    page = context.new_page()
    outside: list[str] = []
    errors: list[str] = []
    watch(context, page, [page_file.as_uri(), "about:", "data:"], outside, errors,
          requests=True)
    try:
        page.goto(page_file.as_uri())
        wait_until(page, "document.querySelector('iframe') !== null")
        frame = page.frames[1]
        wait_until(frame, "document.documentElement.dataset.longReady === '1'")
        wait_until(frame, "document.getElementById('long-level').dataset.level === 'atlas' "
                          "&& !document.getElementById('long-legend').hidden")
        block = int(frame.evaluate("document.getElementById('long-level').dataset.block"))
        box = page.locator("iframe").bounding_box()
        canvas = frame.locator("#long-canvas").bounding_box()
        plot = frame.evaluate("window.attnvizLong.plot()")
        assert box is not None and canvas is not None
        page.mouse.move(canvas["x"] + plot["left"] + 0.3 * plot["side"] + 0.5,
                        canvas["y"] + plot["top"] + 0.8 * plot["side"] + 0.5)
        shown = frame.evaluate("Object.assign({}, document.getElementById('long-readout')"
                               ".dataset)")
        assert shown["kind"] == "atlas" and int(shown["block"]) == block
        sums, maxes = cap.atlas(0, 0, block)
        row, col = int(shown["row"]), int(shown["col"])
        assert float(shown["max"]) == pytest.approx(float(maxes[row, col]), rel=1e-6,
                                                    abs=1e-7)
        wait_until(frame, "document.getElementById('long-stats').rows.length === 5")
    finally:
        context.close()
    assert outside == [] and errors == []
