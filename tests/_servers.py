"""A real attnviz server for tests: an app on a free loopback port, uvicorn in a thread."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def thread_server(app: Any, *, start_timeout: float = 20.0) -> Iterator[str]:
    """Serve ``app`` on 127.0.0.1 (a free port) while the block runs; yields its address.

    The server is stopped and its socket closed on the way out, whatever the block did.
    """
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + start_timeout
        while not server.started:
            assert time.monotonic() < deadline, "the test server did not start"
            time.sleep(0.02)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


class ServeProcess:
    """``attnviz serve`` in a subprocess on 127.0.0.1, port chosen by the system, in its own
    process group (so :meth:`close` ends it with everything it started).

    The constructor returns once the address line matching ``pattern`` (its first group is
    :attr:`url`) is printed, failing with the output so far past ``start_timeout`` seconds or
    when the process ends first. Every output line (stdout and stderr) lands in :attr:`output`
    and :attr:`lines`.
    """

    def __init__(self, *args: str, env: dict[str, str] | None = None,
                 pattern: str = r"attnviz serve: (http://127\.0\.0\.1:\d+/)",
                 start_timeout: float = 60.0) -> None:
        import os
        import queue
        import re
        import subprocess
        import sys

        environment = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                       **(env or {})}
        environment.pop("ATTNVIZ_SERVER", None)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "attnviz", "serve", "--host", "127.0.0.1", "--port", "0",
             *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=environment, start_new_session=True)
        self.lines: queue.Queue[str] = queue.Queue()
        self.output: list[str] = []
        for stream in (self.process.stdout, self.process.stderr):
            threading.Thread(target=self._read, args=(stream,), daemon=True).start()
        self.url = ""
        try:
            deadline = time.monotonic() + start_timeout
            while not self.url:
                assert time.monotonic() < deadline and self.process.poll() is None, self.text()
                try:
                    line = self.lines.get(timeout=0.2)
                except queue.Empty:
                    continue
                match = re.search(pattern, line)
                self.url = match.group(1) if match else ""
        except BaseException:
            self.close()
            raise

    def _read(self, stream: Any) -> None:
        for line in stream:
            self.output.append(line)
            self.lines.put(line)

    def text(self) -> str:
        return "".join(self.output)

    def close(self) -> None:
        """End the server and its process group, if still running."""
        import os
        import signal

        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(30)

    def __enter__(self) -> ServeProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def tampering_proxy(app: Any, tamper: Any) -> Iterator[str]:
    """A loopback HTTP server that passes each request to ``app`` (in-process, Starlette's
    TestClient) and answers with ``tamper(path, answer)``: the app's JSON answer, changed (a
    hostile server that speaks attnviz's API almost right). Yields its address."""
    import http.server
    import json

    from starlette.testclient import TestClient

    client = TestClient(app, base_url="http://127.0.0.1:8000")

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = self.rfile.read(int(self.headers.get("content-length") or 0))
            path = self.path.split("?", 1)[0]
            response = client.request(self.command, path, content=body or None,
                                      headers={"content-type": "application/json"})
            answer = response.json() if response.status_code == 200 else None
            data = (json.dumps(tamper(path, answer)).encode() if answer is not None
                    else response.content)
            self.send_response(response.status_code)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST  # noqa: N815

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                              daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)
