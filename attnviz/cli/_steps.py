"""Progress of the long steps (the forward pass layer by layer, the scans, figures, writing) on
standard error.

On a terminal each step is a rich progress bar naming the step, with the count and the time
left, removed when the step is done; elsewhere (a pipe, a log file, CI) one line per step.
Steps over within :data:`QUIET_SECONDS` show neither. The
library reports progress as ``callback(done, total)`` calls; :func:`step` makes such a
callback for one named step.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console

#: Steps shorter than this show no bar and no line (a short text's forward is over at once).
QUIET_SECONDS = 1.0


class Step:
    """A callback ``(done, total)`` for one named step: a bar on a terminal (started once
    the step outlasts :data:`QUIET_SECONDS`, stopped when ``done`` reaches ``total``), one
    line elsewhere."""

    def __init__(self, console: Console, name: str, unit: str) -> None:
        self.console, self.name, self.unit = console, name, unit
        self.started: float | None = None
        self.bar: Any = None
        self.task: Any = None
        self.said = False

    def __call__(self, done: int, total: int) -> None:
        now = time.perf_counter()
        if self.started is None:
            self.started = now
        if not self.console.is_terminal:
            # One line per step that is still running after QUIET_SECONDS (a log says what a
            # long run is doing; a short one stays quiet).
            if not self.said and done < total and now - self.started >= QUIET_SECONDS:
                self.said = True
                self.console.print(f"{self.name}: {done}/{total} {self.unit}...",
                                   markup=False, highlight=False, style="dim")
            if done >= total:
                self.close()
            return
        if self.bar is None and done < total and now - self.started >= QUIET_SECONDS:
            self._start(total)
        if self.bar is not None:
            self.bar.update(self.task, completed=done, total=total)
        if done >= total:
            self.close()

    def _start(self, total: int) -> None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TextColumn(self.unit), TimeElapsedColumn(), TextColumn("spent,"),
                            TimeRemainingColumn(), TextColumn("left"), console=self.console,
                            transient=True)
        from rich.errors import LiveError

        try:
            self.bar.start()
        except LiveError:  # another live display (an export's bars) is up: it shows progress
            self.bar = None
            return
        self.task = self.bar.add_task(self.name, total=total)

    def close(self) -> None:
        """Remove the bar; the next call starts the step again (the next text's forward)."""
        if self.bar is not None:
            self.bar.stop()
            self.bar = None
        self.started, self.said = None, False


def step(console: Console, name: str, unit: str) -> Step:
    """A progress callback for the step ``name`` counted in ``unit`` (``"layers"``)."""
    return Step(console, name, unit)


@contextmanager
def stepping(console: Console, name: str, unit: str) -> Iterator[Step]:
    """:func:`step` whose bar is removed when the block ends, however it ends."""
    made = Step(console, name, unit)
    try:
        yield made
    finally:
        made.close()


@contextmanager
def doing(console: Console, what: str) -> Iterator[None]:
    """A spinner saying what is happening (``"drawing the figure"``) on a terminal, one line
    elsewhere once it has taken :data:`QUIET_SECONDS`."""
    if not console.is_terminal:
        import threading

        timer = threading.Timer(QUIET_SECONDS, lambda: console.print(
            f"{what}...", markup=False, highlight=False, style="dim"))
        timer.daemon = True
        timer.start()
        try:
            yield
        finally:
            timer.cancel()
        return
    with console.status(f"{what}...", spinner="dots"):
        yield
