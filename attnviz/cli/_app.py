"""The Typer app every command registers on, and the group that runs them.

Commands import :data:`app` from here (not from :mod:`attnviz.cli`, which imports the commands
to register them), so the package and its command modules never import each other.
"""

from __future__ import annotations

import contextlib
import inspect
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

import typer
from typer.core import TyperGroup

from attnviz._version import __version__


def _click_exceptions() -> Any:
    """The exceptions of the click that parses the options: recent Typer versions carry their
    own copy of click; older ones use click itself."""
    import importlib

    try:
        return importlib.import_module("typer._click.exceptions")
    except ImportError:  # pragma: no cover - older Typer
        return importlib.import_module("click.exceptions")


_CLICK = _click_exceptions()
ClickException: type[Exception] = _CLICK.ClickException
NoArgsIsHelpError: type[Exception] = _CLICK.NoArgsIsHelpError


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


def _usage_line(error: Any) -> str:
    """A click usage error as the one line every attnviz error is: ``Error: <what>; see
    'attnviz COMMAND --help'`` (click's and Typer's own form is a usage block and a box)."""
    message = " ".join(str(error.format_message()).split()).rstrip(".")
    message = message.replace(": Value error, ", ": ")  # Typer's wording of a bad choice
    context = getattr(error, "ctx", None)
    if context is not None:
        message += f"; see '{context.command_path} --help'"
    return f"Error: {message}"


def _usage_exit(error: Any) -> typer.Exit:
    """Print :func:`_usage_line` on standard error; the ``Exit`` to raise (click's exit code:
    2 for usage errors)."""
    from rich.markup import escape

    from attnviz.cli._common import stderr

    stderr.print(escape(_usage_line(error)).replace("Error:", "[bold red]Error:[/bold red]", 1),
                 markup=True, highlight=False)
    return typer.Exit(int(getattr(error, "exit_code", 2)))


_ITEM_END = (".", ":")


def reflow_help(text: str | None) -> str | None:
    """A command's help with each paragraph's source line breaks joined, so the terminal wraps
    it cleanly at any width (Typer keeps every line break of a docstring, and a paragraph
    written at 100 columns then breaks raggedly at 80).

    Kept as written: indented paragraphs (examples), click's ``\b`` blocks, and a break
    before a line that starts a new item (``--layer L alone: ...`` after a line ending in
    ``.`` or ``:``).
    """
    if not text:
        return text
    paragraphs = inspect.cleandoc(text).split("\n\n")
    out = []
    for paragraph in paragraphs:
        lines = paragraph.split("\n")
        if paragraph.startswith("\b") or any(line[:1].isspace() for line in lines):
            out.append(paragraph)
            continue
        joined = lines[0].strip()
        for line in lines[1:]:
            line = line.strip()
            if line.startswith("-") and joined.endswith(_ITEM_END):
                joined += "\n" + line
            else:
                joined += " " + line
        out.append(joined)
    return "\n\n".join(out)


def _reflow_commands(group: Any) -> None:
    """:func:`reflow_help` on the help of every command below ``group``."""
    for command in getattr(group, "commands", {}).values():
        command.help = reflow_help(command.help)
        _reflow_commands(command)


class _Commands(TyperGroup):
    """The command group: one-line usage errors; says why it stopped on Ctrl-C or SIGTERM.

    Usage errors (an unknown option, a bad value, a missing ``-o``) of the group and of every
    command in it are caught here, where both are parsed, and printed as one ``Error:`` line
    with exit code 2, as :class:`~attnviz.errors.AttnvizError` is.

    Typer turns ``KeyboardInterrupt`` into a silent exit 130 before ``main()`` sees it, so the
    message is printed here, inside the command.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.help = reflow_help(self.help)
        _reflow_commands(self)

    def make_context(self, info_name: str | None, args: list[str], parent: Any = None,
                     **extra: Any) -> Any:
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except NoArgsIsHelpError:
            raise  # `attnviz` alone: the help
        except ClickException as error:
            raise _usage_exit(error) from None

    def invoke(self, ctx: Any) -> Any:
        import errno
        import os

        try:
            with _sigterm_interrupts():
                return super().invoke(ctx)
        except NoArgsIsHelpError:
            raise  # `attnviz cache` alone: its help
        except ClickException as error:
            raise _usage_exit(error) from None
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
