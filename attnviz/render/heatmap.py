"""Matplotlib heatmaps of attention: one head, a layer's heads, the model overview.

Query tokens are rows, key tokens are columns: row ``i`` shows where token ``i`` looks.

Figures are laid out by hand from their content, never by a layout engine, so a layout costs
nothing and every figure of one shape has the same pixels outside its images (which is what
:mod:`attnviz.render.fast` relies on):

* **Sizes from content**: each token gets a cell big enough for an 8-pt label (bigger when the
  cell values are written in), up to a bound on the plot's size; past it the cells shrink and
  only every n-th label is drawn, and the axis label says so. A grid gives each head at least
  one pixel per token at the saved resolution, or its title says it is downsampled.
* **Colour scale**: :class:`ColourScale` (linear, power or log; the top fixed or the shown
  data's maximum). Colours come from one lookup table, :func:`colour_table`, here and in the
  fast renderer alike. The colour bar's ticks sit at fixed places; their labels state the
  values, the top one the maximum.
* **Titles always fit**: they are wrapped (measured, not guessed) to the figure's width.
"""

from __future__ import annotations

import contextlib
import functools
import io
import math
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.collections import LineCollection, PolyCollection  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.font_manager import FontProperties  # noqa: E402
from matplotlib.image import AxesImage  # noqa: E402
from matplotlib.text import Text  # noqa: E402

from attnviz.errors import UsageError  # noqa: E402
from attnviz.fileio import atomic_write  # noqa: E402

ANNOT_MAX_TOKENS = 30  # past this, cell values are not written unless asked for (~1 ms per cell)
DEFAULT_DPI = 100
MIN_DPI, MAX_DPI = 20, 600  # the bounds of --dpi
FORMATS = ("png", "svg", "pdf")

# Colour scales. The default makes a typical head readable: most heads put 0.1-0.4 on their
# strongest key and a few hundredths elsewhere, so a fixed 0..1 linear scale leaves them dark.
SCALES = ("linear", "power", "log")
DEFAULT_SCALE = "power"
DEFAULT_GAMMA = 0.5  # power 0.5: a weight a quarter of the maximum gets half the colour range
DEFAULT_VMAX = "auto"
GAMMA_RANGE = (0.05, 5.0)
VMAX_LIMIT = 1e6
LOG_DECADES = 3  # the log scale shows weights from top / 1000 to top

# Sizes, in inches and points.
LABEL_PT = 8.0  # smallest font for token labels
ANNOT_PT = 8.0  # font of the cell values
TITLE_PT = 11.0
GRID_TITLE_PT = 12.0
AXIS_PT = 10.0
CELL_LABEL_IN = 0.15  # a row or column with an 8-pt label (1.35 lines)
CELL_ANNOT_IN = 0.36  # a cell that holds "0.00" in 8 pt
CELL_MAX_IN = 0.75  # few tokens: cells no bigger than this
MIN_PLOT_IN = 3.0
MAX_PLOT_IN = 22.0  # 146 tokens get every label; past that labels are thinned
MAX_GRID_IN = 40.0  # a grid's width or height
MIN_FIGURE_IN = 5.5  # narrower figures would wrap every title
MIN_BAR_IN = 2.6  # the colour bar's label needs this much height
PAD_IN = 0.12
LABEL_IN = 0.95  # room for tick labels (longer labels are shortened with "...")
AXIS_LABEL_IN = 0.3
TITLE_LINE_IN = 0.21
TITLE_LINES = 2  # lines a head figure reserves for its title (more make it taller)
MAX_TITLE_LINES = 5
COLOURBAR_GAP_IN = 0.15
COLOURBAR_WIDTH_IN = 0.18
COLOURBAR_TEXT_IN = 0.95  # tick labels and the two-line label
DIVIDER_COLOUR = "white"


# --------------------------------------------------------------------------- plain text
@contextlib.contextmanager
def plain_text() -> Iterator[None]:
    """Draw labels as plain text: no mathtext for ``$`` in tokens, no glyph or layout warnings.

    Also makes SVG output reproducible (fixed hash salt for element ids).
    """
    with matplotlib.rc_context({"text.parse_math": False, "svg.hashsalt": "attnviz"}), \
            warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*[Gg]lyph .* missing from")
        warnings.filterwarnings("ignore", message=r".*[Mm]atplotlib currently does not support")
        warnings.filterwarnings("ignore", message=r".*[Tt]ight layout not applied")
        yield


@functools.lru_cache(maxsize=1)
def _renderer() -> Any:
    from matplotlib.backends.backend_agg import RendererAgg

    return RendererAgg(1, 1, 72)


@functools.lru_cache(maxsize=16)
def _font(size: float) -> FontProperties:
    return FontProperties(size=size)


@functools.lru_cache(maxsize=8192)
def text_width(text: str, size: float) -> float:
    """Width in inches of one line of ``text`` drawn at ``size`` points."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*[Gg]lyph .* missing from")
        width, _, _ = _renderer().get_text_width_height_descent(text, _font(size), ismath=False)
    return float(width) / 72.0


def shorten(text: str, width: float, size: float) -> str:
    """``text`` cut with an ellipsis so that it is at most ``width`` inches wide."""
    if text_width(text, size) <= width:
        return text
    low, high = 0, len(text)
    while low < high:  # the longest prefix that fits with the ellipsis
        middle = (low + high + 1) // 2
        if text_width(text[:middle] + "\u2026", size) <= width:
            low = middle
        else:
            high = middle - 1
    return text[:low] + "\u2026"


def wrap_text(text: str, width: float, size: float, max_lines: int = MAX_TITLE_LINES) -> str:
    """Wrap ``text`` at spaces (or anywhere, for a word longer than a line) to ``width`` inches.

    More than ``max_lines`` lines: the last one is shortened with an ellipsis.
    """
    if "\n" not in text and text_width(text, size) <= width:
        return text
    lines: list[str] = []
    for paragraph in text.split("\n"):
        line = ""
        for word in paragraph.split(" "):
            candidate = f"{line} {word}" if line else word
            if text_width(candidate, size) <= width:
                line = candidate
                continue
            if line:
                lines.append(line)
            while len(word) > 1 and text_width(word, size) > width:
                cut = max(1, len(shorten(word, width, size)) - 1)
                lines.append(word[:cut])
                word = word[cut:]
            line = word
        lines.append(line)
    if len(lines) > max_lines:
        lines = lines[:max_lines - 1] + [shorten(" ".join(lines[max_lines - 1:]), width, size)]
    return "\n".join(lines)


def title_lines(text: str, width: float, size: float = TITLE_PT) -> int:
    """How many lines ``text`` takes when wrapped to ``width`` inches."""
    return wrap_text(text, width, size).count("\n") + 1


# --------------------------------------------------------------------------- colours
def check_cmap(name: str) -> str:
    """Validate a matplotlib colour map name."""
    if name not in matplotlib.colormaps:
        close = [c for c in sorted(matplotlib.colormaps) if c.lower().startswith(name[:3].lower())]
        hint = f"try one of: {', '.join(close[:6])}" if close else "try viridis, magma or Blues"
        raise UsageError(f"unknown colour map {name!r}", hint)
    return name


@dataclass(frozen=True)
class ColourTable:
    """A colour map as lookup tables: ``rgb[i]`` bytes and whether text on it should be white."""

    name: str
    rgb: np.ndarray  # [N, 3] uint8, what matplotlib paints for bin i
    light_text: np.ndarray  # [N] bool: luminance < 0.5 -> white text

    @property
    def size(self) -> int:
        return int(self.rgb.shape[0])

    def bins(self, matrix: np.ndarray, vmax: float = 1.0) -> np.ndarray:
        """Bin index of each value, as ``Colormap.__call__`` bins ``value / vmax``.

        Args:
            matrix: any shape, e.g. ``[query, key]``.

        Returns:
            ``intp`` array of the same shape, in ``0..N-1`` (NaN -> 0).
        """
        scaled = np.asarray(matrix, dtype=np.float64) / (vmax or 1.0)
        return self.unit_bins(scaled)

    def unit_bins(self, unit: np.ndarray) -> np.ndarray:
        """Bin index of values already mapped to ``0..1`` (NaN -> 0)."""
        size = self.size
        scaled = np.nan_to_num(np.asarray(unit, dtype=np.float64), nan=0.0)
        return np.clip(scaled * size, 0, size - 1).astype(np.intp)


@functools.lru_cache(maxsize=16)
def colour_table(name: str) -> ColourTable:
    """The lookup tables of a named matplotlib colour map."""
    cmap = matplotlib.colormaps[check_cmap(name)]
    index = np.arange(cmap.N)
    rgb = np.ascontiguousarray(cmap(index, bytes=True)[:, :3], dtype=np.uint8)
    floats = cmap(index)[:, :3]
    luminance = 0.299 * floats[:, 0] + 0.587 * floats[:, 1] + 0.114 * floats[:, 2]
    rgb.setflags(write=False)
    light = luminance < 0.5
    light.setflags(write=False)
    return ColourTable(name, rgb, light)


def parse_vmax(value: str | float | None) -> float | None:
    """``--vmax``: ``auto`` (or ``None``) is the shown data's maximum; else a number > 0."""
    if value is None:
        return None
    if isinstance(value, str):
        if value.strip().lower() in ("auto", ""):
            return None
        try:
            number = float(value)
        except ValueError:
            raise UsageError(f"--vmax {value!r} is not a number",
                             "use auto (the largest weight shown) or a number such as 1 or "
                             "0.5") from None
    else:
        number = float(value)
    if not math.isfinite(number) or not 0 < number <= VMAX_LIMIT:
        raise UsageError(f"--vmax {value} is out of range",
                         f"use auto or a number above 0 and at most {VMAX_LIMIT:g}; "
                         "--vmax 1 keeps the fixed 0..1 scale")
    return number


@dataclass(frozen=True)
class ColourScale:
    """How weights map to colours.

    Attributes:
        kind: ``linear``, ``power`` (``(w / top) ** gamma``) or ``log`` (three decades below
            the top).
        gamma: the exponent of the power scale (0.5 lifts small weights; 1 is linear).
        vmax: the weight drawn in the top colour; ``None`` (``auto``): the largest weight shown.
    """

    kind: str = DEFAULT_SCALE
    gamma: float = DEFAULT_GAMMA
    vmax: float | None = None

    @classmethod
    def of(cls, scale: str | None = None, gamma: float | None = None,
           vmax: str | float | None = DEFAULT_VMAX) -> ColourScale:
        """A checked scale from option values (``None`` for the defaults)."""
        if gamma is not None and (scale or DEFAULT_SCALE) != "power" \
                and (scale or DEFAULT_SCALE) in SCALES:
            raise UsageError(f"--gamma only applies to --scale power, not --scale {scale}",
                             "drop --gamma, or use --scale power")
        made = cls(scale or DEFAULT_SCALE, DEFAULT_GAMMA if gamma is None else float(gamma),
                   parse_vmax(vmax))
        made.check()
        return made

    def check(self) -> None:
        """Raise :class:`UsageError` for an unknown scale or a gamma out of range."""
        if self.kind not in SCALES:
            raise UsageError(f"unknown colour scale {self.kind!r}",
                             f"use one of {', '.join(SCALES)}")
        low, high = GAMMA_RANGE
        if not (math.isfinite(self.gamma) and low <= self.gamma <= high):
            raise UsageError(f"--gamma {self.gamma:g} is out of range",
                             f"use {low:g} to {high:g} (0.5 lifts small weights; 1 is linear)")
        if self.vmax is not None:
            parse_vmax(self.vmax)

    def resolve(self, data: np.ndarray | Sequence[np.ndarray]) -> ResolvedScale:
        """The scale for this data: an ``auto`` top becomes the data's largest finite value."""
        top = self.vmax
        if top is None:
            arrays = [data] if isinstance(data, np.ndarray) else list(data)
            finite = [float(np.nanmax(a)) for a in arrays if np.size(a)]
            top = max([v for v in finite if math.isfinite(v)], default=0.0)
            if top <= 0:
                top = 1.0
        return ResolvedScale(self.kind, self.gamma, float(top), self.vmax is None)


def _format_value(value: float) -> str:
    if value == 0:
        return "0"
    if abs(value) >= 0.1:
        return f"{value:.2f}"
    return f"{value:.2g}"


@dataclass(frozen=True)
class ResolvedScale:
    """A colour scale with its top known: maps weights to ``0..1``."""

    kind: str
    gamma: float
    top: float
    auto: bool

    @property
    def floor(self) -> float:
        """The lowest weight the log scale tells apart (``top / 1000``)."""
        return self.top / 10.0 ** LOG_DECADES

    def unit(self, values: np.ndarray) -> np.ndarray:
        """Weights -> ``0..1`` (float64), computed as matplotlib's norms compute them."""
        data = np.asarray(values, dtype=np.float64)
        if self.kind == "linear":
            return data / self.top
        if self.kind == "power":
            positive = np.where(data > 0, data, 0.0)
            return np.power(positive, self.gamma) / self.top ** self.gamma
        low, high = math.log10(self.floor), math.log10(self.top)
        with np.errstate(divide="ignore", invalid="ignore"):
            logs = np.log10(np.clip(data, self.floor, self.top))
        return (logs - low) / (high - low)

    def tick_units(self) -> list[float]:
        """Where the colour bar's ticks sit, in ``0..1`` (the same for every top)."""
        if self.kind == "log":
            return [i / LOG_DECADES for i in range(LOG_DECADES + 1)]
        return [0.0, 0.5, 1.0]

    def tick_values(self) -> list[float]:
        """The weight at each tick."""
        units = self.tick_units()
        if self.kind == "linear":
            return [u * self.top for u in units]
        if self.kind == "power":
            return [self.top * u ** (1.0 / self.gamma) for u in units]
        return [self.floor * 10.0 ** (u * LOG_DECADES) for u in units]

    def tick_labels(self) -> list[str]:
        """The tick labels; the top one is the maximum, the log scale's bottom one ``<=``."""
        labels = [_format_value(v) for v in self.tick_values()]
        if self.kind == "log":
            labels[0] = "\u2264" + labels[0]
        return labels

    @property
    def name(self) -> str:
        if self.kind == "power":
            return "sqrt scale" if self.gamma == 0.5 else f"power {self.gamma:g} scale"
        return f"{self.kind} scale"

    def label(self, what: str = "attention weight") -> str:
        """The colour bar's label: what is shown, the scale, and what the top is."""
        top = "top = max shown" if self.auto else f"top = {_format_value(self.top)} (fixed)"
        return f"{what}\n{self.name}, {top}"

    def colours(self, matrix: np.ndarray, table: ColourTable) -> tuple[np.ndarray, np.ndarray]:
        """``(rgb, bins)`` of a ``[query, key]`` matrix: uint8 ``[query, key, 3]`` and bins."""
        bins = table.unit_bins(self.unit(matrix))
        return table.rgb[bins], bins


# --------------------------------------------------------------------------- head layout
@dataclass(frozen=True)
class HeadLayout:
    """Where everything of a one-head figure goes, in inches from the bottom left.

    Attributes:
        width, height: the figure.
        plot: ``(left, bottom, width, height)`` of the heatmap; ``colourbar`` likewise.
        label_size: font size of the token labels.
        row_step, col_step: every n-th query / key is labelled.
        annot: whether the cell values are written.
        row_notes, col_notes: what the axis labels add (thinned labels, downsampling).
        title_width: the width titles are wrapped to.
        dropped_values: why cell values asked for were left out, or ``""``.
    """

    width: float
    height: float
    plot: tuple[float, float, float, float]
    colourbar: tuple[float, float, float, float]
    label_size: float
    row_step: int
    col_step: int
    annot: bool
    row_notes: tuple[str, ...]
    col_notes: tuple[str, ...]
    title_width: float
    title_lines: int
    dropped_values: str = ""


def _whole(inches: float) -> float:
    """A figure side rounded up to 0.02 in (whole pixels at 50, 100, 150, 300 dpi), a hair over
    so that matplotlib's truncation to pixels lands on the intended count."""
    return math.ceil(inches / 0.02 - 1e-6) * 0.02 + 1e-7


def _cell(count: int, minimum: float) -> float:
    """Cell size (inches) along an axis of ``count`` tokens, at least ``minimum`` if it fits."""
    cell = min(max(minimum, MIN_PLOT_IN / count), max(CELL_MAX_IN, minimum))
    return min(cell, MAX_PLOT_IN / count)


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _axis_notes(count: int, cell: float, step: int, dpi: float) -> tuple[str, ...]:
    notes = []
    if step > 1:
        notes.append(f"every {_ordinal(step)} token labelled")
    pixels = int(cell * count * dpi)
    if pixels < count:
        notes.append(f"downsampled: {count} tokens in {pixels} px")
    return tuple(notes)


def head_layout(num_query: int, num_key: int | None = None, *, annot: bool | None = None,
                dpi: float = DEFAULT_DPI, lines: int = TITLE_LINES) -> HeadLayout:
    """The layout of a one-head figure of ``num_query`` x ``num_key`` tokens.

    Args:
        num_query, num_key: the matrix's shape (``num_key`` defaults to ``num_query``).
        annot: write the cell values; ``None``: when there are at most 30 tokens. Values are
            left out when an 8-pt value would not fit the cells within the size bound.
        dpi: the saved resolution (decides whether the image must be downsampled).
        lines: lines of the (wrapped) title; at least :data:`TITLE_LINES` are reserved.
    """
    num_key = num_query if num_key is None else num_key
    largest = max(num_query, num_key, 1)
    dropped = ""
    if annot is None:
        annot = largest <= ANNOT_MAX_TOKENS
    if annot and largest * CELL_ANNOT_IN > MAX_PLOT_IN:
        annot = False
        most = int(MAX_PLOT_IN / CELL_ANNOT_IN)
        dropped = (f"cell values left out: they are legible up to {most} tokens "
                   f"({largest} shown); zoom in with --tokens A:B")
    minimum = CELL_ANNOT_IN if annot else CELL_LABEL_IN
    cell_x, cell_y = _cell(max(num_key, 1), minimum), _cell(max(num_query, 1), minimum)
    if annot:  # values need square-ish cells of the same size
        cell_x = cell_y = max(min(cell_x, cell_y), CELL_ANNOT_IN)
    # Whole hundredths of an inch: cell edges fall on pixel edges at 100 dpi (and 50, 200...).
    cell_x, cell_y = (max(math.floor(c * 100 + 1e-6) / 100, 0.01) for c in (cell_x, cell_y))
    label_size = 9.0 if min(cell_x, cell_y) >= 0.2 else LABEL_PT
    need = CELL_LABEL_IN * label_size / LABEL_PT
    row_step = max(1, math.ceil(need / cell_y - 1e-9))
    col_step = max(1, math.ceil(need / cell_x - 1e-9))
    plot_w, plot_h = cell_x * num_key, cell_y * num_query
    left = PAD_IN + AXIS_LABEL_IN + LABEL_IN
    bottom = PAD_IN + AXIS_LABEL_IN + LABEL_IN
    right = COLOURBAR_GAP_IN + COLOURBAR_WIDTH_IN + COLOURBAR_TEXT_IN + PAD_IN
    width = left + plot_w + right
    if width < MIN_FIGURE_IN:  # centre the plot and colour bar in the wider figure
        left += math.floor((MIN_FIGURE_IN - width) * 50) / 100
        width = MIN_FIGURE_IN
    lines = max(lines, TITLE_LINES)
    top = PAD_IN + lines * TITLE_LINE_IN + 0.12
    bar_h = max(MIN_BAR_IN, min(plot_h, max(MIN_PLOT_IN, plot_h * 0.6)))
    # A flat window (a few queries): the colour bar reaches below the plot; make room for it.
    bottom += max(0.0, math.ceil((bar_h + PAD_IN - plot_h - bottom) * 100) / 100)
    height = bottom + plot_h + top
    bar = (left + plot_w + COLOURBAR_GAP_IN, bottom + plot_h - bar_h, COLOURBAR_WIDTH_IN, bar_h)
    return HeadLayout(
        width=_whole(width), height=_whole(height),
        plot=(left, bottom, plot_w, plot_h), colourbar=bar, label_size=label_size,
        row_step=row_step, col_step=col_step, annot=annot,
        row_notes=_axis_notes(num_query, cell_y, row_step, dpi),
        col_notes=_axis_notes(num_key, cell_x, col_step, dpi),
        title_width=width - 2 * PAD_IN, title_lines=lines, dropped_values=dropped)


def head_figure_size(num_query: int, num_key: int | None = None, *, annot: bool | None = None,
                     dpi: float = DEFAULT_DPI) -> tuple[float, float]:
    """Figure size in inches of a one-head heatmap (a title of up to two lines)."""
    layout = head_layout(num_query, num_key, annot=annot, dpi=dpi)
    return layout.width, layout.height


# --------------------------------------------------------------------------- drawing pieces
def _fraction(box: tuple[float, float, float, float], width: float,
              height: float) -> tuple[float, float, float, float]:
    left, bottom, w, h = box
    return left / width, bottom / height, w / width, h / height


def _colourbar(fig: Figure, cax: Axes, scale: ResolvedScale, cmap: str, label: str,
               size: float = 8.0, labels: Sequence[str] | None = None) -> list[Text]:
    """A colour bar drawn as a gradient image in unit space, with its ticks.

    The tick labels are figure texts at fixed places (the fast renderer stamps them), so
    returned in tick order; the label says the scale and the top.
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
    position = cax.get_position()
    fig_w, fig_h = fig.get_size_inches()
    x = position.x1 + 0.07 / fig_w
    texts = []
    strings = list(scale.tick_labels() if labels is None else labels)
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
                 room: float = LABEL_IN - 0.08,
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


def _axis_label(ax: Axes, text: str, axis: str, labels: Sequence[str], size: float) -> Text:
    """An axis label just outside the widest token label (measured)."""
    widest = max((text_width(shorten(t, LABEL_IN - 0.08, size), size) for t in labels),
                 default=0.0)
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


def _annotate(ax: Axes, matrix: np.ndarray, bins: np.ndarray, table: ColourTable,
              size: float = ANNOT_PT, digits: int = 2) -> list[Text]:
    texts = []
    for (i, j), value in np.ndenumerate(matrix):
        light = bool(table.light_text[bins[i, j]])
        shown = f"{value:.{digits}f}"
        if shown.startswith("-") and float(shown) == 0:
            shown = shown[1:]  # a tiny negative difference reads "0.00", not "-0.00"
        texts.append(ax.text(j, i, shown, ha="center", va="center",
                             fontsize=size, color="white" if light else "black",
                             parse_math=False))
    return texts


def _scale(scale: ColourScale | str | None, gamma: float | None,
           vmax: str | float | None) -> ColourScale:
    if isinstance(scale, ColourScale):
        return scale
    return ColourScale.of(scale, gamma, vmax)


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
                      write_values: bool = True) -> HeadArtists:
    """:func:`draw_head`, returning the artists (the fast renderer and ``HeadFigure`` use them).

    ``title_lines_hint`` reserves room for a title of that many lines (the frame of several
    titles is laid out for the longest); ``write_values=False`` lays the figure out for cell
    values without writing them (the fast renderer writes its own).
    """
    matrix = np.asarray(matrix, dtype=np.float32)
    colour_scale = _scale(scale, gamma, vmax)
    resolved = colour_scale.resolve(matrix)
    table = colour_table(check_cmap(cmap))
    rgb, bins = resolved.colours(matrix, table)
    num_query, num_key = matrix.shape
    with plain_text():
        if ax is None:
            probe = head_layout(num_query, num_key, annot=annot, dpi=dpi)
            lines = max(title_lines(title, probe.title_width), title_lines_hint)
            layout: HeadLayout | None = head_layout(num_query, num_key, annot=annot, dpi=dpi,
                                                    lines=lines)
            assert layout is not None
            fig = Figure(figsize=(layout.width, layout.height), dpi=dpi)
            fig.patch.set_facecolor("white")
            ax = fig.add_axes(_fraction(layout.plot, layout.width, layout.height))
            cax = fig.add_axes(_fraction(layout.colourbar, layout.width, layout.height))
            label_size, row_step, col_step = layout.label_size, layout.row_step, layout.col_step
            annotate, row_notes, col_notes = layout.annot, layout.row_notes, layout.col_notes
            title_width = layout.title_width
        else:
            layout = None
            fig = ax.get_figure()  # type: ignore[assignment]
            assert isinstance(fig, Figure)
            from mpl_toolkits.axes_grid1 import make_axes_locatable

            cax = make_axes_locatable(ax).append_axes("right", size="4%", pad=0.08)
            box = ax.get_position()
            plot_w, plot_h = box.width * fig.get_size_inches()[0], box.height * \
                fig.get_size_inches()[1]
            label_size = LABEL_PT
            row_step = max(1, math.ceil(CELL_LABEL_IN / max(plot_h / num_query, 1e-6) - 1e-9))
            col_step = max(1, math.ceil(CELL_LABEL_IN / max(plot_w / num_key, 1e-6) - 1e-9))
            annotate = bool(annot) if annot is not None else (
                max(num_query, num_key) <= ANNOT_MAX_TOKENS
                and min(plot_w / num_key, plot_h / num_query) >= CELL_ANNOT_IN)
            row_notes = (f"every {_ordinal(row_step)} token labelled",) if row_step > 1 else ()
            col_notes = (f"every {_ordinal(col_step)} token labelled",) if col_step > 1 else ()
            title_width = max(box.width * fig.get_size_inches()[0], 1.0)
        image = ax.imshow(rgb, aspect="auto", interpolation="nearest")
        _token_ticks(ax, list(cols), col_step, label_size, "x")
        _token_ticks(ax, list(rows), row_step, label_size, "y")
        ax.set_xlim(-0.5, num_key - 0.5)
        ax.set_ylim(num_query - 0.5, -0.5)
        if layout is not None and layout.plot[2] + 2 * COLOURBAR_GAP_IN < text_width(
                "; ".join([col_name, *col_notes]), AXIS_PT):
            col_name = col_name.split(" ")[0]  # a narrow window: "key" clears the colour bar
        _axis_label(ax, "; ".join([col_name, *col_notes]), "x", list(cols)[::col_step],
                    label_size)
        if layout is not None and layout.plot[3] < text_width(row_name, AXIS_PT) + 0.2:
            row_name = row_name.split(" ")[0]  # a flat window: "query" fits, the rest not
        _axis_label(ax, "; ".join([row_name, *row_notes]), "y", list(rows)[::row_step],
                    label_size)
        _divider(ax, row_divider, "y")
        _divider(ax, col_divider, "x")
        cells = (_annotate(ax, matrix, bins, table, digits=digits)
                 if annotate and write_values else [])
        wrapped = wrap_text(title, title_width, TITLE_PT)
        if layout is not None:  # just above the plot: a shorter title leaves room at the top
            plot_top = layout.plot[1] + layout.plot[3]
            title_text = fig.suptitle(wrapped, x=0.5, y=(plot_top + 0.14) / layout.height,
                                      ha="center", va="bottom", fontsize=TITLE_PT)
        else:
            title_text = ax.set_title(wrapped, fontsize=TITLE_PT)
        ticks = _colourbar(fig, cax, resolved, cmap, resolved.label(label))
    return HeadArtists(fig, ax, image, title_text, ticks, cells, resolved, layout, title_width,
                       annotate)


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


# --------------------------------------------------------------------------- grids
@dataclass(frozen=True)
class GridLayout:
    """Where the panels of a grid figure go (inches; panels from the top left)."""

    width: float
    height: float
    grid: tuple[float, float, float, float]  # left, bottom, width, height of the panel area
    colourbar: tuple[float, float, float, float]
    grid_rows: int
    grid_cols: int
    panel_w: float
    panel_h: float
    gap_x: float
    gap_y: float
    cell: float
    labelled: bool
    note: str
    title_width: float
    title_lines: int

    def panel(self, index: int) -> tuple[float, float, float, float]:
        """``(x0, y0, x1, y1)`` of panel ``index`` in the grid axes' data units (inches, y down)."""
        row, col = divmod(index, self.grid_cols)
        x0 = col * (self.panel_w + self.gap_x)
        y0 = row * (self.panel_h + self.gap_y) + self.gap_y
        return x0, y0, x0 + self.panel_w, y0 + self.panel_h


def grid_shape(num_rows: int, num_cols: int) -> tuple[int, int, list[tuple[int, int]]]:
    """``(grid rows, grid cols, [(row, col) of each panel])``: one layer's heads wrap into a
    near-square grid; several layers make a layers x heads grid."""
    if num_rows == 1 and num_cols > 4:
        wrap = int(np.ceil(np.sqrt(num_cols)))
        return int(np.ceil(num_cols / wrap)), wrap, [(0, h) for h in range(num_cols)]
    return num_rows, num_cols, [(r, c) for r in range(num_rows) for c in range(num_cols)]


def grid_layout(num_rows: int, num_cols: int, num_query: int, num_key: int | None = None, *,
                labelled: bool = False, row_labels: Sequence[str] = (),
                dpi: float = DEFAULT_DPI, title: str = "") -> GridLayout:
    """The layout of a grid of ``num_rows`` x ``num_cols`` panels of ``num_query`` x
    ``num_key`` tokens: each panel gets at least one pixel per token at ``dpi`` when the
    figure stays within :data:`MAX_GRID_IN`, else the note says it is downsampled."""
    num_key = num_query if num_key is None else num_key
    grid_rows, grid_cols, _ = grid_shape(num_rows, num_cols)
    largest = max(num_query, num_key, 1)
    one_layer = num_rows == 1
    base = max(2.4, largest * CELL_LABEL_IN) if labelled else (2.0 if one_layer else 1.6)
    cell = max(base / largest, 1.0 / dpi)
    gap_x = 0.15 if one_layer else 0.08
    gap_y = 0.3 if one_layer else 0.08
    side = LABEL_IN if labelled else 0.0
    left = PAD_IN + side + (0.0 if one_layer else
                            max((text_width(t, 9.0) for t in row_labels), default=0.5) + 0.12)
    bottom = PAD_IN + side
    right = COLOURBAR_GAP_IN + COLOURBAR_WIDTH_IN + COLOURBAR_TEXT_IN + PAD_IN
    head_room = 0.0 if one_layer else 0.25  # head labels above the first row
    top_fixed = PAD_IN + 0.12 + head_room
    room_w = MAX_GRID_IN - left - right - gap_x * (grid_cols - 1)
    room_h = MAX_GRID_IN - bottom - top_fixed - 3 * TITLE_LINE_IN - gap_y * grid_rows
    fit = min(room_w / (grid_cols * num_key), room_h / (grid_rows * num_query))
    note = ""
    if cell > fit:
        cell = fit
        pixels = int(cell * largest * dpi)
        if pixels < largest:
            note = f"downsampled: {largest} tokens in {pixels} px per head"
    panel_w, panel_h = cell * num_key, cell * num_query
    grid_w = grid_cols * panel_w + (grid_cols - 1) * gap_x
    grid_h = grid_rows * (panel_h + gap_y)
    width = left + grid_w + right
    if width < MIN_FIGURE_IN:
        left += (MIN_FIGURE_IN - width) / 2
        width = MIN_FIGURE_IN
    text = f"{title}\n{note}" if note else title
    lines = title_lines(text, width - 2 * PAD_IN, GRID_TITLE_PT) if text else 1
    top = top_fixed + lines * TITLE_LINE_IN * GRID_TITLE_PT / TITLE_PT
    bar_h = max(MIN_BAR_IN, min(grid_h - gap_y, max(MIN_PLOT_IN, 0.5 * grid_h)))
    bottom += max(0.0, math.ceil((bar_h + PAD_IN - grid_h + gap_y - bottom) * 100) / 100)
    height = bottom + grid_h + top
    bar_top = bottom + grid_h - gap_y
    bar = (left + grid_w + COLOURBAR_GAP_IN, bar_top - bar_h, COLOURBAR_WIDTH_IN, bar_h)
    return GridLayout(_whole(width), _whole(height), (left, bottom, grid_w, grid_h), bar,
                      grid_rows, grid_cols, panel_w, panel_h, gap_x, gap_y, cell, labelled, note,
                      width - 2 * PAD_IN, lines)


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
                      label: str = "attention weight", with_images: bool = True) -> GridArtists:
    """:func:`draw_grid`, returning the artists; ``with_images=False`` draws only the frame
    (the fast renderer paints the panels itself)."""
    data = np.asarray(matrices, dtype=np.float32)
    num_rows, num_cols, num_query, num_key = data.shape
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
                rgb, _ = resolved.colours(data[r, c], table)
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
              row_divider: int | None = None, col_divider: int | None = None) -> Figure:
    """A grid of small heatmaps: ``matrices`` is ``[rows, cols, query, key]``.

    Used for a layer's heads (one row, wrapped into a near-square grid) and for the model
    overview (layers x heads). With at most 16 ``tokens`` (query labels; ``key_tokens`` for
    the keys), the outer panels carry token labels. All panels share one colour scale (``auto``:
    the largest weight in the grid).
    """
    return draw_grid_artists(matrices, row_labels, col_labels, title=title, cmap=cmap,
                             tokens=tokens, key_tokens=key_tokens, scale=scale, gamma=gamma,
                             vmax=vmax, dpi=dpi, row_divider=row_divider,
                             col_divider=col_divider).fig


# --------------------------------------------------------------------------- from a capture
@dataclass
class FigureOptions:
    """Options every attention figure takes (the CLI's ``--scale``, ``--tokens``, ...).

    Attributes:
        cmap: matplotlib colour map.
        scale, gamma, vmax: the colour scale (:class:`ColourScale`).
        annot: cell values in one-head figures (``None``: up to 30 tokens).
        dpi: resolution the figure is made for.
        words, exclude_special: the token view (:func:`attnviz.analysis.tokens.token_view`).
        tokens, queries, keys: windows (:func:`attnviz.analysis.tokens.parse_window`).
    """

    cmap: str = "viridis"
    scale: str = DEFAULT_SCALE
    gamma: float | None = None  # None: DEFAULT_GAMMA for the power scale
    vmax: str | float | None = DEFAULT_VMAX
    annot: bool | None = None
    dpi: int = DEFAULT_DPI
    words: bool = False
    exclude_special: bool = False
    tokens: str | None = None
    queries: str | None = None
    keys: str | None = None

    def __post_init__(self) -> None:
        """Check what a Python caller may pass wrongly (the CLI's options are checked by it)."""
        import numbers

        from attnviz.errors import UsageError

        if isinstance(self.dpi, bool) or not isinstance(self.dpi, numbers.Integral) \
                or not MIN_DPI <= self.dpi <= MAX_DPI:
            raise UsageError(f"dpi must be a whole number from {MIN_DPI} to {MAX_DPI}, not "
                             f"{self.dpi!r:.40}")
        for name in ("tokens", "queries", "keys"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise UsageError(f"{name} must be a window such as \"10:40\" or \"bank:loan\", "
                                 f"not {type(value).__name__}")
        for name in ("words", "exclude_special"):
            if not isinstance(getattr(self, name), bool):
                raise UsageError(f"{name} must be True or False, not "
                                 f"{getattr(self, name)!r:.40}")

    def colour_scale(self) -> ColourScale:
        return ColourScale.of(self.scale, self.gamma, self.vmax)


def head_label(capture: Any, head: int | str) -> str:
    """How a head is named in titles: ``3``, or ``mean of all heads`` / ``mean of heads 0, 2``."""
    if head != "mean":
        from attnviz.selection import resolve_index

        return str(resolve_index(int(head), capture.num_heads, "head"))
    return str(capture.mean_label)


def head_title(capture: Any, layer: int, head: int | str, suffix: str = "") -> str:
    """Title of a one-head figure: ``minilm: layer 5, head 3 (notes)`` or ``minilm: layer 5,
    mean of all heads``."""
    from attnviz.selection import resolve_index

    shown = resolve_index(layer, capture.num_layers, "layer")
    label = head_label(capture, head)
    named = label if head == "mean" else f"head {label}"  # "mean of all heads", not "head mean.."
    return f"{capture.model}: layer {shown}, {named}{suffix}"


def layer_title(capture: Any, layer: int, suffix: str = "") -> str:
    """Title of a layer's grid: ``minilm: layer 2, all heads (notes)``."""
    from attnviz.capture import format_indices

    heads = ("all heads" if len(capture.heads) == capture.num_heads
             else f"heads {format_indices(capture.heads)}")
    return f"{capture.model}: layer {layer}, {heads}{suffix}"


def overview_title(capture: Any, suffix: str = "") -> str:
    """Title of the overview: ``minilm: every layer and head (notes)``."""
    from attnviz.capture import format_indices

    if len(capture.layers) == capture.num_layers and len(capture.heads) == capture.num_heads:
        what = "every layer and head"
    else:
        what = f"layers {format_indices(capture.layers)}, heads {format_indices(capture.heads)}"
    return f"{capture.model}: {what}{suffix}"


def capture_head_figure(capture: Any, layer: int, head: int | str = "mean", *,
                        options: FigureOptions | None = None,
                        ax: Axes | None = None) -> HeadArtists:
    """One head (or ``"mean"`` of the layer's heads) of a capture, as ``attnviz heatmap
    --layer L --head H`` draws it: the token view, windows, labels, pair divider and title."""
    from attnviz.analysis.tokens import figure_view

    options = options or FigureOptions()
    capture.layer_position(layer)  # validate on the raw capture: clear messages
    if isinstance(head, str) and head != "mean":
        from attnviz.errors import UsageError

        raise UsageError(f"head must be a whole number such as 3 or -1, or \"mean\", not "
                         f"{head!r:.40}")
    if head != "mean":
        capture.head_position(head)
    shown = figure_view(capture, words=options.words, exclude_special=options.exclude_special,
                        tokens=options.tokens, queries=options.queries, keys=options.keys)
    view = shown.capture
    matrix = (view.mean_matrix(layer) if isinstance(head, str)
              else view.matrix(layer, head))
    return draw_head_artists(
        shown.crop(matrix), shown.row_labels, shown.col_labels,
        title=head_title(view, layer, head, shown.suffix), cmap=options.cmap,
        annot=options.annot, scale=options.colour_scale(), dpi=options.dpi,
        row_divider=shown.row_divider, col_divider=shown.col_divider, ax=ax)


def capture_grid_figure(capture: Any, layer: int | None = None, *,
                        options: FigureOptions | None = None) -> Figure:
    """A layer's heads (``layer``) or every layer and head (``None``) of a capture, as
    ``attnviz heatmap [--layer L]`` draws them."""
    from attnviz.analysis.tokens import figure_view

    options = options or FigureOptions()
    if layer is not None:
        capture.layer_position(layer)
    shown = figure_view(capture, words=options.words, exclude_special=options.exclude_special,
                        tokens=options.tokens, queries=options.queries, keys=options.keys)
    view = shown.capture
    heads = [f"head {h}" for h in view.heads]
    if layer is not None:
        position = view.layer_position(layer)
        shown_layer = view.layers[position]
        block = shown.crop(view.weights[position:position + 1])
        rows, title = [f"layer {shown_layer}"], layer_title(view, shown_layer, shown.suffix)
    else:
        block = shown.crop(view.weights)
        rows, title = [f"layer {i}" for i in view.layers], overview_title(view, shown.suffix)
    return draw_grid(block, rows, heads, title=title, cmap=options.cmap,
                     tokens=shown.row_labels, key_tokens=shown.col_labels,
                     scale=options.colour_scale(), dpi=options.dpi,
                     row_divider=shown.row_divider, col_divider=shown.col_divider)


# --------------------------------------------------------------------------- saving
_METADATA: dict[str, dict[str, str | None]] = {
    "png": {"Software": "attnviz"},
    "svg": {"Date": None, "Creator": "attnviz"},
    "pdf": {"CreationDate": None, "ModDate": None, "Creator": "attnviz"},
}


def figure_bytes(fig: Figure, fmt: str, dpi: float | None = None) -> bytes:
    """``fig`` saved as ``fmt`` (png, svg or pdf) without dates, so output is reproducible."""
    buffer = io.BytesIO()
    with plain_text():
        fig.savefig(buffer, format=fmt, dpi=dpi or fig.dpi, metadata=_METADATA[fmt])
    return buffer.getvalue()


def save_figure(fig: Figure, path: Path | str, *, dpi: int | None = None) -> Path:
    """Save a figure atomically; the format follows the suffix (png, svg, pdf)."""
    path = Path(path)
    fmt = path.suffix.lstrip(".").lower() or "png"
    if fmt not in FORMATS:
        raise UsageError(f"cannot save a figure as .{fmt}", "use a .png, .svg or .pdf file name")
    data = figure_bytes(fig, fmt, dpi)
    atomic_write(path, lambda handle: handle.write(data))
    return path
