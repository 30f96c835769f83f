"""Checks of a capture request that need no model: the text, selections and token limit.

Low in the package (only :mod:`attnviz.errors` and :mod:`attnviz.selection` below it), so the
session, the request and the own-model capture share them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

from attnviz.errors import InputError, UsageError


class _Sized(Protocol):
    """A model source's shape (any :class:`~attnviz.models.AttentionSource`)."""

    num_layers: int
    num_heads: int

Selection = str | int | Sequence[int] | None


def check_text(text: str, what: str = "the text") -> None:
    """Raise :class:`InputError` for text a model cannot use (empty, NUL, not UTF-8)."""
    if not isinstance(text, str):
        raise InputError(f"{what} must be a string, not {type(text).__name__}")
    if not text.strip():
        raise InputError(f"{what} is empty",
                         "give a sentence, e.g. \"The cat sat on the mat\"")
    if "\x00" in text:
        raise InputError(f"{what} contains a NUL character (\\x00)",
                         "remove control characters from the text")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:  # undecodable bytes in argv arrive as lone surrogates
        raise InputError(f"{what} is not valid UTF-8 (character {exc.start})",
                         "pass UTF-8 text, or pipe a UTF-8 file in with TEXT -") from None


def _selection_text(selection: Selection, what: str = "layer") -> str | None:
    """Selections travel as text (``"0,2-4"``) so cache keys stay the same everywhere.

    Raises:
        UsageError: not a selection string, an index or a list of indices.
    """
    import numbers

    if selection is None or isinstance(selection, str):
        return selection
    example = f"e.g. {what}s=\"0,2-4\", {what}s=-1 or {what}s=[0, 3]"
    if isinstance(selection, numbers.Integral) and not isinstance(selection, bool):
        return str(int(selection))
    if isinstance(selection, (bool, bytes, dict)) or not isinstance(selection, Iterable):
        raise UsageError(f"{what}s must be a selection such as \"0,2-4\", an index or a list "
                         f"of indices, not {type(selection).__name__}", example)
    items = list(selection)
    for item in items:
        if isinstance(item, bool) or not isinstance(item, numbers.Integral):
            raise UsageError(f"{what}s must hold whole numbers ({what} indices), not "
                             f"{item!r:.40}", example)
    if not items:
        raise UsageError(f"{what}s=[] selects no {what}", f"leave {what}s out (None) to keep "
                         f"every {what}, or {example[5:]}")
    return ",".join(str(int(i)) for i in items)


def _check_max_tokens(max_tokens: int | None) -> None:
    if max_tokens is None:
        return
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise UsageError(f"max_tokens must be a whole number of at least 1, not "
                         f"{max_tokens!r:.40}", "or None for the model's own limit")


def _selections(layers: Selection, heads: Selection) -> tuple[str | None, str | None]:
    return _selection_text(layers, "layer"), _selection_text(heads, "head")


def _checked_request(text: str, pair: str | None, layers: Selection, heads: Selection,
                    max_tokens: int | None) -> tuple[str | None, str | None]:
    """Check a capture request before anything runs; the layer and head selections as text.

    Raises:
        InputError: an empty or unusable text or pair.
        UsageError: a malformed selection or ``max_tokens``.
    """
    check_text(text)
    if pair is not None:
        check_text(pair, "the pair text")
    layer_text, head_text = _selections(layers, heads)
    _check_max_tokens(max_tokens)
    return layer_text, head_text


def _resolve(source: _Sized, layers: str | None, heads: str | None
             ) -> tuple[list[int] | None, list[int] | None]:
    """The model indices of checked selection texts (``None``: all) on a loaded model."""
    from attnviz.selection import parse_selection

    return (parse_selection(layers, source.num_layers, "layer") if layers else None,
            parse_selection(heads, source.num_heads, "head") if heads else None)
