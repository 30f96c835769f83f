"""Figure geometry: sizes from content, label thinning, title wrapping.

Figures are laid out by hand from their content, never by a layout engine, so a layout costs
nothing and every figure of one shape has the same pixels outside its images (which is what
:mod:`attnviz.render.fast` relies on):

* **Sizes from content**: each token gets a cell big enough for an 8-pt label (bigger when the
  cell values are written in), up to a bound on the plot's size; past it the cells shrink and
  only every n-th label is drawn, and the axis label says so. A grid gives each head at least
  one pixel per token at the saved resolution, or its title says it is downsampled.
* **Titles always fit**: they are wrapped (measured, not guessed) to the figure's width.
"""

from __future__ import annotations

import contextlib
import functools
import math
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
from matplotlib.font_manager import FontProperties  # noqa: E402

ANNOT_MAX_TOKENS = 30  # past this, cell values are not written unless asked for (~1 ms per cell)
DEFAULT_DPI = 100
MIN_DPI, MAX_DPI = 20, 600  # the bounds of --dpi

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
LABEL_IN = 0.95  # room for tick labels; a one-head figure grows it for longer labels
MAX_LABEL_IN = 2.4  # ... up to this (about 28 characters at 8 pt); longer labels are shortened
LABEL_GAP_IN = 0.08  # between the plot's edge and its labels, counted in the label room
AXIS_LABEL_IN = 0.3
TITLE_LINE_IN = 0.21
TITLE_LINES = 2  # lines a head figure reserves for its title (more make it taller)
MAX_TITLE_LINES = 5
COLOURBAR_GAP_IN = 0.15
COLOURBAR_WIDTH_IN = 0.18
COLOURBAR_TEXT_IN = 0.95  # tick labels and the two-line label


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
        row_label_in, col_label_in: room for the query and key labels (inches, the gap to
            the plot included): :data:`LABEL_IN`, more for longer labels, at most
            :data:`MAX_LABEL_IN`.
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
    row_label_in: float = LABEL_IN
    col_label_in: float = LABEL_IN


def label_room(widest: float) -> float:
    """Room (inches) for token labels whose widest is ``widest`` inches: at least
    :data:`LABEL_IN`, at most :data:`MAX_LABEL_IN`, in whole hundredths."""
    need = math.ceil((widest + LABEL_GAP_IN + 0.02) * 100 - 1e-6) / 100
    return min(max(LABEL_IN, need), MAX_LABEL_IN)


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
                dpi: float = DEFAULT_DPI, lines: int = TITLE_LINES,
                row_labels: Sequence[str] = (), col_labels: Sequence[str] = ()) -> HeadLayout:
    """The layout of a one-head figure of ``num_query`` x ``num_key`` tokens.

    Args:
        num_query, num_key: the matrix's shape (``num_key`` defaults to ``num_query``).
        annot: write the cell values; ``None``: when there are at most 30 tokens. Values are
            left out when an 8-pt value would not fit the cells within the size bound.
        dpi: the saved resolution (decides whether the image must be downsampled).
        lines: lines of the (wrapped) title; at least :data:`TITLE_LINES` are reserved.
        row_labels, col_labels: the query and key labels: the margins grow to fit the
            longest (up to :data:`MAX_LABEL_IN`), so that labels are shortened only when
            they are longer than that.
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
    # Labels are measured at the larger label size, so either size fits the room.
    row_room = label_room(max((text_width(t, 9.0) for t in row_labels[::row_step]), default=0))
    col_room = label_room(max((text_width(t, 9.0) for t in col_labels[::col_step]), default=0))
    left = PAD_IN + AXIS_LABEL_IN + row_room
    bottom = PAD_IN + AXIS_LABEL_IN + col_room
    # The colour bar is at most twice the plot's height (a one-cell window: 1.5 in, not
    # 2.6); a bar shorter than its label gets the label wrapped, in up to 2 more lines.
    bar_h = max(min(MIN_BAR_IN, 2 * plot_h), min(plot_h, max(MIN_PLOT_IN, plot_h * 0.6)))
    right = COLOURBAR_GAP_IN + COLOURBAR_WIDTH_IN + COLOURBAR_TEXT_IN + PAD_IN
    if bar_h < MIN_BAR_IN:  # room for the wrapped label's lines past two (a long one)
        lines = sum(wrap_text(line, bar_h, 8.5, max_lines=3).count("\n") + 1
                    for line in ("attention weight", "power 0.35 scale, top = 0.0068 (fixed)"))
        right += (lines - 2) * 8.5 * 1.3 / 72
    width = left + plot_w + right
    if width < MIN_FIGURE_IN:  # centre the plot and colour bar in the wider figure
        left += math.floor((MIN_FIGURE_IN - width) * 50) / 100
        width = MIN_FIGURE_IN
    lines = max(lines, TITLE_LINES)
    top = PAD_IN + lines * TITLE_LINE_IN + 0.12
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
        title_width=width - 2 * PAD_IN, title_lines=lines, dropped_values=dropped,
        row_label_in=row_room, col_label_in=col_room)


def head_figure_size(num_query: int, num_key: int | None = None, *, annot: bool | None = None,
                     dpi: float = DEFAULT_DPI) -> tuple[float, float]:
    """Figure size in inches of a one-head heatmap (a title of up to two lines)."""
    layout = head_layout(num_query, num_key, annot=annot, dpi=dpi)
    return layout.width, layout.height


def _fraction(box: tuple[float, float, float, float], width: float,
              height: float) -> tuple[float, float, float, float]:
    left, bottom, w, h = box
    return left / width, bottom / height, w / width, h / height


# --------------------------------------------------------------------------- grid layout
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
