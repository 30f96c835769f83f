"""The Starlette application of ``attnviz serve``: the page, the JSON API and its guards.

Routes (every one answers JSON errors ``{"error": {"type", "message", "hint", "status"}}`` with
the message the CLI would print)::

    GET  /                    the live page (report front end + text box)
    GET  /assets/<fixed name> its scripts and styles (a fixed list: no request names a file)
    GET  /api/health          {"status": "ok", "ready": every served model loaded, ...}
    GET  /api/models          the served models, loaded or not, the server's limits and its
                              --long-from capture ("long": {"id", "num_tokens"} or null)
    POST /api/model           load a model, say its layers and heads
    POST /api/capture         text -> tokens + weights (quantised, or float32 on request)
    POST /api/capture.zip     the capture as attention.npy + capture.json in a zip
    POST /api/topk            top-k keys per query of one head (json or csv), or one row
    POST /api/explain         the toy model's step-by-step calculation for one query
    POST /api/induction       a model's attention on token positions (the induction test)
    POST /api/long/...        long captures kept here: plan, capture, view, tile, atlas, topk,
                              stats, received (:mod:`attnviz.server.long_routes`)
    GET  /long                the zoomable view of a long capture
    POST /api/generate        generated tokens, streamed as chosen, with their top keys

Guards: requests must name an allowed ``Host`` (``127.0.0.1``/``localhost`` when bound there,
so a web page elsewhere cannot reach the server through DNS rebinding) and carry the token when
one is set; POST bodies must be ``application/json`` (so other sites' forms cannot post here)
and at most ``limits.max_body_bytes``; each model queues at most ``limits.queue`` requests
(503 beyond) and a request gets ``limits.timeout_s`` (503 after). Every response carries a
Content-Security-Policy that allows only this server's own scripts, styles and API.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import json
import logging
import os
import queue
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from importlib import resources
from string import Template
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import parse_qsl, quote, urlencode

from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from attnviz.errors import AttnvizError, NoSpaceError, OutputError, UsageError
from attnviz.server.engine import (
    Engine,
    ExplainParams,
    Limits,
    capture_payload,
    capture_zip,
    encode_float32,
    explain_payload,
    topk_csv,
    topk_payload,
)
from attnviz.server.requests import (
    ApiError,
    CaptureRequest,
    ExplainRequest,
    GenerateRequest,
    InductionRequest,
    ModelRequest,
    TopkRequest,
    WeightsRequest,
    parse,
)

if TYPE_CHECKING:
    from pydantic import BaseModel

    from attnviz.long import LongCapture
    from attnviz.models import ModelSpec
    from attnviz.session import Session

    _Model = TypeVar("_Model", bound=BaseModel)

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
       "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
SECURITY_HEADERS = [
    (b"content-security-policy", CSP.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"x-frame-options", b"DENY"),
    (b"cross-origin-resource-policy", b"same-origin"),
]
# The page and its assets: a fixed list, so no request can name a file.
ASSETS = {
    "report.js": ("attnviz.render", "report.js", "text/javascript; charset=utf-8"),
    "report.css": ("attnviz.render", "report.css", "text/css; charset=utf-8"),
    "live.js": ("attnviz.server", "live.js", "text/javascript; charset=utf-8"),
    "live.css": ("attnviz.server", "live.css", "text/css; charset=utf-8"),
    "long.js": ("attnviz.render", "long.js", "text/javascript; charset=utf-8"),
    "long.css": ("attnviz.render", "long.css", "text/css; charset=utf-8"),
}
log = logging.getLogger("attnviz.server")


def _asset(package: str, name: str) -> str:
    return resources.files(package).joinpath("assets").joinpath(name).read_text(encoding="utf-8")


def page_html() -> str:
    """The live page: the report's markup inside the page's own controls."""
    from attnviz._version import __version__
    from attnviz.render.html import report_body

    generator = f"attnviz {__version__}"
    return Template(_asset("attnviz.server", "live.html")).substitute(
        report_body=report_body("attnviz live", generator), generator=generator)


# --------------------------------------------------------------------------- errors
def error_response(status: int, kind: str, message: str, hint: str | None = None,
                   headers: dict[str, str] | None = None) -> Response:
    body = {"error": {"type": kind, "message": message, "hint": hint, "status": status}}
    return Response(json.dumps(body, ensure_ascii=False), status_code=status,
                    media_type="application/json", headers=headers)


def _error_of(error: AttnvizError) -> Response:
    if isinstance(error, ApiError):
        headers = None if error.retry_after is None else {"Retry-After": str(error.retry_after)}
        return error_response(error.status, error.kind, error.message, error.hint, headers)
    from attnviz.long import LongUnsupported

    kind = type(error).__name__
    if isinstance(error, OutputError):  # the server's own files: no path of its disk goes out
        log.warning("%s", error.message)
        if isinstance(error, NoSpaceError):
            return error_response(507, kind, f"{error.public} on the server",
                                  "free disk space on the server (its temporary folder), or "
                                  "try a shorter text")
        return error_response(500, kind, "the server cannot write its working files",
                              "the server's log has the details")
    if isinstance(error, UsageError):  # InputError included: what the CLI exits 2 for
        return error_response(422, kind, error.message, error.hint)
    if isinstance(error, LongUnsupported):  # the request's model cannot take the long path
        return error_response(422, kind, error.message, error.hint)
    return error_response(500, kind, error.message, error.hint)


Handler = Callable[[Request], Awaitable[Response]]


def _endpoint(handler: Handler) -> Handler:
    """Map attnviz errors to JSON responses; log anything unexpected with its traceback."""

    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except AttnvizError as error:
            return _error_of(error)
        except Exception as error:
            if os.environ.get("ATTNVIZ_DEBUG", "") not in ("", "0"):
                raise
            log.exception("unexpected error in %s %s", request.method, request.url.path)
            return error_response(500, "InternalError",
                                  f"internal error ({type(error).__name__}) in the server",
                                  "the server's log has the details; please report it")

    return wrapped


async def read_request(request: Request, model: type[_Model], limits: Limits) -> _Model:
    """The POST body, read up to ``limits.max_body_bytes``, as the route's request model."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype != "application/json":
        raise ApiError(415, "send the request body as JSON with Content-Type: application/json",
                       f"got Content-Type {ctype or 'none'!r}"[:200])
    limit = limits.max_body_bytes
    too_big = ApiError(413, f"the request body is larger than this server takes ({limit:,} "
                            "bytes)",
                       "send a shorter text, or start the server with a higher --max-chars",
                       kind="InputError")
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.strip().isdigit():
            raise ApiError(400, "the Content-Length header is not a number")
        if int(declared) > limit:
            raise too_big
    body = bytearray()
    try:
        async for chunk in request.stream():
            body.extend(chunk)
            if len(body) > limit:
                raise too_big
    except ClientDisconnect:
        raise ApiError(400, "the request body was cut off") from None
    try:
        data = json.loads(bytes(body))
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply") from None
    except (UnicodeDecodeError, ValueError) as exc:
        if "integer string conversion" in str(exc):  # Python's guard against huge numbers
            raise ApiError(400, "a number in the request body has too many digits",
                           "send numbers such as 5 or -1") from None
        raise ApiError(400, f"the request body is not valid JSON: {exc}"[:300],
                       'send e.g. {"text": "The cat sat on the mat"}') from None
    return parse(model, data, max_chars=limits.max_chars, max_k=limits.max_k)


# --------------------------------------------------------------------------- guard
def _host_name(host: str) -> str:
    """The name in a ``Host`` header (``127.0.0.1:8000`` -> ``127.0.0.1``); a header that is not
    ``name[:port]`` or ``[v6][:port]`` comes back whole, so it matches no allowed name
    (``127.0.0.1:8000@evil.com``)."""
    host = host.strip().lower()
    if host.startswith("["):  # [::1]:8000
        end = host.find("]")
        rest = host[end + 1:] if end > 0 else ""
        if end > 0 and (not rest or (rest[0] == ":" and (rest[1:].isdigit()
                                                          or not rest[1:]))):
            return host[1:end]
        return host
    name, colon, port = host.partition(":")
    if colon and port and not (port.isdigit() and port.isascii()):  # "name:" is allowed
        return host
    return name


class Guard:
    """ASGI middleware: allowed ``Host`` names, the token, and security headers on everything.

    The token may come as ``Authorization: Bearer``, an ``X-Attnviz-Token`` header, a cookie
    set when the page was opened with ``?token=``, or ``?token=`` itself. Opening the page with
    ``?token=`` sets the cookie and redirects to the same address without it, so links copied
    from the address bar do not carry the token.
    """

    def __init__(self, app: ASGIApp, *, token: str | None,
                 allowed_hosts: Sequence[str] | None) -> None:
        self.app = app
        self.token = token
        self.allowed_hosts = None if allowed_hosts is None else {
            h.strip().lower().strip("[]") for h in allowed_hosts}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_secured(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                names = {name.lower() for name, _ in headers}
                headers.extend(h for h in SECURITY_HEADERS if h[0] not in names)
                if b"cache-control" not in names:
                    headers.append((b"cache-control", b"no-store"))
                message = {**message, "headers": headers}
            await send(message)

        denied = self._check(scope)
        if denied is not None:
            await denied(scope, receive, send_secured)
            return
        await self.app(scope, receive, send_secured)

    def _cookie_name(self, scope: Scope) -> str:
        server = scope.get("server") or ("", 0)
        return f"attnviz-token-{server[1] or 0}"

    def _check(self, scope: Scope) -> Response | None:
        headers = Headers(scope=scope)
        api = str(scope.get("path", "")).startswith("/api/")
        if self.allowed_hosts is not None:
            host = _host_name(headers.get("host", ""))
            if host not in self.allowed_hosts:
                return self._deny(403, api, f"this server answers only to "
                                            f"{', '.join(sorted(self.allowed_hosts))}, not to "
                                            f"the host {host[:100]!r}",
                                  "open it as http://127.0.0.1:PORT/ or http://localhost:PORT/")
        if self.token is None:
            return None
        pairs = parse_qsl(scope.get("query_string", b"").decode("latin-1"),
                          keep_blank_values=True)
        query = dict(pairs)
        given, source = None, ""
        authorization = headers.get("authorization", "")
        cookies = _cookies(headers.get("cookie", ""))
        if authorization.lower().startswith("bearer "):
            given, source = authorization[7:].strip(), "header"
        elif headers.get("x-attnviz-token"):
            given, source = headers["x-attnviz-token"].strip(), "header"
        elif "token" in query:
            given, source = query["token"], "query"
        elif self._cookie_name(scope) in cookies:
            given, source = cookies[self._cookie_name(scope)], "cookie"
        if not given:
            return self._deny(401, api, "this server needs its token",
                              "open the address 'attnviz serve' printed (it ends in "
                              "?token=...), or send Authorization: Bearer TOKEN",
                              {"WWW-Authenticate": "Bearer"})
        if not hmac.compare_digest(given.encode("utf-8", "replace"),
                                   self.token.encode("utf-8")):
            return self._deny(403, api, "the token is wrong",
                              "use the token 'attnviz serve' printed when it started")
        if source == "query" and scope.get("method") in ("GET", "HEAD") and not api:
            rest = urlencode([(k, v) for k, v in pairs if k != "token"])
            target = quote(str(scope.get("path", "/"))) + (f"?{rest}" if rest else "")
            response = Response(status_code=303, headers={"Location": target})
            response.set_cookie(self._cookie_name(scope), self.token, httponly=True,
                                samesite="strict", path="/")
            return response
        return None

    @staticmethod
    def _deny(status: int, api: bool, message: str, hint: str,
              headers: dict[str, str] | None = None) -> Response:
        if api:
            return error_response(status, "AuthError" if status == 401 else "Forbidden",
                                  message, hint, headers)
        return Response(f"{message}: {hint}\n", status_code=status, media_type="text/plain",
                        headers=headers)


def _cookies(header: str) -> dict[str, str]:
    cookies = {}
    for part in header.split(";"):
        name, sep, value = part.strip().partition("=")
        if sep:
            cookies[name] = value
    return cookies


# --------------------------------------------------------------------------- the app
class _DaemonPool:
    """Worker threads for blocking work, as daemon threads.

    ``concurrent.futures.ThreadPoolExecutor`` joins its threads when the interpreter exits, so
    Ctrl-C during a model load would wait for the load (minutes for a big model). The server
    writes no file from these threads (its session has no disk cache), so they may simply stop
    with the process.
    """

    def __init__(self, max_workers: int, name: str) -> None:
        self.max_workers = max_workers
        self.name = name
        self._queue: queue.SimpleQueue[tuple[concurrent.futures.Future[Any],
                                             Callable[[], Any]] | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._running = 0
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, work: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("the pool is shut down")
            self._queue.put((future, work))
            if self._idle == 0 and len(self._threads) < self.max_workers:
                thread = threading.Thread(target=self._work, daemon=True,
                                          name=f"{self.name}_{len(self._threads)}")
                self._threads.append(thread)
                thread.start()
            else:
                self._idle -= 1 if self._idle else 0
        return future

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            future, work = item
            if future.set_running_or_notify_cancel():
                with self._lock:
                    self._running += 1
                try:
                    future.set_result(work())
                except BaseException as error:  # handed to the waiting request
                    future.set_exception(error)
                finally:
                    with self._lock:
                        self._running -= 1
            with self._lock:
                self._idle += 1

    def running(self) -> int:
        """How many threads are running work now (a model load or a forward pass)."""
        with self._lock:
            return self._running

    def shutdown(self) -> None:
        """Cancel the work not started yet and let every thread end when it is free."""
        with self._lock:
            self._closed = True
            threads = len(self._threads)
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].cancel()
        for _ in range(threads):
            self._queue.put(None)


class _Runner:
    """Runs blocking work (model forwards, encoding) on worker threads, inside the engine's
    queue bound and the request timeout."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.pool = _DaemonPool(engine.max_pending, "attnviz-serve")
        self.stopping = False
        self._waiting: set[asyncio.Future[Any]] = set()

    async def run(self, key: str, work: Callable[[], Any], spec: ModelSpec | None = None
                  ) -> Any:
        if self.stopping:
            raise self._stopped()
        release = self.engine.admit(key)
        state = {"started": False, "abandoned": False}
        guard = threading.Lock()

        def job() -> Any:
            with guard:
                if state["abandoned"]:
                    return None
                state["started"] = True
            try:
                return work()
            finally:
                release()  # also when the client stopped waiting: the place is free only now

        def abandon() -> None:
            with guard:
                if not state["started"]:
                    state["abandoned"] = True
                    release()

        try:
            future = self.pool.submit(job)
        except RuntimeError:  # shutting down
            release()
            raise self._stopped() from None
        timeout = self.engine.limits.timeout_s
        waiting = asyncio.wrap_future(future)
        self._waiting.add(waiting)
        try:
            return await asyncio.wait_for(waiting, timeout)
        except asyncio.CancelledError:
            if not self.stopping:
                raise
            abandon()
            raise self._stopped() from None
        except asyncio.TimeoutError:
            abandon()
            if spec is not None and self.engine.session.is_loading(spec):
                raise ApiError(503, f"no answer within {timeout:g} s: the model {spec.name} is "
                                    "still loading (it goes on loading)",
                               "try again in a moment, or start the server with a longer "
                               "--timeout", kind="AttnvizError", retry_after=1) from None
            raise ApiError(503, f"no answer within {timeout:g} s: the model is busy or the text "
                                "is long",
                           "try again, or start the server with a longer --timeout",
                           kind="AttnvizError", retry_after=1) from None
        finally:
            self._waiting.discard(waiting)

    @staticmethod
    def _stopped() -> ApiError:
        return ApiError(503, "the server is stopping", "start it again with attnviz serve",
                        kind="AttnvizError")  # no Retry-After: trying again will not help

    def stop(self) -> None:
        """Answer every waiting request with 503 now, and every new one (call in the loop).

        Work already running on a model is not interrupted; its answer is dropped.
        """
        self.stopping = True
        for waiting in list(self._waiting):
            waiting.cancel()

    def close(self) -> None:
        self.stopping = True
        self.pool.shutdown()


def create_app(models: Sequence[str] = (), *, token: str | None = None,
               allow_any_model: bool = False, limits: Limits | None = None,
               session: Session | None = None,
               allowed_hosts: Sequence[str] | None = LOCAL_HOSTS, device: str = "auto",
               dtype: str = "float32", long_capture: LongCapture | None = None) -> Starlette:
    """The ASGI application of ``attnviz serve``.

    Args:
        models: names requests may use (the first is the default; each loads on first use, or
            before with ``app.state.engine.load(name)``).
        token: when set, every request must carry it (see :class:`Guard`).
        allow_any_model: also load any hub id or folder a request names.
        limits: request bounds (:class:`~attnviz.server.engine.Limits`).
        session: the warm engine to capture with (default: a new one, no disk cache).
        allowed_hosts: ``Host`` names the server answers to; ``None`` for any (a server bound
            beyond this machine relies on its token instead).
        device, dtype: how the models are loaded.
        long_capture: a long capture (:func:`attnviz.long.load_long`) the server keeps for
            good (never evicted) and the page ``/long`` opens on (``attnviz serve
            --long-from DIR``).

    Returns:
        The Starlette app; ``app.state.engine`` is its :class:`~attnviz.server.engine.Engine`.
    """
    engine = Engine(models, allow_any_model=allow_any_model, limits=limits, session=session,
                    device=device, dtype=dtype)
    runner = _Runner(engine)
    page = page_html()
    assets = {name: (_asset(package, file), media) for name, (package, file, media)
              in ASSETS.items()}
    from attnviz.render.long_html import long_script

    assets["long.js"] = (long_script(), assets["long.js"][1])  # with report.js's colour part

    async def index(request: Request) -> Response:
        return HTMLResponse(page)

    def asset_route(name: str) -> Route:
        text, media = assets[name]

        async def asset(request: Request) -> Response:
            return Response(text, media_type=media, headers={"Cache-Control": "no-cache"})

        return Route(f"/assets/{name}", asset, methods=["GET"])

    async def health(request: Request) -> Response:
        from attnviz._version import __version__

        return _json({"status": "ok", "version": __version__, "models": engine.models,
                      "default": engine.models[0], "ready": engine.ready(),
                      "pending": engine.pending()})

    async def models_list(request: Request) -> Response:
        from starlette.concurrency import run_in_threadpool

        payload = await run_in_threadpool(engine.models_payload)
        payload["long"] = long_store.pinned_info()
        return _json(payload)

    async def model_info(request: Request) -> Response:
        body = await read_request(request, ModelRequest, engine.limits)
        spec = engine.spec(body.model, body.toy)
        from attnviz.session import spec_key

        return _json(await runner.run(spec_key(spec), lambda: engine.describe(spec), spec))

    async def capture(request: Request) -> Response:
        body = await read_request(request, WeightsRequest, engine.limits)
        params = engine.capture_params(body)

        def work() -> bytes:
            payload = capture_payload(engine.capture(params), weights=body.weights,
                                      stats=body.stats)
            return json.dumps(payload, ensure_ascii=False, allow_nan=False).encode("utf-8")

        answer = await runner.run(params.model_key, work, params.spec)
        return Response(answer, media_type="application/json")

    async def capture_download(request: Request) -> Response:
        params = engine.capture_params(await read_request(request, CaptureRequest,
                                                          engine.limits))
        answer = await runner.run(params.model_key,
                                  lambda: capture_zip(engine.capture(params)), params.spec)
        name = _file_name("attnviz_capture", params.spec.name, params.text) + ".zip"
        return Response(answer, media_type="application/zip",
                        headers={"Content-Disposition": f'attachment; filename="{name}"'})

    async def topk(request: Request) -> Response:
        body = await read_request(request, TopkRequest, engine.limits)
        params = engine.capture_params(body)
        if body.format == "csv" and body.query is not None:
            raise ApiError(422, "'query' and format csv do not go together",
                           "leave out 'query' for the CSV of every query")
        payload = await runner.run(params.model_key,
                                   lambda: topk_payload(engine.capture(params), body),
                                   params.spec)
        if body.format == "csv":
            name = _file_name("attnviz_topk", params.spec.name, params.text,
                              f"L{payload['layer']}_H{payload['head']}") + ".csv"
            return Response(topk_csv(payload), media_type="text/csv; charset=utf-8",
                            headers={"Content-Disposition": f'attachment; filename="{name}"'})
        return _json(payload)

    async def generate(request: Request) -> Response:
        from starlette.responses import StreamingResponse

        from attnviz.server.generate import generation_lines

        body = await read_request(request, GenerateRequest, engine.limits)
        lines = await generation_lines(engine, body, runner.pool.submit)
        return StreamingResponse(lines, media_type="application/x-ndjson")

    async def induction(request: Request) -> Response:
        body = await read_request(request, InductionRequest, engine.limits)
        spec = engine.spec(body.model, body.toy)
        from attnviz.session import spec_key

        weights = await runner.run(spec_key(spec), lambda: engine.induction(spec, body.ids),
                                   spec)
        return _json({"weights": encode_float32(weights)})

    async def explain(request: Request) -> Response:
        params = ExplainParams.read(await read_request(request, ExplainRequest, engine.limits),
                                    engine)
        return _json(await runner.run("explain", lambda: explain_payload(params)))

    async def not_found(request: Request, exc: Exception) -> Response:
        status = exc.status_code if isinstance(exc, HTTPException) else 404
        if status == 405:
            return error_response(405, "UsageError",
                                  f"{request.method} is not allowed on {request.url.path}"[:200],
                                  "the API takes GET on /api/health and /api/models, POST "
                                  "with a JSON body elsewhere")
        return error_response(status, "UsageError", f"no such page: {request.url.path}"[:200],
                              "see the JSON API in the README")

    from attnviz.server.long_routes import long_routes

    routes_long, long_store = long_routes(engine, runner.run, read_request, _endpoint, _json)
    if long_capture is not None:
        long_store.pin(long_capture)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            runner.close()
            long_store.close()

    routes = [
        Route("/", _endpoint(index), methods=["GET"]),
        *[asset_route(name) for name in ASSETS],
        Route("/api/health", _endpoint(health), methods=["GET"]),
        Route("/api/models", _endpoint(models_list), methods=["GET"]),
        Route("/api/model", _endpoint(model_info), methods=["POST"]),
        Route("/api/capture", _endpoint(capture), methods=["POST"]),
        Route("/api/capture.zip", _endpoint(capture_download), methods=["POST"]),
        Route("/api/topk", _endpoint(topk), methods=["POST"]),
        Route("/api/explain", _endpoint(explain), methods=["POST"]),
        Route("/api/induction", _endpoint(induction), methods=["POST"]),
        *routes_long,
        Route("/api/generate", _endpoint(generate), methods=["POST"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan,
                    middleware=[Middleware(Guard, token=token, allowed_hosts=allowed_hosts)],
                    exception_handlers={404: not_found, 405: not_found})
    app.state.engine = engine
    app.state.runner = runner
    app.state.long_store = long_store
    return app


def _json(value: Any) -> Response:
    return Response(json.dumps(value, ensure_ascii=False, allow_nan=False),
                    media_type="application/json")


def _file_name(*parts: str) -> str:
    """A download name from a model and text: ASCII letters, digits, ``_``, ``-`` and ``.``."""
    from attnviz.fileio import short_hash, slugify

    head, model, text, *rest = parts
    name = "_".join([head, model, slugify(text, 24), *rest, short_hash(model, text, length=6)])
    return "".join(ch if ch.isascii() and (ch.isalnum() or ch in "_-.") else "_" for ch in name)
