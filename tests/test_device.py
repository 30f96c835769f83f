"""Device and dtype choices on any machine."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnviz.errors import DeviceError, UsageError
from attnviz.models._torch import resolve_device, resolve_dtype


def test_auto_and_cpu():
    assert resolve_device("cpu").type == "cpu"
    expected = "cuda" if torch.cuda.is_available() else resolve_device("auto").type
    assert resolve_device("auto").type == expected


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda_is_clear():
    with pytest.raises(DeviceError, match="CUDA is not available"):
        resolve_device("cuda:0")


def test_bad_names():
    with pytest.raises(UsageError):
        resolve_device("gpu0")
    with pytest.raises(UsageError):
        resolve_dtype("float64")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_returns_float32(minilm_capture, dtype):
    from attnviz.models.hf import HFSource

    capture = HFSource("minilm", device="cpu", dtype=dtype).capture("The cat sat on the mat")
    assert capture.weights.dtype == np.float32
    np.testing.assert_allclose(capture.weights.sum(-1), 1.0, atol=2e-2)
    np.testing.assert_allclose(capture.weights, minilm_capture.weights, atol=5e-2)
