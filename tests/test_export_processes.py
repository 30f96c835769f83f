"""Export as real processes: kills, signals, two runs at once, a file truncated mid-draw.

Each test starts ``attnviz export`` in its own process group (its drawing workers join that
group), waits with timeouts, and kills the whole group in ``finally`` so a failure never leaves
a process behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals and groups")

TOY = ["--model", "toy", "--toy-layers", "2", "--toy-heads", "4"]


def _texts(path: Path, count: int) -> Path:
    path.write_text("".join(f"text number {i} with a few words in it\n" for i in range(count)))
    return path


@contextlib.contextmanager
def _export(*args: object, env: dict[str, str] | None = None,
            stdin: int | None = None) -> Iterator[subprocess.Popen]:
    """``attnviz export ARGS`` in a new process group, killed (with its group) at the end."""
    command = [sys.executable, "-c", "from attnviz.cli import main; main()", "export",
               *[str(a) for a in args]]
    full_env = {**os.environ, "MPLBACKEND": "Agg", **(env or {})}
    process = subprocess.Popen(command, stdin=stdin, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, start_new_session=True, env=full_env)
    try:
        yield process
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            process.communicate(timeout=10)


def _feed(process: subprocess.Popen, count: int, start: int = 0) -> None:
    """Write ``count`` texts to the export's standard input and leave the pipe open.

    An export reading a pipe that stays open never runs out of work, so a test that signals
    it mid-run cannot lose a race against a fast machine.
    """
    assert process.stdin is not None
    process.stdin.write(b"".join(f"text number {i} with a few words in it\n".encode()
                                 for i in range(start, start + count)))
    process.stdin.flush()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _members(pgid: int) -> list[int]:
    """Processes of a group, from /proc (empty where there is no /proc)."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            found.append(int(entry.name))
    return found


def _wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def _drawing(out: Path, process: subprocess.Popen) -> bool:
    if process.poll() is not None:
        _, err = process.communicate()
        raise AssertionError(f"the export ended early ({process.returncode}): {err.decode()}")
    return any(out.glob("*/heads/*.png"))


def _workers_started(process: subprocess.Popen, out: Path) -> None:
    _wait_for(lambda: _drawing(out, process), 120, "the first figures")
    if Path("/proc").is_dir():
        _wait_for(lambda: len(_members(process.pid)) >= 3, 30, "two drawing workers")


def _one_done(out: Path, process: subprocess.Popen) -> bool:
    _drawing(out, process)
    return any('"complete": true' in p.read_text("utf-8") for p in out.glob("*/export.json"))


def _leftovers(out: Path) -> list[Path]:
    return [p for p in out.rglob("*") if p.name.endswith((".tmp", ".lock"))]


def test_workers_die_with_a_killed_export(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with _export("--input", "-", *TOY, "--jobs", "2", "-o", out,
                 stdin=subprocess.PIPE) as process:
        _feed(process, 300)
        _workers_started(process, out)
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=10)
        _wait_for(lambda: not _group_alive(process.pid), 15, "the workers to exit")
        # The workers are gone: a folder the user deletes now stays deleted.
        import shutil

        shutil.rmtree(out)
        time.sleep(1.0)
        assert not out.exists()


@pytest.mark.parametrize(("how", "code", "message"), [
    ("term", 143, "Terminated"),
    ("ctrl-c", 130, "Interrupted"),
])
def test_signal_stops_the_whole_export(tmp_path: Path, how: str, code: int,
                                       message: str) -> None:
    out = tmp_path / "out"
    with _export("--input", "-", *TOY, "--jobs", "2", "-o", out,
                 stdin=subprocess.PIPE) as process:
        _feed(process, 300)
        _workers_started(process, out)
        _wait_for(lambda: _one_done(out, process), 120, "a text to be complete")
        if how == "term":
            os.kill(process.pid, signal.SIGTERM)  # the main process only, as `kill PID` does
        else:
            os.killpg(process.pid, signal.SIGINT)  # the whole foreground group, as Ctrl-C does
        _, err = process.communicate(timeout=60)
        stderr = err.decode()
        assert process.returncode == code, stderr
        assert message in stderr
        assert "Traceback" not in stderr
        _wait_for(lambda: not _group_alive(process.pid), 15, "the workers to exit")
    assert _leftovers(out) == []
    assert (out / "index.json").is_file(), (stderr, sorted(p.name for p in out.iterdir()))
    index = json.loads((out / "index.json").read_text("utf-8"))
    done = [e for e in index["texts"] if e["status"] == "exported"]
    assert done  # what finished before the signal is listed
    for entry in done:
        assert json.loads((out / entry["folder"] / "export.json").read_text())["complete"]


def test_two_exports_into_one_folder(tmp_path: Path) -> None:
    """The second export fails at once while the first holds the folder.

    The first one reads its texts from a pipe this test keeps open, so it is still running
    (holding the lock, waiting for more lines) however fast the machine is.
    """
    out = tmp_path / "out"
    with _export("--input", "-", *TOY, "--jobs", "1", "-o", out,
                 stdin=subprocess.PIPE) as first:
        from attnviz.export import LOCK_NAME

        _feed(first, 3)
        _wait_for(lambda: (out / LOCK_NAME).exists() or first.poll() is not None, 120,
                  "the first export to start")
        assert first.poll() is None, first.communicate()[1].decode()
        with _export("other text", *TOY, "--jobs", "1", "-o", out) as second:
            _, err = second.communicate(timeout=120)
        stderr = err.decode()
        assert second.returncode == 1, stderr
        assert f"another export is writing to {out} (pid {first.pid})" in stderr
        assert "Traceback" not in stderr
        assert first.poll() is None  # still waiting for its input
        _feed(first, 3, start=3)
        _, err = first.communicate(timeout=300)
        assert first.returncode == 0, err.decode()
    index = json.loads((out / "index.json").read_text("utf-8"))
    assert len(index["texts"]) == 6 and all(e["status"] == "exported" for e in index["texts"])
    assert not (out / "other-text").exists() and not any(
        p.name.startswith("other-text") for p in out.iterdir())
    assert _leftovers(out) == []


def test_attention_file_truncated_while_drawing(tmp_path: Path) -> None:
    """Another process truncates attention.npy after the drawing code opened it: no SIGBUS."""
    out = tmp_path / "out"
    script = textwrap.dedent(f"""
        import os, sys
        from pathlib import Path
        import attnviz.capture
        capture = sys.modules["attnviz.capture"]  # attnviz.capture is also a function
        from attnviz.export import ExportItem, ExportOptions, export_items
        from attnviz.models import ModelSpec
        from attnviz.models.toy import ToyConfig

        real = capture.load_capture
        state = {{"armed": False}}

        def load(path, *args, **kwargs):
            result = real(path, *args, **kwargs)
            if state["armed"]:
                npy = Path(path) / "attention.npy" if Path(path).is_dir() else Path(path)
                os.truncate(npy, 128)  # as another process would, while we draw
            return result

        capture.load_capture = load
        import attnviz.export.exporter as export_module
        real_render = export_module.render_task

        def render(task, *args, **kwargs):
            state["armed"] = True
            return real_render(task, *args, **kwargs)

        export_module.render_task = render
        text = " ".join(f"word{{i}}" for i in range(60))  # 4 x 4 x 60 x 60 floats: 56 pages
        spec = ModelSpec(name="toy", toy=ToyConfig(layers=4, heads=4))
        summary = export_items([ExportItem(text=text, origin="TEXT 1")], {str(out)!r},
                               ExportOptions(jobs=1, figures=("heads",)), spec=spec)
        print("DONE", summary.exported, summary.failed)
    """)
    process = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                             timeout=120, env={**os.environ, "MPLBACKEND": "Agg"},
                             start_new_session=True)
    assert process.returncode == 0, (process.returncode, process.stderr[-2000:])
    assert "DONE" in process.stdout
