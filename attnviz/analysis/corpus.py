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
from attnviz.errors import AttnvizError, InputError

if TYPE_CHECKING:
    from attnviz.models import AttentionSource, ModelSpec

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


def capture_batches(spec: ModelSpec, texts: Sequence[CorpusText], *,
                    load: Callable[[], AttentionSource], batch_size: int = 8,
                    layers: str | None = None, heads: str | None = None,
                    max_tokens: int | None = None, truncate: bool = True,
                    use_cache: bool = True, write: bool = True,
                    check: Callable[[str, str | None], None] | None = None,
                    warn: Callable[[str], None] | None = None
                    ) -> Iterator[Capture | InputError]:
    """One capture (weights ``[layer, head, query, key]``) or error per text, in order.

    Texts are taken ``batch_size`` at a time: those in the capture cache come from it, the rest
    run through the model in one padded batch (:func:`~attnviz.models.capture_many`). When that
    batch fails because of one text, its texts are captured one by one, so the bad text gets its
    own :class:`InputError` and the others their captures. Only one batch of captures is held
    at a time.

    Args:
        spec: the model (for cache keys); ``load`` returns it loaded, on the first cache miss.
        texts: ``(text, pair)`` tuples.
        batch_size: texts per forward pass.
        layers: layer selection such as ``"0,2-4"``; ``heads`` likewise (``None``: all).
        max_tokens: token limit; ``truncate`` whether to cut past it or fail.
        use_cache: look texts up in the capture cache; ``write``: keep fresh captures there.
        check: raises :class:`InputError` for a text (and pair) the model cannot use.
        warn: called when the cache cannot be written.

    Raises:
        UsageError: a selection fits no text of this model.
        ModelLoadError: the model cannot be loaded.
    """
    import numbers

    from attnviz.engine import MAX_BATCH_SIZE
    from attnviz.errors import UsageError

    if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral) \
            or not 1 <= batch_size <= MAX_BATCH_SIZE:
        raise UsageError(f"the batch size (--batch-size) must be a whole number "
                         f"from 1 to {MAX_BATCH_SIZE}, not {batch_size!r:.40}")
    batch_size = int(batch_size)
    for start in range(0, len(texts), batch_size):
        chunk = texts[start:start + batch_size]
        results: list[Capture | InputError | None] = [None] * len(chunk)
        for i, (text, pair) in enumerate(chunk):
            if check is not None:
                try:
                    check(text, pair)
                except InputError as error:
                    results[i] = error
                    continue
            if use_cache:
                results[i] = _cached(spec, text, pair, layers, heads, max_tokens, truncate)
        misses = [i for i, result in enumerate(results) if result is None]
        if misses:
            for i, result in zip(misses, _run_batch(load(), [chunk[i] for i in misses],
                                                    layers, heads, max_tokens, truncate)):
                results[i] = result
                if use_cache and write and isinstance(result, Capture):
                    _keep(spec, chunk[i], result, layers, heads, max_tokens, truncate, warn)
        yield from (result for result in results if result is not None)


def _cached(spec: ModelSpec, text: str, pair: str | None, layers: str | None,
            heads: str | None, max_tokens: int | None, truncate: bool) -> Capture | None:
    """The cached capture of a request (see :func:`attnviz.cache.cached_capture`)."""
    from attnviz.cache import cached_capture

    return cached_capture(spec, text, pair, layers=layers, heads=heads, max_tokens=max_tokens,
                          truncate=truncate)


def _keep(spec: ModelSpec, text: CorpusText, capture: Capture, layers: str | None,
          heads: str | None, max_tokens: int | None, truncate: bool,
          warn: Callable[[str], None] | None) -> None:
    from attnviz.cache import capture_key, store

    try:
        key = capture_key(spec, text[0], text[1], max_tokens=max_tokens, truncate=truncate,
                          layers=layers, heads=heads)
        store(key, capture)
    except (OSError, ValueError):
        return
    except AttnvizError as error:
        if warn is not None:
            warn(f"could not keep the capture in the cache ({error.message}); "
                 "use --no-cache to stop trying")


def _run_batch(source: AttentionSource, texts: Sequence[CorpusText], layers: str | None,
               heads: str | None, max_tokens: int | None, truncate: bool
               ) -> list[Capture | InputError]:
    """Capture ``texts`` in one batch; when one text spoils it, one by one."""
    from attnviz.models import capture_many
    from attnviz.selection import parse_selection

    layer_list = parse_selection(layers, source.num_layers, "layer") if layers else None
    head_list = parse_selection(heads, source.num_heads, "head") if heads else None
    pairs = [pair for _, pair in texts]
    try:
        return list(capture_many(source, [text for text, _ in texts],
                                 None if all(p is None for p in pairs) else pairs,
                                 batch_size=len(texts), layers=layer_list, heads=head_list,
                                 max_tokens=max_tokens, truncate=truncate))
    except InputError as error:
        if len(texts) == 1:
            return [error]
    results: list[Capture | InputError] = []
    for text, pair in texts:
        try:
            results.append(source.capture(text, pair, layers=layer_list, heads=head_list,
                                          max_tokens=max_tokens, truncate=truncate))
        except InputError as error:
            results.append(error)
    return results


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
            :class:`InputError` in order, lazily (e.g. :func:`capture_batches` or
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
