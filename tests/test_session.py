"""The library session: warm models (a small LRU), the capture cache, thread-safe captures."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import attnviz
import attnviz.models as models
import attnviz.session as session_module
from attnviz.capture import Capture
from attnviz.errors import UsageError
from attnviz.models import ModelSpec
from attnviz.models.toy import ToyConfig
from attnviz.session import Session, default_session

TEXTS = ["The cat sat on the mat.", "A dog barked at the moon.",
         "Tokenization of unbelievable sentences is surprisingly tricky.",
         "The bank of the river was muddy after the rain."]


class Spy:
    """A loaded model that counts the texts it runs (independently of the session's counter)."""

    def __init__(self, source: Any) -> None:
        self._source = source
        self.name = source.name
        self.num_layers = source.num_layers
        self.num_heads = source.num_heads
        self.runs: list[str] = []

    def capture(self, text: str, pair: str | None = None, **options: Any) -> Capture:
        self.runs.append(text)
        return self._source.capture(text, pair, **options)

    def identity(self) -> dict[str, object]:
        return self._source.identity()


@pytest.fixture
def loads(monkeypatch: pytest.MonkeyPatch, minilm) -> list[tuple[str, Spy]]:
    """Count every model load; MiniLM comes from the test session's copy (no second load)."""
    real = models.load_source
    loaded: list[tuple[str, Spy]] = []

    def load(spec: ModelSpec | str | None = None) -> Any:
        name = spec if isinstance(spec, str) else getattr(spec, "name", "minilm")
        spy = Spy(minilm if name == "minilm" else real(spec))
        time.sleep(0.05)  # a real load takes seconds: widen the window for racing threads
        loaded.append((str(name), spy))
        return spy

    monkeypatch.setattr(models, "load_source", load)
    return loaded


@pytest.fixture
def fresh_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """capture_text's process-wide session starts empty in each test."""
    monkeypatch.setattr(session_module, "_DEFAULT", None)


def toy(seed: int) -> ModelSpec:
    return ModelSpec(name="toy", toy=ToyConfig(d_model=16, heads=2, layers=2, seed=seed))


def test_capture_text_loads_once_and_the_cache_skips_the_model(loads, fresh_default,
                                                               minilm) -> None:
    first = attnviz.capture_text(TEXTS[0])
    second = attnviz.capture_text(TEXTS[1])  # a new text: warm model, no second load
    session = default_session()
    assert len(loads) == 1 and session.loads == 1
    spy = loads[0][1]
    assert spy.runs == TEXTS[:2] and session.forwards == 2
    # The results are the model's own.
    np.testing.assert_allclose(second.weights, minilm.capture(TEXTS[1]).weights, atol=1e-6)
    assert second.tokens == minilm.capture(TEXTS[1]).tokens

    again = attnviz.capture_text(TEXTS[0])  # cached: the model does not run
    assert spy.runs == TEXTS[:2] and session.forwards == 2 and session.loads == 1
    np.testing.assert_array_equal(again.weights, first.weights)
    assert again.tokens == first.tokens
    # A selection of a new text is a new forward pass on the same warm model.
    part = attnviz.capture_text(TEXTS[2], layers="1,3", heads=[0, 5])
    assert (part.layers, part.heads) == ([1, 3], [0, 5])
    np.testing.assert_allclose(part.weights,
                               minilm.capture(TEXTS[2]).select([1, 3], [0, 5]).weights,
                               atol=1e-6)
    assert session.loads == 1 and session.forwards == 3 and spy.runs[-1] == TEXTS[2]


def test_without_the_cache_every_text_runs_once_per_call(loads) -> None:
    session = Session(use_cache=False)
    for _ in range(2):
        session.capture(TEXTS[0])
    assert session.loads == 1 and session.forwards == 2
    assert loads[0][1].runs == [TEXTS[0], TEXTS[0]]


def test_least_recently_used_model_is_dropped(loads) -> None:
    session = Session(use_cache=False, max_models=2)
    a, b, c = toy(1), toy(2), toy(3)
    reference = session.capture(TEXTS[0], model=a).weights
    session.capture(TEXTS[0], model=b)
    session.capture(TEXTS[1], model=a)  # a is now the most recent
    assert session.loads == 2
    session.capture(TEXTS[0], model=c)  # over max_models: b goes, a stays
    assert session.loads == 3
    assert session.is_loaded(a) and session.is_loaded(c) and not session.is_loaded(b)
    assert [name for name, _ in loads] == ["toy"] * 3
    again = session.capture(TEXTS[0], model=a)  # still warm
    assert session.loads == 3
    np.testing.assert_array_equal(again.weights, reference)
    session.capture(TEXTS[0], model=b)  # dropped before: loaded again, and c goes
    assert session.loads == 4 and not session.is_loaded(c)
    session.forget()
    assert not session.is_loaded(a) and not session.is_loaded(b)
    with pytest.raises(UsageError, match="max_models"):
        Session(max_models=0)


def _run_together(jobs: list[Callable[[], Any]]) -> list[Any]:
    """Run the jobs on one thread each, released at the same moment; re-raise any error."""
    barrier = threading.Barrier(len(jobs))
    results: list[Any] = [None] * len(jobs)
    errors: list[BaseException] = []

    def work(i: int) -> None:
        barrier.wait()
        try:
            results[i] = jobs[i]()
        except BaseException as error:  # noqa: BLE001 - handed to the main thread
            errors.append(error)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(jobs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads)
    if errors:
        raise errors[0]
    return results


def test_two_threads_share_one_session(loads, minilm) -> None:
    session = Session(use_cache=False)
    rounds = 3

    def job(texts: list[str]) -> Callable[[], list[Capture]]:
        return lambda: [session.capture(text) for _ in range(rounds) for text in texts]

    first, second = _run_together([job(TEXTS[:2]), job(TEXTS[2:])])
    assert session.loads == 1  # both threads asked for the cold model at once: one load
    assert session.forwards == 4 * rounds
    for texts, captures in ((TEXTS[:2], first), (TEXTS[2:], second)):
        for i, capture in enumerate(captures):
            text = texts[i % 2]
            expected = minilm.capture(text)
            assert capture.text == text and capture.tokens == expected.tokens
            np.testing.assert_allclose(capture.weights, expected.weights, atol=1e-6)


def test_two_threads_on_two_models_and_the_cache(loads, minilm) -> None:
    session = Session()
    toy_spec = toy(5)
    toy_reference = models.load_source(toy_spec).capture(TEXTS[3])
    loads.clear()

    def on_minilm() -> list[Capture]:
        return [session.capture(text) for text in TEXTS * 2]

    def on_toy() -> list[Capture]:
        return [session.capture(TEXTS[3], model=toy_spec) for _ in range(4)]

    bert_caps, toy_caps = _run_together([on_minilm, on_toy])
    assert sorted(name for name, _ in loads) == ["minilm", "toy"]
    runs = {name: spy.runs for name, spy in loads}
    assert runs["minilm"] == TEXTS  # the second round came from the cache
    assert runs["toy"] == [TEXTS[3]]
    for capture, text in zip(bert_caps, TEXTS * 2):
        np.testing.assert_allclose(capture.weights, minilm.capture(text).weights, atol=1e-6)
    for capture in toy_caps:
        np.testing.assert_allclose(capture.weights, toy_reference.weights, atol=1e-6)


def test_readme_session_example_runs_as_written(tmp_path: Any, monkeypatch: pytest.MonkeyPatch
                                                ) -> None:
    """README's own-session snippet, executed verbatim (with a private cache folder)."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    readme = (Path(__file__).parents[1] / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
    snippet = next(b for b in blocks if "attnviz.Session(" in b)
    assert attnviz.Session is Session and "Session" in dir(attnviz)
    monkeypatch.setenv("ATTNVIZ_CACHE_DIR", str(tmp_path / "cache"))
    namespace: dict[str, Any] = {"attnviz": attnviz}
    exec(compile(snippet, "README.md", "exec"), namespace)
    assert namespace["cap"].weights.shape == (1, 2, 3, 3)  # toy, layer 0: 3 tokens
    caps = namespace["caps"]
    assert [c.text for c in caps] == ["The cat sat", "A dog barked"]
    assert caps[0].weights.shape[:2] == (6, 12)  # the bundled MiniLM
    np.testing.assert_allclose(caps[0].weights.sum(-1), 1, atol=1e-5)
    # Reaching attnviz.Session does not import torch (the session loads it on first capture).
    code = "import sys, attnviz; attnviz.Session; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == "False"
