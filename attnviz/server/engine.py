"""What the live server does, without HTTP: checked requests, the served models, bounded queues,
recent captures in memory and the JSON payloads of the API.

Every request body is read through its pydantic model (:mod:`attnviz.server.requests`), which
knows each field's type and bound and refuses fields it does not know, so no request can name a
file, a folder or a model the server was not started with. The capture itself goes through a
:class:`~attnviz.session.Session` (warm models, one forward at a time per model); the
:class:`Engine` adds what a shared server needs on top: a bound on the requests waiting for
each model, limits on text and tokens, and a small in-memory cache of recent captures so that
the page's follow-up requests (top-k, a token's row, a download) do not run the model again.
"""

from __future__ import annotations

import base64
import collections
import io
import json
import math
import threading
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, cast

from attnviz.errors import DeviceError, ModelLoadError, UsageError
from attnviz.server.requests import (
    TOY_BOUNDS,
    TOY_EXAMPLE,
    WEIGHT_FORMATS,
    ApiError,
    CaptureRequest,
    ExplainRequest,
    TopkRequest,
    ToyRequest,
    json_type,
)

if TYPE_CHECKING:
    from attnviz.capture import Capture
    from attnviz.models import ModelSpec
    from attnviz.models.toy import ToyConfig
    from attnviz.session import Session

__all__ = ["TOY_BOUNDS", "TOY_EXAMPLE", "WEIGHT_FORMATS", "ApiError", "CaptureParams", "Engine",
           "Limits", "json_type"]

TOPK_CSV_HEADER = ("query_index", "query", "rank", "key_index", "key", "weight")


@dataclass(frozen=True)
class Limits:
    """Bounds on what one request may ask of the server."""

    max_body_bytes: int = 256 * 1024  # the request body, as sent
    max_chars: int = 20_000  # characters of text plus pair
    max_tokens: int = 512  # tokens per capture (the model's own limit applies as well)
    queue: int = 8  # requests waiting for a model behind the one it is running
    timeout_s: float = 60.0  # waiting plus running, before the request gets a 503
    max_weights: int = 1 << 25  # weights in one response (72 heads x 512^2 is 18.9 M)
    cache_mb: int = 256  # recent captures kept in memory
    max_k: int = 100  # top-k keys per query
    long_max_tokens: int = 131072  # tokens of a long capture (/api/long/capture)
    long_max_chars: int = 2_000_000  # characters of a long capture's text plus pair
    long_max_weights: int = 1 << 22  # values in one long answer (a tile, an atlas, a top-k)
    long_keep: int = 4  # long captures kept (each a folder of queries, keys, log-sum-exp)

    def check(self) -> None:
        """Raise :class:`UsageError` for a bound that leaves nothing to serve."""
        for name in ("max_body_bytes", "max_chars", "max_tokens", "max_weights", "max_k",
                     "long_max_tokens", "long_max_chars", "long_max_weights", "long_keep"):
            if getattr(self, name) < 1:
                raise UsageError(f"the server's {name} must be at least 1")
        if self.queue < 0:
            raise UsageError(f"--queue must be 0 or more, got {self.queue}")
        if not self.timeout_s > 0:
            raise UsageError(f"--timeout must be more than 0 seconds, got {self.timeout_s}")
        if self.cache_mb < 0:
            raise UsageError(f"the capture cache size must be 0 or more, got {self.cache_mb}")

    def public(self) -> dict[str, Any]:
        return asdict(self)


# --------------------------------------------------------------------------- captures in memory
class CaptureCache:
    """Recent captures, least recently used out first, bounded by the bytes of their weights."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._items: collections.OrderedDict[tuple[Any, ...], Capture] = (
            collections.OrderedDict())
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: tuple[Any, ...]) -> Capture | None:
        with self._lock:
            capture = self._items.get(key)
            if capture is not None:
                self._items.move_to_end(key)
            return capture

    def put(self, key: tuple[Any, ...], capture: Capture) -> None:
        size = int(capture.weights.nbytes)
        if size > self.max_bytes:
            return
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._bytes -= int(old.weights.nbytes)
            self._items[key] = capture
            self._bytes += size
            while self._bytes > self.max_bytes and self._items:
                _, dropped = self._items.popitem(last=False)
                self._bytes -= int(dropped.weights.nbytes)

    def __len__(self) -> int:
        return len(self._items)


@dataclass(frozen=True)
class CaptureParams:
    """A checked capture request."""

    spec: ModelSpec
    text: str
    pair: str | None
    layers: str | None
    heads: str | None
    max_tokens: int
    truncate: bool

    @property
    def model_key(self) -> str:
        from attnviz.session import spec_key

        return spec_key(self.spec)

    def cache_key(self) -> tuple[Any, ...]:
        return (self.model_key, self.text, self.pair, self.layers, self.heads, self.max_tokens,
                self.truncate)


# --------------------------------------------------------------------------- the engine
class Engine:
    """The served models, their queues and the capture step, shared by every request.

    Args:
        models: the model names requests may use (``minilm``, ``toy``, a hub id or a folder
            given when the server starts); the first is the default. Each loads on first use
            or with :meth:`load` (``attnviz serve`` loads them all before it answers).
        allow_any_model: also load any hub id or folder a request names.
        limits: bounds on requests (:class:`Limits`).
        session: the warm engine (default: a new one without the on-disk capture cache).
        device: device of the models (``auto``, ``cpu``, ``cuda``...); dtype likewise.
    """

    def __init__(self, models: Sequence[str] = (), *, allow_any_model: bool = False,
                 limits: Limits | None = None, session: Session | None = None,
                 device: str = "auto", dtype: str = "float32") -> None:
        from attnviz.models import default_model

        names = [str(m).strip() for m in models if str(m).strip()] or [default_model()]
        self.models = list(dict.fromkeys(names))
        self.allow_any_model = allow_any_model
        self.limits = limits or Limits()
        self.limits.check()
        if session is None:
            from attnviz.session import Session

            # Toy variants (causal, scale) are separate entries: leave room for them.
            session = Session(use_cache=False, max_models=len(self.models) + 4, python=False)
        self.session = session
        self.device = device
        self.dtype = dtype
        self.captures = CaptureCache(self.limits.cache_mb << 20)
        self.load_errors: dict[str, str] = {}
        # Induction runners by model key, with the loaded model each was made for (see
        # _induction_runner): at most as many as the session keeps models.
        self._runners: collections.OrderedDict[
            str, tuple[Any, tuple[Any, Any, list[int], int | None]]] = collections.OrderedDict()
        self._runners_lock = threading.Lock()
        self._pending: collections.Counter[str] = collections.Counter()
        self._pending_lock = threading.Lock()
        self.max_pending = max(4, 4 * (self.limits.queue + 1))  # all models together

    # ------------------------------------------------------------------ models
    def model_name(self, name: str | None) -> str:
        """The served model a request names (``None``: the default), or a 404."""
        if name is None:
            return self.models[0]
        if name in self.models:
            return name
        if self.allow_any_model and name.strip() and "\x00" not in name:
            return name.strip()
        raise ApiError(404, f"model {name!r} is not served here: this server has "
                            f"{', '.join(self.models)}"[:400],
                       "pick one of those, or start the server with --model NAME "
                       "(or --allow-any-model)")

    @staticmethod
    def toy_config(toy: ToyRequest | None) -> ToyConfig:
        """The toy model's settings: the request's, the toy model's defaults for the rest."""
        from attnviz.models.toy import ToyConfig

        return ToyConfig(**(toy.model_dump(exclude_none=True) if toy is not None else {}))

    def spec(self, model: str | None, toy: ToyRequest | None = None) -> ModelSpec:
        """The model a request names (``model``, and ``toy`` options for the toy model)."""
        from attnviz.models import TOY_MODEL, ModelSpec

        name = self.model_name(model)
        if toy is not None and name != TOY_MODEL:
            raise ApiError(422, "'toy' options are for the toy model only",
                           'leave them out, or send "model": "toy"')
        config = self.toy_config(toy) if name == TOY_MODEL else None
        return ModelSpec(name=name, device=self.device, dtype=self.dtype, toy=config)

    def default_spec(self, name: str) -> ModelSpec:
        """A served model as it loads without options (the toy model with its defaults)."""
        return self.spec(name)

    def describe(self, spec: ModelSpec) -> dict[str, Any]:
        """Load the model (if it is not warm yet) and say what it is.

        ``induction`` says how to run the induction test through :meth:`induction` (the number
        of usable token ids, the prefix ids and the model's token limit), when it can run.
        """
        source = self._source(spec)
        info = {"name": spec.name, "num_layers": int(source.num_layers),
                "num_heads": int(source.num_heads), "toy": spec.toy is not None,
                "identity": _plain(source.identity())}
        try:
            _, vocab, prefix, max_tokens = self._induction_runner(spec)
        except UsageError:
            return info
        info["induction"] = {"vocab_size": int(len(vocab)), "prefix": [int(i) for i in prefix],
                             "max_tokens": None if max_tokens is None else int(max_tokens)}
        return info

    def _induction_runner(self, spec: ModelSpec) -> tuple[Any, Any, list[int], int | None]:
        """The induction test's runner of a model, kept while the session keeps the model.

        A runner holds its model: the runners of models the session has dropped go too, so
        the toy settings requests name cannot pile up models in memory.
        """
        from attnviz.analysis.induction import _runner
        from attnviz.session import spec_key

        key = spec_key(spec)
        source = self._source(spec)
        with self._runners_lock:
            kept = self._runners.get(key)
            if kept is not None and kept[0] is source:
                self._runners.move_to_end(key)
                return kept[1]
        run, vocab, prefix, max_tokens = _runner(source)
        runner = (run, vocab, [int(i) for i in prefix], max_tokens)
        with self._runners_lock:
            self._runners[key] = (source, runner)
            self._runners.move_to_end(key)
            warm = self.session._models  # the session's loaded models, by key
            for old in [k for k, (s, _) in self._runners.items() if warm.get(k) is not s]:
                if old != key:
                    del self._runners[old]
            while len(self._runners) > self.session.max_models:
                self._runners.popitem(last=False)
        return runner

    def induction(self, spec: ModelSpec, ids: list[int]) -> Any:
        """``[layer, head, T, T]`` of the model on its prefix ids followed by token *positions*
        in its list of usable tokens (what :func:`attnviz.analysis.induction.induction_scores`
        runs; the ``--server`` client draws the positions exactly as a local run draws ids)."""
        run, vocab, prefix, max_tokens = self._induction_runner(spec)
        count = len(prefix)
        limit = min(self.limits.max_tokens, max_tokens or self.limits.max_tokens)
        if len(ids) > limit:
            raise ApiError(422, f"'ids' holds {len(ids)} tokens, more than {limit}")
        if ids[:count] != prefix:
            raise ApiError(422, f"'ids' must start with the model's prefix ids {prefix}")
        positions = ids[count:]
        if not positions or any(not 0 <= i < len(vocab) for i in positions):
            raise ApiError(422, f"'ids' after the prefix must be positions 0..{len(vocab) - 1} "
                                "in the model's usable tokens")
        real = prefix + [int(vocab[i]) for i in positions]
        # The session's per-model lock: one forward at a time on a model.
        with self.session._forward_lock(spec):
            return run(real)

    def _source(self, spec: ModelSpec) -> Any:
        try:
            source = self.session.source(spec)
        except (ModelLoadError, DeviceError) as error:
            if spec.name in self.models:  # listed by /api/models; any other name is not kept
                self.load_errors[spec.name] = error.message
            raise
        self.load_errors.pop(spec.name, None)
        return source

    def load(self, name: str) -> str | None:
        """Load a served model now (``attnviz serve`` does so before it answers); the error
        message when it cannot be loaded (kept for ``/api/models``, tried again on use)."""
        try:
            self._source(self.default_spec(name))
        except (ModelLoadError, DeviceError) as error:
            return error.message
        return None

    def ready(self) -> bool:
        """Whether every served model is loaded (``/api/health``'s ``ready``)."""
        return all(self.session.is_loaded(self.default_spec(name)) for name in self.models)

    def models_payload(self) -> dict[str, Any]:
        """The served models: loaded or not, their size once loaded, the last load error."""
        from attnviz.models import TOY_MODEL

        entries = []
        for name in self.models:
            spec = self.default_spec(name)
            entry: dict[str, Any] = {"name": name, "toy": name == TOY_MODEL,
                                     "loaded": self.session.is_loaded(spec)}
            if entry["loaded"]:
                source = self.session.source(spec)
                entry.update(num_layers=int(source.num_layers), num_heads=int(source.num_heads))
            if name in self.load_errors:
                entry["error"] = self.load_errors[name]
            entries.append(entry)
        return {"models": entries, "default": self.models[0],
                "allow_any_model": self.allow_any_model, "limits": self.limits.public()}

    # ------------------------------------------------------------------ queue
    def admit(self, key: str) -> Callable[[], None]:
        """Take a place in the model's queue, or raise a 503 when it is full.

        Returns the function that gives the place back (call it once the work has finished,
        even when the client has stopped waiting).
        """
        with self._pending_lock:
            waiting = self._pending[key]
            if waiting >= self.limits.queue + 1 or sum(self._pending.values()) >= self.max_pending:
                raise ApiError(503, f"the server is busy: {waiting} request(s) are already "
                                    "running or waiting for this model",
                               "try again in a moment (each model queues --queue "
                               f"{self.limits.queue} requests)", kind="AttnvizError",
                               retry_after=1)
            self._pending[key] += 1
        released = threading.Event()

        def release() -> None:
            if released.is_set():
                return
            released.set()
            with self._pending_lock:
                self._pending[key] -= 1
                if self._pending[key] <= 0:
                    del self._pending[key]

        return release

    def pending(self) -> int:
        with self._pending_lock:
            return sum(self._pending.values())

    # ------------------------------------------------------------------ captures
    def capture_params(self, request: CaptureRequest) -> CaptureParams:
        """The capture a request asks for, checked against this server's limits."""
        limits = self.limits
        text, pair = request.text, request.pair
        if len(text) + len(pair or "") > limits.max_chars:
            raise ApiError(413, f"the text and pair are {len(text) + len(pair or ''):,} "
                                f"characters long; this server takes at most "
                                f"{limits.max_chars:,}",
                           "send a shorter text, or start the server with a higher --max-chars",
                           kind="InputError")
        spec = self.spec(request.model, request.toy)
        max_tokens = request.max_tokens
        if max_tokens is not None and max_tokens > limits.max_tokens:
            raise ApiError(422, f"max_tokens {max_tokens} is above this server's limit of "
                                f"{limits.max_tokens} tokens",
                           f"ask for at most {limits.max_tokens}, or start the server with a "
                           "higher --max-tokens")
        return CaptureParams(spec=spec, text=text, pair=pair, layers=request.layers,
                             heads=request.heads, max_tokens=max_tokens or limits.max_tokens,
                             truncate=request.truncate)

    def capture(self, params: CaptureParams) -> Capture:
        """The capture a request asks for: from memory, else from the warm model (blocking)."""
        from attnviz.session import check_text

        key = params.cache_key()
        hit = self.captures.get(key)
        if hit is not None:
            return hit
        check_text(params.text)
        if params.pair is not None:
            check_text(params.pair, "the pair text")
        source = self._source(params.spec)  # load errors are remembered for /api/models
        # Refused before the forward pass when the size is known from the tokens: a capture of
        # 512 tokens on every head of a big model takes gigabytes only to be thrown away.
        self._check_size(source, params)
        capture = self.session.capture(params.text, params.pair, model=params.spec,
                                       layers=params.layers, heads=params.heads,
                                       max_tokens=params.max_tokens, truncate=params.truncate,
                                       use_cache=False)
        shape = capture.weights.shape
        self._refuse_size(capture.num_tokens, shape[0], shape[1])
        self.captures.put(key, capture)
        return capture

    def _refuse_size(self, tokens: int, layers: int, heads: int) -> None:
        size = layers * heads * tokens * tokens
        if size > self.limits.max_weights:
            raise ApiError(422, f"the capture of {tokens} tokens holds {size:,} weights "
                                f"({layers} layers x {heads} heads), more than this server "
                                f"sends ({self.limits.max_weights:,})",
                           "select fewer layers or heads, or fewer tokens with max_tokens")

    def _check_size(self, source: Any, params: CaptureParams) -> None:
        """Refuse a capture that will hold more than ``max_weights``, before it runs."""
        from attnviz.session import _resolve

        layers, heads = _resolve(source, params.layers, params.heads)
        # The tokenizer is not safe to share between threads: count under the model's lock.
        with self.session._forward_lock(params.spec):
            tokens = token_count(source, params.text, params.pair, params.max_tokens,
                                 params.truncate)
        if tokens is not None:
            self._refuse_size(tokens, len(layers) if layers is not None else source.num_layers,
                              len(heads) if heads is not None else source.num_heads)


def token_count(source: Any, text: str, pair: str | None, max_tokens: int | None,
                truncate: bool) -> int | None:
    """The tokens a capture of ``text`` (and ``pair``) will hold, without running the model;
    ``None`` when the source cannot tell (or will refuse the text on its own).

    Raises:
        InputError: the text is empty, or too long with ``truncate`` off (Hugging Face models).
    """
    from attnviz.models.toy import ToySource, split_words

    if isinstance(source, ToySource):
        words = len(split_words(text)) + (len(split_words(pair)) if pair is not None else 0)
        limit = source.max_tokens if max_tokens is None else max_tokens
        return None if words > limit and not truncate else min(words, limit)
    encode = getattr(source, "encode", None)
    if callable(encode):  # Hugging Face models: their tokenizer counts
        encoding, _ = encode(text, pair, max_tokens, truncate)
        return int(encoding["input_ids"].shape[1])
    return None


# --------------------------------------------------------------------------- payloads
def _plain(value: Any) -> Any:
    """A JSON-ready copy (numbers, strings, lists, dicts; anything else as text)."""
    return json.loads(json.dumps(value, default=str))


def encode_float32(weights: Any) -> dict[str, Any]:
    """Exact weights: little-endian float32 bytes, base64-encoded."""
    import numpy as np

    data = np.ascontiguousarray(weights, dtype="<f4")
    return {"encoding": "base64", "dtype": "float32", "byteorder": "little",
            "shape": [int(n) for n in data.shape],
            "data": base64.b64encode(data.tobytes()).decode("ascii")}


def capture_payload(capture: Capture, *, weights: str = "q8", stats: bool = False
                    ) -> dict[str, Any]:
    """The JSON of a capture: its sidecar (``capture.json``), word units, head statistics
    (when asked) and the weights ``[layer, head, query, key]`` in the requested encoding.

    The same record is one document of the HTML report (``attnviz.render.html.doc_data``), so
    the page draws it with the report's own front end.
    """
    from attnviz.render.html import encode_weights, head_stats, word_units

    payload = _plain(capture.sidecar())
    payload["words"] = word_units(capture)
    payload["stats"] = head_stats(capture) if stats else None
    payload["warnings"] = [str(w) for w in capture.meta.get("warnings", [])]
    if weights == "float32":
        payload["weights"] = encode_float32(capture.weights)
    else:
        # The HTML report's block (same quantisation and decoder), compressed for speed: on a
        # live server the time to answer matters more than bytes (see encode_weights' fast).
        payload["weights"] = encode_weights(capture.weights, 16 if weights == "q16" else 8,
                                            fast=True)
    return payload


def decode_float32(block: dict[str, Any]) -> Any:
    """The array of an :func:`encode_float32` block.

    Raises:
        ValueError: the block's shape is not a list of counts, or its data do not hold
            exactly that many float32 values.
    """
    import numpy as np

    shape = block["shape"]
    if not isinstance(shape, list) or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
        raise ValueError(f"the weights' shape must be a list of counts, not {shape!r:.60}")
    raw = base64.b64decode(block["data"], validate=True)
    count = math.prod(shape)
    if count * 4 != len(raw):
        raise ValueError(f"the weights hold {len(raw) // 4} values, not the {count} of shape "
                         f"{shape}"[:200])
    return np.frombuffer(raw, dtype="<f4").reshape(shape).astype(np.float32)


def topk_payload(capture: Capture, params: TopkRequest) -> dict[str, Any]:
    """Top-k keys per query of one head (or the layer's mean), as ``attnviz top-k -f json``.

    With ``params.query``, only that query's row, with every weight of the row as well.
    """
    import numpy as np

    from attnviz.analysis.tokens import token_view, view_notes
    from attnviz.analysis.topk import topk_rows
    from attnviz.selection import resolve_index

    capture.layer_position(params.layer)  # the CLI's messages for a layer or head out of range
    chosen = params.head
    for head in chosen if isinstance(chosen, list) else [chosen]:
        if isinstance(head, int):
            capture.head_position(head)
    view = token_view(capture, words=params.words, exclude_special=params.exclude_special)
    layer = resolve_index(params.layer, view.num_layers, "layer")
    if chosen == "mean":
        matrix, label = view.mean_matrix(params.layer), "mean"
        what = view.mean_label  # as the CLI's title
    elif isinstance(chosen, list):
        heads = sorted({resolve_index(h, view.num_heads, "head") for h in chosen})
        matrix = np.mean([view.matrix(params.layer, h) for h in heads], axis=0)
        label = "mean-" + "-".join(str(h) for h in heads)
        what = f"mean of heads {', '.join(str(h) for h in heads)}"
    else:
        label = str(resolve_index(int(chosen), view.num_heads, "head"))
        matrix, what = view.matrix(params.layer, int(chosen)), f"head {label}"
    notes = view_notes(view)
    title = (f"{view.model}: layer {layer}, {what}"
             + (f" ({', '.join(notes)})" if notes else "") + f", top {params.k}")
    tokens = view.display_tokens
    payload: dict[str, Any] = {"title": title, "k": params.k, "layer": layer, "head": label,
                               "tokens": tokens}
    if params.query is None:
        payload["rows"] = topk_rows(matrix, tokens, params.k, causal=view.causal)
        return payload
    size = view.num_tokens
    if not -size <= params.query < size:
        raise ApiError(422, f"query {params.query} is out of range: the input has {size} "
                            f"token{'s' if size != 1 else ''} (0..{size - 1} or -{size}..-1)"
                       + (" after merging words" if params.words else ""))
    query = params.query % size
    row = np.asarray(matrix[query], dtype=np.float32)
    top = cast("list[dict[str, Any]]",
               topk_rows(matrix[query : query + 1], tokens, params.k, causal=False)[0]["top"])
    if view.causal:
        top = [entry for entry in top if int(entry["key_index"]) <= query]
    payload["row"] = {"query_index": query, "query": tokens[query],
                      "weights": [round(float(w), 6) for w in row], "top": top}
    return payload


def topk_csv(payload: dict[str, Any]) -> str:
    """CSV of a :func:`topk_payload` (the columns of ``attnviz top-k --format csv``)."""
    from attnviz.csvtext import csv_text

    return csv_text(TOPK_CSV_HEADER, (
        [row["query_index"], row["query"], rank, item["key_index"], item["key"],
         f"{item['weight']:.6f}"]
        for row in payload["rows"] for rank, item in enumerate(row["top"], start=1)))


def capture_zip(capture: Capture) -> bytes:
    """A zip of ``attention.npy`` (float32) and ``capture.json``, as ``attnviz dump`` writes."""
    import numpy as np

    from attnviz.capture import JSON_NAME, NPY_NAME

    weights = io.BytesIO()
    np.save(weights, np.ascontiguousarray(capture.weights, dtype=np.float32), allow_pickle=False)
    sidecar = capture.sidecar()
    sidecar["dtype"] = "float32"
    sidecar["weights_file"] = NPY_NAME
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=1) as zf:
        zf.writestr(NPY_NAME, weights.getvalue())
        zf.writestr(JSON_NAME, json.dumps(sidecar, ensure_ascii=False, indent=1, default=str))
    return buffer.getvalue()


@dataclass(frozen=True)
class ExplainParams:
    """A checked explain request: one toy head, one query token."""

    text: str
    token: str
    layer: int
    head: int
    config: ToyConfig

    @classmethod
    def read(cls, request: ExplainRequest, engine: Engine) -> ExplainParams:
        """Check an explain request against the server: the toy model, served, within
        ``--max-tokens`` words."""
        from attnviz.models import TOY_MODEL
        from attnviz.models.toy import split_words

        if request.model is not None and request.model != TOY_MODEL:
            raise ApiError(422, "the step-by-step explanation is for the toy model only",
                           'send "model": "toy"')
        if TOY_MODEL not in engine.models and not engine.allow_any_model:
            raise ApiError(404, "this server does not serve the toy model",
                           "start it with --model toy to see the step-by-step explanation")
        config = engine.toy_config(request.toy)
        words = len(split_words(request.text))
        if words > engine.limits.max_tokens:
            raise ApiError(422, f"the text has {words} words, more than this server's limit of "
                                f"{engine.limits.max_tokens} tokens",
                           "shorten the text, or start the server with a higher --max-tokens",
                           kind="InputError")
        return cls(text=request.text, token=str(request.token), layer=request.layer,
                   head=request.head, config=config)


def explain_payload(params: ExplainParams) -> dict[str, Any]:
    """Every step of one toy head for one query (``attnviz explain --format json``)."""
    from attnviz.analysis.explain import explain_head
    from attnviz.session import check_text

    check_text(params.text)
    explanation = explain_head(params.text, params.token, params.layer, params.head,
                               params.config)
    payload = explanation.to_dict()
    payload["d_k"] = params.config.d_k
    payload["causal"] = params.config.causal
    payload["scaling"] = params.config.scale
    return _plain(payload)
