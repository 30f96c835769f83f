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
import json
import re
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
    OutputError,
    UsageError,
)
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

SERVER_ENV = "ATTNVIZ_SERVER"
_ERRORS: dict[str, type[AttnvizError]] = {
    cls.__name__: cls for cls in (UsageError, InputError, ModelLoadError, DeviceError, DumpError,
                                  OutputError)}
_LOOPBACK = ("127.0.0.1", "localhost", "::1")


class ServerError(AttnvizError):
    """The server cannot be reached, needs a token, or did not answer with attnviz's API."""


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
        return _capture_from(payload, weights)
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
        raise ServerError(f"the server's answer is not a capture ({exc})",
                          "check that --server points at 'attnviz serve' of this version"
                          ) from None


class RemoteSession(Session):
    """A :class:`~attnviz.session.Session` whose captures come from ``attnviz serve``.

    Args:
        url: the server's address, e.g. ``http://127.0.0.1:8000``; a ``?token=...`` in it (as
            ``attnviz serve`` prints it for other hosts) is sent as ``Authorization: Bearer``.
        timeout: seconds to wait for one answer.
        warn: called with warnings.

    Model options that change how a model is loaded (``revision``, ``device``, ``dtype``,
    ``trust_remote_code``, ``device_map``) belong to the server and are refused here.
    """

    def __init__(self, url: str, *, timeout: float = 300.0,
                 warn: Callable[[str], None] | None = None, python: bool = True) -> None:
        super().__init__(use_cache=False, warn=warn, python=python)
        self.url, self.token = parse_server_url(url)
        self.timeout = timeout
        # The largest capture a server sends (2**25 float32 weights, base64) is ~180 MB.
        self.max_answer_bytes = 1 << 30
        self.requests = 0  # answers received (tests count them)
        self._sources: dict[str, RemoteSource] = {}
        host = (urllib.parse.urlsplit(self.url).hostname or "").lower()
        # A local server is reached directly, never through an http_proxy from the environment.
        handlers: list[urllib.request.BaseHandler] = [_NoRedirect()]
        if host in _LOOPBACK:
            handlers.append(urllib.request.ProxyHandler({}))
        self._opener = urllib.request.build_opener(*handlers)

    # ------------------------------------------------------------------ HTTP
    def request(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        """Send one request and return the decoded JSON answer (errors raised as attnviz's)."""
        from attnviz._version import __version__

        data = None if body is None else json.dumps(body, ensure_ascii=False).encode("utf-8")
        headers = {"Accept": "application/json", "User-Agent": f"attnviz/{__version__}"}
        if data is not None:
            headers["Content-Type"] = "application/json"
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        try:
            with self._opener.open(req, timeout=self.timeout) as response:
                raw = response.read(self.max_answer_bytes + 1)
        except urllib.error.HTTPError as error:
            raise self._error(error.code, error.read(1 << 20)) from None
        except urllib.error.URLError as error:
            reason = error.reason
            if isinstance(reason, TimeoutError):
                raise self._timeout() from None
            raise ServerError(f"cannot reach the attnviz server at {self.url} ({reason})",
                              "start it with 'attnviz serve', check the address, or drop "
                              f"--server (and unset ${SERVER_ENV})") from None
        except TimeoutError:
            raise self._timeout() from None
        except (ConnectionError, OSError) as error:
            raise ServerError(f"the connection to the attnviz server at {self.url} failed "
                              f"({error})", "check that the server is still running") from None
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
            return ServerError(f"the server at {self.url} answered HTTP {status}, not with "
                               "attnviz's API", "check that --server points at 'attnviz serve'")
        hint = None if hint is None else _clean(hint)
        if status in (401, 403) and kind in ("AuthError", "Forbidden"):
            return ServerError(f"the attnviz server at {self.url}: {message}",
                               "give the address with its token as 'attnviz serve' printed it: "
                               "--server 'http://HOST:PORT/?token=...'")
        return _ERRORS.get(kind, ServerError)(message, hint)

    # ------------------------------------------------------------------ models
    def _spec(self, model: str | ModelSpec | None, **options: Any) -> ModelSpec:
        from attnviz.models import ModelSpec

        spec = make_spec(model, **options)
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
                write_cache: bool = True, **options: Any) -> Capture:
        """The capture of ``text`` from the server, weights exact (float32).

        The arguments are those of :meth:`attnviz.session.Session.capture`; the cache options
        are the server's business and are ignored here.
        """
        spec = self._spec(model, **options)
        layer_text, head_text = _checked_request(text, pair, layers, heads, max_tokens)
        body = {**self._model_fields(spec), "text": text, "pair": pair,
                "layers": layer_text, "heads": head_text,
                "max_tokens": max_tokens, "truncate": truncate, "weights": "float32"}
        payload = self.request("POST", "/api/capture", body)
        self.forwards += 1
        return capture_from_payload(payload)

    @_for_callers
    def dump(self, text: str, path: Path | str, pair: str | None = None, *,
             model: str | ModelSpec | None = None, layers: Selection = None,
             heads: Selection = None, max_tokens: int | None = None, truncate: bool = True,
             float16: bool = False, use_cache: bool | None = None, write_cache: bool = True,
             **options: Any) -> tuple[Path, Capture]:
        """Capture ``text`` on the server and write the record to ``path`` (``attnviz dump``)."""
        from attnviz.stream import write_capture

        capture = self.capture(text, pair, model=model, layers=layers, heads=heads,
                               max_tokens=max_tokens, truncate=truncate, **options)
        return write_capture(capture, path, float16=float16), capture

    def _captures(self, texts: Sequence[tuple[str, str | None]], *,
                  model: str | ModelSpec | None, batch_size: int, layers: Selection,
                  heads: Selection, max_tokens: int | None, truncate: bool,
                  use_cache: bool | None, write_cache: bool,
                  check: Callable[[str, str | None], None] | None
                  ) -> Iterator[Capture | InputError]:
        """:meth:`Session.captures` over the server: one request per ``(text, pair)``, in
        order (the server runs one forward at a time per model)."""
        for text, pair in _text_pairs(texts):
            try:
                if check is not None:
                    check(text, pair)
                yield self.capture(text, pair, model=model, layers=layers, heads=heads,
                                   max_tokens=max_tokens, truncate=truncate)
            except InputError as error:
                yield error


class RemoteSource:
    """A model loaded on the server, with the surface of a local source.

    ``capture`` goes to the server; ``attention_on_ids``, ``vocab_size`` and ``prefix_ids`` let
    :func:`attnviz.analysis.induction.induction_scores` run the induction test there, drawing
    the same random tokens as a local run (the ids sent are positions in the server's list of
    usable tokens).
    """

    def __init__(self, session: RemoteSession, spec: ModelSpec, info: dict[str, Any]) -> None:
        try:
            self.name = str(info["name"])
            self.num_layers = int(info["num_layers"])
            self.num_heads = int(info["num_heads"])
            self._identity = dict(info.get("identity") or {})
            induction = info.get("induction") or {}
        except (KeyError, TypeError, ValueError) as exc:
            raise ServerError(f"the server's answer does not describe a model ({exc})") from None
        self._session = session
        self._spec = spec
        self._induction = induction

    def identity(self) -> dict[str, object]:
        return dict(self._identity)

    def capture(self, text: str, pair: str | None = None, *, layers: list[int] | None = None,
                heads: list[int] | None = None, max_tokens: int | None = None,
                truncate: bool = True) -> Capture:
        return self._session.capture(text, pair, model=self._spec, layers=layers, heads=heads,
                                     max_tokens=max_tokens, truncate=truncate)

    def _induction_info(self, key: str) -> Any:
        if key not in self._induction:
            raise UsageError("the induction test cannot run on this server's model",
                             "add --no-induction, or run without --server")
        return self._induction[key]

    @property
    def vocab_size(self) -> int:
        return int(self._induction_info("vocab_size"))

    @property
    def prefix_ids(self) -> list[int]:
        return [int(i) for i in self._induction_info("prefix")]

    @property
    def max_tokens(self) -> int | None:
        value = self._induction_info("max_tokens")
        return None if value is None else int(value)

    def attention_on_ids(self, ids: list[int]) -> np.ndarray:
        """``[layer, head, T, T]`` of the model on ``prefix_ids`` + token positions."""
        from attnviz.server.engine import decode_float32

        body = {**RemoteSession._model_fields(self._spec), "ids": [int(i) for i in ids]}
        payload = self._session.request("POST", "/api/induction", body)
        try:
            return decode_float32(payload["weights"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ServerError(f"the server's answer holds no weights ({exc})") from None
