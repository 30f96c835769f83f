"""The live page's Generate panel in headless Chromium, against a real ``attnviz serve``.

The server serves a tiny random Llama (a causal language model) built in ``tmp_path``; the
panel's rows, filled line by line from ``/api/generate``, equal ``Session.generate``'s top-k.
Skipped only when no Chromium is installed.
"""

from __future__ import annotations

import re
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
                         max_position_embeddings=128, bos_token_id=101, eos_token_id=None)
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
