"""Hostile long captures: a tampered ``dump --long`` folder, a hostile ``--server`` and bad
requests to ``/api/long/*`` give one-line errors, never a traceback, a 500 or silent nonsense.

A tiny random-weight Llama (GQA) captures about 200 tokens with ``dump --long``; each test
copies that folder and damages one thing in it.
"""

from __future__ import annotations

import base64
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from starlette.testclient import TestClient

from attnviz.errors import DumpError, UsageError
from tests._servers import tampering_proxy
from tests.long_fixtures import build_tiny_llama, long_text

TOKENS = 200
HOSTILE = "\x1b[31mRED\x1b]0;pwn\x07"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama-hostile"), positions=1024)


@pytest.fixture(scope="module")
def dumped(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real ``attnviz dump --long`` folder (through the CLI, in-process)."""
    from typer.testing import CliRunner

    from attnviz.cli import app

    out = tmp_path_factory.mktemp("dumped") / "cap"
    result = CliRunner().invoke(app, ["dump", "-", "--model", str(model_dir), "--long",
                                      "--max-tokens", str(TOKENS), "--truncate", "-o",
                                      str(out)], input=long_text(TOKENS + 40))
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture()
def folder(dumped: Path, tmp_path: Path) -> Path:
    """A copy of the dump to damage."""
    return Path(shutil.copytree(dumped, tmp_path / "cap"))


def _sidecar(folder: Path) -> dict[str, Any]:
    return dict(json.loads((folder / "long.json").read_text(encoding="utf-8")))


def _tamper(folder: Path, change: Callable[[dict[str, Any]], None]) -> None:
    sidecar = _sidecar(folder)
    change(sidecar)
    (folder / "long.json").write_text(json.dumps(sidecar), encoding="utf-8")


def _one_line_error(result: Any, code: int, *words: str) -> str:
    """The CLI failed with ``code``: ``Error: ...`` naming ``words``, no traceback."""
    assert result.exit_code == code, (result.exit_code, result.output, result.exception)
    assert result.exception is None or isinstance(result.exception, SystemExit)
    message = " ".join(result.stderr.split())
    assert message.startswith("Error: ") and "Traceback" not in result.output
    for word in words:
        assert word in message, message
    return message


# --------------------------------------------------------------------------- long.json
def _set(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def change(sidecar: dict[str, Any]) -> None:
        sidecar[key] = value(sidecar) if callable(value) else value

    return change


SIDECAR_CASES = [
    (_set("scales", [0.1]), "'scales' has 1 entries for 2 recorded layers"),
    (_set("windows", [None]), "'windows' has 1 entries for 2 recorded layers"),
    (_set("special", [True]), "'special' has 1 entries for"),
    (_set("display_tokens", lambda s: [None] * len(s["tokens"])),
     "display_tokens.0: Input should be a valid string"),
    (_set("tokens", []), "tokens: List should have at least 1 item"),
    (_set("word_ids", lambda s: ["x"] * len(s["tokens"])), "word_ids.0"),
    (_set("word_ids", lambda s: [-1] * len(s["tokens"])), "word_ids.0"),
    (_set("windows", [-5, None]), "windows.0"),
    (_set("windows", [0, None]), "windows.0"),
    (_set("windows", [2.5, None]), "windows.0"),
    (_set("num_heads", "8"), "num_heads: Input should be a valid integer"),
    (_set("num_layers", 1e12), "num_layers"),
    (_set("num_layers", 1 << 40), "num_layers: Input should be less than or equal to 4096"),
    (_set("num_kv_heads", 3), "num_heads 4 is not a multiple of num_kv_heads 3"),
    (_set("head_dim", 0), "head_dim"),
    (_set("layers", [1, 1]), "'layers' [1, 1] are not unique and in order"),
    (_set("layers", [1, 0]), "are not unique and in order"),
    (_set("layers", [0, 7]), "'layers' name layer 7 of a model of 2 layers"),
    (_set("causal", "no"), "causal: Input should be a valid boolean"),
    (_set("pair", 5), "pair"),
    (_set("dtype", "int8"), "dtype"),
    (_set("scales", [float("nan"), 0.3]), "scales.0"),
    (_set("scales", [float("inf"), 0.3]), "scales.0"),
    (_set("scales", [-0.3, 0.3]), "scales.0: Input should be greater than 0"),
    (_set("meta", [1]), "meta"),
    (lambda s: s.pop("tokens"), "tokens: Field required"),
]


@pytest.mark.parametrize(("change", "words"), SIDECAR_CASES)
def test_a_damaged_sidecar_is_refused_when_read(folder: Path, change: Any, words: str,
                                                invoke: Any) -> None:
    from attnviz.long import load_long

    _tamper(folder, change)
    with pytest.raises(DumpError) as refused:
        load_long(folder)
    assert refused.value.message.startswith(f"{folder / 'long.json'} is damaged: ")
    assert words in refused.value.message and "\n" not in refused.value.message
    assert refused.value.hint == "the long capture folder is damaged: capture again"
    _one_line_error(invoke("top-k", "--from", str(folder), "-l", "0", "--head", "0"), 1,
                    "long.json is damaged", words)


@pytest.mark.parametrize("command", [
    ("heads", "--from", "{f}"), ("heatmap", "--from", "{f}", "-l", "1", "-o", "{o}/h.png"),
    ("html", "--long-from", "{f}", "-o", "{o}/r.html"), ("export", "--from", "{f}", "-o", "{o}"),
    ("dump", "--from", "{f}", "-o", "{o}/d"), ("serve", "--long-from", "{f}", "--port", "0"),
])
def test_every_command_reports_a_short_scale_list(folder: Path, tmp_path: Path, invoke: Any,
                                                  command: tuple[str, ...]) -> None:
    _tamper(folder, _set("scales", [0.1]))
    args = [a.format(f=folder, o=tmp_path / "out") for a in command]
    result = invoke(*args)
    if command[0] == "export":  # export reports each damaged item, then fails
        assert result.exit_code == 1 and "scales" in result.output, result.output
        assert "Traceback" not in result.output
        return
    _one_line_error(result, 1, "long.json is damaged", "'scales' has 1 entries")


def test_deeply_nested_or_broken_json_is_a_damaged_capture(folder: Path, invoke: Any) -> None:
    from attnviz.long import load_long

    (folder / "long.json").write_text("[" * 100_000, encoding="utf-8")
    with pytest.raises(DumpError, match="nested too deeply"):
        load_long(folder)
    _one_line_error(invoke("heads", "--from", str(folder)), 1, "nested too deeply")
    (folder / "long.json").write_bytes(b"\xff\xfe{")
    with pytest.raises(DumpError, match="cannot read"):
        load_long(folder)
    (folder / "long.json").write_text("[]", encoding="utf-8")
    with pytest.raises(DumpError, match="is not a long capture sidecar"):
        load_long(folder)


def test_older_and_newer_sidecars_still_open(folder: Path, dumped: Path) -> None:
    """Unknown keys are ignored and optional ones may be missing; what is read is unchanged
    and a saved copy writes the same sidecar."""
    from attnviz.long import load_long

    reference = load_long(dumped)
    _tamper(folder, lambda s: (s.pop("pair"), s.pop("meta"), s.update(future={"x": 1})))
    cap = load_long(folder)
    assert cap.tokens == reference.tokens and cap.layers == reference.layers
    assert cap.scales == reference.scales and cap.windows == reference.windows
    assert cap.pair is None and cap.meta == {}
    np.testing.assert_array_equal(cap.tile(1, 2, 0, 50, 0, 50),
                                  reference.tile(1, 2, 0, 50, 0, 50))
    copy = reference.save(folder.parent / "copy")
    assert _sidecar(copy) == _sidecar(dumped)


# --------------------------------------------------------------------------- non-finite
@pytest.mark.parametrize(("kind", "value"), [("q", np.nan), ("k", np.inf), ("lse", -np.inf)])
def test_non_finite_arrays_are_refused_naming_the_file(folder: Path, invoke: Any, kind: str,
                                                       value: float,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    import attnviz.long.record as record
    from attnviz.long import load_long

    path = folder / f"{kind}_001.npy"
    array = np.load(path)
    array[..., -1] = value  # the last token only: the chunked check must reach it
    np.save(path, array)
    monkeypatch.setattr(record, "FINITE_CHUNK", 64)  # many chunks
    cap = load_long(folder)
    np.testing.assert_allclose(cap.tile(0, 0, 0, 10, 0, 10).sum(axis=1), 1.0, atol=1e-5)
    assert cap._finite == {0}  # layer 0 was checked once and is clean
    with pytest.raises(DumpError, match=f"{kind}_001.npy holds NaN or infinite values"):
        cap.tile(1, 0, 0, 10, 0, 10)
    _one_line_error(invoke("top-k", "--from", str(folder), "-l", "1", "--head", "0"), 1,
                    f"{kind}_001.npy holds NaN or infinite values", "capture again")


def test_bfloat16_nan_bits_are_found(model_dir: Path, tmp_path: Path, invoke: Any) -> None:
    from attnviz.long import load_long

    out = tmp_path / "bf16"
    result = invoke("dump", "-", "--model", str(model_dir), "--long", "--long-dtype",
                    "bfloat16", "-o", str(out), input=long_text(60))
    assert result.exit_code == 0, result.output
    cap = load_long(out)
    rows = cap.rows(0, 1, 0, 5)  # finite: read
    np.testing.assert_allclose(rows.sum(axis=1), 1.0, atol=1e-2)
    path = out / "k_000.npy"
    bits = np.load(path)
    assert bits.dtype == np.uint16
    bits[1, 3, 2] = 0x7FC0  # a bfloat16 NaN
    np.save(path, bits)
    with pytest.raises(DumpError, match="k_000.npy holds NaN"):
        load_long(out).rows(0, 1, 0, 5)


def test_huge_keys_overflow_into_an_error_not_nan_weights(folder: Path, invoke: Any) -> None:
    from attnviz.long import load_long

    path = folder / "k_000.npy"
    keys = np.load(path)
    keys[:] = 1e30  # finite, but every score overflows
    np.save(path, keys)
    cap = load_long(folder)
    for call in (lambda: cap.tile(0, 1, 0, 20, 0, 20), lambda: cap.topk(0, "mean", 3),
                 lambda: cap.atlas(0, 2, 64), lambda: cap.head_stats()):
        with pytest.raises(DumpError, match="keys of layer 0 .* are too large: their scores "
                                            "would not be finite numbers"):
            call()
    _one_line_error(invoke("top-k", "--from", str(folder), "-l", "0", "--head", "0"), 1,
                    "are too large")


# --------------------------------------------------------------------------- token text
def test_control_characters_in_saved_tokens_are_escaped(folder: Path, invoke: Any) -> None:
    from attnviz.long import load_long

    def change(sidecar: dict[str, Any]) -> None:
        sidecar["tokens"][3] = HOSTILE
        sidecar["display_tokens"][3] = HOSTILE
        sidecar["model"] = "llama" + HOSTILE

    _tamper(folder, change)
    cap = load_long(folder)
    shown = "\\x1b[31mRED\\x1b]0;pwn\\x07"
    assert cap.tokens[3] == cap.display_tokens[3] == shown and cap.model == "llama" + shown
    for command in (("top-k", "--from", str(folder), "-l", "0", "--head", "0", "-k", "3"),
                    ("heads", "--from", str(folder))):
        result = invoke(*command)
        assert result.exit_code == 0, result.output
        assert "\x1b" not in result.output and "\x07" not in result.output
    rows = json.loads(invoke("top-k", "--from", str(folder), "-l", "0", "--head", "0", "-k",
                             "3", "-f", "json").stdout)["rows"]
    assert rows[3]["query"] == shown


# --------------------------------------------------------------------------- --measure
@pytest.mark.parametrize("command", [
    ("dump", "--from", "{f}", "--measure", "norm", "-o", "{o}/d"),
    ("top-k", "--from", "{f}", "--measure", "alti", "-l", "0", "--head", "0"),
    ("heads", "--from", "{f}", "--measure", "norm"),
    ("html", "--long-from", "{f}", "--measure", "norm", "-o", "{o}/r.html"),
])
def test_a_measure_is_refused_for_a_saved_long_capture(dumped: Path, tmp_path: Path,
                                                       invoke: Any,
                                                       command: tuple[str, ...]) -> None:
    args = [a.format(f=dumped, o=tmp_path) for a in command]
    _one_line_error(invoke(*args), 2, "is a long capture: it holds attention weights, not",
                    "leave out --measure")
    assert not list(tmp_path.iterdir())  # nothing written
    allowed = invoke(*[a if a not in ("norm", "alti") else "weights" for a in args])
    assert allowed.exit_code == 0, allowed.output


# --------------------------------------------------------------------------- the routes
@pytest.fixture(scope="module")
def served(model_dir: Path, dumped: Path) -> Any:
    from attnviz.long import load_long
    from attnviz.server.app import create_app

    app = create_app(["toy", str(model_dir)], device="cpu", long_capture=load_long(dumped))
    yield app
    app.state.long_store.close()


def _error(response: Any, status: int, *words: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = dict(response.json()["error"])
    for word in words:
        assert word in error["message"], error
    return error


def test_the_atlas_block_is_bounded_by_the_capture(served: Any, dumped: Path) -> None:
    import attnviz.long.record as record
    from attnviz.long import load_long
    from attnviz.render.long_html import pool_atlas

    client = TestClient(served, base_url="http://127.0.0.1:8000")
    key = served.state.long_store.default()
    for block in (1 << 20, 2048):
        _error(client.post("/api/long/atlas", json={"id": key, "layer": 0, "head": 0,
                                                    "block": block}), 422,
               f"block must be a power of two from 16 to 1024 for this capture of {TOKENS} "
               f"tokens, got {block}")
    _error(client.post("/api/long/atlas", json={"id": key, "layer": 0, "head": 0,
                                                "block": 1 << 21}), 422, "block")
    answer = client.post("/api/long/atlas", json={"id": key, "layer": 0, "head": "mean",
                                                  "block": 1024})
    assert answer.status_code == 200 and answer.json()["shape"] == [1, 1]
    cap = load_long(dumped)
    sums = np.frombuffer(base64.b64decode(answer.json()["sums"]), "<f4")
    assert sums[0] == pytest.approx(TOKENS, rel=1e-4)  # every row adds to 1
    with pytest.raises(UsageError, match="from 16 to 1024"):
        cap.atlas(0, 0, 1 << 20)
    with pytest.raises(UsageError, match="from 16 to 1024"):
        cap.summarise(block=1 << 20)
    assert record.largest_block(5000) == 8192 and record.largest_block(10) == 1024
    # Pooling past the grid is one cell, with no padding to pay for.
    rng = np.random.default_rng(0)
    s, m = rng.random((13, 13)).astype(np.float32), rng.random((13, 13)).astype(np.float32)
    pooled_sums, pooled_maxes = pool_atlas(s, m, 1 << 20)
    assert pooled_sums.shape == (1, 1)
    assert pooled_sums[0, 0] == pytest.approx(float(s.astype(np.float64).sum()), rel=1e-6)
    assert pooled_maxes[0, 0] == m.max()


def test_a_model_without_a_long_path_is_a_client_error(served: Any) -> None:
    client = TestClient(served, base_url="http://127.0.0.1:8000")
    error = _error(client.post("/api/long/capture", json={"text": "hi", "model": "toy"}), 422,
                   "toy model has no long path")
    assert error["type"] == "LongUnsupported"


def test_a_damaged_served_capture_is_not_a_500(model_dir: Path, folder: Path) -> None:
    """A capture whose keys overflow answers with its error, not an internal one."""
    from attnviz.long import load_long
    from attnviz.server.app import create_app

    keys = np.load(folder / "k_001.npy")
    keys[:] = 1e30
    np.save(folder / "k_001.npy", keys)
    app = create_app(["toy"], long_capture=load_long(folder))
    client = TestClient(app, base_url="http://127.0.0.1:8000")
    key = app.state.long_store.default()
    for route, body in (("tile", {"layer": 1, "head": 0, "q0": 0, "q1": 5, "k0": 0, "k1": 5}),
                        ("topk", {"layer": 1, "head": 0, "k": 2}),
                        ("atlas", {"layer": 1, "head": 0, "block": 64}),
                        ("stats", {}), ("received", {"layer": 1, "head": 0})):
        error = _error(client.post(f"/api/long/{route}", json={"id": key, **body}), 500,
                       "are too large")
        assert error["type"] == "DumpError"
    app.state.long_store.close()


# --------------------------------------------------------------------------- --server client
def _b64_of(values: Any, dtype: str = "<f4") -> str:
    return base64.b64encode(np.asarray(values, dtype=dtype).tobytes()).decode()


CLIENT_CASES = [
    ("/api/long/topk", lambda a: {**a, "shape": [a["shape"][0] + 1, a["shape"][1]]},
     "the server's answer is not the top-k asked for (its shape is"),
    ("/api/long/topk", lambda a: {**a, "values": "@@not base64@@"},
     "the server's answer is not a top-k (its values are not valid base64"),
    ("/api/long/topk", lambda a: {**a, "values": a["values"][:-8]},
     "the server's answer is not a top-k (it holds"),
    ("/api/long/topk", lambda a: {**a, "values": _b64_of(np.full(a["shape"], np.nan))},
     "it holds NaN or infinite values"),
    ("/api/long/topk", lambda a: {**a, "values": _b64_of(np.full(a["shape"], 7.0))},
     "its weights are not between 0 and 1"),
    ("/api/long/topk", lambda a: {**a, "indices": [[10**6] * a["shape"][1]] * a["shape"][0]},
     "the server's answer is not a top-k (its numbers are not"),
    ("/api/long/topk", lambda a: [1, 2], "the server's answer is not a top-k (it has no"),
    ("/api/long/capture", lambda a: {**a, "display_tokens": a["display_tokens"][:-1]},
     "the server's answer is not a long capture (its display_tokens are"),
    ("/api/long/capture", lambda a: {**a, "num_tokens": "12"},
     "the server's answer is not a long capture (num_tokens"),
    ("/api/long/capture", lambda a: {**a, "layers": [0, 0]},
     "the server's answer is not a long capture (its layers"),
]


@pytest.mark.parametrize(("route", "change", "words"), CLIENT_CASES)
def test_bad_answers_of_a_server_are_refused(served: Any, model_dir: Path, invoke: Any,
                                            route: str, change: Any, words: str) -> None:
    def tamper(path: str, answer: Any) -> Any:
        return change(answer) if path == route else answer

    with tampering_proxy(served, tamper) as url:
        result = invoke("top-k", "-", "--model", str(model_dir), "--long", "--server", url,
                        "-l", "0", "--head", "1", "-k", "2", input=long_text(60))
    _one_line_error(result, 1, words, "check that --server points at 'attnviz serve'")


@pytest.mark.parametrize(("route", "change", "words"), [
    ("/api/long/tile", lambda a: {**a, "shape": [a["shape"][0] - 1, a["shape"][1]]},
     "the server's answer is not the tile asked for"),
    ("/api/long/tile", lambda a: {**a, "weights": "%%%"}, "not valid base64"),
    ("/api/long/atlas", lambda a: {**a, "shape": [1, 1]}, "not the atlas asked for"),
    ("/api/long/atlas", lambda a: {**a, "maxes": _b64_of(np.full(a["shape"], np.inf))},
     "NaN or infinite"),
    ("/api/long/received", lambda a: {"received": _b64_of([1.0, 2.0], "<f8")},
     "the server's answer is not attention received (it holds 16 bytes"),
    ("/api/long/stats", lambda a: {**a, "sinks": [0.5]}, "the server's answer is not sinks"),
    ("/api/long/stats", lambda a: {**a, "stats": {"entropy": [[1.0]]}},
     "the server's answer is not head statistics"),
])
def test_bad_numbers_of_a_server_are_refused_in_python(served: Any, model_dir: Path,
                                                       route: str, change: Any,
                                                       words: str) -> None:
    from attnviz.server.client import RemoteSession, ServerError

    def tamper(path: str, answer: Any) -> Any:
        return change(answer) if path == route else answer

    with tampering_proxy(served, tamper) as url:
        cap = RemoteSession(url).capture_long(long_text(60), model=str(model_dir))
        calls = {"/api/long/tile": lambda: cap.tile(0, 1, 0, 10, 0, 10),
                 "/api/long/atlas": lambda: cap.atlas(0, 1, 16),
                 "/api/long/received": lambda: cap.received(0, 1),
                 "/api/long/stats": lambda: (cap.sinks(), cap.head_stats())}
        with pytest.raises(ServerError, match=words.replace("(", r"\(")):
            calls[route]()


def test_a_long_capture_of_other_layers_is_refused(served: Any, model_dir: Path) -> None:
    from attnviz.server.client import RemoteSession, ServerError

    def tamper(path: str, answer: Any) -> Any:
        if path == "/api/long/capture":
            answer = {**answer, "layers": [1], "num_layers": 2}
        return answer

    with tampering_proxy(served, tamper) as url:
        session = RemoteSession(url)
        with pytest.raises(ServerError, match=r"a long capture of layers \[1\], not layers=0"):
            session.capture_long(long_text(60), model=str(model_dir), layers="0")
        assert session.capture_long(long_text(60), model=str(model_dir),
                                    layers="1").layers == [1]


def test_token_text_of_a_server_cannot_drive_the_terminal(served: Any, model_dir: Path,
                                                          invoke: Any) -> None:
    def tamper(path: str, answer: Any) -> Any:
        if path == "/api/long/capture":
            answer = {**answer, "model": answer["model"] + "\x1b[2J",
                      "warnings": ["\x1b[1mbold"]}
            for name in ("tokens", "display_tokens"):
                answer[name] = [HOSTILE + t for t in answer[name]]
        if path == "/api/long/stats":  # token 3 a sink in every head: the sinks line names it
            answer = {**answer, "sinks": [1.0 if i == 3 else 0.0
                                          for i in range(len(answer["sinks"]))]}
        return answer

    with tampering_proxy(served, tamper) as url:
        outputs = {}
        for command in (("top-k", "-l", "0", "--head", "1", "-k", "2"),
                        ("top-k", "-l", "0", "--head", "1", "-k", "2", "-f", "json"),
                        ("heads",)):
            result = invoke(*command[:1], "-", "--model", str(model_dir), "--long", "--server",
                            url, *command[1:], input=long_text(60))
            assert result.exit_code == 0, result.output
            assert "\x1b" not in result.output and "\x07" not in result.output
            outputs[command[-1]] = result.stdout
    shown = "\\x1b[31mRED\\x1b]0;pwn\\x07"
    assert json.loads(outputs["json"])["rows"][3]["query"].startswith(shown)
    note = "".join(outputs["heads"].split())  # the sinks line, unwrapped
    assert f"Attentionsinks(meanweightabove0.3):3:{shown}" in note
