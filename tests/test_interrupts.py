"""A signal at the worst moment: nothing half-done stays behind.

Each test sends itself SIGTERM (handled by raising :class:`Stop`, as the CLI turns SIGTERM into
an exception) at an exact point in the code, so the race the process tests can only hit by
chance is hit every time.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import attnviz.export as export_module
import attnviz.fileio as fileio
from attnviz.export import ExportItem, ExportOptions, export_items
from attnviz.models import ModelSpec
from attnviz.models.toy import ToyConfig

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")


class Stop(Exception):
    """What the SIGTERM handler raises."""


@pytest.fixture()
def sigterm_raises() -> Iterator[None]:
    def stop(signum: int, frame: object) -> None:
        raise Stop

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _signal_self() -> None:
    os.kill(os.getpid(), signal.SIGTERM)


def test_signals_held_defers_the_signal_to_the_end_of_the_block(sigterm_raises: None) -> None:
    steps: list[str] = []
    with pytest.raises(Stop):
        with fileio.signals_held():
            _signal_self()
            time.sleep(0.05)  # unheld, the handler would raise here
            steps.append("after the signal")
        steps.append("after the block")
    assert steps == ["after the signal"]


def test_signals_held_restores_the_handlers(sigterm_raises: None) -> None:
    before = (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT))
    with fileio.signals_held():
        assert signal.getsignal(signal.SIGTERM) is not before[0]
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


def test_signals_held_keeps_an_ignored_signal_ignored(sigterm_raises: None) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with fileio.signals_held():
        _signal_self()
        time.sleep(0.05)
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN  # and we are still here


def test_a_signal_right_after_the_temporary_is_created_leaves_nothing(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, sigterm_raises: None) -> None:
    real = fileio._create_temp

    def create_then_signal(*args, **kwargs):  # type: ignore[no-untyped-def]
        created = real(*args, **kwargs)
        _signal_self()
        return created

    monkeypatch.setattr(fileio, "_create_temp", create_then_signal)
    with pytest.raises(Stop):
        fileio.atomic_write_text(tmp_path / "out.txt", "text")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_signal_between_manifest_and_index_entry(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, sigterm_raises: None) -> None:
    """The index never lists a text as exported whose folder is not complete."""
    real_add = export_module._Index.add

    def add_then_signal(self, entry):  # type: ignore[no-untyped-def]
        real_add(self, entry)
        if entry.get("status") == "exported":
            _signal_self()

    monkeypatch.setattr(export_module._Index, "add", add_then_signal)
    out = tmp_path / "out"
    items = [ExportItem(text=t, origin=f"text {n}")
             for n, t in enumerate(["the cat sat", "a dog barked"], 1)]
    with pytest.raises(Stop):
        export_items(items, out, ExportOptions(jobs=1, figures=("heads",)),
                     spec=ModelSpec(name="toy", toy=ToyConfig(layers=1, heads=2)))
    index = json.loads((out / "index.json").read_text("utf-8"))
    listed = [e for e in index["texts"] if e["status"] == "exported"]
    assert len(listed) == 1
    manifest = json.loads((out / listed[0]["folder"] / "export.json").read_text("utf-8"))
    assert manifest["complete"] is True
    assert [p for p in out.rglob("*") if p.name.endswith((".tmp", ".lock"))] == []


def test_two_held_signals_are_both_delivered(sigterm_raises: None) -> None:
    """The first handler raising does not drop the second signal."""
    seen: list[str] = []

    def interrupted(signum: int, frame: object) -> None:
        seen.append("int")
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, interrupted)
    try:
        with pytest.raises(KeyboardInterrupt) as caught:
            with fileio.signals_held():
                _signal_self()
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.05)
        assert seen == ["int"]
        assert isinstance(caught.value.__context__, Stop)  # SIGTERM's handler ran first
    finally:
        signal.signal(signal.SIGINT, previous)


def test_an_event_loops_wakeup_descriptor_is_left_alone() -> None:
    """With asyncio listening (a wakeup fd), holding would make it see the signal twice."""
    import asyncio

    calls: list[int] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, lambda: calls.append(1))
        try:
            with fileio.signals_held():
                _signal_self()
            await asyncio.sleep(0.2)
        finally:
            loop.remove_signal_handler(signal.SIGTERM)

    asyncio.run(main())
    assert calls == [1]


_SLOW_DUMP = """
import sys, time
import attnviz.long.seam as seam
from attnviz.cli import main

write = seam._write_npy

def slow(folder, name, array):
    write(folder, name, array)
    if name == "lse_000.npy":  # the signal lands here, with the first layer's files written
        sys.stderr.write(f"wrote {name}\\n")
        sys.stderr.flush()
        time.sleep(60)

seam._write_npy = slow
sys.argv = ["attnviz", *sys.argv[1:]]
main()
"""


@pytest.mark.parametrize(("signum", "code", "before"), [
    (signal.SIGINT, 130, False), (signal.SIGTERM, 143, True)])
def test_a_signal_during_dump_long_leaves_no_partial_capture(
        tmp_path: Path, signum: int, code: int, before: bool) -> None:
    """A real process stopped with its first layer's q_, k_ and lse_ files written: it exits
    130 (Ctrl-C) or 143 (SIGTERM), removes what it wrote and the folder it made, and leaves
    an earlier capture and the user's files as they were."""
    import subprocess

    from tests.long_fixtures import build_tiny_llama, capture_tiny_llama, long_text

    model = build_tiny_llama(tmp_path / "llama")
    out = tmp_path / "sg"
    files: dict[str, bytes] | None = None
    if before:
        capture_tiny_llama(model, 64, out)
        (out / "notes.txt").write_text("mine")
        files = {p.name: p.read_bytes() for p in out.iterdir()}
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    process = subprocess.Popen(
        [sys.executable, "-c", _SLOW_DUMP, "dump", "-", "-m", str(model), "--long", "--no-cache",
         "-o", str(out)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert process.stdin is not None and process.stderr is not None
        process.stdin.write(long_text(600))
        process.stdin.close()
        seen = []
        for line in process.stderr:
            seen.append(line)
            if line.startswith("wrote lse_000"):
                break
        assert seen and seen[-1].startswith("wrote lse_000"), "".join(seen)
        process.send_signal(signum)
        process.wait(timeout=120)
        rest = process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == code, "".join(seen) + rest
    assert "Traceback" not in rest
    if files is None:
        assert not out.exists()
    else:
        assert {p.name: p.read_bytes() for p in out.iterdir()} == files


def test_ctrl_c_inside_a_finaliser_still_stops_the_command() -> None:
    """Ctrl-C that lands while Python runs a weakref callback or ``__del__`` is printed as
    "Exception ignored" and lost by default, and the command goes on (seen once in an
    ``export --force`` interrupted mid-run); the console script's hook delivers it again."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import sys, time, weakref
        import attnviz.cli
        sys.unraisablehook = attnviz.cli._interrupt_again  # as attnviz.cli.main sets it
        class Held: pass
        def landed(ref):
            raise KeyboardInterrupt  # Ctrl-C arriving inside the callback
        try:
            held = Held(); ref = weakref.ref(held, landed); del held
            for _ in range(200):
                time.sleep(0.01)
            print("went on")
        except KeyboardInterrupt:
            print("interrupted")
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.stdout.strip() == "interrupted", (done.stdout, done.stderr)
    assert "Exception ignored" not in done.stderr and "Traceback" not in done.stderr
