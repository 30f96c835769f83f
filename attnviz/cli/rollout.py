"""``rollout``: how much of each input token reaches each position at the top layer.

The command checks its options, calls :func:`attnviz.analysis.rollout.rollout_view` and writes
the heatmap, the matrix and a bar chart. numpy, matplotlib and the models are imported inside
the command, so ``--help`` stays fast.
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from attnviz.cli._analysis_common import check_distinct_outputs, check_image_path
from attnviz.cli._app import app
from attnviz.cli._common import (
    OUTPUT_PANEL,
    VIEW_PANEL,
    CaptureOptions,
    CmapOpt,
    DpiOpt,
    ExcludeSpecialOpt,
    WordsOpt,
    capture_options,
    handle_errors,
    session,
    stdout,
    view_of,
    warn,
)
from attnviz.errors import UsageError
from attnviz.fileio import check_output

if TYPE_CHECKING:
    from attnviz.capture import Capture
    from attnviz.request import CaptureRequest


class MethodChoice(str, Enum):
    rollout = "rollout"
    flow = "flow"


class HeadFusionChoice(str, Enum):
    mean = "mean"
    max = "max"
    min = "min"


ROLLOUT_HELP = "\n\n".join([
    "Attention rollout (Abnar and Zuidema, 2020): how much of each input token reaches each "
    "position at the top layer.",
    "Per layer, fuse the heads (--head-fusion), add the residual path and renormalise rows: "
    "A = rownorm(0.5 A + 0.5 I). Multiply upward from --start-layer: R = A_start, then "
    "R = A_l @ R. Rows of R sum to 1.",
    "Writes the heatmap, the matrix (.npy, float32) and a bar chart of one token's row "
    "(--token), prints their paths and then that row's five largest entries. In a causal "
    "model rollout favours early tokens.",
    "--measure combines that measure's per-layer matrices the same way (rollout or flow); the "
    "rows of norm and norm-res-ln are amounts, so each head's rows are first scaled to sum to "
    "1 (the command says so); alti and value-zeroing rows already sum to 1. norm-res-ln, alti "
    "and value-zeroing hold the residual path already, so their layers are multiplied without "
    "the identity mixed in (as their authors roll them out).",
    "--method flow computes attention flow instead (Abnar and Zuidema, 2020): the maximum flow "
    "from each top token to each input token through the graph whose edge capacities are the "
    "same matrices A, rows divided by their sums. It solves tokens^2 maximum-flow problems on "
    "a graph of layers x tokens^2 edges (on MiniLM about 1 s at 8 tokens, 10 s at 16, "
    "minutes at 32), so it refuses more than --max-flow-tokens tokens (default 16).",
    "Examples:",
    "  attnviz rollout \"The cat sat on the mat\" --token cat",
    "  attnviz rollout \"The cat sat on the mat\" --method flow --token cat",
    "  attnviz rollout \"The cat sat\" --head-fusion max --start-layer 2 -o roll.png",
    "  attnviz rollout --from cat/ --npy rollout.npy",
    "  attnviz rollout \"The cat sat on the mat\" --measure norm",
])


def _token_slug(tokens: list[str], index: int) -> str:
    """The bar chart's file-name part for token ``index``: ``it``, ``cls``, ``the-5``, ``pos3``.

    A token that occurs more than once gets its position, so two rows never share a name.
    """
    import re

    from attnviz.fileio import slugify

    token = tokens[index]
    if not re.search(r"[A-Za-z0-9]", token):
        return f"pos{index}"
    slug = slugify(token, 20)
    return f"{slug}-{index}" if tokens.count(token) > 1 else slug


def _default_path(capture: Capture, method: str = "rollout") -> Path:
    """``attention_<slug>_<hash>_rollout.png`` (``_flow`` for attention flow): the text,
    model and mask decide the name."""
    from attnviz.fileio import short_hash, slugify

    slug = slugify(capture.text, 30)
    digest = short_hash(capture.text, capture.pair or "", capture.model, str(capture.causal),
                        length=6)
    measure = "" if capture.measure == "weights" else f"_{capture.measure}"
    return Path(f"attention_{slug}_{digest}_{method}{measure}.png")


@app.command("rollout", help=ROLLOUT_HELP)
@handle_errors
@capture_options
def rollout_command(
    options: CaptureOptions,
    method: Annotated[MethodChoice, typer.Option(
        "--method", rich_help_panel=VIEW_PANEL,
        help="rollout (multiply the layers) or flow (maximum flow through the layers; slow: "
             "bounded by --max-flow-tokens).")] = MethodChoice.rollout,
    max_flow_tokens: Annotated[int, typer.Option(
        "--max-flow-tokens", rich_help_panel=VIEW_PANEL, min=1, max=64,
        help="With --method flow: refuse texts longer than this many tokens (1 to 64; the "
             "time grows faster than layers x tokens^4).")] = 16,
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
        help="Bar chart file. Default: beside the heatmap, ending in _bar_TOKEN (e.g. "
             "rollout_bar_it.png for -o rollout.png --token it).")] = None,
    cmap: CmapOpt = "viridis",
    annot: Annotated[bool | None, typer.Option(
        "--annot/--no-annot", rich_help_panel=OUTPUT_PANEL, show_default=False,
        help="Write the values in the cells (default: at most 30 tokens).")] = None,
    exclude_special: ExcludeSpecialOpt = False,
    words: WordsOpt = False,
    dpi: DpiOpt = 100,
) -> None:
    """Attention rollout of a text or capture: heatmap, matrix and one token's bar chart."""
    check_image_path(out, "--out")
    check_image_path(bar, "--bar")
    if npy is not None and npy.suffix.lower() != ".npy":
        raise UsageError(f"--npy {npy} must end in .npy")
    check_output(npy, "--npy")
    check_distinct_outputs(out=out, bar=bar)  # before any work; the defaults again below
    from attnviz.analysis.flow import flow_view
    from attnviz.analysis.rollout import RESIDUAL_INSIDE, rollout_view, save_matrix
    from attnviz.render import analysis as figures
    from attnviz.render.heatmap import check_cmap, save_figure

    check_cmap(cmap)
    # --start-layer is checked against the model's config before it loads.
    request = options.request(start_layer=start_layer)
    if method is MethodChoice.flow:  # counted by the tokenizer alone, before the model loads
        _check_flow_request(request, max_flow_tokens, exclude_special=exclude_special,
                           words=words)
    capture = session().run_full(request)
    view = view_of(capture, exclude_special=exclude_special, words=words)
    if method is MethodChoice.flow:
        result = flow_view(view, head_fusion.value, start_layer, token, max_flow_tokens)
    else:
        result = rollout_view(view, head_fusion.value, start_layer, token)
    out_path = out or _default_path(capture, method.value)
    npy_path = npy or out_path.with_suffix(".npy")
    bar_path = bar or out_path.with_name(
        f"{out_path.stem}_bar_{_token_slug(result.tokens, result.index)}{out_path.suffix}")
    check_distinct_outputs(out=out_path, npy=npy_path, bar=bar_path)
    if not view.rows_sum_to_one:
        warn(f"{view.measure} rows are amounts, not distributions: each head's rows were "
             "scaled to sum to 1 before the heads were fused and the layers combined")
    if view.measure in RESIDUAL_INSIDE:
        warn(f"{view.measure} holds the residual path already: its layers were multiplied "
             "without mixing in the identity")
    if view.causal:
        warn("rollout on a causal model favours early tokens: every later token sees them, so "
             "the product of lower-triangular matrices piles weight on the first positions. "
             "Compare keys within one row rather than across rows.")
    heat = figures.draw_matrix(result.matrix, result.tokens, result.tokens, title=result.title,
                               cmap=cmap, annot=annot,
                               label="attention flow" if method is MethodChoice.flow
                               else "rolled-out attention")
    save_figure(heat, out_path, dpi=dpi)
    save_matrix(npy_path, result.matrix)
    chart = figures.draw_token_bars(result.matrix[result.index], result.tokens,
                                    highlight=result.index, title=result.bar_title)
    save_figure(chart, bar_path, dpi=dpi)
    for path in (out_path, npy_path, bar_path):
        stdout.print(str(path), markup=False)
    stdout.print(result.summary(), markup=False)


def _check_flow_request(request: CaptureRequest, max_tokens: int, *,
                       exclude_special: bool = False, words: bool = False) -> None:
    """Refuse a text over ``max_tokens`` before its model loads: the model's tokenizer alone
    counts it (:func:`attnviz.models.count_tokens`). A saved capture, standard input, the toy
    model, ``words`` (merged pieces: fewer rows) or a tokenizer that cannot be loaded alone
    are left to :func:`flow_view`, which checks the view itself.

    Raises:
        UsageError: more tokens than ``max_tokens`` (after ``--max-tokens`` cuts the text).
    """
    if request.text is None or request.from_path is not None or words:
        return
    from attnviz.analysis import flow
    from attnviz.models import count_tokens

    count = count_tokens(request.model, request.text, request.pair,
                         special=not exclude_special)
    if count is None:
        return
    if request.max_tokens is not None and request.truncate:
        count = min(count, request.max_tokens)
    flow.check_flow_size(count, max_tokens)
