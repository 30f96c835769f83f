"""Take a screenshot of the live page of ``attnviz serve`` (the README's "Explore live" picture).

Usage::

    python scripts/screenshot_serve.py sample_outputs/serve_live.png

Starts ``attnviz serve --model minilm --model toy`` on a free port of 127.0.0.1 (stopped again,
with its process group, whatever happens), opens the page in headless Chromium with every
request that is not for that server blocked, clicks a token so its row shows beside the views,
and saves the viewport. Chromium comes from the system (``bash scripts/install_browser.sh``).
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import quote_plus

from chromium_shot import finish, guarded_page, png_parser, written

SAMPLE_TEXT = "The cat sat on the mat because it was warm."
SAMPLE_FRAGMENT = "#text=" + quote_plus(SAMPLE_TEXT) + "&view=head&layer=5&heads=4,11&query=8"


def start_server() -> tuple[subprocess.Popen[str], str]:
    """``attnviz serve`` on a free port; returns the process and the page's address."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.pop("ATTNVIZ_SERVER", None)
    process = subprocess.Popen(
        [sys.executable, "-m", "attnviz", "serve", "--model", "minilm", "--model", "toy",
         "--host", "127.0.0.1", "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        start_new_session=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in process.stdout or []],
                     daemon=True).start()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and process.poll() is None:
        try:
            line = lines.get(timeout=0.5)
        except queue.Empty:
            continue
        match = re.search(r"attnviz serve: (http://127\.0\.0\.1:\d+/)", line)
        if match:
            return process, match.group(1)
    stop_server(process)
    raise SystemExit("error: attnviz serve did not start")


def stop_server(process: subprocess.Popen[str]) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=30)


def warm_up(url: str) -> None:
    """Load MiniLM on the server and run it once (``POST /api/capture``)."""
    import json
    import urllib.request

    body = json.dumps({"model": "minilm", "text": "A first text loads the model."}).encode()
    request = urllib.request.Request(url + "api/capture", data=body,
                                     headers={"Content-Type": "application/json"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(request, timeout=120) as response:
        response.read()


def screenshot_serve(png_path: Path | str, *, width: int = 1280, height: int = 720) -> Path:
    """Screenshot of the live page with MiniLM, the head view and the row of "it"."""
    png_path = Path(png_path)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    problems: list[str] = []
    process, url = start_server()
    try:
        warm_up(url)  # load the model first, so the page shows a warm request's time
        with guarded_page(width, height, (url,), problems) as page:
            page.goto(url + SAMPLE_FRAGMENT)
            page.wait_for_selector("html[data-ready='1']", state="attached", timeout=120_000)
            page.wait_for_selector("#row-panel:not([hidden])", timeout=30_000)
            page.wait_for_timeout(300)
            page.screenshot(path=str(png_path))
    finally:
        stop_server(process)
    return finish(png_path, problems, "the live page")


def main(argv: list[str] | None = None) -> int:
    args = png_parser(__doc__, width=1280, height=720).parse_args(argv)
    return written(screenshot_serve(args.png, width=args.width, height=args.height))


if __name__ == "__main__":
    sys.exit(main())
