"""Layer and head selections: ``5``, ``-1``, ``0,2-4``, ``all``.

Indices are 0-based like ``outputs.attentions[layer][0, head]``; negative indices count from
the end, as in Python. Every function raises :class:`~attnviz.errors.UsageError` with the valid
range when a selection does not fit the model.
"""

from __future__ import annotations

import re

from attnviz.errors import UsageError

_RANGE = re.compile(r"^(-?\d+)\s*-\s*(-?\d+)$")


def resolve_index(index: int, size: int, what: str) -> int:
    """Turn a possibly negative index into ``0..size-1``.

    Args:
        index: the index as the user typed it.
        size: how many there are (layers or heads).
        what: ``"layer"`` or ``"head"``, used in the message.

    Raises:
        UsageError: the index is not a whole number (a bool, a float, a string, ``None``), or is
            out of range; the message states the valid range.
    """
    import numbers

    if isinstance(index, bool) or not isinstance(index, numbers.Integral):
        raise UsageError(f"{what} must be a whole number such as 3 or -1, not {index!r:.40}")
    index = int(index)
    if -size <= index < size:
        return index % size
    plural = what if size == 1 else f"{what}s"
    raise UsageError(
        f"{what} {index} is out of range: this model has {size} {plural} "
        f"(0..{size - 1} or -{size}..-1)"
    )


def parse_int(text: str, what: str) -> int:
    """Parse one integer index, with a usage error naming ``what`` on failure."""
    try:
        return int(text.strip())
    except ValueError:
        raise UsageError(
            f"invalid {what} {text!r}: expected an integer such as 0, 5 or -1"
            + (", or 'mean'" if what == "head" else "")
        ) from None


def parse_selection(spec: str | None, size: int, what: str) -> list[int]:
    """Parse a selection such as ``"0,2-4"`` into sorted, unique, non-negative indices.

    ``None``, ``""`` and ``"all"`` select everything. Ranges are inclusive; both ends may be
    negative (``-3--1`` is the last three). A range whose start is after its end is an error.

    Args:
        spec: the selection text.
        size: how many layers or heads the model has.
        what: ``"layer"`` or ``"head"``.

    Returns:
        Sorted unique indices in ``0..size-1``.
    """
    if spec is None or spec.strip().lower() in ("", "all"):
        return list(range(size))
    chosen: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        if not part:
            raise UsageError(f"invalid {what} selection {spec!r}: empty item between commas")
        match = _RANGE.match(part)
        if match:
            start = resolve_index(int(match.group(1)), size, what)
            stop = resolve_index(int(match.group(2)), size, what)
            if start > stop:
                raise UsageError(
                    f"invalid {what} range {part!r}: the start comes after the end",
                    f"write it as {match.group(2)}-{match.group(1)}",
                )
            chosen.update(range(start, stop + 1))
        else:
            try:
                value = int(part)
            except ValueError:
                raise UsageError(
                    f"invalid {what} selection {spec!r}: {part!r} is not an index or a range",
                    "use indices and inclusive ranges such as 0,2-4 or -1, or 'all'",
                ) from None
            chosen.add(resolve_index(value, size, what))
    return sorted(chosen)
