"""One tie rule for every top-k table: equal weights go to the earlier key, at any length.

A long capture's top-k (ranked from scores chunk by chunk with torch) and a full capture's
(ranked from the weight matrix with numpy) must list the same keys in the same order for the
same weights, also when many weights are exactly equal: uniform attention (queries of zeros)
and keys repeated, so that scores tie exactly.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from attnviz.analysis import long as long_tables
from attnviz.analysis.topk import top_k, topk_rows
from tests.long_fixtures import write_long

HEADS, KV_HEADS, DIM = 4, 2, 8


def _queries_keys(size: int, kind: str) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(size)
    if kind == "uniform":  # every score 0: every visible key weighs exactly 1 / visible
        q = np.zeros((1, HEADS, size, DIM), dtype=np.float32)
        k = rng.normal(size=(1, KV_HEADS, size, DIM)).astype(np.float32)
    else:  # three distinct keys repeated: scores (and weights) tie exactly in every row
        q = rng.normal(size=(1, HEADS, size, DIM)).astype(np.float32)
        distinct = rng.normal(size=(KV_HEADS, 3, DIM)).astype(np.float32)
        k = distinct[:, rng.integers(0, 3, size=size)][None]
    return q, k


@pytest.mark.parametrize("size", [15, 200])
@pytest.mark.parametrize("kind", ["uniform", "repeated"])
@pytest.mark.parametrize("causal", [True, False])
def test_full_and_long_tables_are_identical_under_ties(tmp_path: Path, size: int, kind: str,
                                                       causal: bool) -> None:
    from attnviz.long import load_long

    q, k = _queries_keys(size, kind)
    cap = load_long(write_long(tmp_path / "cap", q, k, causal=causal))
    tokens = list(cap.display_tokens)
    # The whole-capture scan's top-k (one pass over every head) follows the same rule.
    summary = cap.summarise(k=7)
    assert summary.top_indices is not None
    for head in [*range(HEADS), "mean"]:
        matrix = cap.rows(0, head, 0, size)  # the weights a full capture would hold
        if kind == "repeated" and head != "mean":  # the ties are really there
            assert len(np.unique(matrix[-1])) <= 3
        for top in (1, 3, 7):
            full = topk_rows(matrix, tokens, top, causal=causal)
            assert long_tables.topk_rows(cap, 0, head, top) == full, (top, head)
            if head != "mean":
                scanned = [[int(j) for j in row[:top] if j >= 0]
                           for row in summary.top_indices[0, head]]
                assert scanned == [entry.keys for entry in top_k(matrix, top, causal=causal)]


def test_uniform_rows_list_the_earliest_keys(tmp_path: Path) -> None:
    from attnviz.long import load_long

    q, k = _queries_keys(15, "uniform")
    cap = load_long(write_long(tmp_path / "cap", q, k, causal=False))
    indices, values = cap.topk(0, 2, 3)
    assert indices.tolist() == [[0, 1, 2]] * 15
    np.testing.assert_allclose(values, 1 / 15, rtol=1e-6)


def test_one_rule_in_numpy_and_torch() -> None:
    from attnviz.analysis.topk import top_keys

    rng = np.random.default_rng(0)
    for _ in range(200):
        rows, n = int(rng.integers(1, 12)), int(rng.integers(1, 50))
        values = rng.integers(0, int(rng.integers(1, 5)), size=(2, rows, n)).astype(np.float32)
        k = int(rng.integers(1, n + 1))
        expected = np.argsort(-values, axis=-1, kind="stable")[..., :k]
        np.testing.assert_array_equal(top_keys(values, k), expected)
        np.testing.assert_array_equal(top_keys(torch.from_numpy(values), k).numpy(), expected)
