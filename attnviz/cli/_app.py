"""The Typer app every command registers on, and the group that runs them.

Commands import :data:`app` from here (not from :mod:`attnviz.cli`, which imports the commands
to register them), so the package and its command modules never import each other.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

import typer
from typer.core import TyperGroup

from attnviz._version import __version__


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread: a command stops as on Ctrl-C (drawing workers are
    ended, temporary files removed) and the CLI exits with 143."""


@contextlib.contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """Turn the first SIGTERM into :class:`Terminated` (a second one kills at once)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class _Commands(TyperGroup):
    """The command group: says why it stopped on Ctrl-C or SIGTERM.

    Typer turns ``KeyboardInterrupt`` into a silent exit 130 before ``main()`` sees it, so the
    message is printed here, inside the command.
    """

    def invoke(self, ctx: Any) -> Any:
        import errno
        import os

        try:
            with _sigterm_interrupts():
                return super().invoke(ctx)
        except OSError as exc:
            # A name over 255 bytes (-o, --model, --from, ...) fails in whichever call first
            # touches it; every such call means the same thing to the user.
            if exc.errno != errno.ENAMETOOLONG or os.environ.get("ATTNVIZ_DEBUG", "") not in (
                    "", "0"):
                raise
            from attnviz.cli._common import report_error
            from attnviz.errors import UsageError

            name = str(exc.filename or "")
            shown = name if len(name) <= 80 else f"{name[:40]}...{name[-20:]}"
            report_error(UsageError(f"the name {shown!r} is too long",
                                    "a file or folder name holds at most 255 bytes: choose a "
                                    "shorter one"))
            raise typer.Exit(1) from None
        except KeyboardInterrupt as stop:
            terminated = isinstance(stop, Terminated)
            sys.stderr.write("\nTerminated (SIGTERM).\n" if terminated else "\nInterrupted.\n")
            sys.stderr.flush()
            raise typer.Exit(143 if terminated else 130) from None


app = typer.Typer(
    cls=_Commands,
    name="attnviz",
    help=(
        "See what a transformer's attention does: capture every layer and head, then draw "
        "heatmaps, list top-k attended tokens, or dump the weights.\n\n"
        "Examples:\n\n"
        "  attnviz heatmap \"The cat sat on the mat\" --layer 5 --head 3\n\n"
        "  attnviz top-k \"The cat sat on the mat\" --layer 5 --head 3 -k 3\n\n"
        "  attnviz dump \"The cat sat on the mat\" -o cat/"
    ),
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    context_settings={"help_option_names": ["-h", "--help"]},
    add_completion=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"attnviz {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                 help="Show the version and exit."),
) -> None:
    """See what a transformer's attention does."""
