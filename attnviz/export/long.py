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
so memory stays that of one capture. Folder names, the lock, atomic writes, the index, the
resume (a text complete from an earlier run with the same settings is skipped; ``--force``
redraws) and the replacing of an earlier export only once the new one is complete are those of
:mod:`attnviz.export` (:mod:`~attnviz.export.write`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import time
from collections.abc import Iterable
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from attnviz.errors import AttnvizError, InputError, OutputError, UsageError
from attnviz.export.plan import ExportItem, ExportOptions, ExportProgress, ExportSummary
from attnviz.export.write import LONG_FILES

if TYPE_CHECKING:
    from attnviz.export.index import Index
    from attnviz.record import AttentionRecord as LongCapture
    from attnviz.request import CaptureRequest
    from attnviz.session import Session

HEADS_CSV, SINKS_JSON = LONG_FILES


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
    from attnviz.analysis.tables import topk_csv_rows
    from attnviz.analysis.topk import TOPK_CSV_COLUMNS
    from attnviz.csvtext import csv_text
    from attnviz.fileio import atomic_write, atomic_write_text
    from attnviz.render.heatmap import figure_bytes

    files: list[str] = []
    root = folder.parent
    # One pass over every head's scores gives the atlas, statistics and sinks (a capture
    # made with the summary holds it already; a saved one is scanned once here).
    shown = progress or ExportProgress()
    cap.prepare(progress=functools.partial(
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
    from attnviz.analysis.tables import long_stat_sums, sink_table

    report = head_report(long_stat_sums(cap), cap)  # title: pair, causal
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
    from attnviz.export.index import Index, failed_entry, index_header
    from attnviz.export.write import export_lock
    from attnviz.fileio import LinkError, ensure_dir

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
                try:
                    _one(number, item, label, out_dir, options, settings, request, session,
                         summary, progress, index)
                except _Failed as failed:
                    error = failed.error
                    stop = (isinstance(error, OutputError) and not isinstance(error, LinkError))
                    if stop or (isinstance(error, UsageError) and not isinstance(error, InputError)
                                and item.dump is None):
                        if stop and failed.name is not None:  # the index says where it stopped
                            summary.add_failure(label, error.message)
                            with contextlib.suppress(OSError):  # its scratch file: same disk
                                index.add(failed_entry(number, item, error.message,
                                                       folder=failed.name))
                        raise error from None  # fits no text (or nothing can be written):
                        # stop; a link in one text's folder fails that text only
                    summary.add_failure(label, error.message)
                    index.add(failed_entry(number, item, error.message, folder=failed.name))
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


class _Failed(Exception):
    """One text failed with ``error``; ``name``: its folder, once known."""

    def __init__(self, error: AttnvizError, name: str | None) -> None:
        super().__init__(error.message)
        self.error, self.name = error, name


def _one(number: int, item: ExportItem, label: str, out_dir: Path, options: ExportOptions,
         settings: dict[str, Any], request: CaptureRequest, session: Session,
         summary: ExportSummary, progress: ExportProgress, index: Index) -> None:
    """Export one item and add its index entry (``exported`` or ``skipped``).

    A text an earlier run completed with the same settings (and model) is skipped, as in a
    full export (:func:`~attnviz.export.write.finished_export`; ``--force`` redraws), and an
    earlier export in the folder stays whole until this one is complete.

    Raises:
        _Failed: the text failed (the error, and its folder once known).
    """
    from attnviz.export.capture import model_settings
    from attnviz.export.exporter import skip_text
    from attnviz.export.index import folder_entry
    from attnviz.export.plan import check_texts, folder_name
    from attnviz.export.write import (
        MANIFEST,
        MANIFEST_FORMAT,
        check_folder,
        clean_temporaries,
        drop_staging,
        finished_export,
        replace_outputs,
        staging_folder,
        write_json,
    )
    from attnviz.fileio import signals_held
    from attnviz.inputs import safe_child

    name: str | None = None
    cap: LongCapture | None = None
    try:
        if item.error:
            raise InputError(item.error)
        if item.dump is None:  # named and checked before the model runs: a complete text
            text, pair = item.text or "", item.pair  # costs nothing
            check_texts(text, pair)
            source = model_settings(request.spec, request.max_tokens, request.truncate)
        else:
            cap = _capture(item, request, session, progress)
            text, pair, source = cap.text, cap.pair, {"dump": cap.model}
        name = folder_name(text, pair, item.id)
        folder = safe_child(out_dir, name)
        check_folder(folder, out_dir)  # LinkError: this text fails, nothing goes through it
        full_settings = {**settings, "source": source}
        finished = finished_export(folder, full_settings, text, pair, options.force)
        if finished is not None:
            index.add(skip_text(summary, progress, number, item, label, name, finished))
            return
        if cap is None:
            cap = _capture(item, request, session, progress)
        progress.begin_text(label, len(options.figures) + 3)
        if folder.exists():
            clean_temporaries(folder)
        work = staging_folder(folder, out_dir, resume=False)
        try:
            manifest = {"format": MANIFEST_FORMAT, "format_version": 1,
                        "complete": False, "long": True, "settings": full_settings,
                        "origin": item.origin, "id": item.id, "text": text,
                        "pair": pair, "model": cap.model,
                        "num_tokens": cap.num_tokens, "layers": list(cap.layers),
                        "heads": list(cap.heads), "files": []}
            # The folder is described (not complete) before its first file.
            write_json(work / MANIFEST, manifest)
            files = write_text(cap, work, options, progress)
            manifest = {**manifest, "complete": True, "files": files}
            with signals_held():  # files, manifest and index entry together
                replace_outputs(folder, work, files, out_dir)
                write_json(folder / MANIFEST, manifest)
                index.add(folder_entry(number, item, name, manifest, "exported"))
        finally:
            drop_staging(folder, work)
    except AttnvizError as error:
        raise _Failed(error, name) from None
    finally:
        if cap is not None:
            cap.close()
    summary.exported += 1
    summary.files_written += len(files) + 1
    progress.advance(len(files) + 1)
    progress.end_text(label, "exported", f"{name}: {len(files) + 1} files")


def _capture(item: ExportItem, request: CaptureRequest, session: Session,
             progress: ExportProgress) -> LongCapture:
    """The long capture of one item (a saved long capture is read, not captured again), with
    every head's summary from the forward's own pass; ``progress`` hears of the forward, layer
    by layer."""
    held = session.long_progress
    session.long_progress = functools.partial(
        progress.step, "forward pass, every head's summary on the way (layers)")
    try:
        return _capture_item(item, dataclasses.replace(request, long_summary=True), session)
    finally:
        session.long_progress = held


def _capture_item(item: ExportItem, request: CaptureRequest,
                  session: Session) -> LongCapture:
    """The record of one item (a saved capture is read, not captured again). A model without
    a long path answers with its full capture when that fits; its files are written the same
    way, since every record answers the same questions."""
    if item.dump is not None:
        return session.run(dataclasses.replace(request, text=None, from_path=item.dump,
                                               model=None, long=True))
    return session.run(dataclasses.replace(request, text=item.text, pair=item.pair,
                                           long=True))
