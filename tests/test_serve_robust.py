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
from tests._servers import ServeProcess

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

    app = create_app(["toy"])
    engine = app.state.engine
    client = TestClient(app, base_url=BASE)
    watched = []
    for seed in range(12):
        answer = client.post("/api/model", json={"model": "toy", "toy": {"seed": seed}})
        assert answer.status_code == 200, answer.text
        assert answer.json()["induction"]["vocab_size"] > 0
        spec = ModelSpec(name="toy", device=engine.device, dtype=engine.dtype,
                         toy=ToyConfig(seed=seed))
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


# --------------------------------------------------------------------------- attnviz serve
class _Serve(ServeProcess):
    """``attnviz serve`` in a subprocess (tests/_servers.py), with requests to it."""

    def __init__(self, *args: str) -> None:
        super().__init__(*args, pattern=r"attnviz serve: (http://127\.0\.0\.1:\d+)/")

    def get(self, path: str) -> tuple[int, Any]:
        import json
        import urllib.error
        import urllib.request

        try:
            with urllib.request.urlopen(self.url + path, timeout=30) as response:
                body = response.read()
                status = response.status
        except urllib.error.HTTPError as error:
            body, status = error.read(), error.code
        try:
            return status, json.loads(body)
        except ValueError:
            return status, body

    def post(self, path: str, body: dict[str, Any], box: dict[str, Any]) -> None:
        import json
        import urllib.error
        import urllib.request

        request = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                box["status"] = response.status
        except urllib.error.HTTPError as error:
            box["status"], box["error"] = error.code, json.loads(error.read())["error"]
            box["retry_after"] = error.headers.get("Retry-After")
        except OSError as error:  # the server went away before answering
            box["status"] = repr(error)

    def interrupt(self) -> int:
        import signal
        import subprocess

        self.process.send_signal(signal.SIGINT)
        try:
            return self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.close()
            raise


def test_ctrl_c_while_torch_is_busy_and_requests_wait_stops_cleanly() -> None:
    """SIGINT during a long forward pass, with two requests waiting for the model: "Stopped.",
    exit 0 (it was an abort, exit -6: "terminate called without an active exception")."""
    serve = _Serve("--model", "toy")
    try:
        # 12 layers x 32 heads x 384 x 384 keeps torch's threads busy for seconds.
        heavy = {"text": " ".join(f"w{i}" for i in range(384)), "model": "toy",
                 "toy": {"d_model": 64, "heads": 32, "layers": 12}, "layers": "0",
                 "heads": "0"}
        boxes: list[dict[str, Any]] = [{} for _ in range(4)]
        threads = [threading.Thread(target=serve.post, args=("/api/capture", heavy, box),
                                    daemon=True) for box in boxes]
        for thread in threads:
            thread.start()
        # One forward pass runs (seconds each), the others wait for the model.
        _wait_for(lambda: serve.get("/api/health")[1]["pending"] >= 3, 30)
        time.sleep(0.3)
        code = serve.interrupt()
        for thread in threads:
            thread.join(10)
    finally:
        serve.close()
    output = serve.text()
    assert code == 0, output
    assert "Stopped." in output and "terminate called" not in output
    assert "Traceback" not in output
    stopped = [box for box in boxes if box.get("status") == 503]
    assert len(stopped) >= 2, boxes  # the waiting requests are answered at once
    for box in stopped:
        assert box["error"]["message"] == "the server is stopping"
        assert box["retry_after"] is None  # a client asking again would find no server


def test_serve_loads_its_models_first_and_logs_without_the_token() -> None:
    serve = _Serve("--model", "toy", "--log")
    try:
        # Right after the address is printed, every served model is warm.
        status, health = serve.get("/api/health")
        assert status == 200 and health["ready"] is True and health["default"] == "toy"
        listed = serve.get("/api/models")[1]["models"]
        assert [(m["loaded"], m.get("num_layers")) for m in listed] == [(True, 1)]
        assert serve.get("/?token=sekrit-123&x=1")[0] == 200
        assert serve.get("/api/health?token=sekrit-456")[0] == 200
        assert serve.get("/api/nothing")[0] == 404
        _wait_for(lambda: "/api/nothing" in serve.text())
        assert serve.interrupt() == 0
    finally:
        serve.close()
    output = serve.text()
    access = [line for line in output.splitlines() if '"GET ' in line]
    assert len(access) == 5, output  # health, models, page, health, 404
    assert any('"GET /?token=***&x=1 HTTP/1.1" 200' in line for line in access), access
    assert any('"GET /api/nothing HTTP/1.1" 404' in line for line in access)
    assert "sekrit" not in output


def test_the_token_is_hidden_in_every_log_line() -> None:
    import logging

    from uvicorn.logging import AccessFormatter

    from attnviz.cli.serve import _HideToken

    token = "Zx9-secret_token"
    record = logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1,
                               '%s - "%s %s HTTP/%s" %d',
                               ("127.0.0.1:5000", "GET", f"/?a=1&token={token}", "1.1", 303),
                               None)
    other = logging.LogRecord("uvicorn.error", logging.INFO, __file__, 1,
                              "cookie attnviz-token-8000=%s", (token,), None)
    hide = _HideToken(token)
    assert hide.filter(record) and hide.filter(other)
    line = AccessFormatter('%(client_addr)s - "%(request_line)s" %(status_code)s').format(
        record)
    assert line.startswith('127.0.0.1:5000 - "GET /?a=1&token=*** HTTP/1.1" 303')
    assert token not in line
    assert other.getMessage() == "cookie attnviz-token-8000=***"


# --------------------------------------------------------------------------- --server client
def _toy_payload(text: str = SENTENCE, **changes: Any) -> dict[str, Any]:
    """A real /api/capture answer (float32) of the default toy model, then ``changes``."""
    from attnviz.server.engine import capture_payload

    capture = ToySource(ToyConfig(), device="cpu").capture(text)
    return {**capture_payload(capture, weights="float32"), **changes}


def _fake_server(answer: Any, limit: int = 20) -> Any:
    """A loopback HTTP server answering at most ``limit`` requests with ``answer(path)``."""
    import http.server
    import json

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            self.rfile.read(int(self.headers.get("content-length") or 0))
            server: Any = self.server
            server.paths.append(self.path)
            assert len(server.paths) <= limit, "the client sent too many requests"
            status, headers, body = answer(self.path)
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            self.send_response(status)
            for name, value in headers:
                self.send_header(name, value)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST  # noqa: N815

    server: Any = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.paths = []
    server.url = f"http://127.0.0.1:{server.server_address[1]}"
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                     daemon=True).start()
    return server


@pytest.fixture
def fake() -> Any:
    """Start fake servers with ``fake(answer)``; all are shut down after the test."""
    started: list[Any] = []

    def start(answer: Any, limit: int = 20) -> Any:
        started.append(_fake_server(answer, limit))
        return started[-1]

    yield start
    for server in started:
        server.shutdown()
        server.server_close()


def _toy_model(layers: int = 1, heads: int = 2, **extra: Any) -> tuple[int, list[Any], Any]:
    return 200, [], {"name": "toy", "num_layers": layers, "num_heads": heads, **extra}


def test_the_timeout_is_a_total_deadline(fake: Any) -> None:
    """A server that drips its answer (headers or body, a byte at a time) holds the client
    for ``timeout`` seconds in all, not ``timeout`` per read."""
    import socket

    from attnviz.server.client import RemoteSession, ServerError

    for part in ("body", "headers"):
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        stop = threading.Event()

        def drip(listener: socket.socket = listener, part: str = part,
                 stop: threading.Event = stop) -> None:
            connection, _ = listener.accept()
            with connection:
                connection.recv(65536)
                head = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                        b"Content-Length: 64\r\n\r\n")
                slow = head + b"[" * 64 if part == "headers" else b"[" * 64
                if part == "body":
                    connection.sendall(head)
                for byte in slow[:60]:  # at most 60 bytes, one per 0.2 s: 12 s in all
                    if stop.wait(0.2):
                        return
                    try:
                        connection.sendall(bytes([byte]))
                    except OSError:
                        return

        thread = threading.Thread(target=drip, daemon=True)
        thread.start()
        remote = RemoteSession(f"http://127.0.0.1:{listener.getsockname()[1]}", timeout=1)
        started = time.monotonic()
        try:
            with pytest.raises(ServerError, match="did not answer within 1 s"):
                remote.request("POST", "/api/capture", {"text": SENTENCE})
            assert time.monotonic() - started < 4, part  # 12 s if the deadline were per read
        finally:
            stop.set()
            thread.join(5)
            listener.close()
    from attnviz.errors import UsageError

    for bad in (0, -1, float("inf"), float("nan"), "5", True):
        with pytest.raises(UsageError, match="timeout must be a number of seconds"):
            RemoteSession("http://127.0.0.1:9", timeout=bad)


def test_a_busy_server_is_asked_again_within_the_deadline(fake: Any) -> None:
    from attnviz.server.client import RemoteSession, ServerError

    busy = (503, [("Retry-After", "0")], {"error": {
        "type": "AttnvizError", "message": "the server is busy", "status": 503}})
    answers = [busy, busy, (200, [], _toy_payload())]
    server = fake(lambda path: _toy_model() if path == "/api/model" else answers.pop(0))
    remote = RemoteSession(server.url)
    capture = remote.capture(SENTENCE, model="toy")
    assert capture.tokens == SENTENCE.split() and server.paths.count("/api/capture") == 3
    # Always busy: asked 1 + RETRIES times, then the server's own message.
    from attnviz.server.client import RETRIES

    always = fake(lambda path: busy)
    with pytest.raises(ServerError, match="the server is busy"):
        RemoteSession(always.url).capture(SENTENCE, model="toy")
    assert len(always.paths) == 1 + RETRIES
    # A wait that does not fit in the time left is not waited for; no Retry-After: no retry.
    later = (503, [("Retry-After", "20")], busy[2])
    for answer, timeout in ((later, 5.0), (busy[:1] + ([],) + busy[2:], 300.0)):
        once = fake(lambda path, answer=answer: answer)
        started = time.monotonic()
        with pytest.raises(ServerError, match="busy"):
            RemoteSession(once.url, timeout=timeout).capture(SENTENCE, model="toy")
        assert len(once.paths) == 1 and time.monotonic() - started < 3


def test_token_text_from_a_server_cannot_drive_the_terminal(fake: Any, invoke: Any) -> None:
    from attnviz.server.client import RemoteSession

    payload = _toy_payload()
    payload["display_tokens"] = ["\x1b]0;pwned\x07The", "\x1b[2Jcat", *SENTENCE.split()[2:]]
    payload["model"] = "toy\x1b[31m"
    payload["meta"] = {**payload["meta"], "warnings": ["\x1b[1mbold\x1b[0m"]}
    server = fake(lambda path: _toy_model() if path == "/api/model" else (200, [], payload))
    capture = RemoteSession(server.url).capture(SENTENCE, model="toy")
    assert capture.display_tokens[:2] == ["\\x1b]0;pwned\\x07The", "\\x1b[2Jcat"]
    assert capture.model == "toy[31m" and capture.meta["warnings"] == ["[1mbold[0m"]
    result = invoke("top-k", SENTENCE, "--model", "toy", "--layer", "0", "--head", "0",
                    "--server", server.url)
    assert result.exit_code == 0, result.output
    assert "\x1b" not in result.stdout + result.stderr and "\x07" not in result.stdout
    assert "\\x1b[2Jcat" in result.stdout


@pytest.mark.parametrize(("changes", "asked", "words"), [
    ({"text": "The dog sat on the mat"}, {}, "its text is not the text sent"),
    ({"pair": "A dog"}, {}, "it holds a pair although none was sent"),
    ({}, {"pair": "A dog"}, "its pair is not the pair sent"),
    ({}, {"layers": "1"}, "its layers are [0], not [1]"),
    ({}, {"heads": [1]}, "its heads are [0, 1], not [1]"),
    ({"num_heads": 3}, {}, "its model has 1 layers x 3 heads, not 1 x 2"),
])
def test_an_answer_for_another_request_is_refused(fake: Any, changes: dict[str, Any],
                                                  asked: dict[str, Any], words: str) -> None:
    from attnviz.server.client import RemoteSession, ServerError

    model = _toy_model(layers=2) if "layers" in asked else _toy_model()
    payload = _toy_payload(**changes)
    if "layers" in asked:  # a two-layer model whose answer holds layer 0
        two = ToySource(ToyConfig(layers=2), device="cpu").capture(SENTENCE, layers=[0])
        from attnviz.server.engine import capture_payload

        payload = capture_payload(two, weights="float32")
    server = fake(lambda path: model if path == "/api/model" else (200, [], payload))
    remote = RemoteSession(server.url)
    remote.source("toy")  # the model's shape, as the CLI asks before capturing
    text = SENTENCE
    with pytest.raises(ServerError) as caught:
        remote.capture(text, model="toy", **asked)
    assert words in caught.value.message and "another capture" in caught.value.message


def test_server_sizes_for_the_induction_test_are_bounded(fake: Any, invoke: Any) -> None:
    """heads --induction --server: a vocabulary of 10**12 from the server was np.arange'd
    (a MemoryError traceback)."""
    payload = _toy_payload("A B C A B C", causal=False)

    def answer(induction: dict[str, Any]) -> Any:
        return lambda path: (_toy_model(induction=induction) if path == "/api/model"
                             else (200, [], payload))

    for vocab in (10**12, "many", -3, 0, True):
        server = fake(answer({"vocab_size": vocab, "prefix": [], "max_tokens": None}), 5)
        result = invoke("heads", "A B C A B C", "--model", "toy", "--induction", "--server",
                        server.url)
        assert result.exit_code == 1, result.output
        assert not isinstance(result.exception, MemoryError)
        message = " ".join(result.stderr.split())
        assert "induction test vocab_size" in message and "4,194,304" in message, message
        assert "Traceback" not in result.output
    server = fake(answer({"vocab_size": 100, "prefix": list(range(10**5)), "max_tokens": None}),
                  5)
    result = invoke("heads", "A B C A B C", "--model", "toy", "--induction", "--server",
                    server.url)
    assert result.exit_code == 1 and "prefix" in result.stderr


def test_server_without_model_uses_the_servers_default(invoke: Any) -> None:
    import socket

    import uvicorn

    from attnviz.server.app import create_app
    from attnviz.server.client import RemoteSession

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    server = uvicorn.Server(uvicorn.Config(create_app(["toy"]), log_level="warning",
                                          lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        _wait_for(lambda: server.started, 20)
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        args = ("top-k", SENTENCE, "--layer", "0", "--head", "1", "--format", "csv")
        remote = invoke(*args, "--server", url)
        local = invoke(*args, "--model", "toy", "--no-cache")
        assert remote.exit_code == 0, remote.output
        assert remote.stdout == local.stdout
        capture = RemoteSession(url).capture(SENTENCE)
        assert capture.model == "toy"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


# --------------------------------------------------------------------------- request models
@pytest.mark.parametrize(("path", "body"), [
    ("/api/model", {"model": "toy"}),
    ("/api/capture", {"text": SENTENCE, "model": "toy"}),
    ("/api/capture.zip", {"text": SENTENCE, "model": "toy"}),
    ("/api/topk", {"text": SENTENCE, "model": "toy", "layer": 0, "head": 0}),
    ("/api/induction", {"model": "toy", "ids": [1, 2, 1, 2]}),
    ("/api/explain", {"text": SENTENCE, "token": 1}),
])
def test_every_route_reads_a_declared_model(path: str, body: dict[str, Any]) -> None:
    """Each route's body is a pydantic model: unknown fields (also inside 'toy') are refused
    with the fields it has, a null is a field left out, and the body as declared works."""
    from starlette.testclient import TestClient

    from attnviz.server.app import create_app
    from attnviz.server.requests import (
        CaptureRequest,
        ExplainRequest,
        InductionRequest,
        ModelRequest,
        TopkRequest,
        WeightsRequest,
    )

    model = {"/api/model": ModelRequest, "/api/capture": WeightsRequest,
             "/api/capture.zip": CaptureRequest, "/api/topk": TopkRequest,
             "/api/induction": InductionRequest, "/api/explain": ExplainRequest}[path]
    assert model.model_config.get("extra") == "forbid"
    client = TestClient(create_app(["toy"]), base_url=BASE)
    assert client.post(path, json=body).status_code == 200
    nulls = {name: None for name in model.model_fields if name not in body}
    assert client.post(path, json={**body, **nulls}).status_code == 200
    error = client.post(path, json={**body, "cache_dir": "/tmp", "out": "x"}).json()["error"]
    assert error["status"] == 422 and error["message"] == (
        "unknown field(s) in the request body: 'cache_dir', 'out'")
    assert error["hint"] == f"the fields are {', '.join(sorted(model.model_fields))}"
    nested = client.post(path, json={**body, "toy": {"layers": 1, "path": "/etc"}}).json()
    assert nested["error"]["message"] == "unknown field(s) in 'toy': 'path'"
    assert nested["error"]["hint"] == ("the fields are causal, d_model, heads, layers, scale, "
                                       "seed")


def test_no_token_warning_names_the_port_bound(invoke: Any,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """--port 0 --no-token on another host: the warning names the port the system chose (it
    said ':0'). Nothing binds outside loopback here: the socket is made on 127.0.0.1."""
    import attnviz.cli.serve as serve_cli

    real_bind = serve_cli._bind
    served: list[int] = []
    monkeypatch.setattr(serve_cli, "_bind", lambda host, port: real_bind("127.0.0.1", port))
    monkeypatch.setattr(serve_cli, "_serve", lambda sock, *args, **kwargs: served.append(
        sock.getsockname()[1]))
    result = invoke("serve", "--model", "toy", "--host", "0.0.0.0", "--port", "0",
                    "--no-token")
    assert result.exit_code == 0, result.output
    assert served and served[0] != 0
    said = " ".join(result.stderr.split())
    assert f"anyone who can reach 0.0.0.0:{served[0]} can use this server" in said
