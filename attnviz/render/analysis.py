"""Figures of the analysis commands: head statistics, rollout, and comparisons.

Every function returns a matplotlib :class:`~matplotlib.figure.Figure`; save it with
:func:`attnviz.render.heatmap.save_figure` (atomic, format from the suffix). Titles are wrapped
to the figure's width, and text is drawn as typed (a ``$`` never starts mathtext).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.colors import Normalize  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.text import Text  # noqa: E402

from attnviz.render.colours import (  # noqa: E402
    ColourScale,
    ResolvedScale,
    check_cmap,
    colour_table,
)
from attnviz.render.head import draw_head  # noqa: E402
from attnviz.render.layout import (  # noqa: E402
    ANNOT_MAX_TOKENS,
    ANNOT_PT,
    AXIS_LABEL_IN,
    AXIS_PT,
    CELL_ANNOT_IN,
    CELL_LABEL_IN,
    COLOURBAR_GAP_IN,
    COLOURBAR_TEXT_IN,
    COLOURBAR_WIDTH_IN,
    DEFAULT_DPI,
    LABEL_IN,
    LABEL_PT,
    MAX_GRID_IN,
    MIN_BAR_IN,
    MIN_PLOT_IN,
    PAD_IN,
    TITLE_LINE_IN,
    TITLE_PT,
    _fraction,
    _ordinal,
    _whole,
    plain_text,
    wrap_text,
)
from attnviz.render.parts import (  # noqa: E402
    _annotate,
    _axis_label,
    _colourbar,
    _divider,
    _scale,
    _token_ticks,
)

DIVERGING_CMAP = "RdBu_r"  # blue = less attention in B, red = more; white = no change
CHANGED_COLOUR = "#d62728"  # labels of positions whose tokens differ between A and B


def _fit_title(fig: Figure, title: str, size: float = 12.0) -> float:
    """Put ``title`` at the top of ``fig``, wrapped to its width; returns its height (inches)."""
    width, height = fig.get_size_inches()
    wrapped = wrap_text(title, width - 2 * PAD_IN, size)
    lines = wrapped.count("\n") + 1
    fig.suptitle(wrapped, x=0.5, y=1 - PAD_IN / height, ha="center", va="top", fontsize=size)
    return PAD_IN + lines * TITLE_LINE_IN * size / TITLE_PT + 0.1


def _tight(fig: Figure, top: float) -> None:
    """Tight layout below a title ``top`` inches tall."""
    height = fig.get_size_inches()[1]
    fig.tight_layout(rect=(0.0, 0.0, 1.0, max(0.5, 1 - top / height)))


def draw_stat_grid(values: np.ndarray, labels: Sequence[Sequence[str]], layers: Sequence[int],
                   heads: Sequence[int], *, stat: str, title: str,
                   cmap: str = "viridis") -> Figure:
    """A layers x heads heatmap of one statistic with each head's label written in its cell.

    Args:
        values: ``[layer, head]`` statistic.
        labels: ``[layer][head]`` short pattern labels.
        layers: model layer of each row; heads: model head of each column.
        stat: the statistic's name (colour bar label).
        title: figure title.
        cmap: matplotlib colour map.
    """
    n_layers, n_heads = values.shape
    with plain_text():
        fig = Figure(figsize=(float(np.clip(2.0 + 0.9 * n_heads, 5.5, 30.0)),
                              float(np.clip(1.6 + 0.6 * n_layers, 3.5, 30.0))),
                     dpi=DEFAULT_DPI)
        ax = fig.add_subplot()
        finite = values[np.isfinite(values)]
        low = float(min(0.0, finite.min())) if finite.size else 0.0
        high = float(finite.max()) if finite.size else 1.0
        if stat not in ("distance", "entropy_nats"):
            high = max(high, 1.0)  # shares and normalised entropy live in 0..1
        norm = Normalize(vmin=low, vmax=high if high > low else low + 1.0)
        image = ax.imshow(values, cmap=check_cmap(cmap), norm=norm, aspect="auto",
                          interpolation="nearest")
        ax.set_xticks(np.arange(n_heads), [str(h) for h in heads])
        ax.set_yticks(np.arange(n_layers), [str(layer) for layer in layers])
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        ax.tick_params(length=0)
        colormap = matplotlib.colormaps[cmap]
        size = 8.0 if n_heads <= 16 else 6.0
        for i in range(n_layers):
            for j in range(n_heads):
                r, g, b, _ = colormap(float(norm(values[i, j])))
                light = (0.299 * r + 0.587 * g + 0.114 * b) < 0.5
                ax.text(j, i, f"{labels[i][j]}\n{values[i, j]:.2f}", ha="center", va="center",
                        fontsize=size, color="white" if light else "black")
        fig.colorbar(image, ax=ax, fraction=0.046, pad=0.02, label=stat)
        _tight(fig, _fit_title(fig, title, TITLE_PT))
    return fig


def draw_matrix(matrix: np.ndarray, rows: Sequence[str], cols: Sequence[str], *, title: str,
                cmap: str = "viridis", label: str = "attention weight",
                annot: bool | None = None, vmax: str | float | None = "auto",
                scale: ColourScale | str | None = "linear", gamma: float | None = None,
                dpi: float = DEFAULT_DPI) -> Figure:
    """One ``[query, key]`` heatmap with token labels, laid out as
    :func:`~attnviz.render.head.draw_head` lays out a head.

    The colour scale defaults to linear up to the matrix maximum (rollout matrices rarely
    reach 1); ``vmax=None`` means the same.
    """
    return draw_head(matrix, rows, cols, title=title, cmap=cmap, annot=annot,
                     vmax="auto" if vmax is None else vmax, scale=scale, gamma=gamma, dpi=dpi,
                     label=label)


def draw_token_bars(values: np.ndarray, tokens: Sequence[str], *, title: str,
                    highlight: int | None = None, label: str = "rolled-out attention") -> Figure:
    """A bar chart of one row: how much each token receives; ``highlight`` marks the query."""
    count = len(values)
    with plain_text():
        fig = Figure(figsize=(float(np.clip(2.5 + 0.2 * count, 6.0, 24.0)), 4.2),
                     dpi=DEFAULT_DPI)
        ax = fig.add_subplot()
        colours = ["#d62728" if i == highlight else "#1f77b4" for i in range(count)]
        ax.bar(np.arange(count), values, color=colours)
        width = fig.get_size_inches()[0] - 1.2
        step = max(1, math.ceil(CELL_LABEL_IN * count / width - 1e-9))
        ticks = np.arange(0, count, step)
        ax.set_xticks(ticks, [tokens[int(i)] for i in ticks], rotation=90, fontsize=LABEL_PT)
        if step > 1:
            ax.set_xlabel(f"every {_ordinal(step)} token labelled", fontsize=AXIS_PT)
        ax.set_ylabel(label)
        ax.set_xlim(-0.6, count - 0.4)
        ax.set_ylim(0.0, max(float(values.max()) * 1.12, 1e-6))
        ax.spines[["top", "right"]].set_visible(False)
        _tight(fig, _fit_title(fig, title, TITLE_PT))
    return fig


# --------------------------------------------------------------------------- comparison
@dataclass
class Panel:
    """One heatmap of a comparison: the matrix, its labels and what to mark."""

    matrix: np.ndarray  # [query, key]
    rows: Sequence[str]
    cols: Sequence[str]
    title: str
    changed_rows: Sequence[int] = ()  # rows / columns whose tokens differ between A and B
    changed_cols: Sequence[int] = ()
    row_divider: int | None = None
    col_divider: int | None = None
    masked: np.ndarray | None = None  # [query, key] cells a query cannot see: grey, no value


def _mark(labels: Sequence[Text], changed: Sequence[int], step: int) -> None:
    """Colour the drawn labels (every ``step``-th position) of positions that changed."""
    marked = set(changed)
    for index, text in zip(range(0, 10**9, step), labels):
        if index in marked:
            text.set_color(CHANGED_COLOUR)
            text.set_fontweight("bold")


BOLD_WIDTH = 1.15  # bold DejaVu Sans is at most this much wider than regular


def draw_comparison(a: np.ndarray | Panel, b: np.ndarray | Panel,
                    tokens_a: Sequence[str] = (), tokens_b: Sequence[str] = (), *,
                    titles: tuple[str, str] = ("A", "B"), title: str,
                    diff: np.ndarray | Panel | None = None, cmap: str = "viridis",
                    annot: bool | None = None, scale: ColourScale | str | None = None,
                    gamma: float | None = None, vmax: str | float | None = "auto",
                    dpi: float = DEFAULT_DPI) -> Figure:
    """A and B side by side on one colour scale, plus ``B - A`` when given.

    Each of ``a``, ``b`` and ``diff`` is a :class:`Panel` (matrix, labels, title, positions to
    mark) or a bare matrix labelled with ``tokens_a`` / ``tokens_b`` (``diff``: ``tokens_a``).
    The difference panel uses a diverging colour map centred at 0 with symmetric limits (the
    largest change), so white is "no change", red "B attends more", blue "B attends less";
    labels of positions whose tokens differ are red.
    """
    panel_a = a if isinstance(a, Panel) else Panel(np.asarray(a), tokens_a, tokens_a, titles[0])
    panel_b = b if isinstance(b, Panel) else Panel(np.asarray(b), tokens_b, tokens_b, titles[1])
    panel_d = diff if isinstance(diff, Panel) or diff is None else Panel(
        np.asarray(diff), tokens_a, tokens_a, "difference B - A")
    panels = [panel_a, panel_b] + ([panel_d] if panel_d is not None else [])
    largest = max(max(p.matrix.shape) for p in panels)
    if annot is None:
        annot = largest <= min(ANNOT_MAX_TOKENS, 16)
    room = (MAX_GRID_IN - 2 * PAD_IN) / len(panels) - LABEL_IN - AXIS_LABEL_IN - 1.4
    if annot and largest * CELL_ANNOT_IN > room:
        annot = False
    cell = CELL_ANNOT_IN if annot else max(CELL_LABEL_IN, MIN_PLOT_IN / largest)
    cell = min(cell, 0.6, room / largest)
    cell = max(math.floor(cell * 100 + 1e-6) / 100, 0.01)
    step = max(1, math.ceil(CELL_LABEL_IN / cell - 1e-9))
    bar_block = COLOURBAR_GAP_IN + COLOURBAR_WIDTH_IN + COLOURBAR_TEXT_IN
    # x positions: [labels][A][labels][B][colour bar][labels][B - A][colour bar]
    left_room = PAD_IN + AXIS_LABEL_IN + LABEL_IN
    lefts, x = [], left_room
    for number, panel in enumerate(panels):
        lefts.append(x)
        x += panel.matrix.shape[1] * cell
        if number == 0:
            x += LABEL_IN + 0.1
        elif number == 1:
            x += bar_block + (LABEL_IN + 0.3 if panel_d is not None else 0.0)
        else:
            x += bar_block
    width = max(x + PAD_IN, 6.0)
    plot_h = max(p.matrix.shape[0] for p in panels) * cell
    panel_title_lines = max(
        wrap_text(p.title, max(p.matrix.shape[1] * cell + LABEL_IN, 1.5), 10.0).count("\n") + 1
        for p in panels)
    title_lines = wrap_text(title, width - 2 * PAD_IN, 12.0).count("\n") + 1
    top = PAD_IN + title_lines * 0.23 + 0.15 + panel_title_lines * 0.2 + 0.1
    bottom = PAD_IN + AXIS_LABEL_IN + LABEL_IN
    bottom += max(0.0, math.ceil((MIN_BAR_IN + PAD_IN - plot_h - bottom) * 100) / 100)
    height = bottom + plot_h + top
    width, height = _whole(width), _whole(height)
    colours = _scale(scale, gamma, vmax).resolve([panel_a.matrix, panel_b.matrix])
    table = colour_table(cmap)
    with plain_text():
        fig = Figure(figsize=(width, height), dpi=dpi)
        fig.patch.set_facecolor("white")
        for number, (panel, left) in enumerate(zip(panels, lefts)):
            num_query, num_key = panel.matrix.shape
            box = (left, bottom + plot_h - num_query * cell, num_key * cell, num_query * cell)
            ax = fig.add_axes(_fraction(box, width, height))
            is_diff = panel is panel_d
            if is_diff:
                limit = float(np.abs(panel.matrix).max()) or 1e-6
                resolved = ResolvedScale("linear", 1.0, 2 * limit, True)
                diverging = colour_table(DIVERGING_CMAP)
                rgb, bins = resolved.colours(np.asarray(panel.matrix) + limit, diverging)
                ax.imshow(rgb, aspect="auto", interpolation="nearest")
            else:
                hidden = panel.masked if panel.masked is not None and np.shape(
                    panel.masked) == np.shape(panel.matrix) else None
                rgb, bins = colours.colours(panel.matrix, table, hidden)
                ax.imshow(rgb, aspect="auto", interpolation="nearest")
            ax.set_xlim(-0.5, num_key - 0.5)
            ax.set_ylim(num_query - 0.5, -0.5)
            _mark(_token_ticks(ax, list(panel.cols), step, LABEL_PT, "x"), panel.changed_cols,
                  step)
            _mark(_token_ticks(ax, list(panel.rows), step, LABEL_PT, "y"), panel.changed_rows,
                  step)
            note = f"; every {_ordinal(step)} token labelled" if step > 1 else ""
            # Changed tokens are drawn bold, ~15% wider: measured so, the axis name clears them.
            _axis_label(ax, "key (attended to)" + note, "x", list(panel.cols)[::step],
                        LABEL_PT * (BOLD_WIDTH if panel.changed_cols else 1.0))
            if number == 0:
                _axis_label(ax, "query (attending)" + note, "y", list(panel.rows)[::step],
                            LABEL_PT * (BOLD_WIDTH if panel.changed_rows else 1.0))
            _divider(ax, panel.row_divider, "y")
            _divider(ax, panel.col_divider, "x")
            panel_width = max(num_key * cell + LABEL_IN, 1.5)
            ax.set_title(wrap_text(panel.title, panel_width, 10.0), fontsize=10.0, pad=4)
            if annot:
                _annotate(ax, np.asarray(panel.matrix), bins,  # B - A: float noise is 0.00
                          diverging if is_diff else table, size=ANNOT_PT,
                          significant=not is_diff, masked=None if is_diff else hidden)
            if number >= 1:  # A and B share the first colour bar, B - A has its own
                bar_h = max(MIN_BAR_IN, min(plot_h, max(MIN_PLOT_IN, 0.6 * plot_h)))
                bar = (left + num_key * cell + COLOURBAR_GAP_IN, bottom + plot_h - bar_h,
                       COLOURBAR_WIDTH_IN, bar_h)
                cax = fig.add_axes(_fraction(bar, width, height))
                if is_diff:
                    _diff_colourbar(fig, cax, limit)
                else:
                    _colourbar(fig, cax, colours, cmap, colours.label("attention weight"))
        _fit_title(fig, title, 12.0)
    return fig


def _diff_colourbar(fig: Figure, cax: Axes, limit: float) -> None:
    """The colour bar of ``B - A``: -limit..limit, centred at 0."""
    resolved = ResolvedScale("linear", 1.0, 2 * limit, True)
    values = [(unit * 2 - 1) * limit for unit in resolved.tick_units()]
    _colourbar(fig, cax, resolved, DIVERGING_CMAP, "B - A\nlimits = largest change",
               labels=["0" if abs(v) < limit * 1e-9 else f"{v:+.2g}" for v in values])
