"""Progress of the long steps on standard error: a bar naming the step on a terminal, one line
per step elsewhere, nothing for a step over at once."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from tests.long_fixtures import build_tiny_llama, long_text


def _console(terminal: bool) -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, force_terminal=terminal, width=120, highlight=False), out


def test_a_step_is_one_line_off_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    import attnviz.cli._steps as steps

    console, out = _console(False)
    monkeypatch.setattr(steps, "QUIET_SECONDS", 0.0)
    step = steps.step(console, "forward pass", "layers")
    for done in range(4):
        step(done, 3)
    assert out.getvalue().strip() == "forward pass: 0/3 layers..."
    step(0, 3)  # the next text's forward: its own line
    assert out.getvalue().count("forward pass") == 2


def test_a_short_step_says_nothing() -> None:
    import attnviz.cli._steps as steps

    console, out = _console(False)
    step = steps.step(console, "forward pass", "layers")
    for done in range(4):
        step(done, 3)
    assert out.getvalue() == ""


def test_a_step_is_a_bar_with_count_and_time_left_on_a_terminal(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import attnviz.cli._steps as steps

    console, out = _console(True)
    monkeypatch.setattr(steps, "QUIET_SECONDS", 0.0)
    step = steps.step(console, "top-3 keys, layer 2 head 3", "queries")
    step(0, 16000)
    step(4000, 16000)
    assert step.bar is not None
    step.bar.refresh()
    shown = out.getvalue()
    assert "top-3 keys, layer 2 head 3" in shown and "4000/16000" in shown
    assert "queries" in shown and "spent," in shown and "left" in shown
    step(16000, 16000)
    assert step.bar is None  # removed once done


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("progress-llama"), positions=2048,
                            layers=3)


def test_cli_names_each_long_step(invoke: Any, llama_dir: Path,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """top-k --long: the forward pass (up to the layer asked for) and the ranking are named
    on standard error; the table on standard output is untouched."""
    import attnviz.cli._steps as steps

    monkeypatch.setattr(steps, "QUIET_SECONDS", 0.0)
    result = invoke("top-k", "-", "--model", str(llama_dir), "--long", "-l", "1", "--head",
                    "2", "-k", "2", "-f", "csv", "--no-cache", input=long_text(300))
    assert result.exit_code == 0, result.output
    assert "forward pass: 0/2 layers..." in result.stderr  # layer 2 is never run
    assert "top-2 keys, layer 1 head 2: 0/" in result.stderr
    assert result.stdout.startswith("query_index,query,rank,key_index,key,weight")


def test_doing_says_what_only_when_it_takes_a_while(monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    import attnviz.cli._steps as steps

    console, out = _console(False)
    monkeypatch.setattr(steps, "QUIET_SECONDS", 0.05)
    with steps.doing(console, "drawing the figure"):
        pass
    assert out.getvalue() == ""
    with steps.doing(console, "drawing the figure"):
        time.sleep(0.3)
    assert out.getvalue().strip() == "drawing the figure..."
