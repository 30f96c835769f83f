"""Grids of small heatmaps: a layer's heads, or every layer and head of a model (the
overview), under one colour scale."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.collections import LineCollection, PolyCollection  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.image import AxesImage  # noqa: E402
from matplotlib.text import Text  # noqa: E402

from attnviz.render.colours import (  # noqa: E402
    DEFAULT_VMAX,
    ColourScale,
    ResolvedScale,
    check_cmap,
    colour_table,
)
from attnviz.render.layout import (  # noqa: E402
    DEFAULT_DPI,
    GRID_TITLE_PT,
    LABEL_PT,
    PAD_IN,
    GridLayout,
    _fraction,
    grid_layout,
    grid_shape,
    plain_text,
    wrap_text,
)
from attnviz.render.parts import DIVIDER_COLOUR, _colourbar, _scale, _token_ticks  # noqa: E402


@dataclass
class GridArtists:
    """The pieces of a grid figure that change between figures of one shape."""

    fig: Figure
    images: list[AxesImage]  # in the order of the matrices (row-major); none for a frame
    title: Text
    ticks: list[Text]
    scale: ResolvedScale
    layout: GridLayout
    ax: Axes
    extents: list[tuple[float, float, float, float]]  # display (x0, y0, x1, y1) of each panel
    panels: list[list[tuple[float, float]]]  # corners of each panel, in the grid axes' units


def draw_grid_artists(matrices: np.ndarray, row_labels: Sequence[str],
                      col_labels: Sequence[str], *, title: str, cmap: str = "viridis",
                      tokens: Sequence[str] | None = None,
                      key_tokens: Sequence[str] | None = None,
                      scale: ColourScale | str | None = None, gamma: float | None = None,
                      vmax: str | float | None = DEFAULT_VMAX, dpi: float = DEFAULT_DPI,
                      row_divider: int | None = None, col_divider: int | None = None,
                      label: str = "attention weight", with_images: bool = True,
                      masked: np.ndarray | None = None) -> GridArtists:
    """:func:`draw_grid`, returning the artists; ``with_images=False`` draws only the frame
    (the fast renderer paints the panels itself)."""
    data = np.asarray(matrices, dtype=np.float32)
    num_rows, num_cols, num_query, num_key = data.shape
    masks = _row_masks(masked, num_rows, (num_query, num_key))
    colour_scale = _scale(scale, gamma, vmax)
    resolved = colour_scale.resolve(data)
    table = colour_table(check_cmap(cmap))
    key_tokens = tokens if key_tokens is None else key_tokens
    labelled = (tokens is not None and key_tokens is not None and num_rows == 1
                and max(num_query, num_key) <= 16)
    layout = grid_layout(num_rows, num_cols, num_query, num_key, labelled=labelled,
                         row_labels=row_labels, dpi=dpi, title=title)
    grid_rows, grid_cols, flat = grid_shape(num_rows, num_cols)
    with plain_text():
        fig = Figure(figsize=(layout.width, layout.height), dpi=dpi)
        fig.patch.set_facecolor("white")
        ax = fig.add_axes(_fraction(layout.grid, layout.width, layout.height))
        ax.set_xlim(0.0, layout.grid[2])
        ax.set_ylim(layout.grid[3], 0.0)
        for spine in ax.spines.values():
            spine.set_visible(False)
        ax.tick_params(length=0, pad=2)
        ax.set_xticks([])
        ax.set_yticks([])
        images = []
        borders, lines = [], []
        for index, (r, c) in enumerate(flat):
            x0, y0, x1, y1 = layout.panel(index)
            if with_images:
                rgb, _ = resolved.colours(data[r, c], table, masks[r])
                images.append(ax.imshow(rgb, aspect="auto", interpolation="nearest",
                                        extent=(x0, x1, y1, y0)))
            borders.append([(x0, y0), (x1, y0), (x1, y1), (x0, y1)])
            if row_divider is not None and 0 < row_divider < num_query:
                y = y0 + row_divider * layout.cell
                lines.append([(x0, y), (x1, y)])
            if col_divider is not None and 0 < col_divider < num_key:
                x = x0 + col_divider * layout.cell
                lines.append([(x, y0), (x, y1)])
            if num_rows == 1 or r == 0:
                ax.text((x0 + x1) / 2, y0 - 0.05, col_labels[c], ha="center", va="bottom",
                        fontsize=9, parse_math=False)
            if num_rows > 1 and c == 0:
                ax.text(x0 - 0.1, (y0 + y1) / 2, row_labels[r], ha="right", va="center",
                        fontsize=9, parse_math=False)
        # One artist for every border and divider: a grid of 72 heads stays cheap to draw.
        ax.add_collection(PolyCollection(borders, facecolors="none", edgecolors="black",
                                         linewidths=0.6, zorder=4))
        if lines:
            divider = LineCollection(lines, colors=DIVIDER_COLOUR, linewidths=0.8, zorder=3,
                                     capstyle="butt")
            divider.set_gid("pair-divider")
            ax.add_collection(divider)
        if labelled and tokens is not None and key_tokens is not None:
            ys, y_labels, xs, x_labels = [], [], [], []
            for index in range(len(flat)):
                x0, y0, _, _ = layout.panel(index)
                grid_row, grid_col = divmod(index, grid_cols)
                if grid_col == 0:
                    ys += [y0 + (i + 0.5) * layout.cell for i in range(num_query)]
                    y_labels += list(tokens)
                if grid_row == grid_rows - 1 or index + grid_cols >= len(flat):
                    xs += [x0 + (j + 0.5) * layout.cell for j in range(num_key)]
                    x_labels += list(key_tokens)
            _token_ticks(ax, y_labels, 1, LABEL_PT, "y", places=ys)
            _token_ticks(ax, x_labels, 1, LABEL_PT, "x", places=xs)
        text = f"{title}\n{layout.note}" if layout.note else title
        wrapped = wrap_text(text, layout.title_width, GRID_TITLE_PT)
        title_text = fig.suptitle(wrapped, x=0.5, y=1 - PAD_IN / layout.height, ha="center",
                                  va="top", fontsize=GRID_TITLE_PT)
        cax = fig.add_axes(_fraction(layout.colourbar, layout.width, layout.height))
        ticks = _colourbar(fig, cax, resolved, cmap, resolved.label(label))
        extents = []
        for index in range(len(flat)):
            x0, y0, x1, y1 = layout.panel(index)
            (left, top), (right, bottom) = ax.transData.transform([(x0, y0), (x1, y1)])
            extents.append((float(left), float(bottom), float(right), float(top)))
    return GridArtists(fig, images, title_text, ticks, resolved, layout, ax, extents, borders)


def draw_grid(matrices: np.ndarray, row_labels: Sequence[str], col_labels: Sequence[str], *,
              title: str, cmap: str = "viridis", tokens: Sequence[str] | None = None,
              key_tokens: Sequence[str] | None = None,
              scale: ColourScale | str | None = None, gamma: float | None = None,
              vmax: str | float | None = DEFAULT_VMAX, dpi: float = DEFAULT_DPI,
              row_divider: int | None = None, col_divider: int | None = None,
              label: str = "attention weight", masked: np.ndarray | None = None) -> Figure:
    """A grid of small heatmaps: ``matrices`` is ``[rows, cols, query, key]``.

    Used for a layer's heads (one row, wrapped into a near-square grid) and for the model
    overview (layers x heads). With at most 16 ``tokens`` (query labels; ``key_tokens`` for
    the keys), the outer panels carry token labels. All panels share one colour scale (``auto``:
    the largest weight in the grid). ``masked`` (boolean ``[query, key]``, or
    ``[rows, query, key]`` where rows differ): cells a query cannot see, drawn grey as the
    single heatmaps draw them.
    """
    return draw_grid_artists(matrices, row_labels, col_labels, title=title, cmap=cmap,
                             tokens=tokens, key_tokens=key_tokens, scale=scale, gamma=gamma,
                             vmax=vmax, dpi=dpi, row_divider=row_divider,
                             col_divider=col_divider, label=label, masked=masked).fig


def _row_masks(masked: np.ndarray | None, rows: int, shape: tuple[int, int]
               ) -> list[np.ndarray | None]:
    """Each grid row's masked cells (``None``: none)."""
    if masked is None:
        return [None] * rows
    masked = np.asarray(masked, dtype=bool)
    if masked.shape == shape:
        return [masked] * rows
    if masked.shape == (rows, *shape):
        return list(masked)
    raise ValueError(f"masked has shape {masked.shape}, the panels {shape}")
