"""One request, one call: :class:`attnviz.request.CaptureRequest` and the session methods that
answer it (``run``, ``run_each``, ``write``, ``run_texts``), local and over ``--server``."""

from __future__ import annotations

import io
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from attnviz.capture import load_capture
from attnviz.errors import InputError, UsageError
from attnviz.models import ModelSpec
from attnviz.models.toy import ToyConfig, ToySource, trace_head
from attnviz.request import CaptureRequest
from attnviz.session import Session
from tests._servers import thread_server

TEXT = "The cat sat on the mat"
CONFIG = ToyConfig(d_model=16, heads=2, layers=3, seed=5)
TOY = ModelSpec(name="toy", toy=CONFIG)


def _stdin(monkeypatch: pytest.MonkeyPatch, data: bytes) -> None:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data), encoding="utf-8"))


# --------------------------------------------------------------------------- the request
def test_a_request_takes_one_input() -> None:
    with pytest.raises(UsageError, match="one input, not text and from_path"):
        CaptureRequest(text=TEXT, from_path=Path("cap"))
    with pytest.raises(UsageError, match="one input, not text and stdin"):
        CaptureRequest(text=TEXT, stdin=True)
    with pytest.raises(UsageError, match="pair cannot be given with from_path"):
        CaptureRequest(from_path=Path("cap"), pair="A dog")
    assert not CaptureRequest(model="toy").has_input
    assert CaptureRequest(stdin=True).has_input
    with pytest.raises(UsageError, match="names no text"):
        Session(use_cache=False).run(CaptureRequest(model=TOY))


def test_the_request_spec_names_the_model() -> None:
    assert CaptureRequest(model=TOY).spec is TOY
    assert CaptureRequest(model="toy").spec == ModelSpec(name="toy")
    assert CaptureRequest().spec == ModelSpec()  # the default model ($ATTNVIZ_MODEL or MiniLM)


# --------------------------------------------------------------------------- run
def test_run_equals_the_head_recomputed_step_by_step() -> None:
    """The weights the request returns equal softmax(q.k / sqrt(d_k)) traced from the toy
    model's own projections, head by head."""
    capture = Session(use_cache=False).run(CaptureRequest(text=TEXT, model=TOY))
    assert capture.weights.shape == (3, 2, 6, 6)
    np.testing.assert_allclose(capture.weights.sum(axis=-1), 1.0, atol=1e-5)
    source = ToySource(CONFIG, device="cpu")
    for layer in range(3):
        for head in range(2):
            trace = trace_head(source, TEXT, layer, head)
            np.testing.assert_allclose(capture.matrix(layer, head), trace.weights, atol=1e-5)


def test_run_reads_standard_input(monkeypatch: pytest.MonkeyPatch) -> None:
    session = Session(use_cache=False)
    _stdin(monkeypatch, (TEXT + "\n").encode())
    piped = session.run(CaptureRequest(stdin=True, model=TOY))
    direct = session.run(CaptureRequest(text=TEXT, model=TOY))
    assert piped.text == TEXT
    np.testing.assert_array_equal(piped.weights, direct.weights)
    _stdin(monkeypatch, b"\xff\xfe")
    with pytest.raises(InputError, match="standard input is not valid UTF-8"):
        session.run(CaptureRequest(stdin=True, model=TOY))
    monkeypatch.setenv("ATTNVIZ_MAX_INPUT_MB", "0.000001")  # one byte
    _stdin(monkeypatch, b"The cat")
    with pytest.raises(InputError, match="holds more than 1 bytes"):
        session.run(CaptureRequest(stdin=True, model=TOY))


def test_run_checks_the_text_and_the_pair() -> None:
    session = Session(use_cache=False)
    with pytest.raises(InputError, match="the text is empty"):
        session.run(CaptureRequest(text="  ", model=TOY))
    with pytest.raises(InputError, match="the --pair text contains a NUL"):
        session.run(CaptureRequest(text=TEXT, pair="a\x00b", model=TOY))


def test_indices_are_checked_before_the_model_loads(forbid_loading: Any) -> None:
    tried = forbid_loading()
    session = Session(use_cache=False)
    with pytest.raises(UsageError, match="layer 3 is out of range: this model has 3 layers"):
        session.run(CaptureRequest(text=TEXT, model=TOY, layer=3))
    with pytest.raises(UsageError, match="head -3 is out of range"):
        session.run(CaptureRequest(text=TEXT, model=TOY, layer=0, head=-3))
    with pytest.raises(UsageError, match="^--start-layer: layer 7 is out of range"):
        session.run(CaptureRequest(text=TEXT, model=TOY, start_layer=7))
    with pytest.raises(UsageError, match="layer 5 is out of range"):
        session.run(CaptureRequest(text=TEXT, model=TOY, layers="0,5"))
    # Every request of run_each is checked before the first one loads its model.
    with pytest.raises(UsageError, match="head 2 is out of range"):
        session.run_each([CaptureRequest(text=TEXT, model=TOY, layer=0, head=1),
                          CaptureRequest(text="A dog", model=TOY, layer=0, head=2)])
    assert tried == []


def test_a_saved_capture_is_read_cut_and_checked(tmp_path: Path) -> None:
    session = Session(use_cache=False)
    whole = session.run(CaptureRequest(text=TEXT, model=TOY))
    whole.save(tmp_path / "cap")
    cut = session.run(CaptureRequest(from_path=tmp_path / "cap", layers="1-2", heads="1"))
    assert (cut.layers, cut.heads) == ([1, 2], [1])
    np.testing.assert_array_equal(cut.weights, whole.weights[1:3, 1:2])
    with pytest.raises(UsageError, match="layer 0 is not in this capture: it holds layers 1, 2"):
        session.run(CaptureRequest(from_path=tmp_path / "cap", layers="1-2", layer=0))
    with pytest.raises(UsageError, match="head 1 is not in this capture"):
        session.run(CaptureRequest(from_path=tmp_path / "cap", heads="0", head=1))


def test_truncation_warnings_go_to_warn_once() -> None:
    said: list[str] = []
    session = Session(use_cache=False, warn=said.append)
    capture = session.run(CaptureRequest(text=TEXT, model=TOY, max_tokens=3))
    assert capture.num_tokens == 3
    assert len(said) == 1 and "kept the first 3" in said[0]
    with pytest.raises(InputError, match="more than --max-tokens 3"):
        Session(use_cache=False, python=False).run(
            CaptureRequest(text=TEXT, model=TOY, max_tokens=3, truncate=False))


def test_the_cache_answers_a_second_request(forbid_loading: Any) -> None:
    first = Session().run(CaptureRequest(text=TEXT, model=TOY, layers="2"))
    tried = forbid_loading()
    again = Session().run(CaptureRequest(text=TEXT, model=TOY, layers="2"))
    np.testing.assert_array_equal(again.weights, first.weights)
    assert tried == []
    with pytest.raises(AssertionError, match="was loaded"):  # use_cache=False asks the model
        Session().run(CaptureRequest(text=TEXT, model=TOY, layers="2", use_cache=False))


# --------------------------------------------------------------------------- write, run_texts
def test_write_streams_a_text_and_copies_a_saved_capture(tmp_path: Path) -> None:
    session = Session(use_cache=False)
    path, capture = session.write(CaptureRequest(text=TEXT, model=TOY, heads="0"),
                                  tmp_path / "a")
    assert path == tmp_path / "a" / "attention.npy"
    reference = session.run(CaptureRequest(text=TEXT, model=TOY))
    np.testing.assert_array_equal(load_capture(tmp_path / "a").weights,
                                  reference.weights[:, :1])
    path, copied = session.write(CaptureRequest(from_path=tmp_path / "a", layers="-1"),
                                 tmp_path / "b.npy", float16=True)
    assert np.load(path).dtype == np.float16 and copied.layers == [2]
    loaded = load_capture(path)
    assert loaded.layers == [2]
    np.testing.assert_allclose(loaded.weights, reference.weights[2:, :1], atol=3e-4)


@pytest.mark.parametrize("batch_size", [1, 3])
def test_run_texts_gives_one_answer_per_text(batch_size: int) -> None:
    session = Session(use_cache=False)
    request = CaptureRequest(model=TOY, heads="1", max_tokens=4)
    texts = [(TEXT, None), ("   ", None), ("A dog", "barked at the moon")]
    results = list(session.run_texts(request, texts, batch_size=batch_size))
    assert isinstance(results[1], InputError) and "empty" in results[1].message
    for (text, pair), result in zip([texts[0], texts[2]], [results[0], results[2]]):
        assert not isinstance(result, InputError)
        single = session.run(CaptureRequest(text=text, pair=pair, model=TOY, heads="1",
                                            max_tokens=4))
        assert result.tokens == single.tokens and result.heads == [1]
        np.testing.assert_allclose(result.weights, single.weights, atol=1e-6)
        assert result.meta.get("warnings")  # 6 words cut to 4: left for the caller to name


# --------------------------------------------------------------------------- --server
@pytest.fixture(scope="module")
def toy_server() -> Iterator[str]:
    """``attnviz serve --model toy`` on a free port (uvicorn in a thread of this process)."""

    from attnviz.server.app import create_app

    with thread_server(create_app(["toy"])) as url:
        yield url


def test_a_remote_session_answers_the_same_request(toy_server: str, tmp_path: Path) -> None:
    from attnviz.server.client import RemoteSession

    remote = RemoteSession(toy_server)
    request = CaptureRequest(text=TEXT, model=TOY, layers="0,2", layer=2, head=1)
    local = Session(use_cache=False).run(request)
    answered = remote.run(request)
    np.testing.assert_array_equal(answered.weights, local.weights)
    assert answered.layers == [0, 2]
    with pytest.raises(UsageError, match="layer 3 is out of range"):  # from the server's model
        remote.run(CaptureRequest(text=TEXT, model=TOY, layer=3))
    whole = Session(use_cache=False).run(CaptureRequest(text=TEXT, model=TOY))
    before = remote.requests
    path, _ = remote.write(CaptureRequest(text=TEXT, model=TOY, heads="0"), tmp_path / "r")
    assert remote.requests > before  # captured on the server, written here
    np.testing.assert_array_equal(load_capture(path).weights, whole.weights[:, :1])
    texts = [(TEXT, None), ("", None)]
    answers = list(remote.run_texts(CaptureRequest(model=TOY), texts, batch_size=2))
    assert isinstance(answers[1], InputError)
    assert not isinstance(answers[0], InputError)
    np.testing.assert_array_equal(answers[0].weights, whole.weights)
