"""``--server URL``: capture through a running ``attnviz serve`` instead of loading the model here.

:class:`RemoteSession` has the surface of :class:`~attnviz.session.Session` (``capture``,
``captures``, ``source``), so every command that gets its captures from the CLI session --
``heatmap``, ``top-k``, ``dump``, ``heads``, ``export`` and the others -- works unchanged: the
server runs the model and sends the weights back as exact float32, and the numbers are the
same as a local capture. Only the standard library is used (``urllib``), so the client needs
neither torch nor an HTTP package::

    from attnviz.server.client import RemoteSession
    remote = RemoteSession("http://127.0.0.1:8000")
    cap = remote.capture("The cat sat on the mat")      # no model loaded in this process
"""

from __future__ import annotations

import dataclasses
import datetime
import email.utils
import http.client
import json
import math
import os
import re
import socket
import threading
import time
import unicodedata
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from attnviz.errors import (
    AttnvizError,
    DeviceError,
    DumpError,
    InputError,
    ModelLoadError,
    NoSpaceError,
    OutputError,
    UsageError,
)
from attnviz.server.answers import NotAttnvizAnswer, ServerError
from attnviz.session import (
    Selection,
    Session,
    _checked_request,
    _for_callers,
    _text_pairs,
    make_spec,
    spec_key,
)

if TYPE_CHECKING:
    import numpy as np

    from attnviz.capture import Capture
    from attnviz.models import ModelShape, ModelSpec
    from attnviz.request import CaptureRequest
    from attnviz.server.long_client import RemoteLongCapture

SERVER_ENV = "ATTNVIZ_SERVER"
_ERRORS: dict[str, type[AttnvizError]] = {
    cls.__name__: cls for cls in (UsageError, InputError, ModelLoadError, DeviceError, DumpError,
                                  OutputError, NoSpaceError)}
_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def _shown_url(text: str) -> str:
    """An address for a message, without any password or token in it."""
    shown = re.sub(r"//[^/@?#]*@", "//***@", text)  # user:password@
    return re.sub(r"(token=)[^&#]*", r"\1***", shown)[:100]


def parse_server_url(url: str) -> tuple[str, str | None]:
    """The base address of a server and the token its URL carries (``?token=...``).

    Raises:
        UsageError: not an ``http://`` or ``https://`` address with a valid host and port, or
            one that carries a user name or password (``attnviz serve`` uses a token).
    """
    hint = f"use the address 'attnviz serve' printed, or unset ${SERVER_ENV}"
    text = url.strip()
    if any(ch.isspace() or unicodedata.category(ch) == "Cc" for ch in text):
        raise UsageError(f"--server {_shown_url(text)!r} is not a valid address: it holds "
                         "spaces or control characters", hint)
    try:
        parts = urllib.parse.urlsplit(text)
        host, port = parts.hostname, parts.port  # port: ValueError past 65535
    except ValueError as exc:
        raise UsageError(f"--server {_shown_url(text)!r} is not a valid address ({exc}; "
                         "check the host and the port 1..65535)", hint) from None
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise UsageError(f"--server must be an http:// or https:// address such as "
                         f"http://127.0.0.1:8000, not {_shown_url(text)!r}", hint)
    if parts.username is not None or parts.password is not None:
        raise UsageError("--server must not hold a user name or password (user:password@): "
                         "attnviz serve checks a token instead",
                         "give the address as 'attnviz serve' printed it, with ?token=... "
                         "when it has one")
    if not host:
        raise UsageError(f"--server {_shown_url(text)!r} is not a valid address: it has no "
                         "host", hint)
    if port == 0:
        raise UsageError(f"--server {_shown_url(text)!r} is not a valid address: port 0",
                         hint)
    token = dict(urllib.parse.parse_qsl(parts.query)).get("token") or None
    # An API address pasted whole (http://host:port/api/health) names the same server.
    path = re.sub(r"/api(/[^?#]*)?$", "", parts.path).rstrip("/")
    base = urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, "", ""))
    return base, token


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """``attnviz serve`` never redirects an API call: following one would send the token (and
    the text) to wherever the answer points."""

    def redirect_request(self, req: urllib.request.Request, fp: Any, code: int, msg: str,
                         headers: Any, newurl: str) -> None:
        raise ServerError(f"the server at {_shown_url(req.full_url.rsplit('/api/', 1)[0])} "
                          f"answered with a redirect (HTTP {code}) to "
                          f"{_shown_url(str(newurl))!r}, which attnviz serve never does; not "
                          "followed", "check that --server points at 'attnviz serve' itself")


#: Longest server message passed on (a server's text is printed on this terminal).
MAX_MESSAGE = 1000


def _clean(text: Any) -> str:
    """A message from the server, safe to print: no control or bidirectional-override
    characters (terminal escapes), at most :data:`MAX_MESSAGE` characters."""
    shown = "".join(ch for ch in str(text) if ch in "\n\t" or unicodedata.category(ch)
                    not in ("Cc", "Cf", "Co", "Cs"))
    return shown if len(shown) <= MAX_MESSAGE else shown[:MAX_MESSAGE - 3] + "..."


def _shown_safely(payload: dict[str, Any]) -> dict[str, Any]:
    """A capture answer whose text for the terminal cannot drive it: display tokens with their
    control characters escaped (as a local capture's), the model name and warnings cleaned."""
    from attnviz.capture_build import escape_controls

    shown = dict(payload)
    display = payload.get("display_tokens")
    if isinstance(display, list):
        shown["display_tokens"] = [escape_controls(t) if isinstance(t, str) else t
                                   for t in display]
    if isinstance(payload.get("model"), str):
        shown["model"] = _clean(payload["model"])
    meta = payload.get("meta")
    if isinstance(meta, dict) and isinstance(meta.get("warnings"), list):
        shown["meta"] = {**meta, "warnings": [_clean(w) for w in meta["warnings"]]}
    return shown


def capture_from_payload(payload: dict[str, Any]) -> Capture:
    """The :class:`~attnviz.capture.Capture` of an ``/api/capture`` answer with float32 weights.

    Raises:
        ServerError: the answer is not a capture.
    """
    from attnviz.capture import _capture_from
    from attnviz.server.engine import decode_float32

    try:
        block = payload["weights"]
        if block.get("encoding") != "base64" or block.get("dtype") != "float32":
            raise ValueError(f"weights encoded as {block.get('encoding')!r}, not float32")
        weights = decode_float32(block)
        return _capture_from(_shown_safely(payload), weights)
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
        raise ServerError(f"the server's answer is not a capture ({exc})",
                          "check that --server points at 'attnviz serve' of this version"
                          ) from None


#: How many times a request that got 503 with ``Retry-After`` is tried again.
RETRIES = 4
_DEADLINE = "_attnviz_deadline"  # the attribute of a urllib Request that holds its _Deadline


class _Deadline:
    """The end of one request: when it passes, the request's sockets are shut down, so no
    server can hold the client past it by answering slowly (a socket timeout bounds each read
    only: one byte every half second never trips it)."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds
        self.passed = False
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._timer = threading.Timer(seconds, self._cut)
        self._timer.daemon = True
        self._timer.start()

    def left(self) -> float:
        return max(0.0, self.end - time.monotonic())

    def watch(self, sock: socket.socket) -> socket.socket:
        with self._lock:
            self._sockets.append(sock)
            if self.passed:
                _shut(sock)
        return sock

    def _cut(self) -> None:
        with self._lock:
            self.passed = True
            for sock in self._sockets:
                _shut(sock)

    def cancel(self) -> None:
        self._timer.cancel()


def _shut(sock: socket.socket) -> None:
    """End a socket's traffic both ways: a read blocked on it in another thread returns."""
    try:
        socket.socket.shutdown(sock, socket.SHUT_RDWR)  # the raw socket, also under TLS
    except OSError:
        pass


def _watched(connection: type[http.client.HTTPConnection], req: urllib.request.Request
             ) -> Callable[..., http.client.HTTPConnection]:
    """A connection class whose sockets the request's deadline watches."""
    deadline = getattr(req, _DEADLINE, None)

    def make(*args: Any, **kwargs: Any) -> http.client.HTTPConnection:
        conn = connection(*args, **kwargs)
        if deadline is not None:
            create = conn._create_connection  # type: ignore[attr-defined]

            def connect(*a: Any, **k: Any) -> socket.socket:
                return deadline.watch(create(*a, **k))

            conn._create_connection = connect  # type: ignore[attr-defined]
        return conn

    return make


class _WatchedHTTP(urllib.request.HTTPHandler):
    def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(_watched(http.client.HTTPConnection, req), req)


class _WatchedHTTPS(urllib.request.HTTPSHandler):
    def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        context = getattr(self, "_context", None)
        return self.do_open(_watched(http.client.HTTPSConnection, req), req, context=context)


class _Busy(Exception):
    """A 503 the server says to try again after ``wait`` seconds."""

    def __init__(self, error: AttnvizError, wait: float) -> None:
        super().__init__(error.message)
        self.error = error
        self.wait = wait


def _retry_after(value: str | None) -> float | None:
    """Seconds to wait from a ``Retry-After`` header (seconds or an HTTP date), between 0.1
    and 30; ``None`` without one."""
    if not value:
        return None
    try:
        seconds = float(value.strip())
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        if when.tzinfo is None:
            return None
        seconds = (when - datetime.datetime.now(datetime.timezone.utc)).total_seconds()
    if not math.isfinite(seconds):
        return None
    return min(max(seconds, 0.1), 30.0)


class RemoteSession(Session):
    """A :class:`~attnviz.session.Session` whose captures come from ``attnviz serve``.

    Args:
        url: the server's address, e.g. ``http://127.0.0.1:8000``; a ``?token=...`` in it (as
            ``attnviz serve`` prints it for other hosts) is sent as ``Authorization: Bearer``.
        timeout: seconds one request may take in all (connecting, waiting, reading the answer,
            and trying again after a 503 with ``Retry-After``).
        warn: called with warnings.

    Model options that change how a model is loaded (``revision``, ``device``, ``dtype``,
    ``trust_remote_code``, ``device_map``) belong to the server and are refused here.
    """

    def __init__(self, url: str, *, timeout: float = 300.0,
                 warn: Callable[[str], None] | None = None, python: bool = True) -> None:
        super().__init__(use_cache=False, warn=warn, python=python)
        self.url, self.token = parse_server_url(url)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) \
                or not 0 < timeout <= 1e6:
            raise UsageError(f"timeout must be a number of seconds from 0 to 1000000, not "
                             f"{timeout!r:.40}")
        self.timeout = float(timeout)
        # The largest capture a server sends (2**25 float32 weights, base64) is ~180 MB.
        self.max_answer_bytes = 1 << 30
        self.requests = 0  # answers received (tests count them)
        self._sources: dict[str, RemoteSource] = {}
        self._default: str | None = None  # the server's default model, once asked
        host = (urllib.parse.urlsplit(self.url).hostname or "").lower()
        # A local server is reached directly, never through an http_proxy from the environment.
        handlers: list[urllib.request.BaseHandler] = [_NoRedirect(), _WatchedHTTP(),
                                                      _WatchedHTTPS()]
        if host in _LOOPBACK:
            handlers.append(urllib.request.ProxyHandler({}))
        self._opener = urllib.request.build_opener(*handlers)

    # ------------------------------------------------------------------ HTTP
    def request(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        """Send one request and return the decoded JSON answer (errors raised as attnviz's).

        ``timeout`` bounds the whole request, however slowly the server answers. A 503 with
        ``Retry-After`` (the server is busy, or a model is loading) is tried again, at most
        :data:`RETRIES` times and only while the wait fits in that time.
        """
        from attnviz._version import __version__

        data = None if body is None else json.dumps(body, ensure_ascii=False).encode("utf-8")
        headers = {"Accept": "application/json", "User-Agent": f"attnviz/{__version__}"}
        if data is not None:
            headers["Content-Type"] = "application/json"
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        deadline = _Deadline(self.timeout)
        try:
            for attempt in range(RETRIES + 1):
                try:
                    return self._attempt(method, path, data, headers, deadline)
                except _Busy as busy:
                    if attempt == RETRIES or busy.wait >= deadline.left():
                        raise busy.error from None
                    time.sleep(busy.wait)
        finally:
            deadline.cancel()
        raise AssertionError("unreachable")  # pragma: no cover - the loop returns or raises

    def _attempt(self, method: str, path: str, data: bytes | None, headers: dict[str, str],
                 deadline: _Deadline) -> Any:
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        setattr(req, _DEADLINE, deadline)  # noqa: B010 - read by the connection handlers
        try:
            with self._opener.open(req, timeout=max(deadline.left(), 0.001)) as response:
                raw = response.read(self.max_answer_bytes + 1)
        except urllib.error.HTTPError as error:
            try:
                answer = error.read(1 << 20)
            except (OSError, http.client.HTTPException):
                answer = b""
            if deadline.passed:
                raise self._timeout() from None
            failure = self._error(error.code, answer)
            wait = _retry_after(error.headers.get("Retry-After")) if error.code == 503 else None
            if wait is not None:
                raise _Busy(failure, wait) from None
            raise failure from None
        except urllib.error.URLError as error:
            reason = error.reason
            if deadline.passed or isinstance(reason, TimeoutError):
                raise self._timeout() from None
            raise ServerError(f"cannot reach the attnviz server at {self.url} ({reason})",
                              "start it with 'attnviz serve', check the address, or drop "
                              f"--server (and unset ${SERVER_ENV})") from None
        except (OSError, http.client.HTTPException) as error:  # TimeoutError included
            if deadline.passed or isinstance(error, TimeoutError):
                raise self._timeout() from None
            raise ServerError(f"the connection to the attnviz server at {self.url} failed "
                              f"({error})", "check that the server is still running") from None
        if deadline.passed:  # the answer was cut off when the time was up
            raise self._timeout()
        if len(raw) > self.max_answer_bytes:
            raise ServerError(f"the answer of the server at {self.url} is larger than "
                              f"{self.max_answer_bytes:,} bytes",
                              "select fewer layers or heads, or a shorter text")
        self.requests += 1
        try:
            return json.loads(raw)
        except (ValueError, RecursionError):  # RecursionError: nested thousands deep
            raise ServerError(f"the server at {self.url} did not answer with JSON",
                              "check that --server points at 'attnviz serve'") from None

    def _timeout(self) -> ServerError:
        return ServerError(f"the attnviz server at {self.url} did not answer within "
                           f"{self.timeout:g} s", "the server may be busy: try again")

    def _error(self, status: int, raw: bytes) -> AttnvizError:
        try:
            info = json.loads(raw)["error"]
            message, hint, kind = _clean(info["message"]), info.get("hint"), str(info.get("type"))
        except (ValueError, KeyError, TypeError, RecursionError):
            return NotAttnvizAnswer(f"the server at {self.url} answered HTTP {status}, not with "
                                    "attnviz's API",
                                    "check that --server points at 'attnviz serve'")
        hint = None if hint is None else _clean(hint)
        if kind == "LongUnsupported":  # the model cannot take the long path: a fallback
            from attnviz.long import LongUnsupported

            return LongUnsupported(message, hint)
        if status in (401, 403) and kind in ("AuthError", "Forbidden"):
            return ServerError(f"the attnviz server at {self.url}: {message}",
                               "give the address with its token as 'attnviz serve' printed it: "
                               "--server 'http://HOST:PORT/?token=...'")
        return _ERRORS.get(kind, ServerError)(message, hint)

    # ------------------------------------------------------------------ models
    def _spec(self, model: str | ModelSpec | None, **options: Any) -> ModelSpec:
        from attnviz.models import ModelSpec

        spec = make_spec(self.default_model() if model is None else model, **options)
        default = ModelSpec(name=spec.name)
        for option, flag in (("revision", "--revision"), ("trust_remote_code",
                                                          "--trust-remote-code"),
                             ("device", "--device"), ("dtype", "--dtype"),
                             ("device_map", "--device-map"), ("max_memory", "max_memory")):
            value = getattr(spec, option)
            if value != getattr(default, option):
                shown = flag if isinstance(value, bool) else f"{flag} {value}"
                raise UsageError(f"{shown} cannot be used with --server: the server loads its "
                                 "models with its own settings",
                                 f"drop {flag}, or start the server with it (attnviz serve)")
        return spec

    def default_model(self) -> str:
        """The model used when none is named: ``$ATTNVIZ_MODEL``, else the server's default
        (its first ``--model``), not this machine's."""
        chosen = os.environ.get("ATTNVIZ_MODEL", "").strip()
        if chosen:
            return chosen
        if self._default is None:
            info = self.request("GET", "/api/health")
            models = info.get("models") if isinstance(info, dict) else None
            name = info.get("default") if isinstance(info, dict) else None
            if name is None and isinstance(models, list) and models:
                name = models[0]  # a server that does not name its default: its first model
            if not isinstance(name, str) or not name.strip() or _clean(name) != name \
                    or len(name) > 500:
                raise ServerError(f"the server at {self.url} does not say which model it "
                                  "serves by default",
                                  "name one with --model, or check that --server points at "
                                  "'attnviz serve'")
            self._default = name
        return self._default

    @staticmethod
    def _model_fields(spec: ModelSpec) -> dict[str, Any]:
        return {"model": spec.name,
                "toy": dataclasses.asdict(spec.toy) if spec.toy is not None else None}

    @_for_callers
    def source(self, model: str | ModelSpec | None = None, **options: Any) -> RemoteSource:
        """The model on the server (loaded there if it is not warm yet)."""
        spec = self._spec(model, **options)
        key = spec_key(spec)
        if key not in self._sources:
            info = self.request("POST", "/api/model", self._model_fields(spec))
            self._sources[key] = RemoteSource(self, spec, info)
        return self._sources[key]

    @_for_callers
    def shape(self, model: str | ModelSpec | None = None, **options: Any) -> ModelShape | None:
        """Layers and heads of the model on the server (so indices are checked up front)."""
        from attnviz.models import ModelShape

        source = self.source(model, **options)
        return ModelShape(source.num_layers, source.num_heads)

    def is_loaded(self, model: str | ModelSpec | None = None, **options: Any) -> bool:
        """Always true: models load on the server, never in this process."""
        return True

    def forget(self, model: str | ModelSpec | None = None) -> None:
        self._sources.clear()

    # ------------------------------------------------------------------ captures
    @_for_callers
    def capture(self, text: str, pair: str | None = None, *,
                model: str | ModelSpec | None = None, layers: Selection = None,
                heads: Selection = None, max_tokens: int | None = None,
                truncate: bool = True, use_cache: bool | None = None,
                write_cache: bool = True, measure: str = "weights", **options: Any) -> Capture:
        """The capture of ``text`` from the server, weights exact (float32).

        The arguments are those of :meth:`attnviz.session.Session.capture`; the cache options
        are the server's business and are ignored here.
        """
        from attnviz.models._measure import check_measure_for

        spec = self._spec(model, **options)
        measure = check_measure_for(spec.name, measure)
        layer_text, head_text = _checked_request(text, pair, layers, heads, max_tokens)
        body = {**self._model_fields(spec), "text": text, "pair": pair,
                "layers": layer_text, "heads": head_text,
                "max_tokens": max_tokens, "truncate": truncate, "weights": "float32"}
        if measure != "weights":  # a server of an earlier version knows attention only
            body["measure"] = measure
        payload = self.request("POST", "/api/capture", body)
        self.forwards += 1
        capture = capture_from_payload(payload)
        self._check_answer(capture, spec, text, pair, layer_text, head_text, measure)
        return capture

    def _check_answer(self, capture: Capture, spec: ModelSpec, text: str, pair: str | None,
                      layers: str | None, heads: str | None, measure: str = "weights") -> None:
        """Refuse a capture of something else than was asked for: another text or pair,
        other layers or heads, or another shape than the server said its model has.

        Raises:
            ServerError: the answer does not match the request.
        """
        from attnviz.selection import parse_selection

        wrong = []
        if capture.text != text:
            wrong.append("its text is not the text sent")
        if capture.pair != pair:
            wrong.append("its pair is not the pair sent" if pair is not None
                         else "it holds a pair although none was sent")
        if capture.measure != measure:
            wrong.append(f"it holds the measure {capture.measure}, not {measure}")
        known = self._sources.get(spec_key(spec))
        if known is not None and (capture.num_layers, capture.num_heads) != (
                known.num_layers, known.num_heads):
            wrong.append(f"its model has {capture.num_layers} layers x {capture.num_heads} "
                         f"heads, not {known.num_layers} x {known.num_heads}")
        for what, chosen, size, got in (("layer", layers, capture.num_layers, capture.layers),
                                        ("head", heads, capture.num_heads, capture.heads)):
            try:
                expected = parse_selection(chosen, size, what)
            except UsageError:
                expected = None
            if got != expected:
                wrong.append(f"its {what}s are {_brief(got)}, not {_brief(expected)}")
        if wrong:
            raise ServerError(f"the server at {self.url} answered with another capture than "
                              f"the one asked for: {'; '.join(wrong)}",
                              "check that --server points at 'attnviz serve' of this version")

    @_for_callers
    def dump(self, text: str, path: Path | str, pair: str | None = None, *,
             model: str | ModelSpec | None = None, layers: Selection = None,
             heads: Selection = None, max_tokens: int | None = None, truncate: bool = True,
             float16: bool = False, use_cache: bool | None = None, write_cache: bool = True,
             measure: str = "weights", **options: Any) -> tuple[Path, Capture]:
        """Capture ``text`` on the server and write the record to ``path`` (``attnviz dump``)."""
        from attnviz.stream import write_capture

        capture = self.capture(text, pair, model=model, layers=layers, heads=heads,
                               max_tokens=max_tokens, truncate=truncate, measure=measure,
                               **options)
        return write_capture(capture, path, float16=float16), capture

    # ------------------------------------------------------------------ long inputs
    def wants_long(self, request: CaptureRequest, text: str, pair: str | None, *,
                   dumping: bool = False) -> bool:
        """Whether the long path answers: ``request.long``, else the server's own decision
        (from the size of a full capture there, ``/api/long/plan``; ``dumping`` changes
        nothing: a long capture is not dumped through a server)."""
        if request.long is not None:
            return request.long
        spec = self._spec(request.model)
        body = {**self._model_fields(spec), "text": text, "pair": pair,
                "layers": request.layers, "heads": request.heads,
                "max_tokens": request.max_tokens, "truncate": request.truncate}
        try:
            answer = self.request("POST", "/api/long/plan", body)
        except NotAttnvizAnswer:
            answer = None
        if not isinstance(answer, dict) or not isinstance(answer.get("long"), bool):
            # A server without the long path (an older attnviz): the full capture answers, and
            # the server's own size limit refuses what it cannot hold.
            return False
        if answer["long"]:
            self._note("the server takes the long path for this text: a full capture would not "
                       "fit its limit (--no-long asks for the full capture)")
        return bool(answer["long"])

    def token_count(self, request: CaptureRequest, text: str, pair: str | None) -> int:
        """An upper bound (the tokenizer is on the server)."""
        return self._token_bound(request, text, pair)

    @_for_callers
    def capture_long(self, text: str, pair: str | None = None, *,
                     model: str | ModelSpec | None = None, layers: Any = None,
                     max_tokens: int | None = None, truncate: bool = True,
                     dtype: str = "float32", folder: Path | str | None = None,
                     summary: bool = False, k: int = 0, progress: Any = None,
                     **options: Any) -> RemoteLongCapture:
        """A long capture made and kept by the server; reads of it are requests
        (:class:`~attnviz.server.long_client.RemoteLongCapture`). ``summary`` and ``k`` are
        the server's business (it streams statistics and atlas levels itself) and are not
        sent; the forward runs there, so ``progress`` hears nothing.

        Raises:
            UsageError: ``folder`` is given (queries and keys stay on the server).
        """
        from attnviz.server.long_client import RemoteLongCapture

        if folder is not None:
            raise UsageError("a long capture made through --server stays on the server: its "
                             "queries and keys are not sent, so it cannot be written here",
                             "run attnviz dump --long on the server's machine, or leave out "
                             "--server")
        spec = self._spec(model, **options)
        layer_text, _ = _checked_request(text, pair, layers, None, max_tokens)
        body = {**self._model_fields(spec), "text": text, "pair": pair, "layers": layer_text,
                "max_tokens": max_tokens, "truncate": truncate, "dtype": dtype}
        answer = self.request("POST", "/api/long/capture", body)
        try:
            cap = RemoteLongCapture(self, answer)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ServerError(f"the server's answer is not a long capture ({exc})",
                              "check that --server points at 'attnviz serve' of this version"
                              ) from None
        self.forwards += 1
        if cap.text != text or cap.pair != pair:
            raise ServerError(f"the server at {self.url} answered with a long capture of "
                              "another text", "check that --server points at 'attnviz serve' "
                              "of this version")
        if layer_text:
            from attnviz.selection import parse_selection

            try:
                wanted: list[int] | None = parse_selection(layer_text, cap.num_layers, "layer")
            except UsageError:
                wanted = None  # the server's model has fewer layers than the ones asked for
            if wanted != cap.layers:
                raise ServerError(f"the server at {self.url} answered with a long capture of "
                                  f"layers {cap.layers[:8]}, not --layers {layer_text}",
                                  "check that --server points at 'attnviz serve' of this "
                                  "version")
        for message in cap.meta.get("warnings", []):
            self._note(str(message))
        return cap

    def _captures(self, texts: Sequence[tuple[str, str | None]], *,
                  model: str | ModelSpec | None, batch_size: int, layers: Selection,
                  heads: Selection, max_tokens: int | None, truncate: bool,
                  use_cache: bool | None, write_cache: bool,
                  check: Callable[[str, str | None], None] | None, measure: str = "weights"
                  ) -> Iterator[Capture | InputError]:
        """:meth:`Session.captures` over the server: one request per ``(text, pair)``, in
        order (the server runs one forward at a time per model)."""
        for text, pair in _text_pairs(texts):
            try:
                if check is not None:
                    check(text, pair)
                yield self.capture(text, pair, model=model, layers=layers, heads=heads,
                                   max_tokens=max_tokens, truncate=truncate, measure=measure)
            except InputError as error:
                yield error


def _brief(indices: list[int] | None) -> str:
    if indices is None:
        return "none of this model's"
    shown = ", ".join(str(i) for i in indices[:8])
    return f"[{shown}{', ...' if len(indices) > 8 else ''}]"


#: The largest vocabulary the induction test accepts from a server (the largest models' are
#: about 256k tokens; the random draws need an array of this many token positions).
MAX_VOCAB = 1 << 22


class RemoteSource:
    """A model loaded on the server, with the surface of a local source.

    ``capture`` goes to the server; ``attention_on_ids``, ``vocab_size`` and ``prefix_ids`` let
    :func:`attnviz.analysis.induction.induction_scores` run the induction test there, drawing
    the same random tokens as a local run (the ids sent are positions in the server's list of
    usable tokens).
    """

    def __init__(self, session: RemoteSession, spec: ModelSpec, info: dict[str, Any]) -> None:
        try:
            self.name = _clean(info["name"])  # shown in titles: no terminal escapes
            self.num_layers = int(info["num_layers"])
            self.num_heads = int(info["num_heads"])
            self._identity = dict(info.get("identity") or {})
            induction = info.get("induction") or {}
        except (KeyError, TypeError, ValueError) as exc:
            raise ServerError(f"the server's answer does not describe a model ({exc})") from None
        self._session = session
        self._spec = spec
        self._induction = induction if isinstance(induction, dict) else {}

    def identity(self) -> dict[str, object]:
        return dict(self._identity)

    def capture(self, text: str, pair: str | None = None, *, layers: list[int] | None = None,
                heads: list[int] | None = None, max_tokens: int | None = None,
                truncate: bool = True, measure: str = "weights") -> Capture:
        return self._session.capture(text, pair, model=self._spec, layers=layers, heads=heads,
                                     max_tokens=max_tokens, truncate=truncate, measure=measure)

    def _induction_info(self, key: str) -> Any:
        if key not in self._induction:
            raise UsageError("the induction test cannot run on this server's model",
                             "add --no-induction, or run without --server")
        return self._induction[key]

    def _count(self, key: str, low: int, high: int) -> int:
        """A whole number the server gave for the induction test, checked before any use."""
        value = self._induction_info(key)
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ServerError(f"the server's model description gives the induction test "
                              f"{key} {_clean(repr(value))[:60]}; it must be a whole number "
                              f"from {low:,} to {high:,}",
                              "add --no-induction, or check that --server points at "
                              "'attnviz serve'")
        return value

    @property
    def vocab_size(self) -> int:
        """The number of usable tokens on the server (bounded by :data:`MAX_VOCAB`)."""
        return self._count("vocab_size", 1, MAX_VOCAB)

    @property
    def prefix_ids(self) -> list[int]:
        prefix = self._induction_info("prefix")
        if not isinstance(prefix, list) or len(prefix) > 16 or not all(
                isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 1 << 40
                for i in prefix):
            raise ServerError("the server's model description gives the induction test a "
                              "prefix that is not a short list of token ids",
                              "add --no-induction, or check that --server points at "
                              "'attnviz serve'")
        return [int(i) for i in prefix]

    @property
    def max_tokens(self) -> int | None:
        if self._induction_info("max_tokens") is None:
            return None
        return self._count("max_tokens", 2, 1 << 30)

    def attention_on_ids(self, ids: list[int]) -> np.ndarray:
        """``[layer, head, T, T]`` of the model on ``prefix_ids`` + token positions."""
        from attnviz.server.engine import decode_float32

        body = {**RemoteSession._model_fields(self._spec), "ids": [int(i) for i in ids]}
        payload = self._session.request("POST", "/api/induction", body)
        try:
            return decode_float32(payload["weights"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ServerError(f"the server's answer holds no weights ({exc})") from None
