"""The HTML report in a real headless Chromium (Debian's ``chromium``, driven by Playwright).

The network is blocked for every page: each request that is not for the report file itself is
aborted and recorded, and every test asserts that there were none. Skipped only when no
Chromium binary is installed (``bash scripts/install_browser.sh`` installs it).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from attnviz.analysis.tokens import exclude_special, merge_words
from attnviz.analysis.topk import top_k
from attnviz.capture import Capture
from attnviz.render.html import write_report
from tests._browser import hover_until, wait_until, watch

pytestmark = pytest.mark.slow

WORDY = "Tokenization of unbelievable sentences is surprisingly tricky."


@dataclass
class Opened:
    """A report open in a fresh browser context, with everything that went wrong recorded."""

    page: Any
    outside_requests: list[str] = field(default_factory=list)
    console_errors: list[str] = field(default_factory=list)
    dialogs: list[str] = field(default_factory=list)
    wall_s: float = 0.0

    def assert_clean(self) -> None:
        assert self.outside_requests == [], "the report tried to reach the network"
        assert self.console_errors == []
        assert self.dialogs == []

    def hash_params(self) -> dict[str, str]:
        fragment = self.page.evaluate("location.hash").lstrip("#")
        return dict(part.split("=", 1) for part in fragment.split("&") if "=" in part)

    def tooltip_rows(self) -> list[tuple[int, str, str]]:
        return self.page.eval_on_selector_all(
            "#tooltip tr.entry",
            "rows => rows.map(r => [Number(r.dataset.index), "
            "r.querySelector('.tok').textContent, r.querySelector('.w').textContent])")


@pytest.fixture
def open_report(browser: Any) -> Iterator[Any]:
    contexts: list[Any] = []

    def opener(path: Path, fragment: str = "", width: int = 1280, height: int = 900) -> Opened:
        context = browser.new_context(viewport={"width": width, "height": height},
                                      accept_downloads=True)
        contexts.append(context)
        page = context.new_page()
        opened = Opened(page=page)
        watch(context, page, ("file:", "data:", "blob:"), opened.outside_requests,
              opened.console_errors, requests=True, dialogs=opened.dialogs)
        start = time.perf_counter()
        page.goto(path.resolve().as_uri() + fragment)
        page.wait_for_selector("html[data-ready='1']", timeout=30_000)
        opened.wall_s = time.perf_counter() - start
        return opened

    yield opener
    for context in contexts:
        context.close()


@pytest.fixture(scope="module")
def wordy_capture(minilm) -> Capture:
    return minilm.capture(WORDY)


def _png(path: str | Path) -> Any:
    from PIL import Image

    image = Image.open(path)
    image.load()
    assert image.format == "PNG"
    return image


def _save_png(opened: Opened) -> Any:
    with opened.page.expect_download() as download:
        opened.page.click("#save-png")
    return _png(download.value.path()), download.value.suggested_filename


def _wait_for(opened: Opened, expression: str, timeout_s: float = 10.0) -> None:
    wait_until(opened.page, expression, timeout_s=timeout_s)


def _hover_cell(opened: Opened, row: int, col: int) -> None:
    """Hover the heatmap's cell (row, col) until the tooltip shows that cell."""

    def centre() -> tuple[float, float]:
        box = opened.page.locator("#hm-canvas").bounding_box()
        x0, y0, cell = opened.page.eval_on_selector(
            "#hm-canvas",
            "c => [Number(c.dataset.x0), Number(c.dataset.y0), Number(c.dataset.cell)]")
        return box["x"] + x0 + (col + 0.5) * cell, box["y"] + y0 + (row + 0.5) * cell

    hover_until(opened.page, centre, lambda: opened.page.evaluate(
        f"(() => {{ const t = document.getElementById('tooltip'); return !t.hidden && "
        f"t.dataset.query === '{row}' && t.dataset.key === '{col}'; }})()"),
        timeout_s=10.0, what=f"the tooltip of query {row}, key {col}")


# --------------------------------------------------------------------------- tests
def test_report_works_offline_in_every_view(open_report, wordy_capture, tmp_path: Path) -> None:
    path = write_report([wordy_capture], tmp_path / "report.html")
    opened = open_report(path)
    page = opened.page
    assert page.text_content("#doc-info .text") == WORDY
    tokens = page.eval_on_selector_all("#hv-left .tok", "ts => ts.map(t => t.textContent)")
    assert tokens == wordy_capture.display_tokens
    image, name = _save_png(opened)
    assert name.endswith(".png") and image.width > 300 and image.height > 200
    for view in ("model", "heatmap", "stats"):
        page.click(f".tabs button[data-view={view}]")
        assert opened.hash_params()["view"] == view
        assert page.is_visible(f"#view-{view}")
    assert page.locator("#stats-table tbody tr").count() in (0, 6 * 12)
    for view in ("model", "heatmap"):
        page.click(f".tabs button[data-view={view}]")
        image, name = _save_png(opened)
        assert view in name
        pixels = np.asarray(image.convert("RGB"))
        assert pixels.std() > 10  # drawn, not blank
    page.click("#words")
    page.click("#special")
    page.select_option("#scale", "log")
    page.click(".tabs button[data-view=head]")
    assert page.locator("#hv-left .tok").count() == len(
        exclude_special(merge_words(wordy_capture)).tokens)
    page.hover("#hv-left .tok[data-i='1']")
    assert page.is_visible("#tooltip")
    opened.assert_clean()


@pytest.mark.parametrize("bits", [16, 8])
def test_hovered_token_shows_the_capture_weights(open_report, wordy_capture, tmp_path: Path,
                                                 bits: int) -> None:
    layer, head, query = 2, 5, 3
    path = write_report([wordy_capture], tmp_path / "r.html", precision=bits, top_k=4)
    opened = open_report(path, f"#view=head&layer={layer}&heads={head}")
    opened.page.hover(f"#hv-left .tok[data-i='{query}']")
    rows = opened.tooltip_rows()
    matrix = wordy_capture.matrix(layer, head)
    expected = top_k(matrix, 4)[query]
    step = 1 / ((1 << bits) - 1)
    tolerance = step / 2 + (0.5e-4 if bits == 16 else 0.5e-3) + 1e-6  # storage + display
    assert len(rows) == 4
    for (index, label, weight), true_weight in zip(rows, expected.weights):
        assert label == wordy_capture.display_tokens[index]
        assert abs(float(weight) - matrix[query, index]) <= tolerance
        assert abs(float(weight) - true_weight) <= tolerance  # the right keys, strongest first
    if bits == 16:
        assert [row[0] for row in rows] == expected.keys
    # A key token lists the queries that attend to it most.
    opened.page.hover("#hv-right .tok[data-i='0']")
    rows = opened.tooltip_rows()
    column = matrix[:, 0]
    for index, _, weight in rows:
        assert abs(float(weight) - column[index]) <= tolerance
    assert abs(float(rows[0][2]) - column.max()) <= tolerance
    opened.assert_clean()


def test_word_special_and_mean_views_match_the_library(open_report, wordy_capture,
                                                       tmp_path: Path) -> None:
    layer = 1
    path = write_report([wordy_capture], tmp_path / "r.html", precision=16)
    view = exclude_special(merge_words(wordy_capture))
    assert len(view.tokens) < len(wordy_capture.tokens) - 2  # words were merged
    words = merge_words(wordy_capture)
    opened = open_report(path, f"#view=head&layer={layer}&heads=4&words=1&special=1")
    opened.page.hover("#hv-left .tok[data-i='1']")
    rows = opened.tooltip_rows()
    assert "query 1: tokenization" in opened.page.text_content("#tooltip .tt-title")
    for index, _, weight in rows:
        assert abs(float(weight) - words.matrix(layer, 4)[1, index]) <= 1e-4
    opened.page.evaluate(f"location.hash = '#view=head&layer={layer}&heads=4&words=1&special=0'")
    _wait_for(opened, "!document.getElementById('special').checked")
    labels = opened.page.eval_on_selector_all("#hv-left .tok", "ts => ts.map(t => t.textContent)")
    assert labels == view.display_tokens
    opened.page.hover("#hv-left .tok[data-i='1']")
    matrix = view.matrix(layer, 4)
    for index, _, weight in opened.tooltip_rows():
        assert abs(float(weight) - matrix[1, index]) <= 1e-4
    # Heatmap of the mean of two heads, read by hovering cells.
    fragment = f"#view=heatmap&layer={layer}&heads=3,7&words=1&special=0"
    opened.page.evaluate(f"location.hash = '{fragment}'")
    _wait_for(opened, "document.getElementById('view-heatmap').hidden === false")
    mean = (view.matrix(layer, 3) + view.matrix(layer, 7)) / 2
    for row, col in [(0, 0), (2, 1), (len(view.tokens) - 1, 3)]:
        _hover_cell(opened, row, col)
        tip = opened.page.locator("#tooltip")
        assert tip.get_attribute("data-query") == str(row)
        assert tip.get_attribute("data-key") == str(col)
        assert abs(float(opened.tooltip_rows()[0][2]) - mean[row, col]) <= 1e-4
    opened.assert_clean()


def test_model_view_click_selects_layer_and_head(open_report, wordy_capture,
                                                 tmp_path: Path) -> None:
    path = write_report([wordy_capture], tmp_path / "r.html")
    opened = open_report(path, "#view=model")
    page = opened.page
    assert page.locator("#mv-grid canvas").count() == 6 * 12
    page.click("#mv-grid canvas[data-layer='3'][data-head='7']")
    params = opened.hash_params()
    assert (params["view"], params["layer"], params["heads"]) == ("heatmap", "3", "7")
    assert page.input_value("#layer") == "3"
    pressed = page.eval_on_selector_all(
        "#heads .chip", "cs => cs.filter(c => c.getAttribute('aria-pressed') === 'true')"
                        ".map(c => c.textContent)")
    assert pressed == ["7"]
    assert "layer 3, head 7" in (page.get_attribute("#hm-canvas", "aria-label") or "")
    # Opened large: one head, token labels and a value on hover.
    _hover_cell(opened, 1, 2)
    value = float(opened.tooltip_rows()[0][2])
    assert abs(value - wordy_capture.matrix(3, 7)[1, 2]) <= 0.5 / 255 + 0.5e-3
    page.click(".tabs button[data-view=model]")
    selected = page.eval_on_selector_all(
        "#mv-grid canvas.selected", "cs => cs.map(c => [c.dataset.layer, c.dataset.head])")
    assert selected == [["3", "7"]]
    opened.assert_clean()


def test_keyboard_and_address_keep_the_selection(open_report, wordy_capture,
                                                 tmp_path: Path) -> None:
    path = write_report([wordy_capture], tmp_path / "r.html")
    opened = open_report(path)
    page = opened.page
    page.click("#title")  # focus the page, not a control
    for key in ("ArrowDown", "ArrowDown", "ArrowRight", "ArrowRight", "ArrowUp"):
        page.keyboard.press(key)
    params = opened.hash_params()
    assert (params["layer"], params["heads"]) == ("1", "1")
    page.keyboard.press("ArrowLeft")
    page.click(".tabs button[data-view=heatmap]")
    page.click("#words")
    address = page.url
    assert "layer=1" in address and "heads=0" in address and "words=1" in address
    reopened = open_report(path, "#" + address.split("#", 1)[1])
    again = reopened.page
    assert again.input_value("#layer") == "1"
    assert again.is_visible("#view-heatmap") and again.is_checked("#words")
    assert "layer 1, head 0 (word level" in (again.get_attribute("#hm-canvas", "aria-label") or "")
    opened.assert_clean()
    reopened.assert_clean()


HOSTILE_TOKENS = [
    "[CLS]",
    '<img src=x onerror="window.__pwned=1;alert(1)">',
    "</script><script>window.__pwned=2;alert(2)</script>",
    "<svg onload=alert(3)>",
    "\"'><iframe src=javascript:alert(4)>",
    "&lt;b&gt;",
    "[SEP]",
]


def test_hostile_tokens_run_no_script(open_report, tmp_path: Path) -> None:
    count = len(HOSTILE_TOKENS)
    rng = np.random.default_rng(0)
    weights = rng.random((2, 2, count, count)).astype(np.float32)
    weights /= weights.sum(-1, keepdims=True)
    text = " ".join(HOSTILE_TOKENS[1:-1])
    capture = Capture(tokens=HOSTILE_TOKENS, word_ids=[None, 0, 1, 2, 3, 4, None],
                      special=[True, False, False, False, False, False, True], weights=weights,
                      layers=[0, 1], heads=[0, 1], num_layers=2, num_heads=2,
                      model="<img src=x onerror=alert(5)>", causal=False, text=text,
                      pair="</script><script>alert(6)</script>")
    path = write_report([capture, capture], tmp_path / "hostile.html",
                        title="</title><script>alert(7)</script>")
    opened = open_report(path)
    page = opened.page
    for view in ("head", "model", "heatmap"):
        page.click(f".tabs button[data-view={view}]")
    page.click(".tabs button[data-view=head]")
    page.hover("#hv-left .tok[data-i='1']")
    page.hover("#hv-right .tok[data-i='2']")
    page.select_option("#doc", "1")
    _wait_for(opened, "location.hash.includes('doc=1')")
    assert page.evaluate("window.__pwned") is None
    assert page.evaluate(
        "document.querySelectorAll('img, svg, iframe, object, embed').length") == 0
    assert page.evaluate("document.scripts.length") == 2
    shown = page.eval_on_selector_all("#hv-left .tok", "ts => ts.map(t => t.textContent)")
    assert shown == capture.display_tokens  # shown as text, character for character
    assert page.title() == "</title><script>alert(7)</script>"
    assert page.text_content("#doc-info .text") == f"{text}  |  {capture.pair}"
    page.hover("#hv-left .tok[data-i='1']")
    assert HOSTILE_TOKENS[1] in page.text_content("#tooltip")
    opened.assert_clean()


def test_512_token_report_loads_and_is_drawn(open_report, minilm, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    words = ("attention maps show where each token looks when the model reads a long "
             "paragraph about unbelievable tokenization").split()
    text = " ".join(words[i % len(words)] for i in range(700))
    capture = minilm.capture(text, max_tokens=512)
    assert capture.num_tokens == 512
    start = time.perf_counter()
    path = write_report([capture], tmp_path / "long.html")
    write_s = time.perf_counter() - start
    opened = open_report(path)
    load_ms = opened.page.evaluate("window.attnvizReport.loadMs")
    shot = tmp_path / "long.png"
    opened.page.screenshot(path=str(shot))
    image = _png(shot)
    assert (image.width, image.height) == (1280, 900)
    assert opened.page.locator("#hv-left .tok").count() == 512
    opened.page.click(".tabs button[data-view=model]")
    assert opened.page.locator("#mv-grid canvas").count() == 72
    opened.page.click("#mv-grid canvas[data-layer='5'][data-head='11']")
    assert opened.hash_params()["layer"] == "5"
    size_mb = path.stat().st_size / 1e6
    with capsys.disabled():
        print(f"\n512-token MiniLM report (6x12 heads, 8-bit): {size_mb:.2f} MB, written in "
              f"{write_s:.2f} s, first view painted {load_ms / 1000:.2f} s after navigation "
              f"(wall {opened.wall_s:.2f} s; target < 2 s)")
    assert load_ms < 30_000
    opened.assert_clean()
