"""Usage errors of every command are one ``Error:`` line with exit code 2, never Typer's box.

The commands are read from the app itself, so a new command or option is covered as it
comes: an unknown option, a value under an option's bound, a word where a number goes, a
missing required option and an extra argument.
"""

from __future__ import annotations

from typing import Any

import pytest
import typer.main

from attnviz.cli import app


def _leaves(command: Any, path: list[str]) -> list[tuple[list[str], Any]]:
    children = getattr(command, "commands", None)
    if children is None:
        return [(path, command)]
    return [leaf for name, child in children.items() for leaf in _leaves(child, [*path, name])]


COMMANDS = _leaves(typer.main.get_command(app), [])


def _bound(param: Any) -> Any:
    """An option's lower bound (Typer's own parameters, or click's range type)."""
    low = getattr(param, "min", None)
    return low if low is not None else getattr(getattr(param, "type", None), "min", None)


def _is_option(param: Any) -> bool:
    return bool(getattr(param, "opts", None)) and param.opts[0].startswith("-") and not \
        getattr(param, "is_flag", False)


def _cases(path: list[str], command: Any) -> list[list[str]]:
    cases = [[*path, "--no-such-option"]]
    options = [p for p in command.params if _is_option(p)]
    numeric = [p for p in options if _bound(p) is not None]
    for param in numeric:
        low = _bound(param)
        cases.append([*path, param.opts[0], str(low - 1 if isinstance(low, int) else low - 1.0)])
    if numeric:
        cases.append([*path, numeric[0].opts[0], "many"])
    if any(p.required for p in command.params):
        cases.append(path)  # a required option missing
    arguments = [p for p in command.params if not p.opts[0].startswith("-")]
    if arguments:
        cases.append([*path, *(["some text"] * (len(arguments) + 1))])  # one too many
    return cases


def _check_one_line(result: Any, path: list[str]) -> str:
    assert result.exit_code == 2, (result.exit_code, result.output)
    lines = result.stderr.strip("\n").split("\n")
    assert len(lines) == 1, result.stderr
    line = lines[0]
    assert line.startswith("Error: "), line
    assert f"see 'attnviz{''.join(' ' + p for p in path)} --help'" in line, line
    assert "\u256d" not in result.output and "Usage:" not in result.output  # no box, no usage
    assert result.stdout == ""
    return line


@pytest.mark.parametrize(("path", "command"), COMMANDS, ids=[" ".join(p) for p, _ in COMMANDS])
def test_every_usage_error_of_every_command_is_one_line(invoke, forbid_loading, path, command):
    forbid_loading()
    cases = _cases(path, command)
    assert len(cases) >= 2 or path[0] == "cache"
    for args in cases:
        _check_one_line(invoke(*args), path)


def test_the_group_and_a_sub_group_answer_in_one_line(invoke):
    for args, path, said in ((["--bogus"], [], "No such option: --bogus"),
                             (["nosuch"], [], "No such command 'nosuch'"),
                             (["cache", "nosuch"], ["cache"], "No such command 'nosuch'")):
        assert said in _check_one_line(invoke(*args), path)


def test_top_k_k_and_dump_out_read_as_declared(invoke, forbid_loading):
    forbid_loading()
    line = _check_one_line(invoke("top-k", "The cat", "-l", "0", "--head", "0", "-k", "0"),
                           ["top-k"])
    assert "'-k'" in line and "'--k'" not in line
    assert "--k " not in invoke("top-k", "--help").stdout
    line = _check_one_line(invoke("dump", "The cat"), ["dump"])
    assert "Missing option '--out' / '-o'" in line
    line = _check_one_line(invoke("heatmap", "The cat", "--scale", "bogus"), ["heatmap"])
    assert "'bogus' is not one of" in line and "Value error" not in line


def test_the_console_script_prints_one_line(tmp_path):
    """The real entry point (not the test runner) prints the same single line."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "COLUMNS": "60"}
    done = subprocess.run([sys.executable, "-m", "attnviz", "dump", "The cat"], env=env,
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip().split("\n") == [
        "Error: Missing option '--out' / '-o'; see 'attnviz dump --help'"]
