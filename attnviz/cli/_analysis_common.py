"""Pieces the commands share: the analysis commands' (``heads``, ``rollout``, ``compare``,
``explain``) checks, and what ``heatmap``, ``top-k`` and ``heads`` ask of the record they are
given, whatever holds it (:class:`~attnviz.record.AttentionRecord`: every weight in memory, or
queries and keys on disk for a long input).

Only typer, rich and the standard library are imported here, so ``--help`` stays fast (numpy
and the figures are imported inside).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from attnviz.cli._common import (  # noqa: F401  (toy options re-exported for the commands)
    CausalOpt,
    DModelOpt,
    NoScaleOpt,
    SeedOpt,
    ToyHeadsOpt,
    ToyLayersOpt,
    stdout,
    warn,
)
from attnviz.errors import UsageError
from attnviz.fileio import check_output

if TYPE_CHECKING:
    from attnviz.record import AttentionRecord
    from attnviz.render.heatmap import FigureOptions


def check_image_path(path: Path | None, option: str) -> None:
    """Refuse an image path that is not a file to write (:func:`attnviz.fileio.check_output`)
    or whose suffix is not .png, .svg or .pdf."""
    check_output(path, option)
    if path is not None and path.suffix.lower() not in (".png", ".svg", ".pdf"):
        raise UsageError(f"cannot tell the image format of {option} {path}",
                         "end the file name in .png, .svg or .pdf")


def check_distinct_outputs(**paths: Path | None) -> None:
    """Refuse two output options naming one file (``-o r.png --bar r.png``): the second
    write would silently replace the first. Keyword names are the options without dashes."""
    import os

    seen: dict[str, str] = {}
    for option, path in paths.items():
        if path is None:
            continue
        key = os.path.normcase(os.path.abspath(path))
        flag = f"--{option.replace('_', '-')}"
        if key in seen:
            raise UsageError(f"{seen[key]} and {flag} both name {path}: one file would replace "
                             "the other", "give each output its own file name")
        seen[key] = flag


def view_suffix(*, words: bool = False, exclude_special: bool = False,
                tokens: str | None = None, queries: str | None = None,
                keys: str | None = None) -> str:
    """The part of a derived file name that says which view a figure shows (``_words``,
    ``_nospecial``, ``_t10-40``): figures of one text with other views never share a name."""
    import re

    from attnviz.fileio import short_hash

    parts = ["words"] if words else []
    if exclude_special:
        parts.append("nospecial")
    for letter, window in (("t", tokens), ("q", queries), ("k", keys)):
        if not window:
            continue
        text = window.strip()
        start, colon, end = text.partition(":")

        def named(part: str, empty: str) -> str:  # -3 -> m3: a sign, not a separator
            part = part.strip()
            return empty if not part else "m" + part[1:] if part.startswith("-") else part

        shown = (f"{named(start, 'start')}-{named(end, 'end')}" if colon
                 else "at" + named(text, ""))
        if not re.fullmatch(r"[A-Za-z0-9-]{1,24}", shown):  # token texts: keep them apart
            shown = "w" + short_hash(text, length=6)
        parts.append(letter + shown.lower())
    return "".join(f"_{part}" for part in parts)


def print_wide(table: Any) -> None:
    """Print a table at its natural width (wider than the console rather than truncated)."""
    from rich.measure import Measurement

    needed = Measurement.get(stdout, stdout.options.update(max_width=4000), table).maximum
    width = stdout.width
    if needed <= width:
        stdout.print(table)
        return
    stdout.width = needed
    try:
        stdout.print(table)
    finally:
        stdout.width = width


# --------------------------------------------------------------------------- records
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


def figure_name(cap: AttentionRecord, what: str) -> Path:
    """The default file name of a figure of ``cap`` (``what``: the view, e.g. ``L2_H3``)."""
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
    from attnviz.cli._common import stderr
    from attnviz.cli._steps import doing, stepping
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
            cap.prepare(progress=progress)
        if layer is not None:
            index = cap.layer_index(layer)
            fig, block = atlas.atlas_grid_figure(cap, index, options=figure)
            label = f"L{index}_heads_atlas{block}"
        else:
            fig, block = atlas.atlas_grid_figure(cap, None, options=figure)
            label = f"overview_atlas{block}"
    with doing(stderr, "drawing the figure"):
        path = save_figure(fig, out or figure_name(cap, label + suffix), dpi=figure.dpi)
    return path, warnings


# --------------------------------------------------------------------------- top-k
def check_k(k: int) -> None:
    """Refuse a ``-k`` past :data:`MAX_LONG_K` (every key of 100k tokens is no table)."""
    if k > MAX_LONG_K:
        raise UsageError(f"-k {k} is more than a long capture lists: at most {MAX_LONG_K} "
                         "keys per query", f"use -k {MAX_LONG_K} or fewer")
