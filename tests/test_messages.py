"""Messages give advice that works: the command or numbers they suggest succeed, they count
what the request needs, and each thing is said once; a full disk is said one way everywhere;
labels and figures name and show what is there (a model by its folder, help that wraps
cleanly, masked cells and the values of a long input's window)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.long_fixtures import build_tiny_llama, long_text


@pytest.fixture(scope="module")
def short_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny causal Llama with 64 positions (a prompt reaches its end quickly)."""
    return build_tiny_llama(tmp_path_factory.mktemp("short-llama") / "llama", positions=64)


@pytest.fixture(scope="module")
def llama_256(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("llama-256") / "llama", positions=256)


# --------------------------------------------------------------------------- generate (12)
def test_generate_says_how_many_prompt_tokens_fit_and_that_advice_works(invoke, short_llama):
    prompt = long_text(100)  # cut to the model's 64 positions: no room for a new token
    result = invoke("generate", prompt, "-m", short_llama, "-n", "4")
    assert result.exit_code == 2, result.output
    assert "--max-new-tokens 1 or less" not in result.stderr  # the advice that failed
    assert "60 prompt tokens fit with 4 new tokens" in result.stderr
    assert "--max-tokens 60" in result.stderr
    followed = invoke("generate", prompt, "-m", short_llama, "-n", "4", "--max-tokens", "60",
                      "--format", "json")
    assert followed.exit_code == 0, followed.output


def test_generate_offers_fewer_new_tokens_when_the_prompt_leaves_room(invoke, short_llama):
    result = invoke("generate", long_text(40), "-m", short_llama, "-n", "40")
    assert result.exit_code == 2, result.output
    room = 64 - int(result.stderr.split("the prompt (")[1].split(" tokens")[0])
    assert f"--max-new-tokens {room} or less" in result.stderr
    assert "24 prompt tokens fit with 40 new tokens" in result.stderr


# --------------------------------------------------------------------------- flow (13)
def test_flow_refuses_a_long_text_before_the_model_loads(invoke, forbid_loading, tmp_path):
    tried = forbid_loading()
    text = "the cat sat on the mat while a dog ran past her house and birds sang"
    result = invoke("rollout", text, "--method", "flow", "-o", tmp_path / "flow.png")
    assert result.exit_code == 2, result.output
    assert "attention flow over 18 tokens" in result.stderr  # [CLS] + 16 words + [SEP]
    assert tried == []
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("extra", [["--exclude-special"], ["--max-tokens", "10"],
                                   ["--max-flow-tokens", "18"]])
def test_flow_check_counts_as_the_view_does(invoke, forbid_loading, tmp_path, extra):
    """16 words without [CLS]/[SEP], a text cut to 10 tokens, a bound of 18: all within the
    bound, so the check lets them through to the model (which the test forbids)."""
    tried = forbid_loading()
    text = "the cat sat on the mat while a dog ran past her house and birds sang"
    result = invoke("rollout", text, "--method", "flow", "-o", tmp_path / "f.png", *extra)
    assert "attention flow over" not in result.output
    assert tried == ["minilm"]


# --------------------------------------------------------------------------- switch (14)
def test_automatic_switch_counts_what_a_one_head_figure_needs(invoke, llama_256, tmp_path,
                                                               monkeypatch):
    text = long_text(240)  # 242 tokens with the specials: 2 layers x 4 heads, 1.9 MB in full
    monkeypatch.setenv("ATTNVIZ_MAX_FULL_MB", "0.1")
    out = tmp_path / "one.png"
    result = invoke("heatmap", text, "-m", llama_256, "-l", "1", "--head", "0", "-o", out)
    assert result.exit_code == 0, result.output
    assert "1 layer x 1 head x 242x242 weights" in result.stderr, result.stderr
    assert "^2" not in result.stderr and "2 layers" not in result.stderr
    assert f"{242 * 242 * 4 / 1024:.0f} KB" in result.stderr  # 1 x 1 x 242^2 x 4 bytes
    # the eager forward holds one layer's scores and weights of all 4 heads beside the kept
    # head: 2 x 4 x 242^2 x 4 bytes more (a full capture's memory is not only what it keeps)
    assert f"({2 * 4 * 242 * 242 * 4 / 1024 / 1024:.2f} MB)" in result.stderr, result.stderr
    # one head and the forward fit a bound of 2.5 MB (one layer's four heads do not): the
    # full capture of that head, no long path
    monkeypatch.setenv("ATTNVIZ_MAX_FULL_MB", "2.5")
    result = invoke("heatmap", text, "-m", llama_256, "-l", "1", "--head", "0", "-o", out)
    assert result.exit_code == 0, result.output
    assert "long path" not in result.stderr


# --------------------------------------------------------------------------- export (15)
def test_a_line_that_is_not_utf8_is_named_once(invoke, tmp_path):
    source = tmp_path / "in.txt"
    source.write_bytes(b"The cat sat\n\xff\xfe broken\n")
    result = invoke("export", "--input", source, "-m", "toy", "-o", tmp_path / "out")
    assert result.exit_code == 1, result.output
    lines = [line for line in result.stderr.splitlines() if "UTF-8" in line]
    assert lines, result.stderr
    for line in lines:
        assert line.count(f"line 2 of {source}") == 1, line


# --------------------------------------------------------------------------- compare (16)
def test_compare_file_name_names_the_layer_the_table_shows(invoke, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = invoke("compare", "the cat sat on the mat", "--vs-causal", "--head", "0",
                    "--toy-layers", "2")
    assert result.exit_code == 0, result.output
    (image,) = tmp_path.glob("compare_*.png")
    assert "(layer 1, head 0)" in result.stdout
    assert image.name.endswith("_L1_H0.png"), image.name


def test_compare_note_is_a_whole_sentence(minilm):
    from attnviz.analysis.compare import compare_captures

    comparison = compare_captures(minilm.capture("The cat sat on the mat"),
                                  minilm.capture("The big fluffy cat sat on the mat!"), 2, 3)
    note = comparison.renormalised_note
    assert note and note.endswith("are the weights before renormalisation")


# --------------------------------------------------------------------------- memory (11)
def _memory(monkeypatch: pytest.MonkeyPatch, available: int) -> None:
    import types

    import psutil

    monkeypatch.setattr(psutil, "virtual_memory",
                        lambda: types.SimpleNamespace(available=available))


def test_a_measure_that_does_not_fit_gets_advice_that_works(invoke, cli_minilm, monkeypatch,
                                                            tmp_path):
    # 40 tokens of --measure norm: every layer and head (6 x 12) plus the selection, float32
    text = long_text(38)
    budget = 4 * 2 * 6 * 12 * 30 ** 2  # 30 tokens' worth (90% of what is free)
    _memory(monkeypatch, int(budget / 0.9) + 1)
    result = invoke("heatmap", text, "--measure", "norm", "-l", "0", "--head", "0", "-o",
                    tmp_path / "n.png")
    assert result.exit_code == 2, result.output
    assert "--long" not in result.stderr.replace("\n", " ").split("Error:")[1].split(
        "long path holds")[0]  # no advice to take a path that refuses measures
    fit = int(result.stderr.split("--max-tokens ")[1].split(")")[0])
    # every layer and head for the measure plus the figure's selection (the same, here)
    assert fit == int((budget / (4 * 2 * 6 * 12)) ** 0.5)
    followed = invoke("heatmap", text, "--measure", "norm", "-l", "0", "--head", "0",
                      "--max-tokens", fit, "-o", tmp_path / "n.png")
    assert followed.exit_code == 0, followed.output
    tight = invoke("heatmap", text, "--measure", "norm", "-l", "0", "--head", "0",
                   "--max-tokens", fit + 1, "-o", tmp_path / "n.png")
    assert tight.exit_code == 2  # the number is the largest that fits


def test_weights_that_do_not_fit_name_the_tokens_that_do(minilm, monkeypatch):
    from attnviz.errors import InputError

    _memory(monkeypatch, int(4 * 6 * 12 * 20 ** 2 / 0.9) + 1)
    with pytest.raises(InputError) as caught:
        minilm.capture(long_text(30))
    assert "--max-tokens 20" in str(caught.value.hint)
    minilm.capture(long_text(30), max_tokens=20)


# --------------------------------------------------------------------------- labels (17)
def test_a_relative_model_folder_is_named_by_its_folder_everywhere(invoke, llama_256,
                                                                   monkeypatch):
    import json

    from attnviz.long import LongCapture
    from attnviz.render.atlas import atlas_head_figure
    from attnviz.render.heatmap import FigureOptions
    from attnviz.server.long_routes import describe

    work = llama_256.parent / "work"
    work.mkdir(exist_ok=True)
    monkeypatch.chdir(work)
    relative = "../llama"
    dumped = invoke("dump", long_text(40), "-m", relative, "--long", "-o", "lc")
    assert dumped.exit_code == 0, dumped.output
    topk = invoke("top-k", "--from", "lc", "-l", "0", "--head", "0")
    assert topk.exit_code == 0, topk.output
    assert topk.stdout.startswith("llama: layer 0"), topk.stdout[:80]
    page = invoke("html", "--long-from", "lc", "-o", "lc.html")
    assert page.exit_code == 0, page.output
    html = (work / "lc.html").read_text(encoding="utf-8")
    assert "<title>attnviz: llama:" in html and relative not in html.split("<script")[0]
    data = json.loads(html.split('id="attnviz-long-data">')[1].split("</script>")[0])
    assert data["model_label"] == "llama" and data["model"] == relative  # the record: the path
    cap = LongCapture.open(work / "lc")
    try:
        assert relative not in repr(cap) and "'llama'" in repr(cap)
        fig, _block = atlas_head_figure(cap, 0, 0, options=FigureOptions())
        assert fig.texts[0].get_text().startswith("llama: layer 0")
        served = describe("k", cap, 1000)
        assert served["model_label"] == "llama" and served["model"] == relative
    finally:
        cap.close()


def test_the_bundled_model_is_named_minilm_not_its_install_path(minilm):
    import attnviz
    from attnviz.models.hf import bundled_model_path

    cap = attnviz.capture(minilm.model, minilm.tokenizer, "The cat sat")
    assert str(bundled_model_path()) not in repr(cap)
    assert repr(cap).startswith("Capture('minilm':")


# --------------------------------------------------------------------------- heads (18)
def test_heads_per_layer_labels_do_not_wrap_at_80_columns(invoke, cli_minilm, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    result = invoke("heads", "the cat sat on the mat and the dog ran", "--measure", "norm")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80
    start = next(i for i, line in enumerate(lines) if line.startswith("Per layer"))
    rows = []  # the table's rows: up to the blank line before the attention sinks
    for line in lines[start + 3:]:
        if not line.strip():
            break
        rows.append(line)
    assert [row.split()[0] for row in rows] == [str(layer) for layer in range(6)], rows
    left_out = result.stderr.replace("\n", " ")
    header = lines[start + 1].split()
    for name in header[1:-1]:  # each statistic shown is in both tables, none named left out
        head_header = next(line for line in lines if line.startswith("L "))
        assert name in head_header.split() and f" {name}," not in left_out


# --------------------------------------------------------------------------- full disk (10)
def _disk_full_after(monkeypatch: pytest.MonkeyPatch, limit: int,
                     message: str | None = None) -> None:
    """Make the lowest writer of output files fail once ``limit`` bytes are written: with
    ``ENOSPC``, or (``message``) as numpy reports a short write, without an error number."""
    import errno
    import os

    import attnviz.diskfull as diskfull

    real = diskfull.write_chunk
    written = [0]

    def write(handle, data):  # type: ignore[no-untyped-def]
        size = memoryview(data).nbytes
        if written[0] + size > limit:
            if message is not None:
                raise OSError(message)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        written[0] += size
        return real(handle, data)

    monkeypatch.setattr(diskfull, "write_chunk", write)


@pytest.mark.parametrize("message", [None, "8008 requested and 7136 written"])
def test_dump_long_on_a_full_disk_says_so_and_names_the_folder(invoke, llama_256, tmp_path,
                                                               monkeypatch, message):
    out = tmp_path / "book"
    _disk_full_after(monkeypatch, 20_000, message)
    result = invoke("dump", long_text(100), "-m", llama_256, "--long", "-o", out)
    assert result.exit_code == 1, result.output
    error = result.stderr.replace("\n", " ")
    assert f"no space left on the device while writing {out}{'/'}" in error, error
    assert "the disk is full" in error and "free some disk space" in error
    assert ".attnviz-dump" not in error and "requested and" not in error
    assert not out.exists()  # nothing half-written is left (the folder was made by the dump)


def test_a_full_dump_and_a_figure_on_a_full_disk_say_the_same(invoke, cli_minilm, tmp_path,
                                                              monkeypatch):
    _disk_full_after(monkeypatch, 0)
    for args, shown in ((["dump", "The cat sat", "-o", tmp_path / "d"], tmp_path / "d"),
                        (["heatmap", "The cat sat", "-l", "0", "--head", "0", "-o",
                          tmp_path / "h.png"], tmp_path / "h.png")):
        result = invoke(*args)
        assert result.exit_code == 1, result.output
        error = result.stderr.replace("\n", " ")
        assert f"no space left on the device while writing {shown}" in error, error
        assert "the disk is full" in error and ".tmp" not in error
    assert not (tmp_path / "h.png").exists()


def test_a_long_capture_in_the_temporary_folder_names_tmpdir(invoke, llama_256, tmp_path,
                                                              monkeypatch):
    import tempfile

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)  # read TMPDIR again
    _disk_full_after(monkeypatch, 0)
    result = invoke("heatmap", long_text(60), "-m", llama_256, "--long", "-l", "0",
                    "-o", tmp_path / "h.png")
    assert result.exit_code == 1, result.output
    error = result.stderr.replace("\n", " ")
    assert f"temporary folder {tmp_path}" in error and "TMPDIR" in error, error
    assert "the disk is full" in error and "attnviz-long-" not in error
    assert not list(tmp_path.glob("attnviz-long-*"))


def test_the_server_answers_507_without_paths_when_its_disk_is_full(llama_256, tmp_path,
                                                                     monkeypatch):
    import tempfile

    from starlette.testclient import TestClient

    from attnviz.server.app import create_app

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)
    app = create_app([str(llama_256)], device="cpu")
    client = TestClient(app, base_url="http://127.0.0.1:8000")
    _disk_full_after(monkeypatch, 0)
    answer = client.post("/api/long/capture", json={"text": long_text(60),
                                                    "model": str(llama_256)})
    assert answer.status_code == 507, answer.text
    error = answer.json()["error"]
    assert "no space left" in error["message"] and error["type"] == "NoSpaceError"
    for path in (str(tmp_path), str(llama_256), "/tmp", "attnviz-long"):
        assert path not in answer.text


def test_export_long_on_a_full_disk_describes_the_text_and_keeps_an_index(
        invoke, llama_256, tmp_path, monkeypatch):
    import json

    out = tmp_path / "out"
    first = invoke("export", long_text(50), "-m", llama_256, "--long", "-o", out)
    assert first.exit_code == 0, first.output
    _disk_full_after(monkeypatch, 30_000)
    result = invoke("export", long_text(50), long_text(70), "-m", llama_256, "--long",
                    "--force", "-o", out)
    assert result.exit_code == 1, result.output
    assert "no space left on the device" in result.stderr
    monkeypatch.undo()
    index = json.loads((out / "index.json").read_text(encoding="utf-8"))
    for entry in index["texts"]:
        folder = out / entry["folder"]
        if any(folder.iterdir()):  # a text's files are described by its manifest
            manifest = json.loads((folder / "export.json").read_text(encoding="utf-8"))
            if entry["status"] != "failed":
                assert manifest["complete"], (entry, manifest)
            elif manifest["complete"]:  # --force failed: the earlier export stays whole
                assert all((folder / name).is_file() for name in manifest["files"]), manifest
    assert any(entry["status"] == "failed" and "no space" in entry.get("error", "")
               for entry in index["texts"]), index["texts"]


# --------------------------------------------------------------------------- --help (20)
def _command_paths() -> list[list[str]]:
    import typer

    from attnviz.cli import app

    paths: list[list[str]] = [[]]

    def walk(command, prefix):  # type: ignore[no-untyped-def]
        for name, sub in getattr(command, "commands", {}).items():
            paths.append([*prefix, name])
            walk(sub, [*prefix, name])

    walk(typer.main.get_command(app), [])
    return paths


def _ragged_breaks(text: str, width: int = 80) -> list[str]:
    """Lines of the help's prose (before the option boxes) that end although the next line's
    first word would have fitted, and example lines that wrap."""
    lines = [line.rstrip() for line in text.split("╭")[0].splitlines()]
    room = width - 2  # rich pads the text by one column on each side
    bad = []
    for a, b in zip(lines, lines[1:]):
        a_text, b_text = a[1:], b[1:]
        if not a_text.strip() or not b_text.strip() or a_text.startswith("Usage:"):
            continue
        if a_text.startswith("  "):  # an example: one line each
            bad.append(f"example wraps: {a_text.strip()!r} / {b_text.strip()!r}")
            continue
        if b_text.startswith("-") and a_text.endswith((".", ":")):
            continue  # a new item on its own line
        if len(a_text) + 1 + len(b_text.split()[0]) <= room:
            bad.append(f"{a_text!r} / {b_text!r}")
    return bad


def test_every_help_text_wraps_cleanly_at_80_columns(runner, monkeypatch):
    from attnviz.cli import app

    monkeypatch.setenv("COLUMNS", "80")
    paths = _command_paths()
    assert len(paths) > 10
    problems = {}
    for path in paths:
        result = runner.invoke(app, [*path, "--help"])
        assert result.exit_code == 0, (path, result.output)
        bad = _ragged_breaks(result.stdout)
        if bad:
            problems[" ".join(path) or "attnviz"] = bad
    assert not problems, problems


def test_the_ragged_breaks_of_the_issue_are_recognised():
    text = (" Usage: attnviz heatmap\n\n"
            " Figures grow with the input up to a bound, then label every n-th token; zoom\n"
            " into long\n"
            " inputs with --tokens A:B (or --queries / --keys). Colours: --scale power\n"
            " (default,\n"
            " --gamma 0.5) and --vmax auto.\n╭─ Options")
    assert len(_ragged_breaks(text)) == 2  # "into long" / "inputs", "(default," / "--gamma"


# --------------------------------------------------------------------------- figures (19)
def test_cell_text_keeps_a_significant_digit():
    from attnviz.render.parts import cell_text

    assert cell_text(0.25) == "0.25" and cell_text(1.0) == "1.00" and cell_text(0.0) == "0.00"
    assert cell_text(-1e-9) == "-1e-9" and cell_text(-0.0) == "0.00"
    assert cell_text(0.00042) == "4e-4" and cell_text(0.0049) == "5e-3"
    assert cell_text(0.005) == "0.01" or cell_text(0.005) == "5e-3"  # rounding at the edge


@pytest.fixture(scope="module")
def long_dump(llama_256: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.long_fixtures import capture_tiny_llama

    return capture_tiny_llama(llama_256, 240, tmp_path_factory.mktemp("long-dump") / "cap")


def test_an_exact_window_of_a_long_capture_writes_what_tells_weights_apart(long_dump):
    from attnviz.long import LongCapture
    from attnviz.render.atlas import head_matrix, tile_head_figure
    from attnviz.render.colours import MASKED_RGB
    from attnviz.render.heatmap import FigureOptions

    cap = LongCapture.open(long_dump)
    try:
        rows, cols = (200, 212), (100, 112)  # weights of order 1/200, none masked
        artists = tile_head_figure(cap, 1, 0, rows, cols, options=FigureOptions(annot=True))
        matrix = head_matrix(cap, 1, 0, rows, cols)
        texts = [cell.get_text() for cell in artists.cells]
        assert len(texts) == matrix.size and "0.00" not in texts, texts[:12]
        for text, value in zip(texts, matrix.ravel()):
            assert float(text) == pytest.approx(float(value), rel=0.5, abs=0.005)
        # queries 0:12, keys 0:12 of a causal model: the future is grey, without a value
        artists = tile_head_figure(cap, 1, 0, (0, 12), (0, 12), options=FigureOptions(annot=True))
        image = np.asarray(artists.image.get_array())
        upper = np.triu(np.ones((12, 12), dtype=bool), 1)
        assert (image[upper] == MASKED_RGB).all()
        assert not (image[~upper] == MASKED_RGB).all(axis=-1).any()
        assert len(artists.cells) == int((~upper).sum())
    finally:
        cap.close()


def test_a_full_capture_draws_masked_cells_grey_and_bidirectional_none(minilm, llama_256):
    from attnviz.models.hf import HFSource
    from attnviz.render.colours import MASKED_RGB
    from attnviz.render.heatmap import FigureOptions, capture_head_figure

    causal = HFSource(str(llama_256), device="cpu").capture("the cat sat on the mat")
    artists = capture_head_figure(causal, 0, 1, options=FigureOptions(annot=True,
                                                                       tokens="2:7"))
    image = np.asarray(artists.image.get_array())
    upper = np.triu(np.ones((5, 5), dtype=bool), 1)
    assert (image[upper] == MASKED_RGB).all() and len(artists.cells) == 15
    bidirectional = capture_head_figure(minilm.capture("the cat sat on the mat"), 0, 1)
    assert not (np.asarray(bidirectional.image.get_array()) == MASKED_RGB).all(axis=-1).any()


def test_export_frames_draw_masked_cells_grey_without_values():
    """The fast renderer (export's PNGs): masked cells in the long view's grey, no value."""
    from attnviz.render import fast
    from attnviz.render.colours import MASKED_RGB
    from attnviz.render.parts import masked_cells

    labels = [f"t{i}" for i in range(6)]
    masked = masked_cells((0, 6), (0, 6), causal=True)
    template = fast.head_template(labels, labels, titles=["t"], annot=True, masked=masked)
    matrix = np.tril(np.ones((6, 6), np.float32))
    matrix /= matrix.sum(axis=1, keepdims=True)
    image = template.compose([matrix], "t")
    box = template.boxes[0]
    cells = image[box.cell_rows[:, None], box.cell_cols[None, :]]
    assert masked is not None and (cells[masked] == MASKED_RGB).all()
    assert not (cells[~masked] == MASKED_RGB).all(axis=-1).any()
    # every pixel of a masked cell is grey (no glyph); a seen cell holds its value's glyph
    region = image[box.top:box.bottom, box.left:box.right]
    inside = (box.row_index[:, None] == 1) & (box.col_index[None, :] == 4)  # away from edges
    assert (region[inside] == MASKED_RGB).all()
    seen = (box.row_index[:, None] == 4) & (box.col_index[None, :] == 1)
    assert len({tuple(pixel) for pixel in region[seen].tolist()}) > 1


# --------------------------------------------------------------------------- atlas masks (19)
@pytest.mark.parametrize(("tokens", "block", "causal", "window"),
                         [(100, 8, True, None), (97, 16, True, 20), (64, 8, False, 10),
                          (50, 7, False, None), (33, 4, True, 4)])
def test_masked_blocks_are_the_blocks_where_no_query_sees_a_key(tokens, block, causal, window):
    import numpy as np

    from attnviz.render.parts import masked_blocks

    found = masked_blocks(tokens, block, causal=causal, window=window)
    i = np.arange(tokens)[:, None]
    j = np.arange(tokens)[None, :]
    visible = np.ones((tokens, tokens), dtype=bool)
    if causal:
        visible &= j <= i
    if window:
        visible &= j > i - window
    n = -(-tokens // block)
    expected = np.array([[not visible[a * block:(a + 1) * block, b * block:(b + 1) * block].any()
                          for b in range(n)] for a in range(n)])
    if not expected.any():
        assert found is None
    else:
        assert found is not None and (found == expected).all()


def _causal_long(tmp_path: Path, seed: int) -> Any:
    """An open long capture of random causal queries and keys: 256 tokens, 2 heads, 1 layer."""
    from attnviz.long import LongCapture
    from tests.long_fixtures import write_long

    rng = np.random.default_rng(seed)
    q = rng.normal(size=(1, 2, 256, 8)).astype(np.float32)
    k = rng.normal(size=(1, 1, 256, 8)).astype(np.float32)
    return LongCapture.open(write_long(tmp_path / "lc", q, k, causal=True))


def test_an_atlas_draws_the_blocks_a_causal_query_cannot_see_grey(tmp_path):
    import numpy as np

    from attnviz.render.atlas import atlas_head_figure
    from attnviz.render.colours import MASKED_RGB
    from attnviz.render.heatmap import FigureOptions

    cap = _causal_long(tmp_path, seed=0)
    try:
        fig, block = atlas_head_figure(cap, 0, 0, options=FigureOptions())
        image = np.asarray(fig.axes[0].images[0].get_array())
        n = -(-256 // block)
        assert image.shape[:2] == (n, n)
        rgb = image[..., :3] if image.dtype == np.uint8 else (image[..., :3] * 255).round()
        assert (rgb[0, n - 1] == MASKED_RGB).all()  # the first queries, the last keys
        assert not (rgb[n - 1, 0] == MASKED_RGB).all()  # the last queries see the first keys
        assert not (rgb[n - 1, n - 1] == MASKED_RGB).all()  # the diagonal holds weights
    finally:
        cap.close()


# ------------------------------------------------------ masked cells in every figure kind (19)
def _causal_and_not(llama_256: Path, minilm: Any) -> tuple[Any, Any]:
    from attnviz.models.hf import HFSource

    causal = HFSource(str(llama_256), device="cpu").capture("the cat sat on the mat")
    return causal, minilm.capture("the cat sat on the mat")


def _grey(image: Any) -> Any:
    """Which pixels of an RGB(A) image are the masked grey."""
    import numpy as np

    from attnviz.render.colours import MASKED_RGB

    rgb = np.asarray(image)[..., :3]
    if rgb.dtype != np.uint8:
        rgb = (rgb * 255).round()
    return (rgb == MASKED_RGB).all(axis=-1)


def test_layer_grids_and_the_overview_draw_masked_cells_grey(minilm, llama_256):
    import numpy as np

    from attnviz.render.heatmap import FigureOptions, capture_grid_figure

    causal, bidirectional = _causal_and_not(llama_256, minilm)
    size = causal.num_tokens
    upper = np.triu(np.ones((size, size), dtype=bool), 1)
    for layer in (0, None):  # one layer's heads, every layer and head
        fig = capture_grid_figure(causal, layer, options=FigureOptions())
        images = fig.axes[0].images
        assert len(images) == causal.num_heads * (1 if layer == 0 else causal.num_layers)
        for image in images:
            grey = _grey(image.get_array())
            assert grey.shape == (size, size) and (grey == upper).all()
    fig = capture_grid_figure(bidirectional, 0, options=FigureOptions())
    assert not any(_grey(image.get_array()).any() for image in fig.axes[0].images)
    # a window of queries 3:6 and keys 1:4: the cells after each query's own position
    fig = capture_grid_figure(causal, 0, options=FigureOptions(queries="3:6", keys="1:4"))
    rows, cols = np.arange(3, 6)[:, None], np.arange(1, 4)[None, :]
    assert (_grey(fig.axes[0].images[0].get_array()) == (cols > rows)).all()


def test_export_grid_frames_draw_masked_cells_grey():
    """The fast renderer's grid frames (export's layer and overview PNGs)."""
    import numpy as np

    from attnviz.render import fast
    from attnviz.render.parts import masked_cells

    labels = [f"t{i}" for i in range(6)]
    masked = masked_cells((0, 6), (0, 6), causal=True)
    template = fast.grid_template(1, 3, 6, ["layer 0"], ["head 0", "head 1", "head 2"],
                                  tokens=labels, titles=["t"], masked=masked)
    matrix = np.tril(np.ones((6, 6), np.float32))
    matrix /= matrix.sum(axis=1, keepdims=True)
    image = template.compose([matrix] * 3, "t")
    assert masked is not None and len(template.boxes) == 3
    for box in template.boxes:
        cells = image[box.cell_rows[:, None], box.cell_cols[None, :]]
        assert (_grey(cells) == masked).all()


def test_exported_layer_grids_of_a_causal_model_are_grey_above_the_diagonal(llama_256, tmp_path):
    """`attnviz export` end to end: the layer PNG's panels, read back from the file."""
    import numpy as np
    from PIL import Image
    from typer.testing import CliRunner

    from attnviz.cli import app

    texts = tmp_path / "in.txt"
    texts.write_text("the cat sat on the mat\n", encoding="utf-8")
    out = tmp_path / "out"
    done = CliRunner().invoke(app, ["export", "--input", str(texts), "-m", str(llama_256),
                                    "-o", str(out), "--no-cache"])
    assert done.exit_code == 0, done.output
    grids = sorted(out.rglob("L0[0-9].png")) + sorted(out.rglob("overview.png"))
    assert len(grids) >= 2, sorted(p.name for p in out.rglob("*"))
    for grid in grids:
        pixels = np.asarray(Image.open(grid).convert("RGB"))
        assert _grey(pixels).sum() > 100, grid.name  # the panels' upper triangles


def test_atlas_grids_draw_blocks_no_query_sees_grey(tmp_path):

    from attnviz.render.atlas import atlas_grid_figure
    from attnviz.render.heatmap import FigureOptions

    cap = _causal_long(tmp_path, seed=1)
    try:
        fig, block = atlas_grid_figure(cap, None, options=FigureOptions())
        n = -(-256 // block)
        for image in fig.axes[0].images:
            grey = _grey(image.get_array())
            assert grey.shape == (n, n) and grey[0, n - 1] and not grey[n - 1, 0]
            assert not grey.diagonal().any()
    finally:
        cap.close()


def test_compare_panels_draw_the_causal_side_grey(minilm, llama_256):
    import numpy as np

    from attnviz.render.analysis import Panel, draw_comparison
    from attnviz.render.parts import masked_cells

    causal, bidirectional = _causal_and_not(llama_256, minilm)
    size = causal.num_tokens
    masked = masked_cells((0, size), (0, size), causal=True)
    labels = [f"t{i}" for i in range(size)]
    a = Panel(np.asarray(bidirectional.matrix(0, 0))[:size, :size], labels, labels, "A")
    b = Panel(np.asarray(causal.matrix(0, 0)), labels, labels, "B", masked=masked)
    fig = draw_comparison(a, b, title="t")
    first, second = (ax.images[0].get_array() for ax in fig.axes[:2])
    assert not _grey(first).any() and (_grey(second) == masked).all()
