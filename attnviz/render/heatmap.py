"""Matplotlib heatmaps of a capture's attention: one head, a layer's heads, the model overview.

Query tokens are rows, key tokens are columns: row ``i`` shows where token ``i`` looks. This
module turns a :class:`~attnviz.capture.Capture` into figures (the token view, windows,
titles) and saves them; the drawing itself lives in rooms of its own, whose names it also
re-exports:

* :mod:`attnviz.render.colours`: colour maps and scales (:class:`ColourScale`: linear, power or
  log; the top fixed or the shown data's maximum). Colours come from one lookup table,
  :func:`colour_table`, here and in the fast renderer alike.
* :mod:`attnviz.render.layout`: figure geometry from content (cell sizes, label thinning) and
  titles wrapped (measured, not guessed) to the figure's width.
* :mod:`attnviz.render.parts`: colour bar, token and axis labels, dividers, cell values.
* :mod:`attnviz.render.head`: one head (:func:`draw_head`); :mod:`attnviz.render.grid`: grids
  of heads (:func:`draw_grid`).
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

from matplotlib.axes import Axes  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from attnviz.errors import UsageError  # noqa: E402
from attnviz.fileio import atomic_write  # noqa: E402
from attnviz.render.colours import (  # noqa: E402, F401  (re-exported)
    DEFAULT_GAMMA,
    DEFAULT_SCALE,
    DEFAULT_VMAX,
    GAMMA_RANGE,
    LOG_DECADES,
    SCALES,
    VMAX_LIMIT,
    ColourScale,
    ColourTable,
    ResolvedScale,
    check_cmap,
    colour_table,
    parse_vmax,
)
from attnviz.render.grid import (  # noqa: E402, F401  (re-exported)
    GridArtists,
    draw_grid,
    draw_grid_artists,
)
from attnviz.render.head import (  # noqa: E402, F401  (re-exported)
    HeadArtists,
    draw_head,
    draw_head_artists,
)
from attnviz.render.layout import (  # noqa: E402, F401  (re-exported)
    ANNOT_MAX_TOKENS,
    ANNOT_PT,
    AXIS_LABEL_IN,
    AXIS_PT,
    CELL_ANNOT_IN,
    CELL_LABEL_IN,
    CELL_MAX_IN,
    COLOURBAR_GAP_IN,
    COLOURBAR_TEXT_IN,
    COLOURBAR_WIDTH_IN,
    DEFAULT_DPI,
    GRID_TITLE_PT,
    LABEL_IN,
    LABEL_PT,
    MAX_DPI,
    MAX_GRID_IN,
    MAX_PLOT_IN,
    MAX_TITLE_LINES,
    MIN_BAR_IN,
    MIN_DPI,
    MIN_FIGURE_IN,
    MIN_PLOT_IN,
    PAD_IN,
    TITLE_LINE_IN,
    TITLE_LINES,
    TITLE_PT,
    GridLayout,
    HeadLayout,
    _ordinal,
    grid_layout,
    grid_shape,
    head_figure_size,
    head_layout,
    plain_text,
    shorten,
    text_width,
    title_lines,
    wrap_text,
)
from attnviz.render.parts import DIVIDER_COLOUR  # noqa: E402, F401  (re-exported)

FORMATS = ("png", "svg", "pdf")


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
    return f"{capture.title_start}layer {shown}, {named}{suffix}"


def layer_title(capture: Any, layer: int, suffix: str = "") -> str:
    """Title of a layer's grid: ``minilm: layer 2, all heads (notes)``."""
    from attnviz.capture import format_indices

    heads = ("all heads" if len(capture.heads) == capture.num_heads
             else f"heads {format_indices(capture.heads)}")
    return f"{capture.title_start}layer {layer}, {heads}{suffix}"


def overview_title(capture: Any, suffix: str = "") -> str:
    """Title of the overview: ``minilm: every layer and head (notes)``."""
    from attnviz.capture import format_indices

    if len(capture.layers) == capture.num_layers and len(capture.heads) == capture.num_heads:
        what = "every layer and head"
    else:
        what = f"layers {format_indices(capture.layers)}, heads {format_indices(capture.heads)}"
    return f"{capture.title_start}{what}{suffix}"


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
    from attnviz.render.parts import masked_cells

    # A causal view keeps its order (words merged, special tokens dropped): a later key is
    # masked in it too.
    masked = masked_cells((shown.rows.start, shown.rows.stop),
                          (shown.cols.start, shown.cols.stop), causal=bool(view.causal))
    return draw_head_artists(
        shown.crop(matrix), shown.row_labels, shown.col_labels,
        title=head_title(view, layer, head, shown.suffix), cmap=options.cmap,
        annot=options.annot, scale=options.colour_scale(), dpi=options.dpi,
        row_divider=shown.row_divider, col_divider=shown.col_divider, ax=ax,
        label=view.measure_label or "attention weight", masked=masked)


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
    from attnviz.render.parts import masked_cells

    masked = masked_cells((shown.rows.start, shown.rows.stop),
                          (shown.cols.start, shown.cols.stop), causal=bool(view.causal))
    return draw_grid(block, rows, heads, title=title, cmap=options.cmap,
                     tokens=shown.row_labels, key_tokens=shown.col_labels,
                     scale=options.colour_scale(), dpi=options.dpi,
                     row_divider=shown.row_divider, col_divider=shown.col_divider,
                     label=view.measure_label or "attention weight", masked=masked)


def capture_heatmap(capture: Any, /, layer: int, head: int | str = "mean",
                    ax: Axes | None = None, **options: Any) -> tuple[Figure, Axes]:
    """:meth:`Capture.heatmap <attnviz.capture.Capture.heatmap>`: one head as ``attnviz heatmap
    --layer L --head H`` draws it, ``options`` being the fields of :class:`FigureOptions`.

    Returns:
        ``(figure, axes)``: the matplotlib ``Figure`` and the heatmap's ``Axes``.
    """
    names = set(FigureOptions.__dataclass_fields__) - {"extra"}
    unknown = sorted(set(options) - names)
    if unknown:
        raise UsageError(f"unknown figure option {unknown[0]!r}",
                         f"use any of: {', '.join(sorted(names))}")
    artists = capture_head_figure(capture, layer, head, options=FigureOptions(**options), ax=ax)
    return artists.fig, artists.ax


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
