"""Compare two attention maps: the same text in two models, two texts in one model, a mask on/off.

The difference is ``B - A`` and only defined when the two maps are over the same tokens; then
positive cells are where B attends more than A.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from attnviz.capture import Capture


@dataclass
class Side:
    """One side of a comparison: a ``[query, key]`` matrix and what it shows."""

    capture: Capture
    matrix: np.ndarray  # [query, key]
    layer: int  # model layer index
    head: str  # model head index as text, or "mean"

    @property
    def tokens(self) -> list[str]:
        return self.capture.display_tokens


def side_of(capture: Capture, layer: int, head: int | str) -> Side:
    """The matrix of one layer and head (an index, or ``"mean"`` of the held heads).

    Raises:
        UsageError: the layer or head is not in the capture.
    """
    from attnviz.selection import resolve_index

    shown_layer = resolve_index(layer, capture.num_layers, "layer")
    if head == "mean":
        return Side(capture, capture.mean_matrix(layer), shown_layer, "mean")
    matrix = capture.matrix(layer, int(head))
    return Side(capture, matrix, shown_layer, str(resolve_index(int(head), capture.num_heads,
                                                                "head")))


def tokens_line_up(a: Capture, b: Capture) -> bool:
    """Whether two captures are over the same tokens (display text, ignoring case)."""
    return a.num_tokens == b.num_tokens and all(
        x.lower() == y.lower() for x, y in zip(a.display_tokens, b.display_tokens))


def difference(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``b - a`` of two ``[query, key]`` matrices of the same shape."""
    if a.shape != b.shape:
        raise ValueError(f"matrices differ in shape: {a.shape} vs {b.shape}")
    return np.asarray(b, dtype=np.float64) - np.asarray(a, dtype=np.float64)


def largest_changes(a: np.ndarray, b: np.ndarray, tokens: list[str], k: int = 10
                    ) -> list[dict[str, object]]:
    """The ``k`` cells with the largest ``|b - a|``, largest first (ties: row-major order).

    Returns:
        Dicts with ``query_index``, ``query``, ``key_index``, ``key``, ``a``, ``b`` and
        ``delta`` (``b - a``).
    """
    delta = difference(a, b)
    flat = np.abs(delta).ravel()
    order = np.argsort(-flat, kind="stable")[:max(k, 0)]
    size = delta.shape[1]
    changes: list[dict[str, object]] = []
    for index in order:
        i, j = divmod(int(index), size)
        changes.append({"query_index": i, "query": tokens[i], "key_index": j, "key": tokens[j],
                        "a": float(a[i, j]), "b": float(b[i, j]), "delta": float(delta[i, j])})
    return changes


#: Text formats of :func:`format_changes`.
CHANGE_FORMATS: tuple[str, ...] = ("csv", "markdown")


@dataclass
class Comparison:
    """Two attention maps side by side and, when their tokens line up, their difference.

    Attributes:
        a, b: the two sides; ``a.capture`` and ``b.capture`` are the views compared.
        aligned: whether both sides are over the same tokens (:func:`tokens_line_up`).
        diff: ``[query, key]`` float64 ``B - A`` when aligned, else ``None``.
        changes: the largest changes (:func:`largest_changes`); empty when not aligned.
        hint: when not aligned, ``" (they do with --words --exclude-special)"`` if that would
            make the tokens line up, else ``""``.
    """

    a: Side
    b: Side
    aligned: bool
    diff: np.ndarray | None
    changes: list[dict[str, object]]
    hint: str = ""

    @property
    def where(self) -> str:
        """The layer and head shown, e.g. ``"layer 0, head 3"`` (each side's when they differ)."""
        a, b = self.a, self.b
        if b.layer != a.layer or b.head != a.head:
            return f"A layer {a.layer}, head {a.head}; B layer {b.layer}, head {b.head}"
        return f"layer {a.layer}, head {a.head}"

    @property
    def title(self) -> str:
        """Figure title: the layer and head, and how the views differ from the raw captures."""
        from attnviz.analysis.tokens import view_notes

        notes = [n for n in view_notes(self.a.capture) if n != "causal"]
        return f"Compare: {self.where}" + (f" ({', '.join(notes)})" if notes else "")

    @property
    def mismatch(self) -> str:
        """Why there is no difference map (meaningful when not aligned)."""
        return (f"the tokens do not line up ({self.a.capture.num_tokens} vs "
                f"{self.b.capture.num_tokens} tokens){self.hint}: no difference map")

    def to_dict(self, image: str, label_a: str, label_b: str) -> dict[str, Any]:
        """Both sides, the alignment and the changes, for json output."""

        def describe(side: Side, label: str) -> dict[str, Any]:
            capture = side.capture
            return {"label": label, "model": capture.model, "text": capture.text,
                    "causal": capture.causal, "layer": side.layer, "head": side.head,
                    "tokens": side.tokens}

        return {"image": image, "aligned": self.aligned, "a": describe(self.a, label_a),
                "b": describe(self.b, label_b), "changes": self.changes}


def compare_captures(a: Capture, b: Capture, layer: int = -1, head: int | str = "mean", *,
                     top: int = 10, words: bool = False, exclude_special: bool = False
                     ) -> Comparison:
    """Compare one layer and head of two captures.

    Args:
        a, b: weights ``[layer, head, query, key]`` of the two sides (any models and texts).
        layer: layer of each capture (negative counts from the end of each).
        head: head index, or ``"mean"`` of the layer's held heads.
        top: how many of the largest changes to list.
        words: merge subword tokens into words on both sides first.
        exclude_special: drop special tokens (rows renormalised) on both sides first.

    Raises:
        UsageError: the layer or head is not in a capture.
    """
    from attnviz.analysis.tokens import exclude_special as drop_special
    from attnviz.analysis.tokens import merge_words, token_view

    view_a = token_view(a, words=words, exclude_special=exclude_special)
    view_b = token_view(b, words=words, exclude_special=exclude_special)
    side_a = side_of(view_a, layer, head)
    side_b = side_of(view_b, layer, head)
    aligned = tokens_line_up(view_a, view_b)
    if aligned:
        return Comparison(side_a, side_b, True, difference(side_a.matrix, side_b.matrix),
                          largest_changes(side_a.matrix, side_b.matrix, side_a.tokens, top))
    hint = ""
    if not (words and exclude_special) and tokens_line_up(drop_special(merge_words(a)),
                                                          drop_special(merge_words(b))):
        hint = " (they do with --words --exclude-special)"
    return Comparison(side_a, side_b, False, None, [], hint)


def format_changes(changes: list[dict[str, object]], fmt: str, where: str) -> str:
    """The largest changes (:func:`largest_changes`) as ``csv`` or ``markdown`` text."""
    if fmt not in CHANGE_FORMATS:
        raise ValueError(f"unknown format {fmt!r}: use csv or markdown")
    if fmt == "csv":
        import csv
        import io

        buffer = io.StringIO()
        writer = csv.writer(buffer, lineterminator="\n")
        writer.writerow(["query_index", "query", "key_index", "key", "a", "b", "delta"])
        for change in changes:
            writer.writerow([change["query_index"], change["query"], change["key_index"],
                             change["key"], f"{change['a']:.6f}", f"{change['b']:.6f}",
                             f"{change['delta']:+.6f}"])
        return buffer.getvalue()
    lines = [f"**Largest changes, B - A ({where})**", "", "| query | key | A | B | B - A |",
             "|---|---|---:|---:|---:|"]
    for change in changes:
        query = str(change["query"]).replace("|", "\\|")
        key = str(change["key"]).replace("|", "\\|")
        lines.append(f"| {change['query_index']}:{query} | {change['key_index']}:{key} | "
                     f"{change['a']:.3f} | {change['b']:.3f} | {change['delta']:+.3f} |")
    return "\n".join(lines) + "\n"
