"""``heads``: what every head does, in numbers, for a text, a capture or a corpus.

The command checks its options, calls :mod:`attnviz.analysis.corpus` and
:mod:`attnviz.analysis.heads` and prints. numpy, matplotlib and the models are imported inside
the command, so ``--help`` stays fast.
"""

from __future__ import annotations

import dataclasses
import io
import os
import re
from collections.abc import Sequence
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, cast

import typer
from rich.markup import escape

from attnviz.cli._analysis_common import check_distinct_outputs, check_image_path
from attnviz.cli._app import app
from attnviz.cli._common import (
    INPUT_PANEL,
    OUTPUT_PANEL,
    VIEW_PANEL,
    CaptureOptions,
    CmapOpt,
    DpiOpt,
    ExcludeSpecialOpt,
    HeadsOpt,
    LayersOpt,
    WordsOpt,
    capture_options,
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
from attnviz.cli.core import TableFormat
from attnviz.errors import UsageError
from attnviz.fileio import check_output

if TYPE_CHECKING:
    from attnviz.record import AttentionRecord

# Kept in step with attnviz.analysis.stats (not imported here: --help must stay light).
_STATS = ("entropy", "entropy_nats", "distance", "max_weight", "self", "previous", "next",
          "first", "sep", "punct", "local")
_SHORT = {"entropy": "ent", "entropy_nats": "nats", "distance": "dist", "max_weight": "max",
          "self": "self", "previous": "prev", "next": "next", "first": "first", "sep": "sep",
          "punct": "punct", "local": "local", "induction": "induct"}


class StatName(str, Enum):
    entropy = "entropy"
    entropy_nats = "entropy_nats"
    distance = "distance"
    max_weight = "max_weight"
    self = "self"
    previous = "previous"
    next = "next"
    first = "first"
    sep = "sep"
    punct = "punct"
    local = "local"
    induction = "induction"


class SortKey(str, Enum):
    layer = "layer"
    label = "label"
    entropy = "entropy"
    entropy_nats = "entropy_nats"
    distance = "distance"
    max_weight = "max_weight"
    self = "self"
    previous = "previous"
    next = "next"
    first = "first"
    sep = "sep"
    punct = "punct"
    local = "local"
    induction = "induction"


HEADS_HELP = "\n\n".join([
    "Say in numbers what every head does: entropy, distance, where its attention goes.",
    "For each layer and head, averaged over the query rows (and over every text of --input, "
    "weighted by tokens):",
    "\n".join([
        "- entropy: -sum a ln a of a row divided by ln(number of keys the row can see): "
        "0 one-hot, 1 uniform.",
        "- entropy_nats: the same in nats, not normalised (0 ln 0 = 0, no smoothing).",
        "- distance: mean |query - key| weighted by attention, in tokens.",
        "- max_weight: the largest weight of a row.",
        "- self, previous, next, first: the weight on the token itself, the one before, the "
        "one after, and position 0 ([CLS], <s>, or the first word).",
        "- sep: the weight on special tokens after position 0 ([SEP], </s>).",
        "- punct: the weight on punctuation tokens.",
        "- local: the weight within 2 positions of the query.",
        "- induction (causal models, live): mean weight on the induction target in a repeated "
        "random-token sequence (second occurrence of a token -> the token after its first "
        "occurrence).",
    ]),
    "Rows with a single visible key (row 0 of a causal model) or no weight (after "
    "--exclude-special) are skipped; previous and next count only rows that have that "
    "neighbour.",
    "Labels, first rule that applies: induction (score >= 0.3); self, previous-token, "
    "next-token, first-token/[CLS], [SEP], punctuation (that share >= 0.5, the largest wins); "
    "broad (entropy >= 0.9); local (local >= 0.7); otherwise mixed. A per-layer table follows: "
    "its sep column shows, e.g., the [SEP]-heavy middle layers of BERT-base (Clark et al., "
    "2019).",
    "Examples:",
    "  attnviz heads \"The cat sat on the mat.\"",
    "  attnviz heads --input sentences.txt --sort sep --format csv -o heads.csv",
    "  attnviz heads --input t.jsonl --engine ray --workers 4 --gpus-per-worker 0.5",
    "  attnviz heads \"The cat sat on the mat.\" --plot heads.png --stat entropy",
    "  attnviz heads \"A B C D\" --model toy --causal --toy-layers 2",
    "A measure's rows are scaled to sum to 1 first:",
    "  attnviz heads \"The cat sat on the mat.\" --measure norm",
    "Long inputs (--long, or by itself when every weight would not fit): the statistics the "
    "long capture streams per head, and the attention sinks (Gu et al.: tokens whose mean "
    "attention in a head exceeds 0.3).",
    "  cat book.txt | attnviz heads - --model ./llama --long -f csv -o heads.csv",
])


def _write_or_print(text: str, out: Path | None) -> None:
    if out is None:
        typer.echo(text, nl=False)
        return
    from attnviz.fileio import atomic_write_text

    atomic_write_text(out, text)
    stdout.print(str(out), markup=False)


# Which statistics a narrow terminal keeps first (the rest are left out, and named).
_PRIORITY = ("induction", "entropy", "distance", "previous", "first", "sep", "self", "next",
             "punct", "max_weight", "local", "entropy_nats")
_MIN_WIDTH = 20  # narrower consoles are treated as this wide
_TRAILING_SPACE = re.compile(r"[ \t]+(?=(?:\x1b\[[0-9;]*m)*$)")


def parse_columns(spec: str | None, keys: Sequence[str]) -> list[str] | None:
    """The statistics ``--columns`` asks for, in display order; ``None`` means fit the width.

    Args:
        spec: comma-separated names, full (``entropy``) or short as in the table header
            (``ent``), or ``all``.
        keys: the statistics the rows have, in display order.

    Raises:
        UsageError: an unknown name, or ``induction`` when the test did not run.
    """
    if spec is None or not spec.strip():
        return None
    if spec.strip().lower() == "all":
        return list(keys)
    by_name = {**{name: name for name in _SHORT}, **{short: name for name, short in _SHORT.items()}}
    wanted: list[str] = []
    for part in spec.split(","):
        name = part.strip().lower().replace("-", "_")
        if not name:
            raise UsageError(f"invalid --columns {spec!r}: empty name between commas")
        if name not in by_name:
            choices = ", ".join(f"{full} ({short})" if short != full else full
                                for full, short in _SHORT.items())
            raise UsageError(f"unknown column {part.strip()!r} in --columns",
                             f"choose from: {choices}, or all")
        full = by_name[name]
        if full not in keys:
            raise UsageError(f"--columns {part.strip()}: this table has no {full} statistic",
                             "the induction test runs on live causal models (or add "
                             "--induction)")
        wanted.append(full)
    return [k for k in keys if k in wanted]


def _console_width() -> int:
    """The width to fit: $COLUMNS when set, else the terminal's (80 when not a terminal)."""
    columns = os.environ.get("COLUMNS", "").strip()
    width = int(columns) if columns.isdigit() else stdout.width
    return max(width, _MIN_WIDTH)


def _head_table(rows: list[dict[str, Any]], keys: Sequence[str], title: str) -> Any:
    from rich import box
    from rich.table import Table

    table = Table(title=escape(title), box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False,
                  title_justify="left")
    table.add_column("L", justify="right", no_wrap=True)
    table.add_column("H", justify="right", no_wrap=True)
    table.add_column("label", style="bold", no_wrap=True)
    for key in keys:
        table.add_column(_SHORT[key], justify="right", no_wrap=True)
    for row in rows:
        table.add_row(str(row["layer"]), str(row["head"]), escape(str(row["label"])),
                      *[f"{row[k]:.2f}" for k in keys])
    return table


def _layer_table(layer_rows: list[dict[str, Any]], keys: Sequence[str],
                 short: bool = False) -> Any:
    from rich import box
    from rich.table import Table

    from attnviz.analysis.stats import SHORT_LABELS

    title = "Per layer (mean over heads" + ("; labels as in --plot)" if short else ")")
    table = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False,
                  title_justify="left")
    table.add_column("L", justify="right", no_wrap=True)
    for key in keys:
        table.add_column(_SHORT[key], justify="right", no_wrap=True)
    table.add_column("labels", min_width=12)  # wraps at ", " only when nothing else fits
    for entry in layer_rows:
        counts = escape(", ".join(f"{n} {SHORT_LABELS.get(label, label) if short else label}"
                                  for label, n in entry["labels"].items()))
        table.add_row(str(entry["layer"]), *[f"{entry[k]:.2f}" for k in keys], counts)
    return table


def fit_columns(rows: list[dict[str, Any]], keys: Sequence[str], width: int,
                layer_rows: list[dict[str, Any]] | None = None) -> list[str]:
    """The statistics that fit ``width`` characters beside layer, head and label, and beside
    the per-layer label counts in their short names (``layer_rows``), so neither table wraps.

    Columns are taken in :data:`_PRIORITY` order while both tables still fit, then shown in
    display order; at least one is always kept.
    """
    chosen: list[str] = []
    for key in (k for k in _PRIORITY if k in keys):
        trial = [k for k in keys if k in chosen or k == key]
        fits = _natural_width(_head_table(rows, trial, "")) <= width and (
            not layer_rows
            or _natural_width(_layer_table(layer_rows, trial, short=True)) <= width)
        if fits or not chosen:
            chosen.append(key)
    return [k for k in keys if k in chosen]


def fit_layer_table(layer_rows: list[dict[str, Any]], keys: Sequence[str], width: int) -> Any:
    """The per-layer table: label counts in full (``7 first-token/[CLS]``) where they fit
    beside the statistics on one line, else in the short names of the plot's cells
    (``7 first``), so that they do not wrap."""
    table = _layer_table(layer_rows, keys)
    if _natural_width(table) <= width:
        return table
    return _layer_table(layer_rows, keys, short=True)


def _natural_width(table: Any) -> int:
    """How wide a table is when nothing is wrapped or squeezed."""
    from rich.console import Console
    from rich.measure import Measurement

    console = Console(width=10_000, file=io.StringIO())
    return int(Measurement.get(console, console.options, table).maximum)


def render_plain(renderables: Sequence[Any], width: int) -> str:
    """Render rich objects at ``width`` and drop trailing spaces from every line.

    Colours are kept on a terminal; piped output is plain text.
    """
    from rich.console import Console

    console = Console(width=width, file=io.StringIO(), force_terminal=stdout.is_terminal,
                      color_system="auto" if stdout.is_terminal else None, highlight=False)
    for item in renderables:
        console.print(item)
    text = cast(io.StringIO, console.file).getvalue()
    lines = []
    for line in text.split("\n"):
        previous = None
        while previous != line:  # spaces may hide between closing colour codes
            previous, line = line, _TRAILING_SPACE.sub("", line)
        lines.append(line)
    return "\n".join(lines)


def _print_head_tables(rows: list[dict[str, Any]], layer_rows: list[dict[str, Any]],
                       title: str, columns: list[str] | None) -> None:
    keys = [k for k in (*_STATS, "induction") if rows and k in rows[0]]
    width = _console_width()
    shown = columns if columns is not None else fit_columns(rows, keys, width, layer_rows)
    table = _head_table(rows, shown, title)
    if columns is not None:  # the columns asked for, whole, even if wider than the terminal
        width = max(width, _natural_width(table))
    text = render_plain([table, "", fit_layer_table(layer_rows, shown, width)], width)
    stdout.file.write(text)
    stdout.file.flush()
    left_out = [k for k in keys if k not in shown]
    if left_out and columns is None:
        import textwrap

        note = (f"Left out to fit {width} columns: {', '.join(_SHORT[k] for k in left_out)} "
                "(--columns all shows them; --format csv has every statistic)")
        stderr.print("\n".join(textwrap.wrap(note, width)), markup=False, highlight=False)


def _with_sinks(text: str, cap: AttentionRecord, fmt: TableFormat) -> str:
    """One text's table with its attention sinks: a ``sinks`` entry in JSON, a line
    after Markdown; CSV stays one table (the sinks go to standard error)."""
    import json

    from attnviz.analysis.tables import sink_note, sink_table

    sinks = sink_table(cap)
    if fmt is TableFormat.json:
        data = json.loads(text)
        data["sinks"] = {"threshold": sinks["threshold"], "tokens": sinks["sinks"]}
        return json.dumps(data, ensure_ascii=False, indent=1) + "\n"
    if fmt is TableFormat.csv:
        stderr.print(escape(sink_note(sinks)), markup=False, highlight=False)
        return text
    return text.rstrip("\n") + "\n\n" + sink_note(sinks) + "\n"


@app.command("heads", help=HEADS_HELP)
@handle_errors
@capture_options
def heads_command(
    options: CaptureOptions,
    input_file: Annotated[Path | None, typer.Option(
        "--input", "-i", rich_help_panel=INPUT_PANEL, metavar="FILE",
        help="A corpus: one text per line, or JSONL with \"text\" (and \"pair\"); '-' reads "
             "standard input. Statistics are averaged over all texts, weighted by tokens.")
    ] = None,
    batch_size: Annotated[int, typer.Option(
        "--batch-size", min=1, max=BATCH_SIZE_MAX, rich_help_panel=INPUT_PANEL,
        help="With --input: texts per forward pass (padded batches; 1 runs them one by "
             "one).")] = 8,
    engine: EngineOpt = EngineName.local,
    ray_address: RayAddressOpt = None,
    workers: WorkersOpt = None,
    gpus_per_worker: GpusPerWorkerOpt = None,
    layers: LayersOpt = None,
    heads: HeadsOpt = None,
    sort: Annotated[SortKey, typer.Option(
        "--sort", rich_help_panel=OUTPUT_PANEL,
        help="Order rows by layer/head, by label, or by a statistic (largest first).")
    ] = SortKey.layer,
    ascending: Annotated[bool, typer.Option(
        "--ascending", rich_help_panel=OUTPUT_PANEL,
        help="With --sort STAT: smallest first.")] = False,
    fmt: Annotated[TableFormat | None, typer.Option(
        "--format", "-f", rich_help_panel=OUTPUT_PANEL, show_default=False,
        help="Output format (default: table; with --plot, the table is printed only when "
             "--format or -o is given).")
    ] = None,
    out: Annotated[Path | None, typer.Option(
        "--out", "-o", rich_help_panel=OUTPUT_PANEL,
        help="Write the table to this file instead of standard output (with --format "
             "table: as Markdown).")] = None,
    plot: Annotated[Path | None, typer.Option(
        "--plot", rich_help_panel=OUTPUT_PANEL, metavar="PATH",
        help="Draw a layers x heads heatmap of --stat with the labels in the cells (.png, "
             ".svg or .pdf) and print its path instead of the table (add --format or -o for "
             "the table as well).")] = None,
    stat: Annotated[StatName, typer.Option(
        "--stat", rich_help_panel=OUTPUT_PANEL, help="The statistic --plot shows.")
    ] = StatName.entropy,
    cmap: CmapOpt = "viridis",
    dpi: DpiOpt = 100,
    induction: Annotated[bool | None, typer.Option(
        "--induction/--no-induction", rich_help_panel=VIEW_PANEL, show_default=False,
        help="Run the repeated random-token induction test (default: for causal models run "
             "live, not with --from).")] = None,
    columns: Annotated[str | None, typer.Option(
        "--columns", "-c", rich_help_panel=OUTPUT_PANEL, metavar="LIST",
        help="Statistics in the table, e.g. ent,prev,sep (names as in the header or in full), "
             "or all. Default: as many as fit the terminal width. csv, json and markdown "
             "always hold every statistic.")] = None,
    exclude_special: ExcludeSpecialOpt = False,
    words: WordsOpt = False,
) -> None:
    """Head statistics and pattern labels of a text, a capture or a corpus."""
    check_output(out)
    from attnviz.analysis.heads import head_report, measure_induction

    sort_key = sort.value
    stat_key = stat.value
    parse_columns(columns, (*_STATS, "induction"))  # a misspelt name fails before any work
    check_image_path(plot, "--plot")
    check_distinct_outputs(out=out, plot=plot)
    if plot is not None:
        from attnviz.render.heatmap import check_cmap

        check_cmap(cmap)
    ray = ray_options(engine, ray_address, workers, gpus_per_worker, batch_size,
                      has_input=input_file is not None)
    if ray is not None and (options.measure or "weights") != "weights":
        raise UsageError("--measure is not available with --engine ray yet",
                         "use --engine local (the default) for the statistics of a measure")
    ray_induction: list[Any] | None = None  # the induction test, when a Ray worker ran it
    single: AttentionRecord | None = None  # one text's record (its sinks are added)
    view: AttentionRecord  # the (last) record the statistics came from, as shown
    if input_file is not None:
        if options.long:
            raise UsageError("--long takes one text (TEXT or --from), not --input",
                             "run heads --long on each long text")
        if options.text is not None or options.from_path is not None:
            raise UsageError("give --input FILE, TEXT or --from PATH, not several")
        if options.pair is not None:
            raise UsageError("--pair cannot be used with --input",
                             "give pairs in a JSONL file: {\"text\": \"...\", \"pair\": \"...\"}")
        from attnviz.analysis.corpus import read_corpus

        texts, skipped = read_corpus(input_file)
        if skipped:
            warn(f"skipped {skipped} blank line(s) or empty text(s) in {escape(str(input_file))}")
        request = options.model_request(layers=layers, heads=heads)
        from rich.progress import Progress

        from attnviz.analysis.corpus import corpus_stats

        with Progress(console=stderr, transient=True,
                      disable=len(texts) < 2 or not stderr.is_terminal) as progress:
            task = progress.add_task("Capturing", total=len(texts))
            if ray is not None:
                from attnviz.engine.ray_heads import corpus_stats_ray

                corpus, *ray_induction = corpus_stats_ray(
                    texts, spec=request.spec, options=ray, layers=layers, heads=heads,
                    max_tokens=request.max_tokens, truncate=request.truncate,
                    use_cache=request.use_cache, words=words,
                    exclude_special=exclude_special, induction=induction,
                    warn=lambda message: warn(escape(message)),
                    advance=lambda count: progress.advance(task, count),
                    note=lambda message: stderr.print(message, markup=False, style="dim"))
            else:
                corpus = corpus_stats(
                    texts, capture_all=lambda chunk: session().run_texts(
                        request, chunk, batch_size=batch_size),
                    words=words, exclude_special=exclude_special,
                    warn=lambda message: warn(escape(message)),
                    advance=lambda: progress.advance(task))
        if corpus.failed:
            warn(f"{corpus.failed} text(s) could not be used and were skipped")
        sums, view = corpus.sums, corpus.view
    else:
        from attnviz.analysis.tables import long_stat_sums
        from attnviz.cli._analysis_common import record_view

        if options.long:  # the induction test loads the model beside the long path
            if induction:
                raise UsageError("--induction runs the test beside a full capture",
                                 "leave out --induction with a long input")
            induction = False
        request = dataclasses.replace(  # every head is read: one pass computes them all
            options.request(layers=layers, heads=heads, long_path=True), long_summary=True)
        record = session().run(request)
        from attnviz.cli._steps import stepping

        with stepping(stderr, "statistics, atlas and sinks of every head",
                      "tokens") as progress:
            record.prepare(progress=progress)  # held already after a capture
        view = record_view(record, exclude_special=exclude_special, words=words)
        sums = long_stat_sums(view)  # each head's statistics, whatever holds the weights
        single = view
    live = request.from_path is None  # the induction test needs the model, not a saved capture
    if ray_induction is not None:
        scores, induction_info = ray_induction
    else:
        scores, induction_info = measure_induction(
            (lambda: session().source(request.model)) if live else None, view, induction)
    if sort_key == "induction" and scores is None:
        raise UsageError("--sort induction needs the induction test",
                         "run on a live causal model, or add --induction")
    if stat_key == "induction" and scores is None and plot is not None:
        raise UsageError("--stat induction needs the induction test",
                         "run on a live causal model, or add --induction")
    report = head_report(sums, view, scores, induction_info=induction_info, sort=sort_key,
                         ascending=ascending, words=words, exclude_special=exclude_special)
    # --plot alone draws the plot and says where it went; the 90-line table is asked for.
    table_wanted = plot is None or fmt is not None or out is not None
    fmt = fmt or TableFormat.table
    if not table_wanted:
        pass
    elif fmt is TableFormat.table and out is None:
        _print_head_tables(report.rows, report.layer_rows, report.title,
                           parse_columns(columns, report.keys))
        if single is not None:
            import textwrap

            from attnviz.analysis.tables import sink_note, sink_table

            note = textwrap.fill(sink_note(sink_table(single)), _console_width(),
                                 break_long_words=False, break_on_hyphens=False)
            stdout.print("\n" + note, markup=False, highlight=False, soft_wrap=True)
    else:
        text = report.format("markdown" if fmt is TableFormat.table else fmt.value)
        if single is not None:
            text = _with_sinks(text, single, fmt)
        _write_or_print(text, out)
    if plot is not None:
        from attnviz.render import analysis as figures
        from attnviz.render.heatmap import save_figure

        values, labels = report.grid(stat_key)
        fig = figures.draw_stat_grid(values, labels, report.layers, report.heads, stat=stat_key,
                                     title=f"{report.title}: {stat_key}", cmap=cmap)
        path = save_figure(fig, plot, dpi=dpi)
        if not table_wanted:
            stdout.print(str(path), markup=False)
            stderr.print(f"{stat_key} of {len(report.layers)} layers x {len(report.heads)} "
                         f"heads, with their labels, drawn to {path}; the table: add "
                         f"--format table (or -o FILE)", markup=False, highlight=False,
                         style="dim")
        elif fmt is TableFormat.table or out is not None:
            stdout.print(str(path), markup=False)
        else:
            stderr.print(str(path), markup=False)
