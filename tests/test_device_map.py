"""--device-map auto (Accelerate) on a CPU-only machine, with and without disk offload, and
the --trust-remote-code warning."""

from __future__ import annotations

import numpy as np
import pytest

from attnviz.capture import load_capture
from attnviz.errors import UsageError
from attnviz.models.hf import HFSource
from tests.conftest import SENTENCE

TEXTS = ["The cat sat on the mat.", "Hi there", "A longer sentence with more words in it."]


@pytest.fixture(scope="module")
def plain(tiny_llama_dir):
    return HFSource(str(tiny_llama_dir), device="cpu")


def test_device_map_auto_equals_normal_load(tiny_llama_dir, plain):
    mapped = HFSource(str(tiny_llama_dir), device_map="auto")
    assert mapped.device.type == "cpu"  # no GPU here: everything stays in CPU memory
    capture = mapped.capture(SENTENCE)
    reference = plain.capture(SENTENCE)
    assert capture.weights.dtype == np.float32
    np.testing.assert_array_equal(capture.weights, reference.weights)
    assert capture.causal and capture.meta["method"] == "hooks"


def test_small_max_memory_offloads_to_disk(tiny_llama_dir, plain, tmp_path):
    """A budget smaller than the model: Accelerate offloads weights to disk, results stay equal."""
    offloaded = HFSource(str(tiny_llama_dir), device_map="auto", max_memory={"cpu": "200KB"},
                         offload_folder=tmp_path / "offload")
    assert offloaded.hf_device_map is not None
    assert "disk" in {str(v) for v in offloaded.hf_device_map.values()}
    assert any(p.device.type == "meta" for p in offloaded.model.parameters())  # really offloaded
    capture = offloaded.capture(SENTENCE)
    assert capture.weights.dtype == np.float32
    assert "disk" in capture.meta["device_map"]
    np.testing.assert_allclose(capture.weights, plain.capture(SENTENCE).weights, rtol=0,
                               atol=1e-6)
    one = offloaded.capture(SENTENCE, layers=[1], heads=[2])
    np.testing.assert_allclose(one.weights, plain.capture(SENTENCE, layers=[1], heads=[2]).weights,
                               rtol=0, atol=1e-6)
    for b, text in zip(offloaded.capture_batch(TEXTS, batch_size=2), TEXTS):
        np.testing.assert_allclose(b.weights, plain.capture(text).weights, rtol=0, atol=1e-5)


def test_device_map_errors(tiny_llama_dir):
    with pytest.raises(UsageError, match="invalid --device-map 'everywhere'"):
        HFSource(str(tiny_llama_dir), device_map="everywhere")
    with pytest.raises(UsageError, match="cannot be combined"):
        HFSource(str(tiny_llama_dir), device="cpu", device_map="auto")
    with pytest.raises(UsageError, match="needs a device map"):
        HFSource(str(tiny_llama_dir), max_memory={"cpu": "1GB"})


def test_cli_device_map(invoke, tiny_llama_dir, plain, tmp_path):
    result = invoke("dump", SENTENCE, "--model", tiny_llama_dir, "--device-map", "auto",
                    "-o", tmp_path / "c")
    assert result.exit_code == 0, result.output
    saved = load_capture(tmp_path / "c")
    np.testing.assert_array_equal(saved.weights, plain.capture(SENTENCE).weights)
    bad = invoke("dump", SENTENCE, "--model", tiny_llama_dir, "--device-map", "nowhere",
                 "-o", tmp_path / "d")
    assert bad.exit_code == 2 and "expected auto, balanced" in bad.stderr
    both = invoke("dump", SENTENCE, "--model", tiny_llama_dir, "--device-map", "auto",
                  "--device", "cpu", "-o", tmp_path / "d")
    assert both.exit_code == 2 and "cannot be combined" in both.stderr
    toy = invoke("dump", "a b", "--model", "toy", "--device-map", "auto", "-o", tmp_path / "d")
    assert toy.exit_code == 2 and "Hugging Face models" in toy.stderr
    assert not (tmp_path / "d").exists()
    assert "Traceback" not in bad.output + both.output + toy.output


def test_trust_remote_code_warns_with_model_name(invoke, tiny_llama_dir, tmp_path):
    result = invoke("dump", SENTENCE, "--model", tiny_llama_dir, "--trust-remote-code",
                    "-o", tmp_path / "c")
    assert result.exit_code == 0, result.output
    assert "--trust-remote-code is on" in result.stderr
    assert str(tiny_llama_dir) in result.stderr.replace("\n", "")
    quiet = invoke("dump", SENTENCE, "--model", tiny_llama_dir, "-o", tmp_path / "d")
    assert quiet.exit_code == 0 and "trust-remote-code" not in quiet.stderr
