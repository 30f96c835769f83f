"""One warm engine: loaded models, the capture cache and the text -> capture step.

Every client goes through a :class:`Session`: the CLI commands, ``export``, ``heads --input``,
``html``, the notebook helpers, the live server and Ray workers. A session keeps the last few
models it loaded (a small LRU, so a second text never reloads the model), looks texts up in the
capture cache before running a model, and applies the layer/head selection and token limits in
one place::

    from attnviz.session import Session
    session = Session()
    cap = session.capture("The cat sat on the mat")            # loads MiniLM once
    cap = session.capture("The dog sat on the rug", layers="5")  # warm: no second load

A command asks one question per request (:class:`~attnviz.request.CaptureRequest`): the
session reads the text or the saved capture, checks the indices against the model's config
before loading it, looks in the cache and captures (:meth:`Session.run`; ``write``, ``run_each``
and ``run_texts`` for ``dump``, ``compare`` and ``--input``).

:func:`default_session` is the process-wide session that :func:`attnviz.capture_text` uses.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast

from attnviz.checks import (  # noqa: F401 - re-exported for callers of the session
    _check_max_tokens,
    _checked_request,
    _resolve,
    _selection_text,
    _selections,
    check_text,
)
from attnviz.errors import AttnvizError, InputError, UsageError
from attnviz.long_session import LongPath
from attnviz.models.specs import (  # noqa: F401 - re-exported for the server and client
    _text_pairs,
    make_spec,
    spec_key,
)

if TYPE_CHECKING:
    from pathlib import Path

    from attnviz.capture import Capture
    from attnviz.long import LongCapture
    from attnviz.long.generate import Generation, Step
    from attnviz.models import AttentionSource, ModelShape, ModelSpec
    from attnviz.models.hf import HFSource
    from attnviz.request import CaptureRequest

Warn = Callable[[str], None]
Selection = str | int | Sequence[int] | None
_T = TypeVar("_T")

_Method = TypeVar("_Method", bound=Callable[..., Any])


def _for_callers(method: _Method) -> _Method:
    """Run a public method with :meth:`Session._messages` (errors named for Python callers)."""
    @functools.wraps(method)
    def wrapper(self: Session, *args: Any, **kwargs: Any) -> Any:
        with self._messages():
            return method(self, *args, **kwargs)

    return cast("_Method", wrapper)


class Session(LongPath):
    """Loaded models (kept warm), the capture cache and the text -> capture step.

    Long inputs: :meth:`capture_long` (and a request with ``long=True``, or ``long=None`` when
    a full capture would not fit) answers with a :class:`~attnviz.long.LongCapture`
    (:mod:`attnviz.long_session`); long captures are not kept in the capture cache.

    Args:
        use_cache: read and write the on-disk capture cache (:mod:`attnviz.cache`).
        max_models: how many loaded models to keep warm; the least recently used is dropped.
        warn: called with warnings (truncation, a cache that cannot be written); default: none.
        on_load: called with the model name before a model is loaded (e.g. to show a spinner);
            it may return a context manager that is held while loading.
        python: errors name keyword arguments (``max_tokens=40``) rather than command-line
            options (``--max-tokens 40``); the command line's own session sets it to False.

    Thread safety: one lock per model serialises forward passes on it (models are not
    re-entrant); one lock per model being loaded makes concurrent requests for it wait for a
    single load, while captures on other models go on.
    """

    def __init__(self, *, use_cache: bool = True, max_models: int = 2,
                 warn: Warn | None = None,
                 on_load: Callable[[str], Any] | None = None, python: bool = True) -> None:
        if isinstance(max_models, bool) or not isinstance(max_models, int) or max_models < 1:
            raise UsageError(f"max_models must be a whole number of at least 1, not "
                             f"{max_models!r:.40}")
        self.use_cache = use_cache
        self.max_models = max_models
        self.warn = warn
        self.on_load = on_load
        self.python = python
        self.loads = 0  # models loaded by this session (tests and benchmarks count them)
        self.forwards = 0  # texts run through a model (cache misses)
        self._models: collections.OrderedDict[str, AttentionSource] = collections.OrderedDict()
        self._model_locks: dict[str, threading.Lock] = {}
        self._loading: dict[str, threading.Lock] = {}  # one per model being loaded now
        self._lock = threading.RLock()
        self._cache_warned: set[str] = set()  # cache warnings are said once per session

    def _messages(self) -> contextlib.AbstractContextManager[None]:
        """Errors raised in the block speak to a Python caller unless this is the CLI's."""
        from attnviz.errors import python_names

        return python_names() if self.python else contextlib.nullcontext()

    # ------------------------------------------------------------------ models
    @_for_callers
    def source(self, model: str | ModelSpec | None = None, **options: Any) -> AttentionSource:
        """The loaded model (from the warm set, or loaded now and kept)."""
        spec = make_spec(model, **options)
        return self._kept(spec_key(spec), functools.partial(self._load, spec))

    def _kept(self, key: str, load: Callable[[], AttentionSource]) -> AttentionSource:
        """The model kept warm under ``key``, or ``load()`` now (one load per key at a time)."""
        with self._lock:
            source = self._warm(key)
            if source is not None:
                return source
            loading = self._loading.setdefault(key, threading.Lock())
        # One load per model at a time, outside the session lock: a model that takes
        # minutes to load does not hold up captures on the models that are warm already.
        with loading:
            try:
                with self._lock:
                    source = self._warm(key)
                if source is not None:
                    return source
                source = load()
                with self._lock:
                    self._models[key] = source
                    self._model_locks.setdefault(key, threading.Lock())
                    while len(self._models) > self.max_models:
                        old, _ = self._models.popitem(last=False)
                        self._model_locks.pop(old, None)
                return source
            finally:
                with self._lock:
                    if self._loading.get(key) is loading:
                        del self._loading[key]

    def _warm(self, key: str) -> AttentionSource | None:
        source = self._models.get(key)
        if source is not None:
            self._models.move_to_end(key)
        return source

    def is_loading(self, model: str | ModelSpec | None = None, **options: Any) -> bool:
        """Whether the model is being loaded right now (by another thread)."""
        return spec_key(make_spec(model, **options)) in self._loading

    def is_loaded(self, model: str | ModelSpec | None = None, **options: Any) -> bool:
        """Whether the model is warm in this session."""
        return spec_key(make_spec(model, **options)) in self._models

    def forget(self, model: str | ModelSpec | None = None) -> None:
        """Drop one loaded model (or all with ``None``) so its memory can be freed."""
        with self._lock:
            if model is None:
                self._models.clear()
                self._model_locks.clear()
                return
            key = spec_key(make_spec(model))
            for kept in (key, "generate " + key):  # the model with its language-model head too
                self._models.pop(kept, None)
                self._model_locks.pop(kept, None)

    def _load(self, spec: ModelSpec, *, causal_lm: bool = False) -> AttentionSource:
        from attnviz.models import TOY_MODEL, load_source

        load: Callable[[ModelSpec], AttentionSource] = load_source
        if causal_lm:  # generate: the model with its language-model head and fused kernel
            from attnviz.long.generate import load_causal_lm as load
        if spec.trust_remote_code and spec.name != TOY_MODEL and self.warn is not None:
            self.warn(f"--trust-remote-code is on: Python code that comes with the model "
                      f"{spec.name} will run on this machine with your permissions; use it "
                      "only for models whose code you trust")
        context = self.on_load(spec.name) if (self.on_load is not None
                                              and spec.name != TOY_MODEL) else None
        if context is not None and hasattr(context, "__enter__"):
            with context:
                source = load(spec)
        else:
            source = load(spec)
        self.loads += 1
        return source

    @contextlib.contextmanager
    def announcing(self, on_load: Callable[[str], Any] | None) -> Iterator[None]:
        """Use ``on_load`` instead of the session's own while the block runs.

        Export uses it to show "Loading..." in its own progress display, which a spinner of
        the CLI session would clash with.
        """
        previous = self.on_load
        self.on_load = on_load
        try:
            yield
        finally:
            self.on_load = previous

    def _spec(self, model: str | ModelSpec | None, **options: Any) -> ModelSpec:
        """The checked spec of a model name and options (:func:`make_spec`)."""
        return make_spec(model, **options)

    def _forward_lock(self, spec: ModelSpec) -> threading.Lock:
        with self._lock:
            return self._model_locks.setdefault(spec_key(spec), threading.Lock())

    # ------------------------------------------------------------------ shapes
    @_for_callers
    def shape(self, model: str | ModelSpec | None = None, **options: Any) -> ModelShape | None:
        """Layers and heads of a model: from the warm model, else read from its config file.

        Never loads weights; ``None`` when the shape cannot be known without loading (see
        :func:`attnviz.models.model_shape`).
        """
        from attnviz.models import ModelShape, model_shape

        spec = make_spec(model, **options)
        source = self._models.get(spec_key(spec))
        if source is not None:
            return ModelShape(source.num_layers, source.num_heads)
        return model_shape(spec)

    @_for_callers
    def validate(self, model: str | ModelSpec | None = None, *, layers: Selection = None,
                 heads: Selection = None, layer: int | None = None, head: int | None = None,
                 **options: Any) -> None:
        """Check layer/head indices and selections against the model before loading it.

        The model's size comes from :meth:`shape` (its ``config.json``), so ``--layer 9`` on a
        6-layer model fails at once instead of after loading the weights. When the size cannot
        be read without loading, nothing is checked here: the capture checks after loading.

        Raises:
            UsageError: an index or selection is out of range; the message gives the range.
            ModelLoadError: the model names a folder that does not exist.
        """
        from attnviz.selection import parse_selection, resolve_index

        shape = self.shape(model, **options)
        if shape is None:
            return
        layer_text, head_text = _selections(layers, heads)
        if layer_text:
            parse_selection(layer_text, shape.num_layers, "layer")
        if head_text:
            parse_selection(head_text, shape.num_heads, "head")
        if layer is not None:
            resolve_index(layer, shape.num_layers, "layer")
        if head is not None:
            resolve_index(head, shape.num_heads, "head")

    # ------------------------------------------------------------------ captures
    @_for_callers
    def capture(self, text: str, pair: str | None = None, *,
                model: str | ModelSpec | None = None, layers: Selection = None,
                heads: Selection = None, max_tokens: int | None = None,
                truncate: bool = True, use_cache: bool | None = None,
                write_cache: bool = True, measure: str = "weights", **options: Any) -> Capture:
        """Capture the attention of ``model`` on ``text`` (and ``pair``).

        Args:
            text: the input text; ``pair`` the optional second sentence.
            model: a model name (``"minilm"``, ``"toy"``, a hub id, a folder) or a
                :class:`~attnviz.models.ModelSpec`; default: ``$ATTNVIZ_MODEL`` or MiniLM.
            layers: layers to keep, as ``"0,2-4"`` or a list of ints (``None``: all).
            heads: heads to keep, likewise.
            max_tokens: token limit; ``truncate`` whether to cut past it (with a warning in
                ``capture.meta["warnings"]``) or raise :class:`~attnviz.errors.InputError`.
            use_cache: read the capture cache (default: the session's ``use_cache``).
            write_cache: keep a fresh capture in the cache.
            measure: ``weights`` (attention) or a measure of :mod:`attnviz.measures`
                (``norm``, ``norm-res-ln``, ``alti``, ``value-zeroing``); each is cached
                under its own key and named in ``capture.meta["measure"]``.
            **options: model options of :class:`~attnviz.models.ModelSpec` (``device``,
                ``dtype``, ``revision``, ``toy``...).

        Returns:
            The capture, weights ``[layer, head, query, key]``.
        """
        def forward(source: AttentionSource, layer_list: list[int] | None,
                    head_list: list[int] | None) -> tuple[Capture, Capture]:
            capture = source.capture(text, pair, layers=layer_list, heads=head_list,
                                     max_tokens=max_tokens, truncate=truncate,
                                     **_measure_option(measure))
            return capture, capture

        return self._run(text, pair, model=model, layers=layers, heads=heads,
                         max_tokens=max_tokens, truncate=truncate, use_cache=use_cache,
                         write_cache=write_cache, options=options, forward=forward,
                         from_cache=lambda hit: hit, measure=measure)

    @_for_callers
    def dump(self, text: str, path: Path | str, pair: str | None = None, *,
             model: str | ModelSpec | None = None, layers: Selection = None,
             heads: Selection = None, max_tokens: int | None = None, truncate: bool = True,
             float16: bool = False, use_cache: bool | None = None, write_cache: bool = True,
             measure: str = "weights", **options: Any) -> tuple[Path, Capture]:
        """Capture ``text`` and write the record to ``path`` (what ``attnviz dump`` does).

        A capture in the cache is written from there, without loading the model. Otherwise the
        model runs and each layer goes straight into the memory-mapped ``.npy``
        (:func:`attnviz.stream.stream_capture`), so a capture bigger than memory can be
        written; a float32 capture is then kept in the cache (a ``float16`` one is not: its
        weights are rounded).

        Args:
            text, pair, model, layers, heads, max_tokens, truncate, use_cache, write_cache,
                measure, **options: as in :meth:`capture`.
            path: a folder (gets ``attention.npy`` + ``capture.json``) or a ``.npy`` path.
            float16: store the weights as float16.

        Returns:
            The written ``.npy`` path and the capture.
        """
        from attnviz.stream import stream_capture, write_capture

        def forward(source: AttentionSource, layer_list: list[int] | None,
                    head_list: list[int] | None) -> tuple[tuple[Path, Capture], Capture]:
            written = stream_capture(source, text, path, pair=pair, layers=layer_list,
                                     heads=head_list, max_tokens=max_tokens,
                                     truncate=truncate, float16=float16,
                                     **_measure_option(measure))
            return written, written[1]

        def from_cache(hit: Capture) -> tuple[Path, Capture]:
            return write_capture(hit, path, float16=float16), hit

        return self._run(text, pair, model=model, layers=layers, heads=heads,
                         max_tokens=max_tokens, truncate=truncate, use_cache=use_cache,
                         write_cache=write_cache and not float16, options=options,
                         forward=forward, from_cache=from_cache, measure=measure)

    # ------------------------------------------------------------------ requests
    @_for_callers
    def check(self, request: CaptureRequest) -> None:
        """Check a request's selections and indices against the model's config before any
        weights load (:meth:`validate`); a saved capture is checked when it is read.

        Raises:
            UsageError: a selection or index out of range (``start_layer``'s named
                ``--start-layer``).
            ModelLoadError: the model names a folder that does not exist.
        """
        if request.from_path is not None:
            return
        from attnviz.models._measure import check_measure_for

        check_measure_for(make_spec(request.model).name, request.measure)
        self.validate(request.model, layers=request.layers, heads=request.heads,
                      layer=request.layer, head=request.head)
        if request.start_layer is not None:
            try:
                self.validate(request.model, layer=request.start_layer)
            except UsageError as error:  # "layer 10" alone would read like --layer
                if not error.message.startswith("layer "):
                    raise
                raise UsageError(f"--start-layer: {error.message}", error.hint) from None

    @_for_callers
    def run(self, request: CaptureRequest) -> Capture | LongCapture:
        """Answer one request (:mod:`attnviz.request`): the capture a command works on.

        Checks the request against the model's config (:meth:`check`), reads the saved
        capture (keeping the request's layers and heads of it) or the text (standard input
        when asked), captures the text (from the capture cache, else the model; its warnings
        go to ``warn``) and checks ``layer`` and ``head`` against the capture.

        A request with ``long=True`` (or ``long=None`` and a full capture too big for
        :func:`~attnviz.long_session.max_full_bytes`) is answered with a long capture, as is a
        ``from_path`` that holds one (``attnviz dump --long``).

        Returns:
            The capture, weights ``[layer, head, query, key]``; or a
            :class:`~attnviz.long.LongCapture`.

        Raises:
            UsageError: no input, or an index out of range or not in the capture.
            InputError: an empty or unusable text or pair.
            DumpError: the saved capture is missing or damaged.
        """
        self.check(request)
        if request.from_path is not None:
            from attnviz.long_session import is_long_folder

            if is_long_folder(request.from_path):
                return self._saved_long(request)
            return self._answer(request)
        if request.long is False:
            return self._answer(request)
        text, pair = self._texts(request)
        request = self.narrowed(dataclasses.replace(request, text=text, stdin=False), text, pair)
        if not self.wants_long(request, text, pair):
            return self._answer(request)
        cap = self.answer_long(request, text, pair)
        self._check_indices(cap, request)
        return cap

    def run_full(self, request: CaptureRequest) -> Capture:
        """:meth:`run` for the commands that need every weight (``rollout``): always the full
        capture.

        Raises:
            UsageError: ``from_path`` holds a long capture.
        """
        from attnviz.capture import Capture

        cap = self.run(dataclasses.replace(request, long=False))
        if not isinstance(cap, Capture):
            raise UsageError(f"{request.from_path} holds a long capture (queries and keys), "
                             "and this command needs every weight at once",
                             "use heatmap, top-k or heads on it, or dump the text without "
                             "--long")
        return cap

    @_for_callers
    def run_each(self, requests: Sequence[CaptureRequest]) -> list[Capture]:
        """Answer several requests (:meth:`run`), every one checked before any model loads."""
        for request in requests:
            self.check(request)
        return [self._answer(request) for request in requests]

    @_for_callers
    def write(self, request: CaptureRequest, path: Path | str, *, float16: bool = False
              ) -> tuple[Path, Capture | LongCapture]:
        """Answer a request as :meth:`run` and write the record to ``path`` (``attnviz dump``).

        A saved capture is read memory-mapped; a text goes through :meth:`dump` (from the
        cache, else streamed layer by layer into the file). A long capture (``request.long``,
        see :meth:`run`) is written into the folder ``path`` as it is captured.

        Returns:
            The written ``.npy`` path (a long capture: its folder) and the capture.
        """
        self.check(request)
        if request.from_path is not None:
            from attnviz.long_session import is_long_folder

            if is_long_folder(request.from_path):
                return self.write_long(self._saved_long(request), path, float16=float16)
            from attnviz.stream import write_capture

            capture = self._saved(request, mmap=True)
            return write_capture(capture, path, float16=float16), capture
        text, pair = self._texts(request)
        if request.long is not False and self.wants_long(request, text, pair, dumping=True):
            return self.dump_long(request, text, pair, path, float16=float16)
        written = self.dump(text, path, pair, model=request.model, layers=request.layers,
                            heads=request.heads, max_tokens=request.max_tokens,
                            truncate=request.truncate, float16=float16,
                            use_cache=request.use_cache and self.use_cache,
                            measure=request.measure or "weights")
        self._say(written[1])
        return written

    def run_texts(self, request: CaptureRequest, texts: Sequence[tuple[str, str | None]], *,
                  batch_size: int = 1) -> Iterator[Capture | InputError]:
        """Capture many texts with the request's model, selection and limits (its own input
        is not used): one capture or :class:`InputError` per ``(text, pair)``, in order.

        ``batch_size`` above 1 runs padded batches (:meth:`captures`); 1 captures the texts
        one by one. The captures' warnings stay in ``capture.meta["warnings"]``, for the caller
        to say which text each is about.
        """
        from attnviz.errors import named_for_python

        def check(text: str, pair: str | None) -> None:
            check_text(text)
            if pair is not None:
                check_text(pair, "the pair text")

        if batch_size > 1:
            yield from self.captures(texts, model=request.model, batch_size=batch_size,
                                     layers=request.layers, heads=request.heads,
                                     max_tokens=request.max_tokens, truncate=request.truncate,
                                     use_cache=request.use_cache and self.use_cache,
                                     check=check, measure=request.measure or "weights")
            return
        for text, pair in _text_pairs(texts):
            try:
                check(text, pair)
                yield self.capture(text, pair, model=request.model, layers=request.layers,
                                   heads=request.heads, max_tokens=request.max_tokens,
                                   truncate=request.truncate,
                                   use_cache=request.use_cache and self.use_cache,
                                   measure=request.measure or "weights")
            except InputError as error:
                yield named_for_python(error) if self.python else error

    def _answer(self, request: CaptureRequest) -> Capture:
        """:meth:`run` after :meth:`check`."""
        if request.from_path is not None:
            capture = self._saved(request)
        else:
            text, pair = self._texts(request)
            capture = self.capture(text, pair, model=request.model, layers=request.layers,
                                   heads=request.heads, max_tokens=request.max_tokens,
                                   truncate=request.truncate,
                                   use_cache=request.use_cache and self.use_cache,
                                   measure=request.measure or "weights")
            self._say(capture)
        if request.layer is not None:
            capture.layer_position(request.layer)
        if request.head is not None:
            capture.head_position(request.head)
        return capture

    @staticmethod
    def _texts(request: CaptureRequest) -> tuple[str, str | None]:
        """The request's text (standard input read now) and pair, checked."""
        text = request.input_text()
        check_text(text)
        if request.pair is not None:
            check_text(request.pair, "the --pair text")
        return text, request.pair

    @staticmethod
    def _saved(request: CaptureRequest, *, mmap: bool = False) -> Capture:
        """The saved capture of ``request.from_path``, cut to the request's layers and heads."""
        from attnviz.capture import load_capture
        from attnviz.selection import parse_selection

        capture = load_capture(cast("Path", request.from_path), mmap=mmap)
        if request.measure is not None and request.measure != capture.measure:
            raise UsageError(f"{request.from_path} holds the measure {capture.measure}, not "
                             f"{request.measure}",
                             f"drop --measure to show what it holds, or capture the text again "
                             f"with --measure {request.measure}")
        if request.layers is not None or request.heads is not None:
            capture = capture.select(
                parse_selection(request.layers, capture.num_layers, "layer")
                if request.layers else None,
                parse_selection(request.heads, capture.num_heads, "head")
                if request.heads else None)
        return capture

    def _say(self, capture: Capture) -> None:
        """Pass a fresh capture's warnings (a truncated text) on to ``warn``."""
        if self.warn is not None:
            for message in capture.meta.get("warnings", []):
                self.warn(str(message))

    def _run(self, text: str, pair: str | None, *, model: str | ModelSpec | None,
             layers: Selection, heads: Selection, max_tokens: int | None, truncate: bool,
             use_cache: bool | None, write_cache: bool, options: dict[str, Any],
             forward: Callable[[AttentionSource, list[int] | None, list[int] | None],
                               tuple[_T, Capture]],
             from_cache: Callable[[Capture], _T], measure: str = "weights") -> _T:
        """The steps :meth:`capture` and :meth:`dump` share: check the request, answer from
        the cache (``from_cache``) or validate, load and run ``forward`` under the model's
        forward lock, then keep the fresh capture in the cache (when ``write_cache``)."""
        from attnviz.models._measure import check_measure_for

        spec = make_spec(model, **options)
        measure = check_measure_for(spec.name, measure)
        layer_text, head_text = _checked_request(text, pair, layers, heads, max_tokens)
        cache_on = self.use_cache if use_cache is None else use_cache
        key = ""
        if cache_on:
            from attnviz.cache import find

            hit, key = find(spec, text, pair, layers=layer_text, heads=head_text,
                            max_tokens=max_tokens, truncate=truncate, warn=self._cache_warn,
                            measure=measure)
            if hit is not None:
                return from_cache(hit)
        self.validate(spec, layers=layer_text, heads=head_text)  # before loading the weights
        source = self.source(spec)
        layer_list, head_list = _resolve(source, layer_text, head_text)
        with self._forward_lock(spec):
            result, capture = forward(source, layer_list, head_list)
            self.forwards += 1
        if key and write_cache:
            self._keep(key, capture)
        return result

    def captures(self, texts: Sequence[tuple[str, str | None]], *,
                 model: str | ModelSpec | None = None, batch_size: int = 8,
                 layers: Selection = None, heads: Selection = None,
                 max_tokens: int | None = None, truncate: bool = True,
                 use_cache: bool | None = None, write_cache: bool = True,
                 check: Callable[[str, str | None], None] | None = None,
                 measure: str = "weights") -> Iterator[Capture | InputError]:
        """One capture or :class:`InputError` per text, in order, in padded batches.

        ``texts`` is a list of strings and/or ``(text, pair)`` tuples.

        Cached texts come from the cache; the others run ``batch_size`` at a time (see
        :func:`attnviz.batches.capture_batches`). ``measure`` as in :meth:`capture` (a measure
        other than weights runs text by text inside each batch).
        """
        from attnviz.errors import named_for_python

        with self._messages():
            for item in self._captures(texts, model=model, batch_size=batch_size,
                                       layers=layers, heads=heads, max_tokens=max_tokens,
                                       truncate=truncate, use_cache=use_cache,
                                       write_cache=write_cache, check=check,
                                       measure=measure):
                yield named_for_python(item) if self.python and isinstance(
                    item, InputError) else item

    def _captures(self, texts: Sequence[tuple[str, str | None]], *,
                  model: str | ModelSpec | None, batch_size: int, layers: Selection,
                  heads: Selection, max_tokens: int | None, truncate: bool,
                  use_cache: bool | None, write_cache: bool,
                  check: Callable[[str, str | None], None] | None, measure: str = "weights"
                  ) -> Iterator[Capture | InputError]:
        from attnviz.batches import capture_batches
        from attnviz.models._measure import check_measure_for

        spec = make_spec(model)
        measure = check_measure_for(spec.name, measure)
        texts = _text_pairs(texts)
        layer_text, head_text = _selections(layers, heads)
        _check_max_tokens(max_tokens)
        self.validate(spec, layers=layer_text, heads=head_text)  # before loading the weights
        cache_on = self.use_cache if use_cache is None else use_cache

        def load() -> AttentionSource:
            # The lock is looked up on every pass: another thread may have evicted and
            # reloaded the model since the last one, and the reloaded model has a new lock.
            return _Locked(self.source(spec), functools.partial(self._forward_lock, spec), self)

        from attnviz.cache import warnings_to

        with warnings_to(self._cache_warn):
            yield from capture_batches(spec, texts, load=load, batch_size=batch_size,
                                       layers=layer_text,
                                       heads=head_text, max_tokens=max_tokens,
                                       truncate=truncate, use_cache=cache_on, write=write_cache,
                                       check=check, warn=self._cache_warn, measure=measure)

    @_for_callers
    def generate(self, prompt: str, *, model: str | ModelSpec | None = None,
                 max_new_tokens: int = 20, sample: bool = False, seed: int | None = None,
                 layers: Selection = None, heads: Selection = None,
                 max_tokens: int | None = None, truncate: bool = True,
                 on_step: Callable[[Step], None] | None = None,
                 **options: Any) -> Generation:
        """Generate after ``prompt`` with the KV cache and the model's own kernel, recording
        each generated token's attention rows (:mod:`attnviz.long.generate`).

        Args:
            prompt: the text to continue.
            model: a decoder-only causal language model (name, folder or spec); the model
                with its head is kept warm beside the captures' models.
            max_new_tokens: at most this many tokens (1 to 4096); fewer at end of sequence.
            sample: sample instead of greedy decoding; ``seed`` repeats a sample.
            layers: layers to record, as ``"0,2-4"`` or a list (``None``: all); ``heads`` too.
            max_tokens: a limit on the prompt's tokens; ``truncate`` cuts past it.
            on_step: called with each :class:`~attnviz.long.generate.Step` as it comes.
            **options: model options of :class:`~attnviz.models.ModelSpec`.

        Returns:
            The :class:`~attnviz.long.generate.Generation`: tokens, text and rows
            ``[layer, head, step, key]``.
        """
        from attnviz.long.generate import check_causal_lm, check_max_new_tokens, generate

        spec = make_spec(model, **options)
        layer_text, head_text = _checked_request(prompt, None, layers, heads, max_tokens)
        check_max_new_tokens(max_new_tokens)
        check_causal_lm(spec)  # from config.json, before any weights load
        self.validate(spec, layers=layer_text, heads=head_text)
        key = "generate " + spec_key(spec)
        source = self._kept(key, functools.partial(self._load, spec, causal_lm=True))
        layer_list, head_list = _resolve(source, layer_text, head_text)
        with self._lock:
            lock = self._model_locks.setdefault(key, threading.Lock())
        with lock:
            result = generate(cast("HFSource", source), prompt,
                              max_new_tokens=max_new_tokens, sample=sample, seed=seed,
                              layers=layer_list, heads=head_list, max_tokens=max_tokens,
                              truncate=truncate, on_step=on_step)
            self.forwards += 1
        if self.warn is not None:
            for message in result.meta.get("warnings", []):
                self.warn(str(message))
        return result

    def _cache_warn(self, message: str) -> None:
        """Pass a cache warning on once: a corpus of damaged entries or an unwritable cache
        folder would otherwise repeat it for every text."""
        if self.warn is None or message in self._cache_warned:
            return
        self._cache_warned.add(message)
        self.warn(message)

    def _keep(self, key: str, capture: Capture) -> None:
        """Store a fresh capture under the key its cache lookup computed."""
        from attnviz.cache import store

        try:
            store(key, capture)
        except OSError:
            return
        except AttnvizError as error:
            self._cache_warn(f"could not keep the capture in the cache ({error.message}); "
                             "use --no-cache to stop trying")


def _measure_option(measure: str) -> dict[str, str]:
    """``measure=`` for a source's capture, left out for attention weights (sources that
    know no measures keep working)."""
    from attnviz.measures import check_measure

    name = check_measure(measure or "weights")
    return {} if name == "weights" else {"measure": name}


class _Locked:
    """A loaded model whose forward passes hold the session's per-model lock (``lock()``
    gives the model's current lock)."""

    def __init__(self, source: AttentionSource, lock: Callable[[], threading.Lock],
                 session: Session) -> None:
        self._source = source
        self._lock = lock
        self._session = session
        self.name = source.name
        self.num_layers = source.num_layers
        self.num_heads = source.num_heads
        batched = getattr(source, "iter_captures", None)
        if callable(batched):
            def iter_captures(texts: Sequence[str], *args: Any, **kwargs: Any
                              ) -> Iterator[Capture]:
                with self._lock():
                    captures = list(batched(texts, *args, **kwargs))
                    self._session.forwards += len(captures)
                yield from captures

            self.iter_captures = iter_captures

    def __getattr__(self, name: str) -> Any:
        return getattr(self._source, name)

    def capture(self, *args: Any, **kwargs: Any) -> Capture:
        with self._lock():
            self._session.forwards += 1
            return self._source.capture(*args, **kwargs)

    def identity(self) -> dict[str, object]:
        return self._source.identity()


_DEFAULT: Session | None = None
_DEFAULT_LOCK = threading.Lock()


def default_session() -> Session:
    """The process-wide session (created on first use) behind :func:`attnviz.capture_text`."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None:
            _DEFAULT = Session()
        return _DEFAULT


__all__ = ["Session", "default_session", "make_spec", "spec_key", "check_text", "InputError"]
