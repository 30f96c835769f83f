"""The zoomable long-context view in a real headless Chromium, against ``attnviz serve``.

A 16,384-token capture of a tiny random-weight Llama is taken with the long path and saved;
``attnviz serve --long-from`` runs as a subprocess on 127.0.0.1 (always killed with its process
group). The test opens ``/long`` on the whole context, zooms with the mouse wheel down to an
exact token-level tile, hovers cells and checks the values the page shows against the
capture's own ``atlas`` and ``tile``; stepping the head select at token level asks for the
visible tile only (no atlas level: that is a pass over the whole head). Every request beyond
the server is aborted and recorded.

The offline report (``attnviz html --long-from``) of a 1,000-token capture, from file:// with
every other request blocked: masked keys at every zoom (also inside an atlas block), the
colour legend, the fixed and the visible colour scale, zoom bounds, a canvas that follows its
window and the pixel ratio, tables that fit their panel, and the hover readout after a jump.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests._browser import wait_until, watch
from tests._servers import ServeProcess
from tests.long_fixtures import build_tiny_llama, capture_tiny_llama

pytestmark = pytest.mark.slow

TOKENS = 16_384
MASKED = [232, 233, 236]  # long.js: the colour of keys a query does not see


@pytest.fixture(scope="module")
def long_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = build_tiny_llama(tmp_path_factory.mktemp("tiny-llama-16k"), positions=TOKENS)
    return capture_tiny_llama(model, TOKENS, tmp_path_factory.mktemp("long16k") / "capture")


@pytest.fixture(scope="module")
def server_url(long_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with ServeProcess("--model", "toy", "--long-from", str(long_folder), "--timeout", "600",
                      env={"ATTNVIZ_CACHE_DIR": str(tmp_path_factory.mktemp("long-serve-cache"))},
                      pattern=r"Long context \(16,384 tokens\): (http://127\.0\.0\.1:\d+/long)",
                      start_timeout=120) as served:
        yield served.url


def _readout(page: Any) -> dict[str, str]:
    return dict(page.evaluate(
        "Object.assign({}, document.getElementById('long-readout').dataset)"))


def _plot(page: Any) -> dict[str, float]:
    """Where the map lies on the page (CSS pixels): x, y of its corner, its side, the ratio."""
    box = page.locator("#long-canvas").bounding_box()
    plot = page.evaluate("window.attnvizLong.plot()")
    return {"x": box["x"] + plot["left"], "y": box["y"] + plot["top"], "side": plot["side"],
            "dpr": plot["dpr"], "left": plot["left"], "top": plot["top"]}


def _expected_block(blocks: list[int], span: float, side: float) -> int:
    """long.js levelFor: the finest level whose blocks are at least a pixel."""
    fits = [b for b in blocks if b >= span / side]
    return min(fits) if fits else max(blocks)


def test_zoom_from_the_whole_context_to_exact_token_weights(browser: Any, server_url: str,
                                                            long_folder: Path) -> None:
    from attnviz.long import load_long

    cap = load_long(long_folder)
    assert cap.num_tokens == TOKENS
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    outside: list[str] = []
    errors: list[str] = []
    watch(context, page, [server_url.rsplit("/", 1)[0] + "/"], outside, errors,
          requests=True)
    try:
        # the live page links to the long view of the capture the server was started with
        page.goto(server_url.rsplit("/", 1)[0] + "/")
        page.wait_for_selector("#long-link:not([hidden])", timeout=60_000)
        assert "16,384 tokens" in (page.text_content("#long-link") or "")
        page.click("#long-link")
        page.wait_for_url(server_url)
        wait_until(page, "document.documentElement.dataset.longReady === '1'")
        wait_until(page, "document.getElementById('long-level').dataset.level === 'atlas'")
        assert page.evaluate("window.attnvizLong.view()") == {"x0": 0, "y0": 0, "span": TOKENS}
        plot = _plot(page)
        blocks = [b for b in (16, 32, 64, 128) if -(-TOKENS // b) <= 1024]
        block = _expected_block(blocks, TOKENS, plot["side"])
        assert page.evaluate("document.getElementById('long-level').dataset.block") == str(block)
        x, y = plot["x"] + plot["side"] * 0.45 + 0.5, plot["y"] + plot["side"] * 0.65 + 0.5
        page.mouse.move(x, y)
        shown = _readout(page)
        assert shown["kind"] == "atlas" and shown["block"] == str(block)
        row, col = int(shown["row"]), int(shown["col"])
        assert row > col  # below the diagonal: attention a causal model pays
        sums, maxes = cap.atlas(0, 0, block)
        assert float(shown["sum"]) == pytest.approx(float(sums[row, col]), rel=1e-6, abs=1e-7)
        assert float(shown["max"]) == pytest.approx(float(maxes[row, col]), rel=1e-6,
                                                    abs=1e-7)

        # zoom in with the wheel around that point until the page draws exact weights
        for _ in range(12):
            page.mouse.wheel(0, -400)
            page.wait_for_timeout(60)
            if page.evaluate("window.attnvizLong.view().span") <= 64:
                break
        assert page.evaluate("window.attnvizLong.view().span") <= 256
        wait_until(page, "document.getElementById('long-level').dataset.level === 'exact'")
        view = page.evaluate("window.attnvizLong.view()")
        checked = 0
        side = plot["side"]
        for dx, dy in ((-0.4 * side, 0.3 * side), (-0.15 * side, 0.3 * side), (0.0, 0.0),
                       (0.2 * side, -0.2 * side)):
            page.mouse.move(x + dx, y + dy)
            shown = _readout(page)
            assert shown["kind"] == "exact"
            q, k = int(shown["q"]), int(shown["k"])
            assert view["y0"] <= q < view["y0"] + view["span"] + 1
            assert view["x0"] <= k < view["x0"] + view["span"] + 1
            value = float(cap.tile(0, 0, q, q + 1, k, k + 1)[0, 0])
            assert float(shown["value"]) == pytest.approx(value, abs=1e-6)
            if k > q:
                assert value == 0.0
            else:
                checked += value > 0
        assert checked >= 2  # not only masked zeros

        # the mean of the layer's heads, at the same place
        page.select_option("#long-head", "mean")
        wait_until(page, "document.getElementById('long-level').dataset.level === 'exact'")
        page.mouse.move(x - 0.15 * side, y + 0.3 * side)
        shown = _readout(page)
        q, k = int(shown["q"]), int(shown["k"])
        assert float(shown["value"]) == pytest.approx(
            float(cap.tile(0, "mean", q, q + 1, k, k + 1)[0, 0]), abs=1e-6)

        # jump to a token by number, then by text
        page.fill("#long-query", "12345")
        page.click("#long-find button")
        view = page.evaluate("window.attnvizLong.view()")
        assert view["x0"] <= 12345 < view["x0"] + view["span"]
        assert view["y0"] <= 12345 < view["y0"] + view["span"]
        assert page.evaluate("document.getElementById('long-found').dataset.position") == "12345"
        tokens = [t.lower() for t in cap.display_tokens]
        needle = f"{tokens[9000]} {tokens[9001]} {tokens[9002]}"
        joined, starts = "", []
        for i, t in enumerate(tokens):  # the rule the page states: across token boundaries
            joined += t.replace(" ", "")
            starts += [i] * len(t.replace(" ", ""))
        expected = starts[joined.index(needle.replace(" ", ""))]
        assert expected <= 9000
        page.fill("#long-query", needle.upper())
        page.click("#long-find button")
        found = int(page.evaluate("document.getElementById('long-found').dataset.position"))
        assert found == expected
        view = page.evaluate("window.attnvizLong.view()")
        assert view["x0"] <= found < view["x0"] + view["span"]
        wait_until(page, "document.getElementById('long-level').dataset.level === 'exact'")
    finally:
        context.close()
    assert outside == [], "the page reached beyond the server"
    assert errors == []


def test_head_switching_at_token_level_asks_for_the_visible_tile_only(
        browser: Any, server_url: str, long_folder: Path) -> None:
    """Stepping the head select while exact tiles show: each head answers with the tile of
    the view (no atlas level, which is a pass over the whole head), within a second."""
    import statistics
    import time

    from attnviz.long import load_long

    cap = load_long(long_folder)
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    outside: list[str] = []
    errors: list[str] = []
    asked: list[str] = []
    watch(context, page, [server_url.rsplit("/", 1)[0] + "/"], outside, errors, requests=True)
    page.on("request", lambda request: asked.append(f"{request.url} {request.post_data}"))
    try:
        page.goto(server_url)
        wait_until(page, "document.documentElement.dataset.longReady === '1'")
        page.evaluate("window.attnvizLong.find('12000')")
        wait_until(page, "document.getElementById('long-level').dataset.level === 'exact'")
        took = []
        for head in ("1", "2", "3", "mean", "0"):
            del asked[:]
            started = time.monotonic()
            page.select_option("#long-head", head)
            wait_until(page, "(() => { const l = window.attnvizLong.level(); return l && "
                             "l.kind === 'exact'; })()", timeout_s=30)
            took.append(time.monotonic() - started)
            atlases = [a for a in asked if "/api/long/atlas" in a]
            # a level is asked for only to know the head's maximum, and only the coarsest one
            # once the statistics pass has run (the server pools it from that pass)
            assert all('"block":4096' in a for a in atlases), atlases
            view = page.evaluate("window.attnvizLong.view()")
            page.mouse.move(0, 0)
            plot = _plot(page)
            page.mouse.move(plot["x"] + plot["side"] * 0.7, plot["y"] + plot["side"] * 0.8)
            shown = _readout(page)
            assert shown["kind"] == "exact"
            q, k = int(shown["q"]), int(shown["k"])
            assert view["y0"] <= q <= view["y0"] + view["span"]
            want = float(cap.tile(0, head if head == "mean" else int(head), q, q + 1, k,
                                  k + 1)[0, 0])
            assert float(shown["value"]) == pytest.approx(want, abs=1e-6)
        assert statistics.median(took) < 1.0 and max(took) < 3.0, took
    finally:
        context.close()
    assert outside == [] and errors == []


# --------------------------------------------------------------------------- the offline report
@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    """A 1,000-token long capture and its offline report, whose finest level is 64 tokens."""
    from attnviz.long import load_long
    from attnviz.render.long_html import write_long_report

    folder = tmp_path_factory.mktemp("long1000")
    model = build_tiny_llama(folder / "llama", positions=1024)
    cap = load_long(capture_tiny_llama(model, 1000, folder / "capture"))
    # 2 x 2 layers x 5 (4 heads and the mean) = 20 n^2 cells a level: 4^2, 8^2, 16^2 and
    # 32^2 (block 32) make 20 x 1,360 = 27,200 > 20,000, so the finest level kept is 64
    return cap, write_long_report(cap, folder / "report.html", max_cells=20_000)


def _open_report(browser: Any, path: Path, *, width: int = 1400, height: int = 1000,
                 dpr: float = 1, level: str = "atlas") -> tuple[Any, Any, list[str], list[str]]:
    context = browser.new_context(viewport={"width": width, "height": height},
                                  device_scale_factor=dpr)
    page = context.new_page()
    outside: list[str] = []
    errors: list[str] = []
    watch(context, page, [path.resolve().as_uri()], outside, errors, requests=True)
    page.goto(path.resolve().as_uri())
    wait_until(page, "document.documentElement.dataset.longReady === '1'", timeout_s=60)
    wait_until(page, f"document.getElementById('long-level').dataset.level === '{level}' && "
                     "window.attnvizLong.scale().basis === 'head'", timeout_s=60)
    return context, page, outside, errors


def _pixel(page: Any, plot: dict[str, float], view: dict[str, float], q: int, k: int
           ) -> list[int]:
    """The canvas's colour at the centre of token pair (q, k)."""
    fx = (k + 0.5 - view["x0"]) / view["span"]
    fy = (q + 0.5 - view["y0"]) / view["span"]
    x = (plot["left"] + fx * plot["side"]) * plot["dpr"]
    y = (plot["top"] + fy * plot["side"]) * plot["dpr"]
    return list(page.evaluate(
        "([x, y]) => Array.from(document.getElementById('long-canvas').getContext('2d')"
        ".getImageData(Math.floor(x), Math.floor(y), 1, 1).data.slice(0, 3))", [x, y]))


def test_the_offline_report_zooms_through_its_atlas_levels(browser: Any,
                                                           small: tuple[Any, Path]) -> None:
    cap, path = small
    context, page, outside, errors = _open_report(browser, path)
    try:
        plot = _plot(page)
        # 1,000 tokens on the map: the finest level at least a pixel is 64 (16 would be finer
        # than the report holds)
        assert page.evaluate("document.getElementById('long-level').dataset.block") == "64"
        # zoom stops at what the report holds: four of its finest blocks across
        assert page.evaluate("window.attnvizLong.bounds()") == {"minSpan": 256,
                                                                 "maxSpan": 1000}
        assert page.is_disabled("#long-zoom-out")
        clicks = 0
        while not page.is_disabled("#long-zoom-in"):
            page.click("#long-zoom-in")
            clicks += 1
            assert clicks < 10
        view = page.evaluate("window.attnvizLong.view()")
        assert view["span"] == 256
        page.keyboard.press("Escape")
        page.focus("#long-canvas")
        page.keyboard.press("+")
        assert page.evaluate("window.attnvizLong.view()")["span"] == 256
        assert "the finest level this report holds" in page.inner_text("#long-level")
        assert page.evaluate("document.getElementById('long-level').dataset.block") == "64"
        page.mouse.move(plot["x"] + 0.2 * plot["side"] + 0.5, plot["y"] + 0.6 * plot["side"] + 0.5)
        shown = _readout(page)
        assert shown["kind"] == "atlas" and shown["block"] == "64"
        sums, maxes = cap.atlas(0, 0, 64)
        row, col = int(shown["row"]), int(shown["col"])
        assert float(shown["sum"]) == pytest.approx(float(sums[row, col]), rel=1e-5, abs=1e-6)
        assert float(shown["max"]) == pytest.approx(float(maxes[row, col]), rel=1e-6,
                                                    abs=1e-7)
        texts = page.locator("#long-stats").inner_text()
        assert all(name.replace("_", " ") in texts for name in cap.head_stats())
    finally:
        context.close()
    assert outside == [] and errors == []


def test_offline_masks_future_keys_inside_a_block_with_a_fixed_scale_and_legend(
        browser: Any, small: tuple[Any, Path]) -> None:
    """Zoomed past the finest level, a diagonal block is masked to the token (not painted
    whole), the colours keep the head's maximum as top while panning (not the one visible
    block), and "what is visible" takes the largest visible value instead."""
    import numpy as np

    cap, path = small
    context, page, outside, errors = _open_report(browser, path)
    try:
        sums, maxes = cap.atlas(0, 0, 64)
        head_max = float(np.max(maxes))
        legend = "Object.assign({}, document.getElementById('long-legend').dataset)"
        shown = page.evaluate(legend)
        assert shown["basis"] == "head" and shown["kind"] == "power"
        assert float(shown["top"]) == pytest.approx(head_max, rel=1e-6)
        assert page.is_visible("#long-legend-bar")
        ticks = page.eval_on_selector_all("#long-legend-ticks span",
                                          "s => s.map(t => t.textContent)")
        assert ticks[0] == "0" and len(ticks) == 3
        page.evaluate("window.attnvizLong.setView({x0: 448, y0: 448, span: 64})")
        view = page.evaluate("window.attnvizLong.view()")
        assert view == {"x0": 448, "y0": 448, "span": 256}  # clamped to the zoom bound
        plot = _plot(page)
        # block 7 (tokens 448-511) on the diagonal: keys after the query are masked inside it
        for q, k in ((460, 470), (470, 500), (449, 511)):
            assert _pixel(page, plot, view, q, k) == MASKED, (q, k)
        for q, k in ((470, 460), (500, 449), (600, 500)):
            assert _pixel(page, plot, view, q, k) != MASKED, (q, k)
        # hovering a masked key says so
        fx, fy = (470.5 - view["x0"]) / view["span"], (460.5 - view["y0"]) / view["span"]
        page.mouse.move(plot["x"] + fx * plot["side"], plot["y"] + fy * plot["side"])
        assert _readout(page)["masked"] == "1"
        colour = _pixel(page, plot, view, 600, 500)
        page.focus("#long-canvas")
        page.keyboard.press("ArrowRight")  # pan: a fixed scale keeps every colour
        moved = page.evaluate("window.attnvizLong.view()")
        assert moved["x0"] > view["x0"]
        assert float(page.evaluate(legend)["top"]) == pytest.approx(head_max, rel=1e-6)
        assert _pixel(page, plot, moved, 600, 500) == colour
        # the scale of what is visible: the largest block max in view, masked blocks left out
        page.select_option("#long-range", "visible")
        shown = page.evaluate(legend)
        assert shown["basis"] == "visible" and shown["range"] == "visible"
        r0, r1 = int(moved["y0"]) // 64, (int(moved["y0"] + moved["span"]) - 1) // 64
        c0, c1 = int(moved["x0"]) // 64, (int(moved["x0"] + moved["span"]) - 1) // 64
        seen = [float(maxes[r, c]) for r in range(r0, r1 + 1) for c in range(c0, c1 + 1)
                if c <= r]
        assert float(shown["top"]) == pytest.approx(max(seen), rel=1e-6)
        # a fixed vmax and a log scale, as the command line's --vmax and --scale log
        page.fill("#long-vmax", "0.5")
        page.dispatch_event("#long-vmax", "change")
        page.select_option("#long-scale", "log")
        shown = page.evaluate(legend)
        assert shown["basis"] == "vmax" and float(shown["top"]) == 0.5 and shown["kind"] == "log"
        assert page.is_hidden("#long-gamma-label")
        page.select_option("#long-scale", "power")
        page.fill("#long-gamma", "9")
        page.dispatch_event("#long-gamma", "change")
        assert "not a valid colour scale" in page.inner_text("#long-scale-note")
        assert page.evaluate("window.attnvizLong.scale().gamma") == 0.5
    finally:
        context.close()
    assert outside == [] and errors == []


def test_offline_canvas_follows_its_window_and_pixel_ratio(browser: Any,
                                                           small: tuple[Any, Path]) -> None:
    """A 1024 x 700 window at 2x: no sideways scroll, the canvas holds two pixels per CSS
    pixel, the tables fit their panel; a wider window gets a bigger map; the readout follows a
    jump and clears when the pointer leaves."""
    _cap, path = small
    context, page, outside, errors = _open_report(browser, path, width=1024, height=700, dpr=2)
    try:
        assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
        size = page.evaluate("(() => { const c = document.getElementById('long-canvas'); "
                             "return [c.width, c.height, c.clientWidth, c.clientHeight]; })()")
        assert size[0] == round(size[2] * 2) and size[1] == round(size[3] * 2)
        fits = ("[...document.querySelectorAll('.long-side section')].every(s => "
                "s.scrollWidth <= s.clientWidth + 1)")
        wait_until(page, "document.getElementById('long-stats').rows.length > 1")
        assert page.evaluate(fits)
        small_side = _plot(page)["side"]
        page.set_viewport_size({"width": 1600, "height": 1100})
        wait_until(page, f"window.attnvizLong.plot().side > {small_side}")
        assert page.evaluate(fits)
        page.set_viewport_size({"width": 700, "height": 900})  # a narrow notebook column
        wait_until(page, "window.attnvizLong.plot().side < 600")
        assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
        assert page.evaluate(fits)
        plot = _plot(page)
        page.mouse.move(plot["x"] + plot["side"] * 0.5, plot["y"] + plot["side"] * 0.8)
        before = _readout(page)
        assert before["kind"] == "atlas"
        page.evaluate("window.attnvizLong.find('100')")  # the pointer stays on the map
        after = _readout(page)
        view = page.evaluate("window.attnvizLong.view()")
        assert view["y0"] <= int(after["q"]) < view["y0"] + view["span"]
        assert after["q"] != before["q"]
        page.mouse.move(1, 1)
        assert _readout(page) == {}
    finally:
        context.close()
    assert outside == [] and errors == []


def test_a_short_text_opens_at_its_exact_cells_with_values(browser: Any,
                                                           tmp_path: Path) -> None:
    """A 13-token capture's report carries its weights: the view opens on exact cells, each
    weight written in its cell and shown on hover equal to the capture's, future keys masked,
    the legend on the head's maximum, zoom down to 4 tokens, every head and the mean."""
    from attnviz.long import capture_long, load_long
    from attnviz.models.hf import HFSource
    from attnviz.render.long_html import write_long_report

    model = build_tiny_llama(tmp_path / "llama", positions=64)
    capture_long(HFSource(str(model), device="cpu"),
                 "the cat sat on the mat because it was warm.", folder=tmp_path / "cap").close()
    cap = load_long(tmp_path / "cap")
    T = cap.num_tokens
    assert 10 <= T <= 16
    path = write_long_report(cap, tmp_path / "short.html")
    context, page, outside, errors = _open_report(browser, path, width=1280, height=900,
                                                  level="exact")
    try:
        assert page.evaluate("window.attnvizLong.view()") == {"x0": 0, "y0": 0, "span": T}
        assert page.evaluate("window.attnvizLong.bounds()") == {"minSpan": 4, "maxSpan": T}
        plot = _plot(page)
        view = page.evaluate("window.attnvizLong.view()")
        for head in ("0", "3", "mean"):
            page.select_option("#long-head", head)
            wait_until(page, "document.getElementById('long-level').dataset.level === 'exact' "
                             "&& window.attnvizLong.scale().basis === 'head'")
            which = head if head == "mean" else int(head)
            weights = cap.tile(0, which, 0, T, 0, T)
            legend = page.evaluate("document.getElementById('long-legend').dataset.top")
            assert float(legend) == pytest.approx(float(weights.max()), rel=1e-6)
            for q, k in ((0, 0), (5, 2), (T - 1, 3), (4, 9)):
                page.mouse.move(plot["x"] + (k + 0.5) / T * plot["side"],
                                plot["y"] + (q + 0.5) / T * plot["side"])
                shown = _readout(page)
                assert (shown["kind"], int(shown["q"]), int(shown["k"])) == ("exact", q, k)
                assert float(shown["value"]) == pytest.approx(float(weights[q, k]), abs=1e-7)
                assert shown["masked"] == ("1" if k > q else "0")
                assert (_pixel(page, plot, view, q, k) == MASKED) == (k > q)
        # the weights are written in their cells (the canvas draws them; a cell's pixels
        # hold more than one colour where text is)
        page.select_option("#long-head", "0")
        cell = page.evaluate(
            "([x, y, s]) => { const d = document.getElementById('long-canvas').getContext('2d')"
            ".getImageData(x, y, s, s).data; const seen = new Set(); for (let i = 0; i < "
            "d.length; i += 4) seen.add(d[i] + ',' + d[i + 1] + ',' + d[i + 2]); "
            "return seen.size; }",
            [int(plot["left"] + 2), int(plot["top"] + 2 + plot["side"] / T * 5),
             int(plot["side"] / T) - 4])
        assert cell > 2
    finally:
        context.close()
    assert outside == [] and errors == []
