"""heatmap, top-k and dump through the CLI: outputs, numbers and every bad input."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from attnviz.capture import load_capture
from tests.conftest import SENTENCE

HEAVY = ("torch", "transformers", "matplotlib", "seaborn")


def assert_clean(result, code: int, fragment: str) -> None:
    output = result.stdout + result.stderr
    assert result.exit_code == code, output
    assert fragment in output, output
    assert "Traceback" not in output


# --------------------------------------------------------------------------- heatmap
def test_heatmap_single_head_png(invoke, tmp_path, cli_minilm):
    from attnviz.render.heatmap import head_figure_size

    out = tmp_path / "head.png"
    result = invoke("heatmap", SENTENCE, "--layer", "5", "--head", "3", "-o", out)
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == str(out)
    width, height = head_figure_size(8)
    with Image.open(out) as image:
        assert image.size == (round(width * 100), round(height * 100))
        pixels = np.asarray(image.convert("RGB"))
    assert pixels.std() > 10  # something was drawn
    assert not list(tmp_path.glob(".*tmp"))


@pytest.mark.parametrize("args", [["--layer", "1"], [], ["--layer", "-1", "--head", "mean"],
                                  ["--layer", "0", "--head", "2", "--exclude-special"],
                                  ["--layer", "0", "--head", "2", "--words", "--no-annot"]])
def test_heatmap_views(invoke, tmp_path, cli_minilm, args):
    out = tmp_path / "view.png"
    result = invoke("heatmap", SENTENCE, *args, "-o", out)
    assert result.exit_code == 0, result.output
    with Image.open(out) as image:
        assert image.format == "PNG" and min(image.size) > 300


def test_heatmap_svg_and_default_name(invoke, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = invoke("heatmap", "a b c", "--model", "toy", "--layer", "0", "--head", "1",
                    "-o", "x.svg")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "x.svg").read_text().lstrip().startswith("<?xml")
    result = invoke("heatmap", "a b c", "--model", "toy")
    assert result.exit_code == 0, result.output
    produced = Path(result.stdout.strip())
    assert produced.exists() and produced.name.startswith("attention_a-b-c_")


def test_heatmap_reads_stdin(invoke, tmp_path):
    out = tmp_path / "s.png"
    result = invoke("heatmap", "-", "--model", "toy", "-o", out, input="one two three\n")
    assert result.exit_code == 0, result.output
    assert out.exists()


def test_heatmap_from_dump_equals_live(invoke, tmp_path):
    invoke("dump", "alpha beta gamma", "--model", "toy", "--toy-heads", "4", "--d-model", "8",
           "-o", tmp_path / "cap")
    a, b = tmp_path / "a.png", tmp_path / "b.png"
    live = invoke("heatmap", "alpha beta gamma", "--model", "toy", "--toy-heads", "4",
                  "--d-model", "8", "--layer", "0", "--head", "3", "-o", a)
    saved = invoke("heatmap", "--from", tmp_path / "cap", "--layer", "0", "--head", "3", "-o", b)
    assert live.exit_code == saved.exit_code == 0, live.output + saved.output
    with Image.open(a) as ia, Image.open(b) as ib:
        np.testing.assert_array_equal(np.asarray(ia), np.asarray(ib))


# --------------------------------------------------------------------------- top-k
def test_topk_equals_argsort(invoke, cli_minilm, minilm_capture):
    result = invoke("top-k", SENTENCE, "--layer", "5", "--head", "3", "-k", "3",
                    "--format", "json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    matrix = minilm_capture.matrix(5, 3)
    for row in data["rows"]:
        expected = np.argsort(-matrix[row["query_index"]], kind="stable")[:3]
        assert [t["key_index"] for t in row["top"]] == expected.tolist()
        np.testing.assert_allclose([t["weight"] for t in row["top"]],
                                   matrix[row["query_index"], expected], atol=1e-6)


def test_topk_formats(invoke, tmp_path, cli_minilm):
    table = invoke("top-k", SENTENCE, "--layer", "0", "--head", "0")
    assert table.exit_code == 0 and "top 3" in table.stdout and "[CLS]" in table.stdout
    csv_out = tmp_path / "t.csv"
    result = invoke("top-k", SENTENCE, "-l", "0", "--head", "mean", "-f", "csv", "-o", csv_out)
    assert result.exit_code == 0, result.output
    lines = csv_out.read_text().splitlines()
    assert lines[0] == "query_index,query,rank,key_index,key,weight" and len(lines) == 1 + 8 * 3
    md = invoke("top-k", SENTENCE, "-l", "0", "--head", "1", "-k", "2", "-f", "markdown",
                "--exclude-special")
    assert md.exit_code == 0 and "| # | query | top 1 | top 2 |" in md.stdout
    assert "[CLS]" not in md.stdout.split("\n", 3)[-1]


# --------------------------------------------------------------------------- dump
def test_dump_round_trip(invoke, tmp_path, cli_minilm, minilm_capture):
    result = invoke("dump", SENTENCE, "-o", tmp_path / "cap")
    assert result.exit_code == 0, result.output
    loaded = load_capture(tmp_path / "cap")
    np.testing.assert_allclose(loaded.weights, minilm_capture.weights, atol=1e-6)
    assert loaded.tokens == minilm_capture.tokens
    result = invoke("dump", SENTENCE, "--layers", "0,2-4", "--heads", "-2--1", "--float16",
                    "-o", tmp_path / "small.npy")
    assert result.exit_code == 0, result.output
    small = load_capture(tmp_path / "small.npy")
    assert small.layers == [0, 2, 3, 4] and small.heads == [10, 11]
    np.testing.assert_allclose(small.matrix(3, 11), minilm_capture.matrix(3, 11), atol=5e-4)


# --------------------------------------------------------------------------- bad input
BAD = [
    (["heatmap", ""], 2, "the text is empty"),
    (["heatmap", "   \n\t"], 2, "the text is empty"),
    (["heatmap", "a\x00b", "--model", "toy"], 2, "NUL"),
    (["heatmap"], 2, "give a TEXT"),
    (["heatmap", "a", "--from", "x"], 2, "either TEXT or --from"),
    (["heatmap", "hi", "--model", "toy", "--layer", "3"], 2, "layer 3 is out of range"),
    (["heatmap", "hi", "--model", "toy", "--layer", "0", "--head", "9"], 2,
     "head 9 is out of range: this model has 2 heads (0..1 or -2..-1)"),
    (["heatmap", "hi", "--model", "toy", "--head", "0"], 2, "--head needs --layer"),
    (["heatmap", "hi", "--model", "toy", "--layer", "0", "--head", "x"], 2, "invalid head"),
    (["heatmap", "hi", "--model", "toy", "--cmap", "nope"], 2, "unknown colour map"),
    (["heatmap", "hi", "--model", "toy", "-o", "x.gif"], 2, ".png, .svg or .pdf"),
    (["heatmap", "hi", "--model", "toy", "--device", "tpu"], 2, "invalid --device"),
    (["heatmap", "hi", "--model", "toy", "--dtype", "int8"], 2, "invalid --dtype"),
    (["heatmap", "hi", "--model", "toy", "--device", "cuda"], 1, "CUDA is not available"),
    (["heatmap", "hi", "--model", "toy", "--d-model", "7"], 2, "not divisible"),
    (["heatmap", "hi", "--model", "no-such-org/no-such-model"], 1, "--model minilm"),
    (["top-k", "hi", "--model", "toy", "--layer", "0"], 2, "--head"),
    (["top-k", "hi", "--model", "toy", "-l", "0", "--head", "0", "-f", "xml"], 2, "xml"),
    (["top-k", "hi", "--model", "toy", "-l", "0", "--head", "0", "-k", "0"], 2, "-k"),
    (["dump", "hi", "--model", "toy"], 2, "--out"),
    (["dump", "hi", "--model", "toy", "--toy-layers", "4", "--layers", "3-1", "-o", "d"], 2,
     "start comes after"),
    (["dump", "hi", "--model", "toy", "--heads", "a", "-o", "d"], 2, "not an index"),
    (["heatmap", "--from", "missing-dump"], 1, "does not exist"),
    (["heatmap", "hi there", "--model", "toy", "--max-tokens", "1", "--no-truncate"], 2,
     "more than --max-tokens"),
]


@pytest.mark.parametrize(("args", "code", "fragment"), BAD, ids=[" ".join(b[0])[:50] for b in BAD])
def test_bad_input(invoke, tmp_path, monkeypatch, args, code, fragment):
    monkeypatch.chdir(tmp_path)
    result = invoke(*args)
    assert_clean(result, code, fragment)
    assert not list(tmp_path.rglob("*")), "nothing may be written on failure"


def test_missing_model_folder(invoke, tmp_path):
    (tmp_path / "m").mkdir()
    assert_clean(invoke("heatmap", "hi", "--model", tmp_path / "m"), 1, "without config.json")
    (tmp_path / "m" / "config.json").write_text('{"model_type": "bert"}')
    assert_clean(invoke("heatmap", "hi", "--model", tmp_path / "m"), 1, "cannot load the model")


def test_corrupt_dump_via_cli(invoke, tmp_path):
    invoke("dump", "a b", "--model", "toy", "-o", tmp_path / "c")
    (tmp_path / "c" / "attention.npy").write_bytes(b"\x93NUMPY garbage")
    assert_clean(invoke("top-k", "--from", tmp_path / "c", "-l", "0", "--head", "0"), 1,
                 "truncated or corrupt")


def test_output_not_writable(invoke, tmp_path):
    blocker = tmp_path / "file.txt"
    blocker.write_text("x")
    result = invoke("heatmap", "a b", "--model", "toy", "-o", blocker / "x.png")
    assert_clean(result, 1, "is a file")
    result = invoke("dump", "a b", "--model", "toy", "-o", blocker)  # before any work
    assert_clean(result, 2, "a file with that name exists and is not a capture")
    assert blocker.read_text() == "x"


def test_disk_full_leaves_nothing(invoke, tmp_path, monkeypatch):
    import errno

    import attnviz.fileio as fileio

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fileio.os, "fsync", full)
    result = invoke("dump", "a b", "--model", "toy", "-o", tmp_path / "c")
    assert_clean(result, 1, "no space left")
    assert not [p for p in (tmp_path / "c").rglob("*") if p.is_file()]


def test_debug_env_shows_traceback(invoke, monkeypatch):
    monkeypatch.setenv("ATTNVIZ_DEBUG", "1")
    result = invoke("heatmap", "", "--model", "toy")
    assert result.exit_code != 0
    from attnviz.errors import InputError

    assert isinstance(result.exception, InputError)


# --------------------------------------------------------------------------- real processes
def test_help_does_not_import_heavy_modules():
    code = ("import sys\nfrom attnviz.cli import main\n"
            "for argv in (['--help'], ['heatmap', '--help'], ['top-k', '--help'], "
            "['dump', '--help']):\n"
            "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
            f"print('HEAVY', [m for m in {HEAVY!r} if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert "HEAVY []" in out.stdout, out.stdout[-500:]


def test_console_script_and_module(tmp_path):
    exe = shutil.which("attnviz") or str(Path(sys.executable).with_name("attnviz"))
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([exe, "heatmap", SENTENCE, "--layer", "5", "--head", "3", "-o",
                          str(tmp_path / "h.png")], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(tmp_path / "h.png")
    bad = subprocess.run([sys.executable, "-m", "attnviz", "heatmap", "hi", "--model", "toy",
                          "--toy-layers", "3", "--layer", "99"],
                         capture_output=True, text=True, env=env)
    assert bad.returncode == 2
    assert "layer 99 is out of range: this model has 3 layers (0..2 or -3..-1)" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_topk_causal_never_lists_future_keys(invoke, tiny_gpt2_dir):
    result = invoke("top-k", "The cat sat on the mat", "--model", tiny_gpt2_dir, "-l", "0",
                    "--head", "0", "-k", "3", "-f", "json")
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)["rows"]
    for row in rows:
        assert all(t["key_index"] <= row["query_index"] for t in row["top"])
        assert len(row["top"]) == min(3, row["query_index"] + 1)


def test_partial_capture_titles_and_file_inside_folder(invoke, tmp_path):
    invoke("dump", "a b c", "--model", "toy", "--toy-heads", "4", "--d-model", "8",
           "--heads", "1,3", "-o", tmp_path / "cap")
    from attnviz.cli.core import _head_title  # noqa: F401  (titles are built in core)

    loaded = load_capture(tmp_path / "cap" / "attention.npy")  # a file inside the folder
    assert loaded.heads == [1, 3]
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    titles: list[str] = []
    real = Figure.suptitle

    def spy(self, text, *args, **kwargs):
        titles.append(text)
        return real(self, text, *args, **kwargs)

    Figure.suptitle = spy  # type: ignore[method-assign]
    try:
        assert invoke("heatmap", "--from", tmp_path / "cap", "--layer", "0", "-o",
                      tmp_path / "g.png").exit_code == 0
        assert invoke("heatmap", "--from", tmp_path / "cap", "-o", tmp_path / "o.png"
                      ).exit_code == 0
    finally:
        Figure.suptitle = real  # type: ignore[method-assign]
    assert titles == ["toy: layer 0, heads 1, 3", "toy: layers 0, heads 1, 3"]
