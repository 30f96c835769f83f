"""``export --html``: one interactive report of every exported text, listed in the index."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from attnviz.render.html import decode_weights, read_report_data

TOY = ["--model", "toy", "--toy-layers", "2", "--toy-heads", "2"]


def test_html_report_lists_every_exported_text(invoke, tmp_path: Path) -> None:
    texts = ["The cat sat on the mat", "A dog barked", "Colourless green ideas sleep"]
    source = tmp_path / "texts.jsonl"
    lines = [{"text": texts[0]}, {"text": ""}, {"text": texts[1]}, {"text": texts[2]}]
    source.write_text("\n".join(json.dumps(line) for line in lines) + "\n", encoding="utf-8")
    out = tmp_path / "out"
    result = invoke("export", "--input", source, "-o", out, *TOY, "--figures", "overview",
                    "--jobs", "1", "--html", "--batch-size", "2")
    assert result.exit_code == 1, result.output  # the empty text failed; the rest exported
    assert "report.html" in result.stdout
    document = (out / "report.html").read_text(encoding="utf-8")
    data = read_report_data(document)
    assert [doc["text"] for doc in data["docs"]] == texts
    index = json.loads((out / "index.json").read_text(encoding="utf-8"))
    assert index["report"] == "report.html"
    assert 'href="report.html"' in (out / "index.html").read_text(encoding="utf-8")
    exported = [entry for entry in index["texts"] if entry["status"] == "exported"]
    assert len(exported) == 3
    for doc, entry in zip(data["docs"], exported):
        weights = np.load(out / entry["folder"] / "attention.npy")
        decoded = decode_weights(doc["weights"])
        assert decoded.shape == weights.shape
        np.testing.assert_allclose(decoded, weights, atol=1 / 255 + 1e-6)  # 8-bit storage
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]

    # A re-run keeps every text (skipped as complete) and still reports all of them.
    again = invoke("export", "--input", source, "-o", out, *TOY, "--figures", "overview",
                   "--jobs", "1", "--html")
    assert "0 exported, 3 skipped, 1 failed" in again.stdout
    data = read_report_data((out / "report.html").read_text(encoding="utf-8"))
    assert [doc["text"] for doc in data["docs"]] == texts


def test_no_report_without_html(invoke, tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = invoke("export", "A dog barked", "-o", out, *TOY, "--figures", "overview",
                    "--jobs", "1")
    assert result.exit_code == 0, result.output
    assert not (out / "report.html").exists()
    assert "report" not in json.loads((out / "index.json").read_text(encoding="utf-8"))
