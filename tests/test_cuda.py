"""CUDA capture equals CPU capture (skipped on machines without a CUDA GPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.conftest import SENTENCE

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.mark.parametrize(("dtype", "atol"), [("float32", 1e-4), ("float16", 5e-3),
                                             ("bfloat16", 3e-2)])
def test_minilm_cuda_matches_cpu(minilm_capture, dtype, atol):
    from attnviz.models.hf import HFSource

    capture = HFSource("minilm", device="cuda", dtype=dtype).capture(SENTENCE)
    assert capture.weights.dtype == np.float32
    assert capture.meta["device"].startswith("cuda")
    np.testing.assert_allclose(capture.weights, minilm_capture.weights, atol=atol)


def test_toy_cuda_matches_cpu():
    from attnviz.models.toy import ToyConfig, ToySource

    config = ToyConfig(layers=2, heads=4, d_model=32, causal=True)
    cpu = ToySource(config, device="cpu").capture("one two three four")
    gpu = ToySource(config, device="cuda:0").capture("one two three four")
    np.testing.assert_allclose(gpu.weights, cpu.weights, atol=1e-5)
    assert (np.triu(gpu.weights[0, 0], 1) == 0).all()


def test_auto_picks_cuda():
    from attnviz.models._torch import resolve_device

    assert resolve_device("auto").type == "cuda"
