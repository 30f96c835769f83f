"""``cache clear`` and ``cache info``: the capture cache of commands that take TEXT."""

from __future__ import annotations

import typer

from attnviz.cli._app import app
from attnviz.cli._common import handle_errors, stdout

cache_app = typer.Typer(
    name="cache",
    help="The capture cache: a second heatmap/top-k/dump on the same text skips the model. "
         "It lives in $ATTNVIZ_CACHE_DIR, else the user cache folder (~/.cache/attnviz on "
         "Linux); --no-cache on any command bypasses it.",
    no_args_is_help=True,
)
app.add_typer(cache_app, name="cache")


def _size(count: int) -> str:
    size = float(count)
    for unit in ("bytes", "KB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "bytes" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GB"  # pragma: no cover


@cache_app.command("clear")
@handle_errors
def clear() -> None:
    """Remove every cached capture.

    Example:

      attnviz cache clear
    """
    import attnviz.cache as cache

    entries, freed = cache.clear()
    stdout.print(f"Removed {entries} cached capture{'s' if entries != 1 else ''} "
                 f"({_size(freed)}) from {cache.cache_dir()}", markup=False)


@cache_app.command("info")
@handle_errors
def info() -> None:
    """Show where the cache is, how many captures it holds and its size limit.

    Example:

      attnviz cache info
    """
    import attnviz.cache as cache

    state = cache.info()
    stdout.print(f"{state.path}\n{state.entries} cached capture"
                 f"{'s' if state.entries != 1 else ''}, {_size(state.bytes)} "
                 f"(limit {_size(state.limit)}; set {cache.ENV_MAX_MB} to change it)",
                 markup=False)
