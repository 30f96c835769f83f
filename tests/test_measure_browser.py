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
