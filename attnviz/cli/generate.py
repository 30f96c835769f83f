"""``generate``: which context tokens each generated token attended to."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from attnviz.cli._app import app
from attnviz.cli._common import (
    INPUT_PANEL,
    MODEL_PANEL,
    OUTPUT_PANEL,
    VIEW_PANEL,
    DeviceMapOpt,
    DeviceOpt,
    DtypeOpt,
    HeadsOpt,
    LayersOpt,
    MaxTokensOpt,
    RevisionOpt,
    TruncateOpt,
    TrustRemoteCodeOpt,
    handle_errors,
    read_text,
    session,
    stderr,
    stdout,
    use_server,
    warn,
)
from attnviz.cli.core import TableFormat, _parse_head, key_label
from attnviz.fileio import check_output

if TYPE_CHECKING:
    from attnviz.long.generate import Generation

GENERATE_CSV_COLUMNS = ("step", "position", "token", "rank", "key_index", "key", "weight")


def generation_title(result: Generation, layer: int, head: int | str, k: int) -> str:
    """``model: layer 1, head 2, top 3 (12 prompt + 8 generated tokens)``."""
    from attnviz.capture_build import escape_controls, model_label

    named = f"mean of {len(result.heads)} heads" if head == "mean" else f"head {head}"
    return (f"{escape_controls(model_label(result.model))}: layer {layer}, {named}, top {k} "
            f"({result.prompt_length} prompt + {result.steps} generated tokens)")


def _json_text(document: dict[str, Any]) -> str:
    """``document`` as JSON whose text cannot drive a terminal: ``json`` escapes U+0000 to
    U+001F itself; DEL and the C1 controls (U+0080 to U+009F, CSI among them) are written as
    ``\\u`` escapes too, so the data read back is the same."""
    import re

    text = json.dumps(document, ensure_ascii=False, indent=1)
    return re.sub("[\x7f-\x9f]", lambda m: f"\\u{ord(m.group()):04x}", text) + "\n"


def format_generation(result: Generation, rows: list[dict[str, Any]], fmt: TableFormat,
                      k: int, title: str) -> str:
    """The top-k rows of a generation as csv, json or markdown text."""
    from attnviz.capture_build import escape_controls

    if fmt is TableFormat.json:
        return _json_text({"title": title, "model": result.model, "prompt": result.prompt,
                           "text": result.text, "tokens": result.tokens,
                           "prompt_length": result.prompt_length, "k": k,
                           "sample": result.meta.get("sample"), "seed": result.meta.get("seed"),
                           "stopped": result.meta.get("stopped"), "rows": rows})
    if fmt is TableFormat.csv:
        from attnviz.csvtext import csv_text

        cells = [[row["step"], row["position"], row["token"], rank, item["key_index"],
                  item["key"], f"{item['weight']:.6f}"]
                 for row in rows for rank, item in enumerate(row["top"], start=1)]
        return csv_text(GENERATE_CSV_COLUMNS, cells)

    def cell(text: object) -> str:
        return escape_controls(str(text)).replace("|", "\\|")

    lines = [f"**{title}**", "", f"Generated: {cell(result.text)}", "",
             "| # | generated | " + " | ".join(f"top {i}" for i in range(1, k + 1)) + " |",
             "|---|---|" + "---|" * k]
    for row in rows:
        tops = [f"{cell(key_label(t))} ({t['weight']:.3f})" for t in row["top"]]
        tops += [""] * (k - len(tops))
        lines.append(f"| {row['position']} | {cell(row['token'])} | " + " | ".join(tops) + " |")
    return "\n".join(lines) + "\n"


def _print_table(result: Generation, rows: list[dict[str, Any]], k: int, title: str) -> None:
    from rich.markup import escape
    from rich.table import Table

    from attnviz.capture_build import escape_controls

    stdout.print(f"[bold]Prompt:[/bold] {escape(escape_controls(result.prompt))}")
    stdout.print(f"[bold]Generated:[/bold] {escape(escape_controls(result.text))}"
                 + (" [dim](stopped at end of sequence)[/dim]"
                    if result.meta.get("stopped") == "end of sequence" else ""))
    table = Table(title=escape(title), show_lines=False)
    table.add_column("#", justify="right", style="dim")
    table.add_column("generated", style="bold")
    for rank in range(1, k + 1):
        table.add_column(f"top {rank}")
    for row in rows:
        table.add_row(str(row["position"]), escape(str(row["token"])),
                      *[f"{escape(key_label(t))} [dim]{t['weight']:.3f}[/dim]"
                        for t in row["top"]])
    stdout.print(table)


def _check_shown(model: str, layer: int, head: int | str | None, layers: str | None,
                 heads: str | None, spec: dict[str, Any]) -> None:
    """--layer and --head must be among --layers and --heads (checked from config.json)."""
    from attnviz.errors import UsageError
    from attnviz.selection import parse_selection, resolve_index

    shape = session().shape(model, **spec) if layers or heads else None
    if shape is None:
        return
    for option, index, selection, size, what in (
            ("--layer", layer, layers, shape.num_layers, "layer"),
            ("--head", head, heads, shape.num_heads, "head")):
        if selection and isinstance(index, int):
            chosen = parse_selection(selection, size, what)
            if resolve_index(index, size, what) not in chosen:
                raise UsageError(f"{option} {index} is not among --{what}s {selection}",
                                 f"add it to --{what}s, or pick {option} from {selection}")


def _check_out_beside_dump(out: Path | None, dump: Path | None) -> None:
    """Refuse ``-o`` naming the ``--dump`` folder or a path inside it, before the model
    loads (else the rows are written first and the table's write fails or lands in them)."""
    if out is None or dump is None:
        return
    from attnviz.errors import UsageError

    folder = os.path.normcase(os.path.realpath(dump))
    target = os.path.normcase(os.path.realpath(out))
    if target == folder or target.startswith(folder.rstrip(os.sep) + os.sep):
        where = "names" if target == folder else "is inside"
        raise UsageError(f"-o {out} {where} the --dump folder {dump}: the table and the "
                         "saved rows would collide", "give -o a file outside the --dump folder")


@app.command("generate")
@handle_errors
def generate_command(
    prompt: Annotated[str, typer.Argument(
        metavar="PROMPT", show_default=False,
        help="The text to continue; '-' reads standard input.")],
    model: Annotated[str, typer.Option(
        "--model", "-m", rich_help_panel=MODEL_PANEL, show_default=False,
        help="A decoder-only language model with its head: a Hugging Face id or a local "
             "folder (GPT-2, Llama, Mistral, Qwen2, ...).")],
    max_new_tokens: Annotated[int, typer.Option(
        "--max-new-tokens", "-n", rich_help_panel=INPUT_PANEL,
        help="Generate at most this many tokens (1 to 4096; fewer when the model ends the "
             "sequence).")] = 20,
    sample: Annotated[bool, typer.Option(
        "--sample", rich_help_panel=INPUT_PANEL,
        help="Sample with the model's generation settings instead of greedy decoding.")] = False,
    seed: Annotated[int | None, typer.Option(
        "--seed", rich_help_panel=INPUT_PANEL, show_default=False,
        help="Seed of --sample (0 to 4294967295) to repeat a sample; without it one is drawn "
             "and shown in the JSON and the dump.")] = None,
    layer: Annotated[int, typer.Option(
        "--layer", "-l", rich_help_panel=VIEW_PANEL,
        help="Layer to list, 0-based; negative counts from the end.")] = -1,
    head: Annotated[str, typer.Option(
        "--head", rich_help_panel=VIEW_PANEL,
        help="Head index, or 'mean' of the recorded heads.")] = "mean",
    layers: LayersOpt = None,
    heads: HeadsOpt = None,
    k: Annotated[int, typer.Option(
        "-k", "--top-k", min=1, max=1000, rich_help_panel=VIEW_PANEL,
        help="How many context tokens to list per generated token (1 to 1000).")] = 3,
    fmt: Annotated[TableFormat, typer.Option(
        "--format", "-f", rich_help_panel=OUTPUT_PANEL,
        help="Output format.")] = TableFormat.table,
    out: Annotated[Path | None, typer.Option(
        "--out", "-o", rich_help_panel=OUTPUT_PANEL,
        help="Write to this file instead of standard output (csv, json, markdown).")] = None,
    dump: Annotated[Path | None, typer.Option(
        "--dump", rich_help_panel=OUTPUT_PANEL, metavar="DIR",
        help="Also save every recorded row: DIR/rows.npy, float32 [layer, head, step, key] "
             "(zeros past each step's keys), and DIR/generation.json.")] = None,
    revision: RevisionOpt = None,
    trust_remote_code: TrustRemoteCodeOpt = False,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "float32",
    device_map: DeviceMapOpt = None,
    max_tokens: MaxTokensOpt = None,
    truncate: TruncateOpt = True,
) -> None:
    """Generate text and list which context tokens each generated token attended to.

    The model runs its own attention kernel with the key/value cache.

    Each step records one attention row per layer and head: the row of the query that
    produced the token, over the prompt and the tokens generated before it.

    Greedy by default; --sample samples (--seed repeats a sample).

    Examples:

      attnviz generate "The capital of France is" -m gpt2 --max-new-tokens 8

      attnviz generate "Once upon a time" -m ./llama -n 20 -l 3 --head 5 -f csv

      attnviz generate "Once upon a time" -m ./llama --sample --seed 7 --dump s/
    """
    check_output(out)
    from attnviz.errors import UsageError
    from attnviz.selection import resolve_index

    head_choice = _parse_head(head)
    check_output(dump, "--dump", folder=True)
    if dump is not None and dump.exists() and not dump.is_dir():  # before the model loads
        raise UsageError(f"--dump {dump}: a file with that name exists; --dump names a folder "
                         "(rows.npy and generation.json go in it)",
                         "choose another folder for --dump")
    _check_out_beside_dump(out, dump)
    use_server(None)  # generation runs in this process, whatever an earlier command used
    if os.environ.get("ATTNVIZ_SERVER", "").strip():
        warn("generate runs the model here: $ATTNVIZ_SERVER is not used (a served causal "
             "language model streams generations at POST /api/generate)")
    prompt = read_text(prompt)
    spec: dict[str, Any] = {"revision": revision, "trust_remote_code": trust_remote_code,
                            "device": device, "dtype": dtype, "device_map": device_map}
    # --layer and --head against the model's config.json, before the weights load.
    session().validate(model, layer=layer, head=head_choice if isinstance(head_choice, int)
                       else None, layers=layers, heads=heads, **spec)
    _check_shown(model, layer, head_choice, layers, heads, spec)
    result = session().generate(
        prompt, model=model, max_new_tokens=max_new_tokens, sample=sample, seed=seed,
        layers=layers, heads=heads, max_tokens=max_tokens, truncate=truncate, **spec)
    shown_layer = resolve_index(layer, result.num_layers, "layer")
    shown_head: int | str = "mean" if head_choice == "mean" else resolve_index(
        int(head_choice or 0), result.num_heads, "head")
    rows = result.top_k(shown_layer, shown_head, k)
    k = min(k, max((len(row["top"]) for row in rows), default=0))
    title = generation_title(result, shown_layer, shown_head, k)
    if dump is not None:
        stderr.print(f"Rows saved to {result.save(dump)}", markup=False)
    if fmt is TableFormat.table and out is None:
        _print_table(result, rows, k, title)
        return
    text = format_generation(result, rows, TableFormat.markdown if fmt is TableFormat.table
                             else fmt, k, title)
    if out is None:
        typer.echo(text, nl=False)
        return
    from attnviz.fileio import atomic_write_text

    atomic_write_text(out, text)
    stdout.print(str(out))
