"""What every attention heatmap draws around its images: the colour bar, token labels, axis
labels, a sentence pair's divider and the cell values (one head, grids and the analysis
figures share them)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.text import Text  # noqa: E402

from attnviz.render.colours import ColourScale, ColourTable, ResolvedScale, colour_table  # noqa: E402
from attnviz.render.layout import (  # noqa: E402
    ANNOT_PT,
    AXIS_PT,
    LABEL_GAP_IN,
    LABEL_IN,
    shorten,
    text_width,
    wrap_text,
)

DIVIDER_COLOUR = "white"


def _colourbar(fig: Figure, cax: Axes, scale: ResolvedScale, cmap: str, label: str,
               size: float = 8.0, labels: Sequence[str] | None = None, *,
               attached: bool = False) -> list[Text]:
    """A colour bar drawn as a gradient image in unit space, with its ticks.

    The tick labels are figure texts at fixed places (the fast renderer stamps them), so
    returned in tick order; the label says the scale and the top. ``attached``: the texts
    belong to the colour bar's axes instead (placed relative to it), for a colour bar in the
    user's own figure, whose layout may still move it.
    """
    gradient = colour_table(cmap).rgb[:, None, :]  # [N, 1, 3], bottom to top
    cax.imshow(gradient, aspect="auto", interpolation="nearest", origin="lower",
               extent=(0.0, 1.0, 0.0, 1.0))
    cax.set_xlim(0.0, 1.0)
    cax.set_ylim(0.0, 1.0)
    cax.set_xticks([])
    units = scale.tick_units()
    cax.yaxis.tick_right()
    cax.set_yticks(units, [""] * len(units))
    cax.tick_params(axis="y", length=3, width=0.8, pad=1)
    for spine in cax.spines.values():
        spine.set_linewidth(0.8)
    strings = list(scale.tick_labels() if labels is None else labels)
    if attached:
        return _attached_texts(fig, cax, units, strings, label, size)
    position = cax.get_position()
    fig_w, fig_h = fig.get_size_inches()
    label = wrap_bar_label(label, position.height * fig_h)
    x = position.x1 + 0.07 / fig_w
    texts = []
    for unit, text in zip(units, strings):
        y = position.y0 + unit * position.height
        texts.append(fig.text(x, y, text, ha="left", va="center", fontsize=size,
                              parse_math=False))
    # Room for the widest label an auto top can produce ("0.0068") or the ones given.
    longest = max(text_width(t, size) for t in [*strings, "0.0068"])
    label_x = position.x1 + (0.12 + longest + 0.08) / fig_w
    fig.text(label_x, position.y0 + position.height / 2, label, rotation=90, ha="left",
             va="center", fontsize=8.5, parse_math=False, linespacing=1.3)
    return texts


def wrap_bar_label(label: str, length: float) -> str:
    """A colour bar's label with each line wrapped to the bar's ``length`` (inches), so that
    a short bar's label does not reach past it (unchanged when it fits)."""
    return "\n".join(wrap_text(line, length, 8.5, max_lines=3) for line in label.split("\n"))


def _attached_texts(fig: Figure, cax: Axes, units: Sequence[float], strings: Sequence[str],
                    label: str, size: float) -> list[Text]:
    """The colour bar's tick labels and label as texts of its axes, right of it."""
    from matplotlib.transforms import ScaledTranslation

    def right_of_bar(inches: float) -> Any:
        return cax.transAxes + ScaledTranslation(inches, 0.0, fig.dpi_scale_trans)

    texts = [cax.text(1.0, unit, text, transform=right_of_bar(0.07), ha="left", va="center",
                      fontsize=size, parse_math=False) for unit, text in zip(units, strings)]
    longest = max(text_width(t, size) for t in [*strings, "0.0068"])
    cax.text(1.0, 0.5, label, transform=right_of_bar(0.12 + longest + 0.08), rotation=90,
             ha="left", va="center", fontsize=8.5, parse_math=False, linespacing=1.3)
    return texts


def _offset(ax: Axes, axis: str, points: float) -> Any:
    """Data coordinates along ``axis``, ``points`` outside the axes on the other axis."""
    from matplotlib.transforms import ScaledTranslation, blended_transform_factory

    fig = ax.get_figure()
    assert fig is not None
    if axis == "x":
        base = blended_transform_factory(ax.transData, ax.transAxes)
        return base + ScaledTranslation(0, -points / 72, fig.dpi_scale_trans)
    base = blended_transform_factory(ax.transAxes, ax.transData)
    return base + ScaledTranslation(-points / 72, 0, fig.dpi_scale_trans)


def _token_ticks(ax: Axes, labels: Sequence[str], step: int, size: float, axis: str,
                 room: float = LABEL_IN - LABEL_GAP_IN,
                 places: Sequence[float] | None = None) -> list[Text]:
    """Token labels along one side of a heatmap, every ``step``-th (cell ``i`` is centred on
    ``i``, or on ``places[i]``), shortened to ``room`` inches.

    Plain texts rather than matplotlib ticks: a tick costs several artists, and a long input
    has hundreds of labels.
    """
    positions = list(range(0, len(labels), step))
    transform = _offset(ax, axis, 2.0)
    texts = []
    for i in positions:
        where = float(i) if places is None else float(places[i])
        shown = shorten(labels[i], room, size)
        if axis == "x":
            texts.append(ax.text(where, 0.0, shown, transform=transform, rotation=90,
                                 ha="center", va="top", fontsize=size, parse_math=False))
        else:
            texts.append(ax.text(0.0, where, shown, transform=transform, ha="right",
                                 va="center", fontsize=size, parse_math=False))
    ax.set_xticks([])
    ax.set_yticks([])
    return texts


def _axis_label(ax: Axes, text: str, axis: str, labels: Sequence[str], size: float,
                room: float = LABEL_IN - LABEL_GAP_IN) -> Text:
    """An axis label just outside the widest token label (measured, as shortened to
    ``room`` inches)."""
    widest = max((text_width(shorten(t, room, size), size) for t in labels), default=0.0)
    points = 2.0 + widest * 72 + 4.0
    if axis == "x":
        return ax.text(0.5, 0.0, text, transform=_axes_offset(ax, 0.0, -points), ha="center",
                       va="top", fontsize=AXIS_PT, parse_math=False)
    return ax.text(0.0, 0.5, text, transform=_axes_offset(ax, -points, 0.0), rotation=90,
                   ha="right", va="center", fontsize=AXIS_PT, parse_math=False)


def _axes_offset(ax: Axes, dx_points: float, dy_points: float) -> Any:
    from matplotlib.transforms import ScaledTranslation

    fig = ax.get_figure()
    assert fig is not None
    return ax.transAxes + ScaledTranslation(dx_points / 72, dy_points / 72, fig.dpi_scale_trans)


def _divider(ax: Axes, position: int | None, axis: str, *, start: float = -0.5,
             cell: float = 1.0, span: tuple[float, float] | None = None,
             width: float = 1.5) -> None:
    """A line between a sentence pair's segments, before token ``position`` of the window."""
    if position is None:
        return
    where = start + position * cell
    low, high = span if span is not None else (0.0, 1.0)
    kwargs: dict[str, Any] = {"color": DIVIDER_COLOUR, "linewidth": width, "zorder": 3,
                              "solid_capstyle": "butt"}
    if span is None:
        line = ax.axvline(where, **kwargs) if axis == "x" else ax.axhline(where, **kwargs)
    else:
        xs, ys = ([where, where], [low, high]) if axis == "x" else ([low, high], [where, where])
        (line,) = ax.plot(xs, ys, **kwargs)
    line.set_gid("pair-divider")


def cell_text(value: float, digits: int = 2, significant: bool = True) -> str:
    """A cell's value as written in the figure: ``digits`` decimals (``0.25``), or, for a value
    that would read ``0.00`` without being 0, its first significant digit (``4e-4``): the weights
    of a long input's window are of order 1/tokens, and each keeps what tells it apart.
    ``significant=False`` keeps the decimals (a difference map, whose tiny values are noise)."""
    value = float(value)
    shown = f"{value:.{digits}f}"
    if float(shown) == 0:
        if value == 0 or not np.isfinite(value) or not significant:
            return shown.lstrip("-")  # a tiny negative difference reads "0.00", not "-0.00"
        mantissa, exponent = f"{value:.0e}".split("e")
        return f"{mantissa}e{int(exponent)}"  # "4e-4": as wide as "0.00"
    return shown


def _annotate(ax: Axes, matrix: np.ndarray, bins: np.ndarray, table: ColourTable,
              size: float = ANNOT_PT, digits: int = 2,
              masked: np.ndarray | None = None, significant: bool = True) -> list[Text]:
    """The cell values (none in ``masked`` cells: no weight is there)."""
    texts = []
    for (i, j), value in np.ndenumerate(matrix):
        if masked is not None and masked[i, j]:
            continue
        light = bool(table.light_text[bins[i, j]])
        texts.append(ax.text(j, i, cell_text(value, digits, significant), ha="center",
                             va="center",
                             fontsize=size, color="white" if light else "black",
                             parse_math=False))
    return texts


def masked_cells(rows: tuple[int, int], cols: tuple[int, int], *, causal: bool,
                 window: int | None = None) -> np.ndarray | None:
    """Which cells of a window are masked, boolean ``[query, key]``: a key after its query
    (``causal``) or ``window`` or more positions before it (a sliding window). ``rows`` and
    ``cols`` are the ``(start, stop)`` token positions; ``None`` when nothing is masked."""
    if not causal and not window:
        return None
    i = np.arange(rows[0], rows[1])[:, None]
    j = np.arange(cols[0], cols[1])[None, :]
    masked = np.zeros((rows[1] - rows[0], cols[1] - cols[0]), dtype=bool)
    if causal:
        masked |= j > i
    if window:
        masked |= j <= i - window
    return masked if masked.any() else None


def _scale(scale: ColourScale | str | None, gamma: float | None,
           vmax: str | float | None) -> ColourScale:
    if isinstance(scale, ColourScale):
        return scale
    return ColourScale.of(scale, gamma, vmax)


def masked_blocks(tokens: int, block: int, *, causal: bool,
                  window: int | None = None) -> np.ndarray | None:
    """Which ``block``-token blocks of a ``tokens``-token atlas hold no visible key at all,
    boolean ``[block, block]``: every key of the block lies after every query of its row
    (``causal``), or ``window`` or more positions before it; ``None`` when none is."""
    if not causal and not window:
        return None
    starts = np.arange(0, tokens, block)
    ends = np.minimum(starts + block, tokens) - 1  # the last position of each block
    q_first, q_last = starts[:, None], ends[:, None]
    k_first, k_last = starts[None, :], ends[None, :]
    masked = np.zeros((len(starts), len(starts)), dtype=bool)
    if causal:
        masked |= k_first > q_last
    if window:
        masked |= k_last <= q_first - window
    return masked if masked.any() else None
