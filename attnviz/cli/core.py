"""``heatmap``, ``top-k`` and ``dump``: the core commands."""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from attnviz.cli._analysis_common import check_image_path, view_suffix
from attnviz.cli._app import app
from attnviz.cli._common import (
    OUTPUT_PANEL,
    VIEW_PANEL,
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
    capture_options,
    handle_errors,
    session,
    stdout,
    warn,
)
from attnviz.errors import UsageError
from attnviz.fileio import check_output

if TYPE_CHECKING:
    from attnviz.record import AttentionRecord


class TableFormat(str, Enum):
    table = "table"
    csv = "csv"
    json = "json"
    markdown = "markdown"


def _head_title(capture: AttentionRecord, layer: int, head: str, notes: list[str]) -> str:
    extra = f" ({', '.join(notes)})" if notes else ""
    named = head if head.startswith("mean") else f"head {head}"
    return f"{capture.title_start}layer {layer}, {named}{extra}"


def _notes(capture: AttentionRecord) -> list[str]:
    from attnviz.analysis.tokens import view_notes

    return view_notes(capture)


#: -o endings of files a capture is not (the user meant a file; dump would make a folder).
_NOT_A_CAPTURE = {".txt", ".csv", ".tsv", ".npz", ".pt", ".pth", ".pkl", ".pickle", ".h5",
                  ".hdf5", ".png", ".svg", ".pdf", ".jpg", ".jpeg", ".html", ".md", ".zip",
                  ".safetensors", ".bin", ".parquet"}


def _parse_head(head: str | None) -> int | str | None:
    if head is None:
        return None
    if head.strip().lower() == "mean":
        return "mean"
    from attnviz.selection import parse_int

    return parse_int(head, "head")


@app.command("heatmap")
@handle_errors
@capture_options
def heatmap(
    options: CaptureOptions,
    layer: Annotated[int | None, typer.Option(
        "--layer", "-l", rich_help_panel=VIEW_PANEL,
        help="Layer, 0-based; negative counts from the end. Alone: a grid of its heads.")] = None,
    head: Annotated[str | None, typer.Option(
        "--head", rich_help_panel=VIEW_PANEL,
        help="Head index, or 'mean' for the average of the layer's heads (needs --layer).")
    ] = None,
    out: Annotated[Path | None, typer.Option(
        "--out", "-o", rich_help_panel=OUTPUT_PANEL,
        help="Output file (.png, .svg or .pdf). Default: a name derived from the text.")] = None,
    cmap: CmapOpt = "viridis",
    annot: Annotated[bool | None, typer.Option(
        "--annot/--no-annot", rich_help_panel=OUTPUT_PANEL, show_default=False,
        help="Write the weights in the cells (default: when there are at most 30 tokens).")
    ] = None,
    exclude_special: ExcludeSpecialOpt = False,
    words: WordsOpt = False,
    dpi: DpiOpt = 100,
    tokens: TokensOpt = None,
    queries: QueriesOpt = None,
    keys: KeysOpt = None,
    scale: ScaleOpt = ScaleName.power,
    gamma: GammaOpt = None,
    vmax: VmaxOpt = "auto",
) -> None:
    """Draw attention as a heatmap and print the image's path.

    --layer L --head H: one head, annotated (rows: queries, columns: keys).
    --layer L alone: a grid of all heads of that layer. Neither: every layer and head.
    Figures grow with the input up to a bound, then label every n-th token; zoom into long
    inputs with --tokens A:B (or --queries / --keys). Colours: --scale power (default,
    --gamma 0.5) and --vmax auto (the largest weight shown; --vmax 1 for the fixed 0..1 scale).
    Continuation pieces of a word are marked with a middle dot (un ·bel ·ie ·va ·bly) unless
    --words merges them.

    Examples:

      attnviz heatmap "The cat sat on the mat" --layer 5 --head 3

      attnviz heatmap "The cat sat on the mat" --layer -1 --head mean -o mean.svg

      attnviz dump "A long text: a paragraph, a page or more" -o long/

      attnviz heatmap --from long/ --layer 2 --head 3 --tokens 2:8 --vmax 1

      attnviz heatmap --from cat/ --layer 0

      attnviz heatmap "The cat sat on the mat" --layer 2 --head 3 --measure norm

    Long inputs (--long, or taken by itself when every weight would not fit): a --tokens
    window of one head is drawn exactly; without one, the figures show the atlas (the largest
    weight of each block of tokens; the title gives the block size).

      cat book.txt | attnviz heatmap - -m ./lm --long -l 2 --head 3 --tokens 0:64
    """
    head_choice = _parse_head(head)
    if head_choice is not None and layer is None:
        raise UsageError("--head needs --layer", "example: --layer 5 --head 3")
    check_image_path(out, "-o")
    from attnviz.render import heatmap as render

    render.check_cmap(cmap)
    figure = render.FigureOptions(cmap=cmap, scale=scale.value, gamma=gamma, vmax=vmax,
                                  annot=annot, dpi=dpi, words=words,
                                  exclude_special=exclude_special, tokens=tokens,
                                  queries=queries, keys=keys)
    figure.colour_scale()  # a bad --vmax is reported before the slow parts
    import attnviz.cli._analysis_common as records

    if options.long:  # what the long path cannot give is refused before any work
        records.check_view(words=words, exclude_special=exclude_special)
    # --layer/--head are checked against the model's config before it loads, then the capture.
    record = session().run(options.request(
        layer=layer, head=head_choice if isinstance(head_choice, int) else None,
        long_path=True))
    suffix = view_suffix(words=words, exclude_special=exclude_special, tokens=tokens,
                         queries=queries, keys=keys)
    if record.finest_block > 1 and not (words or exclude_special):
        # Weights computed on demand: a window of one head exactly, else the atlas.
        path, warnings = records.atlas_heatmap(record, layer=layer, head=head_choice,
                                               figure=figure, out=out, suffix=suffix)
        for message in warnings:
            warn(message)
        stdout.print(str(path))
        return
    capture = record.dense("the figure")  # every weight at hand (--words: gathered, bounded)
    if layer is not None and head_choice is not None:
        shown_layer = capture.layer_index(layer)
        index = capture.head_index(head_choice)
        what = f"L{shown_layer}_mean" if index is None else f"L{shown_layer}_H{index}"
        artists = render.capture_head_figure(capture, layer, head_choice, options=figure)
        if annot and artists.layout is not None and artists.layout.dropped_values:
            warn(artists.layout.dropped_values)
        fig = artists.fig
    elif layer is not None:
        shown_layer = capture.layer_index(layer)
        fig = render.capture_grid_figure(capture, layer, options=figure)
        what = f"L{shown_layer}_heads"
    else:
        fig = render.capture_grid_figure(capture, None, options=figure)
        what = "overview"
    what += suffix
    path = render.save_figure(fig, out or records.figure_name(capture, what), dpi=dpi)
    stdout.print(str(path))


def key_label(item: dict[str, Any]) -> str:
    """A top-k key as tables show it: its position and token (``17:.``), as ``compare`` does,
    so that repeated tokens can be told apart."""
    return f"{item['key_index']}:{item['key']}"


def format_topk(rows: list[dict[str, object]], fmt: TableFormat, k: int, title: str,
                measure: str = "weights") -> str:
    """Render top-k rows as csv, json or markdown text (``k`` past the keys means all keys).

    A ``measure`` other than weights is named: a ``measure`` field in JSON, and the CSV's
    value column is called after it (``norm`` instead of ``weight``).
    """
    k = min(k, max((len(row["top"]) for row in rows), default=0))  # type: ignore[arg-type]
    if fmt is TableFormat.json:
        document: dict[str, object] = {"title": title, "k": k, "rows": rows}
        if measure != "weights":
            document = {"title": title, "measure": measure, "k": k, "rows": rows}
        return json.dumps(document, ensure_ascii=False, indent=1)
    if fmt is TableFormat.csv:
        from attnviz.csvtext import csv_text

        cells: list[list[object]] = []
        for row in rows:
            top: list[dict[str, Any]] = row["top"]  # type: ignore[assignment]
            for rank, item in enumerate(top, start=1):
                cells.append([row["query_index"], row["query"], rank, item["key_index"],
                              item["key"], f"{item['weight']:.6f}"])
        value = "weight" if measure == "weights" else measure
        return csv_text(["query_index", "query", "rank", "key_index", "key", value], cells)

    def cell(text: object) -> str:
        return str(text).replace("|", "\\|")

    lines = [f"**{title}**", "", "| # | query | " + " | ".join(f"top {i}" for i in range(1, k + 1))
             + " |", "|---|---|" + "---|" * k]
    for row in rows:
        tops = [f"{cell(key_label(t))} ({t['weight']:.3f})" for t in row["top"]]  # type: ignore
        tops += [""] * (k - len(tops))
        lines.append(f"| {row['query_index']} | {cell(row['query'])} | " + " | ".join(tops) + " |")
    return "\n".join(lines) + "\n"


def topk_table(record: AttentionRecord, layer: int, head_choice: int | str | None, k: int,
               *, words: bool = False, exclude_special: bool = False
               ) -> tuple[list[dict[str, object]], str, int]:
    """Top-k rows of a record as ``top-k`` shows them, the table's title and ``k`` cut to
    the keys there are (past the number of keys, ``-k`` means every key)."""
    import attnviz.cli._analysis_common as records
    from attnviz.analysis.tables import topk_rows

    view = records.record_view(record, words=words, exclude_special=exclude_special)
    if view.finest_block > 1:  # each key of each row is computed: a table, not a dump
        records.check_k(k)
    k = min(k, view.num_tokens)
    shown_layer = view.layer_index(layer)
    index = view.head_index("mean" if head_choice == "mean" else int(head_choice or 0))
    head_label = view.mean_label if index is None else str(index)
    which: int | str = "mean" if index is None else index
    if view.finest_block > 1:  # a pass over the head's scores: show it
        from attnviz.cli._common import stderr
        from attnviz.cli._steps import stepping

        named = "the mean of the heads" if index is None else f"head {index}"
        with stepping(stderr, f"top-{k} keys, layer {shown_layer} {named}",
                      "queries") as progress:
            rows = topk_rows(view, shown_layer, which, k, progress=progress)
    else:
        rows = topk_rows(view, shown_layer, which, k)
    title = _head_title(view, shown_layer, head_label, _notes(view)) + f", top {k}"
    return rows, title, k


@app.command("top-k")
@handle_errors
@capture_options
def top_k_command(
    options: CaptureOptions,
    layer: Annotated[int, typer.Option("--layer", "-l", rich_help_panel=VIEW_PANEL,
                                       help="Layer, 0-based; negative counts from the end.")],
    head: Annotated[str, typer.Option(
        "--head", rich_help_panel=VIEW_PANEL, help="Head index, or 'mean' of the layer's heads.")],
    k: Annotated[int, typer.Option("-k", "--top-k", min=1, rich_help_panel=VIEW_PANEL,
                                   help="How many keys to list per query (more than the "
                                        "number of tokens lists them all).")] = 3,
    fmt: Annotated[TableFormat, typer.Option("--format", "-f", rich_help_panel=OUTPUT_PANEL,
                                             help="Output format.")] = TableFormat.table,
    out: Annotated[Path | None, typer.Option(
        "--out", "-o", rich_help_panel=OUTPUT_PANEL,
        help="Write to this file instead of standard output (csv, json, markdown).")] = None,
    exclude_special: ExcludeSpecialOpt = False,
    words: WordsOpt = False,
) -> None:
    """For each query token, list the k tokens it attends to most, with their weights.

    Examples:

      attnviz top-k "The cat sat on the mat" --layer 5 --head 3

      attnviz top-k "The cat sat on the mat" -l 0 --head mean -k 2 --format csv

      attnviz top-k "The cat sat on the mat" -l 2 --head 3 --measure norm

      cat book.txt | attnviz top-k - --model ./llama --long -l 2 --head 3 -f csv -o top.csv
    """
    check_output(out)
    import attnviz.cli._analysis_common as records

    head_choice = _parse_head(head)
    if options.long:  # what the long path cannot give is refused before any work
        records.check_view(words=words, exclude_special=exclude_special)
        records.check_k(k)
    record = session().run(options.request(
        layer=layer, head=head_choice if isinstance(head_choice, int) else None,
        long_path=True))
    rows, title, k = topk_table(record, layer, head_choice, k, words=words,
                                exclude_special=exclude_special)
    if fmt is TableFormat.table and out is None:
        from rich.table import Table

        table = Table(title=title, show_lines=False)
        table.add_column("#", justify="right", style="dim")
        table.add_column("query", style="bold")
        for rank in range(1, k + 1):
            table.add_column(f"top {rank}")
        from rich.markup import escape

        for row in rows:
            table.add_row(str(row["query_index"]), escape(str(row["query"])),
                          *[f"{escape(key_label(t))} [dim]{t['weight']:.3f}[/dim]"
                            for t in row["top"]])  # type: ignore[attr-defined]
        stdout.print(table)
        return
    text = format_topk(rows, TableFormat.markdown if fmt is TableFormat.table else fmt, k, title,
                       record.measure)
    if out is None:
        typer.echo(text, nl=False)
        return
    from attnviz.fileio import atomic_write_text

    atomic_write_text(out, text)
    stdout.print(str(out))


@app.command("dump")
@handle_errors
@capture_options
def dump(
    options: CaptureOptions,
    out: Annotated[Path, typer.Option(
        "--out", "-o", rich_help_panel=OUTPUT_PANEL,
        help="A folder (gets attention.npy + capture.json) or a .npy file (gets a .json "
             "sidecar beside it).")],
    layers: LayersOpt = None,
    heads: HeadsOpt = None,
    float16: Annotated[bool, typer.Option(
        "--float16", rich_help_panel=OUTPUT_PANEL,
        help="Store weights as float16 (half the size; error at most ~2.4e-4).")] = False,
) -> None:
    """Save the capture record: attention.npy \\[layer, head, query, key] plus a JSON sidecar.

    Load it back with numpy and json alone, or re-render it with --from.

    Examples:

      attnviz dump "The cat sat on the mat" -o cat/

      attnviz dump "The cat sat" --layers 0,2-4 --heads 0-5 --float16 -o cat.npy

      attnviz dump "The cat sat on the mat" --measure norm -o cat-norm/

      python -c "import numpy; print(numpy.load('cat/attention.npy').shape)"

    The weights are written layer by layer into a memory-mapped file as the model runs, so a
    capture bigger than memory can be dumped (and read back slice by slice with --from). A
    text already in the capture cache is written from there without loading the model.

    A long input (--long, or by itself when every weight would not fit) is written as a long
    capture: a folder of queries, keys and log-sum-exp per layer (q_000.npy, k_000.npy,
    lse_000.npy) and its sidecar long.json; heatmap, top-k and heads read it back with --from.

      cat book.txt | attnviz dump - -m ./lm --long --long-dtype bfloat16 -o book/

    A folder holds one capture: once a dump into it is complete, the files of an earlier
    capture there (attention.npy, capture.json, long.json, q_/k_/lse_LLL.npy) are removed and
    nothing else is. An interrupted or failed dump leaves the folder as it was.
    """
    check_output(out, folder=True)
    request = options.request(layers=layers, heads=heads, long_path=True)
    if out.exists() and not out.is_dir() and out.suffix.lower() != ".npy":  # before any work
        raise UsageError(f"-o {out}: a file with that name exists and is not a capture; -o "
                         "names a folder (attention.npy and capture.json go in it) or a "
                         "NAME.npy file", "choose another folder for -o")
    if out.suffix.lower() in _NOT_A_CAPTURE and not out.exists():
        raise UsageError(f"-o {out}: a capture is written as a folder (attention.npy and "
                         f"capture.json) or as NAME.npy beside NAME.json, not as "
                         f"a {out.suffix} file", f"use -o {out.with_suffix('')}/ or -o "
                         f"{out.with_suffix('.npy')}")
    # A text in the capture cache is written from there (no model load), else streamed.
    path, _ = session().write(request, out, float16=float16)
    stdout.print(str(path.parent if path.name == "attention.npy" else path))
