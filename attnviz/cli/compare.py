"""``compare``: two attention maps side by side, and their difference when the tokens line up.

The command checks its options, gets the two captures, calls
:func:`attnviz.analysis.compare.compare_captures` and draws and prints the result. numpy,
matplotlib and the models are imported inside the command, so ``--help`` stays fast.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, cast

import typer
from rich.markup import escape

from attnviz.cli._analysis_common import (
    CausalOpt,
    DModelOpt,
    NoScaleOpt,
    SeedOpt,
    ToyHeadsOpt,
    ToyLayersOpt,
    check_image_path,
    print_wide,
    view_suffix,
)
from attnviz.cli._app import app
from attnviz.cli._common import (
    INPUT_PANEL,
    MODEL_PANEL,
    OUTPUT_PANEL,
    TOY_PANEL,
    VIEW_PANEL,
    CaptureOptions,
    CmapOpt,
    DpiOpt,
    ExcludeSpecialOpt,
    GammaOpt,
    KeysOpt,
    MeasureOpt,
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
    use_server,
    warn,
)
from attnviz.cli.core import TableFormat, _parse_head
from attnviz.errors import UsageError

if TYPE_CHECKING:
    from attnviz.analysis.compare import Side
    from attnviz.capture import Capture


COMPARE_HELP = "\n\n".join([
    "Compare attention side by side: one text in two models, two texts in one model, or the "
    "toy model without and with its causal mask.",
    "A third panel shows B - A on a diverging colour map centred at 0 (red: B attends more, "
    "blue: less) and the largest changes are listed. Texts with the same number of tokens (a "
    "changed word) are paired position by position and the differing tokens are marked in red; "
    "texts of different lengths are paired word by word (difflib), and the command says which "
    "words found no counterpart. --tokens/--queries/--keys zoom into both sides.",
    "Examples:",
    "  attnviz compare \"The cat sat on the mat\" \"The dog sat on the mat\" -l 2",
    "  attnviz compare \"The bank of the river\" \"The bank approved the loan\" -l 2",
    "  attnviz compare \"The cat sat\" --model-a minilm --model-b ./my-bert",
    "  attnviz compare \"The cat sat on the mat\" --model toy --vs-causal --head 0",
    "  attnviz compare --from a/ --from b/ --layer 0 --head 3 --format json",
    "  attnviz compare \"The cat sat on the mat\" \"The dog sat on it\" --measure norm",
    "  attnviz compare \"The cat sat\" \"The dog sat\" --server http://127.0.0.1:8765",
])


def _side_options(base: dict[str, Any], text: str, model: str | None, causal: bool
                  ) -> CaptureOptions:
    return CaptureOptions(text=text, from_path=None, pair=None, model=model, causal=causal,
                          no_cache=False, **base)


def _compare_captures(texts: tuple[str, str], models: tuple[str | None, str | None],
                      causal: tuple[bool, bool], base: dict[str, Any], layer: int,
                      head: int | str) -> tuple[Capture, Capture]:
    """Both sides' captures: every side's --layer/--head checked against its model's config
    before the first model loads."""
    cap_a, cap_b = session().run_each([
        _side_options(base, text, model, is_causal).request(
            layer=layer, head=head if isinstance(head, int) else None)
        for text, model, is_causal in zip(texts, models, causal)])
    return cap_a, cap_b


def _panels(comparison: Any, labels: tuple[str, str], tokens: str | None,
            queries: str | None, keys: str | None
            ) -> tuple[Any, Any, Any, str, tuple[list[int], list[int]]]:
    """The three panels of the figure, cut to the windows; the window's title note; and the
    aligned pairs (rows, columns) inside the window.

    A window is resolved on A's tokens. Sides paired position by position show the same
    positions; sides paired by word resolve it on B's own tokens (a word may sit elsewhere in
    B), or, when B lacks a word it names (a changed word), take the positions of B paired with
    A's window. The difference panel keeps the aligned pairs whose A positions are inside A's
    window.
    """
    import numpy as np

    from attnviz.analysis.tokens import (
        Window,
        pair_start,
        parse_window,
        piece_labels,
        window_note,
    )
    from attnviz.render.analysis import Panel

    alignment = comparison.alignment
    marked_a, marked_b = alignment.marked() if alignment is not None else ([], [])

    def resolve(names: list[str], source: str) -> tuple[Any, Any]:
        return (parse_window(queries or tokens, names, "--queries" if queries else "--tokens",
                             source),
                parse_window(keys or tokens, names, "--keys" if keys else "--tokens", source))

    def paired(window: Any, total: int) -> Any:
        """B's positions paired with A's ``window``, as a run (None: none pair up)."""
        if alignment is None:
            return None
        if alignment.method != "words":
            return Window(window.start, window.stop, total)
        inside = [b for a, b in zip(alignment.a, alignment.b) if window.start <= a < window.stop]
        return Window(min(inside), max(inside) + 1, total) if inside else None

    names_a = piece_labels(comparison.a.capture)
    names_b = piece_labels(comparison.b.capture)
    window_a = resolve(names_a, "A")
    if alignment is not None and alignment.method != "words":
        window_b = (paired(window_a[0], len(names_b)), paired(window_a[1], len(names_b)))
    else:
        try:
            window_b = resolve(names_b, "B")
        except UsageError:
            mapped = (paired(window_a[0], len(names_b)), paired(window_a[1], len(names_b)))
            if mapped[0] is None or mapped[1] is None:
                raise
            window_b = mapped
    from attnviz.render.parts import masked_cells

    panels = []
    windows = []
    for side, label, marked, (rows, cols) in ((comparison.a, labels[0], marked_a, window_a),
                                              (comparison.b, labels[1], marked_b, window_b)):
        names = piece_labels(side.capture)
        start = pair_start(side.capture)

        def inside(window: Any, position: int | None) -> int | None:
            if position is None or not window.start < position < window.stop:
                return None
            return int(position - window.start)

        panels.append(Panel(
            side.matrix[rows.span, cols.span], names[rows.span], names[cols.span], label,
            [i - rows.start for i in marked if rows.start <= i < rows.stop],
            [j - cols.start for j in marked if cols.start <= j < cols.stop],
            inside(rows, start), inside(cols, start),
            masked_cells((rows.start, rows.stop), (cols.start, cols.stop),
                         causal=bool(side.capture.causal))))
        windows.append((rows, cols))
    diff = None
    keep_rows: list[int] = []
    keep_cols: list[int] = []
    if alignment is not None and comparison.diff is not None:
        rows, cols = windows[0]
        keep_rows = [i for i, a in enumerate(alignment.a) if rows.start <= a < rows.stop]
        keep_cols = [j for j, a in enumerate(alignment.a) if cols.start <= a < cols.stop]
        if keep_rows and keep_cols:
            changed = set(alignment.changed)
            diff = Panel(comparison.diff[np.ix_(keep_rows, keep_cols)],
                         [alignment.labels[i] for i in keep_rows],
                         [alignment.labels[j] for j in keep_cols], comparison.diff_title,
                         [n for n, i in enumerate(keep_rows) if i in changed],
                         [n for n, j in enumerate(keep_cols) if j in changed])
    window = window_note(*windows[0])
    return (panels[0], panels[1], diff, f" ({window} of A)" if window else "",
            (keep_rows, keep_cols))


def _layer_head_name(a: Side, b: Side) -> str:
    """``L5_H3`` (``L5_mean``) of the layer and head as resolved (``--layer -1`` names the
    last layer, as the table does); ``L5-11_H3`` when the sides' layers differ."""
    def part(first: object, second: object) -> str:
        return f"{first}" if first == second else f"{first}-{second}"

    head = part(a.head, b.head)
    return f"L{part(a.layer, b.layer)}_{head if head == 'mean' else f'H{head}'}"


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
    server: Annotated[str | None, typer.Option(
        "--server", envvar="ATTNVIZ_SERVER", rich_help_panel=MODEL_PANEL, metavar="URL",
        show_default=False,
        help="Capture both sides through a running 'attnviz serve' at URL instead of loading "
             "the models here ($ATTNVIZ_SERVER); the numbers are the same.")] = None,
    toy_heads: ToyHeadsOpt = 2,
    toy_layers: ToyLayersOpt = 1,
    d_model: DModelOpt = 16,
    causal: CausalOpt = False,
    seed: SeedOpt = 0,
    no_scale: NoScaleOpt = False,
    tokens: TokensOpt = None,
    queries: QueriesOpt = None,
    keys: KeysOpt = None,
    scale: ScaleOpt = ScaleName.power,
    gamma: GammaOpt = None,
    vmax: VmaxOpt = "auto",
    measure: MeasureOpt = None,
) -> None:
    """Compare two attention maps side by side, with their difference over aligned tokens."""
    from attnviz.analysis.compare import compare_captures, format_changes

    head_choice = cast("int | str", _parse_head(head))  # not None: --head has a default
    check_image_path(out, "--out")
    from attnviz.render import analysis as figures
    from attnviz.render.heatmap import ColourScale, check_cmap, save_figure

    check_cmap(cmap)
    colour_scale = ColourScale.of(scale.value, gamma, vmax)  # bad values fail before the models
    paths = list(from_paths or [])
    if paths:
        if len(paths) != 2:
            given = {1: "once", 3: "three times"}.get(len(paths), f"{len(paths)} times")
            raise UsageError(f"--from was given {given}; compare needs it twice (A then B)",
                             "example: attnviz compare --from a/ --from b/")
        if text_a is not None or text_b is not None:
            raise UsageError("give two --from captures or texts, not both")
        if model or model_a or model_b or vs_causal:
            raise UsageError("--model, --model-a, --model-b and --vs-causal cannot be used with "
                             "--from: the captures already say which model made them")
        from attnviz.request import CaptureRequest

        use_server(None)  # saved captures are read here, whatever --server says
        cap_a, cap_b = session().run_each([CaptureRequest(from_path=path, measure=measure)
                                           for path in paths])
        if cap_a.measure != cap_b.measure:
            raise UsageError(f"A holds the measure {cap_a.measure} and B {cap_b.measure}: "
                             "compare captures of the same measure",
                             "dump both texts with the same --measure")
        label_a, label_b = (f"A: {cap_a.model_label} ({paths[0]})",
                            f"B: {cap_b.model_label} ({paths[1]})")
    else:
        if text_a is None:
            raise UsageError("give a TEXT_A to compare (and TEXT_B, --model-a/--model-b or "
                             "--vs-causal), or --from twice",
                             "example: attnviz compare \"The bank of the river\" "
                             "\"The bank approved the loan\"")
        base = {"revision": revision, "trust_remote_code": trust_remote_code, "device": device,
                "dtype": dtype, "toy_heads": toy_heads, "toy_layers": toy_layers,
                "d_model": d_model, "seed": seed, "no_scale": no_scale,
                "max_tokens": max_tokens, "truncate": truncate, "server": server,
                "measure": measure}
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
        same_model = (_side_options(base, text_a, models[0], masks[0]).model_name
                      == _side_options(base, second, models[1], masks[1]).model_name)
        if text_b is None and same_model and masks[0] == masks[1]:
            raise UsageError("nothing to compare: both sides are the same text in the same model",
                             "give a TEXT_B, --model-a and --model-b, or --model toy "
                             "--vs-causal")
        cap_a, cap_b = _compare_captures((text_a, second), models, masks, base, layer,
                                         head_choice)
        mask_a = " (bidirectional)" if vs_causal else ""
        mask_b = " (causal)" if vs_causal else ""
        label_a = f"A: {cap_a.model_label}{mask_a}: {_excerpt(cap_a.text)}"
        label_b = f"B: {cap_b.model_label}{mask_b}: {_excerpt(cap_b.text)}"
    comparison = compare_captures(cap_a, cap_b, layer, head_choice, top=top, words=words,
                                  exclude_special=exclude_special)
    where = comparison.where
    panel_a, panel_b, panel_d, window, (rows, cols) = _panels(
        comparison, (label_a, label_b), tokens, queries, keys)
    if window and comparison.aligned:  # list the changes the figure shows, not the whole map
        comparison.changes = comparison.changes_within(rows, cols, top)
    fig = figures.draw_comparison(panel_a, panel_b, titles=(label_a, label_b),
                                  title=comparison.title + window, diff=panel_d, cmap=cmap,
                                  annot=annot, scale=colour_scale, dpi=dpi)
    if out is None:
        from attnviz.fileio import short_hash, slugify

        digest = short_hash(cap_a.text, cap_b.text, cap_a.model, cap_b.model,
                            str(cap_a.causal), str(cap_b.causal), length=6)
        shown = _layer_head_name(comparison.a, comparison.b)
        shown += "" if cap_a.measure == "weights" else f"_{cap_a.measure}"
        shown += view_suffix(words=words, exclude_special=exclude_special, tokens=tokens,
                             queries=queries, keys=keys)
        out = Path(f"compare_{slugify(cap_a.text, 24)}_{digest}_{shown}.png")
    path = save_figure(fig, out, dpi=dpi)
    # What was paired with what, and how unpaired weight was treated: on standard error.
    for note in (comparison.note, comparison.renormalised_note):
        if note:
            stderr.print(f"Note: {escape(note)}", markup=True, highlight=False)
    if fmt is TableFormat.json:
        typer.echo(json.dumps(comparison.to_dict(str(path), label_a, label_b),
                              ensure_ascii=False, indent=1))
        if not comparison.aligned:
            warn(escape(comparison.mismatch))
        return
    # The image path goes with the table; with csv or markdown the table owns standard output.
    (stdout if fmt is TableFormat.table else stderr).print(str(path), markup=False)
    if not comparison.aligned:
        warn(escape(comparison.mismatch))
        return
    if top == 0:
        return
    if fmt is TableFormat.table and not comparison.changes:
        stdout.print(f"B - A ({escape(where)}): no change, A and B have the same weights here")
        return
    if fmt is TableFormat.table:
        from rich.table import Table

        raw = comparison.renormalised
        how = f", rows renormalised over the paired {comparison.unit}s" if raw else ""
        table = Table(title=f"Largest changes, B - A ({escape(where)}){how}", show_edge=False)
        columns = [("query", "left"), ("key", "left"), ("A", "right"), ("B", "right"),
                   ("B - A", "right")] + ([("A raw", "right"), ("B raw", "right")] if raw else [])
        for name, justify in columns:
            table.add_column(name, justify=justify)  # type: ignore[arg-type]
        for change in comparison.changes:
            delta = float(change["delta"])  # type: ignore[arg-type]
            colour = "red" if delta > 0 else "blue"
            extra = [f"{change['a_raw']:.3f}", f"{change['b_raw']:.3f}"] if raw else []
            table.add_row(escape(f"{change['query_index']}:{change['query']}"),
                          escape(f"{change['key_index']}:{change['key']}"), f"{change['a']:.3f}",
                          f"{change['b']:.3f}", f"[{colour}]{delta:+.3f}[/{colour}]", *extra)
        print_wide(table)
        return
    typer.echo(format_changes(comparison.changes, fmt.value, where), nl=False)
