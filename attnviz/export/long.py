"""``attnviz export --long``: long inputs, one folder per text, bounded in size.

A long capture holds no weights, so a text's folder gets what can be derived from it in
streamed passes rather than ``layers x heads`` full-size figures::

    OUT_DIR/
        index.json, index.html        every text of this run, as a normal export's
        the-cat-sat-on-the-mat-1a2b3c4d5e/
            overview.png              every layer and head as atlases (block maxima)
            layers/L00.png ...        one grid of atlases per layer
            topk.csv                  top-k keys of every query, every layer and head
            heads.csv                 each head's statistics (entropy, distance, ...)
            sinks.json                the attention sinks (Gu et al.) and their share of heads
            export.json               this folder's manifest; ``"complete": true`` once done

Texts are captured and written one at a time (each long capture is closed before the next),
so memory stays that of one capture. Folder names, the lock, atomic writes and the index are
those of :mod:`attnviz.export`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import time
from collections.abc import Iterable
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, cast

from attnviz.errors import AttnvizError, InputError, OutputError, UsageError
from attnviz.export.plan import ExportItem, ExportOptions, ExportProgress, ExportSummary

if TYPE_CHECKING:
    from attnviz.capture import Capture
    from attnviz.long import LongCapture
    from attnviz.request import CaptureRequest
    from attnviz.session import Session

HEADS_CSV = "heads.csv"
SINKS_JSON = "sinks.json"


def _figures(cap: LongCapture, options: ExportOptions) -> dict[str, Any]:
    """The atlas figures the options ask for, by file name."""
    from attnviz.render.atlas import atlas_grid_figure
    from attnviz.render.heatmap import FigureOptions

    figure = FigureOptions(cmap=options.cmap, scale=options.scale, gamma=options.gamma,
                           vmax=options.vmax, dpi=options.dpi)
    fmt = options.fmt
    drawn: dict[str, Any] = {}
    if "overview" in options.figures:
        drawn[f"overview.{fmt}"] = atlas_grid_figure(cap, None, options=figure)[0]
    if "layers" in options.figures:
        for layer in cap.layers:
            drawn[f"layers/L{layer:02d}.{fmt}"] = atlas_grid_figure(cap, layer,
                                                                    options=figure)[0]
    return drawn


def _write_bytes(data: bytes, handle: IO[bytes]) -> None:
    handle.write(data)


def write_text(cap: LongCapture, folder: Path, options: ExportOptions,
               progress: ExportProgress | None = None) -> list[str]:
    """Write one text's files into ``folder`` (inside the export folder); returns their
    names, relative to ``folder``; ``progress`` hears of the pass over every head."""
    from attnviz.analysis.long import topk_csv_rows
    from attnviz.analysis.topk import TOPK_CSV_COLUMNS
    from attnviz.csvtext import csv_text
    from attnviz.fileio import atomic_write, atomic_write_text
    from attnviz.render.heatmap import figure_bytes

    files: list[str] = []
    root = folder.parent
    # One pass over every head's scores gives the atlas, statistics and sinks (a capture
    # made with the summary holds it already; a saved one is scanned once here).
    shown = progress or ExportProgress()
    cap.summarise(progress=functools.partial(
        shown.step, "atlas, statistics and sinks of every head (tokens)"))
    for name, fig in _figures(cap, options).items():
        path = folder / name
        data = figure_bytes(fig, options.fmt, options.dpi)
        atomic_write(path, functools.partial(_write_bytes, data), root=root)
        files.append(name)
    atomic_write_text(folder / "topk.csv", csv_text(TOPK_CSV_COLUMNS,
                                                    topk_csv_rows(cap, options.top_k)),
                      root=root)
    files.append("topk.csv")
    from attnviz.analysis.heads import head_report
    from attnviz.analysis.long import long_stat_sums, sink_table

    report = head_report(long_stat_sums(cap), cast("Capture", cap))  # title: pair, causal
    atomic_write_text(folder / HEADS_CSV, report.format("csv"), root=root)
    atomic_write_text(folder / SINKS_JSON, json.dumps(sink_table(cap), ensure_ascii=False,
                                                      indent=1), root=root)
    files += [HEADS_CSV, SINKS_JSON]
    return files


def export_long(items: Iterable[ExportItem], out_dir: Path, options: ExportOptions, *,
                request: CaptureRequest, session: Session,
                progress: ExportProgress | None = None) -> ExportSummary:
    """Export every item (texts, or ``--from`` long captures) as long captures.

    Args:
        items: the inputs (:func:`attnviz.export.read_input`, texts, dumps).
        out_dir: the export folder (created).
        options: the figures (``overview``, ``layers``; heads are drawn by ``attnviz heatmap
            --long --tokens``), format, colours and ``top_k``.
        request: the model, layers, limits and ``long_dtype`` of every text.
        session: the warm engine.
        progress: receives progress events.

    Returns:
        The summary; failed texts are reported and skipped.

    Raises:
        UsageError: an option that fits no text (``--heads``, ``--words``...).
        OutputError: the output folder cannot be written.
    """
    from attnviz.export.index import Index, failed_entry, folder_entry, index_header
    from attnviz.export.plan import folder_name
    from attnviz.export.write import MANIFEST, MANIFEST_FORMAT, export_lock, write_json
    from attnviz.fileio import LinkError, ensure_dir, signals_held
    from attnviz.inputs import safe_child

    if options.words or options.exclude_special:
        raise UsageError("--words and --exclude-special do not apply to a long capture",
                         "leave them out with --long")
    if options.heads is not None:
        raise UsageError("--heads does not apply to a long capture: it keeps every head of its "
                         "layers", "leave out --heads")
    if any((options.tokens, options.queries, options.keys)):
        raise UsageError("--long exports draw the atlas of the whole input",
                         "draw a window with attnviz heatmap --long --layer L --head H "
                         "--tokens A:B")
    progress = progress or ExportProgress()
    summary = ExportSummary(out_dir=out_dir)
    started = time.perf_counter()
    ensure_dir(out_dir)
    settings = {**options.settings(), "long": True, "long_dtype": request.long_dtype}
    with export_lock(out_dir):
        index = Index(out_dir)
        try:
            for number, item in enumerate(items, start=1):
                if item.blank:
                    summary.blank += 1
                    continue
                summary.texts += 1
                label = item.origin or f"text {number}"
                name: str | None = None
                try:
                    if item.error:
                        raise InputError(item.error)
                    cap = _capture(item, dataclasses.replace(request, long_summary=True),
                                   session, progress)
                    name = folder_name(cap.text, cap.pair, item.id)
                    folder = safe_child(out_dir, name)
                    progress.begin_text(label, len(options.figures) + 3)
                    manifest = {"format": MANIFEST_FORMAT, "format_version": 1,
                                "complete": False, "long": True, "settings": settings,
                                "origin": item.origin, "id": item.id, "text": cap.text,
                                "pair": cap.pair, "model": cap.model,
                                "num_tokens": cap.num_tokens, "layers": list(cap.layers),
                                "heads": list(range(cap.num_heads)), "files": []}
                    try:  # the folder is described (not complete) before its first file
                        write_json(folder / MANIFEST, manifest)
                        files = write_text(cap, folder, options, progress)
                    finally:
                        cap.close()
                    manifest = {**manifest, "complete": True, "files": files}
                    with signals_held():
                        write_json(folder / MANIFEST, manifest)
                        index.add(folder_entry(number, item, name, manifest, "exported"))
                    summary.exported += 1
                    summary.files_written += len(files) + 1
                    progress.advance(len(files) + 1)
                    progress.end_text(label, "exported", f"{name}: {len(files) + 1} files")
                except AttnvizError as error:
                    stop = (isinstance(error, OutputError) and not isinstance(error, LinkError))
                    if stop or (isinstance(error, UsageError) and not isinstance(error, InputError)
                                and item.dump is None):
                        if stop and name is not None:  # the index says which text it stopped at
                            summary.add_failure(label, error.message)
                            with contextlib.suppress(OSError):  # its scratch file: same disk
                                index.add(failed_entry(number, item, error.message,
                                                       folder=name))
                        raise  # fits no text (or nothing can be written): stop; a link in
                        # one text's folder fails that text only, as in a normal export
                    summary.add_failure(label, error.message)
                    index.add(failed_entry(number, item, error.message, folder=name))
                    progress.end_text(label, "failed", error.message)
        except BaseException:
            summary.seconds = time.perf_counter() - started
            if index.count:  # what was done (and where it stopped) stays listed
                try:
                    index.finish(index_header(summary, settings, {"name": request.spec.name}))
                except (AttnvizError, OSError):  # a full disk may not hold the index either
                    index.discard()
            else:
                index.discard()
            raise
        summary.seconds = time.perf_counter() - started
        index.finish(index_header(summary, settings, {"name": request.spec.name}))
    return summary


def _capture(item: ExportItem, request: CaptureRequest, session: Session,
             progress: ExportProgress) -> LongCapture:
    """The long capture of one item (a saved long capture is read, not captured again);
    ``progress`` hears of the forward pass, layer by layer."""

    held = session.long_progress
    session.long_progress = functools.partial(
        progress.step, "forward pass, every head's summary on the way (layers)")
    try:
        return _capture_item(item, request, session)
    finally:
        session.long_progress = held


def _capture_item(item: ExportItem, request: CaptureRequest,
                  session: Session) -> LongCapture:
    from attnviz.long import LongCapture

    if item.dump is not None:
        answer = session.run(dataclasses.replace(request, text=None, from_path=item.dump,
                                                 model=None, long=True))
        if not isinstance(answer, LongCapture):
            raise InputError(f"{item.dump} is a full capture, not a long one",
                             "export it without --long")
        return answer
    answer = session.run(dataclasses.replace(request, text=item.text, pair=item.pair,
                                             long=True))
    if not isinstance(answer, LongCapture):  # the model has no long path; the full capture
        raise InputError("this model cannot take the long path",  # fits: a normal export
                         "export the text without --long")
    return answer
