"""Export: the drawing processes.

Figures are drawn by ``jobs`` worker processes (spawned, so they never inherit the model);
they ignore Ctrl-C (the exporting process stops them itself) and end with the exporting
process however it ends.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from attnviz.errors import AttnvizError

if TYPE_CHECKING:
    from concurrent.futures import Future, ProcessPoolExecutor

JOBS_PER_CORE = 4  # drawing is CPU-bound: more processes than this only cost memory


def default_jobs() -> int:
    """The number of cores this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # macOS, Windows
        return max(1, os.cpu_count() or 1)


def max_jobs() -> int:
    """The most drawing processes ``--jobs`` may ask for: 4 per core, at least 4."""
    return max(4, JOBS_PER_CORE * default_jobs())


def start_pool(jobs: int) -> ProcessPoolExecutor | None:
    """Start ``jobs`` drawing processes now, while the model loads in this one.

    Returns:
        The pool; ``None`` when new processes could not re-import the main module (a script
        read from standard input, ``python - < script``): then this process draws.
    """
    import sys

    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    if main_file and not os.path.exists(main_file):
        return None
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    pool = ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_worker_start, initargs=(os.getpid(),))
    try:
        for _ in range(jobs):  # start every worker now, while the model loads
            pool.submit(_warm)
    except BaseException:
        end_pool(pool)
        raise
    return pool


def end_pool(pool: ProcessPoolExecutor) -> None:
    """End the workers now, whatever they are drawing (an interrupted or failed export)."""
    processes = list((getattr(pool, "_processes", None) or {}).values())
    for process in processes:
        with contextlib.suppress(Exception):
            process.terminate()
    for process in processes:
        with contextlib.suppress(Exception):
            process.join(5)
            if process.is_alive():
                process.kill()
                process.join(5)
    pool.shutdown(wait=True, cancel_futures=True)


def drawn(futures: Iterable[Future[tuple[int, int]]], advance: Callable[[int], None]
          ) -> tuple[int, int, AttnvizError | None]:
    """Wait for a text's drawing tasks (see :func:`attnviz.export.draw.render_task`).

    Args:
        futures: the tasks, each ``(files written, files that already existed)``.
        advance: called with the files of each task as it is waited for.

    Returns:
        ``(files written, files kept, the first task's error)``; a task that failed with
        an :class:`AttnvizError` (a link in the way, an unreadable capture) fails the text.

    Raises:
        AttnvizError: a drawing process died (killed, out of memory).
    """
    written = existing = 0
    error: AttnvizError | None = None
    for future in futures:
        try:
            done, kept = future.result()
        except AttnvizError as exc:
            error = error or exc
            continue
        except Exception as exc:
            from concurrent.futures.process import BrokenProcessPool

            if isinstance(exc, BrokenProcessPool):
                raise AttnvizError(
                    "a drawing process stopped unexpectedly (killed, or out of memory)",
                    "run the same command again to finish the export; --jobs 1 draws in "
                    "one process and needs the least memory") from None
            raise
        written += done
        existing += kept
        advance(done + kept)
    return written, existing, error


def _worker_start(parent: int | None = None) -> None:
    """Set up a new drawing worker: it dies with ``parent`` (the exporting process) and leaves
    Ctrl-C to it; then import the drawing code while the model loads in the main process."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops the workers itself
    if parent is not None:
        _die_with_parent(parent)
    import attnviz.render.fast  # noqa: F401


def _die_with_parent(parent: int) -> None:
    """End this process as soon as ``parent`` ends, however it ends (even ``kill -9``).

    Linux delivers SIGKILL to us when the parent dies (``PR_SET_PDEATHSIG``); elsewhere, and
    as a second line, a thread checks every half second that the parent is still ours.
    """
    import sys
    import threading

    if sys.platform.startswith("linux"):
        try:
            import ctypes
            import signal

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG = 1
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:  # the parent died before we could watch it
        os._exit(1)

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="attnviz-parent-watch", daemon=True).start()


def _warm() -> int:
    return os.getpid()
