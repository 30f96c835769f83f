"""What the screenshot scripts share: the system Chromium, a guarded page and the PNG's size.

``guarded_page`` opens one headless Chromium page with every request outside the allowed
address prefixes blocked; blocked requests, console errors and page errors are collected, and
``finish`` turns them into an error after the browser is closed. Chromium comes from the
system (``bash scripts/install_browser.sh``), driven by Playwright for Python.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
MAX_BYTES = 300_000


def chromium_binary() -> str:
    """The system Chromium, or a clear error naming the install script."""
    for candidate in ("/usr/bin/chromium", shutil.which("chromium"),
                      shutil.which("chromium-browser")):
        if candidate and Path(candidate).is_file():
            return candidate
    raise SystemExit("error: no Chromium found; install it with: bash scripts/install_browser.sh")


@contextlib.contextmanager
def guarded_page(width: int, height: int, allowed: Sequence[str] = ("file:",),
                 problems: list[str] | None = None) -> Iterator[Any]:
    """A Playwright page of ``width`` x ``height`` CSS pixels in headless Chromium.

    Requests whose address does not start with one of ``allowed`` (``data:`` and ``blob:``
    always pass) are aborted and noted in ``problems``, as are console and page errors. The
    browser is closed on leaving the block.
    """
    from playwright.sync_api import sync_playwright

    noted = problems if problems is not None else []
    prefixes = (*allowed, "data:", "blob:")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium_binary(),
                                             args=CHROMIUM_ARGS)
        try:
            context = browser.new_context(viewport={"width": width, "height": height})

            def guard(route: Any) -> None:
                if route.request.url.startswith(prefixes):
                    route.continue_()
                else:
                    noted.append(f"network request: {route.request.url}")
                    route.abort()

            context.route("**/*", guard)
            page = context.new_page()
            page.on("console", lambda m: noted.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda error: noted.append(str(error)))
            yield page
        finally:
            browser.close()


def finish(png_path: Path, problems: list[str], what: str) -> Path:
    """Raise if the page misbehaved, else shrink the PNG; its path.

    Raises:
        RuntimeError: the page reached for the network or logged an error.
    """
    if problems:
        raise RuntimeError(f"{what} misbehaved: " + "; ".join(problems))
    shrink(png_path)
    return png_path


def shrink(png_path: Path) -> None:
    """Re-encode a large screenshot with a 256-colour palette (UI pictures lose nothing)."""
    if png_path.stat().st_size <= MAX_BYTES:
        return
    from PIL import Image

    with Image.open(png_path) as image:
        small = image.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT)
    small.save(png_path, optimize=True)


def png_parser(doc: str | None, width: int, height: int) -> argparse.ArgumentParser:
    """The command line of a script that writes one PNG: ``PNG [--width W] [--height H]``."""
    parser = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])
    parser.add_argument("png", type=Path, help="the screenshot to write")
    parser.add_argument("--width", type=int, default=width)
    parser.add_argument("--height", type=int, default=height)
    return parser


def written(path: Path) -> int:
    """Say which PNG was written and its size; exit status 0."""
    print(f"{path} ({path.stat().st_size / 1000:.0f} KB)")
    return 0
