"""``heads --input`` on Ray: per-batch statistic sums on the workers, reduced on the driver.

Every worker (a Ray Data actor) holds one :class:`~attnviz.session.Session`, so it loads the
model once. For each batch of texts it captures them in padded batches
(:meth:`~attnviz.session.Session.captures`, the local engine's code) and adds their statistics
to a :class:`~attnviz.analysis.corpus.CorpusPart`: sums and row counts per layer, head and
statistic. The driver merges the parts as they arrive. Sums merge in any order, so the corpus
result equals the local engine's (to float rounding, far below 1e-6) whatever the batching
and the number of workers, and a batch retried after a worker died is counted once: only
finished batches send their part.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from attnviz.analysis.corpus import CorpusPart, CorpusStats, CorpusText
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
from attnviz.errors import AttnvizError, InputError

if TYPE_CHECKING:
    import numpy as np

    from attnviz.capture import Capture
    from attnviz.models import ModelSpec


@dataclass
class BatchResult:
    """What a worker sends back for one batch.

    Attributes:
        start: position of the batch's first text in the input; ``count`` its texts.
        part: the batch's totals (the view without its weights).
        messages: ``(position, warning)`` in the order they arose.
        error: an error that stops the run (a selection that fits no text, a model that cannot
            be loaded), raised again on the driver.
    """

    start: int
    count: int
    part: CorpusPart = field(default_factory=CorpusPart)
    messages: list[tuple[int, str]] = field(default_factory=list)
    error: AttnvizError | None = None


class HeadsWorker(WorkerBase):
    """A Ray Data actor: the statistic sums of batches of texts.

    Args:
        spec: the model; loaded once, on the first text that is not in the capture cache.
        layers, heads: selections (``"0,2-4"``); ``None``: all.
        max_tokens, truncate: the token limit and what to do past it.
        use_cache: read and write this node's capture cache.
        words, exclude_special: the view the statistics are computed on.
        batch_size: texts per forward pass.
        cwd, kill: see :class:`~attnviz.engine.ray_cluster.WorkerBase`.
    """

    def __init__(self, *, spec: ModelSpec, layers: str | None, heads: str | None,
                 max_tokens: int | None, truncate: bool, use_cache: bool, words: bool,
                 exclude_special: bool, batch_size: int, cwd: str = "",
                 kill: tuple[int, str] | None = None) -> None:
        super().__init__(cwd, kill)
        from attnviz.session import Session

        self.spec = spec
        self.layers, self.heads = layers, heads
        self.max_tokens, self.truncate = max_tokens, truncate
        self.words, self.exclude_special = words, exclude_special
        self.batch_size = batch_size
        self.cache_notes: list[str] = []
        self.session = Session(use_cache=use_cache, max_models=1, warn=self.cache_notes.append,
                               python=False)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, Any]:
        results = [self.run(int(start), json.loads(str(work)))
                   for start, work in zip(batch["start"], batch["work"])]
        return result_rows(results)

    def run(self, start: int, texts: Sequence[CorpusText]) -> BatchResult:
        """Capture ``texts`` (input positions ``start``...) and add up their statistics."""
        from attnviz.session import check_text

        texts = [(str(text), None if pair is None else str(pair)) for text, pair in texts]
        result = BatchResult(start, len(texts))

        def check(text: str, pair: str | None) -> None:
            check_text(text)
            if pair is not None:
                check_text(pair, "the pair text")

        try:
            captures = self.session.captures(
                texts, model=self.spec, batch_size=self.batch_size, layers=self.layers,
                heads=self.heads, max_tokens=self.max_tokens, truncate=self.truncate,
                check=check)
            for offset, ((text, _pair), capture) in enumerate(zip(texts, captures)):
                for message in self.cache_notes:
                    result.messages.append((start + offset, message))
                self.cache_notes.clear()
                for message in result.part.add(start + offset, text, capture, words=self.words,
                                               exclude_special=self.exclude_special):
                    result.messages.append((start + offset, message))
                self.handled += 1
                self.checkpoint()
        except AttnvizError as error:  # fits no text of the corpus: the driver stops
            result.error = error
        result.part = result.part.portable()
        return result


def _induction(spec: ModelSpec, view: Capture, cwd: str
               ) -> tuple[Any, Any, AttnvizError | None]:
    """The induction test on a worker (a Ray task): the live model lives there. Returns the
    scores and the test's settings, or the error to raise on the driver."""
    from attnviz.analysis.heads import measure_induction
    from attnviz.session import Session

    if cwd and os.path.isdir(cwd):
        os.chdir(cwd)
    session = Session(use_cache=False, max_models=1, python=False)
    try:
        scores, info = measure_induction(lambda: session.source(spec), view, True)
    except AttnvizError as error:
        return None, None, error
    return scores, info, None


def corpus_stats_ray(texts: Sequence[CorpusText], *, spec: ModelSpec, options: RayOptions,
                     layers: str | None = None, heads: str | None = None,
                     max_tokens: int | None = None, truncate: bool = True,
                     use_cache: bool = True, words: bool = False,
                     exclude_special: bool = False, induction: bool | None = None,
                     warn: Callable[[str], None] | None = None,
                     advance: Callable[[int], None] | None = None,
                     note: Callable[[str], None] | None = None
                     ) -> tuple[CorpusStats, np.ndarray | None, dict[str, Any] | None]:
    """Head statistics of a corpus on Ray: the same result as
    :func:`attnviz.analysis.corpus.corpus_stats` with batched capture.

    Args:
        texts: ``(text, pair)`` tuples (e.g. from :func:`~attnviz.analysis.corpus.read_corpus`).
        spec: the model each worker loads.
        options: address, workers, GPUs per worker, batch size.
        layers, heads, max_tokens, truncate, use_cache: as for the local engine.
        words, exclude_special: the view the statistics are computed on.
        induction: run the induction test (``None``: for a causal model), on a worker.
        warn: called with each warning (a skipped text, truncation), batch by batch.
        advance: called with the number of texts each finished batch held.
        note: called with a line saying which Ray runs the work.

    Returns:
        The corpus statistics, and the induction scores ``[layer, head]`` and test settings
        (or ``None, None``).

    Raises:
        InputError: no text could be used (or the only text could not).
        UsageError: a selection fits no text, or the cluster cannot hold the workers.
        ModelLoadError: the model cannot be loaded.
    """
    options.check()
    if not texts:
        raise InputError("the input holds no texts", "write one text per line")
    size = options.batch_size
    batches = [{"start": start, "work": json.dumps(list(texts[start:start + size]))}
               for start in range(0, len(texts), size)]
    hook = kill_hook()
    kwargs = {"spec": spec, "layers": layers, "heads": heads, "max_tokens": max_tokens,
              "truncate": truncate, "use_cache": use_cache, "words": words,
              "exclude_special": exclude_special, "batch_size": size, "cwd": os.getcwd(),
              "kill": hook}
    total = CorpusPart()
    try:
        with ray_run(options, note) as run:
            for result in map_batches(run, batches, HeadsWorker, options, kwargs):
                reraise(result.error)
                if warn is not None:
                    for _position, message in result.messages:
                        warn(message)
                total.merge(result.part)
                if advance is not None:
                    advance(result.count)
            if len(texts) == 1 and total.error is not None:
                raise total.error[1]
            corpus = total.result()
            scores, info = None, None
            if induction is True or (induction is None and corpus.view.causal):
                task = run.ray.remote(num_cpus=0, num_gpus=options.gpus_per_worker,
                                      max_retries=2)(_induction)
                scores, info, error = run.ray.get(task.remote(spec, corpus.view, os.getcwd()))
                reraise(error)
    finally:
        if hook_fired(hook) and note is not None:
            note(f"test hook: a worker was killed after {hook[0] if hook else 0} texts and "
                 "its work retried")
    return corpus, scores, info
