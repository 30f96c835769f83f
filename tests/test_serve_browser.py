"""``attnviz serve`` in a real headless Chromium, against a real server subprocess.

One server per module (MiniLM and the toy model, bound to 127.0.0.1 on a free port, always
killed with its process group). Every request that is not for that server is aborted and
recorded, and each test asserts there were none. Skipped only when no Chromium is installed
(``bash scripts/install_browser.sh``).
"""

from __future__ import annotations

import io
import signal
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote_plus

import numpy as np
import pytest

from attnviz.analysis.explain import explain_head
from attnviz.models.toy import ToyConfig
from tests._browser import hover_until, wait_until, watch
from tests._servers import ServeProcess

pytestmark = pytest.mark.slow

TOY_TEXT = "the robot picked up the red ball"
VIEW = ".report-view:not(.pending)"  # the mounted report (Playwright's CSS pierces its shadow)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    with ServeProcess("--model", "minilm", "--model", "toy", env={
            "ATTNVIZ_CACHE_DIR": str(tmp_path_factory.mktemp("serve-cache"))}) as served:
        yield served


@dataclass
class Opened:
    page: Any
    outside: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    dialogs: list[str] = field(default_factory=list)

    def assert_clean(self, allow_errors: bool = False) -> None:
        assert self.outside == [], "the page reached beyond the server"
        assert self.dialogs == []
        if not allow_errors:
            assert self.errors == []

    def live(self, expression: str) -> Any:
        return self.page.evaluate(f"window.attnvizLive.{expression}")

    def wait_updates(self, count: int, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while int(self.page.evaluate("document.documentElement.dataset.updates || 0")) < count:
            assert time.monotonic() < deadline, "the views did not update"
            self.page.wait_for_timeout(50)

    def wait_for(self, expression: str, timeout_s: float = 30) -> None:
        wait_until(self.page, expression, timeout_s=timeout_s)


@pytest.fixture
def open_page(browser: Any, server: ServeProcess) -> Iterator[Any]:
    contexts: list[Any] = []

    def opener(fragment: str = "", wait: bool = True) -> Opened:
        context = browser.new_context(viewport={"width": 1400, "height": 1000},
                                      accept_downloads=True)
        contexts.append(context)
        page = context.new_page()
        opened = Opened(page)
        watch(context, page, (server.url, "data:", "blob:"), opened.outside, opened.errors,
              dialogs=opened.dialogs)
        page.goto(server.url + fragment)
        if wait:
            opened.wait_updates(1, timeout_s=120)  # the first text loads MiniLM
        return opened

    yield opener
    for context in contexts:
        context.close()


def _fragment(text: str, **params: Any) -> str:
    return "#" + "&".join([f"text={quote_plus(text)}"] +
                          [f"{k}={quote_plus(str(v))}" for k, v in params.items()])


def _type(opened: Opened, text: str) -> None:
    before = int(opened.page.evaluate("document.documentElement.dataset.updates || 0"))
    opened.page.fill("#text", text)
    opened.wait_updates(before + 1)
    opened.wait_for(f"window.attnvizLive.doc.text === {text!r}")


# --------------------------------------------------------------------------- tests
def test_typing_updates_the_views_and_hover_equals_a_capture(open_page: Any,
                                                             minilm: Any) -> None:
    opened = open_page(_fragment("The cat sat on the mat", layer=5, heads=3, view="head"))
    assert opened.page.locator(f"{VIEW} #hv-left .tok").all_inner_texts()[:3] == [
        "[CLS]", "the", "cat"]
    text = "A robot picked up the red ball."
    _type(opened, text)
    direct = minilm.capture(text)
    labels = opened.page.locator(f"{VIEW} #hv-left .tok").all_inner_texts()
    assert labels == direct.display_tokens
    assert opened.live("selection.layer") == 5 and opened.live("selection.heads") == [3]
    # Hover the query "picked": the tooltip lists its top keys with the capture's weights.
    query = direct.display_tokens.index("picked")
    opened.page.locator(f"{VIEW} #hv-left .tok").nth(query).hover()
    opened.wait_for("document.querySelector('.report-view:not(.pending)').shadowRoot"
                    ".querySelector('#tooltip:not([hidden])') !== null")
    rows = opened.page.eval_on_selector_all(
        f"{VIEW} #tooltip tr.entry",
        "rows => rows.map(r => [Number(r.dataset.index), r.querySelector('.w').textContent])")
    row = direct.matrix(5, 3)[query]
    order = np.argsort(-row, kind="stable")[:5]
    assert [index for index, _ in rows] == order.tolist()
    assert np.allclose([float(w) for _, w in rows], row[order], atol=1e-4 + 1e-5)
    # The heatmap shows the same numbers under the mouse.
    opened.page.click(f"{VIEW} .tabs button[data-view='heatmap']")
    canvas = opened.page.locator(f"{VIEW} #hm-canvas")

    def centre() -> tuple[float, float]:
        x0, y0, cell = (float(canvas.get_attribute(f"data-{k}")) for k in ("x0", "y0", "cell"))
        box = canvas.bounding_box()
        return box["x"] + x0 + 2.5 * cell, box["y"] + y0 + (query + 0.5) * cell

    hover_until(opened.page, centre, lambda: opened.page.eval_on_selector(
        f"{VIEW} #tooltip", f"t => !t.hidden && t.dataset.query === '{query}' && "
                            "t.dataset.key === '2'"), timeout_s=30.0)
    shown = opened.page.eval_on_selector(f"{VIEW} #tooltip tr.entry .w", "e => e.textContent")
    assert abs(float(shown) - row[2]) <= 1e-4 + 1e-5
    opened.assert_clean()


def test_clicking_a_token_shows_its_row_and_top_k(open_page: Any, minilm: Any) -> None:
    text = "The bank approved the loan"
    opened = open_page(_fragment(text, layer=2, heads=7, view="head"))
    opened.page.locator(f"{VIEW} #hv-left .tok").nth(2).click()  # "bank"
    opened.wait_for("!document.getElementById('row-panel').hidden")
    row = minilm.capture(text).matrix(2, 7)[2]
    cells = opened.page.eval_on_selector_all(
        "#row-table tr.entry", "rows => rows.map(r => [Number(r.dataset.index), "
        "Number(r.querySelector('td.w:nth-child(3)').textContent)])")
    order = np.argsort(-row, kind="stable")[: len(cells)]
    assert [i for i, _ in cells] == order.tolist()
    assert np.allclose([w for _, w in cells], row[order], atol=6e-5)
    assert "query 2: bank" in opened.page.inner_text("#row-title")
    top = opened.page.eval_on_selector_all(
        "#topk-table tr.entry", "rows => rows.map(r => Array.from(r.querySelectorAll('td.key'))"
        ".map(td => Number(td.dataset.index)))")
    matrix = minilm.capture(text).matrix(2, 7)
    assert top == np.argsort(-matrix, axis=1, kind="stable")[:, :3].tolist()
    assert "query=2" in opened.page.evaluate("location.hash")
    opened.assert_clean()


def test_toy_step_by_step_with_scale_and_causal(open_page: Any) -> None:
    opened = open_page(_fragment(TOY_TEXT, model="toy", layer=0, heads=1, query=2,
                                 view="heatmap"))
    opened.wait_for("!document.getElementById('explain-panel').hidden")
    shown = opened.page.eval_on_selector_all("#explain-body td.weight",
                                             "cells => cells.map(c => Number(c.textContent))")
    expected = explain_head(TOY_TEXT, "2", 0, 1, ToyConfig()).weights
    assert np.allclose(shown, expected, atol=6e-5)
    assert "scores \u00d7 1/\u221a8" in opened.page.inner_text("#explain-title")
    for toggle, config in (("#toy-causal", ToyConfig(causal=True)),
                           ("#toy-scale", ToyConfig(causal=True, scale=False))):
        before = int(opened.page.evaluate("document.documentElement.dataset.updates"))
        opened.page.click(toggle)
        opened.wait_updates(before + 1)
        expected = explain_head(TOY_TEXT, "2", 0, 1, config).weights
        opened.wait_for("document.querySelectorAll('#explain-body td.weight').length > 0 && "
                        f"Math.abs(Number(document.querySelector('#explain-body "
                        f"tr[data-index=\"0\"] td.weight').textContent) - {expected[0]}) < 1e-4")
        shown = opened.page.eval_on_selector_all(
            "#explain-body td.weight", "cells => cells.map(c => Number(c.textContent))")
        assert np.allclose(shown, expected, atol=6e-5)
    masked = opened.page.locator("#explain-body tr.masked").count()
    assert masked == len(TOY_TEXT.split()) - 3  # keys after position 2 are masked
    assert opened.live("doc.causal") is True
    assert "toy_causal=1" in opened.page.evaluate("location.hash")
    assert "no scaling" in opened.page.inner_text("#explain-title")
    opened.assert_clean()


def test_hostile_tokens_run_nothing(open_page: Any) -> None:
    hostile = ('<img src=x onerror="window.__pwned=1"> </script><script>window.__pwned=2'
               '</script> <b onmouseover=alert(3)>bold</b>')
    opened = open_page(_fragment(hostile, layer=0, heads=0, view="head", query=2))
    for model in ("minilm", "toy"):
        if model == "toy":
            opened.page.select_option("#model", "toy")
            opened.wait_for("window.attnvizLive.doc.model === 'toy'")
        labels = opened.page.locator(f"{VIEW} #hv-left .tok").all_inner_texts()
        assert "<" in labels and any("script" in label for label in labels)
        for token in opened.page.locator(f"{VIEW} #hv-left .tok").all()[:12]:
            token.hover()
        opened.page.locator(f"{VIEW} #hv-left .tok").nth(1).click()
        opened.wait_for("!document.getElementById('row-panel').hidden")
    images = opened.page.evaluate(
        "document.querySelectorAll('img, script:not([src])').length + "
        "Array.from(document.querySelectorAll('.report-view')).reduce((n, v) => "
        "n + v.shadowRoot.querySelectorAll('img, script, b').length, 0)")
    assert images == 0
    assert opened.page.evaluate("window.__pwned") is None
    # A hostile model name in the link is shown as text too.
    other = open_page("#model=" + quote_plus('<img src=x onerror="alert(4)">') + "&text=hi")
    assert "not served here" in other.page.inner_text("#live-error")
    assert other.page.evaluate("document.querySelectorAll('img').length") == 0
    opened.assert_clean()
    other.assert_clean()


def test_the_link_reproduces_the_view(open_page: Any) -> None:
    opened = open_page(_fragment("Colourless green ideas sleep furiously", view="head"))
    page = opened.page
    page.fill("#pair", "They sleep")
    opened.wait_for("window.attnvizLive.doc.pair === 'They sleep'")
    page.click(f"{VIEW} .tabs button[data-view='heatmap']")
    page.select_option(f"{VIEW} #layer", "3")
    page.click(f"{VIEW} #heads .chip[data-head='4']", modifiers=["Shift"])
    page.click(f"{VIEW} #words")
    page.click(f"{VIEW} #special")
    opened.wait_for("window.attnvizLive.selection.special === false")
    link = page.evaluate("location.href")
    assert "text=" in link and "pair=They+sleep" in link and "layer=3" in link
    picture = page.eval_on_selector(f"{VIEW} #hm-canvas", "c => c.toDataURL()")
    again = open_page(link[link.index("#"):])
    assert again.page.input_value("#text") == "Colourless green ideas sleep furiously"
    assert again.page.input_value("#pair") == "They sleep"
    assert again.live("selection") == opened.live("selection")
    assert again.live("selection.heads") == [4] and again.live("selection.view") == "heatmap"
    assert again.page.eval_on_selector(f"{VIEW} #hm-canvas", "c => c.toDataURL()") == picture
    opened.assert_clean()
    again.assert_clean()


def test_downloads(open_page: Any, minilm: Any, tmp_path: Path) -> None:
    text = "Downloads hold the same numbers"
    opened = open_page(_fragment(text, layer=1, heads=6, view="heatmap"))
    page = opened.page
    with page.expect_download() as download:
        page.click("#download-zip")
    with zipfile.ZipFile(download.value.path()) as archive:
        assert sorted(archive.namelist()) == ["attention.npy", "capture.json"]
        weights = np.load(io.BytesIO(archive.read("attention.npy")))
    assert download.value.suggested_filename.endswith(".zip")
    np.testing.assert_allclose(weights, minilm.capture(text).weights, atol=1e-6)
    with page.expect_download() as download:
        page.click("#download-csv")
    lines = Path(download.value.path()).read_text(encoding="utf-8").splitlines()
    assert lines[0] == "query_index,query,rank,key_index,key,weight"
    matrix = minilm.capture(text).matrix(1, 6)
    for line in lines[1:]:
        query, _, rank, key, _, weight = line.split(",")
        assert int(key) == int(np.argsort(-matrix[int(query)], kind="stable")[int(rank) - 1])
        assert abs(float(weight) - matrix[int(query), int(key)]) < 2e-6
    with page.expect_download() as download:
        page.click(f"{VIEW} #save-png")
    from PIL import Image

    image = Image.open(download.value.path())
    assert image.format == "PNG" and image.size[0] > 200
    opened.assert_clean()


def test_server_going_away_is_a_clear_message_and_ctrl_c_stops_it(open_page: Any,
                                                                  server: ServeProcess) -> None:
    opened = open_page(_fragment("The server will stop now"))
    server.process.send_signal(signal.SIGINT)  # Ctrl-C
    assert server.process.wait(timeout=30) == 0
    deadline = time.monotonic() + 10
    while not any("Stopped." in line for line in server.output):
        assert time.monotonic() < deadline, "".join(server.output)
        time.sleep(0.05)
    assert "Traceback" not in "".join(server.output)
    opened.page.fill("#text", "Is anyone there?")
    # A request still in flight at Ctrl-C may first show "the server is stopping" (also
    # clear); the new text's request then finds nobody there.
    opened.wait_for("(e => !e.hidden && e.textContent.includes('is not answering'))"
                    "(document.getElementById('live-error'))")
    message = opened.page.inner_text("#live-error")
    assert "is not answering" in message and "attnviz serve" in message
    opened.assert_clean(allow_errors=True)  # the browser logs the refused connection
