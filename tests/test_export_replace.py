"""An export over an earlier one: old files stay until their replacements are complete.

``--force`` (or other settings) over a complete export writes each text's new files into a
hidden staging folder inside its folder and moves them into place only once complete, so an
interruption (Ctrl-C, SIGTERM, a failure) leaves the earlier export whole, and the index never
lists a folder that is not there. ``export --long`` shares that code and the resume of a full
export: complete texts are skipped, ``--force`` redraws them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import attnviz.export.draw as draw_module
import attnviz.export.long as long_module
from attnviz.errors import OutputError
from attnviz.export import ExportItem, ExportOptions, export_items
from attnviz.export.plan import folder_name
from attnviz.models import ModelSpec
from attnviz.models.toy import ToyConfig
from tests.long_fixtures import build_tiny_llama

TEXTS = ["The cat sat on the mat", "A dog barked at the moon", "Birds sing in trees"]


def _items(texts: list[str]) -> list[ExportItem]:
    return [ExportItem(text=t, origin=f"text {n}") for n, t in enumerate(texts, 1)]


def _spec() -> ModelSpec:
    return ModelSpec(name="toy", toy=ToyConfig(layers=2, heads=2))


def _snapshot(out: Path) -> dict[str, bytes]:
    """Every text folder's file, by path relative to ``out``."""
    return {str(p.relative_to(out)): p.read_bytes() for p in out.glob("*/**/*") if p.is_file()}


def _check_index(out: Path) -> list[dict[str, Any]]:
    """The index lists only folders that are there and complete; returns its entries."""
    index = json.loads((out / "index.json").read_text("utf-8"))
    for entry in index["texts"]:
        if entry["status"] in ("exported", "skipped"):
            manifest = json.loads((out / entry["folder"] / "export.json").read_text("utf-8"))
            assert manifest["complete"], entry
            missing = [f for f in manifest["files"] if not (out / entry["folder"] / f).is_file()]
            assert missing == [], (entry["folder"], missing)
    return list(index["texts"])


def _staging(out: Path) -> list[Path]:
    return list(out.rglob(".attnviz-export.*"))


@pytest.mark.parametrize(("which", "options"), [
    (1, ExportOptions(jobs=1, force=True)),  # the first text's files, mid-way
    (2, ExportOptions(jobs=1, force=True)),  # the second text, after the first was replaced
    (1, ExportOptions(jobs=1, dpi=80)),  # other settings, without --force
])
def test_an_interrupted_export_keeps_the_earlier_one(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, which: int,
        options: ExportOptions) -> None:
    out = tmp_path / "out"
    first = export_items(_items(TEXTS), out, ExportOptions(jobs=1, figures=("heads",)),
                         spec=_spec())
    assert first.exported == 3
    before = _snapshot(out)
    real_write = draw_module._write
    calls = {"n": 0}
    per_text = 1 + 4 + 2 + 1  # top-k, heads, layers, overview

    def interrupted(path: Path, data: bytes) -> None:
        calls["n"] += 1
        if calls["n"] == per_text * (which - 1) + 3:  # part-way through text `which`
            raise KeyboardInterrupt
        real_write(path, data)

    monkeypatch.setattr(draw_module, "_write", interrupted)
    with pytest.raises(KeyboardInterrupt):
        export_items(_items(TEXTS), out, options, spec=_spec())
    monkeypatch.setattr(draw_module, "_write", real_write)

    after = _snapshot(out)
    entries = _check_index(out)
    assert len(entries) == 3  # this run's finished text and the earlier run's others
    replaced: set[str] = set()
    if which == 2:  # the first text was complete before the interruption: it is new
        replaced = {folder_name(TEXTS[0])}
    for name, data in before.items():
        if name.split("/")[0] not in replaced:
            assert after.get(name) == data, f"{name} was lost or changed"
    assert _staging(out) == []
    assert not list(out.rglob("*.tmp"))

    again = export_items(_items(TEXTS), out, dataclasses.replace(options, force=False),
                         spec=_spec())  # finishes the job, keeping what this run finished
    assert (again.exported, again.skipped, again.failed) == (3 - (which - 1), which - 1, 0)
    assert [e["status"] for e in _check_index(out)] == (
        ["skipped"] * (which - 1) + ["exported"] * (4 - which))
    for manifest in out.glob("*/export.json"):  # every text now has the new settings
        assert json.loads(manifest.read_text("utf-8"))["settings"]["dpi"] == options.dpi
    assert _staging(out) == []


def test_a_failed_text_keeps_its_earlier_export(monkeypatch: pytest.MonkeyPatch,
                                                tmp_path: Path) -> None:
    """A text whose new files cannot be drawn fails, and its earlier export stays whole."""
    out = tmp_path / "out"
    export_items(_items(TEXTS[:1]), out, ExportOptions(jobs=1), spec=_spec())
    before = _snapshot(out)

    real_write = draw_module._write

    def broken(path: Path, data: bytes) -> None:
        if path.name == "L01_H01.png":
            raise OutputError(f"cannot write {path}: no space left on the device")
        real_write(path, data)

    monkeypatch.setattr(draw_module, "_write", broken)
    with pytest.raises(OutputError):
        export_items(_items(TEXTS[:1]), out, ExportOptions(jobs=1, force=True), spec=_spec())
    assert _snapshot(out) == before
    assert _staging(out) == []


def test_a_distributed_part_interrupted_keeps_the_earlier_export(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A Ray worker's share (Exporter.export_part) writes through the same code."""
    from attnviz.export.exporter import Exporter
    from attnviz.export.plan import ExportProgress

    out = tmp_path / "out"
    export_items(_items(TEXTS[:2]), out, ExportOptions(jobs=1), spec=_spec())
    before = _snapshot(out)
    exporter = Exporter(out, ExportOptions(jobs=1, force=True), spec=_spec(), max_tokens=None,
                        truncate=True, use_cache=False, progress=ExportProgress())
    real_write = draw_module._write
    calls = {"n": 0}

    def interrupted(path: Path, data: bytes) -> None:
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        real_write(path, data)

    monkeypatch.setattr(draw_module, "_write", interrupted)
    with pytest.raises(KeyboardInterrupt):
        exporter.export_part(list(enumerate(_items(TEXTS[:2]), start=1)))
    assert _snapshot(out) == before
    assert _staging(out) == []


# --------------------------------------------------------------------------- real signals
def _export(*args: object) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-c", "from attnviz.cli import main; main()", "export",
               *[str(a) for a in args]]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True, env={**os.environ, "MPLBACKEND": "Agg"})


def _mtime(path: Path) -> int | None:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return None


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals and groups")
def test_ctrl_c_during_force_loses_no_finished_text(tmp_path: Path) -> None:
    """Ctrl-C (SIGINT to the group) while ``export --force`` redraws a complete export."""
    texts = tmp_path / "texts.txt"
    texts.write_text("".join(f"text number {i} with a few words in it\n" for i in range(5)))
    out = tmp_path / "out"
    toy = ["--model", "toy", "--toy-layers", "3", "--toy-heads", "4", "--jobs", "1"]
    first = _export("--input", texts, *toy, "-o", out)
    _, err = first.communicate(timeout=300)
    assert first.returncode == 0, err.decode()
    before = _snapshot(out)
    stamps = {p: _mtime(p) for p in out.glob("*/export.json")}
    process = _export("--input", texts, *toy, "--force", "-o", out)
    try:
        deadline = time.monotonic() + 120
        while not any(_mtime(p) not in (None, t) for p, t in stamps.items()):
            assert process.poll() is None, process.communicate()[1].decode()
            assert time.monotonic() < deadline, "the forced export never started a text"
            time.sleep(0.02)
        time.sleep(0.3)  # into the next text
        os.killpg(process.pid, signal.SIGINT)
        _, err = process.communicate(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
    stderr = err.decode()
    assert process.returncode in (0, 130), stderr
    assert "Traceback" not in stderr
    after = _snapshot(out)
    assert set(before) <= set(after)  # no file of the earlier export went missing
    for folder in {name.split("/")[0] for name in before}:
        manifest = json.loads((out / folder / "export.json").read_text("utf-8"))
        assert manifest["complete"], folder  # every text is whole, old or new
    _check_index(out)
    assert _staging(out) == []


# --------------------------------------------------------------------------- export --long
@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama-export"), positions=256)


def _long(invoke: Any, llama_dir: Path, out: Path, *extra: str) -> Any:
    result = invoke("export", TEXTS[0], TEXTS[1], "--model", str(llama_dir), "--long",
                    "--figures", "layers", "-k", "1", "-o", str(out), *extra)
    assert result.exit_code == 0, result.output
    return result


def test_export_long_resumes_and_force_redraws(invoke: Any, llama_dir: Path, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out"
    assert "2 exported" in _long(invoke, llama_dir, out).stdout
    before = {p: p.stat().st_mtime_ns for p in out.glob("*/**/*") if p.is_file()}
    captured: list[str] = []
    real = long_module._capture
    monkeypatch.setattr(long_module, "_capture",
                        lambda item, *a: captured.append(item.text) or real(item, *a))
    again = _long(invoke, llama_dir, out)
    assert "0 exported" in again.stdout and "2 skipped" in again.stdout
    assert captured == []  # complete texts cost no capture
    assert {p: p.stat().st_mtime_ns for p in out.glob("*/**/*") if p.is_file()} == before
    assert [e["status"] for e in _check_index(out)] == ["skipped", "skipped"]
    other = _long(invoke, llama_dir, out, "--dpi", "80")  # other settings: drawn again
    assert "2 exported" in other.stdout and len(captured) == 2
    forced = _long(invoke, llama_dir, out, "--dpi", "80", "--force")
    assert "2 exported" in forced.stdout and len(captured) == 4
    assert [e["status"] for e in _check_index(out)] == ["exported", "exported"]


def test_export_long_force_interrupted_keeps_the_earlier_export(
        invoke: Any, llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out"
    _long(invoke, llama_dir, out)
    before = _snapshot(out)
    real = long_module.write_text

    def interrupted(cap: Any, folder: Path, options: Any) -> list[str]:
        real(cap, folder, options)
        raise KeyboardInterrupt  # every file written, not yet moved into place

    monkeypatch.setattr(long_module, "write_text", interrupted)
    result = invoke("export", TEXTS[0], TEXTS[1], "--model", str(llama_dir), "--long",
                    "--figures", "layers", "-k", "1", "--dpi", "80", "-o", str(out))
    assert result.exit_code != 0
    assert _snapshot(out) == before
    _check_index(out)
    assert _staging(out) == []
