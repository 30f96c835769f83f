"""``attnviz export``: files, manifest, resume, hostile names, parallel drawing."""

from __future__ import annotations

import csv
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import attnviz.export.draw as export_module
import attnviz.models
from attnviz.export import ExportItem, ExportOptions, export_items
from attnviz.models import ModelSpec
from attnviz.models.toy import ToyConfig
from attnviz.render.heatmap import head_figure_size

TOY = ["--model", "toy", "--toy-layers", "2", "--toy-heads", "2"]
NAME = re.compile(r"^[a-z0-9][a-z0-9-]*$")
_RESERVED = {"con", "prn", "aux", "nul", *(f"com{i}" for i in range(10)),
             *(f"lpt{i}" for i in range(10))}


def _files(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}


def _png_size(path: Path) -> tuple[int, int]:
    with Image.open(path) as image:
        image.load()  # decodes: a truncated file fails here
        return image.size


def _use_fixture_model(monkeypatch: pytest.MonkeyPatch, minilm) -> list[str]:
    loads: list[str] = []
    real = attnviz.models.load_source

    def load(spec=None):  # type: ignore[no-untyped-def]
        loads.append(spec.name)
        return minilm if spec.name == "minilm" else real(spec)

    monkeypatch.setattr(attnviz.models, "load_source", load)
    return loads


def test_two_texts_with_minilm(invoke, minilm, monkeypatch: pytest.MonkeyPatch,
                               tmp_path: Path) -> None:
    loads = _use_fixture_model(monkeypatch, minilm)
    texts = ["The cat sat on the mat", "Attention is all you need, they said."]
    out = tmp_path / "out"
    result = invoke("export", *texts, "-o", out, "--layers", "0,5", "--heads", "0-2",
                    "--jobs", "1")
    assert result.exit_code == 0, result.output
    assert "2 exported, 0 skipped, 0 failed" in result.stdout
    assert loads == ["minilm"]  # loaded once for both texts
    index = json.loads((out / "index.json").read_text(encoding="utf-8"))
    assert [entry["text"] for entry in index["texts"]] == texts
    assert index["summary"]["exported"] == 2
    for entry, text in zip(index["texts"], texts):
        folder = out / entry["folder"]
        assert NAME.match(entry["folder"]) and entry["status"] == "exported"
        direct = minilm.capture(text).select([0, 5], [0, 1, 2])
        # Texts run in padded batches (--batch-size 8): equal to a lone run within float error.
        np.testing.assert_allclose(np.load(folder / "attention.npy"), direct.weights,
                                   rtol=0, atol=1e-5)
        sidecar = json.loads((folder / "capture.json").read_text(encoding="utf-8"))
        assert sidecar["tokens"] == direct.tokens and sidecar["layers"] == [0, 5]
        expected = {"attention.npy", "capture.json", "topk.csv", "export.json",
                    "layers/L00.png", "layers/L05.png", "overview.png",
                    *(f"heads/L{layer:02d}_H{head:02d}.png" for layer in (0, 5)
                      for head in range(3))}
        assert _files(folder) == expected
        assert set(entry["files"]) == {f"{entry['folder']}/{f}" for f in expected}
        manifest = json.loads((folder / "export.json").read_text(encoding="utf-8"))
        assert manifest["complete"] is True
        assert set(manifest["files"]) | {"export.json"} == expected
        tokens = len(direct.tokens)
        width, height = head_figure_size(tokens)
        for layer in (0, 5):
            for head in range(3):
                assert _png_size(folder / f"heads/L{layer:02d}_H{head:02d}.png") == (
                    round(width * 100), round(height * 100))
        assert _png_size(folder / "overview.png")[0] > 200
        rows = list(csv.DictReader(io.StringIO((folder / "topk.csv").read_text("utf-8"))))
        assert len(rows) == 2 * 3 * tokens * 3
        matrix = direct.matrix(5, 2)
        row = [r for r in rows if r["layer"] == "5" and r["head"] == "2" and
               r["query_index"] == "1"]
        assert [int(r["key_index"]) for r in row] == list(
            np.argsort(-matrix[1], kind="stable")[:3])
        assert float(row[0]["weight"]) == pytest.approx(float(matrix[1].max()), abs=1e-6)
    html = (out / "index.html").read_text(encoding="utf-8")
    assert html.count("<img") == 2 and "overview.png" in html


def test_jobs_one_and_two_write_the_same_files(invoke, tmp_path: Path) -> None:
    texts = ["The cat sat on the mat", "A dog barked at the moon", "Short one"]
    outputs = []
    for jobs in ("1", "2"):
        out = tmp_path / f"jobs{jobs}"
        result = invoke("export", *texts, *TOY, "-o", out, "--jobs", jobs)
        assert result.exit_code == 0, result.output
        outputs.append(out)
    first, second = outputs
    assert _files(first) == _files(second)
    assert len(_files(first)) == 3 * (3 + 4 + 2 + 1 + 1) + 2
    for name in _files(first):
        a, b = (first / name).read_bytes(), (second / name).read_bytes()
        if name == "index.json":
            a_json, b_json = json.loads(a), json.loads(b)
            a_json["summary"].pop("seconds")
            b_json["summary"].pop("seconds")
            assert a_json == b_json
        else:
            assert a == b, name


def _toy_items(texts: list[str]) -> list[ExportItem]:
    return [ExportItem(text=t, origin=f"text {n}") for n, t in enumerate(texts, 1)]


def _toy_spec() -> ModelSpec:
    return ModelSpec(name="toy", toy=ToyConfig(layers=2, heads=2))


def test_resume_after_an_interrupt(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    texts = ["The cat sat on the mat", "A dog barked at the moon", "Birds sing"]
    out = tmp_path / "out"
    options = ExportOptions(jobs=1)
    real_write = export_module._write
    calls = {"n": 0}

    def interrupted(path: Path, data: bytes) -> None:
        calls["n"] += 1
        if calls["n"] == 14:  # part-way through the second text, in the middle of a file

            def half_then_stop(handle) -> None:  # type: ignore[no-untyped-def]
                handle.write(data[: len(data) // 2])
                raise KeyboardInterrupt

            from attnviz.fileio import atomic_write

            atomic_write(path, half_then_stop)
        real_write(path, data)

    monkeypatch.setattr(export_module, "_write", interrupted)
    with pytest.raises(KeyboardInterrupt):
        export_items(_toy_items(texts), out, options, spec=_toy_spec())
    monkeypatch.setattr(export_module, "_write", real_write)

    leftovers = [p for p in out.rglob("*") if p.name.endswith(".tmp")]
    assert leftovers == []
    for path in out.rglob("*.png"):
        _png_size(path)  # every PNG on disk is whole
    manifests = {p.parent.name: json.loads(p.read_text("utf-8")) for p in out.rglob("export.json")}
    assert sorted(m["complete"] for m in manifests.values()) == [False, True]
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()
              and p.name not in ("export.json", "index.json", "index.html")}

    summary = export_items(_toy_items(texts), out, options, spec=_toy_spec())
    assert (summary.exported, summary.skipped, summary.failed) == (2, 1, 0)
    for path, mtime in before.items():
        assert path.stat().st_mtime_ns == mtime, f"{path} was written again"
    per_text = 2 + 1 + 4 + 2 + 1 + 1  # capture, top-k, heads, layers, overview, manifest
    assert summary.files_written == 3 * per_text - len(before) - 1  # the finished manifest
    assert all(json.loads(p.read_text("utf-8"))["complete"] for p in out.rglob("export.json"))
    index = json.loads((out / "index.json").read_text("utf-8"))
    assert [e["status"] for e in index["texts"]] == ["skipped", "exported", "exported"]

    again = export_items(_toy_items(texts), out, options, spec=_toy_spec())
    assert (again.exported, again.skipped, again.files_written) == (0, 3, 0)
    forced = export_items(_toy_items(texts), out, ExportOptions(jobs=1, force=True),
                          spec=_toy_spec())
    assert forced.exported == 3 and forced.files_written == 3 * per_text


HOSTILE = [
    "../../etc/passwd", "/abs/path", "C:\\Windows\\system32", "CON", "nul.txt",
    "a" * 10_000, "?!...,;:", "\U0001F600 \U0001F680 \U0001F389 party",
    "\u05e9\u05dc\u05d5\u05dd \u05e2\u05d5\u05dc\u05dd", "tab\there\x01\x02\x7f end",
    "NUL\x00inside", "line\u2028separator and\u200bzero width", ".", "..",
]


def test_hostile_texts_stay_inside_out_dir(invoke, tmp_path: Path) -> None:
    records = [{"text": t} for t in HOSTILE]
    records += [{"text": "id test one", "id": "../../escape"},
                {"text": "id test two", "id": "/abs/id"},
                {"text": "id test three", "id": "CON"},
                {"text": "id test four", "id": "x" * 5000},
                {"text": "id test five", "id": "Same"},
                {"text": "id test six", "id": "same"}]
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(json.dumps(r) for r in records) + "\n", encoding="utf-8")
    out = tmp_path / "out"
    result = invoke("export", "--input", source, *TOY, "--figures", "heads", "--heads", "0",
                    "--layers", "0", "-o", out, "--jobs", "1")
    assert result.exit_code == 1, result.output  # the NUL text fails, the rest do not
    assert "NUL" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "out"]
    root = out.resolve()
    for path in out.rglob("*"):
        assert root in path.resolve().parents
        relative = path.relative_to(out)
        for part in relative.parts:
            assert len(part) <= 100
            stem = part.split(".")[0]
            assert stem.lower() not in _RESERVED
            assert re.fullmatch(r"[A-Za-z0-9_.-]+", part), part
            assert not part.endswith((".", " "))
    index = json.loads((out / "index.json").read_text("utf-8"))
    statuses = [e["status"] for e in index["texts"]]
    assert statuses.count("failed") == 1 and statuses.count("exported") == len(records) - 1
    folders = [e["folder"] for e in index["texts"] if e["status"] == "exported"]
    assert len(set(folders)) == len(folders)  # distinct texts and ids never share a folder
    for folder in folders:
        assert NAME.match(folder)
        assert (out / folder / "heads" / "L00_H00.png").is_file()


def test_input_file_blank_lines_and_bad_texts(invoke, tmp_path: Path) -> None:
    source = tmp_path / "texts.txt"
    source.write_bytes(b"The cat sat\n\n   \nA dog barked\n\xff\xfe broken\n")
    out = tmp_path / "out"
    result = invoke("export", "--input", source, *TOY, "--figures", "overview", "-o", out,
                    "--jobs", "1")
    assert result.exit_code == 1, result.output
    assert "2 blank lines" in result.stdout and "2 exported" in result.stdout
    assert "line 5" in result.stderr and "UTF-8" in result.stderr
    index = json.loads((out / "index.json").read_text("utf-8"))
    assert index["summary"]["blank"] == 2 and index["summary"]["failed"] == 1
    assert [e["origin"] for e in index["texts"]] == [
        f"line {n} of {source}" for n in (1, 4, 5)]


def test_standard_input_jsonl_with_pairs_and_duplicates(invoke, tmp_path: Path) -> None:
    lines = [{"text": "The cat sat", "pair": "It was tired", "id": "first"},
             {"text": "The cat sat", "pair": "It was tired", "id": "first"},
             {"text": "Something else", "id": "first"},
             {"text": "   "}]
    out = tmp_path / "out"
    result = invoke("export", "--input", "-", *TOY, "--figures", "heads", "-o", out,
                    "--jobs", "1", input="\n".join(json.dumps(x) for x in lines) + "\n")
    assert result.exit_code == 1, result.output
    index = json.loads((out / "index.json").read_text("utf-8"))
    assert [e["status"] for e in index["texts"]] == ["exported", "duplicate", "failed",
                                                    "failed"]
    assert "used by another text" in index["texts"][2]["error"]
    assert "empty" in index["texts"][3]["error"]
    sidecar = json.loads((out / "first" / "capture.json").read_text("utf-8"))
    assert sidecar["pair"] == "It was tired"


def test_from_dumps_and_vector_formats(invoke, tmp_path: Path) -> None:
    dump = invoke("dump", "The cat sat on the mat", *TOY, "-o", tmp_path / "cap")
    assert dump.exit_code == 0, dump.output
    out = tmp_path / "out"
    result = invoke("export", "--from", tmp_path / "cap", "--format", "svg", "--words",
                    "--heads", "1", "--figures", "heads,layers", "-o", out, "--jobs", "1")
    assert result.exit_code == 0, result.output
    (folder,) = [p for p in out.iterdir() if p.is_dir()]
    np.testing.assert_array_equal(np.load(folder / "attention.npy"),
                                  np.load(tmp_path / "cap" / "attention.npy")[:, 1:2])
    svgs = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*.svg"))
    assert svgs == ["heads/L00_H01.svg", "heads/L01_H01.svg", "layers/L00.svg",
                    "layers/L01.svg"]
    head = (folder / "heads" / "L01_H01.svg").read_text(encoding="utf-8")
    assert head.lstrip().startswith("<?xml") and "<svg" in head
    assert "<!-- toy: layer 1, head 1 -->" in head  # the title, drawn as paths
    grid = (folder / "layers" / "L01.svg").read_text(encoding="utf-8")
    assert "<!-- toy: layer 1, heads 1 -->" in grid  # as `heatmap --layer 1` titles it


def test_pngs_look_like_heatmap(invoke, tmp_path: Path) -> None:
    text = "The cat sat on the mat"
    out = tmp_path / "out"
    result = invoke("export", text, *TOY, "-o", out, "--jobs", "1")
    assert result.exit_code == 0, result.output
    (folder,) = [p for p in out.iterdir() if p.is_dir()]
    for args, name in ((["--layer", "1", "--head", "0"], "heads/L01_H00.png"),
                       (["--layer", "0"], "layers/L00.png"), ([], "overview.png")):
        reference = tmp_path / "ref.png"
        drawn = invoke("heatmap", text, *TOY, *args, "-o", reference)
        assert drawn.exit_code == 0, drawn.output
        ours = np.asarray(Image.open(folder / name).convert("RGB"), dtype=np.int16)
        theirs = np.asarray(Image.open(reference).convert("RGB"), dtype=np.int16)
        assert ours.shape == theirs.shape, name
        difference = np.abs(ours - theirs).max(axis=2)
        assert difference.mean() < 2.0 and (difference > 40).mean() < 0.02, name


def test_layer_out_of_range_is_a_usage_error(invoke, tmp_path: Path) -> None:
    result = invoke("export", "The cat sat", *TOY, "--layers", "7", "-o", tmp_path / "o",
                    "--jobs", "1")
    assert result.exit_code == 2
    assert "layer 7 is out of range" in result.stderr
    assert not (tmp_path / "o").exists()  # created for nothing: removed again


def test_nothing_to_export_and_bad_options(invoke, tmp_path: Path) -> None:
    result = invoke("export", "-o", tmp_path / "o")
    assert result.exit_code == 2 and "nothing to export" in result.stderr
    result = invoke("export", "x", "-o", tmp_path / "o", "--figures", "heads,pies")
    assert result.exit_code == 2 and "pies" in result.stderr
    result = invoke("export", "--input", tmp_path / "missing.txt", "-o", tmp_path / "o")
    assert result.exit_code == 2 and "does not exist" in result.stderr
    assert not (tmp_path / "o").exists()


def test_export_help_imports_nothing_heavy() -> None:
    code = ("import sys; from attnviz.cli import app; import attnviz.cli.export, "
            "attnviz.cli.cache, attnviz.cache, attnviz.export; "
            "print(sorted(m for m in ('torch', 'matplotlib', 'transformers', 'PIL') "
            "if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert result.stdout.strip() == "[]"


def test_duplicates_are_counted_apart_from_skipped(invoke, tmp_path: Path) -> None:
    """The summary's counts add up to the entries' statuses."""
    inputs = tmp_path / "dup.txt"
    inputs.write_text("Same text\nSame text\nOther text\n", encoding="utf-8")
    out = tmp_path / "out"
    result = invoke("export", "--input", inputs, *TOY, "--figures", "heads", "--jobs", "1",
                    "-o", out)
    assert result.exit_code == 0, result.output
    assert "(2 exported, 0 skipped, 0 failed, 1 duplicates)" in result.stdout
    index = json.loads((out / "index.json").read_text("utf-8"))
    statuses = [e["status"] for e in index["texts"]]
    summary = index["summary"]
    assert statuses == ["exported", "duplicate", "exported"]
    assert (summary["exported"], summary["skipped"], summary["duplicates"]) == (2, 0, 1)
    again = invoke("export", "--input", inputs, *TOY, "--figures", "heads", "--jobs", "1",
                   "-o", out)
    assert "(0 exported, 2 skipped, 0 failed, 1 duplicates)" in again.stdout
    # Files are counted alike: what the first run wrote, the second one kept (export.json too).
    written = json.loads((out / "index.json").read_text("utf-8"))["summary"]
    first = int(result.stdout.split(" files written")[0].rsplit(" ", 1)[1])
    assert written["files_skipped"] == first and written["files_written"] == 0
