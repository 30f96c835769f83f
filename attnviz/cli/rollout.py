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

if TYPE_CHECKING:
    from attnviz.capture import Capture


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
    "Examples:",
    "  attnviz rollout \"The cat sat on the mat\" --token cat",
    "  attnviz rollout \"The cat sat\" --head-fusion max --start-layer 2 -o roll.png",
    "  attnviz rollout --from cat/ --npy rollout.npy",
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


def _default_path(capture: Capture) -> Path:
    """``attention_<slug>_<hash>_rollout.png``: the text, model and mask decide the name."""
    from attnviz.fileio import short_hash, slugify

    slug = slugify(capture.text, 30)
    digest = short_hash(capture.text, capture.pair or "", capture.model, str(capture.causal),
                        length=6)
    return Path(f"attention_{slug}_{digest}_rollout.png")


@app.command("rollout", help=ROLLOUT_HELP)
@handle_errors
@capture_options
def rollout_command(
    options: CaptureOptions,
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
    check_distinct_outputs(out=out, bar=bar)  # before any work; the defaults again below
    from attnviz.analysis.rollout import rollout_view, save_matrix
    from attnviz.render import analysis as figures
    from attnviz.render.heatmap import check_cmap, save_figure

    check_cmap(cmap)
    # --start-layer is checked against the model's config before it loads.
    capture = session().run_full(options.request(start_layer=start_layer))
    view = view_of(capture, exclude_special=exclude_special, words=words)
    result = rollout_view(view, head_fusion.value, start_layer, token)
    out_path = out or _default_path(capture)
    npy_path = npy or out_path.with_suffix(".npy")
    bar_path = bar or out_path.with_name(
        f"{out_path.stem}_bar_{_token_slug(result.tokens, result.index)}{out_path.suffix}")
    check_distinct_outputs(out=out_path, npy=npy_path, bar=bar_path)
    if view.causal:
        warn("rollout on a causal model favours early tokens: every later token sees them, so "
             "the product of lower-triangular matrices piles weight on the first positions. "
             "Compare keys within one row rather than across rows.")
    heat = figures.draw_matrix(result.matrix, result.tokens, result.tokens, title=result.title,
                               cmap=cmap, label="rolled-out attention", annot=annot)
    save_figure(heat, out_path, dpi=dpi)
    save_matrix(npy_path, result.matrix)
    chart = figures.draw_token_bars(result.matrix[result.index], result.tokens,
                                    highlight=result.index, title=result.bar_title)
    save_figure(chart, bar_path, dpi=dpi)
    for path in (out_path, npy_path, bar_path):
        stdout.print(str(path), markup=False)
    stdout.print(result.summary(), markup=False)
