"""The zoomable long-context view in a real headless Chromium, against ``attnviz serve``.

A 16,384-token capture of a tiny random-weight Llama is taken with the long path and saved;
``attnviz serve --long-from`` runs as a subprocess on 127.0.0.1 (always killed with its process
group). The test opens ``/long`` on the whole context, zooms with the mouse wheel down to an
exact token-level tile, hovers cells and checks the values the page shows against the
capture's own ``atlas`` and ``tile``. Every request beyond the server is aborted and recorded.
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
MARGIN_LEFT, MARGIN_TOP = 110, 86  # long.js: where the map starts on its canvas


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
        # the coarsest level that fits: 630 px for 16,384 tokens, 26 tokens a pixel: 32
        assert page.evaluate("document.getElementById('long-level').dataset.block") == "32"
        box = page.locator("#long-canvas").bounding_box()
        x, y = box["x"] + MARGIN_LEFT + 300.5, box["y"] + MARGIN_TOP + 420.5
        page.mouse.move(x, y)
        shown = _readout(page)
        assert shown["kind"] == "atlas" and shown["block"] == "32"
        row, col = int(shown["row"]), int(shown["col"])
        assert row > col  # below the diagonal: attention a causal model pays
        sums, maxes = cap.atlas(0, 0, 32)
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
        for dx, dy in ((-250.0, 250.0), (-100.0, 200.0), (0.0, 0.0), (150.0, -150.0)):
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
        page.mouse.move(x - 100, y + 200)
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


def test_the_offline_report_zooms_through_its_atlas_levels(browser: Any, tmp_path: Path
                                                           ) -> None:
    from attnviz.long import load_long
    from attnviz.render.long_html import write_long_report

    model = build_tiny_llama(tmp_path / "llama", positions=1024)
    cap = load_long(capture_tiny_llama(model, 1000, tmp_path / "capture"))
    path = write_long_report(cap, tmp_path / "report.html", max_cells=20_000)
    # 2 x 2 layers x 5 (4 heads and the mean) = 20 n^2 cells a level: 4^2, 8^2, 16^2 and
    # 32^2 (block 32) make 20 x 1,360 = 27,200 > 20,000, so the finest level kept is 64
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    outside: list[str] = []
    errors: list[str] = []
    watch(context, page, [path.resolve().as_uri()], outside, errors, requests=True)
    try:
        page.goto(path.resolve().as_uri())
        wait_until(page, "document.documentElement.dataset.longReady === '1'", timeout_s=60)
        wait_until(page, "document.getElementById('long-level').dataset.level === 'atlas'",
                   timeout_s=60)
        # 1,000 tokens on 630 px: the finest level at least a pixel is 64 (16 would be finer
        # than the report holds)
        assert page.evaluate("document.getElementById('long-level').dataset.block") == "64"
        for _ in range(4):
            page.click("#long-zoom-in")
        wait_until(page, "document.getElementById('long-level').dataset.level === 'atlas'",
                   timeout_s=60)
        assert page.evaluate("document.getElementById('long-level').dataset.block") == "64"
        box = page.locator("#long-canvas").bounding_box()
        page.mouse.move(box["x"] + MARGIN_LEFT + 200.5, box["y"] + MARGIN_TOP + 400.5)
        shown = _readout(page)
        assert shown["kind"] == "atlas" and shown["block"] == "64"
        sums, maxes = cap.atlas(0, 0, 64)
        row, col = int(shown["row"]), int(shown["col"])
        assert float(shown["sum"]) == pytest.approx(float(sums[row, col]), rel=1e-5, abs=1e-6)
        assert float(shown["max"]) == pytest.approx(float(maxes[row, col]), rel=1e-6,
                                                    abs=1e-7)
        texts = page.locator("#long-stats").inner_text()
        assert all(name in texts for name in cap.head_stats())
    finally:
        context.close()
    assert outside == [] and errors == []
