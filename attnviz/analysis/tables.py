"""Tables of any attention record (:class:`~attnviz.record.AttentionRecord`): top-k rows,
head statistics and attention sinks, one shape whatever holds the weights.

Pure functions of the record: each asks the record its question (a long capture answers in
streamed passes, a full capture from its array).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from attnviz.analysis.stats import StatSums
    from attnviz.record import AttentionRecord as LongCapture

#: The most attention sinks a table lists.
MAX_SINKS = 10


def topk_rows(cap: LongCapture, layer: int, head: int | str, k: int, *,
              progress: Callable[[int, int], None] | None = None) -> list[dict[str, object]]:
    """Rows as :func:`attnviz.analysis.topk.topk_rows` makes them (``query_index``,
    ``query``, ``top``: ``key_index``, ``key``, ``weight``), from the record's exact top-k,
    labelled with continuation pieces marked (``·ing``); keys a causal query cannot see are
    never listed. ``layer`` is a model layer the record holds, ``head`` an index or
    ``"mean"``; ``progress(rows done, rows)`` follows the pass."""
    import numpy as np

    from attnviz.analysis.tokens import piece_labels

    k = min(k, cap.num_tokens)
    indices, values = cap.topk(layer, head, k, progress=progress)  # -1: a key the query cannot see
    indices, values = np.asarray(indices), np.asarray(values, dtype=np.float32)
    tokens = piece_labels(cap)
    rows: list[dict[str, object]] = []
    for query in range(indices.shape[0]):
        top = [{"key_index": int(j), "key": tokens[int(j)], "weight": round(float(w), 6)}
               for j, w in zip(indices[query], values[query])
               if 0 <= int(j) < len(tokens) and not (cap.causal and int(j) > query)]
        rows.append({"query_index": query, "query": tokens[query], "top": top})
    return rows


def topk_csv_rows(cap: LongCapture, k: int) -> Iterator[list[object]]:
    """Rows of a top-k CSV of every captured layer and head (the columns of
    :data:`attnviz.analysis.topk.TOPK_CSV_COLUMNS`)."""
    import numpy as np

    from attnviz.analysis.tokens import piece_labels

    tokens = piece_labels(cap)  # as every top-k table labels them (continuations: ·ing)
    k = min(k, cap.num_tokens)
    for layer in cap.layers:
        for head in cap.heads:
            indices, values = cap.topk(layer, head, k)
            for query, (keys, weights) in enumerate(zip(np.asarray(indices),
                                                        np.asarray(values))):
                rank = 0
                for j, w in zip(keys, weights):
                    if j < 0:  # a key the query cannot see
                        continue
                    rank += 1
                    yield [layer, head, query, tokens[query], rank, int(j), tokens[int(j)],
                           f"{float(w):.6f}"]


def long_stat_sums(cap: LongCapture) -> StatSums:
    """The head statistics of a record as :class:`~attnviz.analysis.stats.StatSums` (one
    text), so every table and figure of ``attnviz heads`` shows them: the means of
    :meth:`~attnviz.record.AttentionRecord.head_stats`, each counted once."""
    import numpy as np

    from attnviz.analysis.stats import StatSums

    means = {name: np.asarray(values, dtype=np.float64)
             for name, values in cap.head_stats().items()}
    return StatSums(layers=list(cap.layers), heads=list(cap.heads), sums=means,
                    counts={name: np.ones_like(values) for name, values in means.items()},
                    texts=1, tokens=cap.num_tokens, model=cap.model, causal=cap.causal,
                    measure=cap.measure)


def sink_table(cap: LongCapture, threshold: float = 0.3) -> dict[str, Any]:
    """The attention sinks of Gu et al. (2024): the tokens whose mean attention in a head is
    above ``threshold``, with the share of (layer, head) pairs where it is; at most
    :data:`MAX_SINKS`, the largest share first."""
    import numpy as np

    fractions = np.asarray(cap.sinks(threshold), dtype=np.float64)
    order = [int(j) for j in np.argsort(-fractions, kind="stable")[:MAX_SINKS]
             if fractions[j] > 0]
    sinks = [{"index": j, "token": cap.display_tokens[j], "fraction": float(fractions[j])}
             for j in order]
    return {"threshold": threshold, "sinks": sinks}


def sink_note(table: dict[str, Any]) -> str:
    """One line on the attention sinks (Gu et al., 2024): the tokens whose mean attention in
    a head is above the threshold, with the share of heads where it is."""
    sinks = table["sinks"]
    if not sinks:
        return (f"Attention sinks: no token draws a mean weight above {table['threshold']} in "
                "any head")
    listed = ", ".join(f"{s['index']}:{s['token']} ({s['fraction']:.0%} of heads)"
                       for s in sinks)
    return f"Attention sinks (mean weight above {table['threshold']}): {listed}"
