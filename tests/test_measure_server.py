"""``measure`` over HTTP: the capture request body, the zip download, ``RemoteSession`` and
``--server``, against the measure computed directly on the bundled MiniLM."""

from __future__ import annotations

import io
import json
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from starlette.testclient import TestClient

from attnviz.capture import load_capture
from attnviz.render.html import decode_weights
from attnviz.server.app import create_app
from attnviz.server.client import RemoteSession, ServerError, capture_from_payload
from attnviz.server.engine import Limits
from tests._servers import thread_server
from tests.conftest import SENTENCE
from tests.test_measure_cli import NORM_LABEL, reference

BASE = "http://127.0.0.1:8000"


@pytest.fixture(scope="module")
def app(patched_minilm: Any) -> Any:
    return create_app(["minilm", "toy"], limits=Limits(max_body_bytes=64 * 1024,
                                                       max_chars=5000, max_tokens=128))


@pytest.fixture(scope="module")
def client(app: Any) -> TestClient:
    return TestClient(app, base_url=BASE)


@pytest.fixture(scope="module")
def norm_ref(minilm: Any) -> np.ndarray:
    return reference(minilm)


@pytest.fixture(scope="module")
def server_url(app: Any) -> Iterator[str]:
    """The module's app on a real port (uvicorn in a thread of this process)."""

    with thread_server(app) as url:
        yield url


def test_capture_body_takes_a_measure(client: TestClient, norm_ref: np.ndarray) -> None:
    response = client.post("/api/capture", json={"text": SENTENCE, "model": "minilm",
                                                 "measure": "norm", "layers": "1,4",
                                                 "weights": "float32"})
    assert response.status_code == 200, response.text
    cap = capture_from_payload(response.json())
    assert cap.measure == "norm" and cap.measure_label == NORM_LABEL
    np.testing.assert_allclose(cap.weights, norm_ref[[1, 4]], atol=1e-6)
    quantised = client.post("/api/capture", json={"text": SENTENCE, "model": "minilm",
                                                  "measure": "norm", "weights": "q16"}).json()
    np.testing.assert_allclose(decode_weights(quantised["weights"]), norm_ref,
                               atol=max(1.0, float(norm_ref.max())) / 65535)
    weights = client.post("/api/capture", json={"text": SENTENCE, "model": "minilm",
                                                "layers": "1", "weights": "float32"}).json()
    assert "measure" not in weights["meta"]  # a weights answer is as it was


def test_zip_download_keeps_the_measure(client: TestClient, norm_ref: np.ndarray,
                                        tmp_path: Path) -> None:
    response = client.post("/api/capture.zip", json={"text": SENTENCE, "model": "minilm",
                                                     "measure": "norm", "heads": "3"})
    assert response.status_code == 200, response.text
    with zipfile.ZipFile(io.BytesIO(response.content)) as archive:
        archive.extractall(tmp_path)
    folder = next(p.parent for p in tmp_path.rglob("capture.json"))
    cap = load_capture(folder)
    assert cap.measure == "norm"
    np.testing.assert_allclose(cap.weights, norm_ref[:, [3]], atol=1e-6)


@pytest.mark.parametrize("body, status, words", [
    ({"measure": "attention"}, 422, "'measure' must be one of weights, norm"),
    ({"measure": 3}, 422, "'measure' must be one of"),
    ({"model": "toy", "measure": "norm"}, 422, "toy model gives attention weights only"),
])
def test_bad_measures_are_refused(client: TestClient, body: dict[str, Any], status: int,
                                  words: str) -> None:
    response = client.post("/api/capture", json={"text": SENTENCE, **body})
    assert response.status_code == status, response.text
    assert words in response.json()["error"]["message"]


def test_remote_session_and_cli(server_url: str, invoke: Any, cli_minilm: Any,
                                norm_ref: np.ndarray) -> None:
    remote = RemoteSession(server_url)
    cap = remote.capture(SENTENCE, model="minilm", layers="2", measure="norm")
    assert cap.measure == "norm"
    np.testing.assert_allclose(cap.weights, norm_ref[[2]], atol=1e-6)
    args = ("top-k", SENTENCE, "--measure", "norm", "-l", "2", "--head", "5", "--format",
            "csv")
    local = invoke(*args, "--no-cache")
    served = invoke(*args, "--server", server_url)
    assert served.exit_code == 0, served.output
    assert served.stdout == local.stdout and served.stdout.splitlines()[0].endswith(",norm")


def test_remote_session_checks_the_answer_names_the_measure(
        server_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    remote = RemoteSession(server_url)
    real = RemoteSession.request

    def forgetful(self: RemoteSession, method: str, path: str,
                  body: dict[str, Any] | None = None) -> Any:
        if body is not None:
            body = {k: v for k, v in body.items() if k != "measure"}  # an older server
        return real(self, method, path, body)

    monkeypatch.setattr(RemoteSession, "request", forgetful)
    with pytest.raises(ServerError, match="it holds the measure weights, not norm"):
        remote.capture(SENTENCE, model="minilm", layers="0", measure="norm")


def test_topk_of_a_measure_matches_the_cli(client: TestClient, invoke: Any, cli_minilm: Any,
                                           norm_ref: np.ndarray) -> None:
    args = ("top-k", SENTENCE, "--measure", "norm", "--layer", "3", "--head", "6", "-k", "2",
            "--no-cache")
    body = {"text": SENTENCE, "model": "minilm", "measure": "norm", "layer": 3, "head": 6,
            "k": 2}
    csv_response = client.post("/api/topk", json={**body, "format": "csv"})
    assert csv_response.text == invoke(*args, "--format", "csv").stdout
    assert csv_response.text.splitlines()[0].endswith(",norm")
    cli_json = json.loads(invoke(*args, "--format", "json").stdout)
    api_json = client.post("/api/topk", json=body).json()
    assert api_json["measure"] == cli_json["measure"] == "norm"
    assert api_json["rows"] == cli_json["rows"] and api_json["title"] == cli_json["title"]
    row = client.post("/api/topk", json={**body, "query": 2}).json()["row"]
    np.testing.assert_allclose(row["weights"], norm_ref[3, 6, 2], atol=1e-6)
