"""Head statistics and pattern labels: what each head does, in numbers.

Every statistic is computed per query row of a head's ``[query, key]`` matrix and then
averaged over the rows (and, for a corpus, over every row of every text, so longer texts weigh
more: the average is weighted by tokens).

Definitions (also in ``attnviz heads --help`` and the documentation):

* ``entropy_nats``: ``-sum_j a_ij ln a_ij`` with ``0 ln 0 = 0`` and no smoothing.
* ``entropy``: the same divided by ``ln n_i``, where ``n_i`` is the number of keys row ``i``
  can see (``T`` in an encoder, ``i + 1`` in a causal model), so 0 is one-hot and 1 uniform.
* ``distance``: mean attention distance ``sum_j a_ij |i - j|``, in tokens.
* ``max_weight``: the largest weight of the row.
* ``self``, ``previous``, ``next``, ``first``: the weight on key ``i``, ``i - 1``, ``i + 1`` and
  position 0 ([CLS], ``<s>``, or the first word of a model without such a token). ``previous`` is
  averaged over rows that have a previous token, ``next`` over rows that have a next one.
* ``sep``: the share on special tokens after position 0 ([SEP], ``</s>``).
* ``punct``: the share on tokens that are punctuation (not special).
* ``local``: the share within ``LOCAL_WINDOW`` positions of the query (a band of width 5).

Rows that cannot choose are skipped: a row with a single visible key (row 0 of a causal model)
and a row with no weight at all (a row whose only weight was on special tokens, after
``--exclude-special``). A statistic with no rows to average over is reported as 0.

Labels, first rule that applies (thresholds are the module constants below):

1. ``induction``: the head's induction score (when one was measured) is at least
   ``INDUCTION_SCORE``.
2. ``self``, ``previous-token``, ``next-token``, ``first-token/[CLS]``, ``[SEP]``,
   ``punctuation``: the largest of those six shares is at least ``DOMINANT_SHARE``.
3. ``broad``: the normalised entropy is at least ``BROAD_ENTROPY`` (near uniform).
4. ``local``: at least ``LOCAL_SHARE`` of the weight lies within ``LOCAL_WINDOW`` positions.
5. ``mixed``: none of the above.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from attnviz.capture import Capture
from attnviz.capture_stats import (  # noqa: F401  (re-exported)
    LOCAL_WINDOW,
    STAT_KEYS,
    StatSums,
    _block_sums,
    is_punctuation,
    row_normalised,
    stat_sums,
)

DOMINANT_SHARE = 0.5  # one target with at least this share of a head's attention names the head
BROAD_ENTROPY = 0.9  # normalised entropy at or above which a head is "broad" (near uniform)
LOCAL_SHARE = 0.7  # share within LOCAL_WINDOW positions at or above which a head is "local"
INDUCTION_SCORE = 0.3  # induction score at or above which a head is an induction head

#: Pattern labels, in rule order.
LABELS: tuple[str, ...] = ("induction", "self", "previous-token", "next-token",
                           "first-token/[CLS]", "[SEP]", "punctuation", "broad", "local", "mixed")

# Share statistic -> label, in tie-break order.
_SHARE_LABELS: tuple[tuple[str, str], ...] = (
    ("self", "self"), ("previous", "previous-token"), ("next", "next-token"),
    ("first", "first-token/[CLS]"), ("sep", "[SEP]"), ("punct", "punctuation"))

#: Short forms of the labels, for figure cells.
SHORT_LABELS: dict[str, str] = {
    "induction": "induct", "self": "self", "previous-token": "prev", "next-token": "next",
    "first-token/[CLS]": "first", "[SEP]": "sep", "punctuation": "punct", "broad": "broad",
    "local": "local", "mixed": "mixed"}


def corpus_sums(captures: Iterable[Capture]) -> StatSums:
    """Statistic sums over several captures of one model (weighted by tokens).

    Raises:
        ValueError: no captures, or captures holding different layers or heads.
    """
    total: StatSums | None = None
    for capture in captures:
        sums = stat_sums(capture)
        total = sums if total is None else total + sums
    if total is None:
        raise ValueError("no captures to average over")
    return total


def label_head(stats: dict[str, float], induction: float | None = None) -> str:
    """The pattern label of one head from its statistics (see the module docstring for rules).

    Args:
        stats: the head's statistics (the :data:`STAT_KEYS`).
        induction: the head's induction score, or ``None`` when it was not measured.
    """
    if induction is not None and induction >= INDUCTION_SCORE:
        return "induction"
    best_key, best_label = max(_SHARE_LABELS, key=lambda item: stats[item[0]])
    if stats[best_key] >= DOMINANT_SHARE:
        return best_label
    if stats["entropy"] >= BROAD_ENTROPY:
        return "broad"
    if stats["local"] >= LOCAL_SHARE:
        return "local"
    return "mixed"


def table_from_sums(sums: StatSums, induction: np.ndarray | None = None) -> list[dict[str, object]]:
    """One dict per held (layer, head), sorted by layer then head; see :func:`head_table`.

    Args:
        sums: statistic sums of one capture or a corpus.
        induction: optional ``[layer, head]`` induction scores for the same layers and heads;
            when given, every row also has an ``"induction"`` key.
    """
    means = sums.means()
    if induction is not None:
        induction = np.asarray(induction, dtype=np.float64)
        expected = (len(sums.layers), len(sums.heads))
        if induction.shape != expected:
            from attnviz.errors import UsageError

            raise UsageError(f"the induction scores have shape {induction.shape} but the "
                             f"statistics cover {expected[0]} layers x {expected[1]} heads",
                             "pass scores for exactly these layers and heads, e.g. "
                             "InductionResult.for_capture(capture.layers, capture.heads)")
    rows: list[dict[str, object]] = []
    for li, layer in enumerate(sums.layers):
        for hi, head in enumerate(sums.heads):
            stats = {k: float(means[k][li, hi]) for k in STAT_KEYS}
            score = None if induction is None else float(induction[li, hi])
            row: dict[str, object] = {"layer": layer, "head": head,
                                      "label": label_head(stats, score), **stats}
            if score is not None:
                row["induction"] = score
            rows.append(row)
    return rows


def head_table(capture: Capture, induction: np.ndarray | None = None) -> list[dict[str, object]]:
    """Statistics and a pattern label for every (layer, head) held in a capture.

    Args:
        capture: weights ``[layer, head, query, key]``.
        induction: optional ``[layer, head]`` induction scores (see
            :mod:`attnviz.analysis.induction`) for the capture's layers and heads.

    Returns:
        One dict per held head, sorted by layer then head, with ``"layer"``, ``"head"`` (model
        indices, int), ``"label"`` (str) and the float statistics ``"entropy"`` (normalised
        0..1), ``"entropy_nats"``, ``"distance"``, ``"max_weight"``, ``"self"``, ``"previous"``,
        ``"next"``, ``"first"``, ``"sep"``, ``"punct"`` and ``"local"`` (plus ``"induction"``
        when scores were given).
    """
    return table_from_sums(stat_sums(capture), induction)


def layer_table(rows: Sequence[dict[str, object]]) -> list[dict[str, object]]:
    """Mean of every statistic over the heads of each layer, from :func:`head_table` rows.

    The ``sep`` column of this table is where Clark et al.'s (2019) observation shows: in
    BERT-base, more than half of the attention of layers 6-10 (1-indexed) goes to [SEP].
    """
    layers: dict[int, list[dict[str, object]]] = {}
    for row in rows:
        layers.setdefault(int(row["layer"]), []).append(row)  # type: ignore[call-overload]
    keys = [k for k in (*STAT_KEYS, "induction") if rows and k in rows[0]]
    out: list[dict[str, object]] = []
    for layer, members in sorted(layers.items()):
        entry: dict[str, object] = {"layer": layer, "heads": len(members)}
        for key in keys:
            entry[key] = float(np.mean([float(m[key]) for m in members]))  # type: ignore[arg-type]
        entry["labels"] = {label: sum(1 for m in members if m["label"] == label)
                           for label in LABELS if any(m["label"] == label for m in members)}
        out.append(entry)
    return out
