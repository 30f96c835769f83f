"""Export: what to export and how: the inputs, their folder names, the options, the outcome.

Reads the input (a file of texts or JSONL, lazily and in bounded pieces), checks texts,
names each text's folder, checks the options and their token windows, chooses how many
drawing processes an input needs, and holds the progress events and the summary of a run.
"""

from __future__ import annotations

import collections
import json
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from attnviz.errors import InputError, UsageError
from attnviz.export.pool import JOBS_PER_CORE, default_jobs, max_jobs
from attnviz.export.write import FORMATS

if TYPE_CHECKING:
    from attnviz.capture import Capture

FIGURES = ("heads", "layers", "overview")
SLUG_LENGTH = 40
ID_LENGTH = 60
_MAX_FAILURES_KEPT = 200
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
                yield ExportItem(origin=origin, error="longer than the limit of "
                                 f"{INPUT_LINE_LIMIT >> 20} MiB")
                _skip_line(handle, origin, name)
                continue
            if number == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]
            try:
                line = raw.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError as exc:
                yield ExportItem(origin=origin,
                                 error=f"not valid UTF-8 (byte {exc.start})")
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


def check_texts(text: str, pair: str | None) -> None:
    """Raise :class:`InputError` for a text or pair a model cannot use."""
    check_text(text)
    if pair is not None:
        check_text(pair, "the pair")


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
FOLDER_NAME = re.compile(r"[a-z0-9][a-z0-9-]*")  # what folder_name makes


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
        measure: what the texts' figures show: ``weights`` or a measure of
            :mod:`attnviz.measures` (``norm``...); saved captures show what they hold (the
            command line refuses one of another measure when ``--measure`` is named).
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
    measure: str = "weights"

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
        from attnviz.measures import check_measure

        self.measure = check_measure(self.measure)

    def settings(self) -> dict[str, Any]:
        """What decides the files' content (a re-run with other settings redraws).

        ``batch_size`` and ``html`` are left out: they change no text's files.
        """
        measure = {} if self.measure == "weights" else {"measure": self.measure}
        return {
            **measure,
            "format": self.fmt, "dpi": self.dpi, "cmap": self.cmap,
            "layers": normal_selection(self.layers), "heads": normal_selection(self.heads),
            "words": self.words, "exclude_special": self.exclude_special,
            "annot": self.annot, "top_k": self.top_k, "figures": sorted(self.figures),
            "scale": self.scale, "gamma": self.gamma, "vmax": self.vmax,
            "tokens": self.tokens, "queries": self.queries, "keys": self.keys,
        }


def normal_selection(selection: str | None) -> str | None:
    """A layer or head selection as the settings record it; ``None`` for all."""
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


def check_views(capture: Capture, options: ExportOptions) -> None:
    """Check that the options' word view and token windows fit this text's capture.

    Raises:
        InputError: a view or window that does not fit this text (the text fails, not the
            export).
    """
    if options.tokens or options.queries or options.keys or options.exclude_special:
        from attnviz.analysis.tokens import check_windows, view_labels

        try:
            check_windows(view_labels(capture, words=options.words,
                                      exclude_special=options.exclude_special),
                          options.tokens, options.queries, options.keys, clip=True)
        except UsageError as error:
            raise InputError(error.message, error.hint) from None


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

    def step(self, name: str, done: int, total: int) -> None:
        """A long step of one text (``"forward pass"``, its layers) is ``done`` of ``total``
        far."""


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

    def add_counts(self, part: ExportSummary) -> None:
        """Add the texts and files of ``part`` (one worker's share of the texts), but not
        its ``texts`` and ``blank``, which the driver counts."""
        self.exported += part.exported
        self.skipped += part.skipped
        self.duplicates += part.duplicates
        self.files_written += part.files_written
        self.files_skipped += part.files_skipped
        for origin, message in part.failures:
            self.add_failure(origin, message)
        self.failed += part.failed - len(part.failures)


# --------------------------------------------------------------------------- reading ahead
class Lookahead:
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

    def __iter__(self) -> Lookahead:
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

