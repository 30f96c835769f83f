"""The JSON API of ``attnviz serve`` (Starlette's TestClient) and the ``--server`` client.

One app per module serves the toy model and the session's MiniLM (the ``minilm`` fixture, not a
second load). Every bad input gets its 4xx with the CLI's message, and the server keeps
answering afterwards; the numbers from the API and from ``--server`` equal a local capture.
"""

from __future__ import annotations

import io
import json
import socket
import threading
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from starlette.testclient import TestClient

from attnviz.analysis.tokens import token_view
from attnviz.analysis.topk import topk_rows
from attnviz.capture import load_capture
from attnviz.errors import InputError
from attnviz.models.toy import ToyConfig, ToySource
from attnviz.render.html import decode_weights
from attnviz.server.app import create_app
from attnviz.server.client import RemoteSession, ServerError, capture_from_payload
from attnviz.server.engine import ApiError, Engine, Limits, decode_float32
from attnviz.session import Session
from tests._servers import thread_server

SENTENCE = "The cat sat on the mat"
BASE = "http://127.0.0.1:8000"


@pytest.fixture(scope="module")
def app(patched_minilm: Any) -> Any:
    return create_app(["minilm", "toy"], limits=Limits(max_body_bytes=64 * 1024,
                                                       max_chars=5000, max_tokens=128))


@pytest.fixture(scope="module")
def client(app: Any) -> TestClient:
    return TestClient(app, base_url=BASE)


def _error(response: Any, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert error["status"] == status and error["message"]
    return error


def _still_answers(client: TestClient) -> None:
    assert client.get("/api/health").json()["status"] == "ok"
    response = client.post("/api/capture", json={"text": SENTENCE, "model": "toy"})
    assert response.status_code == 200
    assert response.json()["tokens"] == ["The", "cat", "sat", "on", "the", "mat"]


def _local_toy(text: str, **config: Any) -> Any:
    return ToySource(ToyConfig(**config), device="cpu").capture(text)


# --------------------------------------------------------------------------- page and health
def test_page_and_assets_are_served_with_a_strict_policy(client: TestClient) -> None:
    page = client.get("/")
    assert page.status_code == 200
    policy = page.headers["content-security-policy"]
    assert "default-src 'none'" in policy and "script-src 'self'" in policy
    assert "connect-src 'self'" in policy and "unsafe" not in policy
    assert page.headers["x-content-type-options"] == "nosniff"
    html = page.text
    assert '<template id="report-body">' in html and 'id="hm-canvas"' in html
    assert "http://" not in html and "https://" not in html  # nothing from elsewhere
    for name, kind in (("report.js", "javascript"), ("live.js", "javascript"),
                       ("report.css", "css"), ("live.css", "css")):
        asset = client.get(f"/assets/{name}")
        assert asset.status_code == 200 and kind in asset.headers["content-type"]
    # Only the fixed list: no request names a file.
    for path in ("/assets/../session.py", "/assets/template.html", "/assets/%2e%2e/app.py",
                 "/static/report.js"):
        assert client.get(path).status_code == 404


def test_health_and_models(client: TestClient) -> None:
    health = client.get("/api/health").json()
    assert health["status"] == "ok" and health["models"] == ["minilm", "toy"]
    info = client.get("/api/models").json()
    assert [m["name"] for m in info["models"]] == ["minilm", "toy"]
    assert info["default"] == "minilm" and info["allow_any_model"] is False
    assert info["limits"]["max_tokens"] == 128
    described = client.post("/api/model", json={"model": "minilm"}).json()
    assert (described["num_layers"], described["num_heads"]) == (6, 12)


# --------------------------------------------------------------------------- numbers
def test_float32_capture_equals_a_local_capture(client: TestClient, minilm: Any) -> None:
    local = minilm.capture(SENTENCE, "A dog barked")
    payload = client.post("/api/capture", json={"text": SENTENCE, "pair": "A dog barked",
                                                "weights": "float32"}).json()
    remote = capture_from_payload(payload)
    assert remote.tokens == local.tokens and remote.special == local.special
    assert remote.word_ids == local.word_ids and remote.pair == "A dog barked"
    np.testing.assert_array_equal(remote.weights, local.weights)


def test_quantised_weights_are_within_their_step(client: TestClient) -> None:
    local = _local_toy(SENTENCE, heads=4, layers=2, d_model=32, causal=True)
    toy = {"heads": 4, "layers": 2, "d_model": 32, "causal": True}
    for fmt, step in (("q8", 1 / 510), ("q16", 1 / 131070)):
        payload = client.post("/api/capture", json={"text": SENTENCE, "model": "toy", "toy": toy,
                                                    "weights": fmt, "stats": True}).json()
        weights = decode_weights(payload["weights"])
        assert np.abs(weights - local.weights).max() <= step + 1e-7
        assert payload["causal"] is True and len(payload["stats"]) == 8  # 2 layers x 4 heads


def test_selections_equal_a_local_selection(client: TestClient, minilm: Any) -> None:
    local = minilm.capture(SENTENCE).select([1, 5], [0, 3, 11])
    payload = client.post("/api/capture", json={"text": SENTENCE, "layers": "1,5",
                                                "heads": [0, 3, 11], "weights": "float32"}).json()
    assert payload["layers"] == [1, 5] and payload["heads"] == [0, 3, 11]
    np.testing.assert_allclose(decode_float32(payload["weights"]), local.weights, atol=1e-6)


def test_topk_matches_the_cli(client: TestClient, invoke: Any) -> None:
    result = invoke("top-k", SENTENCE, "--model", "toy", "--toy-heads", "4", "--d-model", "32",
                    "--layer", "0", "--head", "2", "-k", "2", "--format", "csv", "--no-cache")
    assert result.exit_code == 0, result.output
    body = {"text": SENTENCE, "model": "toy", "toy": {"heads": 4, "d_model": 32}, "layer": 0,
            "head": 2, "k": 2}
    csv_response = client.post("/api/topk", json={**body, "format": "csv"})
    assert csv_response.headers["content-type"].startswith("text/csv")
    assert "attachment" in csv_response.headers["content-disposition"]
    assert csv_response.text == result.stdout
    cli_json = json.loads(invoke("top-k", SENTENCE, "--model", "toy", "--toy-heads", "4",
                                 "--d-model", "32", "--layer", "0", "--head", "mean", "-k", "2",
                                 "--format", "json", "--no-cache").stdout)
    api_json = client.post("/api/topk", json={**body, "head": "mean"}).json()
    assert api_json["rows"] == cli_json["rows"] and api_json["title"] == cli_json["title"]


def test_topk_of_a_word_view_matches_the_cli(client: TestClient, invoke: Any,
                                            cli_minilm: Any) -> None:
    text = "Tokenization of unbelievable sentences"
    result = invoke("top-k", text, "--layer", "2", "--head", "7", "--words",
                    "--exclude-special", "--format", "json", "--no-cache")
    assert result.exit_code == 0, result.output
    api = client.post("/api/topk", json={"text": text, "layer": 2, "head": 7, "k": 3,
                                         "words": True, "exclude_special": True}).json()
    assert api["rows"] == json.loads(result.stdout)["rows"]
    assert "word level" in api["title"]


def test_a_row_and_a_head_mean(client: TestClient, minilm: Any) -> None:
    view = token_view(minilm.capture(SENTENCE), exclude_special=True)
    row = client.post("/api/topk", json={"text": SENTENCE, "layer": -1, "head": [2, 9],
                                         "exclude_special": True, "k": 4, "query": 1}).json()
    expected = (view.matrix(5, 2) + view.matrix(5, 9)) / 2
    np.testing.assert_allclose(row["row"]["weights"], expected[1], atol=1e-6)
    order = np.argsort(-expected[1], kind="stable")[:4]
    assert [e["key_index"] for e in row["row"]["top"]] == order.tolist()
    assert row["row"]["query"] == view.display_tokens[1] == "cat"
    assert row["title"].startswith("minilm: layer 5, mean of heads 2, 9")
    rows = client.post("/api/topk", json={"text": SENTENCE, "layer": 5, "head": [2, 9],
                                          "exclude_special": True, "k": 4}).json()["rows"]
    assert rows == topk_rows(expected, view.display_tokens, 4)


def test_explain_matches_the_cli(client: TestClient, invoke: Any) -> None:
    result = invoke("explain", SENTENCE, "--token", "mat", "--causal", "--no-scale",
                    "--toy-heads", "2", "--head", "1", "--format", "json")
    assert result.exit_code == 0, result.output
    cli = json.loads(result.stdout)
    api = client.post("/api/explain", json={"text": SENTENCE, "token": 5, "head": 1,
                                            "toy": {"causal": True, "scale": False}}).json()
    for key in ("weights", "scores", "scaled", "masked", "output", "tokens", "q",
                "other_scaling_weights"):
        assert api[key] == cli[key], key
    assert api["causal"] is True and api["scaling"] is False and api["d_k"] == 8
    # The explanation's weights are the capture's, for the same toy settings.
    local = _local_toy(SENTENCE, causal=True, scale=False)
    np.testing.assert_allclose(api["weights"], local.weights[0, 1, 5], atol=1e-6)


def test_capture_zip_loads_back(client: TestClient, minilm: Any, tmp_path: Path) -> None:
    response = client.post("/api/capture.zip", json={"text": SENTENCE})
    assert response.headers["content-type"] == "application/zip"
    assert ".zip" in response.headers["content-disposition"]
    with zipfile.ZipFile(io.BytesIO(response.content)) as archive:
        assert sorted(archive.namelist()) == ["attention.npy", "capture.json"]
        archive.extractall(tmp_path / "cap")
    loaded = load_capture(tmp_path / "cap")
    np.testing.assert_array_equal(loaded.weights, minilm.capture(SENTENCE).weights)
    assert loaded.tokens[1:3] == ["the", "cat"]


# --------------------------------------------------------------------------- bad input
def test_huge_bodies_get_413(client: TestClient) -> None:
    huge = json.dumps({"text": "word " * 20_000}).encode()
    _error(client.post("/api/capture", content=huge,
                       headers={"content-type": "application/json"}), 413)
    declared = client.post("/api/capture", content=b"{}", headers={
        "content-type": "application/json", "content-length": "999999999"})
    assert declared.status_code in (400, 413)
    error = _error(client.post("/api/capture", json={"text": "word " * 1100}), 413)
    assert "5,000" in error["message"] and "--max-chars" in error["hint"]
    _still_answers(client)


@pytest.mark.parametrize(("body", "status", "words"), [
    (b"{not json", 400, "not valid JSON"),
    (b"[" * 50_000, 400, "nested too deeply"),
    (b"\xff\xfe\x00", 400, "not valid JSON"),
    (b"[1, 2]", 422, "must be a JSON object"),
    (b'"text"', 422, "must be a JSON object"),
    (b"null", 422, "must be a JSON object"),
])
def test_malformed_json(client: TestClient, body: bytes, status: int, words: str) -> None:
    response = client.post("/api/capture", content=body,
                           headers={"content-type": "application/json"})
    assert words in _error(response, status)["message"]
    _still_answers(client)


@pytest.mark.parametrize(("body", "words"), [
    ({"text": 5}, "'text' must be a string"),
    ({"text": ["a"]}, "'text' must be a string"),
    ({"text": SENTENCE, "pair": 1.5}, "'pair' must be a string"),
    ({"text": SENTENCE, "truncate": "yes"}, "'truncate' must be true or false"),
    ({"text": SENTENCE, "max_tokens": "10"}, "'max_tokens' must be an integer"),
    ({"text": SENTENCE, "max_tokens": 0}, "between 1 and"),
    ({"text": SENTENCE, "max_tokens": True}, "'max_tokens' must be an integer"),
    ({"text": SENTENCE, "layers": {"a": 1}}, "'layers' must be a selection"),
    ({"text": SENTENCE, "heads": [1, "2"]}, "'heads' must be a selection"),
    ({"text": SENTENCE, "weights": "float64"}, "'weights' must be one of q8, q16, float32"),
    ({"text": SENTENCE, "stats": 1}, "'stats' must be true or false"),
    ({"text": SENTENCE, "model": 3}, "'model' must be a string"),
    ({"text": SENTENCE, "model": "toy", "toy": {"d_model": 100_000}}, "'d_model' is 100000"),
    ({"text": SENTENCE, "model": "toy", "toy": {"heads": 3}}, "not divisible"),
    ({"text": SENTENCE, "model": "toy", "toy": {"causal": "no"}}, "'causal' must be true"),
    ({"text": SENTENCE, "model": "toy", "toy": [1]}, "'toy' must be a JSON object"),
    ({"text": SENTENCE, "toy": {"causal": True}}, "for the toy model only"),
    ({"pair": SENTENCE}, "'text' is missing"),
    ({"text": "   "}, "the text is empty"),
    ({"text": "a\x00b"}, "NUL character"),
    ({"text": SENTENCE, "layers": "0,,2"}, "empty item between commas"),
    ({"text": SENTENCE, "layers": "9"}, "layer 9 is out of range: this model has 6 layers"),
    ({"text": SENTENCE, "heads": "0-12"}, "head 12 is out of range: this model has 12 heads"),
    ({"text": SENTENCE, "max_tokens": 500}, "above this server's limit of 128 tokens"),
    ({"text": "word " * 300, "truncate": False}, "more than the limit of 128 tokens"),
])
def test_wrong_fields_get_422_with_the_cli_message(client: TestClient, body: dict[str, Any],
                                                   words: str) -> None:
    error = _error(client.post("/api/capture", json=body), 422)
    assert words in error["message"], error
    _still_answers(client)


@pytest.mark.parametrize("field", ["head", "heads", "layers"])
def test_long_lists_name_their_bound(client: TestClient, field: str) -> None:
    body: dict[str, Any] = {"text": "a b c", "model": "toy", "layer": 0, "head": 0}
    path = "/api/topk" if field == "head" else "/api/capture"
    if field != "head":
        body.pop("layer"), body.pop("head")
    body[field] = [0] * 4097
    error = _error(client.post(path, json=body), 413)
    assert f"'{field}' lists 4097 items; at most 4096" in error["message"]
    body[field] = []
    assert "empty list" in _error(client.post(path, json=body), 422)["message"]


def test_a_view_with_no_tokens_left_is_the_cli_error(client: TestClient, invoke: Any) -> None:
    body = {"text": "[CLS] [SEP]", "model": "minilm", "layer": 0, "head": 0,
            "exclude_special": True}
    error = _error(client.post("/api/topk", json=body), 422)
    cli = invoke("top-k", "[CLS] [SEP]", "--layer", "0", "--head", "0", "--exclude-special")
    assert cli.exit_code == 2
    assert error["message"] in " ".join(cli.stderr.split())
    assert "no tokens are left after --exclude-special" in error["message"]


def test_layer_out_of_range_says_what_the_cli_says(client: TestClient, invoke: Any) -> None:
    cli = invoke("top-k", SENTENCE, "--model", "toy", "--layer", "3", "--head", "0")
    assert cli.exit_code == 2
    error = _error(client.post("/api/topk", json={"text": SENTENCE, "model": "toy", "layer": 3,
                                                  "head": 0}), 422)
    assert error["message"] == "layer 3 is out of range: this model has 1 layer (0..0 or -1..-1)"
    assert error["message"] in " ".join(cli.stderr.split())
    head = _error(client.post("/api/topk", json={"text": SENTENCE, "model": "toy", "layer": 0,
                                                 "head": 7}), 422)
    assert head["message"].startswith("head 7 is out of range")
    for body in ({"layer": "0", "head": 0}, {"head": 0}, {"layer": 0, "head": "first"},
                 {"layer": 0, "head": 0, "k": 0}, {"layer": 0, "head": 0, "k": 1000},
                 {"layer": 0, "head": 0, "format": "xlsx"},
                 {"layer": 0, "head": 0, "query": 99}):
        _error(client.post("/api/topk", json={"text": SENTENCE, "model": "toy", **body}), 422)
    _still_answers(client)


@pytest.mark.parametrize("path", ["/etc/passwd", "../../etc/passwd", "~/.ssh/id_rsa",
                                  "C:\\Windows\\win.ini", "file:///etc/passwd", "/tmp"])
def test_a_path_in_any_field_is_refused(client: TestClient, path: str) -> None:
    assert "not served here" in _error(
        client.post("/api/capture", json={"text": SENTENCE, "model": path}), 404)["message"]
    for field in ("out", "path", "file", "cache_dir", "from", "folder"):
        error = _error(client.post("/api/capture", json={"text": SENTENCE, field: path}), 422)
        assert "unknown field" in error["message"]
    for field in ("layers", "heads"):
        _error(client.post("/api/capture", json={"text": SENTENCE, field: path}), 422)
    _error(client.post("/api/capture", json={"text": SENTENCE, "weights": path}), 422)
    _error(client.post("/api/topk", json={"text": SENTENCE, "layer": 0, "head": 0,
                                          "format": path}), 422)
    _error(client.post("/api/explain", json={"text": SENTENCE, "token": 0, "model": path}), 422)
    # A path as the text is only text: its characters are the tokens, nothing is read.
    tokens = client.post("/api/capture", json={"text": path, "model": "toy"}).json()["tokens"]
    assert "root" not in tokens and len(tokens) <= len(path)
    _still_answers(client)


def test_wrong_methods_types_and_routes(client: TestClient) -> None:
    _error(client.get("/api/capture"), 405)
    _error(client.post("/api/health", json={}), 405)
    _error(client.get("/api/nothing"), 404)
    response = client.post("/api/capture", content=json.dumps({"text": SENTENCE}),
                           headers={"content-type": "text/plain"})
    assert "application/json" in _error(response, 415)["message"]
    _still_answers(client)


def test_explain_needs_the_toy_model(client: TestClient, patched_minilm: Any) -> None:
    _error(client.post("/api/explain", json={"text": SENTENCE, "token": 0, "model": "minilm"}),
           422)
    assert "no token 'dog'" in _error(client.post("/api/explain", json={
        "text": SENTENCE, "token": "dog"}), 422)["message"]
    _error(client.post("/api/explain", json={"text": SENTENCE, "token": None}), 422)
    only_minilm = TestClient(create_app(["minilm"]), base_url=BASE)
    assert "--model toy" in _error(only_minilm.post("/api/explain", json={
        "text": SENTENCE, "token": 0}), 404)["hint"]


def test_wrong_host_is_refused(client: TestClient) -> None:
    error = _error(client.get("/api/health", headers={"host": "attacker.example:8000"}), 403)
    assert "answers only to" in error["message"]
    assert client.get("/", headers={"host": "localhost:8000"}).status_code == 200
    assert client.get("/", headers={"host": "[::1]:8000"}).status_code == 200
    assert client.get("/", headers={"host": "127.0.0.1"}).status_code == 200
    assert client.get("/", headers={"host": "localhost:"}).status_code == 200  # empty port
    # a header that only starts like an allowed name is not that name
    for host in ("127.0.0.1:8000@attacker.example", "localhost:x", "[::1]@attacker.example",
                 "127.0.0.1:8000:1", "[::1]:80x"):
        _error(client.get("/api/health", headers={"host": host}), 403)


# --------------------------------------------------------------------------- token
def test_a_token_is_needed_beyond_localhost(patched_minilm: Any) -> None:
    app = create_app(["toy"], token="s3cret-token", allowed_hosts=None)
    client = TestClient(app, base_url="http://192.0.2.10:8000", follow_redirects=False)
    missing = _error(client.get("/api/models"), 401)
    assert "token" in missing["message"]
    assert client.get("/").status_code == 401
    _error(client.get("/api/models", headers={"authorization": "Bearer wrong"}), 403)
    _error(client.post("/api/capture", json={"text": SENTENCE},
                       headers={"x-attnviz-token": "nope"}), 403)
    _error(client.get("/api/models?token=s3cret-tokenX"), 403)
    ok = client.get("/api/models", headers={"authorization": "Bearer s3cret-token"})
    assert ok.status_code == 200
    assert client.post("/api/capture", json={"text": SENTENCE},
                       headers={"x-attnviz-token": "s3cret-token"}).status_code == 200
    # Opening the page with ?token= sets a cookie and drops the token from the address.
    opened = client.get("/?token=s3cret-token&x=1")
    assert opened.status_code == 303 and opened.headers["location"] == "/?x=1"
    assert "httponly" in opened.headers["set-cookie"].lower()
    assert client.get("/api/models").status_code == 200  # the cookie now
    assert client.get("/").status_code == 200


# --------------------------------------------------------------------------- queue, timeout
def test_a_full_queue_gets_503_and_clears(client: TestClient, app: Any) -> None:
    engine = app.state.engine
    from attnviz.models import ModelSpec
    from attnviz.session import spec_key

    key = spec_key(ModelSpec(name="toy", toy=ToyConfig()))
    held = [engine.admit(key) for _ in range(engine.limits.queue + 1)]
    with pytest.raises(ApiError) as info:
        engine.admit(key)
    assert info.value.status == 503
    response = client.post("/api/capture", json={"text": SENTENCE, "model": "toy"})
    assert "busy" in _error(response, 503)["message"]
    assert response.headers["retry-after"] == "1"
    for release in held:
        release()
    assert engine.pending() == 0
    _still_answers(client)


def test_a_request_that_takes_too_long_gets_503(patched_minilm: Any) -> None:
    gate = threading.Event()

    class Slow(Session):
        def capture(self, *args: Any, **kwargs: Any) -> Any:
            gate.wait(10)
            return super().capture(*args, **kwargs)

    app = create_app(["toy"], session=Slow(use_cache=False),
                     limits=Limits(timeout_s=0.3, queue=1))
    client = TestClient(app, base_url=BASE)
    started = time.perf_counter()
    error = _error(client.post("/api/capture", json={"text": SENTENCE}), 503)
    assert "no answer within 0.3 s" in error["message"]
    assert time.perf_counter() - started < 5
    gate.set()
    deadline = time.monotonic() + 10
    while app.state.engine.pending() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert app.state.engine.pending() == 0  # the abandoned work gave its place back
    assert client.post("/api/capture", json={"text": SENTENCE}).status_code == 200


def test_a_model_that_fails_to_load_is_an_error_not_a_dead_server(tmp_path: Path) -> None:
    missing = str(tmp_path / "no-such-model")
    client = TestClient(create_app([missing, "toy"]), base_url=BASE)
    error = _error(client.post("/api/capture", json={"text": SENTENCE, "model": missing}), 500)
    assert error["type"] == "ModelLoadError" and "does not exist" in error["message"]
    listed = client.get("/api/models").json()["models"][0]
    assert listed["loaded"] is False and "does not exist" in listed["error"]
    assert client.post("/api/capture", json={"text": SENTENCE, "model": "toy"}).status_code == 200


def test_engine_limits_are_checked() -> None:
    with pytest.raises(Exception, match="--queue"):
        Engine(["toy"], limits=Limits(queue=-1))
    with pytest.raises(Exception, match="--timeout"):
        Engine(["toy"], limits=Limits(timeout_s=0))
    assert Engine([]).models == ["minilm"]


# --------------------------------------------------------------------------- --server
@pytest.fixture(scope="module")
def server_url(app: Any) -> Iterator[str]:
    """The module's app on a real port (uvicorn in a thread of this process)."""
    with thread_server(app) as url:
        yield url


def test_remote_session_equals_a_local_capture(server_url: str, minilm: Any) -> None:
    remote = RemoteSession(server_url)
    cap = remote.capture(SENTENCE, "A dog barked", layers="0,5", heads=[3])
    local = minilm.capture(SENTENCE, "A dog barked", layers=[0, 5], heads=[3])
    np.testing.assert_array_equal(cap.weights, local.weights)
    assert (cap.layers, cap.heads, cap.tokens) == (local.layers, local.heads, local.tokens)
    source = remote.source("minilm")
    assert (source.num_layers, source.num_heads) == (6, 12)
    results = list(remote.captures([(SENTENCE, None), ("   ", None), ("A dog", None)],
                                   model="toy"))
    assert isinstance(results[1], InputError)
    np.testing.assert_array_equal(results[2].weights, _local_toy("A dog").weights)
    with pytest.raises(Exception, match="dtype='float16' cannot be used with a RemoteSession"):
        remote.capture(SENTENCE, dtype="float16")  # a Python caller's words
    with pytest.raises(Exception, match="--dtype float16 cannot be used with --server"):
        RemoteSession(server_url, python=False).capture(SENTENCE, dtype="float16")  # the CLI's


def test_cli_with_server_equals_local(server_url: str, invoke: Any, cli_minilm: Any,
                                      tmp_path: Path) -> None:
    for args in (("top-k", SENTENCE, "--layer", "5", "--head", "3", "--format", "csv"),
                 ("top-k", SENTENCE, "--model", "toy", "--causal", "--layer", "0", "--head",
                  "mean", "--format", "json"),
                 ("heads", SENTENCE, "--format", "csv"),
                 ("heads", "A B C A B C", "--model", "toy", "--causal", "--format", "csv")):
        local = invoke(*args, "--no-cache")
        remote = invoke(*args, "--server", server_url)
        assert local.exit_code == 0 and remote.exit_code == 0, remote.output
        assert remote.stdout == local.stdout, args
    dumped = invoke("dump", SENTENCE, "--layers", "2-3", "-o", tmp_path / "remote",
                    "--server", server_url)
    assert dumped.exit_code == 0, dumped.output
    loaded = load_capture(tmp_path / "remote")
    np.testing.assert_array_equal(loaded.weights,
                                  cli_minilm.capture(SENTENCE, layers=[2, 3]).weights)
    drawn = invoke("heatmap", SENTENCE, "--layer", "1", "--head", "2", "-o", tmp_path / "h.png",
                   "--server", server_url)
    assert drawn.exit_code == 0, drawn.output
    from PIL import Image

    assert Image.open(tmp_path / "h.png").size[0] > 100


def test_compare_with_server_equals_local(server_url: str, invoke: Any, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    args = ("compare", "The cat sat on the mat", "The dog sat on the mat", "--model", "toy",
            "--layer", "0", "--head", "1", "--format", "json")
    local = invoke(*args, "-o", tmp_path / "local.png")
    remote = invoke(*args, "-o", tmp_path / "remote.png", "--server", server_url)
    assert local.exit_code == 0 and remote.exit_code == 0, remote.output
    remote_json, local_json = json.loads(remote.stdout), json.loads(local.stdout)
    assert remote_json.pop("image").endswith("remote.png")
    assert local_json.pop("image").endswith("local.png")
    assert remote_json == local_json and remote_json["changes"]
    assert (tmp_path / "remote.png").read_bytes() == (tmp_path / "local.png").read_bytes()
    # It really goes to the server: a dead one is an error, not a silent local run.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{probe.getsockname()[1]}"
    monkeypatch.setenv("ATTNVIZ_SERVER", dead)
    failed = invoke(*args, "-o", tmp_path / "dead.png")
    assert failed.exit_code == 1 and "cannot reach the attnviz server" in " ".join(
        failed.stderr.split())
    assert not (tmp_path / "dead.png").exists()


def test_batch_commands_with_server(server_url: str, invoke: Any, tmp_path: Path,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("The cat sat.\nA dog barked at the moon.\n\nBirds sing\n", encoding="utf-8")
    local = invoke("heads", "--input", corpus, "--model", "toy", "--format", "csv", "--no-cache")
    monkeypatch.setenv("ATTNVIZ_SERVER", server_url)  # the environment variable works too
    remote = invoke("heads", "--input", corpus, "--model", "toy", "--format", "csv")
    assert remote.exit_code == 0, remote.output
    assert remote.stdout == local.stdout
    exported = invoke("export", "--input", corpus, "--model", "toy", "--figures", "overview",
                      "--jobs", "1", "-o", tmp_path / "out")
    assert exported.exit_code == 0, exported.output
    index = json.loads((tmp_path / "out" / "index.json").read_text(encoding="utf-8"))
    folders = [tmp_path / "out" / entry["folder"] for entry in index["texts"]]
    assert len(folders) == 3
    for folder in folders:
        cap = load_capture(folder)
        np.testing.assert_array_equal(cap.weights, _local_toy(cap.text).weights)


def test_an_api_address_pasted_whole_names_its_server(invoke: Any, server_url: str) -> None:
    args = ("top-k", SENTENCE, "--model", "toy", "--layer", "0", "--head", "0", "-f", "csv")
    local = invoke(*args, "--no-cache")
    for url in (f"{server_url}/api/health", f"{server_url}/api/", f"{server_url}/"):
        remote = invoke(*args, "--server", url)
        assert remote.exit_code == 0, remote.output
        assert remote.stdout == local.stdout


def test_unreachable_or_wrong_server(invoke: Any, server_url: str) -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{probe.getsockname()[1]}"
    result = invoke("top-k", SENTENCE, "--layer", "0", "--head", "0", "--server", dead)
    assert result.exit_code == 1
    assert "cannot reach the attnviz server at " + dead in " ".join(result.stderr.split())
    assert "Traceback" not in result.output
    bad = invoke("heatmap", SENTENCE, "--server", "ftp://example.org")
    assert bad.exit_code == 2 and "http:// or https://" in bad.stderr
    unknown = invoke("top-k", SENTENCE, "--model", "gpt2", "--layer", "0", "--head", "0",
                     "--server", server_url)
    assert unknown.exit_code == 2 and "not served here" in " ".join(unknown.stderr.split())
    out_of_range = invoke("top-k", SENTENCE, "--layer", "9", "--head", "0", "--server",
                          server_url)
    assert out_of_range.exit_code == 2 and "layer 9 is out of range" in out_of_range.stderr
    with pytest.raises(ServerError, match="cannot reach"):
        RemoteSession(dead).capture(SENTENCE)


def test_server_needs_its_token_from_the_url(patched_minilm: Any) -> None:
    import uvicorn

    app = create_app(["toy"], token="tok-123", allowed_hosts=None)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not server.started:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        with pytest.raises(ServerError, match="needs its token"):
            RemoteSession(url).capture(SENTENCE)
        with pytest.raises(ServerError, match="the token is wrong"):
            RemoteSession(url + "/?token=bad").capture(SENTENCE)
        cap = RemoteSession(url + "/?token=tok-123").capture(SENTENCE, model="toy")
        np.testing.assert_array_equal(cap.weights, _local_toy(SENTENCE).weights)
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


# --------------------------------------------------------------------------- the command
def test_serve_refuses_a_busy_port_and_a_bad_host(invoke: Any) -> None:
    from attnviz.cli.serve import _address, _is_loopback

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        result = invoke("serve", "--model", "toy", "--port", str(port))
    assert result.exit_code == 1 and f"port {port} on 127.0.0.1 is in use" in result.stderr
    assert "--port 0" in result.stderr
    bad = invoke("serve", "--host", "no.such.host.invalid", "--port", "0")
    assert bad.exit_code == 2 and "cannot listen on host" in bad.stderr
    assert invoke("serve", "--queue", "-1").exit_code == 2
    assert [_is_loopback(h) for h in ("127.0.0.1", "localhost", "::1", "127.0.0.2",
                                      "0.0.0.0", "192.168.1.5", "example.org")] == [
        True, True, True, True, False, False, False]
    assert _address("0.0.0.0", 8000, "abc")[0] == "http://127.0.0.1:8000/?token=abc"
    assert _address("::1", 8001, None) == ["http://[::1]:8001/"]
