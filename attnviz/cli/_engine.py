"""``--engine local|ray`` and the Ray options ``heads --input`` and ``export --input`` share.

Only typer and the light :mod:`attnviz.engine` are imported here (never Ray), so ``--help``
stays fast and a missing Ray matters only to ``--engine ray``.
"""

from __future__ import annotations

from enum import Enum
from typing import Annotated

import typer

from attnviz.engine import MAX_BATCH_SIZE, MAX_GPUS_PER_WORKER, MAX_WORKERS, RayOptions
from attnviz.errors import UsageError

ENGINE_PANEL = "Engine (many texts)"


class EngineName(str, Enum):
    local = "local"
    ray = "ray"


EngineOpt = Annotated[EngineName, typer.Option(
    "--engine", rich_help_panel=ENGINE_PANEL,
    help="Where the texts of --input run: local (this process) or ray (Ray Data workers on "
         "a cluster or a local Ray; needs pip install \"attnviz\\[ray]\").")]
RayAddressOpt = Annotated[str | None, typer.Option(
    "--ray-address", rich_help_panel=ENGINE_PANEL, metavar="ADDRESS", show_default=False,
    help="With --engine ray: the cluster (host:port of the head node, ray://host:10001, or "
         "auto). Default: the running cluster if there is one (RAY_ADDRESS, ray start), else "
         "a local Ray started for this run; 'local' always starts one.")]
WorkersOpt = Annotated[int | None, typer.Option(
    "--workers", rich_help_panel=ENGINE_PANEL, min=1, max=MAX_WORKERS, show_default=False,
    help=f"With --engine ray: workers, each holding one copy of the model (default 1, at most "
         f"{MAX_WORKERS}).")]
GpusPerWorkerOpt = Annotated[float | None, typer.Option(
    "--gpus-per-worker", rich_help_panel=ENGINE_PANEL, min=0, max=MAX_GPUS_PER_WORKER,
    show_default=False, metavar="F",
    help="With --engine ray: GPUs each worker holds (default 0: CPU); a fraction such as 0.5 "
         "puts two workers on one GPU.")]
#: The upper bound of ``--batch-size`` (texts per forward pass, and per Ray task).
BATCH_SIZE_MAX = MAX_BATCH_SIZE


def ray_options(engine: EngineName, address: str | None, workers: int | None,
                gpus_per_worker: float | None, batch_size: int, *,
                has_input: bool) -> RayOptions | None:
    """The Ray options of a command line, or ``None`` for the local engine.

    Raises:
        UsageError: Ray options without ``--engine ray``, ``--engine ray`` without
            ``--input``, or a value out of range.
    """
    given = [flag for flag, value in (("--ray-address", address), ("--workers", workers),
                                      ("--gpus-per-worker", gpus_per_worker))
             if value is not None]
    if engine is EngineName.local:
        if given:
            raise UsageError(f"{given[0]} is an option of --engine ray",
                             f"add --engine ray, or leave out {given[0]}")
        return None
    if not has_input:
        raise UsageError("--engine ray runs the texts of --input FILE",
                         "give the texts with --input, or leave out --engine ray")
    options = RayOptions(address=address, workers=1 if workers is None else workers,
                         gpus_per_worker=0.0 if gpus_per_worker is None else gpus_per_worker,
                         batch_size=batch_size)
    options.check()
    return options
