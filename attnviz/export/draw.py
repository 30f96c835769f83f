"""Export: drawing a text's files from its saved capture: figures and the top-k table.

:func:`render_task` draws one :class:`RenderTask` (some heads, layer grids, the overview of
one text) into its folder, in this process or in a drawing worker; :func:`plan_tasks` splits
a text's figures among the workers. PNGs come from the fast renderer of
:mod:`attnviz.render.fast` (a frame laid out once, reused across heads and texts), SVG and
PDF from matplotlib.
"""

from __future__ import annotations

import collections
import gc
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from attnviz.export.write import (
    HEADS_DIR,
    LAYERS_DIR,
    TOPK_CSV,
    digits,
    head_file,
    is_file,
    layer_file,
    overview_file,
)

if TYPE_CHECKING:
    from attnviz.analysis.tokens import FigureView
    from attnviz.capture import Capture
    from attnviz.export.plan import ExportOptions
    from attnviz.render.fast import FrameTemplate, HeadFigure
    from attnviz.render.heatmap import ColourScale

HEADS_PER_SPLIT = 96  # below this many heads, one process draws all heads of a text


@dataclass(frozen=True)
class RenderTask:
    """Figures of one text for one worker (picklable: paths and numbers only)."""

    folder: str
    heads: tuple[tuple[int, int], ...]  # (layer, head), model indices
    layers: tuple[int, ...]  # layer grids
    overview: bool
    fmt: str
    dpi: int
    cmap: str
    annot: bool | None
    words: bool
    exclude_special: bool
    scale: str = "power"
    gamma: float | None = None
    vmax: float | None = None
    tokens: str | None = None
    queries: str | None = None
    keys: str | None = None

    @property
    def count(self) -> int:
        return len(self.heads) + len(self.layers) + int(self.overview)


_HEAD_TEMPLATES: collections.OrderedDict[tuple[Any, ...], Any] = collections.OrderedDict()
_GRID_TEMPLATES: collections.OrderedDict[tuple[Any, ...], list[Any]] = collections.OrderedDict()


def _remember(cache: collections.OrderedDict[tuple[Any, ...], Any], key: tuple[Any, ...],
              value: Any, size: int) -> None:
    cache[key] = value
    cache.move_to_end(key)
    while len(cache) > size:
        cache.popitem(last=False)


def _scale(task: RenderTask) -> ColourScale:
    from attnviz.render.heatmap import ColourScale

    return ColourScale.of(task.scale, task.gamma, task.vmax)


def _masked(shown: FigureView) -> Any:
    """The cells of the figure a query cannot see (a causal view's later keys), or ``None``."""
    from attnviz.render.parts import masked_cells

    return masked_cells((shown.rows.start, shown.rows.stop),
                        (shown.cols.start, shown.cols.stop), causal=bool(shown.capture.causal))


def _head_template(task: RenderTask, shown: FigureView, titles: list[str],
                   figures: Iterable[Sequence[Any]] = ()) -> FrameTemplate:
    """The head frame of this text; ``figures`` (each ``[matrix]``) have their colour bar
    labels drawn with the titles, in one pass."""
    from attnviz.render.fast import head_template
    rows, cols = tuple(shown.row_labels), tuple(shown.col_labels)
    label = shown.capture.measure_label or "attention weight"
    masked = _masked(shown)
    key = (task.folder, rows, cols, task.cmap, task.dpi, task.annot, _scale(task),
           shown.row_divider, shown.col_divider, label, shown.rows.start, shown.cols.start,
           bool(shown.capture.causal))
    template = _HEAD_TEMPLATES.get(key)
    if template is None:
        template = head_template(rows, cols, cmap=task.cmap, dpi=task.dpi, annot=task.annot,
                                 titles=titles, scale=_scale(task),
                                 row_divider=shown.row_divider, col_divider=shown.col_divider,
                                 figures=figures, label=label, masked=masked)
        _remember(_HEAD_TEMPLATES, key, template, 1)
    else:
        template.prepare(titles, figures)
        _HEAD_TEMPLATES.move_to_end(key)
    return template


def _grid_template(rows: list[str], cols: list[str], shown: FigureView, task: RenderTask,
                   titles: list[str], figures: Iterable[Sequence[Any]] = ()) -> FrameTemplate:
    """A grid frame (laid out once per shape), reused across texts when it does not show
    their tokens."""
    from attnviz.render.fast import grid_template

    tokens, keys = list(shown.row_labels), list(shown.col_labels)
    label = shown.capture.measure_label or "attention weight"
    base = (len(rows), tuple(cols), len(tokens), len(keys), task.cmap, task.dpi, _scale(task),
            shown.row_divider, shown.col_divider, label, shown.rows.start, shown.cols.start,
            bool(shown.capture.causal))
    for entry_rows, entry_tokens, template in _GRID_TEMPLATES.get(base, []):
        if entry_rows in (None, tuple(rows)) and entry_tokens in (None, (*tokens, *keys)):
            template.prepare(titles, figures)
            _GRID_TEMPLATES.move_to_end(base)
            return template
    template = grid_template(len(rows), len(cols), len(tokens), rows, cols, tokens=tokens,
                             key_tokens=keys, num_keys=len(keys), cmap=task.cmap, dpi=task.dpi,
                             titles=titles, scale=_scale(task), row_divider=shown.row_divider,
                             col_divider=shown.col_divider, figures=figures, label=label,
                             masked=_masked(shown))
    shows_rows = any(template_shows(template, label) for label in rows)
    entry = (tuple(rows) if shows_rows else None,
             (*tokens, *keys) if template.uses_tokens else None, template)
    entries = _GRID_TEMPLATES.get(base, [])[-3:] + [entry]
    _remember(_GRID_TEMPLATES, base, entries, 4)
    return template


def template_shows(template: FrameTemplate, label: str) -> bool:
    """Whether a grid frame shows ``label`` (row labels appear only on multi-row grids)."""
    return label in template.strings


def _write(path: Path, data: bytes) -> None:
    """Write a file of a text folder atomically; ``heads/`` and ``layers/`` are never followed
    if they are links (the text folder itself is checked by the exporter)."""
    from attnviz.fileio import atomic_write

    root = path.parent.parent if path.parent.name in (HEADS_DIR, LAYERS_DIR) else path.parent
    atomic_write(path, lambda handle: handle.write(data), root=root)


def render_task(task: RenderTask, on_file: Callable[[int], None] | None = None
                ) -> tuple[int, int]:
    """Draw one task's figures into its text folder; files that exist are kept.

    Args:
        task: what to draw.
        on_file: called with 1 after each file written.

    Returns:
        ``(files written, files that already existed)``.
    """
    import numpy as np

    from attnviz.analysis.tokens import figure_view
    from attnviz.capture import load_capture
    from attnviz.render.heatmap import head_title, layer_title, overview_title

    folder = Path(task.folder)
    # A copy, not a memory map: another process truncating attention.npy while we draw would
    # kill this one with SIGBUS; a copy is read (and checked) once.
    shown = figure_view(load_capture(folder, mmap=False), words=task.words,
                        exclude_special=task.exclude_special, tokens=task.tokens,
                        queries=task.queries, keys=task.keys, clip=True)
    view, suffix = shown.capture, shown.suffix
    width, fmt = digits(view), task.fmt
    col_labels = [f"head {h}" for h in view.heads]
    written = 0

    def save(relative: str, data: bytes) -> None:
        nonlocal written
        _write(folder / relative, data)
        written += 1
        if on_file is not None:
            on_file(1)

    def head_matrix(layer: int, head: int) -> np.ndarray:
        return shown.crop(view.matrix(layer, head))  # [query, key] of the window

    def layer_block(layer: int) -> np.ndarray:
        return shown.crop(view.weights[view.layer_position(layer)])  # [head, query, key]

    heads = [(layer, head, head_file(layer, head, fmt, width)) for layer, head in task.heads]
    heads = [entry for entry in heads if not is_file(folder / entry[2])]
    layers = [(layer, layer_file(layer, fmt, width)) for layer in task.layers]
    layers = [entry for entry in layers if not is_file(folder / entry[1])]
    overview = task.overview and not is_file(folder / overview_file(fmt))
    existing = task.count - len(heads) - len(layers) - int(overview)

    titles = [head_title(view, layer, head, suffix) for layer, head, _ in heads]
    if heads and fmt == "png":
        # Every title and colour bar label in one pass (an auto top changes them per head).
        template = _head_template(task, shown, titles,
                                  ([head_matrix(layer, head)] for layer, head, _ in heads))
        for (layer, head, relative), title in zip(heads, titles):
            save(relative, template.png([head_matrix(layer, head)], title))
    elif heads:
        figure = _head_figure(task, shown, titles)
        for (layer, head, relative), title in zip(heads, titles):
            save(relative, figure.render(head_matrix(layer, head), title, fmt, task.dpi))

    grid_titles = [layer_title(view, layer, suffix) for layer, _ in layers]
    if layers and fmt == "png":
        _grid_template([f"layer {layers[0][0]}"], col_labels, shown, task, grid_titles,
                       (list(layer_block(layer)) for layer, _ in layers))
    for (layer, relative), title in zip(layers, grid_titles):
        block = layer_block(layer)
        if fmt == "png":
            grid = _grid_template([f"layer {layer}"], col_labels, shown, task, grid_titles)
            save(relative, grid.png(list(block), title))
        else:
            save(relative, _vector_grid(block[None], [f"layer {layer}"], col_labels, shown,
                                        title, task))

    if overview:
        weights = shown.crop(view.weights)  # [layer, head, query, key]
        rows = [f"layer {layer}" for layer in view.layers]
        title = overview_title(view, suffix)
        if fmt == "png":
            matrices = [m for block in weights for m in block]
            grid = _grid_template(rows, col_labels, shown, task, [title], [matrices])
            save(overview_file(fmt), grid.png(matrices, title))
        else:
            save(overview_file(fmt), _vector_grid(weights, rows, col_labels, shown, title,
                                                  task))
    # Figures hold reference cycles: free this text's now, so memory stays flat over texts.
    gc.collect()
    return written, existing


def _head_figure(task: RenderTask, shown: FigureView, titles: list[str]) -> HeadFigure:
    from attnviz.render.fast import HeadFigure

    return HeadFigure(shown.row_labels, shown.col_labels, cmap=task.cmap, annot=task.annot,
                      title=max(titles, key=len), titles=titles, scale=_scale(task),
                      dpi=task.dpi, row_divider=shown.row_divider,
                      col_divider=shown.col_divider, masked=_masked(shown))


def _vector_grid(weights: Any, rows: list[str], cols: list[str], shown: FigureView, title: str,
                 task: RenderTask) -> bytes:
    from attnviz.render.heatmap import draw_grid, figure_bytes, plain_text

    with plain_text():
        fig = draw_grid(weights, rows, cols, title=title, cmap=task.cmap,
                        tokens=shown.row_labels, key_tokens=shown.col_labels,
                        scale=_scale(task), dpi=task.dpi, row_divider=shown.row_divider,
                        col_divider=shown.col_divider, masked=_masked(shown))
    return figure_bytes(fig, task.fmt, task.dpi)



def plan_tasks(folder: Path, capture: Capture, options: ExportOptions, workers: int,
               ahead: int) -> list[RenderTask]:
    """Split a text's figures into tasks for ``workers`` drawing processes.

    Args:
        folder: the text's folder.
        capture: its capture (after the layer and head selection).
        options: what to draw.
        workers: drawing processes (1: this process draws).
        ahead: texts known to follow this one in the input.
    """
    heads = ([(layer, head) for layer in capture.layers for head in capture.heads]
             if "heads" in options.figures else [])
    layers = list(capture.layers) if "layers" in options.figures else []
    overview = "overview" in options.figures

    def task(head_part: Sequence[tuple[int, int]], layer_part: Sequence[int],
             with_overview: bool) -> RenderTask:
        return RenderTask(str(folder), tuple(head_part), tuple(layer_part), with_overview,
                          options.fmt, options.dpi, options.cmap, options.annot,
                          options.words, options.exclude_special, options.scale,
                          options.gamma, options.vmax, options.tokens, options.queries,
                          options.keys)

    # Enough texts to keep every worker busy: one task per text, so each frame is drawn
    # once. Otherwise the workers share this text: the overview, the layer grids and the
    # heads go to different workers (each kind has its own frame); a model with hundreds
    # of heads also splits its heads (a frame costs about as much as ~50 heads).
    if ahead + 1 >= workers:
        return [task(heads, layers, overview)]
    tasks = [task([], [], True)] if overview else []
    chunks = max(1, min(workers, len(heads) // HEADS_PER_SPLIT))
    size = max(1, -(-len(heads) // chunks))
    tasks += [task(heads[start:start + size], [], False)
              for start in range(0, len(heads), size)]
    if layers:
        tasks.append(task([], layers, False))
    return tasks


def write_topk(folder: Path, capture: Capture, options: ExportOptions) -> bool:
    """Write the text's topk.csv (of the options' word view) unless it is there.

    Returns:
        Whether the file was written (``False``: kept from an earlier run).
    """
    view = capture
    if options.words:
        from attnviz.analysis.tokens import merge_words

        view = merge_words(view)
    if options.exclude_special:
        from attnviz.analysis.tokens import exclude_special

        view = exclude_special(view)
    if is_file(folder / TOPK_CSV):
        return False
    import numpy as np

    from attnviz.analysis.tokens import piece_labels
    from attnviz.analysis.topk import topk_csv

    _write(folder / TOPK_CSV, topk_csv(np.asarray(view.weights), list(view.layers),
                                       list(view.heads), piece_labels(view), options.top_k,
                                       causal=view.causal, measure=view.measure
                                       ).encode("utf-8"))
    return True
