"""What a folder of saved captures holds and how it is read back.

* Every saver (``Capture.save``, ``LongCapture.save``, ``dump``, ``dump --long``) replaces the
  folder's capture of the other kind once its own is complete, so ``--from DIR`` reads what was
  saved last; a folder holding both (copied in by hand) is refused with a message.
* A FIFO or any other non-regular file among a capture's files is refused at once, never
  waited on; a ``.npy`` header claiming more than its file holds is a ``DumpError``, not a
  ``MemoryError``.
* The temporary folder of a ``--long`` command killed with SIGKILL is removed by the next one.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from attnviz.capture import Capture, load_capture
from attnviz.errors import DumpError
from tests.long_fixtures import build_tiny_llama, capture_tiny_llama

TOKENS = 40
POSIX = pytest.mark.skipif(sys.platform == "win32", reason="FIFOs, signals")


def _full(tokens: int = 5) -> Capture:
    rng = np.random.default_rng(0)
    raw = rng.random((2, 4, tokens, tokens)).astype(np.float32)
    toks = ["[CLS]", *[f"w{i}" for i in range(tokens - 2)], "[SEP]"]
    return Capture(tokens=toks, word_ids=[None, *range(tokens - 2), None],
                   special=[True] + [False] * (tokens - 2) + [True],
                   weights=raw / raw.sum(-1, keepdims=True), layers=[0, 1],
                   heads=[0, 1, 2, 3], num_layers=2, num_heads=4, model="full-one",
                   causal=False, text="the full one")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama-saved"), positions=256)


@pytest.fixture(scope="module")
def long_saved(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return capture_tiny_llama(model_dir, TOKENS, tmp_path_factory.mktemp("long") / "cap")


@pytest.fixture()
def long_copy(long_saved: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(long_saved, tmp_path / "cap"))


def _names(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir()}


# --------------------------------------------------------------------------- the last save wins
def test_capture_save_replaces_a_long_capture(long_copy: Path, invoke: Any) -> None:
    """Capture.save into a long capture's folder: --from reads the full capture after it."""
    (long_copy / "notes.txt").write_text("mine")
    _full().save(long_copy)
    assert _names(long_copy) == {"attention.npy", "capture.json", "notes.txt"}
    result = invoke("top-k", "--from", str(long_copy), "--layer", "0", "--head", "0",
                    "--format", "json")
    assert result.exit_code == 0, result.output
    table = json.loads(result.stdout)
    assert table["title"].startswith("full-one:")
    assert [row["query"] for row in table["rows"]] == _full().tokens
    np.testing.assert_array_equal(load_capture(long_copy).weights, _full().weights)


def test_long_save_replaces_a_full_capture(long_saved: Path, tmp_path: Path) -> None:
    """LongCapture.save into a full capture's folder (and over other layers): only the long
    capture stays, and it reads back equal."""
    from attnviz.long import load_long

    folder = tmp_path / "both"
    _full().save(folder)
    np.save(folder / "q_007.npy", np.zeros(3, np.float32))  # a layer this capture lacks ...
    (folder / "long.json").write_text(json.dumps({"format": "attnviz-long-capture"}))
    cap = load_long(long_saved)
    cap.save(folder)
    arrays = {p.name for p in long_saved.iterdir()}
    assert _names(folder) == arrays  # ... went with the capture it belonged to
    again = load_long(folder)
    np.testing.assert_allclose(again.rows(0, 1, 0, TOKENS), cap.rows(0, 1, 0, TOKENS))


def test_dump_of_a_full_capture_replaces_a_long_one(long_copy: Path, invoke: Any,
                                                    tmp_path: Path) -> None:
    _full().save(tmp_path / "full")
    result = invoke("dump", "--from", str(tmp_path / "full"), "-o", str(long_copy))
    assert result.exit_code == 0, result.output
    assert _names(long_copy) == {"attention.npy", "capture.json"}


def test_a_folder_with_both_captures_is_refused(long_copy: Path, invoke: Any,
                                                tmp_path: Path) -> None:
    """Both kinds side by side (copied by hand): which is newer is not known, so neither."""
    _full().save(tmp_path / "full")
    for name in ("attention.npy", "capture.json"):
        shutil.copy(tmp_path / "full" / name, long_copy / name)
    result = invoke("top-k", "--from", str(long_copy), "--layer", "0", "--head", "0")
    assert result.exit_code == 1, result.output
    assert "holds two captures" in result.output
    assert "Traceback" not in result.output


# --------------------------------------------------------------------------- special files
def _reader(*args: str) -> subprocess.CompletedProcess[str]:
    """``attnviz ARGS`` in a process of its own: a reader that hangs is ended, not waited on."""
    command = [sys.executable, "-c", "from attnviz.cli import main; main()", *args]
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=60,
                              env={**os.environ, "MPLBACKEND": "Agg"})
    except subprocess.TimeoutExpired:
        raise AssertionError(f"attnviz {' '.join(args)} hung on a FIFO") from None


@POSIX
@pytest.mark.parametrize("name", ["k_001.npy", "long.json"])
def test_a_fifo_in_a_long_capture_is_refused_at_once(long_copy: Path, name: str) -> None:
    (long_copy / name).unlink()
    os.mkfifo(long_copy / name)
    done = _reader("top-k", "--from", str(long_copy), "--layer", "1", "--head", "0")
    assert done.returncode == 1, done.stderr
    assert f"{name} is a FIFO (named pipe), not a regular file" in " ".join(done.stderr.split())
    assert "Traceback" not in done.stderr


@POSIX
@pytest.mark.parametrize("name", ["attention.npy", "capture.json"])
def test_a_fifo_in_a_full_capture_is_named(tmp_path: Path, name: str) -> None:
    from attnviz.long.generate import load_generation

    _full().save(tmp_path / "full")
    (tmp_path / "full" / name).unlink()
    os.mkfifo(tmp_path / "full" / name)
    with pytest.raises(DumpError, match="is a FIFO"):
        load_capture(tmp_path / "full")
    os.mkfifo(tmp_path / "generation.json")
    with pytest.raises(DumpError, match="is a FIFO"):  # every loader
        load_generation(tmp_path)


def _lying_header(path: Path, shape: tuple[int, ...]) -> None:
    """Rewrite ``path``'s .npy header to claim ``shape``, keeping its (small) data."""
    from numpy.lib import format as npy

    with open(path, "rb") as handle:
        npy.read_magic(handle)
        _, fortran, dtype = npy.read_array_header_1_0(handle)
        data = handle.read()
    with open(path, "wb") as handle:
        npy.write_array_header_1_0(handle, {"shape": shape, "fortran_order": fortran,
                                            "descr": npy.dtype_to_descr(dtype)})
        handle.write(data)


@pytest.mark.parametrize("mmap", [False, True])
def test_a_header_claiming_terabytes_is_a_dump_error(long_copy: Path, mmap: bool) -> None:
    from attnviz.long import load_long

    _lying_header(long_copy / "lse_000.npy", (4, 1 << 39))  # 4 x 2^39 float32: 8 TiB
    with pytest.raises(DumpError) as info:
        load_long(long_copy, mmap=mmap)
    assert "lse_000.npy" in info.value.message
    assert "truncated or its header is wrong" in info.value.message


def test_an_array_bigger_than_memory_is_refused_unless_mapped(
        long_copy: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import attnviz.reading
    from attnviz.long import load_long

    monkeypatch.setattr(attnviz.reading, "_memory", lambda: 1000)
    with pytest.raises(DumpError, match="more than this machine's memory") as info:
        load_long(long_copy, mmap=False)
    assert "mmap=True" in str(info.value)
    assert load_long(long_copy, mmap=True).num_tokens == TOKENS


# --------------------------------------------------------------------------- stale temporaries
_KILLED = """
import os, signal, sys
from attnviz.session import Session
cap = Session(python=False).capture_long("the cat sat on the mat " * 8, model=sys.argv[1])
print(cap.folder, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


@POSIX
def test_the_next_long_command_removes_what_a_killed_one_left(
        model_dir: Path, tmp_path: Path, invoke: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import tempfile

    temp = tmp_path / "tmp"
    temp.mkdir()
    done = subprocess.run([sys.executable, "-c", _KILLED, str(model_dir)], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "TMPDIR": str(temp)})
    assert done.returncode == -signal.SIGKILL, done.stderr
    left = Path(done.stdout.strip())
    assert left.parent == temp and any(left.glob("q_*.npy"))  # killed: nothing cleaned up
    mine = temp / f"attnviz-long-{os.getpid()}-alive"  # a live process's folder stays
    mine.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    result = invoke("top-k", "the dog ran past her house", "--model", str(model_dir), "--long",
                    "--layer", "0", "--head", "0")
    assert result.exit_code == 0, result.output
    assert not left.exists()
    assert mine.is_dir()
    notes = [line for line in result.stderr.splitlines() if "temporary long-capture" in line]
    assert len(notes) == 1 and "removed 1 temporary long-capture folder (" in notes[0]
    assert [p.name for p in temp.iterdir()] == [mine.name]  # its own folder went at exit
