"""Smaller rough edges of the commands: top-k positions, local model names in titles,
``heads --plot`` and 80-column tables, and texts that become [UNK]."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from attnviz.analysis.topk import topk_csv
from attnviz.capture import Capture, load_capture, model_label

REPEATED = "The cat sat on the mat. The dog sat on the mat."
WARM = "The cat sat on the mat because it was warm."
TOY = ["--model", "toy"]


# --------------------------------------------------------------------------- top-k positions
def test_topk_table_and_markdown_show_positions(invoke, cli_minilm, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    data = json.loads(invoke("top-k", REPEATED, "-l", "5", "--head", "3", "-f", "json").stdout)
    rows = data["rows"]
    table = invoke("top-k", REPEATED, "-l", "5", "--head", "3")
    assert table.exit_code == 0, table.output
    cells = [re.findall(r"(\d+):(\S+) (\d\.\d{3})", line) for line in table.stdout.split("\n")
             if re.match(r"^\W*\d+ \W", line)]
    assert len(cells) == len(rows) == 16
    for found, row in zip(cells, rows):
        assert [(int(i), key, float(w)) for i, key, w in found] == [
            (t["key_index"], t["key"], round(t["weight"], 3)) for t in row["top"]]
    # "mat" at 6 and at 13 are told apart, in the table and in markdown.
    keys = {(t["key_index"], t["key"]) for row in rows for t in row["top"]}
    assert {(6, "mat"), (13, "mat")} <= keys
    assert "6:mat" in table.stdout and "13:mat" in table.stdout
    markdown = invoke("top-k", REPEATED, "-l", "5", "--head", "3", "-f", "markdown").stdout
    first = next(line for line in markdown.split("\n") if line.startswith("| 0 |"))
    assert [f"{t['key_index']}:{t['key']} ({t['weight']:.3f})" for t in rows[0]["top"]] == \
        [cell.strip() for cell in first.strip("|").split("|")[2:]]


def test_topk_csv_json_export_keep_the_same_positions(invoke, cli_minilm, minilm):
    args = ("top-k", REPEATED, "-l", "5", "--head", "3", "-k", "2")
    lines = invoke(*args, "-f", "csv").stdout.strip().split("\n")
    assert lines[0] == "query_index,query,rank,key_index,key,weight"
    from_cli = [line.split(",")[3] for line in lines[1:]]
    data = json.loads(invoke(*args, "-f", "json").stdout)
    assert from_cli == [str(t["key_index"]) for row in data["rows"] for t in row["top"]]
    # export's topk.csv lists the same key positions for that head.
    capture = minilm.capture(REPEATED)
    from attnviz.analysis.tokens import piece_labels

    exported = topk_csv(capture.weights[5:6, 3:4], [5], [3], piece_labels(capture), 2)
    assert [line.split(",")[5] for line in exported.strip().split("\n")[1:]] == from_cli


# --------------------------------------------------------------------------- model names
def _uniform(model: str) -> Capture:
    weights = np.full((1, 1, 3, 3), 1 / 3, dtype=np.float32)
    return Capture.from_attentions([weights], ["a", "b", "c"], model=model)


@pytest.mark.parametrize(("name", "shown"), [
    ("/home/someone/models/my-bert", "my-bert"), ("/home/someone/models/my-bert/", "my-bert"),
    ("./checkpoints/run-7", "run-7"), ("~/models/tiny", "tiny"), ("a/b/c", "c"),
    ("C:\\models\\bert", "bert"), ("minilm", "minilm"), ("toy", "toy"),
    ("bert-base-uncased", "bert-base-uncased"), ("openai-community/gpt2", "openai-community/gpt2"),
])
def test_model_label(name, shown):
    assert model_label(name) == shown


def test_titles_show_the_folder_name_and_the_sidecar_keeps_the_path(tmp_path):
    from attnviz.render import heatmap

    path = str(tmp_path / "deep" / "folder" / "my-bert")
    capture = _uniform(path)
    assert capture.model_label == "my-bert"
    assert heatmap.head_title(capture, 0, 0) == "my-bert: layer 0, head 0"
    assert heatmap.layer_title(capture, 0).startswith("my-bert: layer 0")
    assert heatmap.overview_title(capture).startswith("my-bert: ")
    artists = heatmap.capture_head_figure(capture, 0, 0)
    assert artists.title.get_text().startswith("my-bert: layer 0, head 0")
    capture.save(tmp_path / "saved")
    sidecar = json.loads((tmp_path / "saved" / "capture.json").read_text(encoding="utf-8"))
    assert sidecar["model"] == path and load_capture(tmp_path / "saved").model == path


def test_commands_title_a_local_model_by_its_folder(invoke, tiny_gpt2_dir, tmp_path):
    folder = str(Path(tiny_gpt2_dir).resolve())
    name = Path(folder).name
    topk = invoke("top-k", "The cat sat", "--model", folder, "-l", "0", "--head", "0")
    assert topk.exit_code == 0, topk.output
    assert topk.stdout.lstrip().startswith(f"{name}: layer 0, head 0")
    assert folder not in topk.stdout
    heads = invoke("heads", "The cat sat", "--model", folder, "--no-induction")
    assert heads.stdout.startswith(f"{name}: 1 text") and folder not in heads.stdout
    compared = invoke("compare", "The cat sat", "The dog sat", "--model", folder, "-l", "0",
                      "--format", "json", "-o", tmp_path / "c.png")
    data = json.loads(compared.stdout)
    assert data["a"]["label"].startswith(f"A: {name}: ") and data["a"]["model"] == folder
    invoke("dump", "The cat sat", "--model", folder, "-o", tmp_path / "cap")
    assert load_capture(tmp_path / "cap").model == folder


# --------------------------------------------------------------------------- heads --plot
def test_heads_plot_draws_the_plot_instead_of_the_table(invoke, tmp_path):
    plot = tmp_path / "entropy.png"
    result = invoke("heads", WARM, *TOY, "--plot", plot, "--stat", "entropy")
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == str(plot)  # where the plot went, and nothing else
    assert "Per layer" not in result.output and "label" not in result.stdout
    assert f"drawn to {plot}" in result.stderr and "--format table" in result.stderr
    from PIL import Image

    with Image.open(plot) as image:
        assert image.size[0] > 100
    both = invoke("heads", WARM, *TOY, "--plot", plot, "--format", "table")
    assert "Per layer" in both.stdout and both.stdout.strip().endswith(str(plot))
    csv_and_plot = invoke("heads", WARM, *TOY, "--plot", plot, "--format", "csv")
    assert csv_and_plot.stdout.startswith("layer,head,") and str(plot) in csv_and_plot.stderr


def test_heads_layer_labels_do_not_wrap_at_80_columns(invoke, cli_minilm, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    result = invoke("heads", WARM)
    assert result.exit_code == 0, result.output
    lines = result.stdout.rstrip("\n").split("\n")
    assert max(len(line) for line in lines) <= 80
    per_layer = lines[next(i for i, line in enumerate(lines) if line.startswith("Per layer")):]
    rows = per_layer[3:]  # title, header, rule; the table ends at a blank line (sinks follow)
    rows = rows[:rows.index("")] if "" in rows else rows
    assert [row.split()[0] for row in rows] == [str(layer) for layer in range(6)], per_layer
    data = json.loads(invoke("heads", WARM, "--format", "json").stdout)
    from attnviz.analysis.stats import SHORT_LABELS

    for row, layer in zip(rows, range(6)):
        counts = {}
        for head in data["heads"]:
            if head["layer"] == layer:
                counts[head["label"]] = counts.get(head["label"], 0) + 1
        shown = set(row.split("   ")[-1].strip().split(", "))
        full = {f"{n} {label}" for label, n in counts.items()}
        short = {f"{n} {SHORT_LABELS[label]}" for label, n in counts.items()}
        assert shown in (full, short)
    assert all(len(line) <= 80 for line in result.stderr.split("\n"))


# --------------------------------------------------------------------------- [UNK]
def test_a_text_of_unknown_characters_is_said(invoke, cli_minilm):
    result = invoke("top-k", "\U0001F600 \U0001F389", "-l", "0", "--head", "0")
    assert result.exit_code == 0, result.output
    warning = next(line for line in result.stderr.split("\n") if "[UNK]" in line)
    assert warning.startswith("Warning: every token of the text became [UNK]")
    assert "'\U0001F600'" in warning and "'\U0001F389'" in warning
    some = invoke("top-k", "I love \U0001F600 pizza", "-l", "0", "--head", "0")
    assert "1 token became [UNK], not in minilm's vocabulary ('\U0001F600')" in some.stderr
    plain = invoke("top-k", "I love pizza", "-l", "0", "--head", "0")
    assert "[UNK]" not in plain.stderr


def test_unknown_warning_is_recorded_in_the_capture(minilm):
    capture = minilm.capture("\U0001F600 and \U0001F389")
    assert capture.tokens.count("[UNK]") == 2
    assert any("2 tokens became [UNK]" in w for w in capture.meta["warnings"])


def test_model_options_with_from_say_they_do_nothing(invoke, tmp_path) -> None:
    """--from reads a capture as it was captured: --max-tokens, --model, toy options... given
    with it are named in one warning (they were silently ignored)."""
    saved = tmp_path / "cap"
    assert invoke("dump", "the cat sat on the mat", "--model", "toy", "-o", saved).exit_code == 0
    result = invoke("top-k", "--from", saved, "-l", "0", "--head", "0", "--max-tokens", "3",
                    "--model", "minilm", "--no-truncate", "--toy-heads", "4", "-f", "json")
    assert result.exit_code == 0, result.output
    said = " ".join(result.stderr.split())
    assert ("--model, --max-tokens, --no-truncate, --toy-heads do nothing with --from" in said)
    assert len(json.loads(result.stdout)["rows"]) == 6  # every saved token, as it was
    quiet = invoke("top-k", "--from", saved, "-l", "0", "--head", "0")
    assert quiet.exit_code == 0 and "nothing with --from" not in quiet.stderr
