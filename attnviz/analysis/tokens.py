"""Token-level transformations of a capture: drop special tokens, merge subwords into words."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from attnviz.capture import Capture
from attnviz.errors import InputError

if TYPE_CHECKING:
    from attnviz.record import AttentionRecord

#: Prefix that marks a continuation piece in labels and tables: ``un ·bel ·ie ·va ·bly`` is one
#: word in five pieces. The middle dot is the same for every tokenizer (WordPiece's ``##``,
#: byte-level BPE's missing ``Ġ`` and SentencePiece's missing ``▁`` all become ``·``).
CONTINUATION_MARK = "\u00b7"

PAIR_START = "pair_start"  # meta key: first position of a pair's second segment in a view


def renormalise_rows(weights: np.ndarray) -> np.ndarray:
    """Divide each row (last axis) by its sum; rows that sum to 0 stay 0."""
    sums = weights.sum(axis=-1, keepdims=True)
    return np.divide(weights, sums, out=np.zeros_like(weights), where=sums > 0)


def nothing_left_error(tokens: list[str]) -> InputError:
    """What to say when ``--exclude-special`` would leave no token at all."""
    shown = " ".join(tokens[:8]) + (" ..." if len(tokens) > 8 else "")
    return InputError(f"no tokens are left after --exclude-special: the input has only special "
                      f"tokens ({shown})",
                      "leave out --exclude-special, or give a text with words in it")


def exclude_special(capture: Capture) -> Capture:
    """Drop special tokens ([CLS], [SEP], <s>, ...) from queries and keys and renormalise rows.

    The result's rows sum to 1 again (a row whose only weight was on special tokens becomes 0).
    """
    keep = [i for i, special in enumerate(capture.special) if not special]
    if len(keep) == len(capture.tokens):
        return capture
    if not keep:
        raise nothing_left_error(capture.tokens)
    weights = np.asarray(capture.weights, dtype=np.float32)[:, :, keep][:, :, :, keep]
    meta = {**capture.meta, "special_excluded": True}
    start = pair_start(capture)
    if start is not None:
        meta[PAIR_START] = sum(1 for i in keep if i < start)
    return capture.with_weights(
        renormalise_rows(weights),
        tokens=[capture.tokens[i] for i in keep],
        display_tokens=[capture.display_tokens[i] for i in keep],
        word_ids=[capture.word_ids[i] for i in keep],
        special=[False] * len(keep),
        meta=meta,
    )


def word_groups(capture: Capture) -> list[list[int]]:
    """Token positions of each unit: one group per word, one per special token, in order."""
    groups: list[list[int]] = []
    last_word: int | None = None
    for position, word in enumerate(capture.word_ids):
        if word is not None and word == last_word and groups:
            groups[-1].append(position)
        else:
            groups.append([position])
        last_word = word
    return groups


def join_pieces(pieces: list[str]) -> str:
    """Display text of a word from its pieces; a bare marker piece (a lone ``Ġ`` or ``▁``,
    shown as ``␣``) adds nothing to a word that has other pieces."""
    if len(pieces) == 1:
        return pieces[0]
    return "".join(p for p in pieces if p != "\u2423") or pieces[0]


def merge_words(capture: Capture) -> Capture:
    """Merge subword tokens into words (Clark et al., 2019).

    Attention *to* a word is the sum over its pieces (key axis); attention *from* a word is the
    mean over its pieces (query axis), so rows still sum to 1. Words come from the tokenizer's
    word ids; special tokens stay single units.
    """
    groups = word_groups(capture)
    if len(groups) == len(capture.tokens):
        return capture
    weights = np.asarray(capture.weights, dtype=np.float32)  # [layer, head, query, key]
    summed_keys = np.stack([weights[..., g].sum(axis=-1) for g in groups], axis=-1)
    merged = np.stack([summed_keys[:, :, g, :].mean(axis=2) for g in groups], axis=2)
    display = [join_pieces([capture.display_tokens[i] for i in g]) for g in groups]
    tokens = [display[k] if len(g) > 1 else capture.tokens[g[0]] for k, g in enumerate(groups)]
    meta = {**capture.meta, "words_merged": True}
    start = pair_start(capture)
    if start is not None:
        meta[PAIR_START] = next(k for k, g in enumerate(groups) if g[-1] >= start)
    return capture.with_weights(
        merged.astype(np.float32),
        tokens=tokens, display_tokens=display,
        word_ids=[capture.word_ids[g[0]] for g in groups],
        special=[capture.special[g[0]] for g in groups],
        meta=meta,
    )


#: A position as a user types it: ASCII digits, one optional minus (``str.isdigit`` also
#: accepts ``'²'``, which ``int`` refuses).
_POSITION = re.compile(r"-?[0-9]+")


def is_position(text: str) -> bool:
    """Whether ``text`` reads as a (possibly negative) position that ``int`` accepts."""
    return _POSITION.fullmatch(text.strip()) is not None


def find_token(display_tokens: list[str], spec: str, *, words_option: bool = True) -> int:
    """Position of the token a user named with ``--token``.

    ``words_option``: the command has ``--words`` (the message then suggests it).

    ``spec`` is a token as shown (case-insensitive; its first occurrence), ``WORD:N`` for the
    N-th occurrence (1-based), or a position such as ``0``, ``5`` or ``-1``. A token that reads
    as a number is found with ``5:1``.

    Raises:
        UsageError: no such token, occurrence or position; the message lists the tokens.
    """
    from attnviz.errors import UsageError

    shown = ", ".join(f"{i}:{t}" for i, t in enumerate(display_tokens[:60]))
    if len(display_tokens) > 60:
        shown += ", ..."
    text = spec.strip()
    word, occurrence = text, 1
    head, sep, tail = text.rpartition(":")
    if sep and head and is_position(tail) and not tail.strip().startswith("-"):
        word, occurrence = head, int(tail)
    elif is_position(text):
        index = int(text)
        size = len(display_tokens)
        if -size <= index < size:
            return index % size
        raise UsageError(f"token position {index} is out of range: the input has {size} tokens "
                         f"(0..{size - 1} or -{size}..-1)", f"the tokens are: {shown}")
    matches = [i for i, t in enumerate(display_tokens) if t.lower() == word.lower()]
    if not matches:
        raise UsageError(f"no token {word!r} in the input",
                         f"the tokens are: {shown}. The tokenizer may split a word into pieces: "
                         + ("name one piece, a position, or use --words" if words_option
                            else "name one piece or a position"))
    if not 1 <= occurrence <= len(matches):
        times = "once" if len(matches) == 1 else f"{len(matches)} times"
        raise UsageError(f"token {word!r} occurs {times}, not {occurrence}",
                         f"use {word}:1 to {word}:{len(matches)}")
    return matches[occurrence - 1]


_drop_special = exclude_special  # the parameter of token_view below shadows the name


def token_view(capture: Capture, *, words: bool = False, exclude_special: bool = False
               ) -> Capture:
    """The capture at the level a command shows: words merged first, then specials dropped.

    Args:
        capture: weights ``[layer, head, query, key]``.
        words: merge subword tokens into words (:func:`merge_words`).
        exclude_special: drop special tokens and renormalise rows (:func:`exclude_special`).
    """
    if words:
        capture = merge_words(capture)
    if exclude_special:
        capture = _drop_special(capture)
    return capture


def view_notes(capture: AttentionRecord) -> list[str]:
    """Short notes on how a view differs from the raw capture, for titles."""
    notes = []
    if capture.pair is not None:
        notes.append("sentence pair")
    if capture.meta.get("words_merged"):
        notes.append("word level")
    if capture.meta.get("special_excluded"):
        notes.append("special tokens excluded, rows renormalised")
    if capture.causal:
        notes.append("causal")
    return notes


# --------------------------------------------------------------------------- pieces and pairs
def continuation_flags(capture: AttentionRecord) -> list[bool]:
    """For each token, whether it continues the word of the token before it (a subword piece).

    Comes from the tokenizer's word ids, so it holds for every tokenizer; a word-level view
    (:func:`merge_words`) has no continuation pieces.
    """
    flags: list[bool] = []
    previous: int | None = None
    for word, special in zip(capture.word_ids, capture.special):
        flags.append(word is not None and not special and word == previous)
        previous = None if special else word
    return flags


def piece_labels(capture: AttentionRecord) -> list[str]:
    """Token labels for figures and tables: continuation pieces marked, ``un ·bel ·ie ·va ·bly``.

    With ``--words`` (a merged view) every label is a whole word and nothing is marked.
    """
    return [CONTINUATION_MARK + token if piece else token
            for token, piece in zip(capture.display_tokens, continuation_flags(capture))]


def pair_start(capture: AttentionRecord) -> int | None:
    """Position of the first token of a sentence pair's second segment, or ``None``.

    The second segment starts after the first run of special tokens that follows the first
    segment (``[CLS] A [SEP] | B [SEP]``, ``<s> A </s></s> | B </s>``). Views made by
    :func:`exclude_special` and :func:`merge_words` carry the position in their metadata.
    A pair joined without a separator (most decoders) has no known boundary.
    """
    if capture.pair is None:
        return None
    known = capture.meta.get(PAIR_START)
    if isinstance(known, int) and 0 < known < capture.num_tokens:
        return known
    special, size, i = capture.special, capture.num_tokens, 0
    while i < size and special[i]:
        i += 1
    while i < size and not special[i]:
        i += 1
    if i >= size:
        return None
    while i < size and special[i]:
        i += 1
    return i if i < size else None


# --------------------------------------------------------------------------- windows
@dataclass(frozen=True)
class Window:
    """A run of token positions ``start..stop-1`` of an input of ``total`` tokens."""

    start: int
    stop: int
    total: int

    @property
    def size(self) -> int:
        return self.stop - self.start

    @property
    def full(self) -> bool:
        """Whether the window is the whole input."""
        return self.start == 0 and self.stop == self.total

    @property
    def span(self) -> slice:
        """The window as a slice of positions."""
        return slice(self.start, self.stop)

    def __str__(self) -> str:
        return f"{self.start}:{self.stop}"


def _window_shown(tokens: list[str]) -> str:
    shown = ", ".join(f"{i}:{t}" for i, t in enumerate(tokens[:40]))
    return shown + (", ..." if len(tokens) > 40 else "")


def _window_end(part: str, tokens: list[str], option: str, after: int, end: bool,
                source: str = "the input", clip: bool = False) -> int:
    """One end of a window: a position (negative counts from the end) or a token's text.
    With ``clip`` a position past either end is cut at it (as a Python slice is)."""
    from attnviz.errors import UsageError

    size = len(tokens)
    text = part.strip()
    if is_position(text):
        index = int(text)
        if clip:
            return max(0, min(size, index + size if index < 0 else index))
        if not -size <= index <= size:
            raise UsageError(f"{option} {index} is out of range: the input has {size} tokens "
                             f"(positions 0..{size - 1}, or -{size}..-1 from the end; as the "
                             f"end of A:B, {size} means through the last token)",
                             f"the tokens are: {_window_shown(tokens)}")
        return index + size if index < 0 else index
    wanted = text.lower()
    for position in range(after, size):
        token = tokens[position].lower()
        if token == wanted or token.lstrip(CONTINUATION_MARK) == wanted.lstrip(CONTINUATION_MARK):
            return position + 1 if end else position
    where = f" at or after position {after}" if after else ""
    raise UsageError(f"{option}: no token {text!r} in {source}{where}",
                     f"name a token as shown, or give positions. The tokens are: "
                     f"{_window_shown(tokens)}")


def parse_window(spec: str | None, tokens: list[str], option: str = "--tokens",
                 source: str = "the input", *, clip: bool = False) -> Window:
    """The window a user asked for with ``--tokens``, ``--queries`` or ``--keys``.

    ``spec`` is ``A:B``, Python-slice style: 0-based positions, ``B`` excluded, negative
    positions count from the end, either end may be left out (``:40``, ``-20:``). An end may
    also be a token as shown (case-insensitive, its first occurrence; as ``B`` it is
    included): ``bank:loan``. A single position or token (no colon) is that one token.
    Positions count the tokens of the view shown (after ``--words``/``--exclude-special``).

    Args:
        spec: the option's value; ``None`` or ``""`` is the whole input.
        tokens: the labels of the view's tokens.
        option: the option's name, for messages.
        source: what the tokens are, for messages (``"the input"``, ``"A"``).
        clip: cut a range's positions at the input's ends instead of refusing them (export
            applies one window to texts of every length: ``0:40`` is a short text whole).
            A single position, or a range left empty by the cut, is still an error.

    Raises:
        UsageError: a position out of range, an unknown token, or an empty window.
    """
    from attnviz.errors import UsageError

    size = len(tokens)
    if spec is None or not spec.strip():
        return Window(0, size, size)
    text = spec.strip()
    if text.count(":") > 1:
        raise UsageError(f"{option} {spec!r} has more than one ':'",
                         "give START:END, e.g. 10:40, -20: or bank:loan (name a token that "
                         "contains ':' by its position)")
    if ":" not in text:
        start = _window_end(text, tokens, option, 0, end=False, source=source)
        if start >= size:
            raise UsageError(f"{option} {spec}: the input has {size} tokens (0..{size - 1})")
        return Window(start, start + 1, size)
    head, _, tail = text.partition(":")
    start = (_window_end(head, tokens, option, 0, end=False, source=source, clip=clip)
             if head.strip() else 0)
    stop = (_window_end(tail, tokens, option, start, end=True, source=source, clip=clip)
            if tail.strip() else size)
    if stop <= start:
        raise UsageError(f"{option} {spec} is empty (from position {start} to {stop})",
                         "the end must come after the start, e.g. 10:40")
    return Window(start, stop, size)


def window_note(rows: Window, cols: Window) -> str:
    """How a window is named in titles: ``tokens 10:40 of 305`` or queries and keys apart."""
    if rows.full and cols.full:
        return ""
    if rows == cols:
        return f"tokens {rows} of {rows.total}"
    parts = []
    if not rows.full:
        parts.append(f"queries {rows}")
    if not cols.full:
        parts.append(f"keys {cols}")
    return ", ".join(parts) + f" of {rows.total}"


def view_labels(capture: Capture, *, words: bool = False,
                exclude_special: bool = False) -> list[str]:
    """The labels of :func:`token_view`'s tokens (as :func:`piece_labels`), without computing
    its weights: to check a view and its windows before drawing.

    Raises:
        InputError: ``exclude_special`` leaves no token (the input is only special tokens).
    """
    if words:
        groups = word_groups(capture)
        labels = [join_pieces([capture.display_tokens[i] for i in g]) for g in groups]
        special = [capture.special[g[0]] for g in groups]
    else:
        labels, special = piece_labels(capture), list(capture.special)
    if exclude_special:
        labels = [label for label, is_special in zip(labels, special) if not is_special]
        if not labels:
            raise nothing_left_error(capture.tokens)
    return labels


def parse_windows(labels: list[str], tokens: str | None = None, queries: str | None = None,
                  keys: str | None = None, *, clip: bool = False) -> tuple[Window, Window]:
    """The query and key windows; ``queries`` and ``keys`` default to ``tokens``."""
    rows = parse_window(queries if queries else tokens, labels,
                        "--queries" if queries else "--tokens", clip=clip)
    cols = parse_window(keys if keys else tokens, labels, "--keys" if keys else "--tokens",
                        clip=clip)
    return rows, cols


def check_windows(labels: list[str], tokens: str | None = None, queries: str | None = None,
                  keys: str | None = None, *, clip: bool = False) -> None:
    """Raise :class:`~attnviz.errors.UsageError` when a window does not fit these tokens."""
    parse_windows(labels, tokens, queries, keys, clip=clip)


def check_window_syntax(spec: str | None, option: str = "--tokens") -> None:
    """Raise :class:`~attnviz.errors.UsageError` for a window no input can have (``a:b:c``)."""
    from attnviz.errors import UsageError

    if spec is not None and spec.count(":") > 1:
        raise UsageError(f"{option} {spec!r} has more than one ':'",
                         "give START:END, e.g. 10:40, -20: or bank:loan")


@dataclass
class FigureView:
    """What a figure shows of a capture: the view, the windows, labels and title notes.

    Attributes:
        capture: the view (words merged / special tokens dropped as asked).
        rows: the query window; cols: the key window.
        row_labels, col_labels: labels of the shown queries and keys (pieces marked).
        row_divider, col_divider: position inside the window where a sentence pair's second
            segment starts, or ``None``.
        notes: notes for the title (view, pair, window).
    """

    capture: Capture
    rows: Window
    cols: Window
    row_labels: list[str]
    col_labels: list[str]
    row_divider: int | None
    col_divider: int | None
    notes: list[str]

    def crop(self, matrix: np.ndarray) -> np.ndarray:
        """The window of a ``[..., query, key]`` array (float32)."""
        return np.asarray(matrix[..., self.rows.span, self.cols.span], dtype=np.float32)

    @property
    def suffix(self) -> str:
        """The notes as a title suffix: ``" (word level, tokens 0:10 of 40)"`` or ``""``."""
        return f" ({', '.join(self.notes)})" if self.notes else ""


def figure_view(capture: Capture, *, words: bool = False, exclude_special: bool = False,
                tokens: str | None = None, queries: str | None = None,
                keys: str | None = None, clip: bool = False) -> FigureView:
    """The view, windows and labels of a figure, from the options a command was given.

    ``queries`` and ``keys`` default to ``tokens``, which defaults to every token. ``clip``:
    see :func:`parse_window`.
    """
    view = token_view(capture, words=words, exclude_special=exclude_special)
    labels = piece_labels(view)
    rows, cols = parse_windows(labels, tokens, queries, keys, clip=clip)
    start = pair_start(view)

    def divider(window: Window) -> int | None:
        if start is None or not window.start < start < window.stop:
            return None
        return start - window.start

    notes = view_notes(view)
    note = window_note(rows, cols)
    if note:
        notes.append(note)
    return FigureView(view, rows, cols, labels[rows.span], labels[cols.span], divider(rows),
                      divider(cols), notes)
