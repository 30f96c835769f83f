"""A long capture whose ``long.json`` disagrees with its arrays is refused when it opens.

Weights are ``exp(scale * q.k - lse)`` under the sidecar's mask: a flipped ``causal``, a wrong
scale or window, or a shifted ``lse`` made rows sum to 67 or 0.008, silently. Sampled rows are
recomputed on load and must sum to 1; genuine captures (float32 and 16-bit storage, causal,
bidirectional, windowed, from a model and written with the capture's own kernel) open.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from attnviz.errors import DumpError
from tests.long_fixtures import build_tiny_llama, capture_tiny_llama, write_long

TOKENS = 160
WINDOW = 32


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama-consistency"), positions=512)


@pytest.fixture(scope="module")
def captured(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A genuine causal capture of a random-weight Llama."""
    return capture_tiny_llama(model_dir, TOKENS, tmp_path_factory.mktemp("llama") / "cap")


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Bidirectional and windowed captures written from random queries and keys."""
    rng = np.random.default_rng(3)
    q = rng.normal(size=(2, 4, TOKENS, 16)).astype(np.float32)
    k = rng.normal(size=(2, 2, TOKENS, 16)).astype(np.float32)
    root = tmp_path_factory.mktemp("written")
    return {"bidirectional": write_long(root / "bi", q, k, causal=False),
            "windowed": write_long(root / "win", q, k, causal=True, window=WINDOW)}


def _copy(source: Path, target: Path, change: Callable[[dict[str, Any]], None] | None = None
          ) -> Path:
    shutil.copytree(source, target)
    if change is not None:
        sidecar = json.loads((target / "long.json").read_text(encoding="utf-8"))
        change(sidecar)
        (target / "long.json").write_text(json.dumps(sidecar), encoding="utf-8")
    return target


def _set(**values: Any) -> Callable[[dict[str, Any]], None]:
    return lambda sidecar: sidecar.update(values)


def _scales_times(factor: float) -> Callable[[dict[str, Any]], None]:
    def change(sidecar: dict[str, Any]) -> None:
        sidecar["scales"] = [s * factor for s in sidecar["scales"]]

    return change


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_genuine_captures_open(model_dir: Path, written: dict[str, Path], tmp_path: Path,
                               dtype: str) -> None:
    from attnviz.long import capture_long, load_long
    from attnviz.models.hf import HFSource
    from tests.long_fixtures import long_text

    source = HFSource(str(model_dir), device="cpu")
    for summary in (False, True):  # the log-sum-exp of both capture paths
        folder = tmp_path / f"cap-{summary}"
        capture_long(source, long_text(TOKENS), max_tokens=TOKENS, folder=folder, dtype=dtype,
                     summary=summary).close()
        cap = load_long(folder)
        np.testing.assert_allclose(cap.rows(1, 3, 0, TOKENS).sum(axis=1), 1.0, atol=1e-5)
    for folder in written.values():
        load_long(folder)


CASES = [
    ("captured", _set(causal=False), ['"causal": false', "the arrays are those of causal "
                                     "attention", "query 0 in head"]),
    ("bidirectional", _set(causal=True), ['"causal": true', "the arrays are those of "
                                          "bidirectional attention"]),
    ("captured", _scales_times(4), ["scale", "sum to"]),
    ("bidirectional", _scales_times(0.25), ["scale", "sum to"]),
    ("captured", _set(windows=[16, 16]), ["window 16", "the arrays have no sliding window"]),
    ("windowed", _set(windows=[None, None]),
     ["window none", f"the arrays have a sliding window of {WINDOW} keys"]),
    ("windowed", _set(windows=[8, WINDOW]), ["layer 0", "window 8",
                                             f"a sliding window of {WINDOW} keys"]),
    ("windowed", _set(windows=[WINDOW, 64]), ["layer 1", "window 64"]),
]


@pytest.mark.parametrize(("which", "change", "words"), CASES)
def test_a_sidecar_that_disagrees_is_refused(captured: Path, written: dict[str, Path],
                                             tmp_path: Path, invoke: Any, which: str,
                                             change: Callable[[dict[str, Any]], None],
                                             words: list[str]) -> None:
    from attnviz.long import load_long

    source = captured if which == "captured" else written[which]
    folder = _copy(source, tmp_path / "cap", change)
    with pytest.raises(DumpError) as refused:
        load_long(folder)
    message = refused.value.message
    assert message.startswith(f"{folder / 'long.json'} disagrees with the arrays of layer ")
    assert "\n" not in message and refused.value.hint == "the long capture folder is " \
        "damaged: capture again"
    for word in words:
        assert word in message, message
    result = invoke("top-k", "--from", str(folder), "-l", "0", "--head", "0")
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    shown = " ".join(result.stderr.split())
    assert shown.startswith("Error: ") and "disagrees with the arrays" in shown
    assert "Traceback" not in result.output


@pytest.mark.parametrize("shift", [0.01, -0.01, "rolled"])
def test_a_log_sum_exp_that_disagrees_is_refused(captured: Path, tmp_path: Path,
                                                 shift: Any) -> None:
    from attnviz.long import load_long

    folder = _copy(captured, tmp_path / "cap")
    path = folder / "lse_001.npy"
    lse = np.load(path)
    np.save(path, np.roll(lse, 1, axis=1) if shift == "rolled" else lse + np.float32(shift))
    with pytest.raises(DumpError, match=r"layer 1: .* sum to [0-9.e+-]+, not 1 \(lse_001.npy "
                                        r"against q_001.npy and k_001.npy\)"):
        load_long(folder)


def test_the_server_refuses_a_capture_that_disagrees(captured: Path, tmp_path: Path,
                                                     invoke: Any) -> None:
    folder = _copy(captured, tmp_path / "cap", _set(causal=False))
    result = invoke("serve", "--long-from", str(folder), "--port", "0")
    assert result.exit_code == 1, result.output
    assert "disagrees with the arrays" in " ".join(result.stderr.split())


def test_sixty_four_thousand_tokens_sum_to_one_in_float32(tmp_path: Path) -> None:
    """The tolerance against float32 rounding: the sampled rows of 64k tokens, their
    log-sum-exp computed as a capture computes it (float32, chunked; scores from -30 to 30 and
    a sink key), pass the check with a hundredth of its tolerance."""
    import torch

    from attnviz.long import kernels
    from attnviz.long.consistency import ROW_SUM_TOLERANCE, check_rows, sample_rows

    size, dim, scale = 1 << 16, 32, 0.5
    rng = np.random.default_rng(0)
    q = rng.normal(scale=1.5, size=(2, size, dim)).astype(np.float32)
    k = rng.normal(scale=1.5, size=(1, size, dim)).astype(np.float32)
    k[0, 0] = q[0].mean(axis=0) * 8  # a sink: large scores on key 0
    rows = sample_rows(size, 0)
    assert np.abs(scale * q[:, rows] @ k[0].T).max() > 30
    for causal in (True, False):
        s = kernels.scores(torch.from_numpy(q[:, rows]), torch.from_numpy(k), scale)
        for at, row in enumerate(rows):  # [head, rows, T], masked as lse_chunked masks
            kernels.apply_mask(s[:, at:at + 1], row, 0, causal, None)
        top = s.amax(dim=-1, keepdim=True)
        lse = np.zeros((2, size), dtype=np.float32)  # rows not sampled are not read
        lse[:, rows] = (top[..., 0] + s.sub_(top).exp_().sum(dim=-1).log_()).numpy()
        assert check_rows(tmp_path, 0, 0, q=q, k=k, lse=lse, dtype="float32", causal=causal,
                          window=None, scale=scale, tolerance=ROW_SUM_TOLERANCE / 100) is None
        problem = check_rows(tmp_path, 0, 0, q=q, k=k, lse=lse, dtype="float32",
                             causal=not causal, window=None, scale=scale)
        assert problem is not None and "query 0 in head 0" in problem


def test_huge_scores_open_and_a_shift_is_still_found(tmp_path: Path) -> None:
    """float32 holds a log-sum-exp of 1e5 only to 8e-3, more than the tolerance: a capture
    with such scores opens (the rounding is allowed for), and a shifted lse is still found."""
    from attnviz.long import load_long

    rng = np.random.default_rng(5)
    q = rng.normal(scale=100.0, size=(1, 2, 64, 16)).astype(np.float32)
    k = rng.normal(scale=100.0, size=(1, 1, 64, 16)).astype(np.float32)
    folder = write_long(tmp_path / "cap", q, k, scale=4.0)
    lse = np.load(folder / "lse_000.npy")
    assert np.abs(lse).max() > 100_000
    load_long(folder)
    shifted = _copy(folder, tmp_path / "shifted")
    np.save(shifted / "lse_000.npy", lse + np.float32(0.5))
    with pytest.raises(DumpError, match="disagrees"):
        load_long(shifted)
