"""Export: one run, text by text: capture, write, draw, index (see :mod:`attnviz.export`).

The :class:`Exporter` takes the input in order: a text is checked and named
(:mod:`~attnviz.export.plan`), skipped when an earlier run completed its folder or resumed
when it started it (:mod:`~attnviz.export.write`), captured through the session
(:mod:`~attnviz.export.capture`), saved with its top-k table and manifest, and its figures
drawn (:mod:`~attnviz.export.draw`) here or by the workers (:mod:`~attnviz.export.pool`).
A text's index entry (:mod:`~attnviz.export.index`) is written once its folder is complete,
in input order.
"""

from __future__ import annotations

import collections
import json
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from attnviz.errors import AttnvizError, InputError, OutputError, UsageError
from attnviz.export.capture import TextCaptures, model_settings, select
from attnviz.export.draw import plan_tasks, render_task, write_topk
from attnviz.export.index import (
    Index,
    PartEntries,
    duplicate_entry,
    failed_entry,
    folder_entry,
    index_header,
    write_text_report,
)
from attnviz.export.plan import (
    SMALL_JOB_TEXTS,
    ExportItem,
    ExportOptions,
    ExportProgress,
    ExportSummary,
    Lookahead,
    check_texts,
    check_views,
    folder_name,
    jobs_for,
)
from attnviz.export.pool import default_jobs, drawn, end_pool, start_pool
from attnviz.export.write import (
    CAPTURE_FILES,
    MANIFEST,
    check_folder,
    clean_temporaries,
    drop_staging,
    export_lock,
    finished_export,
    is_file,
    new_manifest,
    read_json,
    replace_outputs,
    same_export,
    staging_folder,
    text_files,
    write_json,
)
from attnviz.fileio import LinkError

if TYPE_CHECKING:
    from concurrent.futures import Future, ProcessPoolExecutor

    from attnviz.capture import Capture
    from attnviz.models import ModelSpec
    from attnviz.session import Session

@dataclass
class _Pending:
    """A text whose figures are being drawn."""

    number: int
    item: ExportItem
    label: str
    folder: Path
    manifest: dict[str, Any]
    futures: list[Future[tuple[int, int]]]
    written: int
    existing: int
    started: float
    work: Path  # where the files are written: the folder, or its staging folder


def skip_text(summary: ExportSummary, progress: ExportProgress, number: int, item: ExportItem,
              label: str, name: str, manifest: dict[str, Any]) -> dict[str, Any]:
    """Count a text an earlier run completed (:func:`~attnviz.export.write.finished_export`)
    as skipped; returns its index entry. Shared by the full and the long export."""
    summary.skipped += 1
    summary.files_skipped += len(manifest.get("files", [])) + 1  # + export.json
    progress.end_text(label, "skipped", f"complete from an earlier run ({name})")
    return folder_entry(number, item, name, manifest, "skipped")


@dataclass
class _Ready:
    """A text already dealt with (failed or skipped): its index entry waits for its turn."""

    entry: dict[str, Any]


class Exporter:
    """Runs one export; see :func:`attnviz.export.export_items`."""

    def __init__(self, out_dir: Path, options: ExportOptions, *, spec: ModelSpec | None,
                 max_tokens: int | None, truncate: bool, use_cache: bool,
                 progress: ExportProgress, session: Session | None = None) -> None:
        self.out_dir = out_dir
        self.options = options
        self.progress = progress
        self.jobs = options.jobs or default_jobs()
        self.summary = ExportSummary(out_dir)
        self.settings = options.settings()
        self.captures = TextCaptures(spec, max_tokens=max_tokens, truncate=truncate,
                                     use_cache=use_cache, batch_size=options.batch_size,
                                     note=progress.note, session=session,
                                     measure=options.measure)
        self._pool: ProcessPoolExecutor | None = None
        self._seen: dict[str, str] = {}
        self._pending: collections.deque[_Pending | _Ready] = collections.deque()
        self._model_settings = model_settings(spec, max_tokens, truncate)
        self._stream: Lookahead | None = None
        self._drawing: set[Path] = set()  # text folders the workers are writing to

    # ------------------------------------------------------------------ run
    def run(self, items: Iterable[ExportItem]) -> ExportSummary:
        """Export ``items``; see :func:`attnviz.export.export_items`.

        The output folder is locked for the run (a second export into it fails at once with
        an :class:`OutputError` naming the first one's process), and a folder this call created
        is removed again if the run ends with nothing written in it.
        """
        with export_lock(self.out_dir):
            return self._run(items)

    def _run(self, items: Iterable[ExportItem]) -> ExportSummary:
        started = time.perf_counter()
        stream = Lookahead(items, max(self.jobs, self.options.batch_size, SMALL_JOB_TEXTS))
        self._stream = stream
        if self.options.jobs is None:
            self.jobs = jobs_for(stream.peek(), self.jobs)
        elif stream.ahead() <= 1 and len(self.options.figures) == 1:
            self.jobs = 1  # one text, one kind of figure: one frame, nothing to share
        index = Index(self.out_dir)
        number = 0
        try:
            self._start_pool()
            for item in stream:
                if item.blank:
                    self.summary.blank += 1
                    continue
                number += 1
                self.summary.texts += 1
                self._one(number, item, stream.ahead())
                while self._pending and (self._pool is None or len(self._pending) > self.jobs
                                         or isinstance(self._pending[0], _Ready)):
                    self._finish(self._pending.popleft(), index)
            while self._pending:
                self._finish(self._pending.popleft(), index)
            self.captures.clear()
            if self.options.html:
                self._write_report(index)
            self._stop_pool(cancel=False)
        except BaseException:
            self._stop_pool(cancel=True)
            self._drop_pending()
            self.summary.seconds = time.perf_counter() - started
            self._end_index(index, failed=True)
            raise
        self.summary.seconds = time.perf_counter() - started
        self._end_index(index, failed=False)
        return self.summary

    def _drop_pending(self) -> None:
        """Remove the staging folders of texts left unfinished (their earlier exports stay)."""
        for pending in self._pending:
            if isinstance(pending, _Pending):
                drop_staging(pending.folder, pending.work)
        self._pending.clear()

    def _start_pool(self) -> None:
        if self.jobs <= 1 or self._pool is not None:
            return
        self._pool = start_pool(self.jobs)
        if self._pool is None:  # new processes could not re-import the main module
            self.jobs = 1

    def _stop_pool(self, cancel: bool) -> None:
        """Wait for the workers to finish, or (``cancel``) end them now: an interrupted or
        failed export stops drawing at once, and their temporary files are removed."""
        pool = self._pool
        if pool is None:
            return
        if not cancel:
            pool.shutdown(wait=True)  # interrupted here: the cancelling call still finds it
            self._pool = None
            return
        self._pool = None
        end_pool(pool)
        for folder in self._drawing:  # what the ended workers were writing
            clean_temporaries(folder, self.out_dir)

    # ------------------------------------------------------------------ index and report
    def _write_report(self, index: Index) -> None:
        report = write_text_report(index, self.out_dir, self.options, self.progress.note)
        if report is not None:
            self.summary.report = report
            self.summary.files_written += 1

    def _end_index(self, index: Index, *, failed: bool) -> None:
        """Write index.json and index.html; after a failure only if a text was listed (what
        finished before an interruption stays listed)."""
        if failed and not index.count:
            index.discard()
            return
        try:
            index.finish(index_header(self.summary, self.settings, self._model_settings))
        except AttnvizError:
            index.discard()
            raise

    def _fail(self, number: int, item: ExportItem, label: str, message: str,
              folder: str | None = None) -> dict[str, Any]:
        self.summary.add_failure(item.origin or label, message)
        self.progress.end_text(label, "failed", message)
        return failed_entry(number, item, message, folder)

    # ------------------------------------------------------------------ one text
    def _one(self, number: int, item: ExportItem, ahead: int) -> None:
        from attnviz.errors import DeviceError, ModelLoadError

        label = item.origin or f"text {number}"
        if item.error:
            self._pending.append(_Ready(self._fail(number, item, label, item.error)))
            return
        try:
            self._prepare(number, item, label, ahead)
        except UsageError as error:
            if item.dump is None and not isinstance(error, InputError):
                raise  # a selection that does not fit the model fits no text: stop
            self._pending.append(_Ready(self._fail(number, item, label, error.message)))
        except AttnvizError as error:
            if isinstance(error, OutputError) and not isinstance(error, LinkError):
                raise  # the output folder is not writable: every text would fail
            if isinstance(error, (ModelLoadError, DeviceError)) and not self.captures.loaded \
                    and item.dump is None:
                raise  # the model cannot be loaded: every text would fail
            self._pending.append(_Ready(self._fail(number, item, label, error.message)))
        finally:
            self.captures.forget(item)  # drawn from disk now: free its capture

    def _prepare(self, number: int, item: ExportItem, label: str, ahead: int) -> None:
        from attnviz.capture import load_capture

        options = self.options
        dump_capture: Capture | None = None
        if item.dump is not None:
            dump_capture = load_capture(item.dump, mmap=True)
            text, pair = dump_capture.text, dump_capture.pair
            source = {"dump": dump_capture.model}
            name = folder_name(text, pair, item.id, salt=f"dump:{dump_capture.model}")
        else:
            text, pair = item.text or "", item.pair
            check_texts(text, pair)
            source = self._model_settings
            name = folder_name(text, pair, item.id)
        duplicate = self._claim(number, item, label, text, pair, name, source)
        if duplicate is not None:
            self._pending.append(_Ready(duplicate))
            return
        folder = self.out_dir / name
        check_folder(folder, self.out_dir)
        settings = {**self.settings, "source": source}
        finished = finished_export(folder, settings, text, pair, options.force)
        if finished is not None:
            self._pending.append(_Ready(skip_text(self.summary, self.progress, number, item,
                                                  label, name, finished)))
            return
        resume = same_export(read_json(folder / MANIFEST), settings, text,
                             pair) and not options.force
        if folder.exists():
            clean_temporaries(folder)
        # An earlier export (another run's settings, or --force) stays whole until this one is
        # complete: the new files go into a staging folder, moved into place by _finish.
        work = staging_folder(folder, self.out_dir, resume)
        try:
            self._write(number, item, label, ahead, text, pair, settings, folder, work,
                        dump_capture, resume)
        except BaseException:
            drop_staging(folder, work)
            raise

    def _write(self, number: int, item: ExportItem, label: str, ahead: int, text: str,
               pair: str | None, settings: dict[str, Any], folder: Path, work: Path,
               dump_capture: Capture | None, resume: bool) -> None:
        """Capture (or read) a text and write its files into ``work``."""
        from attnviz.capture import load_capture

        options = self.options
        capture: Capture | None = None
        if resume and is_file(work / "capture.json"):  # resumed: work is the folder
            try:
                capture = load_capture(work, mmap=False)  # a copy: the file may change
            except AttnvizError:
                capture = None
        if capture is None:
            for stale in ("capture.json", "attention.npy"):
                (work / stale).unlink(missing_ok=True)
            if dump_capture is not None:
                capture = select(dump_capture, options)
            else:
                capture = select(self.captures.capture_item(
                    item, text, pair, self._stream, self._needs_model), options)
            for message in capture.meta.get("warnings", []):
                self.progress.note(f"{label}: {message}")
        check_views(capture, options)
        manifest = new_manifest(settings, item.origin, item.id, text, pair, capture)
        write_json(work / MANIFEST, manifest)
        written = existing = 0
        if all(is_file(work / file) for file in CAPTURE_FILES):
            existing += 2
        else:
            capture.save(work)
            written += 2
        if write_topk(work, capture, options):
            written += 1
        else:
            existing += 1
        tasks = plan_tasks(work, capture, options,
                           self.jobs if self._pool is not None else 1, ahead)
        manifest["files"] = text_files(capture, options.fmt, options.figures)
        total = sum(task.count for task in tasks)
        self.progress.begin_text(label, total)
        pending = _Pending(number, item, label, folder, manifest, [], written, existing,
                           time.perf_counter(), work)
        del capture, dump_capture  # the workers read the capture from disk
        if self._pool is None:
            for task in tasks:
                done, kept = render_task(task, self.progress.advance)
                pending.written += done
                pending.existing += kept
                self.progress.advance(kept)
        else:
            self._drawing.add(work)
            pending.futures = [self._pool.submit(render_task, task) for task in tasks]
        self._pending.append(pending)

    def _needs_model(self, item: ExportItem) -> str | None:
        """The folder name (lower case) of a text item that will run through the model."""
        if item.blank or item.error or item.dump is not None or item.text is None:
            return None
        try:
            check_texts(item.text, item.pair)
        except InputError:
            return None
        name = folder_name(item.text, item.pair, item.id)
        if name.lower() in self._seen:
            return None
        folder = self.out_dir / name
        if not self.options.force and (folder / "capture.json").is_file() and same_export(
                read_json(folder / MANIFEST), {**self.settings, "source": self._model_settings},
                item.text, item.pair):
            return None  # complete or resumable: its saved capture is used
        return name.lower()

    def _claim(self, number: int, item: ExportItem, label: str, text: str, pair: str | None,
               name: str, source: dict[str, Any]) -> dict[str, Any] | None:
        """Reserve a text's folder: ``None`` for a new text, the index entry of a repeat.

        Raises:
            InputError: another text of this input uses the same id.
        """
        identity = json.dumps([text, pair, source], ensure_ascii=False)
        key = name.lower()
        previous = self._seen.get(key)
        if previous is None:
            self._seen[key] = identity
            return None
        if previous != identity:
            raise InputError(f"id {item.id!r} is used by another text in this input",
                             "give every JSONL line its own id")
        self.summary.duplicates += 1
        self.progress.end_text(label, "skipped", f"the same text as before ({name})")
        return duplicate_entry(number, item, text, pair, name)

    def _finish(self, pending: _Pending | _Ready, index: Index) -> None:
        if isinstance(pending, _Ready):
            index.add(pending.entry)
            return
        try:
            done, kept, error = drawn(pending.futures, self.progress.advance)
        except BaseException:
            self._pending.appendleft(pending)  # its staging goes once the workers are ended
            raise
        pending.written += done
        pending.existing += kept
        self._drawing.discard(pending.work)
        self.summary.files_written += pending.written
        self.summary.files_skipped += pending.existing
        name = pending.folder.name
        missing = [f for f in pending.manifest["files"] if not is_file(pending.work / f)]
        if error is not None or missing:
            drop_staging(pending.folder, pending.work)  # the earlier export stays as it was
        if isinstance(error, OutputError) and not isinstance(error, LinkError):
            raise error  # the output folder is not writable: every text would fail
        if error is not None:
            index.add(self._fail(pending.number, pending.item, pending.label, error.message,
                                 folder=name))
            return
        if missing:
            index.add(self._fail(pending.number, pending.item, pending.label,
                                 f"{len(missing)} files were not written (first: {missing[0]})",
                                 folder=name))
            return
        from attnviz.fileio import signals_held

        pending.manifest["complete"] = True
        # The files, the manifest and the index entry together: an interruption never leaves
        # a text listed as exported whose folder is not complete (nor the other way round).
        with signals_held():
            try:
                replace_outputs(pending.folder, pending.work, pending.manifest["files"],
                                self.out_dir)
            finally:
                drop_staging(pending.folder, pending.work)
            write_json(pending.folder / MANIFEST, pending.manifest)
            index.add(folder_entry(pending.number, pending.item, name, pending.manifest,
                                   "exported"))
            self.summary.files_written += 1
            self.summary.exported += 1
        seconds = time.perf_counter() - pending.started
        self.progress.end_text(pending.label, "exported",
                               f"{name}: {pending.written + 1} files written, "
                               f"{pending.existing} kept ({seconds:.1f} s)")

    # ------------------------------------------------------------------ distributed runs
    # A distributed export (attnviz.engine.ray_export) splits run(): the driver numbers the
    # items and admits each text once, workers export their share with export_part (drawing
    # in their own process), and the driver writes the index from every entry.
    def admit(self, number: int, item: ExportItem) -> dict[str, Any] | None:
        """Driver side: the index entry of an item settled without a model (an unreadable
        line, an unusable text, a repeat of an earlier text), or ``None`` for a new text that
        a worker exports. Texts only: saved captures (``dump``) are not admitted."""
        label = item.origin or f"text {number}"
        if item.error:
            return self._fail(number, item, label, item.error)
        if item.dump is not None:
            return self._fail(number, item, label, "saved captures are exported locally")
        text, pair = item.text or "", item.pair
        try:
            check_texts(text, pair)
            return self._claim(number, item, label, text, pair, folder_name(text, pair, item.id),
                               self._model_settings)
        except InputError as error:
            return self._fail(number, item, label, error.message)

    def export_part(self, numbered: Sequence[tuple[int, ExportItem]]) -> list[dict[str, Any]]:
        """Worker side: export these items here, in order; returns their index entries.

        Drawing happens in this process (``jobs`` is not used); texts run through the model
        ``batch_size`` at a time. Files are written atomically and complete folders are
        skipped, so running the same part again (a retried task) writes nothing twice.

        Raises:
            UsageError, OutputError, ModelLoadError: as :meth:`run` (every text would fail).
        """
        numbers = {id(item): number for number, item in numbered}
        stream = Lookahead((item for _, item in numbered), self.options.batch_size)
        self._stream = stream
        entries = PartEntries()
        try:
            for item in stream:
                self._one(numbers[id(item)], item, 0)
                while self._pending:
                    self._finish(self._pending.popleft(), entries)
        finally:
            self.captures.clear()
            self._drop_pending()
        return entries.items

    def write_index(self, entries: Iterable[dict[str, Any]]) -> None:
        """Driver side: index.json and index.html (and report.html with ``html=True``) from
        every text's entry, in input order. When ``entries`` stops with an exception, what
        came before it is indexed and the exception raised."""
        from attnviz.fileio import ensure_dir

        ensure_dir(self.out_dir)
        index = Index(self.out_dir)
        try:
            for entry in entries:
                index.add(entry)
            if self.options.html:
                self._write_report(index)
        except BaseException:
            self._end_index(index, failed=True)
            raise
        self._end_index(index, failed=False)
