"""CSV text that spreadsheets open safely: one writer for every CSV attnviz produces.

Tokens come from user text, so a token such as ``=HYPERLINK(...)`` or ``+cmd`` would run as a
formula when the CSV is opened in a spreadsheet (CSV injection). Text cells that start with
``=``, ``+``, ``-``, ``@``, a tab or a carriage return get a leading ``'``, the usual guard that
spreadsheets hide; numbers (``-0.25``, ``+0.010000``) are written as they are.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Iterable, Sequence

_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def safe_cell(value: object) -> object:
    """``value`` with a ``'`` in front when a spreadsheet would read it as a formula."""
    if not isinstance(value, str) or not value.startswith(_FORMULA_START):
        return value
    try:
        float(value)
    except ValueError:
        return "'" + value
    return value  # a signed number


def csv_text(header: Sequence[object], rows: Iterable[Sequence[object]]) -> str:
    """The CSV text (``\\n`` line ends) of ``header`` and ``rows``, text cells made safe."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow([safe_cell(cell) for cell in header])
    for row in rows:
        writer.writerow([safe_cell(cell) for cell in row])
    return buffer.getvalue()
