"""The zoomable long-context view: the server's /api/long routes and the offline atlas report.

A tiny random-weight Llama (GQA) is built in ``tmp_path`` and a few hundred tokens are captured
with the long path (``capture_long``), saved to a folder and loaded back. Every number the routes
and the report give is compared with the capture's own ``tile``/``atlas`` and, for the atlas,
with sums and maxima of exact tiles recomputed here; bad requests get their 4xx.
"""

from __future__ import annotations

import base64
import json
import re
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from starlette.testclient import TestClient

from attnviz.render.long_html import (
    MAX_ATLAS_SIDE,
    atlas_blocks,
    long_report_data,
    pool_atlas,
    read_long_report,
    render_long_html,
    report_levels,
    unpack_level,
)
from attnviz.server.app import create_app
from attnviz.server.engine import Limits
from tests.long_fixtures import build_tiny_llama, capture_tiny_llama

BASE = "http://127.0.0.1:8000"
TOKENS = 600


@pytest.fixture(scope="module")
def long_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = build_tiny_llama(tmp_path_factory.mktemp("tiny-llama-long"), positions=1024)
    return capture_tiny_llama(model, TOKENS, tmp_path_factory.mktemp("long") / "capture")


@pytest.fixture(scope="module")
def cap(long_folder: Path) -> Any:
    from attnviz.long import load_long

    return load_long(long_folder)


@pytest.fixture(scope="module")
def app(cap: Any) -> Any:
    return create_app(["toy"], long_capture=cap)


@pytest.fixture(scope="module")
def client(app: Any) -> TestClient:
    return TestClient(app, base_url=BASE)


@pytest.fixture(scope="module")
def key(app: Any) -> str:
    return str(app.state.long_store.default())


def _error(response: Any, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["status"] == status and error["message"]
    return dict(error)


def _b64(text: str, shape: list[int]) -> np.ndarray:
    return np.frombuffer(base64.b64decode(text), "<f4").reshape(shape)


def _rows(cap: Any, layer: int, head: int | str) -> np.ndarray:
    """The whole ``[T, T]`` matrix of one head, from exact tiles (small T only)."""
    T = cap.num_tokens
    return np.concatenate([cap.tile(layer, head, q0, min(T, q0 + 256), 0, T)
                           for q0 in range(0, T, 256)])


# --------------------------------------------------------------------------- the pieces
def test_atlas_blocks_and_pooling_follow_their_definition() -> None:
    assert atlas_blocks(16384) == [16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
    assert atlas_blocks(32768)[0] == 32 and atlas_blocks(600) == [16, 32, 64, 128, 256]
    assert atlas_blocks(3) == [16]
    for T in (5, 1000, 16384, 100_000):
        blocks = atlas_blocks(T)
        assert -(-T // blocks[0]) <= MAX_ATLAS_SIDE and -(-T // blocks[-1]) <= 4
        assert all(b2 == 2 * b1 for b1, b2 in zip(blocks, blocks[1:]))
    rng = np.random.default_rng(0)
    weights = rng.random((37, 37)).astype(np.float32)
    for block, factor in ((1, 2), (2, 4), (4, 2)):
        n = -(-37 // block)
        padded = np.zeros((n * block, n * block), np.float32)
        padded[:37, :37] = weights
        fine = padded.reshape(n, block, n, block)
        sums, maxes = pool_atlas(fine.sum((1, 3)), fine.max((1, 3)), factor)
        m = -(-37 // (block * factor))
        wide = np.zeros((m * block * factor,) * 2, np.float32)
        wide[:37, :37] = weights
        coarse = wide.reshape(m, block * factor, m, block * factor)
        np.testing.assert_allclose(sums, coarse.sum((1, 3)), rtol=1e-6)
        np.testing.assert_array_equal(maxes, coarse.max((1, 3)))


# --------------------------------------------------------------------------- routes
def test_the_view_describes_the_served_capture(client: TestClient, cap: Any, key: str
                                               ) -> None:
    info = client.post("/api/long/view", json={}).json()
    assert info["id"] == key and key.startswith("folder-")
    assert info["num_tokens"] == cap.num_tokens == TOKENS
    assert info["display_tokens"] == list(cap.display_tokens)
    assert (info["num_layers"], info["num_heads"]) == (cap.num_layers, cap.num_heads) == (2, 4)
    assert info["layers"] == [0, 1] and info["causal"] is True
    assert info["windows"] == [None, None]  # no sliding window (see test_notebook_long.py)
    assert info["atlas"] == {"blocks": [16, 32, 64, 128, 256], "mean": True}
    assert info["tile"] == {"max_values": Limits().long_max_weights, "view_side": 256}
    assert re.fullmatch("[0-9a-f]{1536}", info["palette"])
    assert client.post("/api/long/view", json={"id": key}).json()["id"] == key
    assert client.get("/api/models").json()["long"] == {"id": key, "num_tokens": TOKENS}
    assert "capture the text again" in _error(
        client.post("/api/long/view", json={"id": "nope"}), 404)["hint"]


@pytest.mark.parametrize("head", [0, 3, "mean", -1])
def test_tiles_equal_the_capture(client: TestClient, cap: Any, key: str,
                                 head: int | str) -> None:
    body = {"id": key, "layer": 1, "head": head, "q0": 300, "q1": 420, "k0": 250, "k1": 600}
    expected = cap.tile(1, head, 300, 420, 250, 600)
    answer = client.post("/api/long/tile", json=body).json()
    assert answer["shape"] == [120, 350]
    np.testing.assert_array_equal(_b64(answer["weights"], answer["shape"]), expected)
    raw = client.post("/api/long/tile", json={**body, "format": "float32"})
    assert raw.headers["content-type"] == "application/octet-stream"
    assert raw.headers["x-attnviz-shape"] == "120,350"
    np.testing.assert_array_equal(np.frombuffer(raw.content, "<f4").reshape(120, 350), expected)
    # causal: every key after its query is 0, and the weights are those of the rows
    later = np.arange(300, 420)[:, None] < np.arange(250, 600)[None, :]
    assert np.all(expected[later] == 0) and np.all(expected[~later] > 0)
    rows = cap.tile(1, head, 300, 420, 0, 600).astype(np.float64)
    np.testing.assert_allclose(rows.sum(axis=1), 1.0, atol=1e-5)


def test_atlas_levels_equal_the_capture_and_the_tiles(client: TestClient, cap: Any,
                                                      key: str) -> None:
    T = cap.num_tokens
    full = _rows(cap, 0, 2).astype(np.float64)
    for block in atlas_blocks(T):
        answer = client.post("/api/long/atlas",
                             json={"id": key, "layer": 0, "head": 2, "block": block}).json()
        n = -(-T // block)
        assert answer["shape"] == [n, n] and answer["block"] == block
        sums, maxes = _b64(answer["sums"], [n, n]), _b64(answer["maxes"], [n, n])
        want_sums, want_maxes = cap.atlas(0, 2, block)
        np.testing.assert_allclose(sums, want_sums, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(maxes, want_maxes, rtol=1e-6, atol=1e-7)
        padded = np.zeros((n * block, n * block))
        padded[:T, :T] = full
        blocks = padded.reshape(n, block, n, block)
        np.testing.assert_allclose(sums, blocks.sum((1, 3)), rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(maxes, blocks.max((1, 3)), rtol=1e-5, atol=1e-6)
    raw = client.post("/api/long/atlas", json={"id": key, "layer": -1, "head": "mean",
                                               "block": 64, "format": "float32"})
    assert raw.headers["x-attnviz-shape"] == "10,10"
    values = np.frombuffer(raw.content, "<f4")
    sums, maxes = cap.atlas(1, "mean", 64)
    np.testing.assert_allclose(values[:100].reshape(10, 10), sums, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(values[100:].reshape(10, 10), maxes, rtol=1e-6, atol=1e-7)


def test_the_page_and_its_assets(client: TestClient) -> None:
    page = client.get("/long")
    assert page.status_code == 200
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert '<script src="/assets/long.js"></script>' in page.text
    assert 'data-long-source="server"' in page.text
    assert "http://" not in page.text and "https://" not in page.text
    for name in ("long.js", "long.css"):
        assert client.get(f"/assets/{name}").status_code == 200


@pytest.mark.parametrize(("body", "status", "words"), [
    ({"layer": 0, "head": 0, "q0": 0, "q1": 601, "k0": 0, "k1": 1}, 422, "600 tokens"),
    ({"layer": 0, "head": 0, "q0": 9, "q1": 9, "k0": 0, "k1": 1}, 422, "9:9"),
    ({"layer": 0, "head": 0, "q0": -1, "q1": 9, "k0": 0, "k1": 1}, 422, "'q0'"),
    ({"layer": 2, "head": 0, "q0": 0, "q1": 1, "k0": 0, "k1": 1}, 422, "layer"),
    ({"layer": 0, "head": 4, "q0": 0, "q1": 1, "k0": 0, "k1": 1}, 422, "head"),
    ({"layer": 0, "head": True, "q0": 0, "q1": 1, "k0": 0, "k1": 1}, 422, "'head'"),
    ({"layer": 0, "head": [0, 1], "q0": 0, "q1": 1, "k0": 0, "k1": 1}, 422, "'head'"),
    ({"layer": "0", "head": 0, "q0": 0, "q1": 1, "k0": 0, "k1": 1}, 422, "'layer'"),
    ({"layer": 0, "head": 0, "q0": 0, "q1": 1.5, "k0": 0, "k1": 1}, 422, "'q1'"),
    ({"layer": 0, "head": 0, "q0": 0, "q1": 1, "k0": 0}, 422, "k1"),
    ({"layer": 0, "head": 0, "q0": 0, "q1": 1, "k0": 0, "k1": 1, "folder": "/etc"}, 422,
     "unknown field"),
    ({"layer": 0, "head": 0, "q0": 0, "q1": 1, "k0": 0, "k1": 1, "format": "npy"}, 422,
     "'format'"),
])
def test_hostile_tiles_are_refused(client: TestClient, key: str, body: dict[str, Any],
                                   status: int, words: str) -> None:
    error = _error(client.post("/api/long/tile", json={"id": key, **body}), status)
    assert words in error["message"] + (error["hint"] or "")
    assert client.post("/api/long/view", json={}).status_code == 200  # still answering


def test_hostile_sizes_and_bodies_are_refused(client: TestClient, key: str, cap: Any) -> None:
    small = create_app(["toy"], limits=Limits(long_max_weights=2000),
                       long_capture=client.app.state.long_store.get(key))
    bounded = TestClient(small, base_url=BASE)
    tile = {"id": key, "layer": 0, "head": 0, "q0": 0, "q1": 200, "k0": 0, "k1": 11}
    assert "at most 2,000" in _error(bounded.post("/api/long/tile", json=tile), 413)["message"]
    assert bounded.post("/api/long/tile", json={**tile, "k1": 10}).status_code == 200
    assert "2,000" in _error(bounded.post("/api/long/atlas", json={
        "id": key, "layer": 0, "head": 0, "block": 16}), 413)["message"]
    assert bounded.post("/api/long/atlas", json={
        "id": key, "layer": 0, "head": 0, "block": 32}).json()["shape"] == [19, 19]
    # the view offers only the levels the bound lets through: 2 x 38^2 = 2,888 values at 16
    assert bounded.post("/api/long/view", json={}).json()["atlas"]["blocks"] == [
        32, 64, 128, 256]
    error = _error(client.post("/api/long/atlas", json={"id": key, "layer": 0, "head": 0,
                                                        "block": 48}), 422)
    assert "power of two" in error["message"]
    _error(client.post("/api/long/atlas", json={"id": key, "layer": 0, "head": 0, "block": 8}),
           422)
    _error(client.post("/api/long/atlas", json={"id": key, "layer": 0, "block": 64}), 422)
    for layer, head, words in ((2, 0, "layer 2"), (-3, 0, "layer -3"), (0, 4, "head 4"),
                               (0, -5, "head -5")):
        for block in (16, 64):  # the finest level (cached) and a pooled one
            error = _error(client.post("/api/long/atlas", json={
                "id": key, "layer": layer, "head": head, "block": block}), 422)
            assert words in error["message"]
    last = client.post("/api/long/atlas", json={"id": key, "layer": -1, "head": -1,
                                                "block": 32}).json()
    np.testing.assert_allclose(_b64(last["sums"], last["shape"]), cap.atlas(1, 3, 32)[0],
                               rtol=1e-5, atol=1e-5)
    _error(client.post("/api/long/atlas", content=b"layer=0",
                       headers={"content-type": "application/x-www-form-urlencoded"}), 415)
    _error(client.post("/api/long/tile", content=b"{",
                       headers={"content-type": "application/json"}), 400)
    _error(client.post("/api/long/tile", content=b"[" * 100_000,
                       headers={"content-type": "application/json"}), 400)
    _error(client.post("/api/long/tile", content=b'{"q1": 1' + b"0" * 5000 + b"}",
                       headers={"content-type": "application/json"}), 400)
    _error(client.get("/api/long/tile"), 405)
    _error(client.post("/api/long/view", json={"id": 5}), 422)


def test_the_guards_cover_the_long_routes(cap: Any, key: str) -> None:
    client = TestClient(create_app(["toy"], long_capture=cap), base_url=BASE)
    for path in ("/long", "/assets/long.js"):
        assert client.get(path, headers={"host": "attacker.example:8000"}).status_code == 403
    body = {"id": key, "layer": 0, "head": 0, "q0": 0, "q1": 2, "k0": 0, "k1": 2}
    _error(client.post("/api/long/tile", json=body, headers={"host": "evil.example"}), 403)
    guarded = TestClient(create_app(["toy"], token="s3cret", allowed_hosts=None,
                                    long_capture=cap), base_url=BASE)
    _error(guarded.post("/api/long/tile", json=body), 401)
    _error(guarded.post("/api/long/atlas", json={"id": key, "layer": 0, "head": 0, "block": 64},
                        headers={"x-attnviz-token": "nope"}), 403)
    assert guarded.get("/long").status_code == 401
    ok = guarded.post("/api/long/tile", json=body, headers={"authorization": "Bearer s3cret"})
    assert ok.status_code == 200
    np.testing.assert_array_equal(_b64(ok.json()["weights"], [2, 2]), cap.tile(0, 0, 0, 2, 0, 2))


def test_without_a_long_capture_the_view_says_how_to_get_one() -> None:
    client = TestClient(create_app(["toy"]), base_url=BASE)
    assert client.get("/api/models").json()["long"] is None
    error = _error(client.post("/api/long/view", json={}), 404)
    assert "--long-from" in error["hint"] and "/long#id=" in error["hint"]
    assert client.get("/long").status_code == 200  # the page, which shows that message


# --------------------------------------------------------------------------- offline report
def test_report_levels_stay_within_the_budget() -> None:
    # 72 n^2 cells a level (2 x 4 layers x 9): 1,572,480 down to 128; 256 would add 4.7 M
    assert report_levels(16384, 4, 8) == [4096, 2048, 1024, 512, 256, 128]
    # docs/long.md: 32 layers x 32 heads at 128k tokens keep 4, 8 and 16 blocks a side
    assert report_levels(131072, 32, 32) == [32768, 16384, 8192]
    assert atlas_blocks(131072)[0] == 128
    for T, L, H, cells in ((16384, 4, 8, 1 << 21), (100_000, 32, 32, 1 << 21),
                           (600, 2, 4, 1000), (3, 1, 1, 1)):
        kept = report_levels(T, L, H, cells)
        assert kept and kept == sorted(kept, reverse=True)
        total = sum(2 * (-(-T // b)) ** 2 * L * (H + 1) for b in kept)
        assert total <= cells or len(kept) == 1
        finer = [b for b in atlas_blocks(T) if b < kept[-1]]
        if finer:
            assert total + 2 * (-(-T // finer[-1])) ** 2 * L * (H + 1) > cells


def test_the_offline_report_carries_the_atlas_and_statistics(cap: Any, tmp_path: Path,
                                                             invoke: Any, long_folder: Path
                                                             ) -> None:
    budget = 10_000
    data = long_report_data(cap, max_cells=budget)
    blocks = report_levels(TOKENS, 2, 4, budget)
    # 20 n^2 cells a level (2 x 2 layers x 5): 180 + 500 + 2,000 + 7,220 = 9,900; 16 adds 28,880
    assert blocks == [256, 128, 64, 32]
    assert data["atlas"]["blocks"] == sorted(blocks)
    assert [level["block"] for level in data["atlas"]["levels"]] == blocks
    for level in data["atlas"]["levels"]:
        for layer in (0, 1):
            for head in [*range(4), "mean"]:
                sums, maxes = unpack_level(level["heads"][str(layer)][str(head)], level["n"])
                want_sums, want_maxes = cap.atlas(layer, head, level["block"])
                np.testing.assert_allclose(sums, want_sums, rtol=1e-5, atol=1e-5)
                np.testing.assert_allclose(maxes, want_maxes, rtol=1e-6, atol=1e-7)
    assert data["display_tokens"] == list(cap.display_tokens)
    for name, values in cap.head_stats().items():
        np.testing.assert_allclose(np.asarray(data["stats"][name], float), values, atol=1e-6)
    sinks = np.asarray(cap.sinks(0.3))
    top = data["sinks"]["top"]
    assert [item["position"] for item in top] == [
        int(i) for i in np.argsort(-sinks, kind="stable")[:len(top)]]
    assert len(top) == min(20, int((sinks > 0).sum()))
    document = render_long_html(data)
    assert read_long_report(document)["atlas"] == json.loads(json.dumps(data["atlas"]))
    assert "http://" not in document and "https://" not in document
    assert "Content-Security-Policy" in document and 'data-long-source="offline"' in document

    out = tmp_path / "long.html"
    result = invoke("html", "--long-from", str(long_folder), "-o", str(out))
    assert result.exit_code == 0, result.output
    written = read_long_report(out.read_text(encoding="utf-8"))
    assert written["num_tokens"] == TOKENS and written["model"] == cap.model
    level = written["atlas"]["levels"][-1]
    assert level["block"] == 16  # 600 tokens: every level fits the default budget
    sums, _ = unpack_level(level["heads"]["1"]["mean"], level["n"])
    np.testing.assert_allclose(sums, cap.atlas(1, "mean", 16)[0], rtol=1e-5, atol=1e-5)


def test_a_report_embeds_exact_weights_when_they_fit_its_budget(cap: Any) -> None:
    """Exact ``[T, T]`` matrices of every head and mean, only within the cell budget."""
    T = TOKENS
    needed = T * T * 2 * 5
    assert "exact" not in long_report_data(cap, max_cells=needed - 1)
    data = long_report_data(cap, max_cells=needed)
    assert data["tile"] == {"max_values": T * T, "view_side": T}
    for layer in (0, 1):
        for head in [*range(4), "mean"]:
            raw = zlib.decompress(base64.b64decode(data["exact"][str(layer)][str(head)]))
            matrix = np.frombuffer(raw, "<f4").reshape(T, T)
            np.testing.assert_array_equal(matrix, cap.tile(layer, head, 0, T, 0, T))


def test_cli_mistakes_are_one_line_errors(invoke: Any, tmp_path: Path,
                                          long_folder: Path) -> None:
    result = invoke("html", "some text", "--long-from", str(long_folder), "-o",
                    str(tmp_path / "x.html"))
    assert result.exit_code == 2 and "--long-from cannot be combined" in result.output
    assert "Traceback" not in result.output
    result = invoke("html", "--long-from", str(long_folder), "--layers", "0", "-o",
                    str(tmp_path / "x.html"))
    assert result.exit_code == 2 and "do not go with --long-from" in result.output
    assert not (tmp_path / "x.html").exists()
    for command in (("html", "--long-from", str(tmp_path / "missing"), "-o",
                     str(tmp_path / "y.html")),
                    ("serve", "--long-from", str(tmp_path / "missing"), "--port", "0")):
        result = invoke(*command)
        assert result.exit_code in (1, 2) and "Error:" in result.output, result.output
        assert "Traceback" not in result.output
    assert not (tmp_path / "y.html").exists()
