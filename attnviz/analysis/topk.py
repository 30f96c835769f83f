"""Top-k attended tokens per query."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TopK:
    """The ``k`` keys one query attends to most."""

    query: int  # position of the query token
    keys: list[int]  # key positions, strongest first
    weights: list[float]  # their weights


def top_k(matrix: np.ndarray, k: int = 3, *, causal: bool = False) -> list[TopK]:
    """For each row of a ``[query, key]`` matrix, the ``k`` largest keys, strongest first.

    Ties are broken by the lower key position (a stable sort), so results are deterministic.
    With ``causal``, keys after the query (masked, weight exactly 0) are never listed, so
    early queries get fewer than ``k`` keys.
    """
    if k < 1:
        raise ValueError("k must be at least 1")
    k = min(k, matrix.shape[1])
    order = np.argsort(-matrix, axis=1, kind="stable")[:, :k]
    return [TopK(query=i, keys=[int(j) for j in row if not (causal and j > i)],
                 weights=[float(matrix[i, j]) for j in row if not (causal and j > i)])
            for i, row in enumerate(order)]


TOPK_CSV_COLUMNS = ("layer", "head", "query_index", "query", "rank", "key_index", "key", "weight")


def topk_rows(matrix: np.ndarray, tokens: list[str], k: int = 3, *,
              causal: bool = False) -> list[dict[str, object]]:
    """Top-k rows of one ``[query, key]`` matrix with token labels.

    Returns:
        One dict per query: ``query_index``, ``query`` and ``top``, a list of ``key_index``,
        ``key`` and ``weight`` (rounded to 6 decimals), strongest first.
    """
    return [{
        "query_index": entry.query,
        "query": tokens[entry.query],
        "top": [{"key_index": j, "key": tokens[j], "weight": round(w, 6)}
                for j, w in zip(entry.keys, entry.weights)],
    } for entry in top_k(matrix, k, causal=causal)]


def topk_csv(weights: np.ndarray, layers: list[int], heads: list[int], tokens: list[str],
             k: int = 3, *, causal: bool = False, measure: str = "weights") -> str:
    """CSV text of the top-k keys of every query, for every layer and head.

    Args:
        weights: ``[layer, head, query, key]``.
        layers: model layer index of each entry on axis 0; ``heads`` likewise for axis 1.
        tokens: label of each token (query and key axes).
        k: keys per query.
        measure: a measure other than weights names the value column (``norm``, not
            ``weight``).

    Returns:
        CSV with the columns of :data:`TOPK_CSV_COLUMNS`, one row per (layer, head, query, rank).
    """
    from attnviz.csvtext import csv_text

    def rows() -> Iterator[list[object]]:
        for li, layer in enumerate(layers):
            for hi, head in enumerate(heads):
                matrix = np.asarray(weights[li, hi], dtype=np.float32)
                for entry in top_k(matrix, k, causal=causal):
                    for rank, (j, w) in enumerate(zip(entry.keys, entry.weights), start=1):
                        yield [layer, head, entry.query, tokens[entry.query], rank, j,
                               tokens[j], f"{w:.6f}"]

    columns = list(TOPK_CSV_COLUMNS)
    if measure != "weights":
        columns[-1] = measure
    return csv_text(columns, rows())
