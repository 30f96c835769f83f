"""Figures of a record whose weights are computed on demand (a long capture): exact tiles
and the atlas, from the questions every record answers
(:class:`~attnviz.record.AttentionRecord`).

A window of one head is computed exactly on demand (``cap.tile``) and drawn as ``attnviz
heatmap`` draws any head; a whole head, a layer's heads or every layer and head are drawn from
the atlas (``cap.atlas``: the weights summed and maxed over square blocks of tokens), with the
block size in the title::

    fig = atlas_head_figure(cap, layer=2, head=3)   # "layer 2, head 3, 64-token blocks (max)"
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from attnviz.errors import UsageError

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from attnviz.record import AttentionRecord as LongCapture
    from attnviz.render.head import HeadArtists
    from attnviz.render.heatmap import FigureOptions

#: The most tokens per side of an exactly drawn window (``--tokens A:B``).
MAX_TILE_TOKENS = 4096
#: The most blocks per side of one head's atlas, and of each panel of a grid.
HEAD_BLOCKS = 256
GRID_BLOCKS = 64


#: The smallest block of an atlas.
MIN_BLOCK = 16


def block_size(tokens: int, blocks: int) -> int:
    """The smallest power of two (at least :data:`MIN_BLOCK`) that cuts ``tokens`` into at
    most ``blocks`` blocks per side."""
    needed = max(MIN_BLOCK, math.ceil(tokens / blocks))
    return 1 << (needed - 1).bit_length()


def head_matrix(cap: LongCapture, layer: int, head: int | str, rows: tuple[int, int],
                cols: tuple[int, int]) -> np.ndarray:
    """Exact weights ``[query, key]`` of one head (or the ``"mean"`` of the layer's heads) in
    a window (``rows`` and ``cols``: ``(start, stop)``).

    Raises:
        UsageError: a side of the window is longer than :data:`MAX_TILE_TOKENS`.
    """
    (q0, q1), (k0, k1) = rows, cols
    for what, size in (("query", q1 - q0), ("key", k1 - k0)):
        if size > MAX_TILE_TOKENS:
            raise UsageError(f"the window holds {size} {what} tokens; a long capture draws at "
                             f"most {MAX_TILE_TOKENS} per side exactly",
                             "choose a narrower --tokens (or --queries/--keys) window, or "
                             "leave it out to draw the atlas of the whole input")
    return np.asarray(cap.tile(layer, head, q0, q1, k0, k1), dtype=np.float32)


def atlas_matrix(cap: LongCapture, layer: int, head: int | str, block: int) -> np.ndarray:
    """One head's atlas as drawn: the largest weight of each block; for the ``"mean"`` of the
    layer's heads, the mean weight of each block (from the block sums)."""
    sums, maxes = cap.atlas(layer, head, block)
    if head != "mean":
        return np.asarray(maxes, dtype=np.float32)
    tokens = cap.num_tokens
    sizes = np.minimum(block, tokens - np.arange(0, tokens, block)).astype(np.float64)
    return (np.asarray(sums, dtype=np.float64) / np.outer(sizes, sizes)).astype(np.float32)


def _what(head: int | str) -> str:
    return "mean weight" if head == "mean" else "max"


def block_labels(cap: LongCapture, block: int) -> list[str]:
    """Labels of atlas blocks: the first token's position and text (``128:the``)."""
    tokens = cap.display_tokens
    return [f"{start}:{tokens[start]}" for start in range(0, cap.num_tokens, block)]


def _title(cap: LongCapture, what: str, notes: list[str]) -> str:
    extra = f" ({', '.join(notes)})" if notes else ""
    return f"{cap.title_start}{what}{extra}"  # as every figure: the model's label first


def long_notes(cap: LongCapture) -> list[str]:
    """The notes of every figure of ``cap`` (a sentence pair, causal; as a full capture's
    titles have them), then the number of tokens the atlas covers."""
    from attnviz.analysis.tokens import view_notes

    return [*view_notes(cap), f"{cap.num_tokens} tokens"]


def tile_head_figure(cap: LongCapture, layer: int, head: int | str, rows: tuple[int, int],
                     cols: tuple[int, int], *, options: FigureOptions) -> HeadArtists:
    """One head's (or the mean's) exact weights in a window, drawn as ``attnviz heatmap
    --layer --head`` draws a head of any record: the same labels (continuation pieces
    marked), pair divider and title (``model: layer 2, head 3 (causal, tokens 10:40 of
    16384)``)."""
    from attnviz.analysis.tokens import Window, pair_start, piece_labels, view_notes, window_note
    from attnviz.render.head import draw_head_artists
    from attnviz.render.heatmap import head_title
    from attnviz.render.parts import masked_cells

    matrix = head_matrix(cap, layer, head, rows, cols)
    masked = masked_cells(rows, cols, causal=bool(cap.causal), window=cap.window_of(layer))
    size = cap.num_tokens
    shown_rows, shown_cols = Window(rows[0], rows[1], size), Window(cols[0], cols[1], size)
    labels = piece_labels(cap)
    notes = view_notes(cap)
    note = window_note(shown_rows, shown_cols)
    if note:
        notes.append(note)
    start = pair_start(cap)

    def divider(window: Window) -> int | None:
        if start is None or not window.start < start < window.stop:
            return None
        return start - window.start

    suffix = f" ({', '.join(notes)})" if notes else ""
    return draw_head_artists(matrix, labels[shown_rows.span], labels[shown_cols.span],
                             title=head_title(cap, layer, head, suffix), cmap=options.cmap,
                             annot=options.annot, scale=options.colour_scale(),
                             dpi=options.dpi, row_divider=divider(shown_rows),
                             col_divider=divider(shown_cols),
                             label=cap.measure_label or "attention weight", masked=masked)


def atlas_head_figure(cap: LongCapture, layer: int, head: int | str, *,
                      options: FigureOptions, blocks: int = HEAD_BLOCKS) -> tuple[Any, int]:
    """One head's atlas: the whole input in blocks; returns the figure and the block size."""
    from attnviz.render.head import draw_head_artists
    from attnviz.render.parts import masked_blocks

    block = block_size(cap.num_tokens, blocks)
    labels = block_labels(cap, block)
    # Blocks no query of theirs can see (a causal model's later keys, a window's earlier
    # ones) are drawn grey, as the viewer and exact windows draw masked cells.
    masked = masked_blocks(cap.num_tokens, block, causal=bool(cap.causal),
                           window=cap.window_of(layer))
    named = cap.mean_label if head == "mean" else f"head {head}"
    title = _title(cap, f"layer {layer}, {named}, {block}-token blocks ({_what(head)})",
                   long_notes(cap))
    artists = draw_head_artists(atlas_matrix(cap, layer, head, block), labels, labels,
                                title=title, cmap=options.cmap, annot=False,
                                scale=options.colour_scale(), dpi=options.dpi,
                                label=f"attention weight ({_what(head)} of a block)",
                                masked=masked)
    for label in artists.ax.texts:  # the axis notes name blocks, not tokens
        text = label.get_text()
        if text.startswith(("key (attended to)", "query (attending)")):
            label.set_text(text.replace(" token labelled", " block labelled")
                           .replace(" tokens in ", " blocks in "))
    return artists.fig, block


def atlas_grid_figure(cap: LongCapture, layer: int | None, *, options: FigureOptions,
                      blocks: int = GRID_BLOCKS) -> tuple[Figure, int]:
    """A layer's heads (``layer``) or every captured layer and head (``None``) as atlases;
    returns the figure and the block size."""
    from attnviz.render.grid import draw_grid

    block = block_size(cap.num_tokens, blocks)
    layers = list(cap.layers) if layer is None else [layer]
    matrices = np.stack([np.stack([atlas_matrix(cap, li, h, block)
                                   for h in cap.heads]) for li in layers])
    what = (f"layer {layer}, all heads" if layer is not None else "every layer and head")
    title = _title(cap, f"{what}, {block}-token blocks (max)", long_notes(cap))
    from attnviz.render.parts import masked_blocks

    size = matrices.shape[-2:]
    masks = [masked_blocks(cap.num_tokens, block, causal=bool(cap.causal),
                           window=cap.window_of(li)) for li in layers]
    masked = None if all(m is None for m in masks) else np.stack(
        [np.zeros(size, bool) if m is None else m for m in masks])
    fig = draw_grid(matrices, [f"layer {li}" for li in layers],
                    [f"head {h}" for h in cap.heads], title=title,
                    cmap=options.cmap, scale=options.colour_scale(), dpi=options.dpi,
                    masked=masked)
    return fig, block
