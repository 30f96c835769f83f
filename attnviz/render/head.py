"""One head's ``[query, key]`` matrix as a labelled heatmap, with its cell values written in
while they are legible (``attnviz heatmap --layer L --head H``).

Query tokens are rows, key tokens are columns: row ``i`` shows where token ``i`` looks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.image import AxesImage  # noqa: E402
from matplotlib.text import Text  # noqa: E402
from matplotlib.transforms import Bbox  # noqa: E402

from attnviz.render.colours import (  # noqa: E402
    DEFAULT_VMAX,
    ColourScale,
    ResolvedScale,
    check_cmap,
    colour_table,
)
from attnviz.render.layout import (  # noqa: E402
    ANNOT_MAX_TOKENS,
    AXIS_LABEL_IN,
    AXIS_PT,
    CELL_ANNOT_IN,
    CELL_LABEL_IN,
    COLOURBAR_GAP_IN,
    COLOURBAR_WIDTH_IN,
    DEFAULT_DPI,
    LABEL_GAP_IN,
    LABEL_IN,
    LABEL_PT,
    TITLE_LINE_IN,
    TITLE_PT,
    HeadLayout,
    _fraction,
    _ordinal,
    head_layout,
    plain_text,
    shorten,
    text_width,
    title_lines,
    wrap_text,
)
from attnviz.render.parts import (  # noqa: E402
    _annotate,
    _axis_label,
    _colourbar,
    _divider,
    _scale,
    _token_ticks,
    wrap_bar_label,
)


@dataclass
class HeadArtists:
    """The pieces of a one-head figure that change from head to head."""

    fig: Figure
    ax: Axes
    image: AxesImage
    title: Text
    ticks: list[Text]
    cells: list[Text]
    scale: ResolvedScale
    layout: HeadLayout | None
    title_width: float = 0.0
    annot: bool = False


def draw_head_artists(matrix: np.ndarray, rows: Sequence[str], cols: Sequence[str], *,
                      title: str, cmap: str = "viridis", annot: bool | None = None,
                      scale: ColourScale | str | None = None, gamma: float | None = None,
                      vmax: str | float | None = DEFAULT_VMAX, dpi: float = DEFAULT_DPI,
                      row_divider: int | None = None, col_divider: int | None = None,
                      label: str = "attention weight", row_name: str = "query (attending)",
                      col_name: str = "key (attended to)", ax: Axes | None = None,
                      title_lines_hint: int = 0, digits: int = 2,
                      write_values: bool = True,
                      masked: np.ndarray | None = None) -> HeadArtists:
    """:func:`draw_head`, returning the artists (the fast renderer and ``HeadFigure`` use them).

    ``title_lines_hint`` reserves room for a title of that many lines (the frame of several
    titles is laid out for the longest); ``write_values=False`` lays the figure out for cell
    values without writing them (the fast renderer writes its own). ``masked`` (boolean
    ``[query, key]``) cells are keys the query cannot see: drawn grey, without a value.
    """
    matrix = np.asarray(matrix, dtype=np.float32)
    colour_scale = _scale(scale, gamma, vmax)
    resolved = colour_scale.resolve(matrix)
    table = colour_table(check_cmap(cmap))
    if masked is not None:
        masked = np.asarray(masked, dtype=bool)
        if masked.shape != matrix.shape:
            raise ValueError(f"masked has shape {masked.shape}, the matrix {matrix.shape}")
        resolved = colour_scale.resolve(np.where(masked, 0.0, matrix).astype(np.float32))
    rgb, bins = resolved.colours(matrix, table, masked)
    num_query, num_key = matrix.shape
    with plain_text():
        if ax is None:
            probe = head_layout(num_query, num_key, annot=annot, dpi=dpi,
                                row_labels=list(rows), col_labels=list(cols))
            lines = max(title_lines(title, probe.title_width), title_lines_hint)
            layout: HeadLayout | None = head_layout(num_query, num_key, annot=annot, dpi=dpi,
                                                    lines=lines, row_labels=list(rows),
                                                    col_labels=list(cols))
            assert layout is not None
            fig = Figure(figsize=(layout.width, layout.height), dpi=dpi)
            fig.patch.set_facecolor("white")
            ax = fig.add_axes(_fraction(layout.plot, layout.width, layout.height))
            cax = fig.add_axes(_fraction(layout.colourbar, layout.width, layout.height))
            label_size, row_step, col_step = layout.label_size, layout.row_step, layout.col_step
            annotate, row_notes, col_notes = layout.annot, layout.row_notes, layout.col_notes
            title_width = layout.title_width
            row_room = layout.row_label_in - LABEL_GAP_IN
            col_room = layout.col_label_in - LABEL_GAP_IN
        else:
            layout = None
            fig = ax.get_figure()  # type: ignore[assignment]
            assert isinstance(fig, Figure)
            fitted = _fit_into_axes(ax, fig, rows, cols, title, resolved.label(label),
                                    names=(row_name, col_name))
            cax, plot_w, plot_h, bar_label = fitted.cax, fitted.width, fitted.height, \
                fitted.bar_label
            row_name, col_name = fitted.row_name, fitted.col_name
            label_size = LABEL_PT
            row_step, col_step = fitted.row_step, fitted.col_step
            annotate = bool(annot) if annot is not None else (
                max(num_query, num_key) <= ANNOT_MAX_TOKENS
                and min(plot_w / num_key, plot_h / num_query) >= CELL_ANNOT_IN)
            row_notes, col_notes = fitted.row_notes, fitted.col_notes
            title_width = max(plot_w, 1.0)
            row_room = col_room = LABEL_IN - LABEL_GAP_IN
        image = ax.imshow(rgb, aspect="auto", interpolation="nearest")
        _token_ticks(ax, list(cols), col_step, label_size, "x", room=col_room)
        _token_ticks(ax, list(rows), row_step, label_size, "y", room=row_room)
        ax.set_xlim(-0.5, num_key - 0.5)
        ax.set_ylim(num_query - 0.5, -0.5)
        if layout is not None and layout.plot[2] + 2 * COLOURBAR_GAP_IN < text_width(
                "; ".join([col_name, *col_notes]), AXIS_PT):
            col_name = col_name.split(" ")[0]  # a narrow window: "key" clears the colour bar
        _axis_label(ax, "; ".join([col_name, *col_notes]), "x", list(cols)[::col_step],
                    label_size, room=col_room)
        if layout is not None and layout.plot[3] < text_width(row_name, AXIS_PT) + 0.2:
            row_name = row_name.split(" ")[0]  # a flat window: "query" fits, the rest not
        _axis_label(ax, "; ".join([row_name, *row_notes]), "y", list(rows)[::row_step],
                    label_size, room=row_room)
        _divider(ax, row_divider, "y")
        _divider(ax, col_divider, "x")
        cells = (_annotate(ax, matrix, bins, table, digits=digits, masked=masked)
                 if annotate and write_values else [])
        wrapped = wrap_text(title, title_width, TITLE_PT)
        if layout is not None:  # just above the plot: a shorter title leaves room at the top
            plot_top = layout.plot[1] + layout.plot[3]
            title_text = fig.suptitle(wrapped, x=0.5, y=(plot_top + 0.14) / layout.height,
                                      ha="center", va="bottom", fontsize=TITLE_PT)
        else:
            title_text = ax.set_title(wrapped, fontsize=TITLE_PT)
        if layout is not None:
            ticks = _colourbar(fig, cax, resolved, cmap, resolved.label(label))
        else:  # texts of the colour bar's own axes: they follow it if a layout moves it
            ticks = _colourbar(fig, cax, resolved, cmap, bar_label, attached=True)
    return HeadArtists(fig, ax, image, title_text, ticks, cells, resolved, layout, title_width,
                       annotate)


@dataclass
class _Fitted:
    """A heatmap fitted into an axes of the user's figure (sizes in inches)."""

    cax: Axes
    width: float
    height: float
    bar_label: str
    row_step: int  # every how many tokens a label
    col_step: int
    row_name: str  # the axis names, shortened or wrapped to their room
    col_name: str
    row_notes: tuple[str, ...]
    col_notes: tuple[str, ...]


def _steps(size: float, count: int) -> tuple[int, tuple[str, ...]]:
    """Every how many of ``count`` tokens along ``size`` inches a label fits, and the note."""
    step = max(1, math.ceil(CELL_LABEL_IN / max(size / max(count, 1), 1e-6) - 1e-9))
    return step, ((f"every {_ordinal(step)} token labelled",) if step > 1 else ())


def _fit_name(name: str, notes: tuple[str, ...], room: float) -> tuple[str, tuple[str, ...]]:
    """An axis name and notes that fit ``room`` inches: the name's first word ("key" for
    "key (attended to)") when the whole does not fit, then the notes on a second line."""
    if text_width("; ".join([name, *notes]), AXIS_PT) <= room:
        return name, notes
    name = name.split(" ")[0]
    if not notes or text_width("; ".join([name, *notes]), AXIS_PT) <= room:
        return name, notes
    return wrap_text("; ".join([name, *notes]), room, AXIS_PT, max_lines=2), ()


def _fit_into_axes(ax: Axes, fig: Figure, rows: Sequence[str], cols: Sequence[str],
                   title: str, bar_label: str, *, names: tuple[str, str]) -> _Fitted:
    """Fit a heatmap, its labels, colour bar and title into the box of an axes of the user's
    figure, so that nothing reaches into a neighbouring panel (a 1x2 ``subplots`` figure).

    The heatmap keeps to its box less the room its labels, title and colour bar take
    (measured, in inches): an axes locator applies that at every draw, so a layout engine
    (``tight_layout``, constrained layout) that moves or resizes the box moves all of it. The
    colour bar is an inset of the heatmap's axes, as tall as the plot.

    The axis names (``names``: rows', columns') and their "every 2nd token labelled" notes
    are fitted to the room beside the plot: shortened to their first word, then wrapped onto
    a second line, whose room is kept.

    Returns:
        the colour bar axes, the plot's size in inches for the box as it is now, the colour
        bar's label wrapped to its height, and the axis names and label steps.
    """
    fig_w, fig_h = (float(v) for v in fig.get_size_inches())
    box = ax.get_position(original=True)
    width, height = box.width * fig_w, box.height * fig_h
    room = LABEL_IN - LABEL_GAP_IN

    def widest(labels: Sequence[str]) -> float:
        return max((text_width(shorten(t, room, LABEL_PT), LABEL_PT) for t in labels),
                   default=0.0)

    row_name, col_name = names
    line = AXIS_PT * 1.25 / 72  # a second line of an axis name
    ticks = max(text_width(t, 8.0) for t in ("0.0068", "0.25", "1e-3"))
    plot_w, plot_h, top, right, wrapped = width, height, 0.0, 0.0, bar_label
    rows_named: tuple[str, tuple[str, ...]] = (row_name, ())
    cols_named: tuple[str, tuple[str, ...]] = (col_name, ())
    for _ in range(3):  # title lines follow the width, the label's lines the height
        left = AXIS_LABEL_IN + rows_named[0].count("\n") * line + widest(rows) + LABEL_GAP_IN \
            + 0.04
        bottom = AXIS_LABEL_IN + cols_named[0].count("\n") * line + widest(cols) \
            + LABEL_GAP_IN + 0.04
        top = title_lines(title, max(plot_w, 1.0)) * TITLE_LINE_IN + 0.12
        plot_h = max(height - bottom - top, 0.3 * height)
        wrapped = wrap_bar_label(bar_label, plot_h)
        label_w = (wrapped.count("\n") + 1) * 8.5 * 1.3 / 72
        right = COLOURBAR_GAP_IN + COLOURBAR_WIDTH_IN + 0.12 + ticks + 0.08 + label_w + 0.04
        plot_w = max(width - left - right, 0.3 * width)
        # a name centred on the plot may reach into the margins, as far as the nearer one
        cols_named = _fit_name(col_name, _steps(plot_w, len(cols))[1],
                               plot_w + 2 * min(left, right) - 0.1)
        rows_named = _fit_name(row_name, _steps(plot_h, len(rows))[1],
                               plot_h + 2 * min(bottom, top) - 0.1)
    inside = _InsideBox(ax, fig, left, bottom, right, top)
    ax.set_axes_locator(inside)
    cax = ax.inset_axes((1 + COLOURBAR_GAP_IN / plot_w, 0.0, COLOURBAR_WIDTH_IN / plot_w, 1.0))
    cax.set_axes_locator(inside.bar)  # in inches beside the plot, whatever its size
    return _Fitted(cax, plot_w, plot_h, wrapped, _steps(plot_h, len(rows))[0],
                   _steps(plot_w, len(cols))[0], rows_named[0], cols_named[0], rows_named[1],
                   cols_named[1])


class _InsideBox:
    """Axes locator: the axes' own box (as the figure or its layout engine sets it) less
    fixed margins in inches, never less than 30% of the box on either side.

    It answers ``get_subplotspec`` for its axes, as ``tight_layout`` asks the locator of an
    axes that has one.
    """

    def __init__(self, ax: Axes, fig: Figure, left: float, bottom: float, right: float,
                 top: float) -> None:
        self.ax, self.fig, self.margins = ax, fig, (left, bottom, right, top)

    def get_subplotspec(self) -> Any:
        return self.ax.get_subplotspec()

    def __call__(self, ax: Any, renderer: Any) -> Bbox:
        left, bottom, right, top = self.margins
        fig_w, fig_h = (float(v) for v in self.fig.get_size_inches())
        box = ax.get_position(original=True)
        plot_w = max(box.width - (left + right) / fig_w, 0.3 * box.width)
        plot_h = max(box.height - (bottom + top) / fig_h, 0.3 * box.height)
        return Bbox.from_bounds(box.x0 + min(left / fig_w, 0.35 * box.width),
                                box.y0 + min(bottom / fig_h, 0.35 * box.height), plot_w, plot_h)

    def bar(self, cax: Any, renderer: Any) -> Bbox:
        """Locator of the colour bar: :data:`COLOURBAR_GAP_IN` right of the plot, as tall."""
        plot = self(self.ax, renderer)
        fig_w = float(self.fig.get_size_inches()[0])
        return Bbox.from_bounds(plot.x1 + COLOURBAR_GAP_IN / fig_w, plot.y0,
                                COLOURBAR_WIDTH_IN / fig_w, plot.height)


def draw_head(matrix: np.ndarray, rows: Sequence[str], cols: Sequence[str], *, title: str,
              cmap: str = "viridis", annot: bool | None = None,
              vmax: str | float | None = DEFAULT_VMAX, scale: ColourScale | str | None = None,
              gamma: float | None = None, dpi: float = DEFAULT_DPI,
              row_divider: int | None = None, col_divider: int | None = None,
              label: str = "attention weight", ax: Axes | None = None) -> Figure:
    """Figure of one ``[query, key]`` attention matrix with token labels and a colour bar.

    Args:
        matrix: ``[query, key]`` weights.
        rows: query token labels; cols: key token labels.
        title: figure title (model, layer, head); wrapped to fit.
        cmap: matplotlib colour map.
        annot: write values in the cells; ``None`` means "when there are at most 30 tokens"
            (values are never drawn smaller than 8 pt: too many tokens, and they are left out).
        vmax: top of the colour scale: ``"auto"`` (the matrix maximum) or a number (``1``:
            the fixed 0..1 scale, to compare figures).
        scale: ``linear``, ``power`` (default, with ``gamma``) or ``log``; or a
            :class:`ColourScale`, which then also decides ``vmax``.
        gamma: the power scale's exponent (default 0.5).
        dpi: the resolution the figure will be saved at (sizes are chosen for it).
        row_divider, col_divider: draw a line before this row / column (a sentence pair's
            second segment).
        label: what the values are (colour bar label).
        ax: draw into this axes of your own figure instead of a new figure.
    """
    return draw_head_artists(matrix, rows, cols, title=title, cmap=cmap, annot=annot,
                             scale=scale, gamma=gamma, vmax=vmax, dpi=dpi,
                             row_divider=row_divider, col_divider=col_divider, label=label,
                             ax=ax).fig
