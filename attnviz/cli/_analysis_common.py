"""Pieces the analysis commands (``heads``, ``rollout``, ``compare``, ``explain``) share.

Only typer, rich and the standard library are imported here, so ``--help`` stays fast.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from attnviz.cli._common import (  # noqa: F401  (toy options re-exported for the commands)
    CausalOpt,
    DModelOpt,
    NoScaleOpt,
    SeedOpt,
    ToyHeadsOpt,
    ToyLayersOpt,
    stdout,
    warn,
)
from attnviz.errors import UsageError
from attnviz.fileio import check_output


def check_image_path(path: Path | None, option: str) -> None:
    """Refuse an image path that is not a file to write (:func:`attnviz.fileio.check_output`)
    or whose suffix is not .png, .svg or .pdf."""
    check_output(path, option)
    if path is not None and path.suffix.lower() not in (".png", ".svg", ".pdf"):
        raise UsageError(f"cannot tell the image format of {option} {path}",
                         "end the file name in .png, .svg or .pdf")


def check_distinct_outputs(**paths: Path | None) -> None:
    """Refuse two output options naming one file (``-o r.png --bar r.png``): the second
    write would silently replace the first. Keyword names are the options without dashes."""
    import os

    seen: dict[str, str] = {}
    for option, path in paths.items():
        if path is None:
            continue
        key = os.path.normcase(os.path.abspath(path))
        flag = f"--{option.replace('_', '-')}"
        if key in seen:
            raise UsageError(f"{seen[key]} and {flag} both name {path}: one file would replace "
                             "the other", "give each output its own file name")
        seen[key] = flag


def view_suffix(*, words: bool = False, exclude_special: bool = False,
                tokens: str | None = None, queries: str | None = None,
                keys: str | None = None) -> str:
    """The part of a derived file name that says which view a figure shows (``_words``,
    ``_nospecial``, ``_t10-40``): figures of one text with other views never share a name."""
    import re

    from attnviz.fileio import short_hash

    parts = ["words"] if words else []
    if exclude_special:
        parts.append("nospecial")
    for letter, window in (("t", tokens), ("q", queries), ("k", keys)):
        if not window:
            continue
        text = window.strip()
        start, colon, end = text.partition(":")

        def named(part: str, empty: str) -> str:  # -3 -> m3: a sign, not a separator
            part = part.strip()
            return empty if not part else "m" + part[1:] if part.startswith("-") else part

        shown = (f"{named(start, 'start')}-{named(end, 'end')}" if colon
                 else "at" + named(text, ""))
        if not re.fullmatch(r"[A-Za-z0-9-]{1,24}", shown):  # token texts: keep them apart
            shown = "w" + short_hash(text, length=6)
        parts.append(letter + shown.lower())
    return "".join(f"_{part}" for part in parts)


def print_wide(table: Any) -> None:
    """Print a table at its natural width (wider than the console rather than truncated)."""
    from rich.measure import Measurement

    needed = Measurement.get(stdout, stdout.options.update(max_width=4000), table).maximum
    width = stdout.width
    if needed <= width:
        stdout.print(table)
        return
    stdout.width = needed
    try:
        stdout.print(table)
    finally:
        stdout.width = width
