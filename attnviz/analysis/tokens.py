"""Token-level transformations of a capture: drop special tokens, merge subwords into words."""

from __future__ import annotations

import numpy as np

from attnviz.capture import Capture


def renormalise_rows(weights: np.ndarray) -> np.ndarray:
    """Divide each row (last axis) by its sum; rows that sum to 0 stay 0."""
    sums = weights.sum(axis=-1, keepdims=True)
    return np.divide(weights, sums, out=np.zeros_like(weights), where=sums > 0)


def exclude_special(capture: Capture) -> Capture:
    """Drop special tokens ([CLS], [SEP], <s>, ...) from queries and keys and renormalise rows.

    The result's rows sum to 1 again (a row whose only weight was on special tokens becomes 0).
    """
    keep = [i for i, special in enumerate(capture.special) if not special]
    if len(keep) == len(capture.tokens):
        return capture
    weights = np.asarray(capture.weights, dtype=np.float32)[:, :, keep][:, :, :, keep]
    return capture.with_weights(
        renormalise_rows(weights),
        tokens=[capture.tokens[i] for i in keep],
        display_tokens=[capture.display_tokens[i] for i in keep],
        word_ids=[capture.word_ids[i] for i in keep],
        special=[False] * len(keep),
        meta={**capture.meta, "special_excluded": True},
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
    return capture.with_weights(
        merged.astype(np.float32),
        tokens=tokens, display_tokens=display,
        word_ids=[capture.word_ids[g[0]] for g in groups],
        special=[capture.special[g[0]] for g in groups],
        meta={**capture.meta, "words_merged": True},
    )


def find_token(display_tokens: list[str], spec: str) -> int:
    """Position of the token a user named with ``--token``.

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
    if sep and head and tail.strip().isdigit():
        word, occurrence = head, int(tail)
    elif text.lstrip("-").isdigit():
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
                         "name one piece, a position, or use --words")
    if not 1 <= occurrence <= len(matches):
        raise UsageError(f"token {word!r} occurs {len(matches)} time(s), not {occurrence}",
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


def view_notes(capture: Capture) -> list[str]:
    """Short notes on how a view differs from the raw capture, for titles."""
    notes = []
    if capture.meta.get("words_merged"):
        notes.append("word level")
    if capture.meta.get("special_excluded"):
        notes.append("special tokens excluded, rows renormalised")
    if capture.causal:
        notes.append("causal")
    return notes
