"""The live page's measure choice in a real headless Chromium, against a real server
subprocess (the fixtures of ``tests/test_serve_browser.py``); skipped only without Chromium."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tests.test_measure_cli import NORM_LABEL, reference
from tests.test_serve_browser import VIEW, _fragment, open_page, server  # noqa: F401 - fixtures

pytestmark = pytest.mark.slow

TEXT = "The cat sat on the mat"


def test_the_page_shows_the_measure_of_its_address(open_page: Any, minilm: Any) -> None:  # noqa: F811
    opened = open_page(_fragment(TEXT, model="minilm", measure="norm", layer=2, heads=3,
                                 view="heatmap"))
    opened.wait_for("window.attnvizLive.doc && window.attnvizLive.doc.meta.measure === 'norm'")
    assert opened.page.eval_on_selector("#measure", "e => e.value") == "norm"
    assert opened.live("doc.meta.measure_conventions.label") == NORM_LABEL
    expected = reference(minilm)
    shape = opened.live("doc.weights.shape")
    assert shape == list(expected.shape)
    assert opened.live("doc.weights.range") == pytest.approx(float(expected.max()), rel=1e-6) \
        if float(expected.max()) > 1.001 else opened.live("doc.weights.range") is None
    title = opened.page.locator(f"{VIEW} #hm-canvas").get_attribute("aria-label")
    assert title.startswith(f"minilm: {NORM_LABEL}, layer 2, head 3"), title
    # Back to attention weights from the menu: the next capture holds no measure.
    opened.page.select_option("#measure", "weights")
    opened.wait_for("window.attnvizLive.doc && !window.attnvizLive.doc.meta.measure")
    assert "measure=" not in opened.page.evaluate("location.hash")
    assert not np.isnan(expected).any()
    opened.assert_clean()


def test_hover_shows_the_measure_values_above_one(open_page: Any, minilm: Any) -> None:  # noqa: F811
    expected = reference(minilm)
    layer, head, query, _ = (int(i) for i in np.unravel_index(np.argmax(expected),
                                                               expected.shape))
    assert expected.max() > 1.5  # the values the report must not clip at 1
    opened = open_page(_fragment(TEXT, model="minilm", measure="norm", layer=layer, heads=head,
                                 view="head"))
    opened.wait_for("window.attnvizLive.doc && window.attnvizLive.doc.meta.measure === 'norm'")
    opened.page.locator(f"{VIEW} #hv-left .tok").nth(query).hover()
    opened.wait_for("document.querySelector('.report-view:not(.pending)').shadowRoot"
                    ".querySelector('#tooltip:not([hidden])') !== null")
    rows = opened.page.eval_on_selector_all(
        f"{VIEW} #tooltip tr.entry",
        "rows => rows.map(r => [Number(r.dataset.index), r.querySelector('.w').textContent])")
    row = expected[layer, head, query]
    order = np.argsort(-row, kind="stable")[:len(rows)]
    assert [index for index, _ in rows] == order.tolist()
    step = float(expected.max()) / 65535  # q16 over the block's range
    assert np.allclose([float(w) for _, w in rows], row[order], atol=step + 1e-4)
    assert float(rows[0][1]) > 1.5
    opened.assert_clean()
