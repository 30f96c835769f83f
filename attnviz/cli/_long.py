"""What ``heatmap``, ``top-k`` and ``heads`` do with a long capture (``--long``, or taken by
itself for an input too long for every weight at once).

The commands in :mod:`attnviz.cli.core` and :mod:`attnviz.cli.heads` hand a
:class:`~attnviz.long.LongCapture` here; numpy and the figures are imported inside.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from attnviz.errors import UsageError

if TYPE_CHECKING:

    from attnviz.long import LongCapture
    from attnviz.render.heatmap import FigureOptions

#: The most attention sinks ``heads`` lists.
MAX_SINKS = 10
#: The most keys per query ``top-k`` lists from a long capture.
MAX_LONG_K = 100


def is_long(capture: object) -> bool:
    """Whether a session's answer is a long capture (not a :class:`~attnviz.capture.Capture`)."""
    from attnviz.capture import Capture

    return not isinstance(capture, Capture)


def check_view(*, words: bool = False, exclude_special: bool = False) -> None:
    """``--words`` and ``--exclude-special`` re-normalise full rows, which a long capture does
    not hold.

    Raises:
        UsageError: either is given.
    """
    given = [flag for flag, on in (("--words", words), ("--exclude-special", exclude_special))
             if on]
    if given:
        raise UsageError(f"{given[0]} does not apply to a long capture (it shows the model's "
                         "own tokens and weights)",
                         f"leave out {given[0]}, or use --no-long with a shorter input "
                         "(--max-tokens N)")


def _name(cap: LongCapture, what: str) -> Path:
    from attnviz.fileio import short_hash, slugify

    digest = short_hash(cap.text, getattr(cap, "pair", None) or "", cap.model, length=6)
    return Path(f"attention_{slugify(cap.text, 30)}_{digest}_{what}.png")


def _layer(cap: LongCapture, layer: int) -> int:
    from attnviz.long_session import long_layer

    return long_layer(cap, layer)


def _head(cap: LongCapture, head: int | str) -> int | str:
    if head == "mean":
        return "mean"
    from attnviz.selection import resolve_index

    return resolve_index(int(head), cap.num_heads, "head")


# --------------------------------------------------------------------------- heatmap
def heatmap(cap: LongCapture, *, layer: int | None, head: int | str | None,
            figure: FigureOptions, out: Path | None, suffix: str) -> tuple[Path, list[str]]:
    """Draw a long capture as ``attnviz heatmap`` does: a window (``--tokens`` etc.) of one
    head exactly, else the atlas; returns the path and warnings to print."""
    from attnviz.render import atlas
    from attnviz.render.heatmap import save_figure

    check_view(words=figure.words, exclude_special=figure.exclude_special)
    windowed = any((figure.tokens, figure.queries, figure.keys))
    warnings: list[str] = []
    if layer is not None and head is not None:
        index, which = _layer(cap, layer), _head(cap, head)
        label = f"L{index}_mean" if which == "mean" else f"L{index}_H{which}"
        if windowed:
            from attnviz.analysis.tokens import parse_windows

            rows, cols = parse_windows(list(cap.display_tokens), figure.tokens, figure.queries,
                                       figure.keys)
            artists = atlas.tile_head_figure(cap, index, which, (rows.start, rows.stop),
                                             (cols.start, cols.stop), options=figure)
            if figure.annot and artists.layout is not None and artists.layout.dropped_values:
                warnings.append(artists.layout.dropped_values)
            fig = artists.fig
        else:
            fig, block = atlas.atlas_head_figure(cap, index, which, options=figure)
            label += f"_atlas{block}"
    else:
        if windowed:
            raise UsageError("a window (--tokens, --queries, --keys) of a long capture is "
                             "drawn for one head", "add --layer L --head H (or --head mean)")
        if layer is not None:
            index = _layer(cap, layer)
            fig, block = atlas.atlas_grid_figure(cap, index, options=figure)
            label = f"L{index}_heads_atlas{block}"
        else:
            fig, block = atlas.atlas_grid_figure(cap, None, options=figure)
            label = f"overview_atlas{block}"
    path = save_figure(fig, out or _name(cap, label + suffix), dpi=figure.dpi)
    return path, warnings


# --------------------------------------------------------------------------- top-k
def check_k(k: int) -> None:
    """Refuse a ``-k`` past :data:`MAX_LONG_K` (every key of 100k tokens is no table)."""
    if k > MAX_LONG_K:
        raise UsageError(f"-k {k} is more than a long capture lists: at most {MAX_LONG_K} "
                         "keys per query", f"use -k {MAX_LONG_K} or fewer")


def topk_rows(cap: LongCapture, layer: int, head: int | str, k: int
              ) -> tuple[list[dict[str, object]], int, int | str]:
    """Rows as :func:`attnviz.analysis.topk.topk_rows` makes them (``query_index``,
    ``query``, ``top``: ``key_index``, ``key``, ``weight``), from the long capture's exact
    top-k; keys a causal query cannot see are never listed. Returns the rows, the layer and
    the head as resolved."""
    import numpy as np

    index, which = _layer(cap, layer), _head(cap, head)
    k = min(k, cap.num_tokens)
    indices, values = cap.topk(index, which, k)  # -1: a key the query cannot see
    indices, values = np.asarray(indices), np.asarray(values, dtype=np.float32)
    tokens = list(cap.display_tokens)
    rows: list[dict[str, object]] = []
    for query in range(indices.shape[0]):
        top = [{"key_index": int(j), "key": tokens[int(j)], "weight": round(float(w), 6)}
               for j, w in zip(indices[query], values[query])
               if 0 <= int(j) < len(tokens) and not (cap.causal and int(j) > query)]
        rows.append({"query_index": query, "query": tokens[query], "top": top})
    return rows, index, which


def topk_title(cap: LongCapture, layer: int, head: int | str, k: int) -> str:
    named = "mean of all heads" if head == "mean" else f"head {head}"
    notes = ", ".join(["long capture", f"{cap.num_tokens} tokens"]
                      + (["causal"] if cap.causal else []))
    return f"{cap.model}: layer {layer}, {named} ({notes}), top {k}"


# --------------------------------------------------------------------------- heads
def head_table(cap: LongCapture, threshold: float = 0.3) -> dict[str, Any]:
    """Every captured head's statistics (:meth:`LongCapture.head_stats`) and the
    attention-sink metric, as rows for a table."""
    import numpy as np

    stats = {name: np.asarray(values, dtype=np.float64)
             for name, values in cap.head_stats().items()}
    names = list(stats)
    rows = []
    for li, layer in enumerate(cap.layers):
        for head in range(cap.num_heads):
            row: dict[str, Any] = {"layer": int(layer), "head": head}
            row.update({name: float(stats[name][li, head]) for name in names})
            rows.append(row)
    fractions = np.asarray(cap.sinks(threshold), dtype=np.float64)
    order = [int(j) for j in np.argsort(-fractions, kind="stable")[:MAX_SINKS]
             if fractions[j] > 0]
    sinks = [{"index": j, "token": cap.display_tokens[j], "fraction": float(fractions[j])}
             for j in order]
    return {"title": f"{cap.model}: head statistics of a long capture ({cap.num_tokens} "
                     f"tokens{', causal' if cap.causal else ''})",
            "stats": names, "rows": rows, "sinks": sinks, "threshold": threshold}


def format_head_table(table: dict[str, Any], fmt: str) -> str:
    """The table as csv, json or markdown text."""
    names: list[str] = table["stats"]
    if fmt == "json":
        return json.dumps(table, ensure_ascii=False, indent=1) + "\n"
    cells = [[row["layer"], row["head"], *[f"{row[n]:.6f}" for n in names]]
             for row in table["rows"]]
    if fmt == "csv":
        from attnviz.csvtext import csv_text

        return csv_text(["layer", "head", *names], cells)
    lines = [f"**{table['title']}**", "", "| L | H | " + " | ".join(names) + " |",
             "|---|---|" + "---|" * len(names)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in cells]
    return "\n".join(lines) + "\n" + sink_note(table) + "\n"


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
