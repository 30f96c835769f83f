"""``--engine ray`` on ``heads --input`` and ``export --input``: the local engine's results.

One local Ray (2 CPUs) serves the whole module; the commands find it already running and
leave it so. Most runs use the toy model (each Ray worker loads it once).
"""

from __future__ import annotations

import contextlib
import json
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

TOY = ("--model", "toy", "--toy-layers", "2", "--toy-heads", "4", "--d-model", "16",
       "--no-cache")
WORDS = ("the cat sat on a mat , dog ran far away . big red car and with small green "
         "ideas sleep furiously ! why not ?").split()
KILL_NOTE = "test hook: a worker was killed"


def _corpus(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 14)))
            for _ in range(count)]


@pytest.fixture(scope="module")
def local_ray(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One local Ray with 2 CPUs for the module; workers get their own capture cache."""
    from attnviz.engine.ray_cluster import init_local

    cache = tmp_path_factory.mktemp("ray-worker-cache")
    ray = init_local(2, env={"ATTNVIZ_CACHE_DIR": str(cache)})
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """200 short texts, a blank line, a text the model cannot use and a repeated text."""
    texts = _corpus(200)
    texts[17] = "broken \x00 text"
    texts[40] = texts[3]
    lines = texts[:100] + [""] + texts[100:]
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _heads_json(invoke, corpus: Path, *extra: str) -> tuple[dict[str, Any], str]:
    result = invoke("heads", "--input", corpus, *TOY, "--format", "json", *extra)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout), result.stderr


def _assert_same_heads(local: dict[str, Any], ray: dict[str, Any]) -> None:
    assert ray["texts"] == local["texts"] == 199  # 200 texts, one unusable
    assert ray["tokens"] == local["tokens"] and ray["title"] == local["title"]
    assert len(ray["heads"]) == len(local["heads"]) == 8
    for mine, theirs in zip(ray["heads"], local["heads"]):
        assert (mine["layer"], mine["head"], mine["label"]) == \
            (theirs["layer"], theirs["head"], theirs["label"])
        stats = [key for key in theirs if key not in ("layer", "head", "label")]
        assert len(stats) >= 11
        for key in stats:
            assert abs(mine[key] - theirs[key]) <= 1e-6, (mine["layer"], mine["head"], key)
    for mine, theirs in zip(ray["layers"], local["layers"]):
        assert mine["labels"] == theirs["labels"]
        assert mine["entropy"] == pytest.approx(theirs["entropy"], abs=1e-6)


@pytest.mark.parametrize(("workers", "batch_size"), [(1, 8), (2, 8), (1, 3), (2, 3)])
def test_heads_ray_equals_local(invoke, local_ray, corpus_file: Path, workers: int,
                                batch_size: int) -> None:
    local, local_err = _heads_json(invoke, corpus_file, "--batch-size", str(batch_size))
    ray, ray_err = _heads_json(invoke, corpus_file, "--batch-size", str(batch_size),
                               "--engine", "ray", "--workers", str(workers))
    _assert_same_heads(local, ray)
    for err in (local_err, ray_err):  # the unusable text is reported and counted
        assert "skipped a text (the text contains a NUL character" in err
        assert "1 text(s) could not be used and were skipped" in err
    assert "Ray: " in ray_err


def test_heads_ray_induction_on_a_worker(invoke, local_ray, corpus_file: Path) -> None:
    """A causal model: the induction test runs on a Ray worker and gives the local scores."""
    local, _ = _heads_json(invoke, corpus_file, "--causal")
    ray, _ = _heads_json(invoke, corpus_file, "--causal", "--engine", "ray", "--workers", "2")
    assert local["induction_test"] == ray["induction_test"] is not None
    _assert_same_heads(local, ray)
    assert [h["induction"] for h in ray["heads"]] == \
        pytest.approx([h["induction"] for h in local["heads"]], abs=1e-6)


def test_heads_ray_worker_killed_mid_run(invoke, local_ray, corpus_file: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker dies after 13 texts (mid-batch): Ray retries its batch; no text is counted
    twice or lost."""
    local, _ = _heads_json(invoke, corpus_file, "--batch-size", "4")
    monkeypatch.setenv("ATTNVIZ_TEST_KILL_ACTOR_AFTER", "13")
    ray, err = _heads_json(invoke, corpus_file, "--batch-size", "4", "--engine", "ray",
                           "--workers", "2")
    assert KILL_NOTE in err
    _assert_same_heads(local, ray)  # same texts and tokens: nothing counted twice


# ------------------------------------------------------------------------------- export
EXPORT = ("--figures", "heads,layers,overview", "--batch-size", "3")


@pytest.fixture(scope="module")
def export_input(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """JSONL: 20 texts (one with an id, one with a pair, one repeated), a blank line and a
    line that is not JSON."""
    rows: list[str] = [json.dumps({"text": text}) for text in _corpus(20, seed=1)]
    rows[2] = json.dumps({"text": "A named one", "id": "named"})
    rows[5] = json.dumps({"text": "The bank of the river", "pair": "The bank approved it"})
    rows[9] = rows[4]
    rows.insert(12, "")
    rows.insert(14, "{not json")
    path = tmp_path_factory.mktemp("export-input") / "texts.jsonl"
    path.write_text("\n".join(rows) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def local_export(tmp_path_factory: pytest.TempPathFactory, export_input: Path) -> Path:
    from typer.testing import CliRunner

    from attnviz.cli import app

    out = tmp_path_factory.mktemp("local-export")
    result = CliRunner().invoke(app, ["export", "--input", str(export_input), "-o", str(out),
                                      *TOY, *EXPORT, "--jobs", "1"])
    assert result.exit_code == 1, result.output  # the bad line fails: exit 1, as with ray
    return out


def _files(root: Path) -> dict[str, Path]:
    return {p.relative_to(root).as_posix(): p for p in root.rglob("*") if p.is_file()}


def _index(root: Path) -> dict[str, Any]:
    index = json.loads((root / "index.json").read_text(encoding="utf-8"))
    index["summary"].pop("seconds")
    return index


def _assert_same_export(local: Path, ray: Path) -> None:
    ours, theirs = _files(ray), _files(local)
    assert ours.keys() == theirs.keys()
    pngs = [name for name in theirs if name.endswith(".png")]
    arrays = [name for name in theirs if name.endswith(".npy")]
    assert len(pngs) == 19 * (8 + 2 + 1) and len(arrays) == 19  # 19 distinct usable texts
    for name in pngs:
        assert ours[name].read_bytes() == theirs[name].read_bytes(), name
    for name in arrays:
        np.testing.assert_array_equal(np.load(ours[name]), np.load(theirs[name]), err_msg=name)
    for name in theirs:
        if name.endswith(("export.json", "capture.json", "topk.csv")):
            assert ours[name].read_bytes() == theirs[name].read_bytes(), name
    mine, reference = _index(ray), _index(local)
    numbers = [entry["number"] for entry in mine["texts"]]
    assert numbers == list(range(1, 22))  # every text once, in input order
    statuses = [entry["status"] for entry in mine["texts"]]
    assert statuses.count("failed") == 1 and statuses.count("duplicate") == 1
    for entry, expected in zip(mine["texts"], reference["texts"]):
        assert entry["folder"] == expected["folder"]
        assert entry["files"] == expected["files"]
        if expected["status"] != "exported":
            assert entry == expected


def test_export_ray_equals_local(invoke, local_ray, export_input: Path, local_export: Path,
                                 tmp_path: Path) -> None:
    out = tmp_path / "ray"
    result = invoke("export", "--input", export_input, "-o", out, *TOY, *EXPORT,
                    "--engine", "ray", "--workers", "2")
    assert result.exit_code == 1, result.output  # one bad line: exit code 1, as local
    assert "19 exported, 0 skipped, 1 failed, 1 duplicates" in result.stdout, result.output
    assert "line 15" in result.stderr and "not valid JSON" in result.stderr
    _assert_same_export(local_export, out)
    assert _index(out)["summary"] == _index(local_export)["summary"]

    again = invoke("export", "--input", export_input, "-o", out, *TOY, *EXPORT,
                   "--engine", "ray", "--workers", "2")  # resume: everything is complete
    assert again.exit_code == 1, again.output
    assert "0 exported, 19 skipped, 1 failed, 1 duplicates" in again.stdout
    _assert_same_export(local_export, out)


def test_export_ray_worker_killed_mid_run(invoke, local_ray, export_input: Path,
                                          local_export: Path, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker dies after 4 texts, in the middle of its batch, with the 5th text's capture
    written and its figures not: the retried batch resumes it; the export is complete and
    every text is listed once."""
    monkeypatch.setenv("ATTNVIZ_TEST_KILL_ACTOR_AFTER", "4")
    out = tmp_path / "ray"
    result = invoke("export", "--input", export_input, "-o", out, *TOY, *EXPORT,
                    "--engine", "ray", "--workers", "2")
    assert result.exit_code == 1, result.output
    assert KILL_NOTE in result.stderr
    _assert_same_export(local_export, out)
    summary = _index(out)["summary"]
    assert summary["texts"] == 21 and summary["failed"] == 1
    assert summary["duplicates"] == 1
    assert summary["exported"] + summary["skipped"] == 19  # finished by the dead worker: skipped
    for entry in _index(out)["texts"]:
        if entry["status"] in ("exported", "skipped"):
            manifest = json.loads((out / entry["folder"] / "export.json").read_text("utf-8"))
            assert manifest["complete"] is True


def test_export_ray_refuses_a_folder_another_export_writes_to(invoke, export_input: Path,
                                                              tmp_path: Path) -> None:
    """The Ray driver takes the same OUT_DIR lock as a local export, before starting Ray."""
    from attnviz.export import LOCK_NAME
    from attnviz.fileio import FolderLock

    out = tmp_path / "busy"
    out.mkdir()
    holder = FolderLock(out, LOCK_NAME, "another export")
    holder.acquire()
    try:
        result = invoke("export", "--input", export_input, "-o", out, *TOY, *EXPORT,
                        "--engine", "ray", "--workers", "1")
    finally:
        holder.release()
    assert result.exit_code == 1, result.output
    assert "another export is writing to" in result.stderr
    assert sorted(p.name for p in out.iterdir()) == []


# ------------------------------------------------------------------------------- options
def test_engine_options_are_checked(invoke, local_ray, corpus_file: Path,
                                    tmp_path: Path) -> None:
    cases = [
        (("--workers", "2"), "--workers is an option of --engine ray"),
        (("--engine", "ray", "--workers", "3"), "at most 2 workers fit"),
        (("--engine", "ray", "--gpus-per-worker", "1"), "has no GPUs"),
        (("--engine", "ray", "--gpus-per-worker", "1.5"), "whole GPUs only"),
        (("--engine", "ray", "--workers", "5000"), "1024"),
        (("--engine", "ray", "--batch-size", "5000"), "1024"),
    ]
    for extra, message in cases:
        result = invoke("heads", "--input", corpus_file, *TOY, *extra)
        assert result.exit_code == 2, (extra, result.output)
        assert message in " ".join(result.output.split()), (extra, result.output)
    no_input = invoke("heads", "The cat sat", *TOY, "--engine", "ray")
    assert no_input.exit_code == 2 and "runs the texts of --input" in no_input.output
    dumps = invoke("export", "--input", corpus_file, "--from", tmp_path, "-o", tmp_path / "o",
                   *TOY, "--engine", "ray")
    assert dumps.exit_code == 2 and "not saved captures" in dumps.output
    jobs = invoke("export", "--input", corpus_file, "-o", tmp_path / "o", *TOY, "--engine",
                  "ray", "--jobs", "2")
    assert jobs.exit_code == 2 and "use --workers" in jobs.output


def test_an_error_every_text_would_hit_stops_the_run(invoke, local_ray, corpus_file: Path,
                                                      tmp_path: Path) -> None:
    """A selection the model does not have fails on the workers; the driver stops with the
    local engine's message and exit code."""
    for args in (("heads", "--input", corpus_file),
                 ("export", "--input", corpus_file, "-o", tmp_path / "out")):
        local = invoke(*args, *TOY, "--layers", "5")
        ray = invoke(*args, *TOY, "--layers", "5", "--engine", "ray", "--workers", "2")
        assert local.exit_code == ray.exit_code == 2, ray.output
        assert "Traceback" not in ray.output
        message = next(line for line in local.stderr.splitlines() if line.startswith("Error:"))
        assert "layer 5" in message and message in ray.stderr


def test_ray_options_bounds_and_addresses() -> None:
    """The library checks what the CLI checks, with messages that name the limits."""
    from attnviz.engine import RayOptions
    from attnviz.engine.ray_cluster import _check_reachable
    from attnviz.errors import AttnvizError, UsageError

    for options, message in [(RayOptions(workers=0), "use 1 to 1024"),
                             (RayOptions(batch_size=4096), "use 1 to 1024"),
                             (RayOptions(gpus_per_worker=-1), "use 0 to 8"),
                             (RayOptions(gpus_per_worker=2.5), "whole GPUs only"),
                             (RayOptions(address=" "), "--ray-address is empty")]:
        with pytest.raises(UsageError, match=message):
            options.check()
    RayOptions(workers=1024, batch_size=1024, gpus_per_worker=0.25).check()
    with pytest.raises(UsageError, match="not an address"):
        _check_reachable("nonsense", "--ray-address")
    with pytest.raises(AttnvizError, match="cannot reach the Ray cluster at 127.0.0.1:1"):
        _check_reachable("127.0.0.1:1", "--ray-address", timeout=2)


def test_without_ray_installed_the_error_says_how_to_install(
        invoke, corpus_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ImportError
    for args in (("heads", "--input", corpus_file), ("export", "--input", corpus_file, "-o",
                                                     tmp_path / "out")):
        result = invoke(*args, *TOY, "--engine", "ray")
        assert result.exit_code == 1, result.output
        assert "Traceback" not in result.output
        assert 'pip install "ray[data]>=2.9"' in result.stderr


def test_local_engine_never_imports_ray(corpus_file: Path) -> None:
    """A real process: ``--help`` and the local engine do not import Ray."""
    script = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from attnviz.cli import app\n"
        "runner = CliRunner()\n"
        "assert runner.invoke(app, ['heads', '--help']).exit_code == 0\n"
        "assert runner.invoke(app, ['export', '--help']).exit_code == 0\n"
        f"result = runner.invoke(app, ['heads', '--input', {str(corpus_file)!r}, "
        f"{', '.join(repr(a) for a in TOY)}, '--format', 'csv'])\n"
        "assert result.exit_code == 0, result.output\n"
        "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"


def _ray_nodes() -> dict[int, str]:
    """Process id -> Ray node id, for every process of a Ray node on this machine."""
    import os

    nodes: dict[int, str] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        for part, mark in (("environ", b"RAY_NODE_ID="), ("cmdline", b"--node-id=")):
            try:
                with open(f"/proc/{name}/{part}", "rb") as handle:
                    for item in handle.read().split(b"\0"):
                        if item.startswith(mark):
                            nodes[int(name)] = item.split(b"=", 1)[1].decode()
            except OSError:
                continue
    return nodes


def _descendants(root: int) -> set[tuple[int, bytes]]:
    """(pid, start time) of every process below ``root`` (Ray's agents rename themselves, so
    ancestry is what tells them apart)."""
    import os

    parents: dict[int, tuple[int, bytes]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as handle:
                    fields = handle.read().rsplit(b")", 1)[1].split()
            except OSError:
                continue
            parents[int(name)] = (int(fields[1]), fields[19])
    below = {root}
    for _ in range(8):
        below |= {pid for pid, (ppid, _) in parents.items() if ppid in below}
    return {(pid, parents[pid][1]) for pid in below - {root}}


def _alive(processes: set[tuple[int, bytes]]) -> set[tuple[int, bytes]]:
    """Those of ``processes`` still running (same pid and start time).

    A process that has been killed can take a while to finish exiting on a busy machine; one
    with SIGKILL pending, or whose memory is already gone (an empty command line), runs no
    more of its own code and does not count.
    """
    alive = set()
    for pid, start in processes:
        try:
            with open(f"/proc/{pid}/stat", "rb") as handle:
                state = handle.read().rsplit(b")", 1)[1].split()
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                command = handle.read()
            with open(f"/proc/{pid}/status", "rb") as handle:
                status = dict(line.split(b":", 1) for line in handle.read().splitlines()
                              if b":" in line)
        except OSError:
            continue
        killed = any(int(status.get(name, b"0").strip() or b"0", 16) & (1 << 8)
                     for name in (b"SigPnd", b"ShdPnd"))
        if state[19] == start and state[0] not in (b"Z", b"X") and command and not killed:
            alive.add((pid, start))
    return alive


def _describe(processes: set[tuple[int, bytes]]) -> list[str]:
    """State and command line of each process, for a failure message."""
    rows = []
    for pid, _ in sorted(processes):
        try:
            with open(f"/proc/{pid}/stat", "rb") as handle:
                state = handle.read().rsplit(b")", 1)[1].split()[0].decode()
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                command = handle.read().replace(b"\0", b" ")[:160].decode(errors="replace")
        except OSError as exc:
            rows.append(f"{pid}: {exc}")
            continue
        rows.append(f"{pid} [{state}] {command}")
    return rows


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs Linux /proc")
def test_a_killed_driver_leaves_no_ray_process_behind(tmp_path: Path) -> None:
    """kill -9 of `attnviz heads --engine ray` mid-run: its local Ray dies with it."""
    import os
    import signal
    import time

    corpus = tmp_path / "many.txt"
    corpus.write_text("\n".join(" ".join(["the", "cat", "sat", str(i)] * 8)
                                for i in range(100000)) + "\n", encoding="utf-8")
    before = set(_ray_nodes().values())
    driver = subprocess.Popen(
        [sys.executable, "-m", "attnviz", "heads", "--input", str(corpus), *TOY,
         "--engine", "ray", "--ray-address", "local", "--workers", "1", "--no-cache",
         "-f", "csv", "-o",
         str(tmp_path / "h.csv")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    ours: set[str] = set()
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and driver.poll() is None:
            ours = set(_ray_nodes().values()) - before
            if ours and any(node in ours for node in _ray_nodes().values()):
                time.sleep(3)  # let the workers start
                break
            time.sleep(0.5)
        assert ours, "the run never started a local Ray"
        assert driver.poll() is None, "the run ended before it could be killed"
        below = _descendants(driver.pid)
        assert len(below) >= 3  # gcs, raylet, agents, workers (and the watchdog)
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait(timeout=10)
        deadline = time.monotonic() + 60  # the watchdog polls; a busy machine is slow to reap Ray
        left = [pid for pid, node in _ray_nodes().items() if node in ours]
        while (left or _alive(below)) and time.monotonic() < deadline:
            time.sleep(0.5)
            left = [pid for pid, node in _ray_nodes().items() if node in ours]
        assert left == []
        assert _alive(below) == set(), _describe(_alive(below))
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
        stray = {pid for pid, node in _ray_nodes().items() if node in ours}
        stray |= {pid for pid, _ in _alive(below)} if "below" in locals() else set()
        for pid in stray:  # never leave a Ray behind, even on failure
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
