"""``export``: every head of many texts to PNG/SVG/PDF, with a progress bar."""

from __future__ import annotations

import functools
import inspect
import time
import typing
from collections.abc import Callable, Iterator
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from attnviz.cli._app import app
from attnviz.cli._common import (
    _CAPTURE_PARAMS,
    INPUT_PANEL,
    OUTPUT_PANEL,
    CaptureOptions,
    CmapOpt,
    DpiOpt,
    ExcludeSpecialOpt,
    GammaOpt,
    HeadsOpt,
    KeysOpt,
    LayersOpt,
    QueriesOpt,
    ScaleName,
    ScaleOpt,
    TokensOpt,
    VmaxOpt,
    WordsOpt,
    handle_errors,
    session,
    stderr,
    stdout,
    warn,
)
from attnviz.cli._engine import (
    BATCH_SIZE_MAX,
    EngineName,
    EngineOpt,
    GpusPerWorkerOpt,
    RayAddressOpt,
    WorkersOpt,
    ray_options,
)
from attnviz.errors import UsageError

if TYPE_CHECKING:
    from attnviz.export import ExportItem, ExportOptions, ExportProgress, ExportSummary
    from attnviz.request import CaptureRequest

F = typing.TypeVar("F", bound=Callable[..., Any])

_NOT_SHARED = ("text", "from_path", "pair")  # export has its own TEXT..., --from and --input


class ImageFormat(str, Enum):
    png = "png"
    svg = "svg"
    pdf = "pdf"


def model_options(func: F) -> F:
    """Add the shared model options (``--model``, ``--dtype``, toy options, ...) to a command.

    Like :func:`~attnviz.cli._common.capture_options` without TEXT, ``--from`` and ``--pair``:
    the command receives ``options: CaptureOptions`` with those left empty.
    """
    own_hints = typing.get_type_hints(func, include_extras=True)
    own = inspect.signature(func)
    own_params = [p.replace(annotation=own_hints.get(name, p.annotation))
                  for name, p in own.parameters.items() if name != "options"]
    shared_specs = [spec for spec in _CAPTURE_PARAMS if spec[0] not in _NOT_SHARED]
    shared = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default,
                                annotation=annotation)
              for name, annotation, default in shared_specs]
    positional = [p for p in own_params if p.kind is not inspect.Parameter.KEYWORD_ONLY]
    keyword = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own_params
               if p.kind is inspect.Parameter.KEYWORD_ONLY]
    params = [*positional, *keyword, *shared]
    shared_names = {name for name, _, _ in shared_specs}

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        bound = inspect.Signature(params).bind(*args, **kwargs)
        bound.apply_defaults()
        values = dict(bound.arguments)
        options = CaptureOptions(text=None, from_path=None, pair=None,
                                 **{k: values.pop(k) for k in list(values) if k in shared_names})
        return func(options=options, **values)

    wrapper.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    hints = {name: annotation for name, annotation, _ in shared_specs}
    hints.update({k: v for k, v in own_hints.items() if k not in ("options", "return")})
    wrapper.__annotations__ = hints
    return wrapper  # type: ignore[return-value]


def _count_texts(path: str) -> int | None:
    """Non-blank lines of an input file (streamed in bounded pieces), or ``None`` for
    standard input, a pipe or a device (counting would consume it)."""
    import os
    import stat

    if path == "-":
        return None
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return None
        count, blank = 0, True
        with open(path, "rb") as handle:
            while chunk := handle.readline(1 << 20):
                blank = blank and not chunk.strip()
                if chunk.endswith(b"\n"):
                    count, blank = count + (not blank), True
        return count + (not blank)
    except OSError:
        return None  # read_input reports it


def _items(texts: list[str], dumps: list[Path],
           lines: Iterator[ExportItem] | None) -> Iterator[ExportItem]:
    from attnviz.export import ExportItem

    for number, text in enumerate(texts, start=1):
        yield ExportItem(text=text, origin=f"TEXT {number}")
    for dump in dumps:
        yield ExportItem(dump=dump, origin=f"--from {dump}")
    if lines is not None:
        yield from lines


def _check_saved_measures(dumps: list[Path], measure: str) -> None:
    """Refuse saved captures of another measure than --measure names (given explicitly);
    a capture that cannot be read is left to the export, which reports it for that item."""
    from attnviz.capture import load_capture
    from attnviz.errors import AttnvizError
    from attnviz.session.long_path import is_long_folder

    for dump in dumps:
        if is_long_folder(dump):
            continue  # a long capture holds weights; export --long refuses a measure itself
        try:
            held = load_capture(dump, mmap=True).measure
        except AttnvizError:
            continue
        if held != measure:
            raise UsageError(f"{dump} holds the measure {held}, not {measure}",
                             "leave out --measure to export saved captures as they are, or "
                             f"dump the text again with --measure {measure}")


def _long_applies(plan: ExportOptions, dumps: list[Path]) -> bool:
    """Whether an export could take the long path by itself: it keeps every head of whole
    inputs, as words of the model's own tokens, and its saved captures (if any) are long."""
    if plan.words or plan.exclude_special or plan.heads is not None:
        return False
    if any((plan.tokens, plan.queries, plan.keys)):
        return False
    from attnviz.session.long_path import is_long_folder

    return all(is_long_folder(path) for path in dumps)


def _long_if_too_big(request: CaptureRequest, texts: list[str],
                     input_file: str | None) -> CaptureRequest:
    """The request on the long path when a text (an argument, or a line of an --input file)
    would not fit as a full capture, said on stderr; else unchanged. Standard input is read
    once, as the export goes, and so is a pipe or device: they are not scanned (their texts
    take the long path with --long)."""
    import dataclasses
    import itertools

    from attnviz.export import read_input

    def file_texts(path: Path) -> Iterator[tuple[str, str | None]]:
        # opened on the first text asked for (never, for a model without a long path)
        for item in read_input(path):
            if item.text and not item.error:
                yield item.text, item.pair

    scanned: Iterator[tuple[str, str | None]] = ((text, None) for text in texts)
    # Only a regular file is read twice: a pipe or device (and standard input) gives its
    # texts once, to the export itself.
    lines = (file_texts(Path(input_file)) if input_file not in (None, "-")
             and Path(str(input_file)).is_file() else iter(()))
    try:
        reason = session().too_big(request, itertools.chain(scanned, lines))
    finally:
        close = getattr(lines, "close", None)
        if close is not None:
            close()  # the file, when the scan stopped early
    if reason is None:
        return request
    from rich.markup import escape

    warn(escape(f"{reason}: exporting every text on the long path (--long: atlas figures, "
                "top-k, statistics and sinks per text; --no-long keeps full captures)"))
    return dataclasses.replace(request, long=True)


def _progress(total: int | None) -> ExportProgress:
    from rich.markup import escape

    from attnviz.export import ExportProgress

    if not stderr.is_terminal:
        class LogLines(ExportProgress):
            """One plain line per text (for logs and pipes)."""

            def __init__(self) -> None:
                self.done = 0
                self.steps: dict[str, Any] = {}

            def note(self, message: str) -> None:
                stderr.print(escape(message), markup=True)

            def step(self, name: str, done: int, total: int) -> None:
                from attnviz.cli._steps import Step

                made = self.steps.setdefault(name, Step(stderr, name, ""))
                made(done, total)  # one line per step still running after a moment

            def end_text(self, label: str, status: str, detail: str) -> None:
                self.done += 1
                of = f"/{total}" if total is not None else ""
                stderr.print(escape(f"[{self.done}{of}] {status} {label}: {detail}"),
                             markup=True)

        return LogLines()

    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TaskProgressColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    class Bar(ExportProgress):
        """A rich progress bar: texts, figures, rate and ETA."""

        def __init__(self) -> None:
            self.bar = Progress(
                SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                MofNCompleteColumn(), TaskProgressColumn(),
                TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                console=stderr, transient=False)
            self.texts = self.bar.add_task("texts", total=total, rate="")
            self.files = self.bar.add_task("files", total=0, rate="")
            self.step_task = self.bar.add_task("", total=None, rate="", visible=False)
            self.started = time.perf_counter()
            self.file_total = 0

        def start(self, count: int | None) -> None:
            self.bar.start()

        def note(self, message: str) -> None:
            self.bar.console.print(escape(message), markup=True)

        def begin_text(self, label: str, figures: int) -> None:
            self.file_total += figures
            self.bar.update(self.files, total=self.file_total)

        def advance(self, files: int) -> None:
            elapsed = max(time.perf_counter() - self.started, 1e-9)
            done = self.bar.tasks[self.files].completed + files
            self.bar.update(self.files, advance=files, rate=f"{done / elapsed:.1f}/s")

        def end_text(self, label: str, status: str, detail: str) -> None:
            if status == "failed":
                self.bar.console.print(
                    escape(f"[failed] {label}: {detail}"), style="red", markup=True)
            self.bar.update(self.texts, advance=1)

        def step(self, name: str, done: int, total: int) -> None:
            self.bar.update(self.step_task, description=name, completed=done, total=total,
                            visible=done < total)

        def stop(self) -> None:
            self.bar.stop()

    return Bar()


def _report(summary: ExportSummary) -> None:
    stdout.print(
        f"Exported to {summary.out_dir}: {summary.texts} text{'' if summary.texts == 1 else 's'} "
        f"({summary.exported} exported, {summary.skipped} skipped, {summary.failed} failed"
        + (f", {summary.duplicates} duplicates" if summary.duplicates else "")
        + (f", {summary.blank} blank lines" if summary.blank else "")
        + f"); {summary.files_written} files written, {summary.files_skipped} kept; "
        f"{summary.seconds:.1f} s. Index: {summary.out_dir / 'index.html'}"
        + (f"; report: {summary.report}" if summary.report is not None else ""),
        markup=False)
    if summary.failed:
        from rich.markup import escape

        for origin, message in summary.failures:
            stderr.print(f"[red]failed[/red] {escape(origin)}: {escape(message)}")
        if summary.failed > len(summary.failures):
            stderr.print(f"... and {summary.failed - len(summary.failures)} more (see index.json)")


def _all_is_none(selection: str | None) -> str | None:
    """``--layers all`` (or an empty value) selects everything, as no selection does."""
    if selection is None or selection.strip().lower() in ("", "all"):
        return None
    return selection


@app.command("export")
@handle_errors
@model_options
def export(
    options: CaptureOptions,
    texts: Annotated[list[str] | None, typer.Argument(
        metavar="TEXT", show_default=False,
        help="Texts to export (each its own folder). Use --input for many.")] = None,
    *,
    out: Annotated[Path, typer.Option(
        "--out", "-o", rich_help_panel=OUTPUT_PANEL, metavar="OUT_DIR",
        help="Output folder: one sub-folder per text, plus index.json and index.html.")],
    input_file: Annotated[str | None, typer.Option(
        "--input", "-i", rich_help_panel=INPUT_PANEL, metavar="FILE",
        help="One text per line, or JSONL with \"text\" (and optional \"pair\", \"id\"); "
             "'-' reads standard input. Blank lines are skipped and counted.")] = None,
    dumps: Annotated[list[Path] | None, typer.Option(
        "--from", rich_help_panel=INPUT_PANEL, metavar="DUMP",
        help="A saved capture (from 'attnviz dump') to export; repeat for more.")] = None,
    layers: LayersOpt = None,
    heads: HeadsOpt = None,
    fmt: Annotated[ImageFormat, typer.Option(
        "--format", "-f", rich_help_panel=OUTPUT_PANEL,
        help="Image format. PNGs use the fast renderer; SVG and PDF are drawn by "
             "matplotlib (slower).")] = ImageFormat.png,
    dpi: DpiOpt = 100,
    cmap: CmapOpt = "viridis",
    annot: Annotated[bool | None, typer.Option(
        "--annot/--no-annot", rich_help_panel=OUTPUT_PANEL, show_default=False,
        help="Write the weights in head figures' cells (default: at most 30 tokens).")] = None,
    exclude_special: ExcludeSpecialOpt = False,
    words: WordsOpt = False,
    top_k: Annotated[int, typer.Option(
        "--top-k", "-k", min=1, rich_help_panel=OUTPUT_PANEL,
        help="Keys per query in each text's topk.csv.")] = 3,
    figures: Annotated[str, typer.Option(
        "--figures", rich_help_panel=OUTPUT_PANEL, metavar="KINDS",
        help="Which figures to draw: any of heads,layers,overview.")
    ] = "heads,layers,overview",
    jobs: Annotated[int | None, typer.Option(
        "--jobs", "-j", min=1, rich_help_panel=OUTPUT_PANEL, show_default=False,
        help="Drawing processes (default: 1 for fewer than 4 texts, where starting a worker "
             "would cost more than it saves; else up to one per core). At most 4 per "
             "core.")
    ] = None,
    force: Annotated[bool, typer.Option(
        "--force", rich_help_panel=OUTPUT_PANEL,
        help="Redraw everything, even texts an earlier run finished.")] = False,
    batch_size: Annotated[int, typer.Option(
        "--batch-size", min=1, max=BATCH_SIZE_MAX, rich_help_panel=INPUT_PANEL,
        help="Texts per forward pass of the model (padded batches; 1 runs them one by one). "
             "Texts from the cache or --from skip the model.")] = 8,
    engine: EngineOpt = EngineName.local,
    ray_address: RayAddressOpt = None,
    workers: WorkersOpt = None,
    gpus_per_worker: GpusPerWorkerOpt = None,
    html: Annotated[bool, typer.Option(
        "--html", rich_help_panel=OUTPUT_PANEL,
        help="Also write OUT_DIR/report.html: the interactive report of every exported "
             "text.")] = False,
    tokens: TokensOpt = None,
    queries: QueriesOpt = None,
    keys: KeysOpt = None,
    scale: ScaleOpt = ScaleName.power,
    gamma: GammaOpt = None,
    vmax: VmaxOpt = "auto",
) -> None:
    """Export every head of many texts: images, grids, overview, capture, top-k.

    Each text gets a folder (a slug of the text plus a hash, or the JSONL id):
    heads/L00_H00.png ..., layers/L00.png ..., overview.png, attention.npy,
    capture.json, topk.csv and export.json (what was written, "complete" once done).
    OUT_DIR/index.json and index.html list them all;
    with --html, OUT_DIR/report.html shows every text interactively.

    Files are written atomically; run the same command again to finish an
    interrupted export (--force redraws everything). A text that fails is
    reported and skipped, and the exit code is then 1.

    Examples:

      attnviz export "The cat sat on the mat" "A dog barked" -o figs/

      attnviz export --input texts.jsonl --layers 0,5 --heads 0-3 -o figs/

      attnviz export --from cat/ --format svg -o figs/

      attnviz export "The cat sat on the mat" --measure norm -o figs-norm/

      attnviz export --input texts.txt --batch-size 16 --html -o figs/

      attnviz export --input texts.txt --engine ray --workers 4 -o /shared/figs/

    With --long (inputs of 8k-100k+ tokens): each folder gets the atlas figures
    (overview, layers/), topk.csv, heads.csv (each head's statistics) and sinks.json,
    computed from the long capture in streamed passes. Export takes the long path by
    itself (and says so) when a text given as an argument or in an --input file would
    not fit as a full capture (see $ATTNVIZ_MAX_FULL_MB); --no-long keeps every weight
    of every text.

      attnviz export --input books.txt --model ./llama --long -o long-figs/
    """
    from attnviz.export import ExportOptions, export_items, read_input

    text_list = list(texts or [])
    dump_list = list(dumps or [])
    if "-" in text_list:
        raise UsageError("'-' is not a text here", "read texts from standard input with "
                         "--input -")
    if not text_list and not dump_list and input_file is None:
        raise UsageError("nothing to export: give TEXT arguments, --input FILE or --from DUMP",
                         "example: attnviz export \"The cat sat on the mat\" -o figs/")
    ray = ray_options(engine, ray_address, workers, gpus_per_worker, batch_size,
                      has_input=input_file is not None)
    if ray is not None and dump_list:
        raise UsageError("--engine ray exports the texts of --input, not saved captures (--from)",
                         "export saved captures with --engine local")
    if ray is not None and jobs is not None:
        raise UsageError("--jobs sets the drawing processes of --engine local",
                         "with --engine ray every worker draws its own texts: use --workers")
    kinds = tuple(k.strip().lower() for k in figures.split(",") if k.strip())
    from attnviz.render.heatmap import parse_vmax

    plan = ExportOptions(fmt=fmt.value, dpi=dpi, cmap=cmap, layers=layers, heads=heads,
                            words=words, exclude_special=exclude_special, annot=annot,
                            top_k=top_k, figures=kinds, jobs=jobs, force=force,
                            batch_size=batch_size, html=html, scale=scale.value, gamma=gamma,
                            vmax=parse_vmax(vmax), tokens=tokens, queries=queries, keys=keys,
                            measure=options.measure or "weights")
    plan.check()
    if options.measure is not None:
        _check_saved_measures(dump_list, plan.measure)
    request = options.model_request(layers=_all_is_none(layers), heads=_all_is_none(heads),
                                    long_path=True)
    if request.long is None and dump_list and not text_list and input_file is None:
        from attnviz.session.long_path import is_long_folder

        if all(is_long_folder(path) for path in dump_list):  # dumps of dump --long
            import dataclasses

            request = dataclasses.replace(request, long=True)
    if request.long is None and ray is None and _long_applies(plan, dump_list):
        request = _long_if_too_big(request, text_list, input_file)
    if request.long and ray is not None:
        raise UsageError("--long exports run here, text by text",
                         "leave out --engine ray with --long")
    if text_list or input_file is not None:  # texts run the model: check it first, from its
        # config, so --layers 9 on a 6-layer model fails before the weights load
        session().check(request)
    lines = read_input(input_file) if input_file is not None else None  # opens it now
    total: int | None = None  # a long export counts nothing ahead
    if not request.long:
        counted = _count_texts(input_file) if input_file is not None else 0
        total = None if counted is None else len(text_list) + len(dump_list) + counted
    progress = _progress(total)
    progress.start(total)
    items = _items(text_list, dump_list, lines)
    try:
        if request.long:  # long inputs: atlas figures, top-k and statistics per text
            from attnviz.export.long import export_long

            summary = export_long(items, out, plan, request=request, session=session(),
                                  progress=progress)
        elif ray is not None:
            from attnviz.engine.ray_export import export_items_ray

            summary = export_items_ray(items, out, plan, spec=request.spec, ray=ray,
                                       max_tokens=request.max_tokens, truncate=request.truncate,
                                       use_cache=request.use_cache, progress=progress,
                                       note=progress.note)
        else:
            summary = export_items(items, out, plan, spec=request.spec,
                                   max_tokens=request.max_tokens, truncate=request.truncate,
                                   use_cache=request.use_cache, progress=progress,
                                   session=session())
    finally:
        stop = getattr(progress, "stop", None)
        if stop is not None:
            stop()
    _report(summary)
    if summary.failed:
        raise typer.Exit(1)
