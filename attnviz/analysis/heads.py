"""The head table of ``attnviz heads``: rows, per-layer means, sorting, and csv/json/markdown text.

Builds on :mod:`attnviz.analysis.stats` (the statistics and labels) and
:mod:`attnviz.analysis.induction` (the induction test).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from attnviz.analysis.stats import SHORT_LABELS, STAT_KEYS, StatSums, layer_table, table_from_sums
from attnviz.analysis.tokens import view_notes
from attnviz.capture import model_label
from attnviz.errors import UsageError

if TYPE_CHECKING:
    from attnviz.record import AttentionRecord

#: Text formats of :func:`format_head_table`.
TEXT_FORMATS: tuple[str, ...] = ("csv", "json", "markdown")


def measure_induction(load: Callable[[], Any] | None, capture: AttentionRecord,
                      requested: bool | None) -> tuple[np.ndarray | None, dict[str, Any] | None]:
    """Run the induction test when asked, or by default for a live causal model.

    Args:
        load: returns the live model (called only when the test runs); ``None`` for a saved
            capture.
        capture: the capture the scores are for (its layers, heads and ``causal`` flag).
        requested: ``True``/``False`` to force the test on or off, ``None`` for the default.

    Returns:
        ``[layer, head]`` scores for the capture's layers and heads and a description of the
        test (:meth:`~attnviz.analysis.induction.InductionResult.settings`: ``length``,
        ``sequences``, ``seed``, ``prefix_ids``, ``token_ids``...), or ``(None, None)``.

    Raises:
        UsageError: the test was asked for without a live model.
    """
    if requested is False or (requested is None and (load is None or not capture.causal)):
        return None, None
    if load is None:
        raise UsageError("--induction needs a live model, not a saved capture (--from)",
                         "give TEXT or --input with --model instead of --from")
    from attnviz.analysis.induction import induction_scores

    result = induction_scores(load())
    return result.for_capture(capture.layers, capture.heads), result.settings()


def _row_keys(rows: list[dict[str, Any]]) -> list[str]:
    return [k for k in (*STAT_KEYS, "induction") if rows and k in rows[0]]


def sort_head_rows(rows: list[dict[str, Any]], key: str = "layer", ascending: bool = False
                   ) -> list[dict[str, Any]]:
    """Rows of :func:`~attnviz.analysis.stats.table_from_sums` in the order ``--sort`` asks for.

    Args:
        rows: one dict per head.
        key: ``layer`` (layer, then head), ``label`` (alphabetical), or a statistic (largest
            first; ties by layer and head).
        ascending: with a statistic: smallest first.
    """
    if key == "layer":
        return list(rows)
    if key == "label":
        return sorted(rows, key=lambda r: (r["label"], r["layer"], r["head"]))
    if rows and key not in rows[0]:
        raise ValueError(f"the rows have no statistic {key!r}")
    return sorted(rows, key=lambda r: (r[key] if ascending else -r[key], r["layer"], r["head"]))


def format_head_table(rows: list[dict[str, Any]], layer_rows: list[dict[str, Any]],
                      fmt: str, info: dict[str, Any]) -> str:
    """Head statistics as csv, json or markdown text.

    Args:
        rows: one dict per head (:func:`~attnviz.analysis.stats.table_from_sums`).
        layer_rows: per-layer means (:func:`~attnviz.analysis.stats.layer_table`).
        fmt: ``csv``, ``json`` or ``markdown``.
        info: what the table describes; json puts it first, markdown uses ``info["title"]``.
    """
    if fmt not in TEXT_FORMATS:
        raise ValueError(f"unknown format {fmt!r}: use csv, json or markdown")
    keys = _row_keys(rows)
    if fmt == "json":
        return json.dumps({**info, "heads": rows, "layers": layer_rows}, ensure_ascii=False,
                          indent=1) + "\n"
    if fmt == "csv":
        from attnviz.csvtext import csv_text

        measure = info.get("measure")  # a measure's statistics say whose they are
        extra = [] if not measure else ["measure"]
        return csv_text(["layer", "head", "label", *keys, *extra], (
            [row["layer"], row["head"], row["label"], *[f"{row[k]:.6f}" for k in keys],
             *([measure] if measure else [])]
            for row in rows))
    lines = [f"**{info['title']}**", "",
             "| layer | head | label | " + " | ".join(keys) + " |",
             "|---:|---:|---|" + "---:|" * len(keys)]
    for row in rows:
        label = str(row["label"]).replace("|", "\\|")
        lines.append(f"| {row['layer']} | {row['head']} | {label} | "
                     + " | ".join(f"{row[k]:.3f}" for k in keys) + " |")
    lines += ["", "**Per layer (mean over heads)**", "",
              "| layer | " + " | ".join(keys) + " |", "|---:|" + "---:|" * len(keys)]
    for entry in layer_rows:
        lines.append(f"| {entry['layer']} | " + " | ".join(f"{entry[k]:.3f}" for k in keys)
                     + " |")
    return "\n".join(lines) + "\n"


@dataclass
class HeadReport:
    """Everything ``attnviz heads`` shows.

    Attributes:
        rows: one dict per head in display order (see
            :func:`~attnviz.analysis.stats.head_table` for the keys).
        layer_rows: per-layer means and label counts, by layer.
        info: ``title``, ``model``, ``texts``, ``tokens``, ``causal``, ``words``,
            ``exclude_special`` and ``induction_test`` (the test's settings, or ``None``).
        layers: model layer of each entry of the grid's axis 0; ``heads`` likewise for axis 1.
    """

    rows: list[dict[str, Any]]
    layer_rows: list[dict[str, Any]]
    info: dict[str, Any]
    layers: list[int]
    heads: list[int]

    @property
    def title(self) -> str:
        return str(self.info["title"])

    @property
    def keys(self) -> list[str]:
        """The statistics every row has, in display order."""
        return _row_keys(self.rows)

    def format(self, fmt: str) -> str:
        """The table as ``csv``, ``json`` or ``markdown`` text (see :func:`format_head_table`)."""
        return format_head_table(self.rows, self.layer_rows, fmt, self.info)

    def grid(self, stat: str) -> tuple[np.ndarray, list[list[str]]]:
        """One statistic as a ``[layer, head]`` float64 grid, with each head's short label."""
        by_position = {(r["layer"], r["head"]): r for r in self.rows}
        values = np.array([[by_position[(layer, head)][stat] for head in self.heads]
                           for layer in self.layers], dtype=np.float64)
        labels = [[SHORT_LABELS[by_position[(layer, head)]["label"]] for head in self.heads]
                  for layer in self.layers]
        return values, labels


def head_report(sums: StatSums, view: AttentionRecord, induction: np.ndarray | None = None, *,
                induction_info: dict[str, Any] | None = None, sort: str = "layer",
                ascending: bool = False, words: bool = False,
                exclude_special: bool = False) -> HeadReport:
    """Rows, per-layer means and a title for the statistics of one text or a corpus.

    Args:
        sums: statistic sums (:func:`~attnviz.analysis.stats.stat_sums` or a corpus total).
        view: the (last) capture the sums came from, as shown: its notes go in the title.
        induction: optional ``[layer, head]`` induction scores for the same layers and heads.
        induction_info: the induction test's settings, from :func:`measure_induction`.
        sort: row order, see :func:`sort_head_rows`.
        ascending: with a statistic as ``sort``: smallest first.
        words: whether subwords were merged into words (recorded in ``info``).
        exclude_special: whether special tokens were dropped (recorded in ``info``).
    """
    rows: list[dict[str, Any]] = table_from_sums(sums, induction)
    # Per-layer means come from the rows in layer order, whatever the display order.
    layer_rows: list[dict[str, Any]] = layer_table(rows)
    notes = view_notes(view)
    measure = view.measure_label
    if sums.measure != "weights" and not view.rows_sum_to_one:
        notes.append(f"{sums.measure} rows scaled to sum to 1 before the statistics")
    title = (f"{model_label(sums.model)}: " + (f"{measure}, " if measure else "")
             + f"{sums.texts} text{'s' if sums.texts != 1 else ''}, "
             f"{sums.tokens} tokens" + (f" ({', '.join(notes)})" if notes else ""))
    info = {"title": title, "model": sums.model, "texts": sums.texts, "tokens": sums.tokens,
            "causal": sums.causal, "words": words, "exclude_special": exclude_special,
            "induction_test": induction_info}
    if sums.measure != "weights":
        info["measure"] = sums.measure
    return HeadReport(sort_head_rows(rows, sort, ascending), layer_rows, info,
                      list(sums.layers), list(sums.heads))
