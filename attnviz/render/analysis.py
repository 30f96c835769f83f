"""Figures of the analysis commands: head statistics, rollout, and comparisons.

Every function returns a matplotlib :class:`~matplotlib.figure.Figure`; save it with
:func:`attnviz.render.heatmap.save_figure` (atomic, format from the suffix).
"""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.colors import Normalize, TwoSlopeNorm  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from attnviz.render.heatmap import (  # noqa: E402
    ANNOT_MAX_TOKENS,
    DEFAULT_DPI,
    _set_token_ticks,
    head_figure_size,
)

DIVERGING_CMAP = "RdBu_r"  # blue = less attention in B, red = more; white = no change


def _plain(text: str) -> str:
    """Text shown as typed: a pair of ``$`` would otherwise start matplotlib's mathtext."""
    return text.replace("$", r"\$")


def _plain_all(texts: Sequence[str]) -> list[str]:
    return [_plain(t) for t in texts]


def _annotate(ax: Axes, matrix: np.ndarray, cmap: str, norm: Normalize, digits: int = 2) -> None:
    colormap = matplotlib.colormaps[cmap]
    size = max(5.0, 9.0 - max(matrix.shape) / 6)
    for (i, j), value in np.ndenumerate(matrix):
        r, g, b, _ = colormap(float(norm(value)))
        light = (0.299 * r + 0.587 * g + 0.114 * b) < 0.5
        ax.text(j, i, f"{value:.{digits}f}", ha="center", va="center", fontsize=size,
                color="white" if light else "black")


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
    fig = Figure(figsize=(float(np.clip(2.0 + 0.9 * n_heads, 5.0, 30.0)),
                          float(np.clip(1.6 + 0.6 * n_layers, 3.5, 30.0))), dpi=DEFAULT_DPI)
    ax = fig.add_subplot()
    finite = values[np.isfinite(values)]
    low = float(min(0.0, finite.min())) if finite.size else 0.0
    high = float(finite.max()) if finite.size else 1.0
    if stat not in ("distance", "entropy_nats"):
        high = max(high, 1.0)  # shares and normalised entropy live in 0..1
    norm = Normalize(vmin=low, vmax=high if high > low else low + 1.0)
    image = ax.imshow(values, cmap=cmap, norm=norm, aspect="auto", interpolation="nearest")
    ax.set_xticks(np.arange(n_heads), [str(h) for h in heads])
    ax.set_yticks(np.arange(n_layers), [str(layer) for layer in layers])
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_title(_plain(title), fontsize=11)
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
    fig.tight_layout()
    return fig


def draw_matrix(matrix: np.ndarray, rows: Sequence[str], cols: Sequence[str], *, title: str,
                cmap: str = "viridis", label: str = "attention weight",
                annot: bool | None = None, vmax: float | None = None) -> Figure:
    """One ``[query, key]`` heatmap with token labels; the colour scale runs 0..``vmax``.

    ``vmax`` defaults to the matrix maximum (rollout matrices rarely reach 1).
    """
    if annot is None:
        annot = max(matrix.shape) <= ANNOT_MAX_TOKENS
    fig = Figure(figsize=head_figure_size(*matrix.shape), dpi=DEFAULT_DPI)
    ax = fig.add_subplot()
    top = float(matrix.max()) if vmax is None else vmax
    norm = Normalize(vmin=0.0, vmax=top if top > 0 else 1.0)
    image = ax.imshow(matrix, cmap=cmap, norm=norm, aspect="auto", interpolation="nearest")
    _set_token_ticks(ax, _plain_all(rows), _plain_all(cols))
    ax.set_xlabel("key (input token)")
    ax.set_ylabel("query")
    ax.set_title(_plain(title), fontsize=11)
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.02, label=label)
    if annot:
        _annotate(ax, matrix, cmap, norm)
    fig.tight_layout()
    return fig


def draw_token_bars(values: np.ndarray, tokens: Sequence[str], *, title: str,
                    highlight: int | None = None, label: str = "rolled-out attention") -> Figure:
    """A bar chart of one row: how much each token receives; ``highlight`` marks the query."""
    count = len(values)
    fig = Figure(figsize=(float(np.clip(2.5 + 0.32 * count, 6.0, 24.0)), 4.2), dpi=DEFAULT_DPI)
    ax = fig.add_subplot()
    colours = ["#d62728" if i == highlight else "#1f77b4" for i in range(count)]
    ax.bar(np.arange(count), values, color=colours)
    step = 1 if count <= 80 else int(np.ceil(count / 80))
    ticks = np.arange(0, count, step)
    ax.set_xticks(ticks, [_plain(tokens[int(i)]) for i in ticks], rotation=90,
                  fontsize=max(5, 10 - count // 15))
    ax.set_ylabel(label)
    ax.set_xlim(-0.6, count - 0.4)
    ax.set_ylim(0.0, max(float(values.max()) * 1.12, 1e-6))
    ax.set_title(_plain(title), fontsize=11)
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    return fig


def draw_comparison(a: np.ndarray, b: np.ndarray, tokens_a: Sequence[str],
                    tokens_b: Sequence[str], *, titles: tuple[str, str], title: str,
                    diff: np.ndarray | None = None, cmap: str = "viridis",
                    annot: bool | None = None) -> Figure:
    """A and B side by side on one colour scale (0..1), plus ``B - A`` when given.

    The difference panel uses a diverging colour map centred at 0 with symmetric limits, so
    white is "no change", red "B attends more", blue "B attends less".
    """
    size = max(a.shape[0], b.shape[0])
    if annot is None:
        annot = size <= min(ANNOT_MAX_TOKENS, 16)
    panels = 3 if diff is not None else 2
    width, height = head_figure_size(size)
    fig = Figure(figsize=(min(width * panels * 0.85, 48.0), height), dpi=DEFAULT_DPI,
                 layout="constrained")
    axes = fig.subplots(1, panels, squeeze=False)[0]
    norm = Normalize(vmin=0.0, vmax=1.0)
    image = None
    for ax, matrix, tokens, name in ((axes[0], a, tokens_a, titles[0]),
                                     (axes[1], b, tokens_b, titles[1])):
        image = ax.imshow(matrix, cmap=cmap, norm=norm, aspect="auto", interpolation="nearest")
        _set_token_ticks(ax, _plain_all(tokens), _plain_all(tokens))
        ax.set_title(_plain(name), fontsize=10)
        ax.set_xlabel("key (attended to)")
        if annot:
            _annotate(ax, matrix, cmap, norm)
    axes[0].set_ylabel("query (attending)")
    if image is not None:
        fig.colorbar(image, ax=list(axes[:2]), fraction=0.04, pad=0.01, label="attention weight")
    if diff is not None:
        ax = axes[2]
        limit = float(np.abs(diff).max()) or 1e-6
        dnorm = TwoSlopeNorm(vcenter=0.0, vmin=-limit, vmax=limit)
        dimage = ax.imshow(diff, cmap=DIVERGING_CMAP, norm=dnorm, aspect="auto",
                           interpolation="nearest")
        _set_token_ticks(ax, _plain_all(tokens_a), _plain_all(tokens_a))
        ax.set_title("difference B - A", fontsize=10)
        ax.set_xlabel("key (attended to)")
        if annot:
            _annotate(ax, diff, DIVERGING_CMAP, dnorm)
        fig.colorbar(dimage, ax=ax, fraction=0.046, pad=0.02, label="B - A")
    fig.suptitle(_plain(title), fontsize=12)
    return fig
