"""Every trait a notebook's browser may set is checked against the capture in Python.

The messages are handed to the widgets as ipywidgets hands a front end's ``update`` messages
over (``Widget._handle_msg``). A selection outside the capture is refused as a whole: the
selection stays what Python holds and the browser is sent it back. Negative indices name the
layer or head they count to, as everywhere else.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import traitlets

from attnviz.capture import Capture
from attnviz.notebook import AttentionView

LAYERS, HEADS = 6, 12


@pytest.fixture(scope="module")
def capture() -> Capture:
    rng = np.random.default_rng(2)
    tokens = ["[CLS]", "the", "cat", "sat", "[SEP]"]
    weights = rng.dirichlet(np.ones(len(tokens)), size=(LAYERS, HEADS, len(tokens)))
    return Capture.from_attentions(weights.astype(np.float32), tokens, model="toy",
                                   text="the cat sat")


def _from_browser(view: Any, state: dict[str, Any]) -> None:
    view._handle_msg({"content": {"data": {"method": "update", "state": state,
                                           "buffer_paths": []}}, "buffers": []})


def _sent(view: Any, monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    sent: list[list[str]] = []
    original = view.send_state
    monkeypatch.setattr(view, "send_state",
                        lambda key=None: (sent.append(sorted(key or [])), original(key))[1])
    return sent


SELECTION = ("view", "layer", "heads", "words", "special", "scale", "gamma", "vmax")

REFUSED = [
    {"layer": 7}, {"layer": 6}, {"layer": -7}, {"layer": True}, {"layer": 2.5}, {"layer": "2"},
    {"layer": None}, {"heads": []}, {"heads": [12]}, {"heads": [-13]}, {"heads": [True]},
    {"heads": [1, 99]}, {"heads": 3}, {"view": "nope"}, {"view": None}, {"words": "yes"},
    {"special": None}, {"scale": "cubic"}, {"gamma": float("nan")}, {"gamma": 9},
    {"vmax": -1.0}, {"vmax": float("inf")}, {"vmax": "lots"},
    {"layer": 3, "heads": [40]},  # one bad value refuses the whole message
    {"layout": None}, {"tooltip": "x"}, {"_dom_classes": ["x"]}, {"_report": {}},
]


@pytest.mark.parametrize("state", REFUSED, ids=[str(s) for s in REFUSED])
def test_a_selection_outside_the_capture_is_refused(capture: Capture, state: dict[str, Any],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    view = AttentionView(capture, layer=2, heads=[2, 3])
    before = {key: getattr(view, key) for key in SELECTION}
    sent = _sent(view, monkeypatch)
    _from_browser(view, state)
    assert {key: getattr(view, key) for key in SELECTION} == before
    assert sent == [sorted(key for key in state if key in SELECTION)] or sent == [
        sorted(state)]  # the browser is told what Python holds


def test_negative_indices_name_the_layer_and_heads(capture: Capture) -> None:
    view = AttentionView(capture)
    _from_browser(view, {"layer": -3, "heads": [-1, 0, -12]})
    assert (view.layer, view.heads) == (3, [0, 11])
    view.layer, view.head = -1, -2
    assert (view.layer, view.heads, view.head) == (LAYERS - 1, [HEADS - 2], HEADS - 2)


@pytest.mark.parametrize(("name", "value"), [("layer", 7), ("layer", True), ("heads", []),
                                             ("heads", [False]), ("head", 12)])
def test_python_gets_the_same_refusals(capture: Capture, name: str, value: Any) -> None:
    view = AttentionView(capture, layer=1)
    with pytest.raises(traitlets.TraitError):
        setattr(view, name, value)
    assert (view.layer, view.heads) == (1, list(range(HEADS)))


def test_a_capture_of_some_layers_refuses_the_others(capture: Capture) -> None:
    part = Capture.from_attentions(capture.weights[[1, 4]], capture.tokens, model="toy",
                                   text="the cat sat", layers=[1, 4], num_layers=LAYERS)
    view = AttentionView(part)
    _from_browser(view, {"layer": 2})
    assert view.layer == 1
    _from_browser(view, {"layer": -2})
    assert view.layer == 4


def test_the_long_view_takes_no_state_from_the_browser(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from attnviz.long import load_long
    from attnviz.notebook_long import LongAttentionView
    from tests.long_fixtures import write_long

    rng = np.random.default_rng(0)
    q = rng.normal(size=(1, 2, 40, 8)).astype(np.float32)
    k = rng.normal(size=(1, 1, 40, 8)).astype(np.float32)
    view = LongAttentionView(load_long(write_long(tmp_path / "cap", q, k)))
    info = dict(view._info)
    sent = _sent(view, monkeypatch)
    for state in ({"_info": {"num_tokens": 7}}, {"_info": {}, "layout": None},
                  {"layer": 7}):
        _from_browser(view, state)
        assert view._info == info
    assert sent == [["_info"], ["_info", "layout"], []]
    # Its data requests are checked against the capture too.
    reply, _ = _ask(view, {"kind": "tile", "layer": 7, "head": 0, "q0": 0, "q1": 4, "k0": 0,
                           "k1": 4, "request": 1})
    assert "layer 7 is out of range" in reply["error"]
    reply, buffers = _ask(view, {"kind": "tile", "layer": -1, "head": -1, "q0": 0, "q1": 4,
                                 "k0": 0, "k1": 4, "request": 2})
    assert reply["shape"] == [4, 4] and len(buffers[0]) == 64


def _ask(view: Any, content: dict[str, Any]) -> tuple[dict[str, Any], list[Any]]:
    answers: list[tuple[dict[str, Any], list[Any]]] = []
    view.send = lambda msg, buffers=None: answers.append((msg, buffers or []))
    view._on_message(view, content, [])
    return answers[-1]
