"""Hostile and broken input: a table of bad inputs across commands.

Each row gives the arguments, the expected exit code and a fragment of the message. Every run
is checked for: that exit code, the fragment, no Python traceback, and no new files anywhere in
the working folder (nothing half-written).
"""

from __future__ import annotations

import errno
import json
from pathlib import Path

import numpy as np
import pytest

HOSTILE_COMMANDS: dict[str, list[str]] = {}  # filled by the cases below; summarised at the end


@pytest.fixture(scope="module")
def arena(tmp_path_factory):
    """A folder with bad models, bad dumps and bad input files, built once."""
    from transformers import AutoTokenizer, BertConfig, BertModel, MambaConfig, MambaModel

    from attnviz.capture import Capture
    from attnviz.models.hf import bundled_model_path

    root = tmp_path_factory.mktemp("arena")
    tokenizer = AutoTokenizer.from_pretrained(bundled_model_path())

    # Models: no weights; config that does not match the checkpoint; no attention at all.
    bert = root / "models" / "mismatch"
    BertModel(BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2,
                         num_attention_heads=4, intermediate_size=64)).save_pretrained(bert)
    tokenizer.save_pretrained(bert)
    config = json.loads((bert / "config.json").read_text())
    (root / "models" / "noweights").mkdir()
    (root / "models" / "noweights" / "config.json").write_text(json.dumps(config))
    tokenizer.save_pretrained(root / "models" / "noweights")
    config["hidden_size"] = 64
    (bert / "config.json").write_text(json.dumps(config))
    mamba = root / "models" / "mamba"
    MambaModel(MambaConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2,
                           state_size=4)).save_pretrained(mamba)
    tokenizer.save_pretrained(mamba)
    (root / "models" / "empty").mkdir()
    (root / "models" / "file.bin").write_bytes(b"not a model")

    # Dumps: a good one, then broken copies.
    rng = np.random.default_rng(0)
    weights = rng.random((2, 2, 3, 3)).astype(np.float32)
    weights /= weights.sum(-1, keepdims=True)
    good = Capture(tokens=["a", "b", "c"], word_ids=[0, 1, 2], special=[False] * 3,
                   weights=weights, layers=[0, 1], heads=[0, 1], num_layers=2, num_heads=2,
                   model="toy", causal=False, text="a b c")
    dumps = root / "dumps"

    def broken(name: str, change) -> None:
        folder = dumps / name
        good.save(folder)
        change(folder / "attention.npy", folder / "capture.json")

    broken("good", lambda npy, side: None)
    broken("nosidecar", lambda npy, side: side.unlink())
    broken("truncated", lambda npy, side: npy.write_bytes(npy.read_bytes()[:90]))
    broken("wrongshape", lambda npy, side: np.save(npy, np.zeros((2, 2, 4, 4), np.float32)))

    def nan(npy: Path, side: Path) -> None:
        array = np.load(npy)
        array[1, 1, 2, 0] = np.nan
        np.save(npy, array)

    broken("nan", nan)

    def lie(npy: Path, side: Path) -> None:
        meta = json.loads(side.read_text())
        meta["tokens"] = ["a", "b"]
        meta["word_ids"], meta["special"], meta["display_tokens"] = [0, 1], [False] * 2, []
        side.write_text(json.dumps(meta))

    broken("lyingjson", lie)

    def pickled(npy: Path, side: Path) -> None:
        with open(npy, "wb") as handle:
            np.save(handle, np.array([object()], dtype=object), allow_pickle=True)

    broken("pickled", pickled)
    broken("badjson", lambda npy, side: side.write_text("{"))

    # Input files.
    inputs = root / "inputs"
    inputs.mkdir()
    (inputs / "latin1.txt").write_bytes("caf\xe9 au lait\n".encode("latin-1"))
    (inputs / "blank.txt").write_text("\n  \n\n")
    (inputs / "huge.txt").write_text("word " * 20_000)
    return root


def _args(arena: Path, args: list[str]) -> list[str]:
    return [a.replace("{A}", str(arena)) for a in args]


TOY = ["--model", "toy"]
CASES: list[tuple[str, list[str], int, str]] = [
    # ------------------------------------------------------------------ bad texts
    ("empty text", ["heatmap", ""], 2, "the text is empty"),
    ("whitespace text", ["top-k", " \t\n ", "-l", "0", "--head", "0"], 2, "the text is empty"),
    ("NUL in text", ["dump", "a\x00b", "-o", "d", *TOY], 2, "NUL"),
    ("control chars only", ["heatmap", "\x01\x02\x03", *TOY], 2, "no words"),
    ("empty pair", ["heatmap", "hi", "--pair", " "], 2, "--pair text is empty"),
    ("100k characters, no truncate", ["dump", "x " * 50_000, "--no-truncate", "-o", "d"], 2,
     "more than the limit of 512"),
    ("zero-width text only", ["heatmap", "\u200b\u200b"], 2, "besides special tokens"),
    ("max-tokens below specials", ["dump", "The dog sat", "--max-tokens", "1", "-o", "d"], 2,
     "leaves no room for the text"),
    ("stdin empty", ["heatmap", "-", *TOY], 2, "the text is empty"),
    # ------------------------------------------------------------------ bad selections
    ("layer out of range", ["heatmap", "hi", *TOY, "--layer", "1"], 2,
     "layer 1 is out of range: this model has 1 layer (0..0 or -1..-1)"),
    ("negative layer out of range", ["top-k", "hi", *TOY, "-l", "-2", "--head", "0"], 2,
     "layer -2 is out of range"),
    ("head out of range", ["heatmap", "hi", "--layer", "0", "--head", "12"], 2,
     "head 12 is out of range: this model has 12 heads (0..11 or -12..-1)"),
    ("reversed range", ["dump", "hi", *TOY, "--heads", "1-0", "-o", "d"], 2,
     "start comes after the end"),
    ("letters as range", ["dump", "hi", *TOY, "--layers", "a", "-o", "d"], 2,
     "is not an index or a range"),
    ("mean where not allowed", ["dump", "hi", *TOY, "--heads", "mean", "-o", "d"], 2,
     "is not an index or a range"),
    ("head without layer", ["heatmap", "hi", *TOY, "--head", "mean"], 2, "--head needs --layer"),
    ("non-integer layer", ["heatmap", "hi", *TOY, "--layer", "x"], 2,
     "Invalid value for '--layer'"),
    ("k zero", ["top-k", "hi", *TOY, "-l", "0", "--head", "0", "-k", "0"], 2, "-k"),
    ("layer not in a dump", ["heatmap", "--from", "{A}/dumps/good", "--layer", "0", "--head",
                             "5"], 2, "head 5 is out of range"),
    # ------------------------------------------------------------------ bad options
    ("unknown format", ["top-k", "hi", *TOY, "-l", "0", "--head", "0", "-f", "xml"], 2, "xml"),
    ("unknown device", ["heatmap", "hi", *TOY, "--device", "tpu"], 2, "invalid --device"),
    ("unknown dtype", ["heatmap", "hi", *TOY, "--dtype", "int4"], 2, "invalid --dtype"),
    ("CUDA without CUDA", ["heatmap", "hi", *TOY, "--device", "cuda:0"], 1,
     "CUDA is not available"),
    ("unknown colour map", ["heatmap", "hi", *TOY, "--cmap", "rainbowz"], 2,
     "unknown colour map"),
    ("unknown image suffix", ["heatmap", "hi", *TOY, "-o", "x.bmp"], 2, ".png, .svg or .pdf"),
    ("TEXT and --from", ["heatmap", "hi", "--from", "{A}/dumps/good"], 2, "not both"),
    ("--pair with --from", ["heatmap", "--from", "{A}/dumps/good", "--pair", "x"], 2,
     "--pair cannot be used with --from"),
    ("toy d_model", ["heatmap", "hi", *TOY, "--d-model", "5"], 2, "not divisible by --toy-heads"),
    ("negative seed", ["heatmap", "hi", *TOY, "--seed", "-1"], 2, "Invalid value for '--seed'"),
    ("huge seed", ["heatmap", "hi", *TOY, "--seed", "5000000000"], 2,
     "Invalid value for '--seed'"),
    ("invalid UTF-8 argument", ["heatmap", "ab\udcffcd", *TOY], 2, "not valid UTF-8"),
    ("invalid UTF-8 pair", ["heatmap", "ab", "--pair", "x\udcff"], 2,
     "--pair text is not valid UTF-8"),
    ("unknown command", ["heatmapz", "hi"], 2, "No such command"),
    # ------------------------------------------------------------------ bad models
    ("unknown hub id offline", ["heatmap", "hi", "--model", "nobody/nothing-here"], 1,
     "--model minilm"),
    ("folder without config", ["heatmap", "hi", "--model", "{A}/models/empty"], 1,
     "without config.json"),
    ("model path is a file", ["heatmap", "hi", "--model", "{A}/models/file.bin"], 1,
     "is a file, not a model folder"),
    ("folder without weights", ["heatmap", "hi", "--model", "{A}/models/noweights"], 1,
     "cannot load the model in folder"),
    ("config does not match checkpoint", ["heatmap", "hi", "--model", "{A}/models/mismatch"], 1,
     "cannot load the model in folder"),
    ("no attention output", ["heatmap", "hi", "--model", "{A}/models/mamba"], 1,
     "did not return attention weights"),
    # ------------------------------------------------------------------ bad dumps
    ("missing dump", ["heatmap", "--from", "{A}/dumps/none"], 1, "does not exist"),
    ("missing sidecar", ["heatmap", "--from", "{A}/dumps/nosidecar"], 1, "no JSON sidecar"),
    ("truncated npy", ["heatmap", "--from", "{A}/dumps/truncated"], 1, "truncated or corrupt"),
    ("wrong shape", ["heatmap", "--from", "{A}/dumps/wrongshape"], 1, "shape"),
    ("NaN weights", ["top-k", "--from", "{A}/dumps/nan", "-l", "0", "--head", "0"], 1, "NaN"),
    ("JSON lies about shape", ["heatmap", "--from", "{A}/dumps/lyingjson"], 1, "shape"),
    ("pickled object array", ["heatmap", "--from", "{A}/dumps/pickled"], 1, "cannot read"),
    ("sidecar not JSON", ["heatmap", "--from", "{A}/dumps/badjson"], 1, "cannot read"),
    ("dump path is a text file", ["heatmap", "--from", "{A}/inputs/blank.txt"], 1,
     "is not a capture"),
    # ------------------------------------------------------------------ other commands
    ("export: nothing to export", ["export", "-o", "out"], 2, "nothing to export"),
    ("export: missing input file", ["export", "--input", "{A}/inputs/none.txt", "-o", "out"], 2,
     "does not exist"),
    ("export: layer out of range", ["export", "a", *TOY, "--layers", "5", "-o", "out"], 2,
     "layer 5 is out of range"),
    ("export: unknown format", ["export", "a", *TOY, "--format", "gif", "-o", "out"], 2,
     "Invalid value for '--format'"),
    ("export: batch size 0", ["export", "a", *TOY, "--batch-size", "0", "-o", "out"], 2,
     "Invalid value for '--batch-size'"),
    ("export: too many jobs", ["export", "a", *TOY, "--jobs", "100000", "-o", "out"], 2,
     "--jobs 100000 is too many"),
    ("export: input is a folder", ["export", "--input", "{A}/inputs", *TOY, "-o", "out"], 2,
     "is a folder"),
    ("heads: input is a folder", ["heads", "--input", "{A}/inputs", *TOY], 2, "is a folder"),
    ("export: output name too long", ["export", "a", *TOY, "-o", "o" * 300], 1, "too long"),
    ("heads: invalid UTF-8 file", ["heads", "--input", "{A}/inputs/latin1.txt", *TOY], 2,
     "not valid UTF-8"),
    ("heads: only blank lines", ["heads", "--input", "{A}/inputs/blank.txt", *TOY], 2,
     "holds no texts"),
    ("heads: unknown sort key", ["heads", "hi", *TOY, "--sort", "nope"], 2,
     "Invalid value for '--sort'"),
    ("heads: bad plot suffix", ["heads", "hi", *TOY, "--plot", "x.gif"], 2,
     ".png, .svg or .pdf"),
    ("rollout: unknown fusion", ["rollout", "hi", *TOY, "--head-fusion", "median"], 2,
     "Invalid value for '--head-fusion'"),
    ("rollout: unknown token", ["rollout", "hi", *TOY, "--token", "zebra"], 2,
     "no token 'zebra'"),
    ("rollout: start layer out of range", ["rollout", "hi", *TOY, "--start-layer", "4"], 2,
     "layer 4 is out of range"),
    ("compare: nothing to compare", ["compare", *TOY], 2, "give a TEXT_A"),
    ("explain: unknown token", ["explain", "hi", "--token", "zebra"], 2, "no token 'zebra'"),
    ("html: not .html", ["html", "hi", *TOY, "-o", "x.txt"], 2, "does not end in .html"),
    ("html: bad precision", ["html", "hi", *TOY, "--precision", "12"], 2,
     "--precision 12 is not supported"),
    ("html: invalid UTF-8 file", ["html", "--input", "{A}/inputs/latin1.txt", *TOY, "-o",
                                  "r.html"], 2, "not valid UTF-8"),
    ("cache: unknown subcommand", ["cache", "frobnicate"], 2, "No such command"),
    # ------------------------------------------------------------------ bad outputs
    ("output inside a file", ["heatmap", "hi", *TOY, "-o", "{A}/inputs/blank.txt/x.png"], 1,
     "is a file"),
    ("dump onto a file", ["dump", "hi", *TOY, "-o", "{A}/inputs/blank.txt"], 2,
     "exists and is not a capture"),
    ("image onto a folder", ["heatmap", "hi", *TOY, "-o", "{A}/dumps"], 2, "it is a folder"),
]


@pytest.mark.parametrize(("name", "args", "code", "fragment"), CASES, ids=[c[0] for c in CASES])
def test_hostile(invoke, arena, tmp_path, monkeypatch, name, args, code, fragment):
    monkeypatch.chdir(tmp_path)
    before = sorted(p for p in arena.rglob("*"))
    result = invoke(*_args(arena, args), input="")
    output = result.stdout + result.stderr
    assert result.exit_code == code, output
    assert fragment in output, output
    assert "Traceback" not in output
    assert not [p for p in tmp_path.rglob("*") if p.is_file()], "no file may be left behind"
    assert sorted(p for p in arena.rglob("*")) == before, "no file may be added to inputs"
    HOSTILE_COMMANDS.setdefault(args[0], []).append(name)


@pytest.mark.parametrize("error", [errno.ENOSPC, errno.EACCES, errno.EROFS])
def test_write_failures_leave_nothing(invoke, tmp_path, monkeypatch, error):
    """Disk full, permission denied, read-only file system: clear message, no file left."""
    import os

    import attnviz.fileio as fileio

    def fail(*args, **kwargs):
        raise OSError(error, os.strerror(error))

    monkeypatch.setattr(fileio.os, "replace", fail)
    monkeypatch.chdir(tmp_path)
    for args in (["dump", "a b", *TOY, "-o", "c"], ["heatmap", "a b", *TOY, "-o", "x.png"]):
        result = invoke(*args)
        output = result.stdout + result.stderr
        assert result.exit_code == 1, output
        assert ("no space left" in output) if error == errno.ENOSPC else (
            "permission denied" in output)
        assert "Traceback" not in output
        assert not [p for p in tmp_path.rglob("*") if p.is_file()]


def test_invalid_utf8_on_stdin(runner):
    from attnviz.cli import app

    result = runner.invoke(app, ["heatmap", "-", *TOY], input=b"caf\xe9\n")
    assert result.exit_code == 2
    assert "not valid UTF-8" in result.output
