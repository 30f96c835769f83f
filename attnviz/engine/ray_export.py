"""``export --input`` on Ray: workers write the texts' folders, the driver writes the index.

The driver reads the input with the local reader (:func:`attnviz.export.read_input`), numbers
the texts and settles what needs no model exactly as the local engine does
(:meth:`~attnviz.export.Exporter.admit`: unreadable lines, unusable texts, repeats of an
earlier text). The other texts go to Ray Data actors in batches; each actor holds one
:class:`~attnviz.session.Session` (the model is loaded once per actor) and exports its batch
with :meth:`~attnviz.export.Exporter.export_part`: the same folder names, atomic writes,
manifests and resume as a local run, drawing in the actor's own process. OUT_DIR must
therefore be a folder every node sees at the same path (a shared filesystem).

A worker that dies is restarted by Ray and its batch runs again: finished folders are
complete (and skipped), a half-written one is resumed, and the driver keeps one index entry
per text number, so the result has every text once. Such a text is listed as ``skipped``
(complete from an earlier attempt) rather than ``exported``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from attnviz.engine import RayOptions
from attnviz.engine.ray_cluster import (
    WorkerBase,
    hook_fired,
    kill_hook,
    map_batches,
    ray_run,
    reraise,
    result_rows,
)
from attnviz.errors import AttnvizError
from attnviz.export import ExportItem, ExportOptions, ExportProgress, ExportSummary

if TYPE_CHECKING:
    import numpy as np

    from attnviz.models import ModelSpec

#: A progress event a worker records and the driver replays: (method name, arguments).
Event = tuple[str, tuple[Any, ...]]


@dataclass
class PartResult:
    """What a worker sends back for one batch.

    Attributes:
        entries: the index entries of the batch's texts.
        summary: the batch's counts (exported, skipped, failed, files).
        events: progress events, in order, for the driver's progress display.
        error: an error that stops the run (the output folder is not writable, a selection
            fits no text, the model cannot be loaded), raised again on the driver.
    """

    entries: list[dict[str, Any]] = field(default_factory=list)
    summary: ExportSummary | None = None
    events: list[Event] = field(default_factory=list)
    error: AttnvizError | None = None


class _Recorder(ExportProgress):
    """Records a worker's progress events; counts finished texts for the test hook."""

    def __init__(self, worker: WorkerBase) -> None:
        self.worker = worker
        self.events: list[Event] = []

    def note(self, message: str) -> None:
        self.events.append(("note", (message,)))

    def begin_text(self, label: str, figures: int) -> None:
        # The test hook ends the process here: the text's capture, top-k and unfinished
        # manifest are written, its figures are not (the retry resumes the folder).
        self.worker.checkpoint()
        self.events.append(("begin_text", (label, figures)))

    def advance(self, files: int) -> None:
        if self.events and self.events[-1][0] == "advance":
            self.events[-1] = ("advance", (self.events[-1][1][0] + files,))
        else:
            self.events.append(("advance", (files,)))

    def end_text(self, label: str, status: str, detail: str) -> None:
        self.events.append(("end_text", (label, status, detail)))
        self.worker.handled += 1


class ExportWorker(WorkerBase):
    """A Ray Data actor: exports batches of texts into OUT_DIR.

    Args:
        out_dir: the output folder (absolute, the same on every node).
        options: what to draw (``jobs`` and ``html`` are not used here).
        spec: the model; loaded once per actor, on the first text not in the capture cache.
        max_tokens, truncate, use_cache: as for the local engine.
        cwd, kill: see :class:`~attnviz.engine.ray_cluster.WorkerBase`.
    """

    def __init__(self, *, out_dir: str, options: ExportOptions, spec: ModelSpec,
                 max_tokens: int | None, truncate: bool, use_cache: bool, cwd: str = "",
                 kill: tuple[int, str] | None = None) -> None:
        super().__init__(cwd, kill)
        from attnviz.session import Session

        self.out_dir = Path(out_dir)
        self.options = dataclasses.replace(options, jobs=1, html=False)
        self.spec = spec
        self.max_tokens, self.truncate, self.use_cache = max_tokens, truncate, use_cache
        self.session = Session(use_cache=use_cache, max_models=1, python=False)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, Any]:
        return result_rows([self.run(json.loads(str(work))) for work in batch["work"]])

    def run(self, rows: list[list[Any]]) -> PartResult:
        """Export ``[number, text, pair, id, origin]`` rows; their entries and counts."""
        from attnviz.export import Exporter

        progress = _Recorder(self)
        exporter = Exporter(self.out_dir, self.options, spec=self.spec,
                            max_tokens=self.max_tokens, truncate=self.truncate,
                            use_cache=self.use_cache, progress=progress, session=self.session)
        numbered = [(int(number), ExportItem(text=text, pair=pair, id=ident, origin=origin))
                    for number, text, pair, ident, origin in rows]
        result = PartResult(summary=exporter.summary, events=progress.events)
        try:
            result.entries = exporter.export_part(numbered)
        except AttnvizError as error:  # every text would fail: the driver stops
            result.error = error
        return result


def _replay(progress: ExportProgress, events: list[Event]) -> None:
    for name, args in events:
        getattr(progress, name)(*args)


def export_items_ray(items: Iterable[ExportItem], out_dir: Path | str,
                     options: ExportOptions | None = None, *, spec: ModelSpec,
                     ray: RayOptions, max_tokens: int | None = None, truncate: bool = True,
                     use_cache: bool = True, progress: ExportProgress | None = None,
                     note: Callable[[str], None] | None = None) -> ExportSummary:
    """Export every text item to ``out_dir`` on Ray, holding the folder's export lock.

    The arguments and errors are those of :func:`_export_items_ray`; like a local export, a
    second export into the same folder stops with an :class:`~attnviz.errors.OutputError`.
    """
    from attnviz.export import export_lock

    with export_lock(Path(out_dir)):
        return _export_items_ray(items, out_dir, options, spec=spec, ray=ray,
                                 max_tokens=max_tokens, truncate=truncate, use_cache=use_cache,
                                 progress=progress, note=note)


def _export_items_ray(items: Iterable[ExportItem], out_dir: Path | str,
                      options: ExportOptions | None = None, *, spec: ModelSpec,
                      ray: RayOptions, max_tokens: int | None = None, truncate: bool = True,
                      use_cache: bool = True, progress: ExportProgress | None = None,
                      note: Callable[[str], None] | None = None) -> ExportSummary:
    """Export every text item to ``out_dir`` on Ray: the files of
    :func:`attnviz.export.export_items`, written by the workers.

    Args:
        items: the inputs (texts; saved captures are refused), e.g. from
            :func:`~attnviz.export.read_input`.
        out_dir: the output folder, on a filesystem every node shares.
        options: what to draw and how; ``batch_size`` is the texts per forward pass and per
            Ray task; ``jobs`` is not used (each worker draws its own texts).
        spec: the model each worker loads.
        ray: address, workers, GPUs per worker (its ``batch_size`` is ignored).
        max_tokens, truncate, use_cache: as for :func:`~attnviz.export.export_items`.
        progress: receives progress events (replayed from the workers, batch by batch).
        note: called with a line saying which Ray runs the work.

    Returns:
        The summary; ``summary.failed`` texts were reported and skipped.

    Raises:
        UsageError: a selection or option fits no text, or the cluster cannot hold the
            workers.
        OutputError: the output folder cannot be written.
    """
    from attnviz.export import Exporter

    options = options or ExportOptions()
    options.check()
    ray_options = dataclasses.replace(ray, batch_size=options.batch_size)
    ray_options.check()
    progress = progress or ExportProgress()
    started = time.perf_counter()
    out_path = Path(out_dir).absolute()
    driver = Exporter(out_path, options, spec=spec, max_tokens=max_tokens, truncate=truncate,
                      use_cache=use_cache, progress=progress)
    summary = driver.summary
    summary.out_dir = Path(out_dir)  # as the user gave it, as a local export reports it
    settled: dict[int, dict[str, Any]] = {}
    work: list[list[Any]] = []
    number = 0
    for item in items:
        if item.blank:
            summary.blank += 1
            continue
        if item.dump is not None:
            from attnviz.errors import UsageError

            raise UsageError("--engine ray exports texts, not saved captures (--from)",
                             "export saved captures with --engine local")
        number += 1
        summary.texts += 1
        entry = driver.admit(number, item)
        if entry is not None:
            settled[number] = entry
        else:
            work.append([number, item.text, item.pair, item.id, item.origin])
    size = options.batch_size
    batches = [{"start": work[i][0], "work": json.dumps(work[i:i + size])}
               for i in range(0, len(work), size)]
    hook = kill_hook()
    kwargs = {"out_dir": str(out_path), "options": options, "spec": spec,
              "max_tokens": max_tokens, "truncate": truncate, "use_cache": use_cache,
              "cwd": os.getcwd(), "kill": hook}

    def entries() -> Iterator[dict[str, Any]]:
        """Every text's index entry in input order, as the workers finish them."""
        waiting = dict(settled)
        following = 1
        if batches:
            with ray_run(ray_options, note) as run:
                for result in map_batches(run, batches, ExportWorker, ray_options, kwargs):
                    _replay(progress, result.events)
                    if result.summary is not None:
                        summary.add_counts(result.summary)
                    for entry in result.entries:
                        waiting[int(entry["number"])] = entry
                    while following in waiting:
                        yield waiting.pop(following)
                        following += 1
                    reraise(result.error)
        yield from (waiting[n] for n in sorted(waiting))
        summary.seconds = time.perf_counter() - started

    try:
        driver.write_index(entries())
    finally:
        summary.seconds = time.perf_counter() - started
        if hook_fired(hook) and note is not None:
            note(f"test hook: a worker was killed after {hook[0] if hook else 0} texts and "
                 "its work retried")
    return summary
