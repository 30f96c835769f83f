"""Matplotlib heatmaps of attention: one head (annotated), a layer's heads, the model overview.

Query tokens are rows, key tokens are columns: row ``i`` shows where token ``i`` looks.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from attnviz.errors import UsageError  # noqa: E402
from attnviz.fileio import atomic_write  # noqa: E402

ANNOT_MAX_TOKENS = 30  # past this, cell values are unreadable and slow (~1 ms per cell)
LABEL_MAX_TOKENS = 80  # past this, tick labels are thinned
DEFAULT_DPI = 100
FORMATS = ("png", "svg", "pdf")


def check_cmap(name: str) -> str:
    """Validate a matplotlib colour map name."""
    if name not in matplotlib.colormaps:
        close = [c for c in sorted(matplotlib.colormaps) if c.lower().startswith(name[:3].lower())]
        hint = f"try one of: {', '.join(close[:6])}" if close else "try viridis, magma or Blues"
        raise UsageError(f"unknown colour map {name!r}", hint)
    return name


def head_figure_size(num_query: int, num_key: int | None = None) -> tuple[float, float]:
    """Figure size in inches of a single-head heatmap with the given number of tokens."""
    num_key = num_query if num_key is None else num_key
    width = float(np.clip(3.0 + 0.3 * num_key, 6.0, 22.0))
    height = float(np.clip(2.4 + 0.3 * num_query, 5.0, 20.0))
    return width, height


def tick_step(num_tokens: int) -> int:
    """Show every n-th token label so labels stay readable on long inputs."""
    return 1 if num_tokens <= LABEL_MAX_TOKENS else int(np.ceil(num_tokens / LABEL_MAX_TOKENS))


def _set_token_ticks(ax: plt.Axes, rows: Sequence[str], cols: Sequence[str]) -> None:
    for axis, labels, rotate in ((ax.xaxis, cols, 90), (ax.yaxis, rows, 0)):
        step = tick_step(len(labels))
        positions = np.arange(0, len(labels), step)
        axis.set_ticks(positions)
        axis.set_ticklabels([labels[int(i)] for i in positions], rotation=rotate,
                            fontsize=max(5, 10 - len(labels) // 15))
    ax.tick_params(length=0)


def draw_head(matrix: np.ndarray, rows: Sequence[str], cols: Sequence[str], *, title: str,
              cmap: str = "viridis", annot: bool | None = None,
              vmax: float | None = None) -> Figure:
    """Figure of one ``[query, key]`` attention matrix with token labels and a colour bar.

    Args:
        matrix: ``[query, key]`` weights.
        rows: query token labels; cols: key token labels.
        title: figure title (model, layer, head).
        cmap: matplotlib colour map.
        annot: write values in the cells; ``None`` means "when there are at most 30 tokens".
        vmax: top of the colour scale; defaults to 1 for probabilities.
    """
    if annot is None:
        annot = max(matrix.shape) <= ANNOT_MAX_TOKENS
    fig = Figure(figsize=head_figure_size(*matrix.shape), dpi=DEFAULT_DPI)
    ax = fig.add_subplot()
    top = 1.0 if vmax is None else vmax
    image = ax.imshow(matrix, cmap=cmap, vmin=0.0, vmax=top, aspect="auto",
                      interpolation="nearest")
    _set_token_ticks(ax, rows, cols)
    ax.set_xlabel("key (attended to)")
    ax.set_ylabel("query (attending)")
    ax.set_title(title, fontsize=11)
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.02, label="attention weight")
    if annot:
        colormap = matplotlib.colormaps[cmap]
        size = max(5.0, 9.0 - max(matrix.shape) / 6)
        for (i, j), value in np.ndenumerate(matrix):
            r, g, b, _ = colormap(min(value / top, 1.0) if top else 0.0)
            light = (0.299 * r + 0.587 * g + 0.114 * b) < 0.5
            ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=size,
                    color="white" if light else "black")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "tight layout not applied" on tiny views
        fig.tight_layout()
    return fig


def draw_grid(matrices: np.ndarray, row_labels: Sequence[str], col_labels: Sequence[str], *,
              title: str, cmap: str = "viridis", tokens: Sequence[str] | None = None) -> Figure:
    """A grid of small heatmaps: ``matrices`` is ``[rows, cols, query, key]``.

    Used for a layer's heads (one row, wrapped into a near-square grid) and for the model
    overview (layers x heads). With at most 16 ``tokens``, the outer axes carry token labels.
    """
    n_rows, n_cols = matrices.shape[:2]
    if n_rows == 1 and n_cols > 4:  # a single layer: wrap heads into a near-square grid
        wrap = int(np.ceil(np.sqrt(n_cols)))
        flat = [(0, h) for h in range(n_cols)]
        grid_rows, grid_cols = int(np.ceil(n_cols / wrap)), wrap
    else:
        flat = [(r, c) for r in range(n_rows) for c in range(n_cols)]
        grid_rows, grid_cols = n_rows, n_cols
    labelled = tokens is not None and len(tokens) <= 16 and n_rows == 1
    cell = 2.4 if labelled else 1.6
    fig = Figure(figsize=(min(1.5 + cell * grid_cols, 40), min(1.0 + cell * grid_rows, 40)),
                 dpi=DEFAULT_DPI, layout="constrained")
    axes = fig.subplots(grid_rows, grid_cols, squeeze=False)
    image = None
    for index, ax in enumerate(axes.flat):
        ax.set_xticks([])
        ax.set_yticks([])
        if index >= len(flat):
            ax.set_axis_off()
            continue
        r, c = flat[index]
        image = ax.imshow(matrices[r, c], cmap=cmap, vmin=0.0, vmax=1.0, aspect="auto",
                          interpolation="nearest")
        if n_rows == 1:
            ax.set_title(col_labels[c], fontsize=9)
        else:
            if r == 0:
                ax.set_title(col_labels[c], fontsize=9)
            if c == 0:
                ax.set_ylabel(row_labels[r], fontsize=9)
        if labelled and tokens is not None:
            grid_row, grid_col = divmod(index, grid_cols)
            if grid_col == 0:
                ax.set_yticks(range(len(tokens)), list(tokens), fontsize=7)
            if grid_row == grid_rows - 1 or index + grid_cols >= len(flat):
                ax.set_xticks(range(len(tokens)), list(tokens), fontsize=7, rotation=90)
            ax.tick_params(length=0)
    fig.suptitle(title, fontsize=12)
    if image is not None:
        fig.colorbar(image, ax=axes, fraction=0.02, pad=0.01, label="attention weight")
    return fig


def save_figure(fig: Figure, path: Path | str, *, dpi: int | None = None) -> Path:
    """Save a figure atomically; the format follows the suffix (png, svg, pdf)."""
    path = Path(path)
    fmt = path.suffix.lstrip(".").lower() or "png"
    if fmt not in FORMATS:
        raise UsageError(f"cannot save a figure as .{fmt}", "use a .png, .svg or .pdf file name")
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        # Missing glyphs (CJK, emoji) draw as boxes; matplotlib's per-glyph warnings would
        # only print source paths at the user.
        warnings.simplefilter("ignore", UserWarning)
        fig.savefig(buffer, format=fmt, dpi=dpi or fig.dpi,
                    metadata={"Software": "attnviz"} if fmt == "png" else None)
    plt.close(fig)
    atomic_write(path, lambda handle: handle.write(buffer.getvalue()))
    return path
