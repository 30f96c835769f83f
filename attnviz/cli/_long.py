"""What ``heatmap``, ``top-k`` and ``heads`` do with a long capture (``--long``, or taken by
itself for an input too long for every weight at once).

The commands in :mod:`attnviz.cli.core` and :mod:`attnviz.cli.heads` hand a
:class:`~attnviz.long.LongCapture` here; numpy and the figures are imported inside.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from attnviz.errors import UsageError

if TYPE_CHECKING:

    from attnviz.long import LongCapture
    from attnviz.render.heatmap import FigureOptions

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
    from attnviz.cli._common import stderr
    from attnviz.cli._steps import doing, stepping
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
            named = "the mean of the heads" if which == "mean" else f"head {which}"
            with doing(stderr, f"atlas of layer {index}, {named}"):
                fig, block = atlas.atlas_head_figure(cap, index, which, options=figure)
            label += f"_atlas{block}"
    else:
        if windowed:
            raise UsageError("a window (--tokens, --queries, --keys) of a long capture is "
                             "drawn for one head", "add --layer L --head H (or --head mean)")
        # Every head's atlas from one pass over the scores (held after a summary capture).
        with stepping(stderr, "atlas of every head", "tokens") as progress:
            cap.scan_all(progress)
        if layer is not None:
            index = _layer(cap, layer)
            fig, block = atlas.atlas_grid_figure(cap, index, options=figure)
            label = f"L{index}_heads_atlas{block}"
        else:
            fig, block = atlas.atlas_grid_figure(cap, None, options=figure)
            label = f"overview_atlas{block}"
    with doing(stderr, "drawing the figure"):
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
    """:func:`attnviz.analysis.long.topk_rows` of a layer and head as the user gave them
    (negative counts from the end); returns the rows, the layer and the head as resolved."""
    from attnviz.analysis.long import topk_rows as rows_of
    from attnviz.cli._common import stderr
    from attnviz.cli._steps import stepping

    index, which = _layer(cap, layer), _head(cap, head)
    named = "the mean of the heads" if which == "mean" else f"head {which}"
    with stepping(stderr, f"top-{k} keys, layer {index} {named}", "queries") as progress:
        return rows_of(cap, index, which, k, progress=progress), index, which


def topk_title(cap: LongCapture, layer: int, head: int | str, k: int) -> str:
    named = "mean of all heads" if head == "mean" else f"head {head}"
    notes = ", ".join(["long capture", f"{cap.num_tokens} tokens"]
                      + (["causal"] if cap.causal else []))
    return f"{cap.model_label}: layer {layer}, {named} ({notes}), top {k}"


