"""Long inputs and big captures: token limits end to end, memory guard, streaming float16 dumps."""

from __future__ import annotations

import errno
import json
import os

import numpy as np
import pytest

from attnviz.capture import load_capture
from attnviz.errors import InputError, OutputError
from attnviz.models.hf import HFSource
from attnviz.stream import CaptureWriter, stream_capture, write_capture
from tests.conftest import SENTENCE

LONG = " ".join(["word"] * 200)  # 202 tokens with [CLS] and [SEP]


@pytest.fixture(scope="module")
def llama(tiny_llama_dir):
    return HFSource(str(tiny_llama_dir), device="cpu")


def test_decoder_works_up_to_its_limit(llama):
    """The tiny Llama has 128 positions: exactly 128 tokens run, causal and normalised."""
    assert llama.max_tokens == 128
    capture = llama.capture(LONG)
    assert capture.weights.shape == (2, 4, 128, 128)
    assert capture.causal
    assert np.all(np.triu(capture.weights, 1) == 0)
    np.testing.assert_allclose(capture.weights.sum(-1), 1.0, atol=1e-5)
    assert "202 tokens long; kept the first 128 tokens (the limit for" in (
        capture.meta["warnings"][0])
    exact = llama.capture(" ".join(["word"] * 126), truncate=False)
    assert exact.num_tokens == 128 and not exact.meta["warnings"]


def test_cli_truncate_warns_and_keeps_first_tokens(invoke, tiny_llama_dir, tmp_path, llama):
    result = invoke("dump", LONG, "--model", tiny_llama_dir, "-o", tmp_path / "c")
    assert result.exit_code == 0, result.output
    assert "Warning:" in result.stderr and "dropped 74" in result.stderr
    saved = load_capture(tmp_path / "c")
    assert saved.weights.shape == (2, 4, 128, 128)
    np.testing.assert_array_equal(saved.weights, llama.capture(LONG).weights)


def test_cli_no_truncate_is_a_clear_error(invoke, tiny_llama_dir, tmp_path):
    result = invoke("dump", LONG, "--model", tiny_llama_dir, "--no-truncate",
                    "-o", tmp_path / "c")
    assert result.exit_code == 2
    assert "202 tokens long, more than the limit of 128 tokens" in result.stderr
    assert "--truncate" in result.stderr and "Traceback" not in result.output
    assert not (tmp_path / "c").exists()


def test_cli_max_tokens(invoke, tiny_llama_dir, tmp_path):
    result = invoke("dump", LONG, "--model", tiny_llama_dir, "--max-tokens", "10",
                    "-o", tmp_path / "c")
    assert result.exit_code == 0, result.output
    assert "kept the first 10 tokens (set by --max-tokens)" in result.stderr
    assert load_capture(tmp_path / "c").weights.shape == (2, 4, 10, 10)
    strict = invoke("top-k", LONG, "--model", tiny_llama_dir, "--max-tokens", "10",
                    "--no-truncate", "--layer", "0", "--head", "0")
    assert strict.exit_code == 2
    assert "more than the limit of 10 tokens (set by --max-tokens)" in strict.stderr
    above = invoke("dump", LONG, "--model", tiny_llama_dir, "--max-tokens", "1000",
                   "-o", tmp_path / "d")
    assert above.exit_code == 0 and "the limit for" in above.stderr  # the model's limit wins
    assert load_capture(tmp_path / "d").num_tokens == 128


def test_memory_guard(minilm, monkeypatch):
    import psutil

    class Tiny:
        available = 1000

    monkeypatch.setattr(psutil, "virtual_memory", lambda: Tiny())
    with pytest.raises(InputError, match=r"needs .* but only 1000 B of memory is free") as info:
        minilm.capture(SENTENCE)
    assert "--layers" in str(info.value)
    # Streaming to disk does not hold the capture in memory, so it is allowed.
    assert minilm.capture(SENTENCE, allocate=lambda shape: np.zeros(shape, np.float16)
                          ).weights.dtype == np.float16


def test_stream_float16_dump_equals_capture(minilm, tmp_path):
    reference = minilm.capture(SENTENCE, layers=[1, 4])
    path, capture = stream_capture(minilm, SENTENCE, tmp_path / "c", layers=[1, 4],
                                   float16=True)
    assert path == tmp_path / "c" / "attention.npy"
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["attention.npy",
                                                                  "capture.json"]
    assert isinstance(capture.weights, np.memmap)  # the written file, not a copy in memory
    sidecar = json.loads((tmp_path / "c" / "capture.json").read_text(encoding="utf-8"))
    assert sidecar["dtype"] == "float16" and sidecar["shape"] == [2, 12, 8, 8]
    raw = np.load(path)
    assert raw.dtype == np.float16
    np.testing.assert_allclose(raw.astype(np.float32), reference.weights, rtol=0, atol=2.5e-4)
    loaded = load_capture(tmp_path / "c", mmap=True)
    assert isinstance(loaded.weights, np.memmap)
    np.testing.assert_allclose(loaded.matrix(4, 11), reference.matrix(4, 11), atol=2.5e-4)
    assert loaded.tokens == reference.tokens and loaded.layers == [1, 4]


def test_cli_dump_streams_and_reads_slices(invoke, use_minilm, minilm, tmp_path):
    result = invoke("dump", SENTENCE, "--float16", "-o", tmp_path / "all.npy")
    assert result.exit_code == 0, result.output
    assert np.load(tmp_path / "all.npy").dtype == np.float16
    # --from reads the memory map; --layers picks slices of it.
    part = invoke("dump", "--from", tmp_path / "all.npy", "--layers", "2,5", "--heads", "0-3",
                  "-o", tmp_path / "part")
    assert part.exit_code == 0, part.output
    saved = load_capture(tmp_path / "part")
    assert saved.weights.shape == (2, 4, 8, 8)
    reference = minilm.capture(SENTENCE)
    np.testing.assert_allclose(saved.matrix(5, 3), reference.matrix(5, 3), atol=2.5e-4)


@pytest.fixture
def use_minilm(monkeypatch, minilm):
    """The CLI reuses the MiniLM fixture instead of loading it again."""
    import attnviz.models as models

    real = models.load_source

    def load(spec=None):
        if getattr(spec, "name", spec) == "minilm" and getattr(spec, "device_map", None) is None:
            return minilm
        return real(spec)

    monkeypatch.setattr(models, "load_source", load)


def test_disk_full_before_the_model_runs(invoke, use_minilm, tmp_path, monkeypatch):
    """The weights file is reserved at full size first: a full disk fails cleanly, early."""
    invoke("dump", "An older capture", "-o", tmp_path / "c")
    old = (tmp_path / "c" / "capture.json").read_bytes()
    old_weights = (tmp_path / "c" / "attention.npy").read_bytes()

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full, raising=False)
    result = invoke("dump", SENTENCE, "-o", tmp_path / "c")
    assert result.exit_code == 1
    assert "no space left" in result.stderr and "Traceback" not in result.output
    # The previous capture is untouched and no temporary file is left behind.
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["attention.npy",
                                                                  "capture.json"]
    assert (tmp_path / "c" / "capture.json").read_bytes() == old
    assert (tmp_path / "c" / "attention.npy").read_bytes() == old_weights
    fresh = invoke("dump", SENTENCE, "-o", tmp_path / "new" / "c")
    assert fresh.exit_code == 1 and not (tmp_path / "new").exists()


def test_writer_aborts_cleanly(tmp_path, minilm_capture):
    with pytest.raises(RuntimeError, match="interrupted"), CaptureWriter(tmp_path / "c") as w:
        w.allocate(minilm_capture.weights.shape)
        w.write_layer(0, minilm_capture.weights[0])
        raise RuntimeError("interrupted")
    assert not (tmp_path / "c").exists()
    with CaptureWriter(tmp_path / "d.npy") as w:
        w.copy_from(minilm_capture)
        with pytest.raises(ValueError, match="shape"):
            w.commit(minilm_capture.select([0]))
    assert list(tmp_path.iterdir()) == []  # left without a commit: nothing published
    with CaptureWriter(tmp_path / "e.npy") as w:
        w.copy_from(minilm_capture)
        w.commit(minilm_capture)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e.json", "e.npy"]


def test_write_capture_from_memory_map(tmp_path, minilm_capture):
    minilm_capture.save(tmp_path / "a", float16=True)
    mapped = load_capture(tmp_path / "a", mmap=True)
    path = write_capture(mapped, tmp_path / "b.npy")
    assert np.load(path).dtype == np.float32
    again = load_capture(tmp_path / "b.npy")
    np.testing.assert_allclose(again.weights, minilm_capture.weights, atol=2.5e-4)
    assert again.tokens == minilm_capture.tokens


def test_write_error_names_the_fix(tmp_path, minilm_capture):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(OutputError, match="a file stands where a folder is needed"):
        write_capture(minilm_capture, blocker / "c")
    assert blocker.read_text() == "x"
