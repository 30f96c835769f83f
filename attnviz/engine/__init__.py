"""Where many texts run: in this process (``local``) or on a Ray cluster (``ray``).

``heads --input`` and ``export --input`` take ``--engine local|ray``. The local engine is the
library's own loop (:func:`attnviz.analysis.corpus.corpus_stats`,
:class:`attnviz.export.Exporter`). The Ray engine runs the same per-text code in Ray Data
actors, each holding one model through a :class:`~attnviz.session.Session`:

* :mod:`attnviz.engine.ray_heads`: head statistics as mergeable sums, reduced on the driver;
* :mod:`attnviz.engine.ray_export`: every worker writes its texts' folders, the driver the index;
* :mod:`attnviz.engine.ray_cluster`: connecting to a cluster, or starting a local Ray for one run.

Importing this package is cheap: Ray is imported only when the Ray engine runs, and a missing
Ray is reported with the command that installs it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import ModuleType

from attnviz.batches import MAX_BATCH_SIZE  # texts per forward pass (and per Ray task)
from attnviz.errors import AttnvizError, UsageError

ENGINES: tuple[str, ...] = ("local", "ray")
MAX_WORKERS = 1024  # Ray workers (actors) of one run
MAX_GPUS_PER_WORKER = 8  # GPUs one worker may hold (fractions allowed below 1)
INSTALL_RAY = 'pip install "ray[data]>=2.9"'  # what the ray extra holds (attnviz is not on PyPI)


@dataclass
class RayOptions:
    """How a run uses Ray.

    Attributes:
        address: the cluster: ``None`` connects to a running cluster (``RAY_ADDRESS``, or one
            started with ``ray start``) and otherwise starts a local Ray for the run; ``"auto"``
            needs a running cluster; ``"local"`` always starts a local Ray; anything else is a
            cluster address (``host:port`` or ``ray://host:10001``).
        workers: Ray actors, each holding one copy of the model.
        gpus_per_worker: GPUs per actor; fractions (``0.5``) put several actors on one GPU.
        batch_size: texts per forward pass; also the texts of one Ray task.
        cpus_per_worker: CPU cores Ray reserves for each actor.
    """

    address: str | None = None
    workers: int = 1
    gpus_per_worker: float = 0.0
    batch_size: int = 8
    cpus_per_worker: float = 1.0

    def check(self) -> None:
        """Raise :class:`UsageError` for values out of range (each message names the limit)."""
        if not 1 <= self.workers <= MAX_WORKERS:
            raise UsageError(f"--workers {self.workers} is out of range: use 1 to {MAX_WORKERS}")
        if not 1 <= self.batch_size <= MAX_BATCH_SIZE:
            raise UsageError(f"--batch-size {self.batch_size} is out of range: use 1 to "
                             f"{MAX_BATCH_SIZE}")
        gpus = self.gpus_per_worker
        if not math.isfinite(gpus) or not 0 <= gpus <= MAX_GPUS_PER_WORKER:
            raise UsageError(f"--gpus-per-worker {gpus:g} is out of range: use 0 to "
                             f"{MAX_GPUS_PER_WORKER} (fractions such as 0.5 share a GPU)")
        if gpus > 1 and gpus != int(gpus):
            raise UsageError(f"--gpus-per-worker {gpus:g}: above 1, Ray gives whole GPUs only",
                             "use a fraction below 1 (e.g. 0.5) or a whole number")
        if not 0 < self.cpus_per_worker <= 256:
            raise UsageError("cpus_per_worker must be more than 0 and at most 256")
        if self.address is not None and not self.address.strip():
            raise UsageError("--ray-address is empty",
                             "give host:port, ray://host:10001, auto or local")


def check_engine(engine: str) -> str:
    """The engine name, checked."""
    if engine not in ENGINES:
        raise UsageError(f"unknown engine {engine!r}", f"use one of {', '.join(ENGINES)}")
    return engine


def import_ray() -> ModuleType:
    """Import Ray (and Ray Data), or say how to install it.

    Raises:
        AttnvizError: Ray is not installed (or its Data library is missing).
    """
    try:
        import ray
        import ray.data  # noqa: F401
    except ImportError as exc:
        missing = getattr(exc, "name", None) or "ray"
        raise AttnvizError(f"--engine ray needs Ray Data, and {missing} cannot be imported",
                           f"install it with: {INSTALL_RAY}") from None
    return ray


__all__ = ["ENGINES", "MAX_BATCH_SIZE", "MAX_GPUS_PER_WORKER", "MAX_WORKERS", "RayOptions",
           "check_engine", "import_ray"]
