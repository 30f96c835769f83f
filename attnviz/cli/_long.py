"""What ``heatmap``, ``top-k`` and ``heads`` share about the record they are given, whatever
holds it (:class:`~attnviz.record.AttentionRecord`: every weight in memory, or queries and
keys on disk for a long input).

The commands ask the record; numpy and the figures are imported inside.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from attnviz.errors import UsageError

if TYPE_CHECKING:
    from attnviz.record import AttentionRecord
    from attnviz.render.heatmap import FigureOptions

#: The most keys per query ``top-k`` lists from a record whose weights are computed on demand.
MAX_LONG_K = 100


def check_view(*, words: bool = False, exclude_special: bool = False) -> None:
    """``--words`` and ``--exclude-special`` re-normalise full rows, which the long path
    (``--long``) does not hold.

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


def record_view(record: AttentionRecord, *, words: bool = False,
                exclude_special: bool = False) -> AttentionRecord:
    """The record as a command shows it: ``--words`` merges subwords, ``--exclude-special``
    drops special tokens and renormalises rows; both need every weight at once
    (:meth:`~attnviz.record.AttentionRecord.dense`, refused past its bound)."""
    if not (words or exclude_special):
        return record
    from attnviz.analysis.tokens import token_view

    flag = "--words" if words else "--exclude-special"
    return token_view(record.dense(flag), words=words, exclude_special=exclude_special)


def _name(cap: AttentionRecord, what: str) -> Path:
    from attnviz.fileio import short_hash, slugify

    digest = short_hash(cap.text, cap.pair or "", cap.model, length=6)
    measure = "" if cap.measure == "weights" else f"_{cap.measure}"
    return Path(f"attention_{slugify(cap.text, 30)}_{digest}_{what}{measure}.png")


def _head(cap: AttentionRecord, head: int | str) -> int | str:
    index = cap.head_index(head)
    return "mean" if index is None else index


# --------------------------------------------------------------------------- heatmap
def atlas_heatmap(cap: AttentionRecord, *, layer: int | None, head: int | str | None,
                  figure: FigureOptions, out: Path | None, suffix: str
                  ) -> tuple[Path, list[str]]:
    """Draw a record whose weights are computed on demand as ``attnviz heatmap`` does: a
    window (``--tokens`` etc.) of one head exactly, else the atlas; returns the path and
    warnings to print."""
    from attnviz.render import atlas
    from attnviz.render.heatmap import save_figure

    windowed = any((figure.tokens, figure.queries, figure.keys))
    warnings: list[str] = []
    if layer is not None and head is not None:
        index, which = cap.layer_index(layer), _head(cap, head)
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
            index = cap.layer_index(layer)
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
