"""A corpus of texts: read an ``--input`` file and add up the head statistics of every text.

Statistics are averaged over every eligible query row of every text (weighted by tokens), so a
corpus is summarised by one :class:`~attnviz.analysis.stats.StatSums`: sums and row counts. A
:class:`CorpusPart` holds those sums for some of the texts; parts computed anywhere (batches,
processes, the workers of a Ray cluster) merge into the same corpus result in any order, up to
float rounding. The local engine adds every text to one part; the Ray engine
(:mod:`attnviz.engine.ray_heads`) adds a batch to a part on a worker and merges the parts.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from attnviz.analysis.stats import StatSums, stat_sums
from attnviz.analysis.tokens import token_view
from attnviz.capture import Capture
from attnviz.errors import InputError

if TYPE_CHECKING:
    pass

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
        from attnviz.fileio import read_input_text

        try:  # bounded: a pipe or a device such as /dev/zero cannot exhaust memory
            raw = read_input_text(path)
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


@dataclass
class CorpusPart:
    """Mergeable totals of some texts of a corpus: what ``heads --input`` adds up.

    Attributes:
        sums: statistic sums (sufficient statistics) of the texts used, ``None`` when none was.
        view: the view of the used text that comes last in the input (its flags, model and
            notes describe the corpus); ``position`` is that text's position in the input.
        failed: how many texts could not be used.
        error: ``(position, error)`` of the first text (in input order) that could not be used.
    """

    sums: StatSums | None = None
    view: Capture | None = None
    position: int = -1
    failed: int = 0
    error: tuple[int, InputError] | None = None

    def add(self, position: int, text: str, result: Capture | InputError, *,
            words: bool = False, exclude_special: bool = False) -> list[str]:
        """Add one text's statistics, or count it as failed.

        Args:
            position: the text's position in the input (0-based).
            text: the text (for the message of a failure).
            result: its capture (weights ``[layer, head, query, key]``) or why it failed.
            words: merge subword tokens into words before the statistics.
            exclude_special: drop special tokens (rows renormalised) before the statistics.

        Returns:
            The warnings to show: the capture's own, or the failure.
        """
        if not isinstance(result, InputError):
            try:
                view = token_view(result, words=words, exclude_special=exclude_special)
            except InputError as error:  # nothing left of it (only special tokens)
                result = error
        if isinstance(result, InputError):
            self.failed += 1
            if self.error is None or position < self.error[0]:
                self.error = (position, result)
            return [f"skipped a text ({result.message}): {text[:60]!r}"]
        messages = [str(message) for message in result.meta.get("warnings", [])]
        sums = stat_sums(view)
        self.sums = sums if self.sums is None else self.sums + sums
        if position > self.position:
            self.view, self.position = view, position
        return messages

    def merge(self, other: CorpusPart) -> CorpusPart:
        """Add another part's totals to this one (in place); returns ``self``."""
        if other.sums is not None:
            self.sums = other.sums if self.sums is None else self.sums + other.sums
        if other.view is not None and other.position > self.position:
            self.view, self.position = other.view, other.position
        self.failed += other.failed
        if other.error is not None and (self.error is None or other.error[0] < self.error[0]):
            self.error = other.error
        return self

    def portable(self) -> CorpusPart:
        """A copy to send between processes: the view keeps its tokens, flags and notes but
        not its weights (the sums hold everything the statistics need)."""
        import dataclasses

        import numpy as np

        view = None if self.view is None else dataclasses.replace(
            self.view, weights=np.zeros((0, 0, 0, 0), dtype=np.float32))
        return dataclasses.replace(self, view=view)

    def result(self) -> CorpusStats:
        """The corpus statistics.

        Raises:
            InputError: no text could be used.
        """
        if self.sums is None or self.view is None:
            if self.error is not None and self.failed == 1:
                raise self.error[1]  # one text, unusable: its own message says why
            first = f" (the first: {self.error[1].message})" if self.error is not None else ""
            raise InputError(f"no text of the input could be used{first}",
                             "check the input file")
        return CorpusStats(self.sums, self.view, self.failed)


def corpus_stats(texts: Sequence[CorpusText],
                 capture_text: Callable[[str, str | None], Capture] | None = None,
                 *, words: bool = False, exclude_special: bool = False,
                 warn: Callable[[str], None] | None = None,
                 advance: Callable[[], None] | None = None,
                 capture_all: Callable[[Sequence[CorpusText]],
                                       Iterable[Capture | InputError]] | None = None
                 ) -> CorpusStats:
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
        capture_all: instead of ``capture_text``, returns every text's capture or
            :class:`InputError` in order, lazily (e.g. :func:`attnviz.batches.capture_batches` or
            :meth:`attnviz.session.Session.run_texts`).

    Returns:
        The sums, the last view and the number of skipped texts.

    Raises:
        InputError: no text could be used (or the only text could not).
    """
    results: Iterable[Capture | InputError]
    if capture_all is not None:
        results = capture_all(texts)
    elif capture_text is not None:
        results = _one_by_one(texts, capture_text)
    else:
        raise TypeError("corpus_stats needs capture_text or capture_all")
    part = CorpusPart()
    for position, ((text, _pair), capture) in enumerate(zip(texts, results)):
        if isinstance(capture, InputError) and len(texts) == 1:
            raise capture
        for message in part.add(position, text, capture, words=words,
                                exclude_special=exclude_special):
            if warn is not None:
                warn(message)
        if advance is not None:
            advance()
    return part.result()


def _one_by_one(texts: Sequence[CorpusText], capture_text: Callable[[str, str | None], Capture]
                ) -> Iterator[Capture | InputError]:
    for text, pair in texts:
        try:
            yield capture_text(text, pair)
        except InputError as error:
            yield error
