"""Compare two attention maps: the same text in two models, two texts in one model, a mask on/off.

The difference is ``B - A`` over positions paired by an :class:`Alignment`; positive cells are
where B attends more than A:

* the same tokens: every position with itself;
* the same number of tokens (a changed word, another model's tokenizer): position by
  position, and the positions whose tokens differ are marked;
* different lengths: word by word, by :class:`difflib.SequenceMatcher` on the two word
  sequences (lower case); equal words pair up, and so do the words of a replaced run of the
  same length (marked as differing); inserted and deleted words have no counterpart.

When a side has words without a counterpart, its rows give part of their weight to keys that
the difference map leaves out (B's rows to "big" and "fluffy" in "The big fluffy cat sat"), so
paired rows would not sum to 1 and ``B - A`` would be mostly negative. Both sides are then
compared like with like: each paired row is renormalised over the paired keys (it sums to 1
on both sides), and the share of each row that the paired keys held is kept
(:attr:`Comparison.paired_share_a` / ``_b``) and reported with the raw weights.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
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


ARROW = "\u2192"  # "cat→dog": A's token, then B's


@dataclass
class Alignment:
    """Which position of A goes with which position of B in the difference map.

    Attributes:
        method: ``tokens`` (the same tokens), ``positions`` (same length, some tokens differ)
            or ``words`` (difflib on the words of both texts).
        a, b: paired positions of A's and of B's view (the word-level view for ``words``).
        labels: a label per pair: the token, or ``a→b`` where they differ.
        differs: per pair, whether the two tokens differ.
        unmatched_a, unmatched_b: labels of the positions left without a counterpart.
        total_a, total_b: how many positions each side has.
    """

    method: str
    a: list[int]
    b: list[int]
    labels: list[str]
    differs: list[bool]
    unmatched_a: list[str] = field(default_factory=list)
    unmatched_b: list[str] = field(default_factory=list)
    total_a: int = 0
    total_b: int = 0

    @property
    def size(self) -> int:
        return len(self.a)

    @property
    def changed(self) -> list[int]:
        """Pair indices whose tokens differ."""
        return [i for i, d in enumerate(self.differs) if d]

    def note(self, unit: str = "token") -> str:
        """What was aligned, in a sentence."""
        differing = len(self.changed)
        if self.method == "tokens":
            return f"the same {self.total_a} {unit}s on both sides"
        if self.method == "positions":
            shown = ", ".join(self.labels[i] for i in self.changed[:6])
            more = f" and {differing - 6} more" if differing > 6 else ""
            return (f"both sides have {self.total_a} {unit}s: aligned position by position; "
                    f"{differing} differ{'s' if differing == 1 else ''} ({shown}{more})")
        left = ", ".join(repr(t) for t in self.unmatched_a[:6]) or "none"
        right = ", ".join(repr(t) for t in self.unmatched_b[:6]) or "none"
        return (f"aligned by word (difflib): {self.size} of {self.total_a} words of A paired "
                f"with {self.size} of {self.total_b} of B, {differing} of them changed; no "
                f"counterpart: A {left}, B {right}")

    def marked(self) -> tuple[list[int], list[int]]:
        """Positions of A and of B to mark: paired with another token, or with none."""
        paired_a, paired_b = set(self.a), set(self.b)
        changed_a = {self.a[i] for i in self.changed}
        changed_b = {self.b[i] for i in self.changed}
        return (sorted(changed_a | (set(range(self.total_a)) - paired_a)),
                sorted(changed_b | (set(range(self.total_b)) - paired_b)))

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.method, "pairs": [[i, j] for i, j in zip(self.a, self.b)],
                "labels": list(self.labels), "differs": list(self.differs),
                "unmatched_a": list(self.unmatched_a), "unmatched_b": list(self.unmatched_b)}


def _label(x: str, y: str) -> tuple[str, bool]:
    same = x.lower() == y.lower()
    return (x if same else f"{x}{ARROW}{y}"), not same


def align_positions(tokens_a: list[str], tokens_b: list[str]) -> Alignment:
    """Pair equal-length token lists position by position, marking the tokens that differ.

    Raises:
        ValueError: the lists differ in length.
    """
    if len(tokens_a) != len(tokens_b):
        raise ValueError(f"lengths differ: {len(tokens_a)} vs {len(tokens_b)}")
    labels, differs = zip(*(_label(x, y) for x, y in zip(tokens_a, tokens_b))) if tokens_a \
        else ((), ())
    method = "positions" if any(differs) else "tokens"
    positions = list(range(len(tokens_a)))
    return Alignment(method, positions, list(positions), list(labels), list(differs),
                     total_a=len(tokens_a), total_b=len(tokens_b))


def align_words(words_a: list[str], words_b: list[str]) -> Alignment:
    """Pair two word lists with :class:`difflib.SequenceMatcher` (case-insensitive).

    Equal runs pair word by word; a replaced run pairs word by word too, as far as the shorter
    side goes (marked as differing); inserted, deleted and left-over words stay unpaired.
    Texts without a word in common pair nothing.
    """
    matcher = difflib.SequenceMatcher(None, [w.lower() for w in words_a],
                                      [w.lower() for w in words_b], autojunk=False)
    a: list[int] = []
    b: list[int] = []
    labels: list[str] = []
    differs: list[bool] = []
    unmatched_a: list[str] = []
    unmatched_b: list[str] = []
    opcodes = matcher.get_opcodes()
    shared = any(tag == "equal" for tag, *_ in opcodes)  # no word in common: nothing pairs
    for tag, i1, i2, j1, j2 in opcodes:
        paired = min(i2 - i1, j2 - j1) if shared and tag in ("equal", "replace") else 0
        for i, j in zip(range(i1, i1 + paired), range(j1, j1 + paired)):
            label, differ = _label(words_a[i], words_b[j])
            a.append(i)
            b.append(j)
            labels.append(label)
            differs.append(differ)
        unmatched_a += words_a[i1 + paired:i2]
        unmatched_b += words_b[j1 + paired:j2]
    return Alignment("words", a, b, labels, differs, unmatched_a, unmatched_b,
                     len(words_a), len(words_b))


def difference(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``b - a`` of two ``[query, key]`` matrices of the same shape."""
    if a.shape != b.shape:
        raise ValueError(f"matrices differ in shape: {a.shape} vs {b.shape}")
    return np.asarray(b, dtype=np.float64) - np.asarray(a, dtype=np.float64)


def largest_changes(a: np.ndarray, b: np.ndarray, tokens: list[str], k: int = 10, *,
                    key_tokens: list[str] | None = None) -> list[dict[str, object]]:
    """The ``k`` cells with the largest ``|b - a|``, largest first (ties: row-major order);
    cells that do not change are never listed.

    Args:
        a, b: ``[query, key]`` matrices of the same shape (aligned positions).
        tokens: query labels; ``key_tokens``: key labels (default: ``tokens``).

    Returns:
        Dicts with ``query_index``, ``query``, ``key_index``, ``key``, ``a``, ``b`` and
        ``delta`` (``b - a``).
    """
    keys = tokens if key_tokens is None else key_tokens
    delta = difference(a, b)
    flat = np.abs(delta).ravel()
    changed = np.flatnonzero(flat)  # ascending: the stable sort keeps row-major ties
    order = changed[np.argsort(-flat[changed], kind="stable")][:max(k, 0)]
    size = delta.shape[1]
    changes: list[dict[str, object]] = []
    for index in order:
        i, j = divmod(int(index), size)
        changes.append({"query_index": i, "query": tokens[i], "key_index": j, "key": keys[j],
                        "a": float(a[i, j]), "b": float(b[i, j]), "delta": float(delta[i, j])})
    return changes


#: Text formats of :func:`format_changes`.
CHANGE_FORMATS: tuple[str, ...] = ("csv", "markdown")


@dataclass
class Comparison:
    """Two attention maps side by side and, when positions pair up, their difference.

    Attributes:
        a, b: the two sides; ``a.capture`` and ``b.capture`` are the views compared.
        alignment: how positions of A and B pair up (:class:`Alignment`), or ``None`` when
            nothing does (no difference map).
        diff: ``[pair, pair]`` float64 ``B - A`` over the paired positions, else ``None``.
        aligned_a, aligned_b: A's and B's ``[pair, pair]`` weights at the paired positions.
        changes: the largest changes (:func:`largest_changes`); empty when not aligned.
        unit: ``token``, or ``word`` when aligned by word.
        renormalised: whether ``aligned_a``/``aligned_b`` are rows renormalised over the
            paired keys (some keys had no counterpart); ``raw_a``/``raw_b`` then hold the
            weights before, and the changes carry them as ``a_raw``/``b_raw``.
        paired_share_a, paired_share_b: ``[pair]``: the share of each paired row's weight
            that the paired keys held before renormalising (1 where every key is paired).
    """

    a: Side
    b: Side
    alignment: Alignment | None
    diff: np.ndarray | None
    changes: list[dict[str, object]]
    aligned_a: np.ndarray | None = None
    aligned_b: np.ndarray | None = None
    unit: str = "token"
    renormalised: bool = False
    raw_a: np.ndarray | None = None
    raw_b: np.ndarray | None = None
    paired_share_a: np.ndarray | None = None
    paired_share_b: np.ndarray | None = None

    def changes_within(self, rows: list[int], cols: list[int], top: int
                       ) -> list[dict[str, object]]:
        """The largest changes among the aligned ``rows`` x ``cols`` (pair indices), e.g. the
        cells of a zoom window; indices in the result stay those of the whole alignment."""
        if self.alignment is None or self.aligned_a is None or self.aligned_b is None:
            return []
        labels = self.alignment.labels
        cells = np.ix_(rows, cols)
        changes = largest_changes(self.aligned_a[cells], self.aligned_b[cells],
                                  [labels[i] for i in rows], top,
                                  key_tokens=[labels[j] for j in cols])
        for change in changes:
            i = rows[int(change["query_index"])]  # type: ignore[call-overload]
            j = cols[int(change["key_index"])]  # type: ignore[call-overload]
            change.update(query_index=i, key_index=j)
            if self.renormalised and self.raw_a is not None and self.raw_b is not None:
                change.update(a_raw=float(self.raw_a[i, j]), b_raw=float(self.raw_b[i, j]))
            if self.alignment.method == "words":
                change.update(a_query_index=self.alignment.a[i], a_key_index=self.alignment.a[j],
                              b_query_index=self.alignment.b[i], b_key_index=self.alignment.b[j])
        return changes

    @property
    def aligned(self) -> bool:
        """Whether there is a difference map."""
        return self.alignment is not None

    @property
    def where(self) -> str:
        """The layer and head shown, e.g. ``"layer 0, head 3"`` (each side's when they differ)."""
        a, b = self.a, self.b

        def head(side: Side) -> str:
            return "mean of the heads" if side.head == "mean" else f"head {side.head}"

        if b.layer != a.layer or b.head != a.head:
            return f"A layer {a.layer}, {head(a)}; B layer {b.layer}, {head(b)}"
        return f"layer {a.layer}, {head(a)}"

    @property
    def title(self) -> str:
        """Figure title: the layer and head, how the views differ from the raw captures, and
        how B - A was aligned."""
        from attnviz.analysis.tokens import view_notes

        notes = [n for n in view_notes(self.a.capture) if n != "causal"]
        if self.alignment is not None and self.alignment.method == "positions":
            count = len(self.alignment.changed)
            notes.append(f"B - A position by position, {count} {self.unit}"
                         + (" differs" if count == 1 else "s differ"))
        elif self.alignment is not None and self.alignment.method == "words":
            notes.append("B - A aligned by word")
        if self.renormalised:
            notes.append(f"rows renormalised over the paired {self.unit}s")
        measure = self.a.capture.measure_label
        return (f"Compare: {measure + ', ' if measure else ''}{self.where}"
                + (f" ({', '.join(notes)})" if notes else ""))

    @property
    def diff_title(self) -> str:
        """Title of the difference panel."""
        if self.renormalised:
            return "difference B - A (paired rows renormalised)"
        return "difference B - A"

    @property
    def note(self) -> str:
        """What was aligned (empty when the tokens are the same)."""
        if self.alignment is None or self.alignment.method == "tokens":
            return ""
        return self.alignment.note(self.unit)

    @property
    def renormalised_note(self) -> str:
        """How B - A compares rows when keys had no counterpart (empty when none had)."""
        if not self.renormalised or self.alignment is None:
            return ""

        def held(shares: np.ndarray | None, side: str) -> str:
            lost = 1.0 - np.asarray(shares if shares is not None else [1.0], dtype=np.float64)
            if float(lost.max()) < 0.0005:
                return f"none of {side}'s rows"
            low, high, mean = (100 * float(v) for v in (lost.min(), lost.max(), lost.mean()))
            span = f"{low:.0f}-{high:.0f}%" if round(low) != round(high) else f"{high:.0f}%"
            return f"{span} of {side}'s rows (mean {mean:.0f}%)"

        count = self.alignment.size
        return (f"B - A compares each row renormalised over the {count} paired {self.unit}s "
                f"(paired rows sum to 1 on both sides); {self.unit}s without a counterpart "
                f"held {held(self.paired_share_a, 'A')} and "
                f"{held(self.paired_share_b, 'B')}; A raw and B raw (a_raw, b_raw) are the "
                "weights before renormalisation")

    @property
    def mismatch(self) -> str:
        """Why there is no difference map (meaningful when not aligned)."""
        return (f"A and B share no word ({self.a.capture.num_tokens} vs "
                f"{self.b.capture.num_tokens} tokens): no difference map")

    def to_dict(self, image: str, label_a: str, label_b: str) -> dict[str, Any]:
        """Both sides, the alignment and the changes, for json output."""

        def describe(side: Side, label: str) -> dict[str, Any]:
            capture = side.capture
            described = {"label": label, "model": capture.model, "text": capture.text,
                         "causal": capture.causal, "layer": side.layer, "head": side.head,
                         "tokens": side.tokens}
            if capture.measure != "weights":
                described["measure"] = capture.measure
            return described

        def shares(values: np.ndarray | None) -> list[float] | None:
            return None if values is None else [round(float(v), 6) for v in values]

        alignment = None
        if self.alignment is not None:
            alignment = {**self.alignment.to_dict(), "unit": self.unit, "note": self.note,
                         "renormalised": self.renormalised,
                         "renormalised_note": self.renormalised_note,
                         "paired_share_a": shares(self.paired_share_a),
                         "paired_share_b": shares(self.paired_share_b)}
        return {"image": image, "aligned": self.aligned, "a": describe(self.a, label_a),
                "b": describe(self.b, label_b), "alignment": alignment,
                "changes": self.changes}


def compare_captures(a: Capture, b: Capture, layer: int = -1, head: int | str = "mean", *,
                     top: int = 10, words: bool = False, exclude_special: bool = False
                     ) -> Comparison:
    """Compare one layer and head of two captures.

    Views of the same length are aligned position by position (:func:`align_positions`),
    others word by word (:func:`align_words` on their word-level views, which the sides then
    show). When words are left without a counterpart, each paired row is renormalised over
    the paired keys on both sides before ``B - A`` (see the module's docstring).

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
    from attnviz.analysis.tokens import piece_labels, token_view

    view_a = token_view(a, words=words, exclude_special=exclude_special)
    view_b = token_view(b, words=words, exclude_special=exclude_special)
    side_a = side_of(view_a, layer, head)
    side_b = side_of(view_b, layer, head)
    unit = "word" if words else "token"
    if view_a.num_tokens == view_b.num_tokens:
        alignment = align_positions(piece_labels(view_a), piece_labels(view_b))
        matrix_a, matrix_b = side_a.matrix, side_b.matrix
    else:
        words_a = token_view(a, words=True, exclude_special=exclude_special)
        words_b = token_view(b, words=True, exclude_special=exclude_special)
        alignment = align_words(words_a.display_tokens, words_b.display_tokens)
        if not alignment.size:
            return Comparison(side_a, side_b, None, None, [], unit=unit)
        unit = "word"  # every panel shows words, so the marks and the map agree
        side_a, side_b = side_of(words_a, layer, head), side_of(words_b, layer, head)
        matrix_a = side_a.matrix[np.ix_(alignment.a, alignment.a)]
        matrix_b = side_b.matrix[np.ix_(alignment.b, alignment.b)]
    raw_a = np.asarray(matrix_a, dtype=np.float64)
    raw_b = np.asarray(matrix_b, dtype=np.float64)
    renormalise = bool(alignment.unmatched_a or alignment.unmatched_b)
    share_a, share_b = raw_a.sum(axis=1), raw_b.sum(axis=1)
    if renormalise:  # like with like: each paired row sums to 1 over the paired keys
        matrix_a, matrix_b = renormalise_rows(raw_a), renormalise_rows(raw_b)
    comparison = Comparison(side_a, side_b, alignment, difference(matrix_a, matrix_b), [],
                            np.asarray(matrix_a), np.asarray(matrix_b), unit,
                            renormalised=renormalise, raw_a=raw_a, raw_b=raw_b,
                            paired_share_a=share_a, paired_share_b=share_b)
    every = list(range(alignment.size))
    comparison.changes = comparison.changes_within(every, every, top)
    return comparison


def renormalise_rows(matrix: np.ndarray) -> np.ndarray:
    """Each row of a ``[query, key]`` matrix divided by its sum (rows of zeros stay 0)."""
    matrix = np.asarray(matrix, dtype=np.float64)
    sums = matrix.sum(axis=1, keepdims=True)
    return np.divide(matrix, sums, out=np.zeros_like(matrix), where=sums > 0)


def format_changes(changes: list[dict[str, object]], fmt: str, where: str) -> str:
    """The largest changes (:func:`largest_changes`) as ``csv`` or ``markdown`` text.

    Changes of renormalised rows (:attr:`Comparison.renormalised`) also give the raw weights:
    CSV columns ``a_raw`` and ``b_raw``, and ``(raw ...)`` in the markdown table.
    """
    if fmt not in CHANGE_FORMATS:
        raise ValueError(f"unknown format {fmt!r}: use csv or markdown")
    raw = any("a_raw" in change for change in changes)
    if fmt == "csv":
        from attnviz.csvtext import csv_text

        header = ["query_index", "query", "key_index", "key", "a", "b", "delta"]
        return csv_text(header + (["a_raw", "b_raw"] if raw else []), (
            [change["query_index"], change["query"], change["key_index"], change["key"],
             f"{change['a']:.6f}", f"{change['b']:.6f}", f"{change['delta']:+.6f}"]
            + ([f"{change['a_raw']:.6f}", f"{change['b_raw']:.6f}"] if raw else [])
            for change in changes))
    title = (f"**Largest changes, B - A ({where}), rows renormalised over the paired keys**"
             if raw else f"**Largest changes, B - A ({where})**")
    lines = [title, "", "| query | key | A | B | B - A |" + (" A raw | B raw |" if raw else ""),
             "|---|---|---:|---:|---:|" + ("---:|---:|" if raw else "")]
    for change in changes:
        query = str(change["query"]).replace("|", "\\|")
        key = str(change["key"]).replace("|", "\\|")
        extra = f" {change['a_raw']:.3f} | {change['b_raw']:.3f} |" if raw else ""
        lines.append(f"| {change['query_index']}:{query} | {change['key_index']}:{key} | "
                     f"{change['a']:.3f} | {change['b']:.3f} | {change['delta']:+.3f} |{extra}")
    return "\n".join(lines) + "\n"
