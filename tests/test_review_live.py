"""What a new user, a hostile user and a careful one find in the live engine.

Wrong types and impossible values given to ``attnviz.capture``, ``Capture.from_attentions``,
``attnviz.show`` and the session get an :class:`~attnviz.errors.AttnvizError` that names the
fix (never a ``TypeError`` from deep inside); the server answers odd requests and slow model
loads without stalling other models; the ``--server`` client refuses addresses it cannot use
safely and survives a server that answers garbage.
"""

from __future__ import annotations

import base64
import http.server
import json
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from starlette.testclient import TestClient

import attnviz
import attnviz.models as models
from attnviz.capture import Capture
from attnviz.errors import AttnvizError, InputError, ModelLoadError, UsageError
from attnviz.models import ModelSpec
from attnviz.models.toy import ToyConfig, ToySource
from attnviz.render.html import decode_weights
from attnviz.server.app import LOCAL_HOSTS, create_app
from attnviz.server.client import (
    RemoteSession,
    ServerError,
    capture_from_payload,
    parse_server_url,
)
from attnviz.server.engine import Limits
from attnviz.session import Session

SENTENCE = "The cat sat on the mat"
BASE = "http://127.0.0.1:8000"


def _toy(text: str, **config: Any) -> Capture:
    return ToySource(ToyConfig(**config), device="cpu").capture(text)


def _softmax_rows(shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    scores = np.random.default_rng(seed).normal(size=shape)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    return (weights / weights.sum(-1, keepdims=True)).astype(np.float32)


# --------------------------------------------------------------------------- attnviz.capture
@pytest.fixture(scope="module")
def gpt2(tiny_gpt2_dir: Path) -> tuple[Any, Any]:
    """The tiny GPT-2 in memory, as a notebook user holds it (sdpa, transformers' default)."""
    from transformers import AutoModel, AutoTokenizer

    return (AutoModel.from_pretrained(tiny_gpt2_dir, attn_implementation="sdpa"),
            AutoTokenizer.from_pretrained(tiny_gpt2_dir))


@pytest.mark.parametrize("options", [{"layers": 1.5}, {"layers": [True]}, {"layers": ["0"]},
                                     {"heads": []}, {"heads": [0.0]}, {"layers": {0: 1}}])
def test_capture_selections_must_be_indices(gpt2: tuple[Any, Any],
                                            options: dict[str, Any]) -> None:
    model, tokenizer = gpt2
    with pytest.raises(UsageError) as caught:
        attnviz.capture(model, tokenizer, SENTENCE, **options)
    name = "layer" if "layers" in options else "head"
    assert name in caught.value.message
    assert model.config._attn_implementation == "sdpa"


def test_capture_takes_numpy_integers(gpt2: tuple[Any, Any]) -> None:
    model, tokenizer = gpt2
    cap = attnviz.capture(model, tokenizer, SENTENCE, layers=np.int64(-1),
                          heads=np.array([3, 1]))
    assert (cap.layers, cap.heads) == ([1], [1, 3])


def test_capture_from_a_model_on_the_meta_device_says_so(tiny_gpt2_dir: Path,
                                                         gpt2: tuple[Any, Any]) -> None:
    from transformers import AutoConfig, AutoModel

    config = AutoConfig.from_pretrained(tiny_gpt2_dir)
    with torch.device("meta"):
        empty = AutoModel.from_config(config)
    with pytest.raises(UsageError) as caught:
        attnviz.capture(empty, gpt2[1], SENTENCE)
    assert "meta device" in caught.value.message
    assert "from_pretrained" in (caught.value.hint or "")


def test_capture_with_the_tokenizer_of_another_model(gpt2: tuple[Any, Any]) -> None:
    from transformers import GPT2Config, GPT2Model

    small = GPT2Model(GPT2Config(vocab_size=1000, n_positions=64, n_embd=32, n_layer=2,
                                 n_head=4)).eval()
    with pytest.raises(UsageError) as caught:
        attnviz.capture(small, gpt2[1], "The zebra sat on the mat")  # ids past 1000
    message = caught.value.message
    assert "tokenizer" in message and "1000" in message
    assert "eager" not in (caught.value.hint or "")  # the attention is not the problem
    assert small.config._attn_implementation == "sdpa"  # put back after the failure


def test_a_failing_forward_keeps_its_own_reason(gpt2: tuple[Any, Any],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    model, tokenizer = gpt2

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("expected all tensors to be on the same device")

    monkeypatch.setattr(model, "forward", broken)
    with pytest.raises(ModelLoadError) as caught:
        attnviz.capture(model, tokenizer, SENTENCE)
    assert "same device" in caught.value.message
    assert "switched to eager" in caught.value.message
    assert "--device" not in (caught.value.hint or "")  # no CLI flags in the Python API
    monkeypatch.undo()
    assert model.config._attn_implementation == "sdpa"


# --------------------------------------------------------------------------- from_attentions
ATT = tuple(_softmax_rows((2, 3, 4, 4), seed) for seed in range(2))  # 2 layers, batch 2
TOKENS = ["[CLS]", "a", "b", "[SEP]"]


@pytest.mark.parametrize("index", ["1", 1.0, True])
def test_from_attentions_batch_index_must_be_an_integer(index: Any) -> None:
    with pytest.raises(UsageError, match="batch_index must be an integer"):
        Capture.from_attentions(ATT, TOKENS, batch_index=index)


def test_from_attentions_batch_of_two_needs_batch_index() -> None:
    with pytest.raises(UsageError, match=r"batch of 2 rows: pass batch_index="):
        Capture.from_attentions(ATT, TOKENS)


def test_from_attentions_numpy_batch_index_and_a_generator() -> None:
    built = Capture.from_attentions((a for a in ATT), TOKENS, batch_index=np.int64(1))
    np.testing.assert_array_equal(built.weights, np.stack([a[1] for a in ATT]))


@pytest.mark.parametrize(("options", "words"), [
    ({"attentions": [np.zeros((1, 2, 0, 0), np.float32)], "tokens": []}, "no tokens"),
    ({"attention_mask": np.ones((3, 4))}, "3 rows"),
    ({"layers": [1, 1]}, "twice"),
    ({"layers": [0, True]}, "whole numbers"),
    ({"heads": [0, 1, 2.5]}, "whole numbers"),
    ({"attentions": [a.astype(np.complex64) for a in ATT]}, "real numbers"),
    ({"attentions": [np.full((1, 1, 4, 4), "x")]}, "real numbers"),
    ({"attentions": [-a for a in ATT]}, "negative"),
    ({"attentions": [a * 4 for a in ATT]}, "must sum to 1"),
    ({"attention_mask": np.array([[1, 1, 1, 0], [1, 1, 1, 1]]), "batch_index": 0},
     "must sum to 1"),
    ({"causal": True}, "later key"),
    ({"num_layers": 0}, "num_layers"),
    ({"tokens": None}, "tokens"),
    ({"tokens": 5}, "tokens"),
    ({"meta": [("a", 1)]}, "meta"),
    ({"word_ids": ["x", "y", "z", "w"]}, "word ids"),
    ({"special": ["yes", "no", "no", "yes"]}, "special"),
    ({"model": None}, "model"),
    ({"text": 5}, "text"),
    ({"pair": b"bytes"}, "pair"),
])
def test_from_attentions_refuses_what_would_break_later(options: dict[str, Any],
                                                       words: str) -> None:
    arguments: dict[str, Any] = {"attentions": ATT, "tokens": TOKENS, **options}
    if np.shape(arguments["attentions"][0])[0] > 1:  # a batch of two: say which row
        arguments.setdefault("batch_index", 1)
    with pytest.raises(UsageError) as caught:
        Capture.from_attentions(arguments.pop("attentions"), arguments.pop("tokens"),
                                **arguments)
    assert words in caught.value.message


def test_from_attentions_keeps_float_rounding_of_half_precision() -> None:
    # bfloat16 rounds a weight of 1 to at most 1 + 2**-8: still attention, not refused.
    rows = np.zeros((1, 1, 3, 3), np.float32)
    rows[..., 0] = 1.0
    built = Capture.from_attentions([torch.from_numpy(rows).to(torch.bfloat16) * 1.003],
                                    ["a", "b", "c"])
    assert float(built.weights.max()) <= 1.0 + 1e-2


# --------------------------------------------------------------------------- attnviz.show
@pytest.fixture(scope="module")
def toy_capture() -> Capture:
    return _toy(SENTENCE, layers=2, heads=4)


@pytest.mark.parametrize("capture", ["The cat", None, np.zeros((1, 1, 2, 2))])
def test_show_needs_a_capture(capture: Any) -> None:
    with pytest.raises(UsageError, match="needs a Capture"):
        attnviz.show(capture)


@pytest.mark.parametrize(("options", "words"), [
    ({"layer": "1"}, "layer"), ({"layer": 1.5}, "layer"), ({"layer": True}, "layer"),
    ({"head": "x"}, "head"), ({"heads": [None]}, "head"), ({"heads": [1.5]}, "head"),
    ({"precision": "8"}, "precision"), ({"precision": 4}, "precision"),
])
def test_show_refuses_wrong_types(toy_capture: Capture, options: dict[str, Any],
                                  words: str) -> None:
    with pytest.raises(UsageError) as caught:
        attnviz.show(toy_capture, **options)
    assert words in caught.value.message


def test_show_takes_one_head_or_a_selection(toy_capture: Capture) -> None:
    assert attnviz.show(toy_capture, heads=2).heads == [2]
    assert attnviz.show(toy_capture, heads="0,2-3").heads == [0, 2, 3]
    assert attnviz.show(toy_capture, layer=np.int64(-1), head=np.int64(-1)).layer == 1
    view = attnviz.show(toy_capture, heads=np.array([3, 1]))
    assert view.heads == [1, 3] and view.head is None


# --------------------------------------------------------------------------- the session
def test_session_takes_toy_settings_as_a_dict() -> None:
    session = Session(use_cache=False)
    cap = session.capture(SENTENCE, model="toy", toy={"layers": 2, "heads": 4})
    np.testing.assert_array_equal(cap.weights, _toy(SENTENCE, layers=2, heads=4).weights)
    same = attnviz.capture_text(SENTENCE, model="toy", toy={"layers": 2, "heads": 4},
                                use_cache=False)
    np.testing.assert_array_equal(same.weights, cap.weights)


@pytest.mark.parametrize(("options", "words"), [
    ({"toy": {"layer": 2}}, "toy"), ({"toy": "big"}, "toy"), ({"toy": {"heads": "2"}}, "toy"),
    ({"model": 5}, "model"), ({"model": ["toy"]}, "model"),
    ({"layers": 1.5}, "layer"), ({"layers": ["a"]}, "layer"), ({"layers": [1.5]}, "layer"),
    ({"layers": []}, "layer"), ({"heads": True}, "head"), ({"heads": [False]}, "head"),
    ({"max_tokens": "5"}, "max_tokens"), ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -3}, "max_tokens"), ({"max_tokens": 2.0}, "max_tokens"),
])
def test_session_options_of_the_wrong_type(options: dict[str, Any], words: str) -> None:
    options = {"model": "toy", **options}
    with pytest.raises(UsageError) as caught:
        Session(use_cache=False).capture(SENTENCE, **options)
    assert words in caught.value.message


def test_session_captures_takes_plain_strings() -> None:
    session = Session(use_cache=False)
    texts = ["ab", "The dog", ("A cat", "sat down")]
    results = list(session.captures(texts, model="toy"))
    assert [r.text for r in results] == ["ab", "The dog", "A cat"]  # not "a" with pair "b"
    assert [r.pair for r in results] == [None, None, "sat down"]
    with pytest.raises(UsageError, match="list of texts"):
        list(session.captures("The cat sat", model="toy"))
    with pytest.raises(UsageError, match="text, pair"):
        list(session.captures([("a", "b", "c")], model="toy"))
    with pytest.raises(UsageError, match="max_models"):
        Session(max_models="2")  # type: ignore[arg-type]


@pytest.fixture
def slow_model(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """Loading the model "slow" blocks until ``release`` is set; every load is counted."""
    real = models.load_source
    state: dict[str, Any] = {"release": threading.Event(), "started": threading.Event(),
                             "loads": []}

    def load(spec: Any = None) -> Any:
        name = getattr(spec, "name", spec)
        state["loads"].append(name)
        if name == "slow":
            state["started"].set()
            assert state["release"].wait(20), "the test never released the slow load"
            return real(ModelSpec(name="toy", toy=ToyConfig(layers=2)))
        return real(spec)

    monkeypatch.setattr(models, "load_source", load)
    yield state
    state["release"].set()


def _in_thread(work: Any) -> tuple[threading.Thread, dict[str, Any]]:
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = work()
        except BaseException as error:  # handed to the test thread
            box["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


def test_a_slow_load_does_not_hold_up_other_models(slow_model: dict[str, Any]) -> None:
    session = Session(use_cache=False, max_models=4)
    first, first_box = _in_thread(lambda: session.capture(SENTENCE, model="slow"))
    second, second_box = _in_thread(lambda: session.capture("A dog", model="slow"))
    assert slow_model["started"].wait(10)
    toy, toy_box = _in_thread(lambda: session.capture(SENTENCE, model="toy"))
    toy.join(10)
    assert "result" in toy_box, toy_box.get("error", "the toy capture waited for the load")
    assert first.is_alive() and not slow_model["release"].is_set()
    assert session.is_loaded("toy") and not session.is_loaded("slow")
    slow_model["release"].set()
    first.join(20)
    second.join(20)
    assert first_box["result"].text == SENTENCE and second_box["result"].text == "A dog"
    assert slow_model["loads"].count("slow") == 1  # the second request waited for the first


# --------------------------------------------------------------------------- the server
@pytest.fixture(scope="module")
def client() -> TestClient:
    app = create_app(["toy"], limits=Limits(max_body_bytes=64 * 1024, max_chars=5000,
                                             max_tokens=64))
    return TestClient(app, base_url=BASE)


def _error(response: Any, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["status"] == status
    return dict(error)


def test_a_number_with_thousands_of_digits(client: TestClient) -> None:
    body = b'{"text": "hi", "max_tokens": 1' + b"0" * 5000 + b"}"
    error = _error(client.post("/api/capture", content=body,
                               headers={"content-type": "application/json"}), 400)
    assert "too many digits" in error["message"]
    assert "sys." not in error["message"] and "int_max_str_digits" not in error["message"]


def test_a_query_out_of_range_names_the_tokens(client: TestClient) -> None:
    error = _error(client.post("/api/topk", json={"text": "hi there", "layer": 0, "head": 0,
                                                 "query": 9}), 422)
    assert error["message"] == ("query 9 is out of range: the input has 2 tokens "
                                "(0..1 or -2..-1)")


def test_a_nested_object_of_the_wrong_type_gets_its_own_hint(client: TestClient) -> None:
    error = _error(client.post("/api/capture", json={"text": "hi", "toy": 5}), 422)
    assert error["message"] == "'toy' must be a JSON object, not a number"
    assert '"text"' not in (error["hint"] or "") and "layers" in (error["hint"] or "")


@pytest.mark.parametrize("text", ["\u05e9\u05dc\u05d5\u05dd \u05e2\u05d5\u05dc\u05dd",
                                  "I \U0001F600 cats \U0001F469\u200d\U0001F4BB",
                                  "\u202eabc def", "猫が好き です"])
def test_unicode_texts_equal_a_local_capture(client: TestClient, text: str) -> None:
    payload = client.post("/api/capture", json={"text": text, "weights": "float32"}).json()
    local = _toy(text)
    remote = capture_from_payload(payload)
    assert remote.tokens == local.tokens and remote.text == text
    np.testing.assert_array_equal(remote.weights, local.weights)


def test_quantised_real_attention_is_within_the_documented_error(patched_minilm_app: Any,
                                                                 minilm: Any) -> None:
    client = TestClient(patched_minilm_app, base_url=BASE)
    local = minilm.capture(SENTENCE, "A dog barked")
    for fmt, bound in (("q8", 0.00197), ("q16", 7.63e-6)):  # 1/510 and 1/131070, as in README
        payload = client.post("/api/capture", json={"text": SENTENCE, "pair": "A dog barked",
                                                    "weights": fmt}).json()
        error = np.abs(decode_weights(payload["weights"]) - local.weights).max()
        assert error <= bound, (fmt, error)
        assert error > 0  # quantised, not exact: the bound is what is checked
    exact = capture_from_payload(client.post("/api/capture", json={
        "text": SENTENCE, "pair": "A dog barked", "weights": "float32"}).json())
    np.testing.assert_array_equal(exact.weights, local.weights)


@pytest.fixture(scope="module")
def patched_minilm_app(minilm: Any) -> Iterator[Any]:
    patch = pytest.MonkeyPatch()
    real = models.load_source

    def load(spec: Any = None) -> Any:
        return minilm if getattr(spec, "name", spec) == "minilm" else real(spec)

    patch.setattr(models, "load_source", load)
    yield create_app(["minilm"])
    patch.undo()


def test_other_models_answer_while_one_loads(slow_model: dict[str, Any]) -> None:
    client = TestClient(create_app(["slow", "toy"]), base_url=BASE)
    loading, box = _in_thread(lambda: client.post("/api/capture",
                                                  json={"text": SENTENCE, "model": "slow"}))
    assert slow_model["started"].wait(10)
    started = time.monotonic()
    toy = client.post("/api/capture", json={"text": SENTENCE, "model": "toy"})
    listed = client.get("/api/models").json()["models"]
    assert toy.status_code == 200 and time.monotonic() - started < 5
    assert [m["loaded"] for m in listed] == [False, True]
    assert loading.is_alive()
    slow_model["release"].set()
    loading.join(20)
    assert box["result"].status_code == 200


def test_a_load_past_the_timeout_says_the_model_is_loading(slow_model: dict[str, Any]
                                                           ) -> None:
    client = TestClient(create_app(["slow"], limits=Limits(timeout_s=0.5)), base_url=BASE)
    error = _error(client.post("/api/capture", json={"text": SENTENCE}), 503)
    assert "still loading" in error["message"]
    slow_model["release"].set()
    deadline = time.monotonic() + 20
    while client.post("/api/capture", json={"text": SENTENCE}).status_code != 200:
        assert time.monotonic() < deadline, "the model never finished loading"
        time.sleep(0.05)
    assert slow_model["loads"].count("slow") == 1


def test_stopping_answers_the_waiting_requests_at_once(slow_model: dict[str, Any]) -> None:
    """What Ctrl-C does before uvicorn's graceful shutdown: no request is left waiting for a
    model load (uvicorn would cancel it after 5 s, with a traceback)."""
    app = create_app(["slow", "toy"])
    with TestClient(app, base_url=BASE) as client:
        waiting, box = _in_thread(lambda: client.post("/api/capture", json={"text": SENTENCE}))
        assert slow_model["started"].wait(10)
        started = time.monotonic()
        client.portal.call(app.state.runner.stop)
        waiting.join(5)
        assert time.monotonic() - started < 5
        error = _error(box["result"], 503)
        assert error["message"] == "the server is stopping"
        later = client.post("/api/capture", json={"text": SENTENCE, "model": "toy"})
        assert _error(later, 503)["message"] == "the server is stopping"
        assert app.state.engine.pending() == 1  # the load itself goes on, in its thread
        slow_model["release"].set()
        deadline = time.monotonic() + 20
        while app.state.engine.pending():
            assert time.monotonic() < deadline
            time.sleep(0.02)
    assert all(thread.daemon for thread in app.state.runner.pool._threads)


def test_load_errors_are_kept_for_served_models_only(tmp_path: Path) -> None:
    app = create_app(["toy"], allow_any_model=True)
    client = TestClient(app, base_url=BASE)
    for i in range(3):
        name = str(tmp_path / f"missing-{i}")
        assert _error(client.post("/api/capture", json={"text": "hi", "model": name}),
                      500)["type"] == "ModelLoadError"
    assert app.state.engine.load_errors == {}
    assert app.state.engine.session._loading == {}


def test_a_model_that_fails_to_load_can_be_retried(tmp_path: Path, tiny_gpt2_dir: Path
                                                   ) -> None:
    later = tmp_path / "model-later"
    client = TestClient(create_app([str(later)]), base_url=BASE)
    first = _error(client.post("/api/capture", json={"text": SENTENCE}), 500)
    assert first["type"] == "ModelLoadError"
    assert "does not exist" in client.get("/api/models").json()["models"][0]["error"]
    shutil.copytree(tiny_gpt2_dir, later)
    again = client.post("/api/capture", json={"text": SENTENCE, "weights": "float32"})
    assert again.status_code == 200, again.text
    listed = client.get("/api/models").json()["models"][0]
    assert listed["loaded"] is True and "error" not in listed
    from attnviz.models.hf import HFSource

    local = HFSource(str(tiny_gpt2_dir), device="cpu").capture(SENTENCE)
    np.testing.assert_allclose(capture_from_payload(again.json()).weights, local.weights,
                               atol=1e-6)


@pytest.mark.parametrize("host", ["127.0.0.2", "localhost", "::1", "[::1]"])
def test_every_loopback_address_serve_prints_is_answered(host: str) -> None:
    from attnviz.cli.serve import _address, _allowed_hosts

    allowed = _allowed_hosts(host)
    assert allowed is not None and set(LOCAL_HOSTS) <= set(allowed)
    url = _address(host, 8000, None)[0]
    assert "[[" not in url
    client = TestClient(create_app(["toy"], allowed_hosts=allowed), base_url=url)
    assert client.get("/api/health").status_code == 200
    other = TestClient(create_app(["toy"], allowed_hosts=allowed),
                       base_url="http://evil.example:8000")
    assert other.get("/api/health").status_code == 403
    assert _allowed_hosts("0.0.0.0") is None


def test_a_busy_port_exits_1(invoke: Any) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        result = invoke("serve", "--model", "toy", "--port", str(port))
    assert result.exit_code == 1
    assert f"port {port} on 127.0.0.1 is in use" in result.stderr
    assert "Traceback" not in result.output


# --------------------------------------------------------------------------- --server client
@pytest.mark.parametrize(("url", "words"), [
    ("http://[::1", "not a valid address"),
    ("http://127.0.0.1:99999", "port"),
    ("http://a b:8000", "not a valid address"),
    ("http://127.0.0.1\x00:8000", "not a valid address"),
    ("http://alice:s3cret@127.0.0.1:8000", "user name or password"),
    ("ftp://alice:s3cret@example.org", "http:// or https://"),
    ("file:///etc/passwd", "http:// or https://"),
])
def test_server_addresses_that_cannot_be_used(url: str, words: str) -> None:
    with pytest.raises(UsageError) as caught:
        parse_server_url(url)
    assert words in caught.value.message
    assert "s3cret" not in str(caught.value)


class _Fake(http.server.BaseHTTPRequestHandler):
    """Answers every POST with what the test put in ``server.answer``; records headers."""

    def log_message(self, *args: Any) -> None:
        pass

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers.get("content-length") or 0))
        server: Any = self.server
        server.seen.append(dict(self.headers))
        status, body, headers = server.answer(self.path)
        self.send_response(status)
        for name, value in headers:
            self.send_header(name, value)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST  # noqa: N815


@pytest.fixture
def fake_servers() -> Iterator[list[Any]]:
    servers = []
    for _ in range(2):
        server: Any = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Fake)
        server.seen = []
        server.answer = lambda path: (200, b"{}", [("content-type", "application/json")])
        server.url = f"http://127.0.0.1:{server.server_address[1]}"
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                         daemon=True).start()
        servers.append(server)
    yield servers
    for server in servers:
        server.shutdown()
        server.server_close()


def _model_answer(path: str) -> tuple[int, bytes, list[tuple[str, str]]] | None:
    if path == "/api/model":
        return 200, json.dumps({"name": "toy", "num_layers": 1, "num_heads": 2}).encode(), [
            ("content-type", "application/json")]
    return None


def test_a_redirect_is_not_followed_and_the_token_stays_home(fake_servers: list[Any]
                                                             ) -> None:
    home, elsewhere = fake_servers
    home.answer = lambda path: _model_answer(path) or (
        307, b"", [("Location", elsewhere.url + "/api/capture")])
    with pytest.raises(ServerError, match="redirect"):
        RemoteSession(home.url + "/?token=tok-secret").capture(SENTENCE, model="toy")
    assert elsewhere.seen == []
    assert all(h.get("Authorization") == "Bearer tok-secret" for h in home.seen)


@pytest.mark.parametrize("body", [
    b"[" * 100_000 + b"]" * 100_000,
    json.dumps({"format": "attnviz-capture", "weights": {
        "encoding": "base64", "dtype": "float32", "shape": [10**6] * 4,
        "data": base64.b64encode(b"\0\0\0\0").decode()}}).encode(),
    json.dumps({"weights": {"encoding": "base64", "dtype": "float32", "shape": [-1, 1, 1, 1],
                            "data": ""}}).encode(),
    json.dumps({"weights": {"encoding": "base64", "dtype": "float32", "shape": "abc",
                            "data": ""}}).encode(),
])
def test_a_garbage_answer_is_a_server_error(fake_servers: list[Any], body: bytes) -> None:
    fake_servers[0].answer = lambda path: _model_answer(path) or (
        200, body, [("content-type", "application/json")])
    with pytest.raises(ServerError, match="server"):
        RemoteSession(fake_servers[0].url).capture(SENTENCE, model="toy")


def test_an_answer_past_the_size_bound(fake_servers: list[Any]) -> None:
    fake_servers[0].answer = lambda path: _model_answer(path) or (
        200, b'{"pad": "' + b"x" * 3000 + b'"}', [("content-type", "application/json")])
    remote = RemoteSession(fake_servers[0].url)
    remote.max_answer_bytes = 2000
    with pytest.raises(ServerError, match="larger than 2,000 bytes"):
        remote.capture(SENTENCE, model="toy")


def test_a_server_message_cannot_drive_the_terminal(fake_servers: list[Any]) -> None:
    message = "\x1b[2J\x1b]0;pwned\x07bad \u202e" + "y" * 100_000
    answer = json.dumps({"error": {"type": "UsageError", "message": message,
                                   "hint": "\x1b[31mred", "status": 422}}).encode()
    fake_servers[0].answer = lambda path: _model_answer(path) or (
        422, answer, [("content-type", "application/json")])
    with pytest.raises(UsageError) as caught:
        RemoteSession(fake_servers[0].url).capture(SENTENCE, model="toy")
    shown = str(caught.value)
    assert "\x1b" not in shown and "\x07" not in shown and "\u202e" not in shown
    assert shown.startswith("[2J]0;pwnedbad ")  # printable text stays, the escapes go
    assert len(caught.value.message) <= 1000 and caught.value.message.endswith("...")
    assert caught.value.hint == "[31mred"


def test_errors_from_the_server_keep_their_exit_codes(fake_servers: list[Any]) -> None:
    for kind, cls in (("InputError", InputError), ("ModelLoadError", ModelLoadError),
                      ("SystemExit", ServerError), ("__class__", ServerError)):
        answer = json.dumps({"error": {"type": kind, "message": "m", "status": 422}}).encode()
        fake_servers[0].answer = lambda path, answer=answer: _model_answer(path) or (
            422, answer, [("content-type", "application/json")])
        with pytest.raises(AttnvizError) as caught:
            RemoteSession(fake_servers[0].url).capture(SENTENCE, model="toy")
        assert type(caught.value) is cls

