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
    display = ["".join(capture.display_tokens[i] for i in g) if len(g) > 1
               else capture.display_tokens[g[0]] for g in groups]
    tokens = [display[k] if len(g) > 1 else capture.tokens[g[0]] for k, g in enumerate(groups)]
    return capture.with_weights(
        merged.astype(np.float32),
        tokens=tokens, display_tokens=display,
        word_ids=[capture.word_ids[g[0]] for g in groups],
        special=[capture.special[g[0]] for g in groups],
        meta={**capture.meta, "words_merged": True},
    )
