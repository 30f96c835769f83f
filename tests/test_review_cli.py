"""Defects found by using the commands as a new user, a hostile user and a domain expert would.

Each test failed before its fix: compare's changes outside its zoom window, zooming on a changed
word, '+0.000' rows listed as changes and layer/head checks after loading; positions such as '²'
that crashed with a traceback; export checking --layers/--heads only after loading the model, and
its failures naming their input line twice.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

TOY = ("--model", "toy")


def test_compare_changes_stay_inside_the_zoom_window(invoke, tmp_path: Path) -> None:
    """--tokens cuts the figure to a window; the listed changes must come from that window too."""
    for a, b in (("The cat sat on the mat", "The dog sat on the rug"),  # positions
                 ("The cat sat on the mat and then slept", "The dog sat on the rug")):  # words
        result = invoke("compare", a, b, *TOY, "--layer", "0", "--head", "0", "--tokens", "0:3",
                        "-k", "50", "-f", "json", "-o", tmp_path / "c.png")
        assert result.exit_code == 0, result.output
        data = json.loads(result.stdout)
        changes = data["changes"]
        assert changes, "no changes listed"
        pairs = data["alignment"]["pairs"]
        for change in changes:
            a_query = change.get("a_query_index", change["query_index"])
            a_key = change.get("a_key_index", change["key_index"])
            assert 0 <= a_query < 3 and 0 <= a_key < 3, change
        # Every cell of the window (3 x 3 aligned pairs) is listed, none outside it.
        inside = [pair for pair in pairs if pair[0] < 3]
        assert len(changes) == len(inside) ** 2


# Text that str.isdigit() calls a number but int() refuses ('²', '--3'): a usage error, not a
# traceback, wherever a position may be typed.
ODD_NUMBERS = ("\u00b2", "--3", "1\u00b2", "-\u00b9")


def _no_traceback(result) -> None:
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output


def test_windows_with_odd_numbers_are_usage_errors(invoke, tmp_path: Path) -> None:
    for odd in ODD_NUMBERS:
        for option, value in (("--tokens", f"{odd}:"), ("--tokens", f"0:{odd}"),
                              ("--queries", odd), ("--keys", f":{odd}")):
            result = invoke("heatmap", "a b c", *TOY, "-l", "0", "--head", "0", option, value,
                            "-o", tmp_path / "h.png")
            _no_traceback(result)
            assert result.exit_code == 2, (option, value, result.output)
            assert option in result.output
            assert not (tmp_path / "h.png").exists()


def test_token_choice_with_odd_numbers_is_a_usage_error(invoke, tmp_path: Path) -> None:
    for odd in ODD_NUMBERS:
        for spec in (odd, f"cat:{odd}"):
            for command in (("rollout", "the cat sat", *TOY, "--token", spec,
                             "-o", tmp_path / "r.png"),
                            ("explain", "the cat sat", "--token", spec)):
                result = invoke(*command)
                _no_traceback(result)
                assert result.exit_code == 2, (command, result.output)
                assert "no token" in result.output


def test_export_checks_layers_and_heads_before_loading(invoke, forbid_loading, tmp_path) -> None:
    """export --layers 9 on a 6-layer model: said at once, from the config, not after loading."""
    tried = forbid_loading()
    for option, value, what in (("--layers", "0,3", "layer 3"), ("--heads", "5", "head 5")):
        for model in (("--model", "toy"), ()):  # the toy's options; MiniLM's config.json
            if not model:
                value = value.replace("3", "9").replace("5", "20")
                what = what.replace("3", "9").replace("5", "20")
            result = invoke("export", "a new text", *model, option, value,
                            "-o", tmp_path / "out")
            assert result.exit_code == 2, result.output
            assert f"{what} is out of range" in result.output
            assert not (tmp_path / "out").exists()
    assert tried == []


def test_compare_checks_layer_and_head_before_loading(invoke, forbid_loading, tmp_path) -> None:
    tried = forbid_loading()
    for args, what in ((("-l", "9"), "layer 9"), (("-l", "0", "--head", "20"), "head 20"),
                       (("--model-b", "toy", "-l", "-7"), "layer -7")):
        result = invoke("compare", "one new text", "another new text", *args,
                        "-o", tmp_path / "c.png")
        assert result.exit_code == 2, result.output
        assert f"{what} is out of range" in result.output
    assert tried == []


def test_compare_zooms_on_the_changed_word(invoke, tmp_path: Path) -> None:
    """--tokens cat:on names A's word; B has 'dog' there. The window is A's positions on both
    sides (they pair up), not an error about B."""
    result = invoke("compare", "The cat sat on the mat", "The dog sat on the mat", *TOY,
                    "-l", "0", "--head", "0", "--tokens", "cat:on", "-f", "json",
                    "-o", tmp_path / "c.png")
    assert result.exit_code == 0, result.output
    changes = json.loads(result.stdout)["changes"]
    assert {c["query_index"] for c in changes} == {1, 2, 3}
    assert {c["key_index"] for c in changes} == {1, 2, 3}
    # Word alignment: 'cat' pairs with 'dog' (a replaced run), so B's window follows the pairs.
    result = invoke("compare", "The cat sat on the mat", "The dog sat on the big mat", *TOY,
                    "-l", "0", "--head", "0", "--tokens", "cat:on", "-f", "json",
                    "-o", tmp_path / "w.png")
    assert result.exit_code == 0, result.output
    changes = json.loads(result.stdout)["changes"]
    assert {c["b_query_index"] for c in changes} == {1, 2, 3}
    # A word in neither side's window: the message says which side.
    result = invoke("compare", "The cat sat", "A dog ran away", *TOY, "-l", "0", "--head", "0",
                    "--queries", "ran", "-o", tmp_path / "x.png")
    assert result.exit_code == 2
    assert "no token 'ran' in A" in result.output


def test_export_failures_name_their_line_once(invoke, tmp_path: Path) -> None:
    """'failed line 4 of x.jsonl: line 4 of x.jsonl: ...' said where the text came from twice."""
    source = tmp_path / "x.jsonl"
    source.write_text('{"text": "a b", "id": "dup"}\n{"text": "c d", "id": "dup"}\n'
                      '{"text": 5}\nnot json {\n{"text": "e", "pair": 3}\n[1]\n'
                      '{"text": "f", "id": [1]}\n', encoding="utf-8")
    result = invoke("export", "--input", source, *TOY, "-o", tmp_path / "out")
    assert result.exit_code == 1, result.output
    failed = [line for line in result.stderr.splitlines() if line.startswith("failed")]
    assert len(failed) == 6, result.stderr
    for line in failed:
        assert line.count("x.jsonl") == 1, line
    index = json.loads((tmp_path / "out" / "index.json").read_text(encoding="utf-8"))
    errors = {t["origin"]: t["error"] for t in index["texts"] if t["status"] == "failed"}
    assert len(errors) == 6
    for origin, error in errors.items():
        assert origin not in error, (origin, error)
    by_line = {origin.split(" of ")[0]: error for origin, error in errors.items()}
    assert "used by another text" in by_line["line 2"]
    assert "not valid JSON" in by_line["line 4"]


def test_compare_of_equal_maps_lists_no_changes(invoke, tmp_path: Path) -> None:
    """Two texts the model sees alike: no '+0.000' rows called the largest changes."""
    result = invoke("compare", "The cat sat", "the cat sat", "--model-a", "toy", "--model-b",
                    "toy", "-l", "0", "--head", "0", "-f", "json", "-o", tmp_path / "c.png")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["aligned"] is True and data["changes"] == []
    table = invoke("compare", "The cat sat", "the cat sat", *TOY, "-l", "0", "--head", "0",
                   "-o", tmp_path / "t.png")
    assert table.exit_code == 0, table.output
    assert "+0.000" not in table.stdout and "no change" in table.stdout


@pytest.mark.parametrize("scale", ["linear", "log"])
def test_gamma_with_a_scale_that_has_no_exponent_is_a_usage_error(invoke, tmp_path, scale):
    result = invoke("heatmap", "the cat sat", "--model", "toy", "-l", "0", "--head", "0",
                    "--scale", scale, "--gamma", "0.3", "-o", tmp_path / "x.png")
    assert result.exit_code == 2, result.output
    assert "--gamma only applies to --scale power" in result.stderr
    assert not (tmp_path / "x.png").exists()
    fine = invoke("heatmap", "the cat sat", "--model", "toy", "-l", "0", "--head", "0",
                  "--scale", scale, "-o", tmp_path / "y.png")
    assert fine.exit_code == 0, fine.output
    power = invoke("heatmap", "the cat sat", "--model", "toy", "-l", "0", "--head", "0",
                   "--gamma", "0.3", "-o", tmp_path / "z.png")
    assert power.exit_code == 0, power.output


# --------------------------------------------------------------------------- second new-user pass
def _error(result, code: int) -> str:
    output = " ".join((result.stdout + result.stderr).split())
    assert result.exit_code == code, output
    assert "Traceback" not in output
    return output


def test_explain_suggests_only_options_it_has(invoke) -> None:
    output = _error(invoke("explain", "The cat sat", "-t", "dog"), 2)
    assert "no token 'dog'" in output and "--words" not in output
    rollout = _error(invoke("rollout", "The cat sat", *TOY, "--token", "dog"), 2)
    assert "use --words" in rollout  # rollout has --words


def test_a_misspelt_head_names_mean(invoke) -> None:
    output = _error(invoke("top-k", "The cat sat", *TOY, "-l", "0", "--head", "meen"), 2)
    assert "expected an integer such as 0, 5 or -1, or 'mean'" in output


def test_dump_refuses_a_file_ending_it_would_make_a_folder_of(invoke, tmp_path: Path) -> None:
    for name in ("x.txt", "out.npz"):
        output = _error(invoke("dump", "The cat sat", *TOY, "-o", tmp_path / name), 2)
        assert "a capture is written as a folder" in output
        assert not (tmp_path / name).exists()
    assert invoke("dump", "The cat sat", *TOY, "-o", tmp_path / "run.v2").exit_code == 0
    assert (tmp_path / "run.v2" / "attention.npy").is_file()  # other dotted names: a folder


def test_toy_options_with_another_model_are_reported(invoke, cli_minilm, tmp_path: Path) -> None:
    result = invoke("top-k", "The cat sat", "-l", "0", "--head", "0", "--toy-heads", "4",
                    "--seed", "3")
    output = _error(result, 0)
    assert "--toy-heads, --seed only apply to --model toy; ignored for minilm" in output
    quiet = invoke("top-k", "The cat sat", *TOY, "-l", "0", "--head", "0", "--toy-heads", "4")
    assert quiet.exit_code == 0 and "ignored" not in quiet.stderr


def test_counts_read_as_english(invoke, tmp_path: Path) -> None:
    result = invoke("export", "The cat sat", *TOY, "--figures", "overview", "--jobs", "1",
                    "-o", tmp_path / "out")
    assert result.exit_code == 0 and ": 1 text (1 exported" in result.stdout
    assert "Last run: 1 text:" in (tmp_path / "out" / "index.html").read_text("utf-8")
    dumped = invoke("dump", "a b", *TOY, "-o", tmp_path / "a")
    assert dumped.exit_code == 0
    once = _error(invoke("compare", "--from", tmp_path / "a", "--layer", "0"), 2)
    assert "--from was given once; compare needs it twice (A then B)" in once


def test_a_misspelt_built_in_model_is_suggested(invoke) -> None:
    output = _error(invoke("top-k", "a b", "--model", "tooy", "-l", "0", "--head", "0"), 1)
    assert "did you mean --model toy?" in output


def test_rollout_start_layer_is_named(invoke) -> None:
    output = _error(invoke("rollout", "The cat sat", *TOY, "--start-layer", "10"), 2)
    assert output.startswith("Error: --start-layer: layer 10 is out of range")


def test_heatmap_help_examples_run_as_written(invoke, cli_minilm, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Every example line of heatmap --help, in order, in an empty folder (dump makes long/)."""
    import shlex

    monkeypatch.chdir(tmp_path)
    text = invoke("heatmap", "--help").stdout
    lines = [" ".join(line.split()) for line in text.splitlines()]
    examples = [line.strip("│ ").strip() for line in lines
                if line.strip("│ ").startswith("attnviz ")]
    assert any("--from long/" in e for e in examples)
    assert invoke("dump", "The cat sat on the mat", "-o", "cat/").exit_code == 0
    for example in examples:
        result = invoke(*shlex.split(example)[1:])
        assert result.exit_code == 0, (example, result.output)


def test_default_names_keep_views_apart(invoke, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Three views of one head, and compare at two layers: no figure replaces another."""
    monkeypatch.chdir(tmp_path)
    args = ("heatmap", "The cat sat on the mat", *TOY, "--toy-layers", "2", "--layer", "1",
            "--head", "mean")
    names = []
    for extra in ((), ("--exclude-special",), ("--tokens", "1:4"), ("--tokens", "-3:"),
                  ("--words", "--queries", "cat")):
        result = invoke(*args, *extra)
        assert result.exit_code == 0, result.output
        names.append(result.stdout.strip())
    assert len(set(names)) == len(names), names
    assert names[2].endswith("_L1_mean_t1-4.png") and names[3].endswith("_L1_mean_tm3-end.png")
    compared = set()
    for layer in ("0", "1"):
        result = invoke("compare", "The cat sat", "The dog sat", *TOY, "--toy-layers", "2",
                        "-l", layer, "-f", "json")
        assert result.exit_code == 0, result.output
        compared.add(json.loads(result.stdout)["image"])
    assert len(compared) == 2 and all(Path(p).is_file() for p in compared)
