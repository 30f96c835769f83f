"""``explain``: one toy attention head for one query token, step by step.

The command checks its options, calls :func:`attnviz.analysis.explain.explain_head` and prints
the tables (or json). numpy and torch are imported inside the command, so ``--help`` stays fast.
"""

from __future__ import annotations

import json
from enum import Enum
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape

from attnviz.cli._analysis_common import (
    CausalOpt,
    DModelOpt,
    NoScaleOpt,
    SeedOpt,
    ToyHeadsOpt,
    ToyLayersOpt,
    print_wide,
)
from attnviz.cli._app import app
from attnviz.cli._common import OUTPUT_PANEL, handle_errors, stdout

if TYPE_CHECKING:
    import numpy as np


class ExplainFormat(str, Enum):
    table = "table"
    json = "json"


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
    text: Annotated[str | None, typer.Argument(
        metavar="TEXT", show_default=False, help="The text; '-' reads standard input.")
    ] = None,
    *,
    token: Annotated[str, typer.Option(
        "--token", "-t", show_default=False,
        help="The query token: a word (first occurrence), WORD:N for the N-th, or a position.")],
    layer: Annotated[int, typer.Option(
        "--layer", "-l", help="Block, 0-based; negative counts from the end.")] = 0,
    head: Annotated[int, typer.Option("--head", help="Head, 0-based.")] = 0,
    toy_heads: ToyHeadsOpt = 2,
    toy_layers: ToyLayersOpt = 1,
    d_model: DModelOpt = 16,
    causal: CausalOpt = False,
    seed: SeedOpt = 0,
    no_scale: NoScaleOpt = False,
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

    from attnviz.analysis.explain import explain_head
    from attnviz.cli._common import missing_text_error, read_text
    from attnviz.models.toy import ToyConfig

    if text is None:
        raise missing_text_error("a TEXT to explain")
    config = ToyConfig(d_model=d_model, heads=toy_heads, layers=toy_layers, causal=causal,
                       scale=not no_scale, seed=seed)
    explanation = explain_head(read_text(text), token, layer, head, config)
    if fmt is ExplainFormat.json:
        typer.echo(json.dumps(explanation.to_dict(), ensure_ascii=False, indent=1))
        return
    trace, query = explanation.trace, explanation.query
    weights, visible = explanation.weights, explanation.visible
    other, contributions = explanation.other, explanation.contributions
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
    print_wide(_vector_table(x_title, names, trace.x, digits, max_dims, query))
    print_wide(_vector_table(f"2. Q = X W_Q (head {trace.head}), query row", [names[query]],
                               trace.q[query : query + 1], digits, max_dims))
    print_wide(_vector_table(f"   K = X W_K (head {trace.head})", names, trace.k, digits,
                               max_dims, query))
    print_wide(_vector_table(f"   V = X W_V (head {trace.head})", names, trace.v, digits,
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
    print_wide(scores)
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
    print_wide(output)
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
