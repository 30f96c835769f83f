"""The long-capture API of ``attnviz serve``: long captures stay on the server.

A long capture (:mod:`attnviz.long`) holds each layer's queries, keys and log-sum-exp; the
server keeps the last few it made and answers bounded questions about them, so no query or key
crosses the wire. Every route takes a JSON body (``POST``, as the rest of the API)::

    POST /api/long/plan      {text, pair?, model?, toy?, layers?, heads?, max_tokens?,
                              truncate?, long?}  -> {"long": whether the long path answers}
    POST /api/long/capture   {text, pair?, model?, layers?, max_tokens?, truncate?, dtype?}
                             -> {"id", "model", "text", "pair", "tokens", "display_tokens",
                                 "layers", "num_layers", "num_heads", "num_kv_heads",
                                 "num_tokens", "causal", "window", "dtype", "warnings",
                                 "max_weights"}
    POST /api/long/view      {id?} -> what /api/long/capture answers, plus the atlas levels,
                             the tile bound and the palette the zoomable view draws with
                             (no id: the capture the server was started with, --long-from)
    POST /api/long/tile      {id, layer, head, q0, q1, k0, k1, format?}
                             -> {"shape": [rows, cols], "weights": base64 float32}
    POST /api/long/atlas     {id, layer, head, block, format?}  (head: index or "mean")
                             -> {"block", "shape": [nb, nb], "sums", "maxes"} (base64 float32)
    POST /api/long/topk      {id, layer, head, k, q0?, q1?}
                             -> {"shape": [rows, k], "indices": [[...]], "values": base64}
    POST /api/long/stats     {id, threshold?}
                             -> {"layers", "stats": {name: [[layer][head]]}, "sinks": [T]}
    POST /api/long/received  {id, layer, head}  -> {"received": base64 float64 [T]}

``id`` names a capture made by ``/api/long/capture`` (the same request gives the same id while
the capture is kept; a 404 says to capture again) or the one the server was started with
(``--long-from``, kept for good). Tiles, atlases and top-k answers are bounded by
``Limits.long_max_weights`` values. ``"format": "float32"`` answers a tile or an atlas as raw
little-endian float32 (``application/octet-stream``, the shape in ``X-Attnviz-Shape``; an atlas
is its sums, then its maxima), which is what the page asks for.

The zoomable view (``GET /long``, ``render/assets/long.js``) fetches atlas levels and exact
tiles from here: ``/long`` opens the ``--long-from`` capture, ``/long#id=ID`` any kept one. An
atlas level is pooled from the finest level the view uses (:class:`AtlasCache`: one pass over a
head's weights, then every coarser level is free).
"""

from __future__ import annotations

import base64
import collections
import threading
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import BeforeValidator

from attnviz.server.requests import (
    ApiError,
    Layers,
    OptionalFlag,
    TextRequest,
    _head,
    _refuse,
    _Request,
    between,
    chars,
    one_of,
)

if TYPE_CHECKING:
    import numpy as np
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    from attnviz.long import LongCapture
    from attnviz.server.engine import Engine

#: Largest atlas block of any capture (attnviz.long.record.MAX_BLOCK; a capture's own bound
#: is smaller: attnviz.long.record.largest_block).
MAX_BLOCK = 1 << 20
#: The storage types of a long capture (``--long-dtype``).
DTYPES = ("float32", "float16", "bfloat16")
_ID = Annotated[str, chars(64)]
_Layer = Annotated[int, between(-(1 << 20), 1 << 20)]
_Head = Annotated[int | str | list[int], BeforeValidator(_head)]
_Pos = Annotated[int, between(0, 1 << 24)]
_OptionalPos = Annotated[int | None, between(0, 1 << 24)]


class LongPlanRequest(TextRequest):
    """``/api/long/plan``: would this text take the long path (``long``: null decides)?"""

    heads: Layers = None
    long: OptionalFlag = None


class LongCaptureRequest(TextRequest):
    """``/api/long/capture``: the text to capture as queries, keys and log-sum-exp."""

    dtype: Annotated[str, one_of(*DTYPES)] = "float32"


class _OnCapture(_Request):
    id: _ID


_Format = Annotated[str, one_of("json", "float32")]


class ViewRequest(_Request):
    """``/api/long/view``: a kept capture (default: the one the server was started with)."""

    id: Annotated[str | None, chars(64)] = None


class TileRequest(_OnCapture):
    layer: _Layer
    head: _Head
    q0: _Pos
    q1: _Pos
    k0: _Pos
    k1: _Pos
    format: _Format = "json"


class AtlasRequest(_OnCapture):
    layer: _Layer
    head: _Head
    block: Annotated[int, between(16, MAX_BLOCK)] = 64  # and at most the capture's largest
    format: _Format = "json"


class LongTopkRequest(_OnCapture):
    layer: _Layer
    head: _Head
    k: Annotated[int, between(1, 1024)] = 3
    q0: Annotated[int, between(0, 1 << 24)] = 0
    q1: _OptionalPos = None


class StatsRequest(_OnCapture):
    threshold: Annotated[float, BeforeValidator(_fraction)] = 0.3


def _fraction(value: Any, info: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
        raise _refuse("'threshold' must be a number between 0 and 1 (exclusive)")
    return float(value)


class ReceivedRequest(_OnCapture):
    layer: _Layer
    head: _Head


# --------------------------------------------------------------------------- the store
#: The view asks for exact tiles once it spans at most this many tokens.
VIEW_SIDE = 256
#: Finest atlas levels kept for the view, by bytes (at most 8 MiB a head).
ATLAS_CACHE_BYTES = 256 << 20


class AtlasCache:
    """Atlas levels of the view: the finest level (:func:`atlas_blocks`) of each head is read
    from the capture once and kept (least recently used out first, within
    :data:`ATLAS_CACHE_BYTES`); coarser levels are pooled from it."""

    def __init__(self) -> None:
        self._levels: collections.OrderedDict[tuple[int, int, str | int, int],
                                              tuple[np.ndarray, np.ndarray]] = (
            collections.OrderedDict())
        self._bytes = 0
        self._lock = threading.Lock()

    def atlas(self, cap: LongCapture, layer: int, head: int | str, block: int
              ) -> tuple[np.ndarray, np.ndarray]:
        from attnviz.long.record import check_block
        from attnviz.render.long_html import atlas_blocks, pool_atlas

        block = check_block(cap.num_tokens, block)  # before any padding is paid for
        finest = atlas_blocks(cap.num_tokens)[0]
        if block < finest or block & (block - 1):  # the capture answers (or refuses) these
            return cap.atlas(layer, head, block)
        # Once the capture holds its summary (one pass over every head: the statistics the
        # view asks for first), a single head's level at the summary's block or coarser is
        # pooled from it, with no pass over the head (the view's fixed colour scale needs the
        # head's maximum while it shows exact tiles).
        held = getattr(cap, "_summary", None)
        if held is not None and not isinstance(head, str) and block >= int(held.block):
            return cap.atlas(layer, head, block)
        from attnviz.selection import resolve_index

        # the same checks (and messages) as the capture's, before the cache is asked
        layer = resolve_index(layer, cap.num_layers, "layer")
        which: int | str = (head if isinstance(head, str)
                            else resolve_index(head, cap.num_heads, "head"))
        key = (id(cap), layer, which, finest)
        with self._lock:
            found = self._levels.get(key)
            if found is not None:
                self._levels.move_to_end(key)
        if found is None:
            found = cap.atlas(layer, head, finest)
            with self._lock:
                if key not in self._levels:
                    self._levels[key] = found
                    self._bytes += found[0].nbytes + found[1].nbytes
                while self._bytes > ATLAS_CACHE_BYTES and len(self._levels) > 1:
                    _, (sums, maxes) = self._levels.popitem(last=False)
                    self._bytes -= sums.nbytes + maxes.nbytes
        return pool_atlas(found[0], found[1], block // finest)

    def forget(self, cap: LongCapture) -> None:
        with self._lock:
            for key in [k for k in self._levels if k[0] == id(cap)]:
                sums, maxes = self._levels.pop(key)
                self._bytes -= sums.nbytes + maxes.nbytes


class LongStore:
    """The long captures the server keeps (the last ``keep``, and any pinned), by id."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self._captures: collections.OrderedDict[str, LongCapture] = collections.OrderedDict()
        self._pinned: dict[str, LongCapture] = {}
        self._lock = threading.Lock()
        self.atlas = AtlasCache()

    def pin(self, cap: LongCapture) -> str:
        """Keep ``cap`` for good (``attnviz serve --long-from``); returns its id."""
        from attnviz.inputs import short_hash

        key = "folder-" + short_hash(str(getattr(cap, "folder", "")), cap.text, length=16)
        with self._lock:
            self._pinned[key] = cap
        return key

    def pinned_info(self) -> dict[str, Any] | None:
        """``{"id", "num_tokens"}`` of the capture the page opens without an id, or None."""
        with self._lock:
            for key, cap in self._pinned.items():
                return {"id": key, "num_tokens": int(cap.num_tokens)}
        return None

    def default(self) -> str:
        """The id the page opens without one: the first pinned capture."""
        with self._lock:
            if self._pinned:
                return next(iter(self._pinned))
        raise ApiError(404, "this server holds no long capture to open",
                       "start it with attnviz serve --long-from DIR, or capture a text with "
                       "/api/long/capture and open /long#id=ID")

    def get(self, key: str) -> LongCapture:
        with self._lock:
            pinned = self._pinned.get(key)
            if pinned is not None:
                return pinned
            cap = self._captures.get(key)
            if cap is None:
                raise ApiError(404, f"no long capture {key[:64]!r} on this server (it keeps the "
                                    f"last {self.keep})",
                               "capture the text again with /api/long/capture")
            self._captures.move_to_end(key)
            return cap

    def find(self, key: str) -> LongCapture | None:
        with self._lock:
            return self._pinned.get(key) or self._captures.get(key)

    def put(self, key: str, cap: LongCapture) -> None:
        with self._lock:
            self._captures[key] = cap
            self._captures.move_to_end(key)
            while len(self._captures) > self.keep:
                _, old = self._captures.popitem(last=False)
                self.atlas.forget(old)
                old.close()

    def close(self) -> None:
        with self._lock:
            for cap in [*self._captures.values(), *self._pinned.values()]:
                cap.close()
            self._captures.clear()
            self._pinned.clear()


def _b64(array: np.ndarray, dtype: str = "<f4") -> str:
    import numpy as np

    return base64.b64encode(np.ascontiguousarray(array, dtype=dtype).tobytes()).decode("ascii")


def _head_value(head: int | str | list[int]) -> int | str:
    if isinstance(head, list):
        raise ApiError(422, "'head' must be one head or \"mean\" for a long capture")
    return head


def describe(key: str, cap: LongCapture, max_weights: int) -> dict[str, Any]:
    """What ``/api/long/capture`` answers: the capture's id, tokens and shape, and the most
    values one answer about it holds."""
    return {"id": key, "max_weights": max_weights, "model": cap.model,
            "model_label": cap.model_label, "text": cap.text,
            "pair": cap.pair, "tokens": cap.tokens, "display_tokens": cap.display_tokens,
            "word_ids": cap.word_ids, "special": cap.special, "layers": cap.layers,
            "num_layers": cap.num_layers, "num_heads": cap.num_heads,
            "num_kv_heads": cap.num_kv_heads, "num_tokens": cap.num_tokens,
            "causal": cap.causal, "window": cap.window, "dtype": cap.dtype,
            "warnings": [str(w) for w in cap.meta.get("warnings", [])]}


def view_payload(key: str, cap: LongCapture, max_values: int) -> dict[str, Any]:
    """``/api/long/view``: :func:`describe` plus what the zoomable view draws with."""
    from attnviz.render.long_html import atlas_blocks, layer_windows, palette_hex

    payload = describe(key, cap, max_values)
    blocks = [b for b in atlas_blocks(cap.num_tokens)
              if 2 * (-(-cap.num_tokens // b)) ** 2 <= max_values]
    payload.update(atlas={"blocks": blocks or [atlas_blocks(cap.num_tokens)[-1]],
                          "mean": True},
                   windows=layer_windows(cap),
                   tile={"max_values": max_values, "view_side": VIEW_SIDE},
                   palette=palette_hex())
    return payload


def _float32(values: np.ndarray, shape: Any) -> Response:
    import numpy as np
    from starlette.responses import Response

    data = np.ascontiguousarray(values, dtype="<f4").tobytes()
    return Response(data, media_type="application/octet-stream",
                    headers={"X-Attnviz-Shape": ",".join(str(int(n)) for n in shape)})


def long_page() -> str:
    """The page ``/long``: long.html with its script and style by address."""
    from attnviz._version import __version__
    from attnviz.render.long_html import long_page as page

    return page(generator=f"attnviz {__version__}", title="attnviz long context",
                source="server", style='<link rel="stylesheet" href="/assets/long.css">',
                data="", script='<script src="/assets/long.js"></script>')


def _check_weights(count: int, limit: int, what: str) -> None:
    if count > limit:
        raise ApiError(413, f"{what} holds {count:,} values; this server sends at most "
                            f"{limit:,} in one answer", "ask for a smaller part")


# --------------------------------------------------------------------------- the routes
def long_routes(engine: Engine, run: Any, read: Any, endpoint: Any, to_json: Any
                ) -> tuple[list[Route], LongStore]:
    """The ``/api/long/...`` routes of :func:`attnviz.server.app.create_app`.

    Args:
        engine: the server's engine (session, limits, model names).
        run: ``await run(key, work, spec)``: blocking work inside the model's queue and the
            request timeout (the app's runner).
        read: ``await read(request, model, limits)``: the JSON body as ``model``.
        endpoint: the app's error wrapper for a handler.
        to_json: a value as a JSON response.

    Returns:
        The routes, and the store of long captures (close it when the app stops).
    """
    import dataclasses

    from starlette.routing import Route

    from attnviz.request import CaptureRequest
    from attnviz.session import spec_key

    limits = engine.limits
    store = LongStore(limits.long_keep)
    # Long texts: the body and text bounds of the long routes (a character takes up to 12
    # bytes of JSON as a surrogate pair of \uXXXX escapes).
    long_limits = dataclasses.replace(
        limits, max_chars=limits.long_max_chars,
        max_body_bytes=max(limits.max_body_bytes, 12 * limits.long_max_chars + 65536))

    def checked_tokens(max_tokens: int | None) -> int:
        if max_tokens is not None and max_tokens > limits.long_max_tokens:
            raise ApiError(422, f"'max_tokens' is {max_tokens}; this server takes at most "
                                f"{limits.long_max_tokens} tokens in a long capture",
                           "send a lower max_tokens, or start the server with a higher "
                           "--long-max-tokens")
        return limits.long_max_tokens if max_tokens is None else max_tokens

    async def plan(request: Request) -> Response:
        body = await read(request, LongPlanRequest, long_limits)
        spec = engine.spec(body.model, body.toy)
        capture_request = CaptureRequest(
            text=body.text, pair=body.pair, model=spec, layers=body.layers, heads=body.heads,
            max_tokens=body.max_tokens, truncate=body.truncate, long=body.long)

        def work() -> dict[str, Any]:
            return {"long": engine.session.wants_long(capture_request, body.text, body.pair)}

        return to_json(await run(spec_key(spec), work, spec))

    async def capture(request: Request) -> Response:
        body = await read(request, LongCaptureRequest, long_limits)
        spec = engine.spec(body.model, body.toy)
        max_tokens = checked_tokens(body.max_tokens)
        from attnviz.inputs import short_hash

        key = short_hash(spec_key(spec), body.text, body.pair or "", body.layers or "",
                         str(max_tokens), str(body.truncate), body.dtype, length=24)

        def work() -> dict[str, Any]:
            held = store.find(key)
            if held is None:
                held = engine.session.capture_long(
                    body.text, body.pair, model=spec, layers=body.layers,
                    max_tokens=max_tokens, truncate=body.truncate, dtype=body.dtype)
                store.put(key, held)
            return describe(key, held, limits.long_max_weights)

        return to_json(await run(spec_key(spec), work, spec))

    async def tile(request: Request) -> Response:
        body = await read(request, TileRequest, limits)
        cap = store.get(body.id)
        _check_weights(max(0, body.q1 - body.q0) * max(0, body.k1 - body.k0),
                       limits.long_max_weights, "the tile")

        weights = await run("long", lambda: cap.tile(body.layer, _head_value(body.head),
                                                     body.q0, body.q1, body.k0, body.k1))
        if body.format == "float32":
            return _float32(weights, weights.shape)
        return to_json({"shape": list(weights.shape), "weights": _b64(weights)})

    async def atlas(request: Request) -> Response:
        body = await read(request, AtlasRequest, limits)
        cap = store.get(body.id)
        from attnviz.long.record import check_block

        check_block(cap.num_tokens, body.block)  # 422 naming the largest block
        blocks = -(-cap.num_tokens // body.block)
        _check_weights(2 * blocks * blocks, limits.long_max_weights, "the atlas")

        sums, maxes = await run("long", lambda: store.atlas.atlas(
            cap, body.layer, _head_value(body.head), body.block))
        if body.format == "float32":
            import numpy as np

            return _float32(np.concatenate([sums.ravel(), maxes.ravel()]), sums.shape)
        return to_json({"block": body.block, "shape": list(sums.shape), "sums": _b64(sums),
                        "maxes": _b64(maxes)})

    async def view(request: Request) -> Response:
        body = await read(request, ViewRequest, limits)
        key = store.default() if body.id is None else body.id
        cap = store.get(key)
        return to_json(view_payload(key, cap, limits.long_max_weights))

    page = long_page()

    async def long_index(request: Request) -> Response:
        from starlette.responses import HTMLResponse

        return HTMLResponse(page)

    async def topk(request: Request) -> Response:
        body = await read(request, LongTopkRequest, limits)
        cap = store.get(body.id)
        q1 = cap.num_tokens if body.q1 is None else body.q1
        _check_weights(max(0, q1 - body.q0) * body.k, limits.long_max_weights, "the top-k")

        def work() -> dict[str, Any]:
            indices, values = cap.topk(body.layer, _head_value(body.head), body.k, body.q0, q1)
            return {"shape": list(values.shape), "indices": indices.tolist(),
                    "values": _b64(values)}

        return to_json(await run("long", work))

    async def stats(request: Request) -> Response:
        body = await read(request, StatsRequest, limits)
        cap = store.get(body.id)

        def work() -> dict[str, Any]:
            means = cap.head_stats()
            return {"layers": cap.layers,
                    "stats": {name: values.tolist() for name, values in means.items()},
                    "sinks": cap.sinks(body.threshold).tolist(), "threshold": body.threshold}

        return to_json(await run("long", work))

    async def received(request: Request) -> Response:
        body = await read(request, ReceivedRequest, limits)
        cap = store.get(body.id)

        def work() -> dict[str, Any]:
            return {"received": _b64(cap.received(body.layer, _head_value(body.head)),
                                     "<f8")}

        return to_json(await run("long", work))

    routes = [Route(f"/api/long/{name}", endpoint(handler), methods=["POST"])
              for name, handler in (("plan", plan), ("capture", capture), ("view", view),
                                    ("tile", tile), ("atlas", atlas), ("topk", topk),
                                    ("stats", stats), ("received", received))]
    routes.append(Route("/long", endpoint(long_index), methods=["GET"]))
    return routes, store
