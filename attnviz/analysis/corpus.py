"""A corpus of texts: read an ``--input`` file and add up the head statistics of every text.

Statistics are averaged over every eligible query row of every text (weighted by tokens), so a
corpus is summarised by one :class:`~attnviz.analysis.stats.StatSums`.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from attnviz.analysis.stats import StatSums, stat_sums
from attnviz.analysis.tokens import token_view
from attnviz.capture import Capture
from attnviz.errors import InputError

#: One text of a corpus and its optional pair sentence.
CorpusText = tuple[str, str | None]

_JSONL_HINT = "write one JSON object per line, e.g. {\"text\": \"The cat sat.\"}"


def read_corpus(path: Path) -> tuple[list[CorpusText], int]:
    """Texts of an ``--input`` file: one per line, or JSONL with ``text`` (and ``pair``).

    ``-`` reads standard input. A file is JSONL when it ends in ``.jsonl``/``.ndjson`` or its
    first non-blank line starts with ``{``.

    Returns:
        ``(text, pair)`` tuples and the number of blank lines or empty texts skipped.

    Raises:
        InputError: the file is missing, not UTF-8, a JSON line is malformed, or no text is left.
    """
    if str(path) == "-":
        raw = sys.stdin.read()
    else:
        if not path.is_file():
            raise InputError(f"input file {path} does not exist",
                             "give a text file with one text per line, or JSONL with \"text\"")
        try:
            raw = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise InputError(f"{path} is not valid UTF-8 (byte {exc.start})",
                             "save the file as UTF-8 and try again") from None
        except OSError as exc:
            raise InputError(f"cannot read {path}: {exc.strerror or exc}") from None
    lines = raw.splitlines()
    first = next((line for line in lines if line.strip()), "")
    jsonl = path.suffix.lower() in (".jsonl", ".ndjson") or first.lstrip().startswith("{")
    texts: list[CorpusText] = []
    skipped = 0
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            skipped += 1
            continue
        if not jsonl:
            texts.append((line.rstrip("\r"), None))
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InputError(f"{path} line {number} is not valid JSON ({exc.msg})",
                             _JSONL_HINT) from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise InputError(f"{path} line {number} has no \"text\" string", _JSONL_HINT)
        pair = record.get("pair")
        if pair is not None and not isinstance(pair, str):
            raise InputError(f"{path} line {number}: \"pair\" must be a string")
        if not record["text"].strip() or (pair is not None and not pair.strip()):
            skipped += 1
            continue
        texts.append((record["text"], pair))
    if not texts:
        raise InputError(f"{path} holds no texts", "write one text per line")
    return texts, skipped


@dataclass
class CorpusStats:
    """Head statistics added up over a corpus.

    Attributes:
        sums: statistic sums over every text that could be used.
        view: the last text's view (words merged, specials dropped as asked): its token flags,
            model and notes describe the corpus.
        failed: how many texts were skipped because they could not be used.
    """

    sums: StatSums
    view: Capture
    failed: int = 0


def corpus_stats(texts: Sequence[CorpusText], capture_text: Callable[[str, str | None], Capture],
                 *, words: bool = False, exclude_special: bool = False,
                 warn: Callable[[str], None] | None = None,
                 advance: Callable[[], None] | None = None) -> CorpusStats:
    """Capture every text and add up its head statistics.

    A text whose capture raises :class:`InputError` is skipped with a warning (when there is more
    than one text; a single text re-raises).

    Args:
        texts: ``(text, pair)`` tuples, e.g. from :func:`read_corpus`.
        capture_text: returns the capture (weights ``[layer, head, query, key]``) of one text
            and its pair; every capture must hold the same layers and heads.
        words: merge subword tokens into words before the statistics.
        exclude_special: drop special tokens (rows renormalised) before the statistics.
        warn: called with each warning: a skipped text, and the capture's own warnings.
        advance: called once per text, used or skipped (for a progress bar).

    Returns:
        The sums, the last view and the number of skipped texts.

    Raises:
        InputError: no text could be used (or the only text could not).
    """
    total: StatSums | None = None
    view: Capture | None = None
    failed = 0
    for text, pair in texts:
        try:
            capture = capture_text(text, pair)
        except InputError as error:
            if len(texts) == 1:
                raise
            failed += 1
            if warn is not None:
                warn(f"skipped a text ({error.message}): {text[:60]!r}")
            if advance is not None:
                advance()
            continue
        if warn is not None:
            for message in capture.meta.get("warnings", []):
                warn(message)
        view = token_view(capture, words=words, exclude_special=exclude_special)
        sums = stat_sums(view)
        total = sums if total is None else total + sums
        if advance is not None:
            advance()
    if total is None or view is None:
        raise InputError("no text of the input could be used", "check the input file")
    return CorpusStats(total, view, failed)
