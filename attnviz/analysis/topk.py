"""Top-k attended tokens per query."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, overload

import numpy as np

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class TopK:
    """The ``k`` keys one query attends to most."""

    query: int  # position of the query token
    keys: list[int]  # key positions, strongest first
    weights: list[float]  # their weights


@overload
def top_keys(values: np.ndarray, k: int) -> np.ndarray: ...
@overload
def top_keys(values: torch.Tensor, k: int) -> torch.Tensor: ...


def top_keys(values: np.ndarray | torch.Tensor, k: int) -> np.ndarray | torch.Tensor:
    """The rule of every top-k table: positions of the ``k`` largest values along the last
    axis, largest first, ties to the lower position (the earlier key).

    One rule for a full capture's matrices (numpy: a stable sort) and a long capture's chunks
    of scores (torch, on the capture's device: ``torch.topk``, whose order among equal values
    is unspecified, then ties at the cut and among the chosen put in position order), so
    both lengths list the same keys for the same weights.

    Args:
        values: ``[..., n]`` numpy array or torch tensor; ``k``: 1 to ``n``.

    Returns:
        ``[..., k]`` positions (int64), of the same kind as ``values``.
    """
    if isinstance(values, np.ndarray):
        return np.argsort(-values, axis=-1, kind="stable")[..., :k]
    return _top_keys_torch(values, k)


def _top_keys_torch(values: torch.Tensor, k: int) -> torch.Tensor:
    import torch

    shape = values.shape
    flat = values.reshape(-1, shape[-1])  # [rows, n]
    size = flat.shape[-1]
    if k >= size:
        index = torch.arange(size, device=flat.device).expand(flat.shape[0], size)
    else:
        # One key more than asked: where it equals the k-th, equal values straddle the cut.
        top, index = torch.topk(flat, k + 1, dim=-1)  # [rows, k + 1]
        kth, index = top[:, k - 1:k], index[:, :k]
        straddle = (top[:, k] == top[:, k - 1]).nonzero()[:, 0]
        if straddle.numel():  # keep the earliest of the values equal to the k-th
            index[straddle] = _earliest_ties(flat[straddle], top[straddle, :k],
                                             index[straddle], kth[straddle])
    # Largest first; among equal values, the earlier position first.
    index = index.sort(dim=-1).values
    order = flat.gather(-1, index).sort(dim=-1, descending=True, stable=True).indices
    return index.gather(-1, order).reshape(*shape[:-1], k)


def _earliest_ties(rows: torch.Tensor, top: torch.Tensor, index: torch.Tensor,
                   cut: torch.Tensor) -> torch.Tensor:
    """For rows whose values equal to the k-th largest (``cut``) straddle the cut: the
    positions of every value above the cut, then of the earliest values equal to it.

    Args:
        rows: ``[r, n]``; ``top``, ``index``: their ``k`` largest values and positions;
        cut: ``[r, 1]`` the k-th largest value.
    """
    import torch

    k = top.shape[-1]
    size = rows.shape[-1]
    above = top > cut  # [r, k]: these are chosen whatever the ties
    count = above.sum(-1, keepdim=True)  # [r, 1]
    # Above-cut positions first (a stable order keeps them), then the earliest ties: positions
    # equal to the cut scored by how early they come (exact in float32 up to 2**24 keys).
    first = index.gather(-1, (~above).to(torch.uint8).sort(dim=-1, stable=True).indices)
    early = torch.arange(size, 0, -1, device=rows.device, dtype=torch.float32)
    ties = torch.topk(torch.where(rows == cut, early, 0.0), k, dim=-1).indices  # [r, k]
    slot = torch.arange(k, device=rows.device)[None, :]  # [1, k]
    later = ties.gather(-1, (slot - count).clamp(min=0))
    return torch.where(slot < count, first, later)


def top_k(matrix: np.ndarray, k: int = 3, *, causal: bool = False) -> list[TopK]:
    """For each row of a ``[query, key]`` matrix, the ``k`` largest keys, strongest first.

    Ties are broken by the lower key position (a stable sort), so results are deterministic.
    With ``causal``, keys after the query (masked, weight exactly 0) are never listed, so
    early queries get fewer than ``k`` keys.
    """
    if k < 1:
        raise ValueError("k must be at least 1")
    k = min(k, matrix.shape[1])
    order = top_keys(matrix, k)
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
