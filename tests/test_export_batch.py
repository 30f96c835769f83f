"""``export --batch-size`` and ``heads --input --batch-size``: padded batches, same results."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import numpy as np
import pytest

import attnviz.models

TEXTS = [
    "The cat sat on the mat",
    "A dog",
    "Attention weights of a decoder never look at future tokens, whatever the batch.",
    "Short one here",
    "Colourless green ideas sleep furiously",
]


def _files(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}


def _export(invoke, model: Path, source: Path, out: Path, batch_size: int, *extra: str):
    return invoke("export", "--input", source, "-o", out, "--model", model, "--no-cache",
                  "--figures", "overview", "--jobs", "1", "--batch-size", str(batch_size),
                  *extra)


def _numbers(value: object, path: str = "") -> dict[str, float]:
    """Every number in a JSON value, by its path."""
    if isinstance(value, dict):
        return {k: v for key, item in value.items()
                for k, v in _numbers(item, f"{path}/{key}").items()}
    if isinstance(value, list):
        return {k: v for i, item in enumerate(value)
                for k, v in _numbers(item, f"{path}/{i}").items()}
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return {path: float(value)}
    return {}


def _assert_same_numbers(expected: object, actual: object) -> None:
    a, b = _numbers(expected), _numbers(actual)
    assert a.keys() == b.keys() and len(a) > 20
    for key in a:
        assert b[key] == pytest.approx(a[key], abs=1e-5), key


def _counting_capture_many(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Record how many texts each capture_many call gets (the export runs it in batches)."""
    sizes: list[int] = []
    real = attnviz.models.capture_many

    def spy(source, texts, pairs=None, **kwargs):  # type: ignore[no-untyped-def]
        sizes.append(len(texts))
        return real(source, texts, pairs, **kwargs)

    monkeypatch.setattr(attnviz.models, "capture_many", spy)
    return sizes


def test_batched_export_equals_one_by_one(invoke, tiny_gpt2_dir: Path, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    source = tmp_path / "texts.txt"
    source.write_text("\n".join(TEXTS) + "\n", encoding="utf-8")
    single = _export(invoke, tiny_gpt2_dir, source, tmp_path / "one", 1)
    assert single.exit_code == 0, single.output
    sizes = _counting_capture_many(monkeypatch)
    batched = _export(invoke, tiny_gpt2_dir, source, tmp_path / "four", 4)
    assert batched.exit_code == 0, batched.output
    assert sizes == [4, 1]  # two forward batches, not five single runs
    one, four = tmp_path / "one", tmp_path / "four"
    assert _files(one) == _files(four)
    index = json.loads((four / "index.json").read_text(encoding="utf-8"))
    assert [entry["text"] for entry in index["texts"]] == TEXTS
    lengths = set()
    for entry in index["texts"]:
        a = np.load(one / entry["folder"] / "attention.npy")
        b = np.load(four / entry["folder"] / "attention.npy")
        assert a.shape == b.shape  # no padding leaks into a text's capture
        lengths.add(a.shape[-1])
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-5)
        np.testing.assert_allclose(b.sum(-1), 1.0, atol=1e-5)
        sidecar = [json.loads((root / entry["folder"] / "capture.json").read_text("utf-8"))
                   for root in (one, four)]
        assert sidecar[0]["tokens"] == sidecar[1]["tokens"]
    assert len(lengths) >= 3  # texts of different lengths shared a batch


def test_topk_of_a_causal_model_lists_no_future_key(invoke, tiny_gpt2_dir: Path,
                                                    tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = invoke("export", "The cat sat on the mat", "-o", out, "--model", tiny_gpt2_dir,
                    "--figures", "overview", "--jobs", "1", "--top-k", "4")
    assert result.exit_code == 0, result.output
    folder = next(p for p in out.iterdir() if p.is_dir())
    weights = np.load(folder / "attention.npy")  # [layer, head, query, key]
    assert np.all(np.triu(weights, k=1) == 0)  # the model is causal
    rows = list(csv.DictReader(io.StringIO((folder / "topk.csv").read_text("utf-8"))))
    assert rows
    assert all(int(r["key_index"]) <= int(r["query_index"]) for r in rows)
    # Query q sees q + 1 keys: row 0 lists one key, later rows up to --top-k.
    per_query: dict[tuple[str, str, int], int] = {}
    for r in rows:
        key = (r["layer"], r["head"], int(r["query_index"]))
        per_query[key] = per_query.get(key, 0) + 1
    assert all(n == min(4, q + 1) for (_, _, q), n in per_query.items())


def test_bad_texts_in_a_batch_are_skipped_and_reported(invoke, tiny_gpt2_dir: Path,
                                                       tmp_path: Path) -> None:
    long_text = " ".join(["word"] * 40)
    lines = [{"text": "The cat sat"}, {"text": ""}, {"text": long_text},
             {"text": "bad\u0000text"}, {"text": "A dog barked"}]
    source = tmp_path / "texts.jsonl"
    source.write_text("\n".join(json.dumps(line) for line in lines) + "\n", encoding="utf-8")
    out = tmp_path / "out"
    # --no-truncate makes the 40-word text fail the batch's check of every text: the batch is
    # captured again one by one, and only that text fails.
    result = _export(invoke, tiny_gpt2_dir, source, out, 8, "--max-tokens", "16",
                     "--no-truncate")
    assert result.exit_code == 1, result.output
    assert "2 exported, 0 skipped, 3 failed" in result.stdout
    index = json.loads((out / "index.json").read_text(encoding="utf-8"))
    status = [entry["status"] for entry in index["texts"]]
    assert status == ["exported", "failed", "failed", "failed", "exported"]
    errors = [entry.get("error") or "" for entry in index["texts"]]
    assert "empty" in errors[1] and "NUL" in errors[3]
    assert "16" in errors[2]  # the token limit it went past
    assert "line 3 of" in result.stderr
    for entry in index["texts"]:
        if entry["status"] == "exported":
            weights = np.load(out / entry["folder"] / "attention.npy")
            np.testing.assert_allclose(weights.sum(-1), 1.0, atol=1e-5)


def test_heads_corpus_batch_sizes_agree(invoke, tiny_gpt2_dir: Path, tmp_path: Path) -> None:
    source = tmp_path / "corpus.txt"
    source.write_text("\n".join(TEXTS) + "\n", encoding="utf-8")
    reports = []
    for batch_size in ("1", "4"):
        result = invoke("heads", "--input", source, "--model", tiny_gpt2_dir, "--no-cache",
                        "--format", "json", "--batch-size", batch_size, "--no-induction")
        assert result.exit_code == 0, result.output
        reports.append(json.loads(result.stdout))
    one, four = reports
    _assert_same_numbers(one, four)


def test_heads_corpus_skips_a_text_that_spoils_its_batch(invoke, tiny_gpt2_dir: Path,
                                                         tmp_path: Path) -> None:
    source = tmp_path / "corpus.txt"
    source.write_text("The cat sat\n" + " ".join(["word"] * 40) + "\nA dog barked\n",
                      encoding="utf-8")
    args = ("heads", "--input", source, "--model", tiny_gpt2_dir, "--no-cache", "--format",
            "json", "--no-induction", "--max-tokens", "16", "--no-truncate")
    batched = invoke(*args, "--batch-size", "8")
    assert batched.exit_code == 0, batched.output
    assert "1 text(s) could not be used" in batched.stderr
    good = tmp_path / "good.txt"
    good.write_text("The cat sat\nA dog barked\n", encoding="utf-8")
    alone = invoke("heads", "--input", good, "--model", tiny_gpt2_dir, "--no-cache",
                   "--format", "json", "--no-induction", "--batch-size", "1")
    assert alone.exit_code == 0, alone.output
    _assert_same_numbers(json.loads(alone.stdout), json.loads(batched.stdout))
