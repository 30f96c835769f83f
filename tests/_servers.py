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
