"""Top-k attended tokens per query."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TopK:
    """The ``k`` keys one query attends to most."""

    query: int  # position of the query token
    keys: list[int]  # key positions, strongest first
    weights: list[float]  # their weights


def top_k(matrix: np.ndarray, k: int = 3) -> list[TopK]:
    """For each row of a ``[query, key]`` matrix, the ``k`` largest keys, strongest first.

    Ties are broken by the lower key position (a stable sort), so results are deterministic.
    """
    if k < 1:
        raise ValueError("k must be at least 1")
    k = min(k, matrix.shape[1])
    order = np.argsort(-matrix, axis=1, kind="stable")[:, :k]
    return [TopK(query=i, keys=[int(j) for j in row],
                 weights=[float(matrix[i, j]) for j in row]) for i, row in enumerate(order)]
