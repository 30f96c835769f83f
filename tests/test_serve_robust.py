"""The live server and its ``--server`` client under stress: locks, bounds, deadlines, hostile
answers and a clean stop.

Every server here binds 127.0.0.1 only; fake servers answer a bounded number of requests and
every wait has a deadline.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest

import attnviz.models as models
from attnviz.models import ModelSpec
from attnviz.models.toy import ToyConfig, ToySource
from attnviz.session import Session

SENTENCE = "The cat sat on the mat"
BASE = "http://127.0.0.1:8000"


def _wait_for(condition: Any, seconds: float = 10) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


# --------------------------------------------------------------------------- session locks
class _Watched:
    """A loaded toy model that counts forward passes running on it at the same time."""

    def __init__(self, real: Any) -> None:
        self._real = real
        self.active = 0
        self.overlaps = 0
        self.holding = threading.Event()  # a "hold" capture is running
        self.release = threading.Event()  # ... until this is set
        self._count = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def capture(self, text: str, *args: Any, **kwargs: Any) -> Any:
        with self._count:
            self.active += 1
            self.overlaps += self.active > 1
        try:
            if text == "hold":
                self.holding.set()
                assert self.release.wait(10), "the test never released the capture"
            return self._real.capture(text, *args, **kwargs)
        finally:
            with self._count:
                self.active -= 1


def test_captures_take_the_current_lock_after_a_reload(monkeypatch: pytest.MonkeyPatch
                                                       ) -> None:
    """One thread evicts and reloads the model (max_models=1) between two passes of another
    thread's captures(): the second pass must wait for the reloaded model's lock."""
    loaded: list[_Watched] = []
    real = models.load_source

    def load(spec: Any = None) -> Any:
        loaded.append(_Watched(real(spec)))
        return loaded[-1]

    monkeypatch.setattr(models, "load_source", load)
    session = Session(use_cache=False, max_models=1)
    model = ModelSpec(name="toy", toy=ToyConfig(heads=2))
    other = ModelSpec(name="toy", toy=ToyConfig(heads=2, seed=1))
    passes = session.captures(["one two", "three four"], model=model, batch_size=1)
    first = next(passes)  # the first pass, on the first load of the model
    session.capture("evict it", model=other)  # max_models=1: the model is dropped
    box: dict[str, Any] = {}
    holder = threading.Thread(target=lambda: box.update(
        held=session.capture("hold", model=model)), daemon=True)
    holder.start()  # reloads the model and holds a forward pass on it
    _wait_for(lambda: len(loaded) == 3 and loaded[2].holding.is_set())
    threading.Timer(0.5, loaded[2].release.set).start()
    second = next(passes)  # must wait for the holder: same model object, its current lock
    holder.join(10)
    assert [w.overlaps for w in loaded] == [0, 0, 0]
    assert list(passes) == []
    reference = ToySource(ToyConfig(heads=2), device="cpu")
    for capture, text in ((first, "one two"), (second, "three four"), (box["held"], "hold")):
        np.testing.assert_array_equal(capture.weights, reference.capture(text).weights)


# --------------------------------------------------------------------------- server bounds
def test_induction_runners_are_bounded_like_the_models() -> None:
    """Each toy setting a request names has its own model and induction runner: the runners
    must not keep models the session has dropped (12 settings grew a server ~577 MB)."""
    import gc
    import weakref

    from starlette.testclient import TestClient

    from attnviz.server.app import create_app
    from attnviz.server.requests import ToyRequest

    app = create_app(["toy"])
    engine = app.state.engine
    client = TestClient(app, base_url=BASE)
    watched = []
    for seed in range(12):
        answer = client.post("/api/model", json={"model": "toy", "toy": {"seed": seed}})
        assert answer.status_code == 200, answer.text
        assert answer.json()["induction"]["vocab_size"] > 0
        spec = engine.spec("toy", ToyRequest(seed=seed))
        watched.append(weakref.ref(engine.session.source(spec)))
    limit = engine.session.max_models
    assert 1 <= len(engine._runners) <= limit < 12
    gc.collect()
    alive = [ref() is not None for ref in watched]
    assert sum(alive) <= limit and not any(alive[:12 - limit])  # the oldest are freed
    # A runner still answers for a model that was dropped and loaded again.
    scores = client.post("/api/induction", json={"model": "toy", "toy": {"seed": 0},
                                                 "ids": [1, 2, 3, 1, 2, 3]})
    assert scores.status_code == 200, scores.text
    assert len(engine._runners) <= limit


def test_a_capture_over_the_weights_limit_is_refused_before_the_forward_pass(
        patched_minilm: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from starlette.testclient import TestClient

    from attnviz.models.toy import ToyModel
    from attnviz.server.app import create_app
    from attnviz.server.engine import Limits

    forwards = {"minilm": 0, "toy": 0}
    toy_forward = ToyModel.forward

    def counted(self: Any, x: Any) -> Any:
        forwards["toy"] += 1
        return toy_forward(self, x)

    monkeypatch.setattr(ToyModel, "forward", counted)
    hook = patched_minilm.model.register_forward_pre_hook(
        lambda module, args: forwards.__setitem__("minilm", forwards["minilm"] + 1))
    try:
        client = TestClient(create_app(["minilm", "toy"], limits=Limits(max_weights=1000)),
                            base_url=BASE)
        # MiniLM: 6 layers x 12 heads x 8 x 8 tokens = 4,608 weights.
        refused = client.post("/api/capture", json={"text": SENTENCE})
        assert refused.status_code == 422, refused.text
        assert refused.json()["error"]["message"] == (
            "the capture of 8 tokens holds 4,608 weights (6 layers x 12 heads), more than "
            "this server sends (1,000)")
        words = " ".join(f"w{i}" for i in range(30))  # toy: 1 layer x 2 heads x 30 x 30
        toy = client.post("/api/capture", json={"text": words, "model": "toy"})
        assert toy.status_code == 422 and "1,800 weights" in toy.json()["error"]["message"]
        assert forwards == {"minilm": 0, "toy": 0}
        # What fits runs as before (the counters see forward passes).
        kept = client.post("/api/capture", json={"text": SENTENCE, "layers": "0-1",
                                                 "heads": [0, 5, 7], "weights": "float32"})
        assert kept.status_code == 200 and kept.json()["shape"] == [2, 3, 8, 8]
        small = client.post("/api/capture", json={"text": words, "model": "toy",
                                                  "max_tokens": 20})
        assert small.status_code == 200, small.text
        assert forwards == {"minilm": 1, "toy": 1}
    finally:
        hook.remove()
