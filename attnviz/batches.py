"""Many texts through one model: cache first, then padded batches, a bad text on its own.

The session's batch step for ``--input`` corpora (``heads --input``, ``export --input``) and the
Ray workers. Each result is a capture or the :class:`~attnviz.errors.InputError` of its text.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

from attnviz.capture import Capture
from attnviz.errors import AttnvizError, InputError

if TYPE_CHECKING:
    from attnviz.models import AttentionSource, ModelSpec

#: One text of a corpus and its optional pair sentence.
CorpusText = tuple[str, str | None]

MAX_BATCH_SIZE = 1024  # texts per forward pass (and per Ray task)


def capture_batches(spec: ModelSpec, texts: Sequence[CorpusText], *,
                    load: Callable[[], AttentionSource], batch_size: int = 8,
                    layers: str | None = None, heads: str | None = None,
                    max_tokens: int | None = None, truncate: bool = True,
                    use_cache: bool = True, write: bool = True,
                    check: Callable[[str, str | None], None] | None = None,
                    warn: Callable[[str], None] | None = None, measure: str = "weights"
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
        measure: ``weights`` or a measure of :mod:`attnviz.measures` (cached under its own key).

    Raises:
        UsageError: a selection fits no text of this model.
        ModelLoadError: the model cannot be loaded.
    """
    import numbers

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
                results[i] = _cached(spec, text, pair, layers, heads, max_tokens, truncate,
                                     measure)
        misses = [i for i, result in enumerate(results) if result is None]
        if misses:
            for i, result in zip(misses, _run_batch(load(), [chunk[i] for i in misses],
                                                    layers, heads, max_tokens, truncate,
                                                    measure)):
                results[i] = result
                if use_cache and write and not isinstance(result, InputError):
                    _keep(spec, chunk[i], result, layers, heads, max_tokens, truncate, warn,
                          measure)
        yield from (result for result in results if result is not None)


def _cached(spec: ModelSpec, text: str, pair: str | None, layers: str | None,
            heads: str | None, max_tokens: int | None, truncate: bool,
            measure: str = "weights") -> Capture | None:
    """The cached capture of a request (see :func:`attnviz.cache.cached_capture`)."""
    from attnviz.cache import cached_capture

    return cached_capture(spec, text, pair, layers=layers, heads=heads, max_tokens=max_tokens,
                          truncate=truncate, measure=measure)


def _keep(spec: ModelSpec, text: CorpusText, capture: Capture, layers: str | None,
          heads: str | None, max_tokens: int | None, truncate: bool,
          warn: Callable[[str], None] | None, measure: str = "weights") -> None:
    from attnviz.cache import capture_key, store

    try:
        key = capture_key(spec, text[0], text[1], max_tokens=max_tokens, truncate=truncate,
                          layers=layers, heads=heads, measure=measure)
        store(key, capture)
    except (OSError, ValueError):
        return
    except AttnvizError as error:
        if warn is not None:
            warn(f"could not keep the capture in the cache ({error.message}); "
                 "use --no-cache to stop trying")


def _run_batch(source: AttentionSource, texts: Sequence[CorpusText], layers: str | None,
               heads: str | None, max_tokens: int | None, truncate: bool,
               measure: str = "weights") -> list[Capture | InputError]:
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
                                 max_tokens=max_tokens, truncate=truncate, measure=measure))
    except InputError as error:
        if len(texts) == 1:
            return [error]
    extra = {} if measure == "weights" else {"measure": measure}
    results: list[Capture | InputError] = []
    for text, pair in texts:
        try:
            results.append(source.capture(text, pair, layers=layer_list, heads=head_list,
                                          max_tokens=max_tokens, truncate=truncate, **extra))
        except InputError as error:
            results.append(error)
    return results
