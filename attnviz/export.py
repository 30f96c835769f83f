"""Batch export: every head of many texts as PNG, SVG or PDF, resumable, in parallel.

For each text, :func:`export_items` writes a folder::

    OUT_DIR/
        index.json, index.html       every text of this run: folder, status, files
        the-cat-sat-on-the-mat-1a2b3c4d5e/
            attention.npy             the capture [layer, head, query, key] (float32)
            capture.json              its sidecar (tokens, layers, heads, model, ...)
            topk.csv                  top-k keys of every query, every layer and head
            heads/L00_H00.png ...     one figure per head, as ``attnviz heatmap -l L --head H``
            layers/L00.png ...        one grid per layer, as ``attnviz heatmap -l L``
            overview.png              every layer and head, as ``attnviz heatmap``
            export.json               this folder's manifest; ``"complete": true`` once done

Folder names are a sanitised slug of the text plus a hash of text and pair (or the sanitised
JSONL ``id``, named so that it can never equal a text's name), so nothing in the input can reach
outside OUT_DIR, collide with another text, or exceed file-name limits. Nothing is written
through a symbolic link inside OUT_DIR (:mod:`attnviz.fileio`), one export at a time writes to
a folder (a lock file), and ``index.json`` lists the texts of every run into the folder.
Every file is written atomically; a re-run skips complete texts and finishes partial ones
(``force=True`` redraws everything). The model runs once per text in the calling process;
figures are drawn by ``jobs`` worker processes (they end with the exporting process), PNGs
with the fast renderer of :mod:`attnviz.render.fast`. At most a few texts are in flight at
once, so memory stays flat however many texts there are.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import json
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from attnviz._version import __version__
from attnviz.errors import AttnvizError, InputError, OutputError, UsageError
from attnviz.fileio import LinkError

if TYPE_CHECKING:
    from concurrent.futures import Future

    from attnviz.analysis.tokens import FigureView
    from attnviz.capture import Capture
    from attnviz.models import ModelSpec
    from attnviz.render.fast import FrameTemplate, HeadFigure
    from attnviz.render.heatmap import ColourScale
    from attnviz.session import Session

MANIFEST = "export.json"
INDEX_JSON = "index.json"
INDEX_HTML = "index.html"
TOPK_CSV = "topk.csv"
HEADS_DIR = "heads"
LAYERS_DIR = "layers"
FORMATS = ("png", "svg", "pdf")
FIGURES = ("heads", "layers", "overview")
REPORT_HTML = "report.html"
LOCK_NAME = ".attnviz-export.lock"  # held (flock) while an export writes to OUT_DIR
MANIFEST_FORMAT = "attnviz-export"
SLUG_LENGTH = 40
ID_LENGTH = 60
_MAX_FAILURES_KEPT = 200
HEADS_PER_SPLIT = 96  # below this many heads, one process draws all heads of a text
SMALL_JOB_TEXTS = 4  # fewer texts are drawn in this process by default (see jobs_for)


# --------------------------------------------------------------------------- inputs
@dataclass
class ExportItem:
    """One input of an export: a text (with optional pair and id) or a saved capture.

    Attributes:
        text: the text; ``None`` for a dump.
        pair: second sentence of a sentence pair.
        id: a name for the folder (JSONL ``id``), sanitised before use.
        dump: a saved capture (folder or ``.npy``) to render instead of running the model.
        origin: where the item came from, for messages (``"line 3 of texts.jsonl"``).
        blank: a blank input line (skipped and counted).
        error: why the input could not be read (reported as a failed text).
    """

    text: str | None = None
    pair: str | None = None
    id: str | None = None
    dump: Path | None = None
    origin: str = ""
    blank: bool = False
    error: str | None = None


def read_input(path: Path | str, stream: IO[bytes] | None = None) -> Iterator[ExportItem]:
    """Read texts from a file (``"-"``: standard input or ``stream``), one item per line.

    A file whose first non-blank line starts with ``{`` is JSONL: each line an object with
    ``text`` and optional ``pair`` and ``id``. Otherwise each line is one text. Blank lines
    come back as ``blank`` items; unreadable lines (not UTF-8, not JSON, longer than 1 MiB) as
    items with an ``error``. The file is opened now and read lazily in bounded pieces, so any
    size works, and a pipe or device does too.

    Raises:
        InputError: the file cannot be opened (missing, a folder); while reading, a line with
            no end in 64 MiB (``/dev/zero``).
    """
    import sys

    from attnviz.fileio import open_input

    if str(path) == "-":
        handle = stream if stream is not None else sys.stdin.buffer
        return _read_lines(handle, "standard input", close=False)
    return _read_lines(open_input(path, "input file"), str(path), close=True)


_SKIP_LIMIT = 64 << 20  # bytes read past an over-long line looking for its end


def _read_lines(handle: IO[bytes], name: str, *, close: bool) -> Iterator[ExportItem]:
    from attnviz.fileio import INPUT_LINE_LIMIT

    jsonl: bool | None = None
    number = 0
    try:
        while True:
            # Bounded reads: a line longer than the limit (or an endless one, /dev/zero) is
            # reported, never held in memory.
            raw = handle.readline(INPUT_LINE_LIMIT + 1)
            if not raw:
                break
            number += 1
            origin = f"line {number} of {name}"
            if len(raw) > INPUT_LINE_LIMIT and not raw.endswith(b"\n"):
                yield ExportItem(origin=origin, error=f"{origin} is longer than the limit of "
                                 f"{INPUT_LINE_LIMIT >> 20} MiB")
                _skip_line(handle, origin, name)
                continue
            if number == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]
            try:
                line = raw.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError as exc:
                yield ExportItem(origin=origin,
                                 error=f"{origin} is not valid UTF-8 (byte {exc.start})")
                continue
            if not line.strip():
                yield ExportItem(origin=origin, blank=True)
                continue
            if jsonl is None:
                jsonl = line.lstrip().startswith("{")
            yield _jsonl_item(line, origin) if jsonl else ExportItem(text=line, origin=origin)
    finally:
        if close:
            handle.close()


def _skip_line(handle: IO[bytes], origin: str, name: str) -> None:
    """Read past the rest of an over-long line; stop the input if it seems to have no end."""
    skipped = 0
    while skipped < _SKIP_LIMIT:
        chunk = handle.readline(1 << 20)
        if not chunk or chunk.endswith(b"\n"):
            return
        skipped += len(chunk)
    raise InputError(f"{origin} is longer than {_SKIP_LIMIT >> 20} MiB: stopped reading {name}",
                     "give a text file with one text per line")


def _jsonl_item(line: str, origin: str) -> ExportItem:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        return ExportItem(origin=origin, error=f"not valid JSON ({exc.msg})")
    if not isinstance(record, dict):
        return ExportItem(origin=origin, error="not a JSON object")
    text, pair, ident = record.get("text"), record.get("pair"), record.get("id")
    if not isinstance(text, str):
        return ExportItem(origin=origin, error="no \"text\" string")
    if pair is not None and not isinstance(pair, str):
        return ExportItem(origin=origin, error="\"pair\" must be a string")
    if ident is not None and not isinstance(ident, (str, int)):
        return ExportItem(origin=origin, error="\"id\" must be a string or a number")
    return ExportItem(text=text, pair=pair, id=None if ident is None else str(ident),
                      origin=origin)


def check_text(text: str, what: str = "the text") -> None:
    """Raise :class:`InputError` for text a model cannot use (empty, NUL characters)."""
    if not text.strip():
        raise InputError(f"{what} is empty", "remove empty texts from the input")
    if "\x00" in text:
        raise InputError(f"{what} contains a NUL character (\\x00)",
                         "remove control characters from the text")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:  # bytes of a command line that were not UTF-8
        raise InputError(f"{what} is not valid UTF-8 (at character {exc.start})",
                         "pass the text encoded as UTF-8") from None


# --------------------------------------------------------------------------- names
def folder_name(text: str, pair: str | None = None, ident: str | None = None,
                salt: str = "") -> str:
    """The folder of one text: a slug of the text plus a hash, or the sanitised id.

    Only ``a-z``, ``0-9`` and ``-`` are used, at most ~70 characters, never a Windows reserved
    name, so the name is valid on Linux, macOS and Windows and cannot leave OUT_DIR. Three
    kinds of names that can never be equal:

    * a text: ``<slug>-<10 hex digits>`` (a slug never holds ``--``);
    * a JSONL id that is already such a slug and does not end like a text's name
      (``-`` and 10 hex digits): the id itself, e.g. ``doc-17``;
    * any other id: ``<slug>--<8 hex digits of the id>`` (``a/b`` and ``a_b`` stay apart).
    """
    from attnviz.fileio import short_hash, slugify

    if ident is not None:
        slug = slugify(ident, ID_LENGTH)
        if slug == ident and not _TEXT_NAME.search(ident):
            return slug
        return f"{slug}--{short_hash(ident, length=8)}"
    return f"{slugify(text, SLUG_LENGTH)}-{short_hash(text, pair or '', salt, length=10)}"


_TEXT_NAME = re.compile(r"-[0-9a-f]{10}$")  # how the folder name of a text ends


def head_file(layer: int, head: int, fmt: str, digits: int = 2) -> str:
    """Relative path of a head's figure, e.g. ``heads/L03_H11.png``."""
    return f"{HEADS_DIR}/L{layer:0{digits}d}_H{head:0{digits}d}.{fmt}"


def layer_file(layer: int, fmt: str, digits: int = 2) -> str:
    """Relative path of a layer's grid, e.g. ``layers/L03.png``."""
    return f"{LAYERS_DIR}/L{layer:0{digits}d}.{fmt}"


def overview_file(fmt: str) -> str:
    """Relative path of the model overview."""
    return f"overview.{fmt}"


def _digits(capture: Capture) -> int:
    return max(2, len(str(max(capture.num_layers, capture.num_heads) - 1)))


# --------------------------------------------------------------------------- options
@dataclass
class ExportOptions:
    """How to draw and what to write.

    Attributes:
        fmt: ``png``, ``svg`` or ``pdf``.
        dpi: resolution of raster images.
        cmap: matplotlib colour map.
        layers: layer selection (``"0,2-4"``; ``None``: all).
        heads: head selection (``None``: all).
        words: merge subword tokens into words.
        exclude_special: drop special tokens and renormalise rows.
        annot: cell values in head figures; ``None``: when there are at most 30 tokens.
        top_k: keys per query in ``topk.csv``.
        figures: which figures to draw: any of ``heads``, ``layers``, ``overview``.
        jobs: worker processes; ``None``: chosen by the input's size (:func:`jobs_for`: 1
            for a few texts, else up to the number of cores); 1 draws in this process; at
            most :func:`max_jobs`.
        force: redraw everything, even what an earlier run finished.
        batch_size: texts per forward pass of the model (padded batches; 1: one by one).
        html: also write ``report.html``, the interactive report of every exported text.
        scale, gamma, vmax: the colour scale (``attnviz.render.heatmap.ColourScale``):
            ``linear``/``power``/``log``, the power's exponent, the top weight (``None``: each
            figure's largest weight; ``1.0``: the fixed 0..1 scale).
        tokens, queries, keys: windows of every figure (``"10:40"``, ``"bank:loan"``; see
            ``attnviz.analysis.tokens.parse_window``).
    """

    fmt: str = "png"
    dpi: int = 100
    cmap: str = "viridis"
    layers: str | None = None
    heads: str | None = None
    words: bool = False
    exclude_special: bool = False
    annot: bool | None = None
    top_k: int = 3
    figures: tuple[str, ...] = FIGURES
    jobs: int | None = None
    force: bool = False
    batch_size: int = 8
    html: bool = False
    scale: str = "power"  # attnviz.render.heatmap.DEFAULT_SCALE
    gamma: float | None = None  # None: attnviz.render.heatmap.DEFAULT_GAMMA (power scale)
    vmax: float | None = None  # auto
    tokens: str | None = None
    queries: str | None = None
    keys: str | None = None

    def check(self) -> None:
        """Raise :class:`UsageError` for impossible values."""
        from attnviz.render.heatmap import check_cmap

        if self.fmt not in FORMATS:
            raise UsageError(f"unknown format {self.fmt!r}", "use png, svg or pdf")
        if not 20 <= self.dpi <= 600:
            raise UsageError(f"--dpi {self.dpi} is out of range", "use 20 to 600")
        if self.top_k < 1:
            raise UsageError("--top-k must be at least 1")
        unknown = [f for f in self.figures if f not in FIGURES]
        if unknown:
            raise UsageError(f"unknown figure kind {unknown[0]!r}",
                             f"choose from {', '.join(FIGURES)}")
        if self.jobs is not None and self.jobs < 1:
            raise UsageError("--jobs must be at least 1")
        if self.jobs is not None and self.jobs > max_jobs():
            raise UsageError(f"--jobs {self.jobs} is too many: use at most {max_jobs()} "
                             f"({JOBS_PER_CORE} per core of the {default_jobs()} this process "
                             "may use)", "leave --jobs out to use one per core")
        if self.batch_size < 1:
            raise UsageError("--batch-size must be at least 1")
        check_cmap(self.cmap)
        from attnviz.analysis.tokens import check_window_syntax
        from attnviz.render.heatmap import ColourScale

        ColourScale.of(self.scale, self.gamma, self.vmax)
        for option, spec in (("--tokens", self.tokens), ("--queries", self.queries),
                             ("--keys", self.keys)):
            check_window_syntax(spec, option)

    def settings(self) -> dict[str, Any]:
        """What decides the files' content (a re-run with other settings redraws).

        ``batch_size`` and ``html`` are left out: they change no text's files.
        """
        return {
            "format": self.fmt, "dpi": self.dpi, "cmap": self.cmap,
            "layers": _normal(self.layers), "heads": _normal(self.heads),
            "words": self.words, "exclude_special": self.exclude_special,
            "annot": self.annot, "top_k": self.top_k, "figures": sorted(self.figures),
            "scale": self.scale, "gamma": self.gamma, "vmax": self.vmax,
            "tokens": self.tokens, "queries": self.queries, "keys": self.keys,
        }


def _normal(selection: str | None) -> str | None:
    if selection is None or selection.strip().lower() in ("", "all"):
        return None
    return "".join(selection.split())


def jobs_for(items: Sequence[ExportItem], cores: int) -> int:
    """The default number of drawing processes for an input that starts with ``items``.

    A worker process takes about 1 s to start (a new interpreter importing numpy and
    matplotlib), about what one text's figures take to draw; one text drawn by two workers
    was no faster than by one. So an input of fewer than :data:`SMALL_JOB_TEXTS` texts is
    drawn in this process, and a bigger one by up to one worker per core with at least two
    texts each.
    """
    texts = sum(1 for item in items if not item.blank and not item.error)
    if texts < SMALL_JOB_TEXTS:
        return 1
    return max(1, min(cores, texts // 2))


def default_jobs() -> int:
    """The number of cores this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # macOS, Windows
        return max(1, os.cpu_count() or 1)


JOBS_PER_CORE = 4  # drawing is CPU-bound: more processes than this only cost memory


def max_jobs() -> int:
    """The most drawing processes ``--jobs`` may ask for: 4 per core, at least 4."""
    return max(4, JOBS_PER_CORE * default_jobs())


# --------------------------------------------------------------------------- progress
class ExportProgress:
    """Receives progress events; the default does nothing (the CLI shows a bar or log lines)."""

    def start(self, total: int | None) -> None:
        """The export starts; ``total`` texts if known."""

    def note(self, message: str) -> None:
        """Something worth saying (loading the model, a warning)."""

    def begin_text(self, label: str, figures: int) -> None:
        """A text's capture is ready and ``figures`` files are to be drawn."""

    def advance(self, files: int) -> None:
        """``files`` more files were drawn."""

    def end_text(self, label: str, status: str, detail: str) -> None:
        """A text is done: ``status`` is ``exported``, ``skipped`` or ``failed``."""


@dataclass
class ExportSummary:
    """What an export did."""

    out_dir: Path
    texts: int = 0  # inputs that were not blank
    exported: int = 0
    skipped: int = 0  # complete from an earlier run
    duplicates: int = 0  # the same text (and pair) again in this input: exported once
    failed: int = 0
    blank: int = 0
    files_written: int = 0
    files_skipped: int = 0
    seconds: float = 0.0
    failures: list[tuple[str, str]] = field(default_factory=list)  # (origin, message)
    report: Path | None = None  # report.html, with ``html=True``

    def add_failure(self, origin: str, message: str) -> None:
        self.failed += 1
        if len(self.failures) < _MAX_FAILURES_KEPT:
            self.failures.append((origin, message))


# --------------------------------------------------------------------------- drawing
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


def _head_template(task: RenderTask, shown: FigureView, titles: list[str],
                   figures: Iterable[Sequence[Any]] = ()) -> FrameTemplate:
    """The head frame of this text; ``figures`` (each ``[matrix]``) have their colour bar
    labels drawn with the titles, in one pass."""
    from attnviz.render.fast import head_template

    rows, cols = tuple(shown.row_labels), tuple(shown.col_labels)
    key = (task.folder, rows, cols, task.cmap, task.dpi, task.annot, _scale(task),
           shown.row_divider, shown.col_divider)
    template = _HEAD_TEMPLATES.get(key)
    if template is None:
        template = head_template(rows, cols, cmap=task.cmap, dpi=task.dpi, annot=task.annot,
                                 titles=titles, scale=_scale(task),
                                 row_divider=shown.row_divider, col_divider=shown.col_divider,
                                 figures=figures)
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
    base = (len(rows), tuple(cols), len(tokens), len(keys), task.cmap, task.dpi, _scale(task),
            shown.row_divider, shown.col_divider)
    for entry_rows, entry_tokens, template in _GRID_TEMPLATES.get(base, []):
        if entry_rows in (None, tuple(rows)) and entry_tokens in (None, (*tokens, *keys)):
            template.prepare(titles, figures)
            _GRID_TEMPLATES.move_to_end(base)
            return template
    template = grid_template(len(rows), len(cols), len(tokens), rows, cols, tokens=tokens,
                             key_tokens=keys, num_keys=len(keys), cmap=task.cmap, dpi=task.dpi,
                             titles=titles, scale=_scale(task), row_divider=shown.row_divider,
                             col_divider=shown.col_divider, figures=figures)
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


def _printable(text: str | None) -> str | None:
    """``text`` with what UTF-8 cannot hold (bytes of a non-UTF-8 argument) as ``?``."""
    if text is None:
        return None
    return text.encode("utf-8", "replace").decode("utf-8")


def _is_file(path: Path) -> bool:
    """A regular file (a link standing there is not one: it is replaced, never followed)."""
    import stat

    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


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
    digits, fmt = _digits(view), task.fmt
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

    heads = [(layer, head, head_file(layer, head, fmt, digits)) for layer, head in task.heads]
    heads = [entry for entry in heads if not _is_file(folder / entry[2])]
    layers = [(layer, layer_file(layer, fmt, digits)) for layer in task.layers]
    layers = [entry for entry in layers if not _is_file(folder / entry[1])]
    overview = task.overview and not _is_file(folder / overview_file(fmt))
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
                      col_divider=shown.col_divider)


def _vector_grid(weights: Any, rows: list[str], cols: list[str], shown: FigureView, title: str,
                 task: RenderTask) -> bytes:
    from attnviz.render.heatmap import draw_grid, figure_bytes, plain_text

    with plain_text():
        fig = draw_grid(weights, rows, cols, title=title, cmap=task.cmap,
                        tokens=shown.row_labels, key_tokens=shown.col_labels,
                        scale=_scale(task), dpi=task.dpi, row_divider=shown.row_divider,
                        col_divider=shown.col_divider)
    return figure_bytes(fig, task.fmt, task.dpi)


def _worker_start(parent: int | None = None) -> None:
    """Set up a new drawing worker: it dies with ``parent`` (the exporting process) and leaves
    Ctrl-C to it; then import the drawing code while the model loads in the main process."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops the workers itself
    if parent is not None:
        _die_with_parent(parent)
    import attnviz.render.fast  # noqa: F401


def _die_with_parent(parent: int) -> None:
    """End this process as soon as ``parent`` ends, however it ends (even ``kill -9``).

    Linux delivers SIGKILL to us when the parent dies (``PR_SET_PDEATHSIG``); elsewhere, and
    as a second line, a thread checks every half second that the parent is still ours.
    """
    import sys
    import threading

    if sys.platform.startswith("linux"):
        try:
            import ctypes
            import signal

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG = 1
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:  # the parent died before we could watch it
        os._exit(1)

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="attnviz-parent-watch", daemon=True).start()


def _warm() -> int:
    return os.getpid()


# --------------------------------------------------------------------------- manifests
def _read_json(path: Path) -> dict[str, Any] | None:
    if not _is_file(path):  # a link is not ours: never read through it
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


def _write_json(path: Path, data: Any) -> None:
    from attnviz.fileio import atomic_write_text

    atomic_write_text(path, json.dumps(data, ensure_ascii=False, indent=1))


def _clean_temporaries(folder: Path, root: Path | None = None) -> None:
    """Remove temporary files an interrupted run (killed mid-write) left behind: only our own
    names (``.NAME.PID.RANDOM.tmp`` of a process that is gone), never through a link."""
    from attnviz.fileio import clean_temporaries

    root = folder.parent if root is None else root
    for sub in (folder, folder / HEADS_DIR, folder / LAYERS_DIR):
        clean_temporaries(sub, root)


class _Index:
    """The run's entries, streamed to an unnamed scratch file, then written as index.json and
    index.html together with the entries of earlier runs into the same folder."""

    def __init__(self, out_dir: Path) -> None:
        from attnviz.fileio import scratch_file

        self.out_dir = out_dir
        self._scratch = scratch_file(out_dir, f"{INDEX_JSON}.entries")
        self.handle = self._scratch.__enter__()
        self.count = 0
        self.folders: set[str] = set()  # folders of this run's entries

    def add(self, entry: dict[str, Any]) -> None:
        self.handle.seek(0, os.SEEK_END)
        self.handle.write(json.dumps(entry, ensure_ascii=False) + "\n")
        self.handle.flush()
        self.count += 1
        if isinstance(entry.get("folder"), str):
            self.folders.add(entry["folder"])

    def entries(self) -> Iterator[dict[str, Any]]:
        self.handle.flush()
        self.handle.seek(0)
        for line in self.handle:
            yield json.loads(line)
        self.handle.seek(0, os.SEEK_END)

    def earlier(self) -> Iterator[dict[str, Any]]:
        """Entries of index.json from earlier runs whose folder is still here and was not
        exported again by this run (failures without a folder are not kept)."""
        for entry in read_index_entries(self.out_dir / INDEX_JSON):
            folder = entry.get("folder")
            if (isinstance(folder, str) and _FOLDER_NAME.fullmatch(folder)
                    and folder not in self.folders and _is_dir(self.out_dir / folder)):
                yield entry

    def finish(self, header: dict[str, Any]) -> None:
        """Write index.json and index.html atomically (streamed: memory stays flat)."""
        import itertools

        from attnviz.fileio import atomic_open

        try:
            with atomic_open(self.out_dir / INDEX_JSON, "w", encoding="utf-8") as out:
                head = json.dumps(header, ensure_ascii=False, indent=1)
                out.write(head[:-2] + ',\n "texts": [')
                for number, entry in enumerate(itertools.chain(self.earlier(), self.entries())):
                    out.write(("\n  " if number == 0 else ",\n  ")
                              + json.dumps(entry, ensure_ascii=False))
                out.write("\n ]\n}\n")
            with atomic_open(self.out_dir / INDEX_HTML, "w", encoding="utf-8") as out:
                _write_html(out, header, read_index_entries(self.out_dir / INDEX_JSON))
        finally:
            self.discard()

    def discard(self) -> None:
        self._scratch.__exit__(None, None, None)


_FOLDER_NAME = re.compile(r"[a-z0-9][a-z0-9-]*")  # what folder_name makes
_INDEX_READ_LIMIT = 64 << 20  # an index.json not in our line layout is read whole up to this


def read_index_entries(path: Path) -> Iterator[dict[str, Any]]:
    """The ``texts`` of an export's index.json, streamed (one entry per line, as written);
    nothing for a file that is missing, a link, or not an attnviz export index."""
    import stat

    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        return
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return
        header: list[bytes] = []
        for raw in handle:
            if raw.strip() == b'"texts": [':
                break
            header.append(raw)
            if len(header) > 1000:
                header = []
                break
        else:
            header = []
        if not header:
            yield from _index_entries_whole(handle)
            return
        if b'"format": "attnviz-export-index"' not in b"".join(header):
            return
        for raw in handle:
            line = raw.strip().rstrip(b",")
            if line in (b"]", b"}", b""):
                if line == b"]":
                    return
                continue
            try:
                entry = json.loads(line.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError):
                return
            if isinstance(entry, dict):
                yield entry


def _index_entries_whole(handle: IO[bytes]) -> Iterator[dict[str, Any]]:
    handle.seek(0)
    data = handle.read(_INDEX_READ_LIMIT + 1)
    if len(data) > _INDEX_READ_LIMIT:
        return
    try:
        index = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return
    if not isinstance(index, dict) or index.get("format") != "attnviz-export-index":
        return
    for entry in index.get("texts") or []:
        if isinstance(entry, dict):
            yield entry


def _is_dir(path: Path) -> bool:
    """A real folder (not a link to one)."""
    import stat

    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _write_html(out: IO[str], header: dict[str, Any], entries: Iterable[dict[str, Any]]) -> None:
    from html import escape
    from urllib.parse import quote

    summary = header.get("summary", {})
    out.write("<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\n"
              "<title>attnviz export</title>\n<style>body{font-family:sans-serif;margin:2em;"
              "max-width:80em}figure{margin:1.5em 0;border-top:1px solid #ccc;"
              "padding-top:1em}img{max-width:100%;height:auto}.failed{color:#b00}"
              "code{background:#f4f4f4}</style></head><body>\n<h1>attnviz export</h1>\n")
    texts = summary.get("texts", 0)
    out.write(f"<p>Last run: {escape(str(texts))} text{'' if texts == 1 else 's'}: "
              f"{escape(str(summary.get('exported', 0)))} exported, "
              f"{escape(str(summary.get('skipped', 0)))} skipped, "
              f"{escape(str(summary.get('duplicates', 0)))} duplicates, "
              f"{escape(str(summary.get('failed', 0)))} failed. Settings: "
              f"<code>{escape(json.dumps(header.get('settings', {}), ensure_ascii=False))}</code>"
              "</p>\n")
    if header.get("report"):
        report = str(header["report"])
        out.write(f"<p>Interactive report of every text: <a href=\"{quote(report)}\">"
                  f"{escape(report)}</a></p>\n")
    for entry in entries:
        text = str(entry.get("text") or "")
        shown = text if len(text) <= 300 else text[:300] + "..."
        folder = entry.get("folder")
        out.write("<figure>\n")
        out.write(f"<figcaption><b>{escape(str(entry.get('number')))}.</b> "
                  f"{escape(shown)}")
        if entry.get("pair"):
            out.write(f" | {escape(str(entry['pair'])[:300])}")
        if folder:
            out.write(f" &mdash; <a href=\"{quote(folder)}/\">{escape(folder)}/</a>")
        out.write(f" ({escape(str(entry.get('status')))}")
        if entry.get("files"):
            out.write(f", {len(entry['files'])} files")
        out.write(")</figcaption>\n")
        if entry.get("error"):
            out.write(f"<p class=\"failed\">{escape(str(entry['error']))}</p>\n")
        overview = next((f for f in entry.get("files") or []
                         if f.rsplit("/", 1)[-1].startswith("overview.")), None)
        if overview:
            source = quote(overview)
            if overview.endswith(".pdf"):
                out.write(f"<p><a href=\"{source}\">overview (PDF)</a></p>\n")
            else:
                out.write(f"<img loading=\"lazy\" src=\"{source}\" alt=\"overview\">\n")
        out.write("</figure>\n")
    out.write("</body></html>\n")


# --------------------------------------------------------------------------- the exporter
@dataclass
class _Pending:
    """A text whose figures are being drawn."""

    number: int
    item: ExportItem
    label: str
    folder: Path
    manifest: dict[str, Any]
    futures: list[Future[tuple[int, int]]]
    written: int
    existing: int
    started: float


class _Entries(_Index):
    """Index entries kept in memory: one worker's share of a distributed export."""

    def __init__(self) -> None:  # no file: the driver writes the index
        self.items: list[dict[str, Any]] = []
        self.count = 0

    def add(self, entry: dict[str, Any]) -> None:
        self.items.append(entry)
        self.count += 1


@dataclass
class _Ready:
    """A text already dealt with (failed or skipped): its index entry waits for its turn."""

    entry: dict[str, Any]


class _Lookahead:
    """An iterator that knows whether up to ``size`` more items follow."""

    def __init__(self, items: Iterable[ExportItem], size: int) -> None:
        self._items = iter(items)
        self._buffer: collections.deque[ExportItem] = collections.deque()
        self._size = max(1, size)
        self._done = False

    def _fill(self) -> None:
        while not self._done and len(self._buffer) < self._size:
            try:
                self._buffer.append(next(self._items))
            except StopIteration:
                self._done = True

    def __iter__(self) -> _Lookahead:
        return self

    def __next__(self) -> ExportItem:
        self._fill()
        if not self._buffer:
            raise StopIteration
        return self._buffer.popleft()

    def ahead(self) -> int:
        """Items (of any kind) known to follow, at most ``size``."""
        self._fill()
        return len(self._buffer)

    def peek(self) -> list[ExportItem]:
        """The items known to follow (at most ``size``), without taking them."""
        self._fill()
        return list(self._buffer)


class Exporter:
    """Runs one export; see :func:`export_items`."""

    def __init__(self, out_dir: Path, options: ExportOptions, *, spec: ModelSpec | None,
                 max_tokens: int | None, truncate: bool, use_cache: bool,
                 progress: ExportProgress, session: Session | None = None) -> None:
        self.out_dir = out_dir
        self.session = session
        self.options = options
        self.spec = spec
        self.max_tokens = max_tokens
        self.truncate = truncate
        self.use_cache = use_cache
        self.progress = progress
        self.jobs = options.jobs or default_jobs()
        self.summary = ExportSummary(out_dir)
        self.settings = options.settings()
        self._loaded = False  # the model loaded once: a later load error is one text's
        self._pool: Any = None
        self._seen: dict[str, str] = {}
        self._pending: collections.deque[_Pending | _Ready] = collections.deque()
        self._model_settings = self._describe_model()
        self.batch_size = options.batch_size
        self._stream: _Lookahead | None = None
        # Captures of texts further down the input, from the last batch (at most batch_size).
        self._prefetched: dict[int, tuple[ExportItem, Capture | InputError]] = {}
        self._drawing: set[Path] = set()  # text folders the workers are writing to

    # ------------------------------------------------------------------ model
    def _describe_model(self) -> dict[str, Any]:
        import dataclasses

        if self.spec is None:
            return {}
        return {"name": self.spec.name, "revision": self.spec.revision,
                "dtype": self.spec.dtype,
                "toy": dataclasses.asdict(self.spec.toy) if self.spec.toy is not None else None,
                "max_tokens": self.max_tokens, "truncate": self.truncate}

    def _session(self) -> Session:
        if self.session is None:
            from attnviz.session import default_session

            self.session = default_session()
        return self.session

    def _announce(self, name: str) -> None:
        self.progress.note(f"Loading {name}...")

    def _capture_text(self, text: str, pair: str | None) -> Capture:
        assert self.spec is not None
        session = self._session()
        with session.announcing(self._announce):
            capture = session.capture(text, pair, model=self.spec, max_tokens=self.max_tokens,
                                      truncate=self.truncate, use_cache=self.use_cache,
                                      write_cache=False)
        self._loaded = self._loaded or session.is_loaded(self.spec)
        return capture

    def _capture_item(self, item: ExportItem, text: str, pair: str | None) -> Capture:
        """The capture of a text item: from the current batch, else from a new one."""
        if self.batch_size > 1 and self.spec is not None:
            entry = self._prefetched.get(id(item))
            if entry is None or entry[0] is not item:
                self._prefetch(item, text, pair)
                entry = self._prefetched.get(id(item))
            if entry is not None and entry[0] is item:
                result = entry[1]
                if isinstance(result, InputError):
                    raise result
                return result
        return self._capture_text(text, pair)

    def _prefetch(self, item: ExportItem, text: str, pair: str | None) -> None:
        """Capture ``item`` and the next texts that will need the model in one batch."""
        assert self.spec is not None
        self._prefetched.clear()
        batch = [item]
        names = {folder_name(text, pair, item.id).lower()}
        for other in self._stream.peek() if self._stream is not None else []:
            if len(batch) >= self.batch_size:
                break
            name = self._needs_model(other)
            if name is not None and name not in names:
                names.add(name)
                batch.append(other)
        texts = [(text, pair)] + [(other.text or "", other.pair) for other in batch[1:]]
        session = self._session()
        try:
            with session.announcing(self._announce):
                for other, result in zip(batch, session.captures(
                        texts, model=self.spec, batch_size=self.batch_size,
                        max_tokens=self.max_tokens, truncate=self.truncate,
                        use_cache=self.use_cache, write_cache=False)):
                    self._prefetched[id(other)] = (other, result)
            self._loaded = self._loaded or session.is_loaded(self.spec)
        except InputError:
            pass  # the texts left run one by one, where the error is reported as usual

    def _needs_model(self, item: ExportItem) -> str | None:
        """The folder name (lower case) of a text item that will run through the model."""
        if item.blank or item.error or item.dump is not None or item.text is None:
            return None
        try:
            check_text(item.text)
            if item.pair is not None:
                check_text(item.pair, "the pair")
        except InputError:
            return None
        name = folder_name(item.text, item.pair, item.id)
        if name.lower() in self._seen:
            return None
        folder = self.out_dir / name
        if not self.options.force and (folder / "capture.json").is_file() and self._same_export(
                _read_json(folder / MANIFEST), {**self.settings, "source": self._model_settings},
                item.text, item.pair):
            return None  # complete or resumable: its saved capture is used
        return name.lower()

    @staticmethod
    def _same_export(manifest: dict[str, Any] | None, settings: dict[str, Any], text: str,
                     pair: str | None) -> bool:
        return (manifest is not None and manifest.get("format") == MANIFEST_FORMAT
                and manifest.get("settings") == settings and manifest.get("text") == text
                and manifest.get("pair") == pair)

    def _select(self, capture: Capture) -> Capture:
        from attnviz.selection import parse_selection

        layers, heads = self.options.layers, self.options.heads
        if _normal(layers) is None and _normal(heads) is None:
            return capture
        return capture.select(
            parse_selection(layers, capture.num_layers, "layer") if _normal(layers) else None,
            parse_selection(heads, capture.num_heads, "head") if _normal(heads) else None)

    # ------------------------------------------------------------------ pool
    def _start_pool(self) -> None:
        if self.jobs <= 1 or self._pool is not None:
            return
        import sys

        main_file = getattr(sys.modules.get("__main__"), "__file__", None)
        if main_file and not os.path.exists(main_file):  # e.g. `python - < script`:
            self.jobs = 1  # new processes could not re-import the main module
            return
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        self._pool = ProcessPoolExecutor(max_workers=self.jobs,
                                         mp_context=multiprocessing.get_context("spawn"),
                                         initializer=_worker_start, initargs=(os.getpid(),))
        for _ in range(self.jobs):  # start every worker now, while the model loads
            self._pool.submit(_warm)

    def _stop_pool(self, cancel: bool) -> None:
        """Wait for the workers to finish, or (``cancel``) end them now: an interrupted or
        failed export stops drawing at once, and their temporary files are removed."""
        pool = self._pool
        if pool is None:
            return
        if not cancel:
            pool.shutdown(wait=True)  # interrupted here: the cancelling call still finds it
            self._pool = None
            return
        self._pool = None
        processes = list((getattr(pool, "_processes", None) or {}).values())
        for process in processes:
            with contextlib.suppress(Exception):
                process.terminate()
        for process in processes:
            with contextlib.suppress(Exception):
                process.join(5)
                if process.is_alive():
                    process.kill()
                    process.join(5)
        pool.shutdown(wait=True, cancel_futures=True)
        for folder in self._drawing:  # what the ended workers were writing
            _clean_temporaries(folder, self.out_dir)

    # ------------------------------------------------------------------ run
    def run(self, items: Iterable[ExportItem]) -> ExportSummary:
        """Export ``items``; see :func:`export_items`.

        The output folder is locked for the run (a second export into it fails at once with
        an :class:`OutputError` naming the first one's process), and a folder this call created
        is removed again if the run ends with nothing written in it.
        """
        from attnviz.fileio import FolderLock, ensure_dir, remove_empty_dirs

        created: list[Path] = []
        ensure_dir(self.out_dir, created=created)
        lock = FolderLock(self.out_dir, LOCK_NAME, "another export")
        try:
            lock.acquire()
            return self._run(items)
        finally:
            lock.release()
            remove_empty_dirs(created)  # only folders left empty: a failed start

    def _run(self, items: Iterable[ExportItem]) -> ExportSummary:
        started = time.perf_counter()
        stream = _Lookahead(items, max(self.jobs, self.batch_size, SMALL_JOB_TEXTS))
        self._stream = stream
        if self.options.jobs is None:
            self.jobs = jobs_for(stream.peek(), self.jobs)
        elif stream.ahead() <= 1 and len(self.options.figures) == 1:
            self.jobs = 1  # one text, one kind of figure: one frame, nothing to share
        index = _Index(self.out_dir)
        number = 0
        try:
            self._start_pool()
            for item in stream:
                if item.blank:
                    self.summary.blank += 1
                    continue
                number += 1
                self.summary.texts += 1
                self._one(number, item, stream.ahead())
                while self._pending and (self._pool is None or len(self._pending) > self.jobs
                                         or isinstance(self._pending[0], _Ready)):
                    self._finish(self._pending.popleft(), index)
            while self._pending:
                self._finish(self._pending.popleft(), index)
            self._prefetched.clear()
            if self.options.html:
                self._write_report(index)
            self._stop_pool(cancel=False)
        except BaseException:
            self._stop_pool(cancel=True)
            self.summary.seconds = time.perf_counter() - started
            if index.count:  # what finished before the interruption stays listed
                self._write_index(index)
            else:
                index.discard()
            raise
        self.summary.seconds = time.perf_counter() - started
        self._write_index(index)
        return self.summary

    def _write_report(self, index: _Index) -> None:
        """Write report.html from the saved captures of every exported text (memory-mapped)."""
        from attnviz.capture import load_capture
        from attnviz.render.html import write_report

        folders = list(dict.fromkeys(
            entry["folder"] for entry in index.entries()
            if entry.get("status") in ("exported", "skipped") and entry.get("folder")))
        if not folders:
            self.progress.note("no text was exported, so no report.html was written")
            return
        # Copies, not memory maps: a file cut short while the report is built must be an
        # error, not a SIGBUS (the report holds every capture's weights anyway).
        captures = [load_capture(self.out_dir / name, mmap=False) for name in folders]
        self.summary.report = write_report(
            captures, self.out_dir / REPORT_HTML, top_k=self.options.top_k,
            words=self.options.words, exclude_special=self.options.exclude_special)
        self.summary.files_written += 1

    def _write_index(self, index: _Index) -> None:
        summary = self.summary
        header = {
            "format": "attnviz-export-index", "format_version": 1, "attnviz": __version__,
            "settings": {**self.settings, "model": self._model_settings},
            "summary": {"texts": summary.texts, "exported": summary.exported,
                        "skipped": summary.skipped, "duplicates": summary.duplicates,
                        "failed": summary.failed,
                        "blank": summary.blank, "files_written": summary.files_written,
                        "files_skipped": summary.files_skipped,
                        "seconds": round(summary.seconds, 3)},
        }
        if summary.report is not None:
            header["report"] = summary.report.name
        try:
            index.finish(header)
        except AttnvizError:
            index.discard()
            raise

    def _fail(self, number: int, item: ExportItem, label: str, message: str,
              folder: str | None = None) -> dict[str, Any]:
        self.summary.add_failure(item.origin or label, message)
        self.progress.end_text(label, "failed", message)
        return {"number": number, "origin": item.origin, "id": _printable(item.id),
                "text": _printable(item.text), "pair": _printable(item.pair), "folder": folder,
                "status": "failed", "error": message, "files": []}

    def _one(self, number: int, item: ExportItem, ahead: int) -> None:
        from attnviz.errors import DeviceError, ModelLoadError

        label = item.origin or f"text {number}"
        if item.error:
            self._pending.append(_Ready(self._fail(number, item, label, item.error)))
            return
        try:
            self._prepare(number, item, label, ahead)
        except UsageError as error:
            if item.dump is None and not isinstance(error, InputError):
                raise  # a selection that does not fit the model fits no text: stop
            self._pending.append(_Ready(self._fail(number, item, label, error.message)))
        except AttnvizError as error:
            if isinstance(error, OutputError) and not isinstance(error, LinkError):
                raise  # the output folder is not writable: every text would fail
            if isinstance(error, (ModelLoadError, DeviceError)) and not self._loaded \
                    and item.dump is None:
                raise  # the model cannot be loaded: every text would fail
            self._pending.append(_Ready(self._fail(number, item, label, error.message)))
        finally:
            self._prefetched.pop(id(item), None)  # drawn from disk now: free its capture

    def _prepare(self, number: int, item: ExportItem, label: str, ahead: int) -> None:
        from attnviz.capture import load_capture

        options = self.options
        dump_capture: Capture | None = None
        if item.dump is not None:
            dump_capture = load_capture(item.dump, mmap=True)
            text, pair = dump_capture.text, dump_capture.pair
            source = {"dump": dump_capture.model}
            name = folder_name(text, pair, item.id, salt=f"dump:{dump_capture.model}")
        else:
            text, pair = item.text or "", item.pair
            check_text(text)
            if pair is not None:
                check_text(pair, "the pair")
            source = self._model_settings
            name = folder_name(text, pair, item.id)
        duplicate = self._claim(number, item, label, text, pair, name, source)
        if duplicate is not None:
            self._pending.append(_Ready(duplicate))
            return
        folder = self.out_dir / name
        self._check_folder(folder)
        settings = {**self.settings, "source": source}
        manifest = _read_json(folder / MANIFEST)
        same = self._same_export(manifest, settings, text, pair)
        if same and not options.force and manifest is not None and manifest.get("complete") \
                and all(_is_file(folder / f) for f in manifest.get("files", [])):
            self.summary.skipped += 1
            self.summary.files_skipped += len(manifest.get("files", [])) + 1  # + export.json
            self.progress.end_text(label, "skipped", f"complete from an earlier run ({name})")
            self._pending.append(_Ready(self._entry(number, item, name, manifest, "skipped")))
            return
        resume = same and not options.force
        if folder.exists():
            _clean_temporaries(folder)
            if not resume:
                self._remove_outputs(folder)
        capture: Capture | None = None
        if resume and _is_file(folder / "capture.json"):
            try:
                capture = load_capture(folder, mmap=False)  # a copy: the file may change
            except AttnvizError:
                capture = None
        if capture is None:
            for stale in ("capture.json", "attention.npy"):
                (folder / stale).unlink(missing_ok=True)
            if dump_capture is not None:
                capture = self._select(dump_capture)
            else:
                capture = self._select(self._capture_item(item, text, pair))
            for message in capture.meta.get("warnings", []):
                self.progress.note(f"{label}: {message}")
        if options.tokens or options.queries or options.keys or options.exclude_special:
            from attnviz.analysis.tokens import check_windows, view_labels

            try:  # a view or window that does not fit this text fails the text, not the export
                check_windows(view_labels(capture, words=options.words,
                                          exclude_special=options.exclude_special),
                              options.tokens, options.queries, options.keys, clip=True)
            except UsageError as error:
                raise InputError(error.message, error.hint) from None
        manifest = {
            "format": MANIFEST_FORMAT, "format_version": 1, "attnviz": __version__,
            "complete": False, "settings": settings, "origin": item.origin, "id": item.id,
            "text": text, "pair": pair, "model": capture.model,
            "num_tokens": capture.num_tokens, "layers": list(capture.layers),
            "heads": list(capture.heads), "files": [],
        }
        _write_json(folder / MANIFEST, manifest)
        written = existing = 0
        if _is_file(folder / "capture.json") and _is_file(folder / "attention.npy"):
            existing += 2
        else:
            capture.save(folder)
            written += 2
        view = capture
        if options.words:
            from attnviz.analysis.tokens import merge_words

            view = merge_words(view)
        if options.exclude_special:
            from attnviz.analysis.tokens import exclude_special

            view = exclude_special(view)
        if _is_file(folder / TOPK_CSV):
            existing += 1
        else:
            import numpy as np

            from attnviz.analysis.tokens import piece_labels
            from attnviz.analysis.topk import topk_csv

            _write(folder / TOPK_CSV, topk_csv(np.asarray(view.weights), list(view.layers),
                                               list(view.heads), piece_labels(view),
                                               options.top_k, causal=view.causal
                                               ).encode("utf-8"))
            written += 1
        tasks = self._tasks(folder, capture, ahead)
        files = ["attention.npy", "capture.json", TOPK_CSV]
        digits = _digits(capture)
        heads = [(layer, head) for layer in capture.layers for head in capture.heads]
        if "heads" in options.figures:
            files += [head_file(layer, head, options.fmt, digits) for layer, head in heads]
        if "layers" in options.figures:
            files += [layer_file(layer, options.fmt, digits) for layer in capture.layers]
        if "overview" in options.figures:
            files.append(overview_file(options.fmt))
        manifest["files"] = files
        total = sum(task.count for task in tasks)
        self.progress.begin_text(label, total)
        pending = _Pending(number, item, label, folder, manifest, [], written, existing,
                           time.perf_counter())
        del capture, view, dump_capture  # the workers read the capture from disk
        if self._pool is None:
            for task in tasks:
                done, kept = render_task(task, self.progress.advance)
                pending.written += done
                pending.existing += kept
                self.progress.advance(kept)
        else:
            self._drawing.add(folder)
            pending.futures = [self._pool.submit(render_task, task) for task in tasks]
        self._pending.append(pending)

    def _claim(self, number: int, item: ExportItem, label: str, text: str, pair: str | None,
               name: str, source: dict[str, Any]) -> dict[str, Any] | None:
        """Reserve a text's folder: ``None`` for a new text, the index entry of a repeat.

        Raises:
            InputError: another text of this input uses the same id.
        """
        identity = json.dumps([text, pair, source], ensure_ascii=False)
        key = name.lower()
        previous = self._seen.get(key)
        if previous is None:
            self._seen[key] = identity
            return None
        if previous != identity:
            raise InputError(f"id {item.id!r} is used by another text in this input",
                             "give every JSONL line its own id")
        self.summary.duplicates += 1
        self.progress.end_text(label, "skipped", f"the same text as before ({name})")
        return {"number": number, "origin": item.origin, "id": item.id, "text": text,
                "pair": pair, "folder": name, "status": "duplicate", "files": []}

    # ------------------------------------------------------------------ distributed runs
    # A distributed export (attnviz.engine.ray_export) splits run(): the driver numbers the
    # items and admits each text once, workers export their share with export_part (drawing
    # in their own process), and the driver writes the index from every entry.
    def admit(self, number: int, item: ExportItem) -> dict[str, Any] | None:
        """Driver side: the index entry of an item settled without a model (an unreadable
        line, an unusable text, a repeat of an earlier text), or ``None`` for a new text that
        a worker exports. Texts only: saved captures (``dump``) are not admitted."""
        label = item.origin or f"text {number}"
        if item.error:
            return self._fail(number, item, label, item.error)
        if item.dump is not None:
            return self._fail(number, item, label, "saved captures are exported locally")
        text, pair = item.text or "", item.pair
        try:
            check_text(text)
            if pair is not None:
                check_text(pair, "the pair")
            return self._claim(number, item, label, text, pair, folder_name(text, pair, item.id),
                               self._model_settings)
        except InputError as error:
            return self._fail(number, item, label, error.message)

    def export_part(self, numbered: Sequence[tuple[int, ExportItem]]) -> list[dict[str, Any]]:
        """Worker side: export these items here, in order; returns their index entries.

        Drawing happens in this process (``jobs`` is not used); texts run through the model
        ``batch_size`` at a time. Files are written atomically and complete folders are
        skipped, so running the same part again (a retried task) writes nothing twice.

        Raises:
            UsageError, OutputError, ModelLoadError: as :meth:`run` (every text would fail).
        """
        numbers = {id(item): number for number, item in numbered}
        stream = _Lookahead((item for _, item in numbered), self.batch_size)
        self._stream = stream
        entries = _Entries()
        try:
            for item in stream:
                self._one(numbers[id(item)], item, 0)
                while self._pending:
                    self._finish(self._pending.popleft(), entries)
        finally:
            self._prefetched.clear()
            self._pending.clear()
        return entries.items

    def write_index(self, entries: Iterable[dict[str, Any]]) -> None:
        """Driver side: index.json and index.html (and report.html with ``html=True``) from
        every text's entry, in input order. When ``entries`` stops with an exception, what
        came before it is indexed and the exception raised."""
        from attnviz.fileio import ensure_dir

        ensure_dir(self.out_dir)
        index = _Index(self.out_dir)
        try:
            for entry in entries:
                index.add(entry)
            if self.options.html:
                self._write_report(index)
        except BaseException:
            if index.count:
                self._write_index(index)
            else:
                index.discard()
            raise
        self._write_index(index)

    def _remove_outputs(self, folder: Path) -> None:
        """Drop the files of an export made with other settings (only names this module
        writes, so nothing else in the folder is touched)."""
        from attnviz.fileio import list_folder, remove_file

        candidates = [folder / MANIFEST, folder / TOPK_CSV, folder / "attention.npy",
                      folder / "capture.json"]
        for fmt in FORMATS:
            candidates.append(folder / overview_file(fmt))
        for sub in (HEADS_DIR, LAYERS_DIR):  # listed without following links (see fileio)
            candidates += [folder / sub / name for name in list_folder(folder / sub,
                                                                         self.out_dir)
                           if name.rsplit(".", 1)[-1] in FORMATS and name.startswith("L")]
        for path in candidates:
            remove_file(path, self.out_dir)

    def _check_folder(self, folder: Path) -> None:
        """Refuse a text folder (or its ``heads/``, ``layers/``) that is a symbolic link.

        Raises:
            LinkError: a link; the text fails, nothing is written through it.
        """
        from attnviz.fileio import check_folder

        if check_folder(folder, self.out_dir):
            for sub in (HEADS_DIR, LAYERS_DIR):
                check_folder(folder / sub, self.out_dir)

    def _tasks(self, folder: Path, capture: Capture, ahead: int) -> list[RenderTask]:
        options = self.options
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
        if self._pool is None or ahead + 1 >= self.jobs:
            return [task(heads, layers, overview)]
        tasks = [task([], [], True)] if overview else []
        chunks = max(1, min(self.jobs, len(heads) // HEADS_PER_SPLIT))
        size = max(1, -(-len(heads) // chunks))
        tasks += [task(heads[start:start + size], [], False)
                  for start in range(0, len(heads), size)]
        if layers:
            tasks.append(task([], layers, False))
        return tasks

    def _finish(self, pending: _Pending | _Ready, index: _Index) -> None:
        if isinstance(pending, _Ready):
            index.add(pending.entry)
            return
        error: AttnvizError | None = None
        for future in pending.futures:
            try:
                done, kept = future.result()
            except AttnvizError as exc:
                error = error or exc
                continue
            except Exception as exc:
                from concurrent.futures.process import BrokenProcessPool

                if isinstance(exc, BrokenProcessPool):
                    raise AttnvizError(
                        "a drawing process stopped unexpectedly (killed, or out of memory)",
                        "run the same command again to finish the export; --jobs 1 draws in "
                        "one process and needs the least memory") from None
                raise
            pending.written += done
            pending.existing += kept
            self.progress.advance(done + kept)
        self._drawing.discard(pending.folder)
        self.summary.files_written += pending.written
        self.summary.files_skipped += pending.existing
        name = pending.folder.name
        if isinstance(error, OutputError) and not isinstance(error, LinkError):
            raise error  # the output folder is not writable: every text would fail
        if error is not None:
            index.add(self._fail(pending.number, pending.item, pending.label, error.message,
                                 folder=name))
            return
        missing = [f for f in pending.manifest["files"] if not _is_file(pending.folder / f)]
        if missing:
            index.add(self._fail(pending.number, pending.item, pending.label,
                                 f"{len(missing)} files were not written (first: {missing[0]})",
                                 folder=name))
            return
        from attnviz.fileio import signals_held

        pending.manifest["complete"] = True
        # The manifest and the index entry together: an interruption never leaves a text
        # listed as exported whose folder is not complete (nor the other way round).
        with signals_held():
            _write_json(pending.folder / MANIFEST, pending.manifest)
            index.add(self._entry(pending.number, pending.item, name, pending.manifest,
                                  "exported"))
            self.summary.files_written += 1
            self.summary.exported += 1
        seconds = time.perf_counter() - pending.started
        self.progress.end_text(pending.label, "exported",
                               f"{name}: {pending.written + 1} files written, "
                               f"{pending.existing} kept ({seconds:.1f} s)")

    def _entry(self, number: int, item: ExportItem, name: str, manifest: dict[str, Any],
               status: str) -> dict[str, Any]:
        return {"number": number, "origin": item.origin, "id": item.id,
                "text": manifest.get("text"), "pair": manifest.get("pair"), "folder": name,
                "status": status, "num_tokens": manifest.get("num_tokens"),
                "files": [f"{name}/{f}" for f in [*manifest.get("files", []), MANIFEST]]}


def export_items(items: Iterable[ExportItem], out_dir: Path | str,
                 options: ExportOptions | None = None, *, spec: ModelSpec | None = None,
                 max_tokens: int | None = None, truncate: bool = True, use_cache: bool = True,
                 progress: ExportProgress | None = None,
                 session: Session | None = None) -> ExportSummary:
    """Export every item (texts and saved captures) to ``out_dir``.

    Args:
        items: the inputs, e.g. from :func:`read_input`; read lazily.
        out_dir: the output folder (created if needed).
        options: what to draw and how.
        spec: the model texts run through (default: the bundled MiniLM).
        max_tokens: token limit per text; ``truncate``: cut past it instead of failing.
        use_cache: look texts up in the capture cache before running the model (the export
            folder keeps each capture, so nothing new is written to the cache).
        progress: receives progress events.
        session: the warm engine that loads the model and captures texts (default: the
            process-wide :func:`~attnviz.session.default_session`).

    Returns:
        The summary; ``summary.failed`` texts were reported and skipped.

    Raises:
        UsageError: a selection or option fits no text (nothing is exported).
        OutputError: the output folder cannot be written.
    """
    from attnviz.models import ModelSpec

    options = options or ExportOptions()
    options.check()
    exporter = Exporter(Path(out_dir), options, spec=spec or ModelSpec(), max_tokens=max_tokens,
                        truncate=truncate, use_cache=use_cache,
                        progress=progress or ExportProgress(), session=session)
    return exporter.run(items)


def export_texts(texts: Iterable[str], out_dir: Path | str, *, model: str | None = None,
                 **options: Any) -> ExportSummary:
    """Export every head of each text: ``export_texts(["The cat sat"], "out")``.

    Keyword options are the fields of :class:`ExportOptions` (``fmt``, ``dpi``, ``cmap``,
    ``layers``, ``heads``, ``words``, ``exclude_special``, ``annot``, ``top_k``, ``figures``,
    ``jobs``, ``force``) and ``spec``, ``max_tokens``, ``truncate``, ``use_cache``,
    ``progress`` of :func:`export_items`.
    """
    from attnviz.models import ModelSpec

    option_names = set(ExportOptions.__dataclass_fields__)
    export_options = ExportOptions(**{k: v for k, v in options.items() if k in option_names})
    rest = {k: v for k, v in options.items() if k not in option_names}
    if model is not None and "spec" not in rest:
        rest["spec"] = ModelSpec(name=model)
    items = (ExportItem(text=text, origin=f"text {n}") for n, text in enumerate(texts, 1))
    return export_items(items, out_dir, export_options, **rest)
