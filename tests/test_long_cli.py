"""Long inputs through every command, the session and the server (``--long``).

A tiny random-weight Llama with grouped-query attention (4 heads, 2 key/value heads) reads a
text of about 1,500 tokens. Every number the long path prints or draws is compared with the
full capture of the same text (eager attention, every weight), within 1e-5.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests._servers import thread_server

TOL = 1e-5
WORDS = ("the cat sat on a mat while dogs ran far into green hills under bright stars and "
         "rivers of old stone").split()


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama (GQA, RoPE) that takes 8k tokens, saved with MiniLM's WordPiece vocab."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaModel

    from attnviz.models.hf import bundled_model_path

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=30522, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=8192)
    out = tmp_path_factory.mktemp("long-llama")
    model = LlamaModel(config)
    with torch.no_grad():  # sharper attention than the default init: top-k has clear winners
        for layer in model.layers:
            layer.self_attn.q_proj.weight.mul_(8.0)
            layer.self_attn.k_proj.weight.mul_(8.0)
    model.save_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(bundled_model_path())
    tokenizer.model_max_length = 8192
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def long_text() -> str:
    rng = np.random.default_rng(0)
    return " ".join(rng.choice(WORDS, 1500))


@pytest.fixture(scope="module")
def full_weights(llama_dir: Path, long_text: str) -> np.ndarray:
    """Every weight of the text, ``[layer, head, query, key]``, from eager attention."""
    from attnviz.models.hf import HFSource

    source = HFSource(str(llama_dir), device="cpu")
    cap = source.capture(long_text, max_tokens=4096)
    return np.asarray(cap.weights, dtype=np.float64)


def _ok(result: Any) -> Any:
    assert result.exit_code == 0, (result.stdout, result.stderr)
    return result


def _topk(invoke: Any, llama_dir: Path, text: str, *flags: str) -> dict[str, Any]:
    result = _ok(invoke("top-k", "-", "--model", str(llama_dir), "-f", "json", "--no-cache",
                        *flags, input=text))
    return json.loads(result.stdout)


def _same_topk(long: dict[str, Any], full: dict[str, Any]) -> None:
    assert len(long["rows"]) == len(full["rows"]) > 1000
    for a, b in zip(long["rows"], full["rows"]):
        assert a["query_index"] == b["query_index"] and a["query"] == b["query"]
        assert len(a["top"]) == len(b["top"])
        np.testing.assert_allclose([t["weight"] for t in a["top"]],
                                   [t["weight"] for t in b["top"]], atol=TOL)
        for x, y in zip(a["top"], b["top"]):
            if x["key_index"] != y["key_index"]:  # a near tie may swap places; never more
                assert abs(x["weight"] - y["weight"]) <= TOL


# --------------------------------------------------------------------------- numbers
@pytest.mark.parametrize("head", ["3", "mean"])
def test_topk_long_equals_the_full_capture(invoke: Any, llama_dir: Path, long_text: str,
                                           full_weights: np.ndarray, head: str) -> None:
    flags = ("-l", "1", "--head", head, "-k", "4")
    long = _topk(invoke, llama_dir, long_text, "--long", *flags)
    full = _topk(invoke, llama_dir, long_text, "--no-long", *flags)
    _same_topk(long, full)
    assert long["title"] == full["title"]  # one record: the same table, title and all
    # ...and both equal an argsort of the eager weights.
    matrix = full_weights[1, 3] if head == "3" else full_weights[1].mean(axis=0)
    for row in long["rows"][::97]:
        i = row["query_index"]
        order = np.argsort(-matrix[i], kind="stable")[:min(4, i + 1)]
        np.testing.assert_allclose([t["weight"] for t in row["top"]], matrix[i, order],
                                   atol=TOL)


def _spy(monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> list[Any]:
    seen: list[Any] = []
    original = getattr(module, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        value = original(*args, **kwargs)
        seen.append((args, kwargs, value))
        return value

    monkeypatch.setattr(module, name, wrapper)
    return seen


@pytest.mark.parametrize("head", ["2", "mean"])
def test_heatmap_window_draws_exact_tiles(invoke: Any, llama_dir: Path, long_text: str,
                                          full_weights: np.ndarray, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch, head: str) -> None:
    import attnviz.render.atlas as atlas

    drawn = _spy(monkeypatch, atlas, "head_matrix")
    out = tmp_path / "tile.png"
    _ok(invoke("heatmap", "-", "--model", str(llama_dir), "--long", "-l", "0", "--head", head,
               "--tokens", "700:760", "--keys", "650:770", "-o", str(out), input=long_text))
    (_, _, matrix), = drawn
    expected = full_weights[0, 2] if head == "2" else full_weights[0].mean(axis=0)
    np.testing.assert_allclose(matrix, expected[700:760, 650:770], atol=TOL)
    from PIL import Image

    assert Image.open(out).size[0] > 200


def test_atlas_figures_show_block_maxima_and_say_the_block(
        invoke: Any, llama_dir: Path, long_text: str, full_weights: np.ndarray,
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import attnviz.render.atlas as atlas
    import attnviz.render.head as head_figures

    drawn = _spy(monkeypatch, head_figures, "draw_head_artists")
    _ok(invoke("heatmap", "-", "--model", str(llama_dir), "--long", "-l", "1", "--head", "3",
               "-o", str(tmp_path / "atlas.png"), input=long_text))
    (args, kwargs, _), = drawn
    T = full_weights.shape[-1]
    block = atlas.block_size(T, atlas.HEAD_BLOCKS)
    assert block == 16 and f"layer 1, head 3, {block}-token blocks (max)" in kwargs["title"]
    nb = -(-T // block)
    padded = np.zeros((nb * block, nb * block))
    padded[:T, :T] = full_weights[1, 3]
    maxima = padded.reshape(nb, block, nb, block).max(axis=(1, 3))
    np.testing.assert_allclose(args[0], maxima, atol=TOL)
    # The layer grid and the overview: every head's atlas, the block in the title.
    grids = _spy(monkeypatch, atlas, "atlas_matrix")
    result = _ok(invoke("heatmap", "-", "--model", str(llama_dir), "--long",
                        "-o", str(tmp_path / "overview.png"), input=long_text))
    assert result.stdout.strip().endswith("overview.png")
    assert len(grids) == 2 * 4
    coarse = atlas.block_size(T, atlas.GRID_BLOCKS)
    nb = -(-T // coarse)
    padded = np.zeros((nb * coarse, nb * coarse))
    padded[:T, :T] = full_weights[0, 1]
    np.testing.assert_allclose(grids[1][2], padded.reshape(nb, coarse, nb, coarse)
                               .max(axis=(1, 3)), atol=TOL)


def test_automatic_switch_past_the_limit(invoke: Any, llama_dir: Path, long_text: str,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    flags = ("-l", "0", "--head", "1", "-k", "2")
    full = _topk(invoke, llama_dir, long_text, "--no-long", *flags)
    monkeypatch.setenv("ATTNVIZ_MAX_FULL_MB", "1")
    result = _ok(invoke("top-k", "-", "--model", str(llama_dir), "-f", "json", "--no-cache",
                        *flags, input=long_text))
    assert "taking the long path" in result.stderr and "more than 1 MB" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    _same_topk(json.loads(result.stdout), full)
    # A short text stays a full capture, without a word.
    short = _ok(invoke("top-k", "The cat sat on the mat", "--model", str(llama_dir), *flags))
    assert "long" not in short.stderr and "long capture" not in short.stdout
    monkeypatch.setenv("ATTNVIZ_MAX_FULL_MB", "lots")
    bad = invoke("top-k", "The cat", "--model", str(llama_dir), *flags)
    assert bad.exit_code == 2 and "ATTNVIZ_MAX_FULL_MB='lots' is not a size" in bad.stderr


def test_dump_says_what_it_writes_when_it_switches_by_itself(
        invoke: Any, llama_dir: Path, long_text: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATTNVIZ_MAX_FULL_MB", "1")
    folder = tmp_path / "auto"
    result = _ok(invoke("dump", "-", "--model", str(llama_dir), "--no-cache", "-o", str(folder),
                        input=long_text))
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "more than 1 MB" in lines[0]
    assert lines[0].endswith("writing a long capture (long.json, q_/k_/lse_LLL.npy) instead of "
                             "attention.npy; --no-long writes every weight")
    names = sorted(p.name for p in folder.iterdir())
    assert "long.json" in names and "attention.npy" not in names and "q_001.npy" in names
    # --no-long, as the line says, writes every weight.
    full = _ok(invoke("dump", "-", "--model", str(llama_dir), "--no-long", "--no-cache", "-o",
                      str(tmp_path / "full"), input=long_text))
    assert "long" not in full.stderr
    assert (tmp_path / "full" / "attention.npy").is_file()


def test_dump_long_reads_back_with_from(invoke: Any, llama_dir: Path, long_text: str,
                                        tmp_path: Path, full_weights: np.ndarray) -> None:
    folder = tmp_path / "book"
    result = _ok(invoke("dump", "-", "--model", str(llama_dir), "--long", "--long-dtype",
                        "float32", "-o", str(folder), input=long_text))
    assert result.stdout.strip() == str(folder)
    sidecar = json.loads((folder / "long.json").read_text())
    assert sidecar["num_kv_heads"] == 2 and sidecar["causal"] is True
    assert np.load(folder / "k_001.npy").shape[:2] == (2, len(sidecar["tokens"]))
    flags = ("-l", "1", "--head", "0", "-k", "3")
    from_dump = json.loads(_ok(invoke("top-k", "--from", str(folder), "-f", "json",
                                      *flags)).stdout)
    _same_topk(from_dump, _topk(invoke, llama_dir, long_text, "--no-long", *flags))
    # heads on the text: every head's statistics come from the capture's own pass
    # (summary=True), the same numbers as from the dump below.
    import attnviz.long as long_package

    passes: list[bool] = []
    real = long_package.capture_long

    def spy(*args: Any, **kwargs: Any) -> Any:
        passes.append(bool(kwargs.get("summary")))
        return real(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(long_package, "capture_long", spy)
        in_pass = json.loads(_ok(invoke("heads", "-", "--model", str(llama_dir), "--long",
                                        "--no-induction", "-f", "json", "--no-cache",
                                        input=long_text)).stdout)
    assert passes == [True]
    # heads --from the long dump: the statistics of the full capture (heads --no-long).
    long_stats = json.loads(_ok(invoke("heads", "--from", str(folder), "-f", "json")).stdout)
    full_stats = json.loads(_ok(invoke("heads", "-", "--model", str(llama_dir), "--no-long",
                                       "--no-induction", "-f", "json", "--no-cache",
                                       input=long_text)).stdout)
    by_head = {(r["layer"], r["head"]): r for r in full_stats["heads"]}
    assert len(long_stats["heads"]) == len(in_pass["heads"]) == len(by_head) == 8
    for row in [*long_stats["heads"], *in_pass["heads"]]:
        expected = by_head[(row["layer"], row["head"])]
        assert row["label"] == expected["label"]
        for name in ("entropy", "distance", "previous", "first", "max_weight", "local"):
            assert row[name] == pytest.approx(expected[name], abs=1e-4), name
    assert long_stats["sinks"]["threshold"] == 0.3
    # Sinks: the share of heads whose mean attention to a token (over the queries that see
    # it) is above the threshold, from the eager weights; the largest shares first, at most 10.
    from attnviz.analysis.tables import sink_table
    from attnviz.long import load_long

    T = full_weights.shape[-1]
    means = np.stack([full_weights[:, :, j:, j].mean(axis=-1) for j in range(T)], axis=-1)

    def expected(threshold: float) -> tuple[list[int], np.ndarray]:
        shares = (means > threshold).mean(axis=(0, 1))
        order = [int(j) for j in np.argsort(-shares, kind="stable")[:10] if shares[j] > 0]
        return order, shares[order]

    assert [s["index"] for s in long_stats["sinks"]["tokens"]] == expected(0.3)[0]
    low = float(np.quantile(means, 0.999))  # a threshold some tokens pass in this model
    got = sink_table(load_long(folder), low)["sinks"]
    indices, shares = expected(low)
    assert len(indices) >= 3 and [s["index"] for s in got] == indices
    np.testing.assert_allclose([s["fraction"] for s in got], shares)
    table = _ok(invoke("heads", "--from", str(folder), "--sort", "distance", "--columns",
                       "ent,dist")).stdout
    assert "Attention sinks" in table and "Per layer" in table and "prev" not in table
    plot = tmp_path / "stats.png"
    _ok(invoke("heads", "--from", str(folder), "--plot", str(plot), "--stat", "distance"))
    from PIL import Image

    assert Image.open(plot).size[0] > 200


def test_session_answers_long_requests(llama_dir: Path, long_text: str,
                                       full_weights: np.ndarray) -> None:
    from attnviz.capture import Capture
    from attnviz.long import LongCapture
    from attnviz.request import CaptureRequest
    from attnviz.session import Session

    session = Session(use_cache=False)
    cap = session.run(CaptureRequest(text=long_text, model=str(llama_dir), long=True,
                                     long_dtype="float32", layer=1, head=2))
    assert isinstance(cap, LongCapture) and cap.num_tokens == full_weights.shape[-1]
    np.testing.assert_allclose(cap.tile(1, 2, 100, 140, 0, 140),
                               full_weights[1, 2, 100:140, :140], atol=TOL)
    short = session.run(CaptureRequest(text="The cat sat", model=str(llama_dir), long=None))
    assert isinstance(short, Capture)
    direct = session.capture_long(long_text, model=str(llama_dir), layers="1", dtype="bfloat16")
    assert direct.layers == [1] and direct.dtype == "bfloat16"
    with pytest.raises(Exception, match="long_dtype must be one of"):
        CaptureRequest(text="x", long=True, long_dtype="int8")


# --------------------------------------------------------------------------- errors
@pytest.mark.parametrize(("args", "words"), [
    (("rollout", "The cat", "--long"), "rollout has no long path"),
    (("top-k", "-", "--long", "-l", "0", "--head", "0", "--words"), "--words does not apply"),
    (("top-k", "-", "--long", "-l", "0", "--head", "0", "-k", "101"), "at most 100 keys"),
    (("dump", "-", "--long", "-o", "x.npy"), "a long capture is written as a folder"),
    (("dump", "-", "--long", "--float16", "-o", "d"), "use --long-dtype float16"),
    (("heads", "-", "--long", "--heads", "0"), "--heads does not apply to a long capture"),
    (("heads", "-", "--long", "--induction"), "--induction runs the test beside a full"),
    (("heatmap", "-", "--long", "--tokens", "0:10"), "is drawn for one head"),
    (("top-k", "-", "--long", "-l", "5", "--head", "0"), "layer 5 is out of range"),
    (("heads", "--input", "x.txt", "--long"), "--long takes one text"),
])
def test_usage_errors(invoke: Any, llama_dir: Path, tmp_path: Path,
                      monkeypatch: pytest.MonkeyPatch, args: tuple[str, ...],
                      words: str) -> None:
    monkeypatch.chdir(tmp_path)
    result = invoke(*args, "--model", str(llama_dir), input="The cat sat on the mat " * 20)
    assert result.exit_code == 2, (result.stdout, result.stderr)
    assert words in " ".join(result.stderr.split())
    assert "Traceback" not in result.stderr
    assert not list(tmp_path.iterdir())  # nothing written


def test_a_model_without_a_long_path_falls_back_or_says_why(
        invoke: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    flags = ("--model", "toy", "--causal", "-l", "0", "--head", "0", "-f", "csv")
    result = _ok(invoke("top-k", "A B C D E", "--long", *flags))
    assert "cannot take the long path" in result.stderr and "using it" in result.stderr
    assert result.stdout == _ok(invoke("top-k", "A B C D E", *flags)).stdout
    monkeypatch.setenv("ATTNVIZ_MAX_FULL_MB", "0.000001")
    refused = invoke("top-k", "A B C D E", "--long", *flags)
    assert refused.exit_code == 2
    assert "toy cannot take the long path (the toy model has no long path), and a full " \
           "capture would need" in " ".join(refused.stderr.split())


# --------------------------------------------------------------------------- --server
@pytest.fixture(scope="module")
def server_url(llama_dir: Path) -> Iterator[str]:
    """attnviz serve of the tiny Llama on a real loopback port (uvicorn in a thread)."""

    from attnviz.server.app import create_app
    from attnviz.server.engine import Limits

    app = create_app([str(llama_dir)], device="cpu", limits=Limits(long_max_weights=1 << 20))
    try:
        with thread_server(app) as url:
            yield url
    finally:
        app.state.long_store.close()


def test_server_round_trip(invoke: Any, llama_dir: Path, long_text: str, server_url: str,
                           full_weights: np.ndarray, tmp_path: Path) -> None:
    flags = ("-l", "1", "--head", "2", "-k", "3")
    remote = _topk(invoke, llama_dir, long_text, "--long", "--server", server_url, *flags)
    _same_topk(remote, _topk(invoke, llama_dir, long_text, "--no-long", *flags))
    from attnviz.server.client import RemoteSession

    session = RemoteSession(server_url)
    cap = session.capture_long(long_text, model=str(llama_dir))
    np.testing.assert_allclose(cap.tile(0, 1, 10, 90, 0, 90), full_weights[0, 1, 10:90, :90],
                               atol=TOL)
    T = cap.num_tokens  # rows past the server's bound of 2**20 values come in parts
    np.testing.assert_allclose(cap.rows(1, "mean", 0, T), full_weights[1].mean(axis=0),
                               atol=TOL)
    sums, maxes = cap.atlas(1, 3, 64)
    assert sums.shape == maxes.shape == (-(-cap.num_tokens // 64),) * 2
    np.testing.assert_allclose(sums.sum(axis=1)[:-1], 64.0, rtol=1e-4)  # rows add to queries
    np.testing.assert_allclose(cap.received(1, 3), full_weights[1, 3].sum(axis=0), rtol=1e-4)
    # heatmap and heads read the server's long capture as they read a local one.
    drawn = _ok(invoke("heatmap", "-", "--model", str(llama_dir), "--long", "--server",
                       server_url, "-l", "1", "-o", str(tmp_path / "grid.png"),
                       input=long_text))
    assert drawn.stdout.strip().endswith("grid.png")
    stats = json.loads(_ok(invoke("heads", "-", "--model", str(llama_dir), "--long",
                                  "--server", server_url, "-f", "json",
                                  input=long_text)).stdout)
    assert len(stats["heads"]) == 8
    row = stats["heads"][5]  # layer 1, head 1: its mean distance, from the eager weights
    positions = np.arange(full_weights.shape[-1])
    distance = (full_weights[1, 1] * np.abs(positions[:, None] - positions[None, :])).sum(-1)
    assert row["distance"] == pytest.approx(distance[1:].mean(), rel=1e-4)
    # The server decides by its own limit; queries and keys never come here.
    dumped = invoke("dump", "-", "--model", str(llama_dir), "--long", "--server", server_url,
                    "-o", str(tmp_path / "d"), input=long_text)
    assert dumped.exit_code == 2 and "stays on the server" in dumped.stderr
    # Answers are bounded.
    import urllib.request

    body = json.dumps({"id": cap.id, "layer": 0, "head": 0, "q0": 0, "q1": cap.num_tokens,
                       "k0": 0, "k1": cap.num_tokens}).encode()
    too_big = urllib.request.Request(server_url + "/api/long/tile", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(too_big, timeout=30)
    assert refused.value.code == 413


# --------------------------------------------------------------------------- a real process
def test_a_real_process(llama_dir: Path, long_text: str, tmp_path: Path,
                        full_weights: np.ndarray) -> None:
    env = {"ATTNVIZ_MAX_FULL_MB": "1", "ATTNVIZ_CACHE_DIR": str(tmp_path / "cache"),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}

    done = subprocess.run(
        [sys.executable, "-m", "attnviz", "top-k", "-", "--model", str(llama_dir), "-l", "0",
         "--head", "3", "-k", "2", "-f", "csv"], input=long_text, capture_output=True,
        text=True, env={**os.environ, **env}, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "taking the long path" in done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines[0] == "query_index,query,rank,key_index,key,weight"
    query, _, rank, key, _, weight = lines[-1].split(",")
    i, j = int(query), int(key)
    assert rank == "2" and float(weight) == pytest.approx(full_weights[0, 3, i, j], abs=TOL)


# --------------------------------------------------------------------------- export
def test_export_long_writes_atlas_topk_and_statistics(invoke: Any, llama_dir: Path,
                                                      long_text: str, tmp_path: Path,
                                                      full_weights: np.ndarray) -> None:
    import csv

    from PIL import Image

    out = tmp_path / "figs"
    dump = tmp_path / "book"
    _ok(invoke("dump", "-", "--model", str(llama_dir), "--long", "-o", str(dump),
               input=long_text))
    result = _ok(invoke("export", "--from", str(dump), "-k", "2", "-o", str(out)))
    assert "1 exported" in result.stdout  # a long dump is exported as one, --long or not
    index = json.loads((out / "index.json").read_text())
    entry, = index["texts"]
    folder = out / entry["folder"]
    manifest = json.loads((folder / "export.json").read_text())
    assert manifest["complete"] and manifest["long"]
    assert sorted(manifest["files"]) == sorted(["overview.png", "layers/L00.png",
                                                "layers/L01.png", "topk.csv", "heads.csv",
                                                "sinks.json"])
    assert Image.open(folder / "overview.png").size[0] > 300
    with open(folder / "topk.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    T = full_weights.shape[-1]
    assert len(rows) == 2 * 4 * (2 * T - 1)  # query 0 of a causal model sees one key
    for row in rows[:: len(rows) // 50]:
        weight = full_weights[int(row["layer"]), int(row["head"]), int(row["query_index"]),
                              int(row["key_index"])]
        assert float(row["weight"]) == pytest.approx(weight, abs=TOL)
    with open(folder / "heads.csv", newline="") as handle:
        heads = list(csv.DictReader(handle))
    assert len(heads) == 8 and "entropy" in heads[0]
    bad = invoke("export", "The cat", "--model", str(llama_dir), "--long", "--words",
                 "-o", str(tmp_path / "x"))
    assert bad.exit_code == 2 and "--words and --exclude-special do not apply" in bad.stderr


def test_export_takes_the_long_path_by_itself(invoke: Any, llama_dir: Path, long_text: str,
                                              tmp_path: Path, full_weights: np.ndarray,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A text of an --input file that would not fit as a full capture: every text of the
    export goes the long path, said once; with --no-long (or when all fit) nothing changes."""
    import csv

    texts = tmp_path / "texts.txt"
    texts.write_text(f"The cat sat on the mat\n\n{long_text}\n")
    monkeypatch.setenv("ATTNVIZ_MAX_FULL_MB", "1")
    out = tmp_path / "auto"
    result = _ok(invoke("export", "--input", str(texts), "--model", str(llama_dir), "-k", "1",
                        "--no-cache", "-o", str(out)))
    assert "2 exported" in result.stdout
    said = [line for line in result.stderr.splitlines() if "long path" in line]
    assert len(said) == 1 and "more than 1 MB" in said[0] and "--no-long" in said[0]
    index = json.loads((out / "index.json").read_text())
    assert [entry["status"] for entry in index["texts"]] == ["exported", "exported"]
    folder = out / index["texts"][1]["folder"]
    manifest = json.loads((folder / "export.json").read_text())
    assert manifest["long"] and manifest["num_tokens"] == full_weights.shape[-1]
    with open(folder / "topk.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    for row in rows[:: max(1, len(rows) // 40)]:
        weight = full_weights[int(row["layer"]), int(row["head"]), int(row["query_index"]),
                              int(row["key_index"])]
        assert float(row["weight"]) == pytest.approx(weight, abs=TOL)
    # Arguments are scanned too; --no-long keeps full captures (the short text fits anyway).
    argued = _ok(invoke("export", "The cat sat on the mat", long_text, "--model",
                        str(llama_dir), "--figures", "overview", "-o", str(tmp_path / "args")))
    assert "exporting every text on the long path" in argued.stderr
    kept = _ok(invoke("export", "The cat sat on the mat", "--model", str(llama_dir),
                      "--no-long", "--figures", "overview", "-o", str(tmp_path / "full")))
    assert "long path" not in kept.stderr
    entry, = json.loads((tmp_path / "full" / "index.json").read_text())["texts"]
    assert not json.loads((tmp_path / "full" / entry["folder"] / "export.json").read_text()
                          ).get("long")
    # Standard input is read once, as the export goes: not scanned (README says --long).
    piped = _ok(invoke("export", "--input", "-", "--model", str(llama_dir), "--figures",
                       "overview", "-o", str(tmp_path / "piped"), input=long_text + "\n"))
    assert "long path" not in piped.stderr
    entry, = json.loads((tmp_path / "piped" / "index.json").read_text())["texts"]
    assert not json.loads((tmp_path / "piped" / entry["folder"] / "export.json").read_text()
                          ).get("long")
    # Every text fits: a normal export, without a word.
    monkeypatch.delenv("ATTNVIZ_MAX_FULL_MB")
    normal = _ok(invoke("export", "--input", str(texts), "--model", str(llama_dir),
                        "--figures", "overview", "-o", str(tmp_path / "normal")))
    assert "long path" not in normal.stderr
    entries = json.loads((tmp_path / "normal" / "index.json").read_text())["texts"]
    assert not any(json.loads((tmp_path / "normal" / e["folder"] / "export.json").read_text()
                              ).get("long") for e in entries)


def test_export_long_fails_only_the_text_whose_folder_holds_a_link(
        invoke: Any, llama_dir: Path, tmp_path: Path) -> None:
    """A link planted in one text's folder fails that text (never written through); the
    others are exported, as a normal export does."""
    out, victim = tmp_path / "figs", tmp_path / "victim"
    victim.mkdir()
    texts = ("the cat sat on a mat", "dogs ran far into green hills")
    args = ("export", *texts, "--model", str(llama_dir), "--long", "--figures", "layers",
            "-k", "1", "-o", str(out))
    _ok(invoke(*args))
    first = out / json.loads((out / "index.json").read_text())["texts"][0]["folder"]
    import shutil

    shutil.rmtree(first / "layers")
    (first / "layers").symlink_to(victim)
    again = invoke(*args, "--force")
    assert again.exit_code == 1, again.output
    assert "symbolic link" in again.stderr and "1 exported" in again.stdout
    assert list(victim.iterdir()) == []
    entries = json.loads((out / "index.json").read_text())["texts"]
    assert [(e["text"], e["status"]) for e in entries] == [(texts[0], "failed"),
                                                           (texts[1], "exported")], entries


# --------------------------------------------------------------------------- README's claims
def test_readme_claims(monkeypatch: pytest.MonkeyPatch, llama_dir: Path, long_text: str,
                       invoke: Any) -> None:
    import psutil

    import attnviz.cli._analysis_common as cli_long
    import attnviz.render.atlas as atlas
    from attnviz.request import CaptureRequest
    from attnviz.server.engine import Limits
    from attnviz.session import Session
    from attnviz.session.long_path import full_bytes, max_full_bytes

    readme = (Path(__file__).parents[1] / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Long contexts and LLMs", 1)[1].split("\n## ", 1)[0]
    assert full_bytes(32, 32, 8192) // 2 // 10**9 == 137 and "137 GB" in section
    # The default limit: a quarter of the free memory.
    free = type("Free", (), {"available": 40 << 30})()
    monkeypatch.delenv("ATTNVIZ_MAX_FULL_MB", raising=False)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: free)
    assert max_full_bytes() == 10 << 30 and "a quarter of the\n  free memory" in section
    # Blocks: powers of two from 16, at most 256 a side for a head and 64 in a grid.
    assert [atlas.block_size(t, atlas.HEAD_BLOCKS) for t in (100, 4096, 4097, 100_000)] == \
        [16, 16, 32, 512]
    assert atlas.block_size(100_000, atlas.GRID_BLOCKS) == 2048
    assert "at most 4096 tokens a\n  side" in section and atlas.MAX_TILE_TOKENS == 4096
    assert cli_long.MAX_LONG_K == 100 and "`-k` at most 100" in section
    limits = Limits()
    assert limits.long_keep == 4 and limits.long_max_weights == 4 << 20
    assert "last 4 long captures" in section and "4 Mi values" in section
    # --no-long never takes the long path, whatever the limit.
    monkeypatch.setenv("ATTNVIZ_MAX_FULL_MB", "1")
    result = _ok(invoke("top-k", "-", "--model", str(llama_dir), "--no-long", "-l", "0",
                        "--head", "0", "-f", "csv", input=long_text))
    assert "long" not in result.stderr
    # Long captures are not kept in the capture cache: a second run captures again.
    session = Session(use_cache=True)
    request = CaptureRequest(text=long_text, model=str(llama_dir), long=True, layers="0")
    session.run(request)
    session.run(request)
    assert session.forwards == 2 and "not kept in the capture cache" in section


def test_a_window_wider_than_the_bound_is_refused(invoke: Any, llama_dir: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    import attnviz.render.atlas as atlas

    monkeypatch.setattr(atlas, "MAX_TILE_TOKENS", 50)
    result = invoke("heatmap", "-", "--model", str(llama_dir), "--long", "-l", "0", "--head",
                    "0", "--tokens", "0:60", input="The cat sat on the mat " * 20)
    assert result.exit_code == 2
    assert "the window holds 60 query tokens; a long capture draws at most 50 per side" \
        in " ".join(result.stderr.split())


def test_the_token_bound_of_a_long_capture(invoke: Any, llama_dir: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    import attnviz.session.long_path as long_session

    monkeypatch.setattr(long_session, "MAX_LONG_TOKENS", 100)
    result = invoke("top-k", "-", "--model", str(llama_dir), "--long", "-l", "0", "--head",
                    "0", input="The cat sat on the mat " * 40)
    assert result.exit_code == 2
    assert "more than the 100 a long capture takes" in " ".join(result.stderr.split())


# --------------------------------------------------------------------------- one capture a folder
def _names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_a_dump_replaces_the_capture_already_in_its_folder(
        invoke: Any, llama_dir: Path, long_text: str, tmp_path: Path) -> None:
    """--from reads what was dumped last; attnviz's other capture files go, nothing else."""
    from attnviz import load_capture

    folder, outside = tmp_path / "d", tmp_path / "outside"
    outside.mkdir()
    (outside / "victim.txt").write_text("mine")
    _ok(invoke("dump", "-", "--model", str(llama_dir), "--long", "-o", str(folder),
               input=long_text))
    (folder / "notes.txt").write_text("mine")
    (folder / "q_notes.npy").write_text("mine")
    (folder / "q_007.npy").symlink_to(outside / "victim.txt")
    long_files = ["k_000.npy", "k_001.npy", "long.json", "lse_000.npy", "lse_001.npy",
                  "q_000.npy", "q_001.npy"]
    assert _names(folder) == sorted([*long_files, "notes.txt", "q_notes.npy", "q_007.npy"])
    # A full dump over the long capture: --from reads it, the long files are gone.
    _ok(invoke("dump", "good morning sun", "--model", str(llama_dir), "-o", str(folder)))
    assert _names(folder) == ["attention.npy", "capture.json", "notes.txt", "q_notes.npy"]
    assert (outside / "victim.txt").read_text() == "mine"  # the link went, not its target
    flags = ("-l", "0", "--head", "1", "-k", "2", "-f", "json")
    rows = json.loads(_ok(invoke("top-k", "--from", str(folder), *flags)).stdout)["rows"]
    live = json.loads(_ok(invoke("top-k", "good morning sun", "--model", str(llama_dir),
                                 "--no-cache", *flags)).stdout)["rows"]
    assert load_capture(folder).text == "good morning sun"
    assert [r["query"] for r in rows] == [r["query"] for r in live] and len(rows) < 10
    np.testing.assert_allclose([t["weight"] for r in rows for t in r["top"]],
                               [t["weight"] for r in live for t in r["top"]], atol=TOL)
    # A long dump over the full one: attention.npy and capture.json go.
    _ok(invoke("dump", "-", "--model", str(llama_dir), "--long", "-o", str(folder),
               input=long_text))
    assert _names(folder) == sorted([*long_files, "notes.txt", "q_notes.npy"])
    # Fewer layers over more: the other layers' arrays go.
    _ok(invoke("dump", "-", "--model", str(llama_dir), "--long", "--layers", "1", "-o",
               str(folder), input=long_text))
    assert _names(folder) == ["k_001.npy", "long.json", "lse_001.npy", "notes.txt",
                              "q_001.npy", "q_notes.npy"]
    sidecar = json.loads((folder / "long.json").read_text())
    assert sidecar["layers"] == [1]
    long_flags = ("-l", "1", "--head", "2", "-k", "3")
    from_dump = json.loads(_ok(invoke("top-k", "--from", str(folder), "-f", "json",
                                      *long_flags)).stdout)
    _same_topk(from_dump, _topk(invoke, llama_dir, long_text, "--no-long", *long_flags))


@pytest.mark.parametrize("where", [".", "link"])
def test_a_dump_into_the_current_folder_or_a_linked_one_replaces_the_capture_there(
        invoke: Any, llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        where: str) -> None:
    """``-o .`` and ``-o LINK`` (a link to a folder, as the user named it) are the folder."""
    real = tmp_path / "real"
    real.mkdir()
    if where == ".":
        monkeypatch.chdir(real)
        out = "."
    else:
        (tmp_path / "link").symlink_to(real)
        out = str(tmp_path / "link")
    _ok(invoke("dump", "the cat sat on a mat", "--model", str(llama_dir), "--long",
               "--no-cache", "-o", out))
    assert "long.json" in _names(real)
    _ok(invoke("dump", "dogs ran far", "--model", str(llama_dir), "--no-long", "--no-cache",
               "-o", out))
    assert _names(real) == ["attention.npy", "capture.json"]
    _ok(invoke("dump", "the cat sat on a mat", "--model", str(llama_dir), "--long",
               "--no-cache", "-o", out))
    assert "attention.npy" not in _names(real) and "long.json" in _names(real)


def test_files_that_only_look_like_a_capture_are_never_removed(
        invoke: Any, llama_dir: Path, tmp_path: Path) -> None:
    """A user's q_001.npy or long.json (not attnviz's: no sidecar of ours) stays."""
    folder = tmp_path / "mine"
    folder.mkdir()
    np.save(folder / "q_001.npy", np.zeros(3))
    np.save(folder / "k_010.npy", np.zeros(3))
    (folder / "long.json").write_text('{"mine": 1}')
    _ok(invoke("dump", "dogs ran far", "--model", str(llama_dir), "--no-long", "--no-cache",
               "-o", str(folder)))
    assert _names(folder) == ["attention.npy", "capture.json", "k_010.npy", "long.json",
                              "q_001.npy"]
    assert (folder / "long.json").read_text() == '{"mine": 1}'


@pytest.mark.parametrize("stop", ["KeyboardInterrupt", "Terminated", "OSError"])
@pytest.mark.parametrize("before", ["nothing", "full", "long"])
def test_a_failed_long_dump_leaves_the_folder_as_it_was(
        invoke: Any, llama_dir: Path, long_text: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, stop: str, before: str) -> None:
    """Stopped after the first layer's files: no partial capture, the old one still reads."""
    import attnviz.long.seam as seam
    from attnviz.cli._app import Terminated

    folder = tmp_path / "d"
    if before == "full":
        _ok(invoke("dump", "good morning sun", "--model", str(llama_dir), "-o", str(folder)))
    elif before == "long":
        _ok(invoke("dump", "-", "--model", str(llama_dir), "--long", "--layers", "1", "-o",
                   str(folder), input=long_text))
    if before != "nothing":
        (folder / "notes.txt").write_text("mine")
    files = {p.name: p.read_bytes() for p in folder.iterdir()} if folder.exists() else None
    write, calls = seam._write_npy, []

    def failing(target: Path, name: str, array: Any) -> None:
        calls.append(name)
        if len(calls) == 4:  # q_, k_, lse_ of the first layer are written
            error = {"KeyboardInterrupt": KeyboardInterrupt(), "Terminated": Terminated(),
                     "OSError": OSError(28, "No space left on device")}[stop]
            raise error
        write(target, name, array)

    monkeypatch.setattr(seam, "_write_npy", failing)
    result = invoke("dump", "-", "--model", str(llama_dir), "--long", "-o", str(folder),
                    input=long_text)
    code = {"KeyboardInterrupt": 130, "Terminated": 143}.get(stop)
    if code is None:
        assert isinstance(result.exception, OSError)  # not ours: re-raised, never hidden
    else:
        assert result.exit_code == code, result.output
    assert len(calls) == 4
    if files is None:
        assert not folder.exists()
        return
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == files
    monkeypatch.setattr(seam, "_write_npy", write)
    _ok(invoke("top-k", "--from", str(folder), "-l", "-1", "--head", "0", "-k", "1"))


def test_an_incomplete_long_capture_is_named_as_such(invoke: Any, tmp_path: Path) -> None:
    folder = tmp_path / "sg"
    folder.mkdir()
    for name in ("q_000.npy", "k_000.npy", "lse_000.npy"):
        np.save(folder / name, np.zeros((1, 2)))
    result = invoke("top-k", "--from", str(folder), "-l", "0", "--head", "0")
    assert result.exit_code == 1, result.output
    output = " ".join(result.stderr.split())
    assert "long.json is missing: an interrupted dump --long?" in output
    assert "dump it again" in output and "capture.json" not in output
    assert "Traceback" not in result.output


def test_dump_from_a_long_capture_replaces_the_folder_and_cleans_a_killed_dump(
        invoke: Any, llama_dir: Path, long_text: str, tmp_path: Path) -> None:
    """dump --from a long capture goes the same way; a killed dump's staging folder (its
    process gone) is removed, a live one's and look-alikes are not."""
    import subprocess

    source, folder = tmp_path / "src", tmp_path / "d"
    _ok(invoke("dump", "-", "--model", str(llama_dir), "--long", "--layers", "0", "-o",
               str(source), input=long_text))
    _ok(invoke("dump", "good morning sun", "--model", str(llama_dir), "-o", str(folder)))
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    killed = folder / f".attnviz-dump.{gone}.0123abcd.tmp"
    killed.mkdir()
    (killed / "q_000.npy").write_text("half")
    live = folder / f".attnviz-dump.{os.getpid()}.89abcdef.tmp"
    live.mkdir()
    (folder / ".attnviz-dump.notes.tmp").mkdir()
    _ok(invoke("dump", "--from", str(source), "-o", str(folder)))
    assert _names(folder) == sorted([".attnviz-dump.notes.tmp", live.name, "k_000.npy",
                                     "long.json", "lse_000.npy", "q_000.npy"])
    for name in ("q_000.npy", "k_000.npy", "lse_000.npy", "long.json"):
        assert (folder / name).read_bytes() == (source / name).read_bytes()
