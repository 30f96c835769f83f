"""``heads``, ``rollout``, ``compare`` and ``explain``: what the heads do, in numbers.

The commands parse and check options, call :mod:`attnviz.analysis` and print. numpy,
matplotlib and the models are imported inside the commands, so ``--help`` stays fast.
"""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape

from attnviz.cli import app
from attnviz.cli._common import (
    INPUT_PANEL,
    MODEL_PANEL,
    OUTPUT_PANEL,
    TOY_PANEL,
    VIEW_PANEL,
    CaptureRequest,
    CmapOpt,
    DpiOpt,
    ExcludeSpecialOpt,
    HeadsOpt,
    LayersOpt,
    WordsOpt,
    capture_options,
    handle_errors,
    obtain_capture,
    stderr,
    stdout,
    view_of,
    warn,
)
from attnviz.cli.core import TableFormat
from attnviz.errors import InputError, UsageError

if TYPE_CHECKING:
    import numpy as np

    from attnviz.analysis.stats import StatSums
    from attnviz.capture import Capture
    from attnviz.models import AttentionSource

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


class HeadFusionChoice(str, Enum):
    mean = "mean"
    max = "max"
    min = "min"


class ExplainFormat(str, Enum):
    table = "table"
    json = "json"


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
    "  attnviz heads \"The cat sat on the mat.\" --plot heads.png --stat entropy",
    "  attnviz heads \"A B C D\" --model toy --causal --toy-layers 2",
])

ROLLOUT_HELP = "\n\n".join([
    "Attention rollout (Abnar and Zuidema, 2020): how much of each input token reaches each "
    "position at the top layer.",
    "Per layer, fuse the heads (--head-fusion), add the residual path and renormalise rows: "
    "A = rownorm(0.5 A + 0.5 I). Multiply upward from --start-layer: R = A_start, then "
    "R = A_l @ R. Rows of R sum to 1.",
    "Writes the heatmap, the matrix (.npy, float32) and a bar chart of one token's row "
    "(--token), and prints their paths. In a causal model rollout favours early tokens.",
    "Examples:",
    "  attnviz rollout \"The cat sat on the mat\" --token cat",
    "  attnviz rollout \"The cat sat\" --head-fusion max --start-layer 2 -o roll.png",
    "  attnviz rollout --from cat/ --npy rollout.npy",
])

COMPARE_HELP = "\n\n".join([
    "Compare attention side by side: one text in two models, two texts in one model, or the "
    "toy model without and with its causal mask.",
    "When both sides have the same tokens, a third panel shows B - A on a diverging colour map "
    "centred at 0 (red: B attends more, blue: less) and the largest changes are listed.",
    "Examples:",
    "  attnviz compare \"The bank of the river\" \"The bank approved the loan\" -l 2",
    "  attnviz compare \"The cat sat\" --model-a minilm --model-b ./my-bert",
    "  attnviz compare \"The cat sat on the mat\" --model toy --vs-causal --head 0",
    "  attnviz compare --from a/ --from b/ --layer 0 --head 3 --format json",
])

EXPLAIN_HELP = "\n\n".join([
    "Step through one toy attention head for one query token, with the model's own numbers.",
    "Prints the embeddings X; Q = X W_Q, K = X W_K, V = X W_V (this head's d_k columns); the raw "
    "scores q.k; the scaled scores q.k / sqrt(d_k); the softmax weights (they sum to 1); and "
    "the output row sum_j w_j V_j. The weights equal those of 'attnviz heatmap TEXT --model "
    "toy' with the same toy options. --no-scale shows how the softmax saturates without "
    "1/sqrt(d_k).",
    "Examples:",
    "  attnviz explain \"The cat sat on the mat\" --token cat",
    "  attnviz explain \"The cat sat on the mat\" --token mat --no-scale --d-model 64",
    "  attnviz explain \"A cat saw the mat\" -t the --toy-layers 2 -l 1 --causal",
])


# --------------------------------------------------------------------------- shared helpers
def _default_path(capture: Capture, what: str, suffix: str = ".png") -> Path:
    from attnviz.fileio import short_hash, slugify

    slug = slugify(capture.text, 30)
    digest = short_hash(capture.text, capture.pair or "", capture.model, str(capture.causal),
                        length=6)
    return Path(f"attention_{slug}_{digest}_{what}{suffix}")


def _check_image_path(path: Path | None, option: str) -> None:
    if path is not None and path.suffix.lower() not in (".png", ".svg", ".pdf"):
        raise UsageError(f"cannot tell the image format of {option} {path}",
                         "end the file name in .png, .svg or .pdf")


def _notes(capture: Capture) -> list[str]:
    notes = []
    if capture.meta.get("words_merged"):
        notes.append("word level")
    if capture.meta.get("special_excluded"):
        notes.append("special tokens excluded, rows renormalised")
    if capture.causal:
        notes.append("causal")
    return notes


def _parse_head(head: str) -> int | str:
    if head.strip().lower() == "mean":
        return "mean"
    from attnviz.selection import parse_int

    return parse_int(head, "head")


def _write_or_print(text: str, out: Path | None) -> None:
    if out is None:
        typer.echo(text, nl=False)
        return
    from attnviz.fileio import atomic_write_text

    atomic_write_text(out, text)
    stdout.print(str(out), markup=False)


# --------------------------------------------------------------------------- heads
def read_corpus(path: Path) -> tuple[list[tuple[str, str | None]], int]:
    """Texts of an ``--input`` file: one per line, or JSONL with ``text`` (and ``pair``).

    ``-`` reads standard input. A file is JSONL when it ends in ``.jsonl``/``.ndjson`` or its
    first non-blank line starts with ``{``.

    Returns:
        ``(text, pair)`` tuples and the number of blank lines or empty texts skipped.

    Raises:
        InputError: the file is missing, not UTF-8, a JSON line is malformed, or no text is left.
    """
    import sys

    if str(path) == "-":
        raw = sys.stdin.read()
    else:
        if not path.is_file():
            raise InputError(f"input file {path} does not exist",
                             "give a text file with one text per line, or JSONL with \"text\"")
        try:
            raw = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise InputError(f"{path} is not valid UTF-8 (byte {exc.start})",
                             "save the file as UTF-8 and try again") from None
        except OSError as exc:
            raise InputError(f"cannot read {path}: {exc.strerror or exc}") from None
    lines = raw.splitlines()
    first = next((line for line in lines if line.strip()), "")
    jsonl = path.suffix.lower() in (".jsonl", ".ndjson") or first.lstrip().startswith("{")
    texts: list[tuple[str, str | None]] = []
    skipped = 0
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            skipped += 1
            continue
        if not jsonl:
            texts.append((line.rstrip("\r"), None))
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InputError(f"{path} line {number} is not valid JSON ({exc.msg})",
                             "write one JSON object per line, e.g. {\"text\": \"The cat sat.\"}"
                             ) from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise InputError(f"{path} line {number} has no \"text\" string",
                             "write one JSON object per line, e.g. {\"text\": \"The cat sat.\"}")
        pair = record.get("pair")
        if pair is not None and not isinstance(pair, str):
            raise InputError(f"{path} line {number}: \"pair\" must be a string")
        if not record["text"].strip() or (pair is not None and not pair.strip()):
            skipped += 1
            continue
        texts.append((record["text"], pair))
    if not texts:
        raise InputError(f"{path} holds no texts", "write one text per line")
    return texts, skipped


class _LazyModel:
    """Loads the requested model on first use only (a cache hit never needs it)."""

    def __init__(self, request: CaptureRequest) -> None:
        self.request = request
        self.source: AttentionSource | None = None

    def __call__(self) -> AttentionSource:
        if self.source is None:
            from attnviz.cli._common import load_model

            self.source = load_model(self.request)
        return self.source


def _capture_text(model: _LazyModel, text: str, pair: str | None, layers: str | None,
                  heads: str | None) -> Capture:
    """One text's capture, from the capture cache when allowed, else from the model."""
    from attnviz.cli._common import check_text, model_spec

    request = model.request
    check_text(text)
    if pair is not None:
        check_text(pair, "the pair text")
    if request.no_cache:
        from attnviz.selection import parse_selection

        source = model()
        return source.capture(
            text, pair,
            layers=parse_selection(layers, source.num_layers, "layer") if layers else None,
            heads=parse_selection(heads, source.num_heads, "head") if heads else None,
            max_tokens=request.max_tokens, truncate=request.truncate)
    from attnviz.cache import capture_with_cache

    return capture_with_cache(model_spec(request), text, pair, load=model, layers=layers,
                              heads=heads, max_tokens=request.max_tokens,
                              truncate=request.truncate, warn=warn)


def _corpus_sums(model: _LazyModel, texts: list[tuple[str, str | None]], layers: str | None,
                 heads: str | None, words: bool, exclude_special: bool
                 ) -> tuple[StatSums, Capture]:
    """Capture every text and add up its statistics; returns the sums and the last view."""
    from rich.progress import Progress

    from attnviz.analysis.stats import stat_sums

    total: StatSums | None = None
    view: Capture | None = None
    failed = 0
    with Progress(console=stderr, transient=True,
                  disable=len(texts) < 2 or not stderr.is_terminal) as progress:
        task = progress.add_task("Capturing", total=len(texts))
        for text, pair in texts:
            try:
                capture = _capture_text(model, text, pair, layers, heads)
            except InputError as error:
                if len(texts) == 1:
                    raise
                failed += 1
                warn(escape(f"skipped a text ({error.message}): {text[:60]!r}"))
                progress.advance(task)
                continue
            for message in capture.meta.get("warnings", []):
                warn(escape(message))
            view = view_of(capture, exclude_special=exclude_special, words=words)
            sums = stat_sums(view)
            total = sums if total is None else total + sums
            progress.advance(task)
    if total is None or view is None:
        raise InputError("no text of the input could be used", "check the input file")
    if failed:
        warn(f"{failed} text(s) could not be used and were skipped")
    return total, view


def _induction(model: _LazyModel | None, capture: Capture, requested: bool | None,
               ) -> tuple[np.ndarray | None, dict[str, Any] | None]:
    if requested is False or (requested is None and (model is None or not capture.causal)):
        return None, None
    if model is None:
        raise UsageError("--induction needs a live model, not a saved capture (--from)",
                         "give TEXT or --input with --model instead of --from")
    from attnviz.analysis.induction import induction_scores

    result = induction_scores(model())
    info = {"length": result.length, "sequences": result.sequences,
            "prefix_tokens": len(result.prefix)}
    return result.for_capture(capture.layers, capture.heads), info


def format_head_table(rows: list[dict[str, Any]], layer_rows: list[dict[str, Any]],
                      fmt: TableFormat, info: dict[str, Any]) -> str:
    """Head statistics as csv, json or markdown text."""
    keys = [k for k in (*_STATS, "induction") if rows and k in rows[0]]
    if fmt is TableFormat.json:
        return json.dumps({**info, "heads": rows, "layers": layer_rows}, ensure_ascii=False,
                          indent=1) + "\n"
    if fmt is TableFormat.csv:
        import csv
        import io

        buffer = io.StringIO()
        writer = csv.writer(buffer, lineterminator="\n")
        writer.writerow(["layer", "head", "label", *keys])
        for row in rows:
            writer.writerow([row["layer"], row["head"], row["label"],
                             *[f"{row[k]:.6f}" for k in keys]])
        return buffer.getvalue()
    lines = [f"**{info['title']}**", "",
             "| layer | head | label | " + " | ".join(keys) + " |",
             "|---:|---:|---|" + "---:|" * len(keys)]
    for row in rows:
        label = str(row["label"]).replace("|", "\\|")
        lines.append(f"| {row['layer']} | {row['head']} | {label} | "
                     + " | ".join(f"{row[k]:.3f}" for k in keys) + " |")
    lines += ["", "**Per layer (mean over heads)**", "",
              "| layer | " + " | ".join(keys) + " |", "|---:|" + "---:|" * len(keys)]
    for entry in layer_rows:
        lines.append(f"| {entry['layer']} | " + " | ".join(f"{entry[k]:.3f}" for k in keys)
                     + " |")
    return "\n".join(lines) + "\n"


def _print_wide(table: Any) -> None:
    """Print a table at its natural width (wider than the console rather than truncated)."""
    from rich.measure import Measurement

    needed = Measurement.get(stdout, stdout.options.update(max_width=4000), table).maximum
    width = stdout.width
    if needed <= width:
        stdout.print(table)
        return
    stdout.width = needed
    try:
        stdout.print(table)
    finally:
        stdout.width = width


def _print_head_tables(rows: list[dict[str, Any]], layer_rows: list[dict[str, Any]],
                       title: str) -> None:
    from rich import box
    from rich.table import Table

    keys = [k for k in (*_STATS, "induction") if rows and k in rows[0]]
    table = Table(title=escape(title), box=box.SIMPLE_HEAD, pad_edge=False,
                  title_justify="left")
    table.add_column("L", justify="right", no_wrap=True)
    table.add_column("H", justify="right", no_wrap=True)
    table.add_column("label", style="bold", no_wrap=True)
    for key in keys:
        table.add_column(_SHORT[key], justify="right", no_wrap=True)
    for row in rows:
        table.add_row(str(row["layer"]), str(row["head"]), escape(str(row["label"])),
                      *[f"{row[k]:.2f}" for k in keys])
    _print_wide(table)
    summary = Table(title="Per layer (mean over heads)", box=box.SIMPLE_HEAD, pad_edge=False,
                    title_justify="left")
    summary.add_column("L", justify="right", no_wrap=True)
    for key in keys:
        summary.add_column(_SHORT[key], justify="right", no_wrap=True)
    summary.add_column("labels", no_wrap=True)
    for entry in layer_rows:
        counts = escape(", ".join(f"{n} {label}" for label, n in entry["labels"].items()))
        summary.add_row(str(entry["layer"]), *[f"{entry[k]:.2f}" for k in keys], counts)
    _print_wide(summary)


@app.command("heads", help=HEADS_HELP)
@handle_errors
@capture_options
def heads_command(
    request: CaptureRequest,
    input_file: Annotated[Path | None, typer.Option(
        "--input", "-i", rich_help_panel=INPUT_PANEL, metavar="FILE",
        help="A corpus: one text per line, or JSONL with \"text\" (and \"pair\"); '-' reads "
             "standard input. Statistics are averaged over all texts, weighted by tokens.")
    ] = None,
    layers: LayersOpt = None,
    heads: HeadsOpt = None,
    sort: Annotated[SortKey, typer.Option(
        "--sort", rich_help_panel=OUTPUT_PANEL,
        help="Order rows by layer/head, by label, or by a statistic (largest first).")
    ] = SortKey.layer,
    ascending: Annotated[bool, typer.Option(
        "--ascending", rich_help_panel=OUTPUT_PANEL,
        help="With --sort STAT: smallest first.")] = False,
    fmt: Annotated[TableFormat, typer.Option(
        "--format", "-f", rich_help_panel=OUTPUT_PANEL, help="Output format.")
    ] = TableFormat.table,
    out: Annotated[Path | None, typer.Option(
        "--out", "-o", rich_help_panel=OUTPUT_PANEL,
        help="Write the table to this file instead of standard output (with --format "
             "table: as Markdown).")] = None,
    plot: Annotated[Path | None, typer.Option(
        "--plot", rich_help_panel=OUTPUT_PANEL, metavar="PATH",
        help="Also draw a layers x heads heatmap of --stat with the labels in the cells "
             "(.png, .svg or .pdf).")] = None,
    stat: Annotated[StatName, typer.Option(
        "--stat", rich_help_panel=OUTPUT_PANEL, help="The statistic --plot shows.")
    ] = StatName.entropy,
    cmap: CmapOpt = "viridis",
    dpi: DpiOpt = 100,
    induction: Annotated[bool | None, typer.Option(
        "--induction/--no-induction", rich_help_panel=VIEW_PANEL, show_default=False,
        help="Run the repeated random-token induction test (default: for causal models run "
             "live, not with --from).")] = None,
    exclude_special: ExcludeSpecialOpt = False,
    words: WordsOpt = False,
) -> None:
    """Head statistics and pattern labels of a text, a capture or a corpus."""
    from attnviz.analysis.stats import SHORT_LABELS, table_from_sums
    from attnviz.analysis.stats import layer_table as per_layer
    from attnviz.cli._common import read_text

    sort_key = sort.value
    stat_key = stat.value
    _check_image_path(plot, "--plot")
    if plot is not None:
        from attnviz.render.heatmap import check_cmap

        check_cmap(cmap)
    model: _LazyModel | None = None
    if input_file is not None:
        if request.text is not None or request.from_path is not None:
            raise UsageError("give --input FILE, TEXT or --from PATH, not several")
        if request.pair is not None:
            raise UsageError("--pair cannot be used with --input",
                             "give pairs in a JSONL file: {\"text\": \"...\", \"pair\": \"...\"}")
        texts, skipped = read_corpus(input_file)
        if skipped:
            warn(f"skipped {skipped} blank line(s) or empty text(s) in {escape(str(input_file))}")
    elif request.from_path is not None:
        texts = []
    else:
        from attnviz.cli._common import validate_request

        validate_request(request)
        texts = [(read_text(request.text or ""), request.pair)]
    if texts:
        model = _LazyModel(request)
        sums, view = _corpus_sums(model, texts, layers, heads, words, exclude_special)
    else:
        from attnviz.analysis.stats import stat_sums

        capture = obtain_capture(request, layers=layers, heads=heads)
        view = view_of(capture, exclude_special=exclude_special, words=words)
        sums = stat_sums(view)
    scores, induction_info = _induction(model, view, induction)
    if sort_key == "induction" and scores is None:
        raise UsageError("--sort induction needs the induction test",
                         "run on a live causal model, or add --induction")
    if stat_key == "induction" and scores is None and plot is not None:
        raise UsageError("--stat induction needs the induction test",
                         "run on a live causal model, or add --induction")
    rows: list[dict[str, Any]] = table_from_sums(sums, scores)
    layer_rows: list[dict[str, Any]] = per_layer(rows)
    if sort_key == "label":
        rows.sort(key=lambda r: (r["label"], r["layer"], r["head"]))
    elif sort_key != "layer":
        rows.sort(key=lambda r: (r[sort_key] if ascending else -r[sort_key], r["layer"],
                                 r["head"]))
    notes = _notes(view)
    title = (f"{sums.model}: {sums.texts} text{'s' if sums.texts != 1 else ''}, "
             f"{sums.tokens} tokens" + (f" ({', '.join(notes)})" if notes else ""))
    info = {"title": title, "model": sums.model, "texts": sums.texts, "tokens": sums.tokens,
            "causal": sums.causal, "words": words, "exclude_special": exclude_special,
            "induction_test": induction_info}
    if fmt is TableFormat.table and out is None:
        _print_head_tables(rows, layer_rows, title)
    else:
        _write_or_print(format_head_table(
            rows, layer_rows, TableFormat.markdown if fmt is TableFormat.table else fmt, info),
            out)
    if plot is not None:
        import numpy as np

        from attnviz.render import analysis as figures
        from attnviz.render.heatmap import save_figure

        by_position = {(r["layer"], r["head"]): r for r in rows}
        values = np.array([[by_position[(layer, head)][stat_key] for head in sums.heads]
                           for layer in sums.layers], dtype=np.float64)
        labels = [[SHORT_LABELS[by_position[(layer, head)]["label"]] for head in sums.heads]
                  for layer in sums.layers]
        fig = figures.draw_stat_grid(values, labels, sums.layers, sums.heads, stat=stat_key,
                                     title=f"{title}: {stat_key}", cmap=cmap)
        path = save_figure(fig, plot, dpi=dpi)
        if fmt is TableFormat.table or out is not None:
            stdout.print(str(path), markup=False)
        else:
            stderr.print(str(path), markup=False)


# --------------------------------------------------------------------------- rollout
@app.command("rollout", help=ROLLOUT_HELP)
@handle_errors
@capture_options
def rollout_command(
    request: CaptureRequest,
    head_fusion: Annotated[HeadFusionChoice, typer.Option(
        "--head-fusion", rich_help_panel=VIEW_PANEL,
        help="How to combine the heads of a layer: mean (Abnar and Zuidema), max or min.")
    ] = HeadFusionChoice.mean,
    start_layer: Annotated[int, typer.Option(
        "--start-layer", rich_help_panel=VIEW_PANEL,
        help="First layer of the product (negative counts from the end).")] = 0,
    token: Annotated[str | None, typer.Option(
        "--token", "-t", rich_help_panel=VIEW_PANEL,
        help="Token whose row the bar chart shows: a token as shown (first occurrence), "
             "WORD:N for the N-th, or a position (0, -1). Default: position 0 ([CLS]) for "
             "encoders, the last token for causal models.")] = None,
    out: Annotated[Path | None, typer.Option(
        "--out", "-o", rich_help_panel=OUTPUT_PANEL,
        help="Heatmap file (.png, .svg or .pdf). Default: a name derived from the text.")
    ] = None,
    npy: Annotated[Path | None, typer.Option(
        "--npy", rich_help_panel=OUTPUT_PANEL,
        help="Where to save the query x key matrix (float32). Default: beside the heatmap.")
    ] = None,
    bar: Annotated[Path | None, typer.Option(
        "--bar", rich_help_panel=OUTPUT_PANEL,
        help="Bar chart file. Default: beside the heatmap, ending in _bar.")] = None,
    cmap: CmapOpt = "viridis",
    annot: Annotated[bool | None, typer.Option(
        "--annot/--no-annot", rich_help_panel=OUTPUT_PANEL, show_default=False,
        help="Write the values in the cells (default: at most 30 tokens).")] = None,
    exclude_special: ExcludeSpecialOpt = False,
    words: WordsOpt = False,
    dpi: DpiOpt = 100,
) -> None:
    """Attention rollout of a text or capture: heatmap, matrix and one token's bar chart."""
    import numpy as np

    from attnviz.analysis.rollout import rollout
    from attnviz.analysis.tokens import find_token
    from attnviz.fileio import atomic_write

    _check_image_path(out, "--out")
    _check_image_path(bar, "--bar")
    if npy is not None and npy.suffix.lower() != ".npy":
        raise UsageError(f"--npy {npy} must end in .npy")
    from attnviz.render import analysis as figures
    from attnviz.render.heatmap import check_cmap, save_figure

    check_cmap(cmap)
    capture = obtain_capture(request)
    view = view_of(capture, exclude_special=exclude_special, words=words)
    matrix = rollout(view, head_fusion.value, start_layer)
    tokens = view.display_tokens
    index = find_token(tokens, token) if token is not None else (
        view.num_tokens - 1 if view.causal else 0)
    from attnviz.selection import resolve_index

    first = resolve_index(start_layer, view.num_layers, "layer")
    span = f"layers {first}-{max(view.layers)}" if first < max(view.layers) else f"layer {first}"
    notes = _notes(view)
    title = (f"{view.model}: attention rollout, {span}, heads fused by {head_fusion.value}"
             + (f" ({', '.join(notes)})" if notes else ""))
    out_path = out or _default_path(capture, "rollout")
    npy_path = npy or out_path.with_suffix(".npy")
    bar_path = bar or out_path.with_name(f"{out_path.stem}_bar{out_path.suffix}")
    if view.causal:
        warn("rollout on a causal model favours early tokens: every later token sees them, so "
             "the product of lower-triangular matrices piles weight on the first positions. "
             "Compare keys within one row rather than across rows.")
    heat = figures.draw_matrix(matrix, tokens, tokens, title=title, cmap=cmap,
                               label="rolled-out attention", annot=annot)
    save_figure(heat, out_path, dpi=dpi)
    data = np.ascontiguousarray(matrix, dtype=np.float32)
    atomic_write(npy_path, lambda handle: np.save(handle, data, allow_pickle=False))
    chart = figures.draw_token_bars(matrix[index], tokens, highlight=index,
                                    title=f"{view.model}: rollout of {tokens[index]!r} "
                                          f"(position {index}), {span}")
    save_figure(chart, bar_path, dpi=dpi)
    for path in (out_path, npy_path, bar_path):
        stdout.print(str(path), markup=False)
    order = np.argsort(-matrix[index], kind="stable")[:5]
    top = ", ".join(f"{tokens[j]} {matrix[index, j]:.3f}" for j in order)
    stderr.print(f"Rolled-out attention of {tokens[index]!r} (position {index}): {top}",
                 markup=False)


# --------------------------------------------------------------------------- compare
_ToyHeads = Annotated[int, typer.Option("--toy-heads", min=1, rich_help_panel=TOY_PANEL,
                                        help="Attention heads per block.")]
_ToyLayers = Annotated[int, typer.Option("--toy-layers", min=1, rich_help_panel=TOY_PANEL,
                                         help="Stacked attention blocks.")]
_DModel = Annotated[int, typer.Option("--d-model", min=1, rich_help_panel=TOY_PANEL,
                                      help="Embedding width (a multiple of --toy-heads).")]
_Seed = Annotated[int, typer.Option("--seed", rich_help_panel=TOY_PANEL,
                                    help="Seed for weights and word embeddings.")]
_NoScale = Annotated[bool, typer.Option(
    "--no-scale", rich_help_panel=TOY_PANEL,
    help="Drop the 1/sqrt(d_k) scaling to show how the softmax saturates.")]
_Causal = Annotated[bool, typer.Option(
    "--causal", rich_help_panel=TOY_PANEL,
    help="Mask future tokens (-inf before the softmax), as in a decoder.")]


def _side_request(base: dict[str, Any], text: str, model: str | None, causal: bool
                  ) -> CaptureRequest:
    return CaptureRequest(text=text, from_path=None, pair=None, model=model, causal=causal,
                          no_cache=False, **base)


def _compare_captures(texts: tuple[str, str], models: tuple[str | None, str | None],
                      causal: tuple[bool, bool], base: dict[str, Any]) -> tuple[Capture, Capture]:
    from attnviz.cli._common import read_text

    loaders: dict[tuple[str, bool], _LazyModel] = {}
    captures = []
    for text, model, is_causal in zip(texts, models, causal):
        request = _side_request(base, text, model, is_causal)
        key = (request.model_name, is_causal)
        loader = loaders.setdefault(key, _LazyModel(request))  # one load per distinct model
        capture = _capture_text(loader, read_text(text), None, None, None)
        for message in capture.meta.get("warnings", []):
            warn(escape(message))
        captures.append(capture)
    return captures[0], captures[1]


def _excerpt(text: str, size: int = 32) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= size else flat[: size - 1] + "\u2026"


@app.command("compare", help=COMPARE_HELP)
@handle_errors
def compare_command(
    text_a: Annotated[str | None, typer.Argument(
        metavar="TEXT_A", show_default=False,
        help="The text (side A); '-' reads standard input. Omit it with --from twice.")] = None,
    text_b: Annotated[str | None, typer.Argument(
        metavar="TEXT_B", show_default=False,
        help="A second text for side B (default: TEXT_A again).")] = None,
    from_paths: Annotated[list[Path] | None, typer.Option(
        "--from", rich_help_panel=INPUT_PANEL, metavar="PATH",
        help="A saved capture; give it twice (A then B) instead of texts.")] = None,
    model: Annotated[str | None, typer.Option(
        "--model", "-m", rich_help_panel=MODEL_PANEL, show_default=False,
        help="Model of both sides (default: minilm or $ATTNVIZ_MODEL).")] = None,
    model_a: Annotated[str | None, typer.Option(
        "--model-a", rich_help_panel=MODEL_PANEL, show_default=False,
        help="Model of side A (overrides --model).")] = None,
    model_b: Annotated[str | None, typer.Option(
        "--model-b", rich_help_panel=MODEL_PANEL, show_default=False,
        help="Model of side B (overrides --model).")] = None,
    vs_causal: Annotated[bool, typer.Option(
        "--vs-causal", rich_help_panel=TOY_PANEL,
        help="Toy model without (A) and with (B) the causal mask, same weights.")] = False,
    layer: Annotated[int, typer.Option(
        "--layer", "-l", rich_help_panel=VIEW_PANEL,
        help="Layer, 0-based; negative counts from the end (each model's own).")] = -1,
    head: Annotated[str, typer.Option(
        "--head", rich_help_panel=VIEW_PANEL,
        help="Head index, or 'mean' of the layer's heads.")] = "mean",
    top: Annotated[int, typer.Option(
        "--top", "-k", min=0, rich_help_panel=OUTPUT_PANEL,
        help="How many of the largest changes to list.")] = 10,
    fmt: Annotated[TableFormat, typer.Option(
        "--format", "-f", rich_help_panel=OUTPUT_PANEL,
        help="How to print the largest changes (json also describes both sides).")
    ] = TableFormat.table,
    out: Annotated[Path | None, typer.Option(
        "--out", "-o", rich_help_panel=OUTPUT_PANEL,
        help="Image file (.png, .svg or .pdf). Default: a name derived from the texts.")
    ] = None,
    cmap: CmapOpt = "viridis",
    annot: Annotated[bool | None, typer.Option(
        "--annot/--no-annot", rich_help_panel=OUTPUT_PANEL, show_default=False,
        help="Write the values in the cells (default: at most 16 tokens).")] = None,
    exclude_special: ExcludeSpecialOpt = False,
    words: WordsOpt = False,
    dpi: DpiOpt = 100,
    revision: Annotated[str | None, typer.Option(
        "--revision", rich_help_panel=MODEL_PANEL, help="Hub branch, tag or commit.")] = None,
    trust_remote_code: Annotated[bool, typer.Option(
        "--trust-remote-code", rich_help_panel=MODEL_PANEL,
        help="Allow the models' own Python code to run (only for models you trust).")] = False,
    device: Annotated[str, typer.Option(
        "--device", rich_help_panel=MODEL_PANEL,
        help="auto, cpu, cuda, cuda:N or mps.")] = "auto",
    dtype: Annotated[str, typer.Option(
        "--dtype", rich_help_panel=MODEL_PANEL,
        help="float32, float16 or bfloat16 for the models.")] = "float32",
    max_tokens: Annotated[int | None, typer.Option(
        "--max-tokens", min=1, rich_help_panel=MODEL_PANEL,
        help="Limit each input to this many tokens.")] = None,
    truncate: Annotated[bool, typer.Option(
        "--truncate/--no-truncate", rich_help_panel=MODEL_PANEL,
        help="Past the token limit: keep the first tokens, or stop with an error.")] = True,
    toy_heads: _ToyHeads = 2,
    toy_layers: _ToyLayers = 1,
    d_model: _DModel = 16,
    causal: _Causal = False,
    seed: _Seed = 0,
    no_scale: _NoScale = False,
) -> None:
    """Compare two attention maps side by side, with their difference when tokens line up."""
    from attnviz.analysis.compare import largest_changes, side_of, tokens_line_up

    head_choice = _parse_head(head)
    _check_image_path(out, "--out")
    from attnviz.render import analysis as figures
    from attnviz.render.heatmap import check_cmap, save_figure

    check_cmap(cmap)
    paths = list(from_paths or [])
    if paths:
        if len(paths) != 2:
            raise UsageError(f"--from was given {len(paths)} time(s); compare needs it twice",
                             "example: attnviz compare --from a/ --from b/")
        if text_a is not None or text_b is not None:
            raise UsageError("give two --from captures or texts, not both")
        if model or model_a or model_b or vs_causal:
            raise UsageError("--model, --model-a, --model-b and --vs-causal cannot be used with "
                             "--from: the captures already say which model made them")
        from attnviz.capture import load_capture

        cap_a, cap_b = load_capture(paths[0]), load_capture(paths[1])
        label_a, label_b = f"A: {cap_a.model} ({paths[0]})", f"B: {cap_b.model} ({paths[1]})"
    else:
        if text_a is None:
            raise UsageError("give a TEXT_A to compare (and TEXT_B, --model-a/--model-b or "
                             "--vs-causal), or --from twice",
                             "example: attnviz compare \"The bank of the river\" "
                             "\"The bank approved the loan\"")
        base = {"revision": revision, "trust_remote_code": trust_remote_code, "device": device,
                "dtype": dtype, "toy_heads": toy_heads, "toy_layers": toy_layers,
                "d_model": d_model, "seed": seed, "no_scale": no_scale,
                "max_tokens": max_tokens, "truncate": truncate}
        if vs_causal:
            if model_a or model_b or (model is not None and model != "toy"):
                raise UsageError("--vs-causal compares the toy model without and with its "
                                 "causal mask", "drop --model-a/--model-b, or use --model toy")
            if causal:
                raise UsageError("--vs-causal already makes side B causal; drop --causal")
            models: tuple[str | None, str | None] = ("toy", "toy")
            masks = (False, True)
        else:
            models = (model_a or model, model_b or model)
            masks = (causal, causal)
        second = text_b if text_b is not None else text_a
        same_model = (_side_request(base, text_a, models[0], masks[0]).model_name
                      == _side_request(base, second, models[1], masks[1]).model_name)
        if text_b is None and same_model and masks[0] == masks[1]:
            raise UsageError("nothing to compare: both sides are the same text in the same model",
                             "give a TEXT_B, --model-a and --model-b, or --model toy "
                             "--vs-causal")
        cap_a, cap_b = _compare_captures((text_a, second), models, masks, base)
        mask_a = " (bidirectional)" if vs_causal else ""
        mask_b = " (causal)" if vs_causal else ""
        label_a = f"A: {cap_a.model}{mask_a}: {_excerpt(cap_a.text)}"
        label_b = f"B: {cap_b.model}{mask_b}: {_excerpt(cap_b.text)}"
    view_a = view_of(cap_a, exclude_special=exclude_special, words=words)
    view_b = view_of(cap_b, exclude_special=exclude_special, words=words)
    side_a = side_of(view_a, layer, head_choice)
    side_b = side_of(view_b, layer, head_choice)
    aligned = tokens_line_up(view_a, view_b)
    diff = side_b.matrix.astype("float64") - side_a.matrix if aligned else None
    changes = largest_changes(side_a.matrix, side_b.matrix, side_a.tokens, top) if aligned else []
    hint = ""
    if not aligned:
        from attnviz.analysis.tokens import exclude_special as drop_special
        from attnviz.analysis.tokens import merge_words

        simpler_a = drop_special(merge_words(cap_a))
        simpler_b = drop_special(merge_words(cap_b))
        if (not (words and exclude_special)) and tokens_line_up(simpler_a, simpler_b):
            hint = " (they do with --words --exclude-special)"
    where = f"layer {side_a.layer}, head {side_a.head}"
    if side_b.layer != side_a.layer or side_b.head != side_a.head:
        where = (f"A layer {side_a.layer}, head {side_a.head}; "
                 f"B layer {side_b.layer}, head {side_b.head}")
    notes = [n for n in _notes(view_a) if n != "causal"]
    title = f"Compare: {where}" + (f" ({', '.join(notes)})" if notes else "")
    fig = figures.draw_comparison(side_a.matrix, side_b.matrix, side_a.tokens, side_b.tokens,
                                  titles=(label_a, label_b), title=title, diff=diff, cmap=cmap,
                                  annot=annot)
    if out is None:
        from attnviz.fileio import short_hash, slugify

        digest = short_hash(cap_a.text, cap_b.text, cap_a.model, cap_b.model,
                            str(cap_a.causal), str(cap_b.causal), length=6)
        out = Path(f"compare_{slugify(cap_a.text, 24)}_{digest}.png")
    path = save_figure(fig, out, dpi=dpi)
    not_aligned = (f"the tokens do not line up ({view_a.num_tokens} vs {view_b.num_tokens} "
                   f"tokens){hint}: no difference map")
    if fmt is TableFormat.json:
        def describe(capture: Capture, label: str, side: Any) -> dict[str, Any]:
            return {"label": label, "model": capture.model, "text": capture.text,
                    "causal": capture.causal, "layer": side.layer, "head": side.head,
                    "tokens": side.tokens}

        typer.echo(json.dumps({"image": str(path), "aligned": aligned,
                               "a": describe(view_a, label_a, side_a),
                               "b": describe(view_b, label_b, side_b),
                               "changes": changes}, ensure_ascii=False, indent=1))
        if not aligned:
            warn(escape(not_aligned))
        return
    # The image path goes with the table; with csv or markdown the table owns standard output.
    (stdout if fmt is TableFormat.table else stderr).print(str(path), markup=False)
    if not aligned:
        warn(escape(not_aligned))
        return
    if top == 0:
        return
    if fmt is TableFormat.table:
        from rich.table import Table

        table = Table(title=f"Largest changes, B - A ({escape(where)})", show_edge=False)
        for name, justify in (("query", "left"), ("key", "left"), ("A", "right"),
                              ("B", "right"), ("B - A", "right")):
            table.add_column(name, justify=justify)  # type: ignore[arg-type]
        for change in changes:
            delta = float(change["delta"])  # type: ignore[arg-type]
            colour = "red" if delta > 0 else "blue"
            table.add_row(escape(f"{change['query_index']}:{change['query']}"),
                          escape(f"{change['key_index']}:{change['key']}"), f"{change['a']:.3f}",
                          f"{change['b']:.3f}", f"[{colour}]{delta:+.3f}[/{colour}]")
        _print_wide(table)
        return
    if fmt is TableFormat.csv:
        import csv
        import io

        buffer = io.StringIO()
        writer = csv.writer(buffer, lineterminator="\n")
        writer.writerow(["query_index", "query", "key_index", "key", "a", "b", "delta"])
        for change in changes:
            writer.writerow([change["query_index"], change["query"], change["key_index"],
                             change["key"], f"{change['a']:.6f}", f"{change['b']:.6f}",
                             f"{change['delta']:+.6f}"])
        typer.echo(buffer.getvalue(), nl=False)
        return
    lines = [f"**Largest changes, B - A ({where})**", "", "| query | key | A | B | B - A |",
             "|---|---|---:|---:|---:|"]
    for change in changes:
        query = str(change["query"]).replace("|", "\\|")
        key = str(change["key"]).replace("|", "\\|")
        lines.append(f"| {change['query_index']}:{query} | {change['key_index']}:{key} | "
                     f"{change['a']:.3f} | {change['b']:.3f} | {change['delta']:+.3f} |")
    typer.echo("\n".join(lines))


# --------------------------------------------------------------------------- explain
def _number(value: float, digits: int) -> str:
    if value == float("-inf"):
        return "-inf"
    return f"{value:.{digits}f}"


def _vector_table(title: str, names: list[str], matrix: np.ndarray, digits: int,
                  max_dims: int, highlight: int | None = None) -> Any:
    from rich.table import Table

    width = matrix.shape[1]
    shown = min(width, max_dims)
    table = Table(title=title, title_justify="left", show_edge=False, pad_edge=False)
    table.add_column("token")
    for d in range(shown):
        table.add_column(str(d), justify="right", no_wrap=True)
    if shown < width:
        table.add_column(f"+{width - shown}", justify="left", style="dim")
    for i, name in enumerate(names):
        cells = [_number(float(v), digits) for v in matrix[i, :shown]]
        if shown < width:
            cells.append("\u2026")
        table.add_row(name, *cells, style="bold" if i == highlight else None)
    return table


@app.command("explain", help=EXPLAIN_HELP)
@handle_errors
def explain_command(
    text: Annotated[str, typer.Argument(
        metavar="TEXT", show_default=False, help="The text; '-' reads standard input.")],
    token: Annotated[str, typer.Option(
        "--token", "-t", show_default=False,
        help="The query token: a word (first occurrence), WORD:N for the N-th, or a position.")],
    layer: Annotated[int, typer.Option(
        "--layer", "-l", help="Block, 0-based; negative counts from the end.")] = 0,
    head: Annotated[int, typer.Option("--head", help="Head, 0-based.")] = 0,
    toy_heads: _ToyHeads = 2,
    toy_layers: _ToyLayers = 1,
    d_model: _DModel = 16,
    causal: _Causal = False,
    seed: _Seed = 0,
    no_scale: _NoScale = False,
    digits: Annotated[int, typer.Option(
        "--digits", min=1, max=8, rich_help_panel=OUTPUT_PANEL,
        help="Decimals shown in the tables.")] = 3,
    max_dims: Annotated[int, typer.Option(
        "--max-dims", min=1, rich_help_panel=OUTPUT_PANEL,
        help="Columns of X, Q, K and V shown (the rest are elided).")] = 8,
    fmt: Annotated[ExplainFormat, typer.Option(
        "--format", "-f", rich_help_panel=OUTPUT_PANEL,
        help="table, or json with every number at full precision.")] = ExplainFormat.table,
) -> None:
    """Print every step of one toy head for one query token."""
    import numpy as np

    from attnviz.analysis.tokens import find_token
    from attnviz.cli._common import read_text
    from attnviz.models.toy import ToyConfig, ToySource, trace_head

    config = ToyConfig(d_model=d_model, heads=toy_heads, layers=toy_layers, causal=causal,
                       scale=not no_scale, seed=seed)
    words = read_text(text)
    source = ToySource(config, device="cpu")
    trace = trace_head(source, words, layer, head)
    query = find_token(trace.tokens, token)
    weights = trace.weights[query]
    visible = np.isfinite(trace.masked[query])
    # The other choice of scaling, for the saturation note: same Q and K, other divisor.
    other_scale = 1.0 if config.scale else 1.0 / np.sqrt(config.d_k)
    other_scores = np.where(visible, trace.scores[query] * other_scale, -np.inf)
    other = np.exp(other_scores - other_scores.max())
    other /= other.sum()
    contributions = weights[:, None] * trace.v  # (T, d_k)
    if fmt is ExplainFormat.json:
        from dataclasses import asdict

        def listed(values: np.ndarray) -> list[Any]:
            return [None if not np.isfinite(v) else float(v) for v in values]

        payload = {
            "model": "toy", "config": asdict(config), "layer": trace.layer, "head": trace.head,
            "tokens": trace.tokens, "query_index": query, "query": trace.tokens[query],
            "scale": trace.scale, "x": trace.x.tolist(), "q": trace.q.tolist(),
            "k": trace.k.tolist(), "v": trace.v.tolist(),
            "scores": listed(trace.scores[query]), "scaled": listed(trace.scaled[query]),
            "masked": [not bool(v) for v in visible], "weights": listed(weights),
            "weights_sum": float(weights.sum()), "output": listed(trace.output[query]),
            "other_scaling_weights": listed(other),
        }
        typer.echo(json.dumps(payload, ensure_ascii=False, indent=1))
        return
    from rich.table import Table

    names = [escape(f"{i}:{t}") for i, t in enumerate(trace.tokens)]
    scale_text = (f"scores divided by sqrt(d_k) = sqrt({config.d_k}) = {np.sqrt(config.d_k):.3f}"
                  if config.scale else "no scaling (--no-scale)")
    stdout.print(f"[bold]Toy model[/bold], layer {trace.layer} of {config.layers}, head "
                 f"{trace.head} of {config.heads}: d_model {config.d_model}, d_k {config.d_k}, "
                 f"{'causal' if config.causal else 'bidirectional'}, {scale_text}, seed "
                 f"{config.seed}")
    stdout.print(f"Query token: [bold]{escape(trace.tokens[query])}[/bold] (position {query})\n")
    x_title = ("1. X: word embeddings" if trace.layer == 0
               else f"1. X: input of block {trace.layer} (output of block {trace.layer - 1})")
    _print_wide(_vector_table(x_title, names, trace.x, digits, max_dims, query))
    _print_wide(_vector_table(f"2. Q = X W_Q (head {trace.head}), query row", [names[query]],
                               trace.q[query : query + 1], digits, max_dims))
    _print_wide(_vector_table(f"   K = X W_K (head {trace.head})", names, trace.k, digits,
                               max_dims, query))
    _print_wide(_vector_table(f"   V = X W_V (head {trace.head})", names, trace.v, digits,
                               max_dims, query))
    scores = Table(title=escape(f"3. Scores of {trace.tokens[query]!r} against every key"),
                   title_justify="left", show_edge=False, pad_edge=False)
    scores.add_column("key")
    scores.add_column("q.k (raw)", justify="right", no_wrap=True)
    scores.add_column("scaled" if config.scale else "scaled (= raw)", justify="right",
                      no_wrap=True)
    scores.add_column("softmax weight", justify="right", no_wrap=True)
    for j, name in enumerate(names):
        masked = not visible[j]
        scores.add_row(name, _number(float(trace.scores[query, j]), digits),
                       "masked (-inf)" if masked else _number(float(trace.scaled[query, j]),
                                                              digits),
                       _number(float(weights[j]), digits), style="dim" if masked else None)
    scores.add_row("sum", "", "", _number(float(weights.sum()), digits), style="bold")
    _print_wide(scores)
    output = Table(title="4. Output row = sum_j weight_j * V_j (before W_O)",
                   title_justify="left", show_edge=False, pad_edge=False)
    output.add_column("key")
    output.add_column("weight", justify="right", no_wrap=True)
    shown = min(config.d_k, max_dims)
    for d in range(shown):
        output.add_column(str(d), justify="right", no_wrap=True)
    for j, name in enumerate(names):
        output.add_row(name, _number(float(weights[j]), digits),
                       *[_number(float(v), digits) for v in contributions[j, :shown]])
    output.add_row("output", "", *[_number(float(v), digits)
                                   for v in trace.output[query, :shown]], style="bold")
    _print_wide(output)
    best = int(np.argmax(weights))
    if config.scale:
        stdout.print(f"Largest weight {weights[best]:.{digits}f} on {trace.tokens[best]!r}. "
                     f"Without 1/sqrt(d_k) it would be {other.max():.{digits}f}: unscaled "
                     "scores grow with d_k and push the softmax towards one-hot (try "
                     "--no-scale --d-model 64).", markup=False)
    else:
        stdout.print(f"Largest weight {weights[best]:.{digits}f} on {trace.tokens[best]!r}. "
                     f"With 1/sqrt(d_k) it would be {other.max():.{digits}f}: without scaling "
                     "the softmax saturates as d_k grows.", markup=False)
