"""The long capture's log-sum-exp from the model's own fused kernel call, and a request that
computes only what it needs (the forward stops after the last layer asked for)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.long_fixtures import build_tiny_llama, long_text

TEXT = ("The cat sat on the mat, and the dog sat on the log. Then the cat saw the dog; "
        "the dog saw the cat. ") * 6


def _visible(rows: Any, size: int, causal: bool, window: int | None) -> Any:
    import torch

    j = torch.arange(size)[None, :]
    i = rows[:, None]
    seen = (j <= i) if causal else torch.ones(len(rows), size, dtype=torch.bool)
    if window:
        seen = seen & (j > i - window)
    return seen


def _weights_error(q: Any, k: Any, lse: Any, scale: float, rows: Any, causal: bool,
                   window: int | None = None) -> float:
    """Largest difference between the weights read back from ``lse`` (float32, as
    ``LongCapture`` computes them) and float64 softmax weights, over ``rows``."""
    import torch

    from attnviz.long import kernels

    size, group = q.shape[1], q.shape[0] // k.shape[0]
    seen = _visible(rows, size, causal, window)  # [n, T]
    s32 = kernels.scores(q[:, rows], k, scale) - lse[:, rows, None]  # [head, n, T]
    read = torch.where(seen, s32.exp(), torch.zeros_like(s32)).double()
    k64 = k.double().repeat_interleave(group, dim=0)
    s64 = (q[:, rows].double() @ k64.transpose(1, 2)) * scale
    truth = torch.softmax(s64.masked_fill(~seen, -math.inf), dim=-1)
    return float((read - truth).abs().max())


def test_cpu_kernel_lse_at_16k_tokens_is_within_1e5_of_float64() -> None:
    """16k tokens, grouped heads, causal: the fused CPU kernel's log-sum-exp gives weights
    within 1e-5 of float64, rows near the end included; its output is sdpa's."""
    import torch

    from attnviz.long import kernels

    torch.manual_seed(0)
    size, dim = 16384, 32
    q = torch.randn(1, 2, size, dim) * 2.0  # [1, head, T, dim]
    k = torch.randn(1, 1, size, dim) * 2.0  # [1, kv_head, T, dim]
    v = torch.randn(1, 1, size, dim)
    scale = 1 / math.sqrt(dim)
    found = kernels.kernel_attention(q, k, v, None, scale, True)
    assert found is not None
    output, lse, name = found
    assert name == "flash (CPU)" and lse.shape == (2, size) and lse.dtype == torch.float32
    rows = torch.tensor([0, 1, 2, 100, 4096, size // 2, size - 64, size - 3, size - 2,
                         size - 1])
    assert _weights_error(q[0], k[0], lse, scale, rows, True) < 1e-5
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                            scale=scale, enable_gqa=True)
    torch.testing.assert_close(output, sdpa, rtol=0, atol=1e-6)


@pytest.mark.parametrize("boolean", [True, False])
def test_cpu_kernel_lse_under_a_window_mask(boolean: bool) -> None:
    """A sliding window given as the model's mask (boolean or additive): the kernel's
    log-sum-exp normalises exactly the keys inside the window."""
    import torch

    from attnviz.long import kernels

    torch.manual_seed(1)
    size, dim, window = 1500, 16, 100
    q, k = torch.randn(1, 4, size, dim) * 3, torch.randn(1, 2, size, dim) * 3
    rows = torch.arange(size)
    seen = _visible(rows, size, True, window)[None, None]  # [1, 1, T, T]
    mask = seen if boolean else torch.zeros(seen.shape).masked_fill(~seen, -3.4e38)
    found = kernels.kernel_attention(q, k, k.clone(), mask, 0.25, True)
    assert found is not None
    lse = found[1]
    assert _weights_error(q[0], k[0], lse, 0.25, rows, True, window) < 1e-5
    chunked = kernels.lse_chunked(q[0], k[0], 0.25, True, window)
    torch.testing.assert_close(lse, chunked, rtol=0, atol=5e-6)


def test_lse_rows_equal_the_chunked_pass() -> None:
    import torch

    from attnviz.long import kernels

    torch.manual_seed(2)
    q, k = torch.randn(4, 300, 8) * 2, torch.randn(2, 300, 8) * 2
    for causal, window in ((True, None), (True, 50), (False, None)):
        full = kernels.lse_chunked(q, k, 0.3, causal, window)
        rows = kernels.sample_rows(q)
        assert rows[0] == 0 and rows[-1] == 299
        torch.testing.assert_close(kernels.lse_rows(q, k, 0.3, causal, window, rows),
                                   full[:, rows], rtol=0, atol=1e-6)


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from attnviz.models.hf import HFSource

    folder = build_tiny_llama(tmp_path_factory.mktemp("kernel-llama"), positions=4096,
                              layers=3, heads=4, kv_heads=2, hidden=32)
    return HFSource(str(folder), device="cpu")


def test_capture_takes_the_kernels_lse_and_output(llama: Any) -> None:
    """The kernel's log-sum-exp equals the chunked pass's, and the kernel's output feeds the
    next layer as sdpa's would (layer 2's queries are the same either way)."""
    from attnviz.long import capture_long

    text = long_text(600)
    fast = capture_long(llama, text)
    exact = capture_long(llama, text, use_kernel=False)
    assert fast.meta["lse"] == ["flash (CPU)"] * 3 and exact.meta["lse"] == ["chunked"] * 3
    for layer in range(3):
        np.testing.assert_allclose(fast._array("lse", layer), exact._array("lse", layer),
                                   rtol=0, atol=5e-6)
        np.testing.assert_allclose(fast._array("q", layer), exact._array("q", layer),
                                   rtol=0, atol=1e-5)
    reference = llama.capture(text, layers=[2])
    np.testing.assert_allclose(fast.rows(2, 3, 0, fast.num_tokens), reference.weights[0, 3],
                               rtol=0, atol=1e-5)


def test_rounded_storage_takes_the_lse_of_the_stored_values(llama: Any) -> None:
    """bfloat16 storage of a float32 model: the log-sum-exp normalises the rounded queries and
    keys (rows read back sum to 1), not the model's own."""
    from attnviz.long import capture_long

    cap = capture_long(llama, long_text(400), dtype="bfloat16", layers=[1])
    assert cap.meta["lse"] == ["flash (CPU)"]
    rows = cap.rows(1, 2, 0, cap.num_tokens)
    np.testing.assert_allclose(rows.sum(-1), 1.0, rtol=0, atol=1e-5)


def test_large_scores_fall_back_to_the_exact_pass(minilm: Any) -> None:
    """MiniLM's first layer has scores near 60, where the kernel's float32 rounding is off by
    more than the weights allow: the sampled rows catch it and the chunked pass runs."""
    from attnviz.long import capture_long

    cap = capture_long(minilm, TEXT, layers=[0, 1])
    assert cap.meta["lse"][0] == "chunked"
    reference = minilm.capture(TEXT, layers=[0])
    for head in range(cap.num_heads):
        np.testing.assert_allclose(cap.rows(0, head, 0, cap.num_tokens),
                                   reference.weights[0, head], rtol=0, atol=1e-5)


def test_forward_stops_after_the_last_layer_and_reports_progress(llama: Any) -> None:
    from attnviz.long import capture_long

    seen: list[tuple[int, int]] = []
    ran: list[int] = []
    modules = llama.attention_modules
    hooks = [modules[n].register_forward_pre_hook(
        lambda module, args, n=n: ran.append(n)) for n in range(3)]
    try:
        cap = capture_long(llama, TEXT, layers=[1], progress=lambda done, total: seen.append(
            (done, total)))
    finally:
        for hook in hooks:
            hook.remove()
    assert cap.layers == [1]
    assert ran == [0, 1]  # layer 2 never ran
    assert seen == [(0, 2), (1, 2), (2, 2)]


def test_a_request_for_one_layer_records_only_it(llama: Any, monkeypatch: pytest.MonkeyPatch,
                                                 tmp_path: Path) -> None:
    """``top-k --layer L`` asks the session for one layer: the long capture records that layer
    only, and negative layers count from the end."""
    from attnviz.request import CaptureRequest
    from attnviz.session import Session

    session = Session()
    for layer, recorded in ((1, [1]), (-1, [2])):
        cap: Any = session.run(CaptureRequest(text=long_text(300), model=llama.name,
                                              layer=layer, head=0, long=True))
        assert cap.layers == recorded


def test_one_pass_answers_topk_and_the_means_atlas(llama: Any,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A summary with top-k and the mean's maxima holds the top keys and the mean's atlas as
    the separate scans give them, and the atlas and sinks need no separate scan."""
    import attnviz.long.scan as scan
    from attnviz.long import capture_long

    cap = capture_long(llama, long_text(700), summary=True, block=16, k=4)
    cap.summarise(block=16, mean=True)  # keeps k=4: one more pass, for the mean's maxima
    held = cap._summary
    assert held is not None and held.k == 4 and held.mean
    assert held.top_indices is not None and held.top_values is not None
    indices, values = held.top_indices[1, 2, :, :3], held.top_values[1, 2, :, :3]
    sums, maxes = cap.atlas(2, "mean", 64)
    cap._summary = None  # the separate scans, for reference
    ref_indices, ref_values = cap.topk(1, 2, 3)
    ref_sums, ref_maxes = cap.atlas(2, "mean", 64)
    np.testing.assert_array_equal(indices, ref_indices)
    np.testing.assert_allclose(values, ref_values, rtol=0, atol=1e-5)
    np.testing.assert_allclose(sums, ref_sums, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(maxes, ref_maxes, rtol=0, atol=1e-6)
    cap._summary = held

    def no_scan(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a separate scan ran")

    monkeypatch.setattr(scan, "scan_layer", no_scan)
    cap.atlas(1, "mean", 16)
    cap.sinks()


def test_export_long_takes_one_pass(invoke: Any, llama: Any, tmp_path: Path,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """export --long: the capture's own pass gives the atlas figures, heads.csv and
    sinks.json (no second summary)."""
    import attnviz.long.scan as scan

    calls = {"summarise": 0}
    for name in calls:
        original = getattr(scan, name)

        def counted(*args: Any, _name: str = name, _original: Any = original,
                    **kwargs: Any) -> Any:
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(scan, name, counted)
    result = invoke("export", long_text(300), "--model", llama.name, "--long", "-o",
                    str(tmp_path / "out"), "--top-k", "2")
    assert result.exit_code == 0, result.output
    assert calls == {"summarise": 0}
    (folder,) = [p for p in (tmp_path / "out").iterdir() if p.is_dir()]
    rows = (folder / "topk.csv").read_text(encoding="utf-8").splitlines()
    assert len(rows) > 1 and (folder / "heads.csv").is_file()
