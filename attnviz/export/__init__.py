"""Batch export: every head of many texts as PNG, SVG or PDF, resumable, in parallel.

For each text, :func:`export_items` writes a folder::

    OUT_DIR/
        index.json, index.html       every text of this run: folder, status, files
        the-cat-sat-on-the-mat-1a2b3c4d5e/
            attention.npy             the capture [layer, head, query, key] (float32)
            capture.json              its sidecar (tokens, layers, heads, model, ...)
            topk.csv                  top-k keys of every query, every layer and head
            heads/L00_H00.png ...     one figure per head, as ``attnviz heatmap -l L --head H``
            layers/L00.png ...        one grid per layer, as ``attnviz heatmap -l L``
            overview.png              every layer and head, as ``attnviz heatmap``
            export.json               this folder's manifest; ``"complete": true`` once done

Folder names are a sanitised slug of the text plus a hash of text and pair (or the sanitised
JSONL ``id``, named so that it can never equal a text's name), so nothing in the input can reach
outside OUT_DIR, collide with another text, or exceed file-name limits. Nothing is written
through a symbolic link inside OUT_DIR (:mod:`attnviz.fileio`), one export at a time writes to
a folder (a lock file), and ``index.json`` lists the texts of every run into the folder.
Every file is written atomically; a re-run skips complete texts and finishes partial ones
(``force=True`` redraws everything). The model runs once per text in the calling process;
figures are drawn by ``jobs`` worker processes (they end with the exporting process), PNGs
with the fast renderer of :mod:`attnviz.render.fast`. At most a few texts are in flight at
once, so memory stays flat however many texts there are.

The modules, in the order a text goes through them:

* :mod:`~attnviz.export.plan`: the input, folder names, options, progress and summary;
* :mod:`~attnviz.export.capture`: texts through the session, a batch at a time;
* :mod:`~attnviz.export.write`: file names, atomic writes, manifests, resume, the lock;
* :mod:`~attnviz.export.draw`: figures and the top-k table of one text;
* :mod:`~attnviz.export.pool`: the drawing processes;
* :mod:`~attnviz.export.index`: index.json and index.html;
* :mod:`~attnviz.export.exporter`: one run, text by text (the local engine; the Ray engine,
  :mod:`attnviz.engine.ray_export`, runs the same per-text code on its workers);
* this package: :func:`export_items` and :func:`export_texts`, and the names above.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from attnviz.export.draw import HEADS_PER_SPLIT, RenderTask, render_task, template_shows
from attnviz.export.exporter import Exporter
from attnviz.export.index import INDEX_HTML, INDEX_JSON, REPORT_HTML, Index, read_index_entries
from attnviz.export.plan import (
    FIGURES,
    ID_LENGTH,
    SLUG_LENGTH,
    SMALL_JOB_TEXTS,
    ExportItem,
    ExportOptions,
    ExportProgress,
    ExportSummary,
    check_text,
    folder_name,
    jobs_for,
    read_input,
)
from attnviz.export.pool import JOBS_PER_CORE, default_jobs, max_jobs
from attnviz.export.write import (
    FORMATS,
    HEADS_DIR,
    LAYERS_DIR,
    LOCK_NAME,
    MANIFEST,
    MANIFEST_FORMAT,
    TOPK_CSV,
    export_lock,
    head_file,
    layer_file,
    overview_file,
)

if TYPE_CHECKING:
    from attnviz.models import ModelSpec
    from attnviz.session import Session

_Index = Index  # the name of the index writer before the split into modules

__all__ = [
    "FIGURES", "FORMATS", "HEADS_DIR", "HEADS_PER_SPLIT", "ID_LENGTH", "INDEX_HTML",
    "INDEX_JSON", "JOBS_PER_CORE", "LAYERS_DIR", "LOCK_NAME", "MANIFEST", "MANIFEST_FORMAT",
    "REPORT_HTML", "SLUG_LENGTH", "SMALL_JOB_TEXTS", "TOPK_CSV", "ExportItem", "ExportOptions",
    "ExportProgress", "ExportSummary", "Exporter", "Index", "RenderTask", "check_text",
    "default_jobs", "export_items", "export_lock", "export_texts", "folder_name", "head_file",
    "jobs_for", "layer_file", "max_jobs", "overview_file", "read_index_entries", "read_input",
    "render_task", "template_shows",
]


def export_items(items: Iterable[ExportItem], out_dir: Path | str,
                 options: ExportOptions | None = None, *, spec: ModelSpec | None = None,
                 max_tokens: int | None = None, truncate: bool = True, use_cache: bool = True,
                 progress: ExportProgress | None = None,
                 session: Session | None = None) -> ExportSummary:
    """Export every item (texts and saved captures) to ``out_dir``.

    Args:
        items: the inputs, e.g. from :func:`read_input`; read lazily.
        out_dir: the output folder (created if needed).
        options: what to draw and how.
        spec: the model texts run through (default: the bundled MiniLM).
        max_tokens: token limit per text; ``truncate``: cut past it instead of failing.
        use_cache: look texts up in the capture cache before running the model (the export
            folder keeps each capture, so nothing new is written to the cache).
        progress: receives progress events.
        session: the warm engine that loads the model and captures texts (default: the
            process-wide :func:`~attnviz.session.default_session`).

    Returns:
        The summary; ``summary.failed`` texts were reported and skipped.

    Raises:
        UsageError: a selection or option fits no text (nothing is exported).
        OutputError: the output folder cannot be written.
    """
    from attnviz.models import ModelSpec

    options = options or ExportOptions()
    options.check()
    exporter = Exporter(Path(out_dir), options, spec=spec or ModelSpec(), max_tokens=max_tokens,
                        truncate=truncate, use_cache=use_cache,
                        progress=progress or ExportProgress(), session=session)
    return exporter.run(items)


def export_texts(texts: Iterable[str], out_dir: Path | str, *, model: str | None = None,
                 **options: Any) -> ExportSummary:
    """Export every head of each text: ``export_texts(["The cat sat"], "out")``.

    Keyword options are the fields of :class:`ExportOptions` (``fmt``, ``dpi``, ``cmap``,
    ``layers``, ``heads``, ``words``, ``exclude_special``, ``annot``, ``top_k``, ``figures``,
    ``jobs``, ``force``) and ``spec``, ``max_tokens``, ``truncate``, ``use_cache``,
    ``progress`` of :func:`export_items`.
    """
    from attnviz.models import ModelSpec

    option_names = set(ExportOptions.__dataclass_fields__)
    export_options = ExportOptions(**{k: v for k, v in options.items() if k in option_names})
    rest = {k: v for k, v in options.items() if k not in option_names}
    if model is not None and "spec" not in rest:
        rest["spec"] = ModelSpec(name=model)
    items = (ExportItem(text=text, origin=f"text {n}") for n, text in enumerate(texts, 1))
    return export_items(items, out_dir, export_options, **rest)
