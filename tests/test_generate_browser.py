"""The live page's Generate panel in headless Chromium, against a real ``attnviz serve``.

The server serves a tiny random Llama (a causal language model) built in ``tmp_path``; the
panel's rows, filled line by line from ``/api/generate``, equal ``Session.generate``'s top-k.
Its button turns into Stop while a generation runs; stopping ends the generation and frees the
model at once. Skipped only when no Chromium is installed.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote_plus

import pytest

from attnviz.session import Session
from tests._browser import wait_until, watch
from tests._servers import ServeProcess
from tests.test_generate import PROMPT, _save

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=30522, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, bos_token_id=101, eos_token_id=None)
    return _save(LlamaForCausalLM, config, tmp_path_factory.mktemp("served") / "llama")


@pytest.fixture(scope="module")
def server_url(llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with ServeProcess("--model", str(llama), "--device", "cpu", env={
            "ATTNVIZ_CACHE_DIR": str(tmp_path_factory.mktemp("serve-cache")),
            "PYTHONPATH": str(Path(__file__).resolve().parents[1])}) as served:
        yield served.url


def test_generate_panel_streams_rows(browser: Any, server_url: str, llama: Path) -> None:
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    outside: list[str] = []
    errors: list[str] = []
    watch(context, page, (server_url, "data:", "blob:"), outside, errors)
    try:
        page.goto(server_url + "#text=" + quote_plus(PROMPT))
        wait_until(page, "Number(document.documentElement.dataset.updates || 0) >= 1")
        page.fill("#new-tokens", "5")
        page.click("#generate")
        wait_until(page, "document.getElementById('generate-panel').dataset.done === '5'")
        title = page.inner_text("#generate-title")
        match = re.fullmatch(r"layer (-?\d+), (?:head (\d+)|mean of the heads), top (\d+)", title)
        assert match, title
        layer, head, k = int(match[1]), match[2], int(match[3])
        rows = page.eval_on_selector_all(
            "#generate-table tr", "rows => rows.map(r => [r.cells[0].textContent, "
            "r.cells[1].textContent, [...r.cells[2].querySelectorAll('.key')].map(s => "
            "s.textContent)])")
        reference = Session(use_cache=False).generate(PROMPT, model=str(llama),
                                                      max_new_tokens=5, device="cpu")
        expected = reference.top_k(layer, int(head) if head else "mean", k)
        assert len(rows) == 5
        for cells, row in zip(rows, expected):
            assert int(cells[0]) == row["position"] and cells[1] == row["token"]
            assert cells[2] == [f"{t['key_index']}:{t['key']} {t['weight']:.3f}"
                                for t in row["top"]]
        assert page.inner_text("#generate-text") == reference.text
        assert outside == [] and errors == []
    finally:
        context.close()


def test_stop_ends_the_generation_and_frees_the_server(browser: Any, server_url: str) -> None:
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    outside: list[str] = []
    errors: list[str] = []
    watch(context, page, (server_url, "data:", "blob:"), outside, errors)
    rows = "document.querySelectorAll('#generate-table tr').length"
    try:
        page.goto(server_url + "#text=" + quote_plus(PROMPT))
        wait_until(page, "Number(document.documentElement.dataset.updates || 0) >= 1")
        page.fill("#new-tokens", "480")
        page.click("#generate")
        wait_until(page, f"{rows} >= 2")
        assert page.inner_text("#generate") == "Stop"
        assert page.get_attribute("#generate-panel", "data-running") == "1"
        page.click("#generate")
        assert page.inner_text("#generate") == "Generate"
        assert page.get_attribute("#generate-panel", "data-stopped") == "1"
        # the server sees the request go and ends the generation at the next token: its
        # queue is empty at once, long before 480 tokens could have been made
        stopped = time.monotonic()
        wait_until(page, "fetch('/api/health').then((r) => r.json()).then((h) => "
                         "h.pending === 0)", timeout_s=10)
        assert time.monotonic() - stopped < 5
        kept = page.evaluate(rows)
        assert 2 <= kept < 480
        page.wait_for_timeout(300)
        assert page.evaluate(rows) == kept  # no row after Stop
        assert page.get_attribute("#generate-panel", "data-done") is None
        # a second request is answered promptly: the model is free
        page.fill("#new-tokens", "3")
        started = time.monotonic()
        page.click("#generate")
        wait_until(page, "document.getElementById('generate-panel').dataset.done === '3'",
                   timeout_s=20)
        assert time.monotonic() - started < 10
        assert page.inner_text("#generate") == "Generate"
        assert outside == [] and errors == []
    finally:
        context.close()
