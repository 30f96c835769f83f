"""``html``: one self-contained, offline HTML report with every view of the attention."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from attnviz.cli._app import app
from attnviz.cli._common import (
    INPUT_PANEL,
    OUTPUT_PANEL,
    VIEW_PANEL,
    CaptureOptions,
    ExcludeSpecialOpt,
    HeadsOpt,
    LayersOpt,
    WordsOpt,
    capture_options,
    handle_errors,
    session,
    stdout,
    warn,
)
from attnviz.errors import InputError, UsageError
from attnviz.fileio import check_output
from attnviz.request import check_text

if TYPE_CHECKING:
    from attnviz.capture import Capture


@dataclass(frozen=True)
class InputText:
    """One text of an ``--input`` file."""

    text: str
    pair: str | None
    line: int


def read_input_file(path: Path) -> tuple[list[InputText], int]:
    """Texts of an ``--input`` file: one per line, or JSONL with ``text`` (and ``pair``).

    A line starting with ``{`` is read as JSON. ``-`` reads standard input.

    Returns:
        The texts and the number of blank lines skipped.

    Raises:
        InputError: the file is missing, not UTF-8, holds a bad JSON line, or no text.
    """
    if str(path) == "-":
        raw = sys.stdin.read()
        where = "standard input"
    else:
        from attnviz.fileio import read_input_text

        try:  # bounded: a pipe or a device such as /dev/zero cannot exhaust memory
            raw = read_input_text(path, "--input")
        except UnicodeDecodeError as exc:
            raise InputError(f"--input {path} is not valid UTF-8 (byte {exc.start})",
                             "save the file as UTF-8 and try again") from None
        except OSError as exc:
            raise InputError(f"cannot read --input {path}: {exc.strerror or exc}") from None
        where = str(path)
    texts: list[InputText] = []
    blank = 0
    for number, line in enumerate(raw.splitlines(), start=1):
        stripped = line.strip()
        if not stripped:
            blank += 1
            continue
        pair: str | None = None
        text = line.rstrip("\r\n")
        if stripped.startswith("{"):
            try:
                record = json.loads(stripped)
            except json.JSONDecodeError as exc:
                raise InputError(f"{where}, line {number}: invalid JSON ({exc.msg})",
                                 "write one JSON object per line, e.g. {\"text\": \"...\"}"
                                 ) from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise InputError(f"{where}, line {number}: a JSON line needs a \"text\" string")
            text = record["text"]
            pair_value = record.get("pair")
            if pair_value is not None and not isinstance(pair_value, str):
                raise InputError(f"{where}, line {number}: \"pair\" must be a string")
            pair = pair_value
        check_text(text, f"{where}, line {number}")
        if pair is not None:
            check_text(pair, f"the pair on {where}, line {number}")
        texts.append(InputText(text=text, pair=pair, line=number))
    if not texts:
        raise InputError(f"{where} holds no text", "write one text per line")
    return texts, blank


def _captures_from_file(options: CaptureOptions, path: Path, layers: str | None,
                        heads: str | None) -> list[Capture]:
    """One capture per text of an ``--input`` file, through the CLI session: from the capture
    cache when it holds the text, else from the model (loaded once)."""
    texts, blank = read_input_file(path)
    if blank:
        warn(f"skipped {blank} blank line{'s' if blank != 1 else ''} in {path}")
    request = options.model_request(layers=layers, heads=heads)
    captures = []
    for item, capture in zip(texts, session().run_texts(
            request, [(item.text, item.pair) for item in texts])):
        if isinstance(capture, InputError):
            raise capture
        for message in capture.meta.get("warnings", []):
            warn(f"line {item.line}: {message}")
        captures.append(capture)
    return captures


def _default_output(captures: list[Capture], input_file: Path | None) -> Path:
    from attnviz.fileio import short_hash, slugify

    first = captures[0]
    if input_file is not None and str(input_file) != "-":
        slug = slugify(input_file.stem, 30)
    else:
        slug = slugify(first.text, 30)
    digest = short_hash(*(c.text for c in captures), first.pair or "", first.model, length=6)
    return Path(f"attention_{slug}_{digest}_report.html")


def _long_report(options: CaptureOptions, input_file: Path | None, folder: Path,
                 out: Path | None, title: str | None) -> None:
    """``--long-from``: the offline long-context report (``render/long_html.py``)."""
    if options.text is not None or options.from_path is not None or input_file is not None:
        raise UsageError("--long-from cannot be combined with TEXT, --from or --input",
                         "the long capture holds its text")
    from attnviz.fileio import short_hash, slugify
    from attnviz.long import load_long
    from attnviz.session.long_path import refuse_measure

    refuse_measure(options.measure, folder)
    from attnviz.render.long_html import write_long_report

    capture = load_long(folder)
    if out is None:
        out = Path(f"attention_{slugify(capture.text, 30)}_"
                   f"{short_hash(capture.text, capture.model, length=6)}_long.html")
    from attnviz.cli._common import stderr
    from attnviz.cli._steps import stepping

    with stepping(stderr, "atlas, statistics and sinks of every head", "tokens") as progress:
        written = write_long_report(capture, out, title=title, progress=progress)
    stdout.print(str(written))


@app.command("html")
@handle_errors
@capture_options
def html_command(
    options: CaptureOptions,
    out: Annotated[Path | None, typer.Option(
        "--out", "-o", rich_help_panel=OUTPUT_PANEL,
        help="Report file (.html). Default: a name derived from the text.")] = None,
    input_file: Annotated[Path | None, typer.Option(
        "--input", "-i", rich_help_panel=INPUT_PANEL, metavar="FILE",
        help="Several texts in one report: one text per line, or JSONL lines with 'text' "
             "(and 'pair'); '-' reads standard input. Blank lines are skipped.")] = None,
    layers: LayersOpt = None,
    heads: HeadsOpt = None,
    title: Annotated[str | None, typer.Option(
        "--title", rich_help_panel=OUTPUT_PANEL,
        help="Page title. Default: the model and the text.")] = None,
    precision: Annotated[int, typer.Option(
        "--precision", rich_help_panel=OUTPUT_PANEL,
        help="Bits per stored weight: 8 (smallest file, error <= 0.002) or 16 (error "
             "<= 0.00001).")] = 8,
    top_k: Annotated[int, typer.Option(
        "--top-k", "-k", min=1, max=50, rich_help_panel=VIEW_PANEL,
        help="Keys listed in the head view's hover tooltip.")] = 5,
    words: WordsOpt = False,
    exclude_special: ExcludeSpecialOpt = False,
    long_from: Annotated[Path | None, typer.Option(
        "--long-from", rich_help_panel=INPUT_PANEL, metavar="DIR", show_default=False,
        help="A saved long capture: write its zoomable atlas report instead (the coarser "
             "atlas levels of every head and of each layer's mean, the head statistics and "
             "the attention sinks).")] = None,
) -> None:
    """Write one self-contained HTML report (head view, model view, heatmaps, statistics).

    The file holds its data, scripts and styles: it opens offline in any recent browser.

    --words and --exclude-special only set how the page opens; both are toggles in it.

    Examples:

      attnviz html "The cat sat on the mat" -o report.html

      attnviz html --from cat/ -o cat.html

      attnviz html --input sentences.txt --layers 0-2 -o sentences.html

      attnviz html "The cat sat on the mat" --measure norm -o norm.html

      attnviz html --long-from book_long/ -o book.html
    """
    check_output(out)
    if precision not in (8, 16):
        raise UsageError(f"--precision {precision} is not supported", "use 8 or 16")
    if out is not None and out.suffix.lower() not in (".html", ".htm"):
        raise UsageError(f"{out} does not end in .html", "name the report e.g. -o report.html")
    if long_from is not None:
        if layers is not None or heads is not None:
            raise UsageError("--layers and --heads do not go with --long-from",
                             "the long report holds every recorded layer and head")
        _long_report(options, input_file, long_from, out, title)
        return
    if input_file is not None:
        if options.text is not None or options.from_path is not None:
            raise UsageError("--input cannot be combined with TEXT or --from",
                             "put every text in the --input file, one per line")
        if options.pair is not None:
            raise UsageError("--pair cannot be used with --input",
                             "give pairs as JSONL lines: {\"text\": \"...\", \"pair\": \"...\"}")
        captures = _captures_from_file(options, input_file, layers, heads)
    else:
        captures = [session().run_full(options.request(layers=layers, heads=heads))]
    from attnviz.render.html import write_report

    path = write_report(captures, out or _default_output(captures, input_file), title=title,
                        precision=precision, top_k=top_k, words=words,
                        exclude_special=exclude_special)
    stdout.print(str(path))
