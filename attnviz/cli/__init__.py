"""The ``attnviz`` command line: a thin Typer layer over the library.

Each command group lives in its own module and registers itself on :data:`app`. Heavy
libraries (torch, transformers, matplotlib) are imported inside the commands, never here.
"""

from __future__ import annotations

import sys

import typer

from attnviz import __version__

app = typer.Typer(
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


def _register() -> None:
    from attnviz.cli import core  # noqa: F401  (registers heatmap, top-k, dump)

    for optional in ("export", "heads", "rollout", "compare", "explain", "html", "cache"):
        try:
            __import__(f"attnviz.cli.{optional}")
        except ModuleNotFoundError as exc:
            if exc.name != f"attnviz.cli.{optional}":
                raise


_register()


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point."""
    try:
        app(args=argv, prog_name="attnviz")
    except KeyboardInterrupt:  # pragma: no cover - interactive
        sys.stderr.write("\nInterrupted.\n")
        sys.exit(130)
