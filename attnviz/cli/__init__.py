"""The ``attnviz`` command line: a thin Typer layer over the library.

Each command group lives in its own module and registers itself on :data:`app`
(:mod:`attnviz.cli._app`). Heavy libraries (torch, transformers, matplotlib) are imported
inside the commands, never here.
"""

from __future__ import annotations

import sys

from attnviz.cli._app import Terminated, app

__all__ = ["Terminated", "app", "main"]


def _register() -> None:
    from attnviz.cli import core  # noqa: F401  (registers heatmap, top-k, dump)

    for optional in ("export", "heads", "rollout", "compare", "explain", "html", "cache",
                     "serve", "generate"):
        try:
            __import__(f"attnviz.cli.{optional}")
        except ModuleNotFoundError as exc:
            if exc.name != f"attnviz.cli.{optional}":
                raise


_register()


def _interrupt_again(unraisable: sys.UnraisableHookArgs) -> None:
    """Ctrl-C that lands while Python runs a finaliser (a weakref callback, ``__del__``) is
    printed as "Exception ignored" and lost, and the command would go on. Deliver it again
    instead: the handler then raises it in the command's own code (or, inside
    :func:`attnviz.fileio.signals_held`, notes it for after the held step)."""
    if unraisable.exc_type is KeyboardInterrupt:
        import _thread
        import threading

        # From another thread, a moment later: a signal raised here would land in this hook.
        threading.Timer(0.02, _thread.interrupt_main).start()
        return
    sys.__unraisablehook__(unraisable)


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point."""
    sys.unraisablehook = _interrupt_again
    try:
        app(args=argv, prog_name="attnviz")
    except KeyboardInterrupt:  # pragma: no cover - interactive
        sys.stderr.write("\nInterrupted.\n")
        sys.exit(130)
