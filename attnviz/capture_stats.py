"""Per-head statistics of a materialised capture, row by row (the definitions of
:mod:`attnviz.analysis.stats`, which re-exports everything here).

They sit beside the record so that :meth:`attnviz.capture.Capture.head_stats` answers them
(the record's question surface, :mod:`attnviz.record`); the labels, tables and corpus sums
built on them stay in :mod:`attnviz.analysis.stats`.
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np


class Capture(Protocol):
    """What :func:`stat_sums` reads of a :class:`attnviz.capture.Capture` (named
    structurally: the record imports this module)."""

    weights: Any
    layers: list[int]
    heads: list[int]
    special: list[bool]
    display_tokens: list[str]
    model: str
    causal: bool

    @property
    def rows_sum_to_one(self) -> bool: ...

    @property
    def measure(self) -> str: ...

LOCAL_WINDOW = 2  # |i - j| <= LOCAL_WINDOW counts as local

#: Statistic keys of every row of :func:`head_table`, in display order.
STAT_KEYS: tuple[str, ...] = ("entropy", "entropy_nats", "distance", "max_weight", "self",
                              "previous", "next", "first", "sep", "punct", "local")


def is_punctuation(token: str) -> bool:
    """Whether a (display) token consists only of punctuation characters, e.g. ``.``, ``,"``."""
    text = token.strip()
    return bool(text) and all(unicodedata.category(ch).startswith("P") for ch in text)


@dataclass
class StatSums:
    """Running sums of the per-row statistics of every held head, and how many rows each has.

    Add the sums of several captures of the same model with ``+`` to average over a corpus,
    weighted by tokens (every eligible query row counts once).

    Attributes:
        layers: model layer of each entry on axis 0.
        heads: model head of each entry on axis 1.
        sums: statistic -> ``[layer, head]`` sum over eligible rows.
        counts: statistic -> ``[layer, head]`` number of eligible rows.
        texts: how many captures were added.
        tokens: how many tokens (query rows, eligible or not) they had.
    """

    layers: list[int]
    heads: list[int]
    sums: dict[str, np.ndarray]
    counts: dict[str, np.ndarray]
    texts: int = 1
    tokens: int = 0
    model: str = ""
    causal: bool = False
    measure: str = "weights"  # a measure's rows were scaled to sum to 1 first

    def __add__(self, other: StatSums) -> StatSums:
        if self.layers != other.layers or self.heads != other.heads:
            raise ValueError("cannot add statistics of different layers or heads")
        return StatSums(
            layers=list(self.layers), heads=list(self.heads),
            sums={k: self.sums[k] + other.sums[k] for k in STAT_KEYS},
            counts={k: self.counts[k] + other.counts[k] for k in STAT_KEYS},
            texts=self.texts + other.texts, tokens=self.tokens + other.tokens,
            model=self.model, causal=self.causal or other.causal, measure=self.measure)

    def means(self) -> dict[str, np.ndarray]:
        """Statistic -> ``[layer, head]`` mean over eligible rows (0 where there are none)."""
        return {k: np.divide(self.sums[k], self.counts[k], out=np.zeros_like(self.sums[k]),
                             where=self.counts[k] > 0) for k in STAT_KEYS}


def _block_sums(block: np.ndarray, *, causal: bool, sep_mask: np.ndarray,
                punct_mask: np.ndarray) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Sums and counts over eligible rows for one layer: ``block`` is ``[head, query, key]``."""
    H, T, _ = block.shape
    positions = np.arange(T)
    visible = positions + 1 if causal else np.full(T, T)  # keys each row can see
    row_sum = block.sum(axis=-1)  # [head, query]
    eligible = (row_sum > 1e-6) & (visible >= 2)[None, :]  # [head, query]
    logs = np.log(np.where(block > 0, block, 1.0))
    nats = -(block * logs).sum(axis=-1)  # [head, query]
    norm = nats / np.log(np.maximum(visible, 2))[None, :]
    dist = np.abs(positions[:, None] - positions[None, :])  # [query, key]
    per_row: dict[str, np.ndarray] = {
        "entropy": norm,
        "entropy_nats": nats,
        "distance": (block * dist).sum(axis=-1),
        "max_weight": block.max(axis=-1),
        "self": np.diagonal(block, axis1=1, axis2=2),
        "first": block[:, :, 0],
        "sep": block[:, :, sep_mask].sum(axis=-1),
        "punct": block[:, :, punct_mask].sum(axis=-1),
        "local": (block * (dist <= LOCAL_WINDOW)).sum(axis=-1),
    }
    previous = np.zeros((H, T))
    following = np.zeros((H, T))
    if T > 1:
        previous[:, 1:] = np.diagonal(block, offset=-1, axis1=1, axis2=2)
        following[:, :-1] = np.diagonal(block, offset=1, axis1=1, axis2=2)
    per_row["previous"] = previous
    per_row["next"] = following
    has_previous = eligible & (positions >= 1)[None, :]
    has_next = eligible & (positions <= T - 2)[None, :]
    masks = dict.fromkeys(STAT_KEYS, eligible)
    masks["previous"] = has_previous
    masks["next"] = has_next
    sums = {k: np.where(masks[k], per_row[k], 0.0).sum(axis=-1) for k in STAT_KEYS}
    counts = {k: masks[k].sum(axis=-1).astype(np.float64) for k in STAT_KEYS}
    return sums, counts


def row_normalised(matrix: np.ndarray) -> np.ndarray:
    """Rows scaled to sum to 1 (a row of zeros stays zero), for ``[..., query, key]``."""
    data = np.asarray(matrix, dtype=np.float64)
    sums = data.sum(axis=-1, keepdims=True)
    return np.divide(data, sums, out=np.zeros_like(data), where=sums > 0)


def stat_sums(capture: Capture) -> StatSums:
    """Per-row statistic sums of every held head of one capture.

    Args:
        capture: weights ``[layer, head, query, key]``; rows should sum to 1 (or 0). The
            rows of a measure whose rows are amounts (``norm``: ``capture.rows_sum_to_one``
            is false) are scaled to sum to 1 first, so its statistics read as those of attention.

    Returns:
        The sums and row counts; :meth:`StatSums.means` gives the statistics.
    """
    L, H, T, _ = capture.weights.shape
    special = np.asarray(capture.special, dtype=bool)
    sep_mask = special & (np.arange(T) > 0)
    punct_mask = np.array([not s and is_punctuation(t)
                           for t, s in zip(capture.display_tokens, capture.special)], dtype=bool)
    sums = {k: np.zeros((L, H)) for k in STAT_KEYS}
    counts = {k: np.zeros((L, H)) for k in STAT_KEYS}
    for position in range(L):  # one layer at a time keeps float64 copies small
        block = np.asarray(capture.weights[position], dtype=np.float64)
        if not capture.rows_sum_to_one:
            block = row_normalised(block)
        layer_sums, layer_counts = _block_sums(block, causal=capture.causal, sep_mask=sep_mask,
                                               punct_mask=punct_mask)
        for key in STAT_KEYS:
            sums[key][position] = layer_sums[key]
            counts[key][position] = layer_counts[key]
    return StatSums(layers=list(capture.layers), heads=list(capture.heads), sums=sums,
                    counts=counts, texts=1, tokens=T, model=capture.model, causal=capture.causal,
                    measure=capture.measure)
