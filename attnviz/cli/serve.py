"""``serve``: the live web app and JSON API of :mod:`attnviz.server`, on uvicorn.

The command checks its options, binds the socket (so a busy port is a clear error, and
``--port 0`` picks a free one), prints the address and runs the app until Ctrl-C. Starlette,
uvicorn and the models are imported inside the command, so ``--help`` stays fast.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from attnviz.cli._app import app
from attnviz.cli._common import (
    MODEL_PANEL,
    OUTPUT_PANEL,
    handle_errors,
    stderr,
    stdout,
    warn,
)
from attnviz.errors import AttnvizError, UsageError

if TYPE_CHECKING:
    from attnviz.long import LongCapture
    from attnviz.server.engine import Limits

SERVER_PANEL = "Server"
SERVE_HELP = "\n\n".join([
    "Explore attention live in the browser: type a sentence and see every head at once.",
    "Starts a local web app with a JSON API beside it. The page shows the head view, model "
    "view, heatmap and head statistics of the text as you type, a top-k panel, a token's row "
    "when you click it (and, for the toy model, the step-by-step Q/K/V/softmax calculation), "
    "and downloads: a PNG of the view, the capture (attention.npy + capture.json) and the "
    "top-k CSV. The models stay loaded, so a new sentence takes milliseconds, not seconds.",
    "Safe by default: the server answers on 127.0.0.1 only. Any other --host needs a token, "
    "generated and printed with the address (--no-token turns that off explicitly). Requests "
    "can use only the models given with --model (--allow-any-model lets them name any hub id "
    "or folder) and never name a file. Other commands can use the running server with "
    "--server URL (or $ATTNVIZ_SERVER) instead of loading the model themselves.",
    "With --long-from DIR (a saved long capture) the page /long shows one head's attention "
    "over the whole context, zoomable from the block atlas down to exact token weights, "
    "computed on demand from the capture's queries, keys and log-sum-exp.",
    "Examples:",
    "  attnviz serve --open",
    "  attnviz serve --long-from book_long/ --open",
    "  attnviz serve --model minilm --model toy --port 8001",
    "  attnviz heatmap \"The cat sat on the mat\" --server http://127.0.0.1:8000",
])


def _is_loopback(host: str) -> bool:
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:
        return False


def _bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` (``port`` 0: a free one), or a clear error."""
    try:
        infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise UsageError(f"cannot listen on host {host!r}: {exc.strerror}",
                         "use an address of this machine, e.g. --host 127.0.0.1") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        if port and exc.errno in (98, 48, 10048):  # EADDRINUSE on Linux, macOS, Windows
            # Not a mistake on the command line (exit 2) but the machine's state, as when
            # any other server finds its port taken: exit 1.
            raise AttnvizError(f"port {port} on {host} is in use",
                               "pick another with --port, or --port 0 for a free one") from None
        raise UsageError(f"cannot listen on {host}:{port}: {exc.strerror or exc}",
                         "pick another --port (ports below 1024 need root) or --host") from None
    sock.set_inheritable(True)
    return sock


def _allowed_hosts(host: str) -> tuple[str, ...] | None:
    """The ``Host`` names a server bound to ``host`` answers to: ``None`` (any, guarded by the
    token) beyond this machine; on a loopback address, the usual local names and the address
    itself, so the address ``serve`` prints (e.g. ``http://127.0.0.2:8000/``) is answered."""
    from attnviz.server.app import LOCAL_HOSTS

    if not _is_loopback(host):
        return None
    own = host.strip().strip("[]").lower()
    return LOCAL_HOSTS if own in LOCAL_HOSTS else (*LOCAL_HOSTS, own)


class _HideToken(logging.Filter):
    """Log records without the token: ``token=...`` in a request line (``GET /?token=...``)
    becomes ``token=***``, and the server's own token nowhere appears."""

    def __init__(self, token: str | None) -> None:
        super().__init__()
        self.token = token

    def _hide(self, value: Any) -> Any:
        if not isinstance(value, str):
            return value
        shown = re.sub(r"(token=)[^&\s\"'#;]*", r"\1***", value, flags=re.IGNORECASE)
        return shown.replace(self.token, "***") if self.token else shown

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg = self._hide(record.msg)
        if isinstance(record.args, tuple):
            record.args = tuple(self._hide(arg) for arg in record.args)
        elif isinstance(record.args, dict):
            record.args = {key: self._hide(arg) for key, arg in record.args.items()}
        return True


def _address(host: str, port: int, token: str | None) -> list[str]:
    """The addresses to print: where a browser on this machine (or another) finds the app."""
    query = f"?token={token}" if token else ""
    host = host.strip().strip("[]")  # --host [::1] as well as --host ::1
    if host in ("0.0.0.0", "::", ""):
        names = ["127.0.0.1", socket.gethostname()]
    else:
        names = [host]
    return [f"http://{f'[{name}]' if ':' in name else name}:{port}/{query}" for name in names]


@app.command("serve", help=SERVE_HELP)
@handle_errors
def serve_command(
    models: Annotated[list[str] | None, typer.Option(
        "--model", "-m", rich_help_panel=MODEL_PANEL, show_default=False, metavar="NAME",
        help="A model to serve: 'minilm' (the default), 'toy', a Hugging Face id or a local "
             "folder. Repeat for several; the first is the default (also of --server "
             "clients). Each is loaded before the address is printed.")] = None,
    host: Annotated[str, typer.Option(
        "--host", rich_help_panel=SERVER_PANEL,
        help="Address to listen on. Anything but 127.0.0.1/localhost needs the printed "
             "token.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(
        "--port", "-p", min=0, max=65535, rich_help_panel=SERVER_PANEL,
        help="Port to listen on; 0 picks a free one.")] = 8000,
    open_browser: Annotated[bool, typer.Option(
        "--open", rich_help_panel=SERVER_PANEL,
        help="Open the page in the default web browser.")] = False,
    no_token: Annotated[bool, typer.Option(
        "--no-token", rich_help_panel=SERVER_PANEL,
        help="Serve another --host without a token (anyone who can reach it can use it).")
    ] = False,
    allow_any_model: Annotated[bool, typer.Option(
        "--allow-any-model", rich_help_panel=MODEL_PANEL,
        help="Let requests load any Hugging Face id or folder they name, not only --model.")
    ] = False,
    device: Annotated[str, typer.Option(
        "--device", rich_help_panel=MODEL_PANEL,
        help="auto, cpu, cuda, cuda:N or mps for the models.")] = "auto",
    dtype: Annotated[str, typer.Option(
        "--dtype", rich_help_panel=MODEL_PANEL,
        help="float32, float16 or bfloat16 for the models.")] = "float32",
    threads: Annotated[int | None, typer.Option(
        "--threads", min=1, max=1024, rich_help_panel=MODEL_PANEL, show_default=False,
        help="CPU threads per forward pass (default: torch's choice; 1 is steadier on a "
             "busy machine).")] = None,
    max_tokens: Annotated[int, typer.Option(
        "--max-tokens", min=1, max=1_000_000, rich_help_panel=SERVER_PANEL,
        help="Most tokens per text (longer texts are cut, with a warning, or refused with "
             "truncate=false).")] = 512,
    long_max_tokens: Annotated[int, typer.Option(
        "--long-max-tokens", min=1, max=1 << 20, rich_help_panel=SERVER_PANEL,
        help="Most tokens of a long capture (/api/long/capture, --long of a client); the "
             "server keeps its last 4.")] = 131072,
    max_chars: Annotated[int, typer.Option(
        "--max-chars", min=1, max=10_000_000, rich_help_panel=SERVER_PANEL,
        help="Most characters of text plus pair per request.")] = 20_000,
    queue: Annotated[int, typer.Option(
        "--queue", min=0, max=10_000, rich_help_panel=SERVER_PANEL,
        help="Requests that may wait for a model behind the running one; more get 503.")] = 8,
    timeout: Annotated[float, typer.Option(
        "--timeout", min=1, max=86_400, rich_help_panel=SERVER_PANEL,
        help="Seconds a request may wait and run before it gets 503.")] = 60.0,
    access_log: Annotated[bool, typer.Option(
        "--log", rich_help_panel=OUTPUT_PANEL, help="Print a line per request.")] = False,
    long_from: Annotated[Path | None, typer.Option(
        "--long-from", rich_help_panel=SERVER_PANEL, metavar="DIR", show_default=False,
        help="A saved long capture to explore at /long: the zoomable view of one head over "
             "the whole context (atlas levels, exact tiles on demand).")] = None,
) -> None:
    from attnviz.server.engine import Limits

    # A character takes up to 6 bytes in JSON (\uXXXX escapes): room for text and pair.
    limits = Limits(max_body_bytes=max(256 * 1024, 12 * max_chars + 16 * 1024),
                    max_chars=max_chars, max_tokens=max_tokens, queue=queue, timeout_s=timeout,
                    long_max_tokens=long_max_tokens)
    limits.check()
    local = _is_loopback(host)
    token = None
    if not local and not no_token:
        import secrets

        token = secrets.token_urlsafe(24)
    long_capture = None
    if long_from is not None:
        from attnviz.long import load_long

        long_capture = load_long(long_from)
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    sock = _bind(host, port)
    if not local and no_token:  # the port bound (--port 0: the system's choice)
        warn(f"--no-token: anyone who can reach {host}:{sock.getsockname()[1]} can use this "
             "server")
    try:
        _serve(sock, list(models or []), host, token, allow_any_model, limits, device, dtype,
               open_browser, access_log, long_capture)
    finally:
        sock.close()


def _serve(sock: socket.socket, models: list[str], host: str, token: str | None,
           allow_any_model: bool, limits: Limits, device: str, dtype: str,
           open_browser: bool, access_log: bool, long_capture: LongCapture | None = None
           ) -> None:
    import uvicorn
    from rich.markup import escape

    from attnviz.server.app import create_app

    port = int(sock.getsockname()[1])
    application = create_app(models, token=token, allow_any_model=allow_any_model,
                             limits=limits, allowed_hosts=_allowed_hosts(host),
                             device=device, dtype=dtype, long_capture=long_capture)
    engine = application.state.engine
    # The served models load now, before the address is printed: a client that reads it may
    # use the server at once, without paying for the load.
    for name in engine.models:
        with stderr.status(f"Loading {name}...", spinner="dots"):
            failed = engine.load(name)
        if failed is not None:
            warn(escape(f"{name} could not be loaded ({failed}); requests for it will try "
                        "again"))
    addresses = _address(host, port, token)
    stdout.print(f"attnviz serve: {addresses[0]}", markup=False, highlight=False)
    for other in addresses[1:]:
        stdout.print(f"  or {other}", markup=False, highlight=False)
    stdout.print(f"Models: {', '.join(engine.models)}"
                 + (" (and any a request names)" if allow_any_model else "")
                 + ". Press Ctrl-C to stop.", markup=False, highlight=False)
    if long_capture is not None:
        base, mark, query = addresses[0].partition("?")
        addresses.insert(0, f"{base}long{mark}{query}")
        stdout.print(f"Long context ({int(long_capture.num_tokens):,} tokens): {addresses[0]}",
                     markup=False, highlight=False)
    stdout.file.flush()
    # --log: uvicorn's access lines (info level), with any token in them hidden.
    config = uvicorn.Config(application, log_level="info" if access_log else "warning",
                            access_log=access_log, timeout_graceful_shutdown=5, lifespan="on",
                            server_header=False)
    hide = _HideToken(token)
    loggers = [logging.getLogger(name) for name in ("uvicorn", "uvicorn.error", "uvicorn.access")]
    hidden: list[logging.Filterer] = [*loggers, *(h for logger in loggers for h in logger.handlers)]
    for where in hidden:
        where.addFilter(hide)
    runner = application.state.runner

    class Server(uvicorn.Server):
        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            # Ctrl-C: requests waiting for a model (a load can take minutes) get their 503
            # now, so the shutdown does not wait for them and cancel them with a traceback.
            runner.stop()
            await super().shutdown(sockets)

    server = Server(config)
    if open_browser:
        import threading
        import webbrowser

        threading.Timer(0.5, webbrowser.open, [addresses[0]]).start()
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C after its clean shutdown
        pass
    finally:
        for where in hidden:
            where.removeFilter(hide)
    stdout.print("Stopped.", markup=False)
    if runner.pool.running():
        # A forward pass (or a load) still runs on a worker thread, its answer dropped: the
        # interpreter's exit would tear down torch's busy threads and abort ("terminate called
        # without an active exception", exit -6). The server writes no files, so nothing is
        # lost by ending the process here.
        stdout.file.flush()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
