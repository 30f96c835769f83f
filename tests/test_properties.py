"""Property-based tests: arbitrary Unicode text never crashes a capture and keeps its invariants."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnviz.errors import AttnvizError

TEXT = st.text(alphabet=st.characters(codec="utf-8"), min_size=0, max_size=60)
SETTINGS = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


def check_invariants(capture) -> None:
    T = capture.num_tokens
    assert capture.weights.shape[-2:] == (T, T)
    assert len(capture.display_tokens) == len(capture.word_ids) == len(capture.special) == T
    assert capture.weights.dtype == np.float32
    assert np.isfinite(capture.weights).all()
    np.testing.assert_allclose(capture.weights.sum(-1), 1.0, atol=1e-4)
    if capture.causal:
        assert (capture.weights[..., np.triu(np.ones((T, T), bool), 1)] == 0).all()


@pytest.fixture(scope="module")
def toy_sources():
    from attnviz.models.toy import ToyConfig, ToySource

    return (ToySource(ToyConfig(layers=2, heads=2), device="cpu"),
            ToySource(ToyConfig(layers=2, heads=4, d_model=16, causal=True), device="cpu"))


@SETTINGS
@given(text=TEXT)
def test_toy_any_text(toy_sources, text):
    for source in toy_sources:
        try:
            capture = source.capture(text)
        except AttnvizError as error:
            assert error.exit_code == 2 and "no words" in error.message
            continue
        check_invariants(capture)
        assert capture.causal == source.config.causal


@SETTINGS
@given(text=TEXT, pair=st.none() | TEXT)
def test_minilm_any_text(minilm, text, pair):
    try:
        capture = minilm.capture(text, pair)
    except AttnvizError as error:
        assert error.exit_code == 2
        assert "empty" in error.message or "besides special tokens" in error.message
        if "empty" in error.message:
            assert not text.strip() or (pair is not None and not pair.strip())
        return
    check_invariants(capture)
    assert capture.tokens[0] == "[CLS]" and capture.tokens[-1] == "[SEP]"
    assert not capture.causal
