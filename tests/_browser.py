"""Headless Chromium for the browser tests (Debian's ``chromium``, driven by Playwright).

The ``browser`` fixture in ``conftest.py`` launches it once per test module; :func:`watch` wires
a page so that requests outside the allowed addresses are aborted and recorded, and console
errors, page errors and dialogs are collected for the test to assert on.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


def chromium_binary() -> str | None:
    for candidate in ("/usr/bin/chromium", shutil.which("chromium"),
                      shutil.which("chromium-browser")):
        if candidate and Path(candidate).is_file():
            return candidate
    return None


def launch_chromium() -> Iterator[Any]:
    """Yield a launched browser, closed afterwards; skip the tests when no Chromium is installed."""
    binary = chromium_binary()
    if binary is None:
        pytest.skip("no Chromium binary: install Debian's chromium with "
                    "`bash scripts/install_browser.sh`")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("Chromium is installed but Playwright is not: pip install -e '.[test]'")
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=binary, args=CHROMIUM_ARGS)
        yield launched
        launched.close()


def watch(context: Any, page: Any, allowed: Sequence[str], outside: list[str],
          errors: list[str], *, requests: bool = False, dialogs: list[str] | None = None
          ) -> None:
    """Abort and record in ``outside`` every request of ``context`` whose address does not start
    with one of ``allowed``; record ``page``'s console errors and page errors in ``errors``.

    ``requests`` also records outside requests from the page's own request events;
    ``dialogs`` records the messages of dialogs, which are dismissed.
    """
    prefixes = tuple(allowed)

    def guard(route: Any) -> None:
        url = route.request.url
        if url.startswith(prefixes):
            route.continue_()
        else:
            outside.append(url)
            route.abort()

    context.route("**/*", guard)
    if requests:
        page.on("request", lambda request: None if request.url.startswith(prefixes)
                else outside.append(request.url))
    page.on("console", lambda message: errors.append(message.text)
            if message.type == "error" else None)
    page.on("pageerror", lambda error: errors.append(str(error)))
    if dialogs is not None:
        noted = dialogs

        def on_dialog(dialog: Any) -> None:
            noted.append(dialog.message)
            dialog.dismiss()

        page.on("dialog", on_dialog)


def wait_until(target: Any, expression: str, arg: Any = None, *, timeout_s: float = 120.0
               ) -> Any:
    """Evaluate ``expression`` in ``target`` (a page or frame) until it is truthy; return it.

    A polling loop rather than ``wait_for_function``, which evaluates a string that the views'
    Content-Security-Policy forbids; it waits through Playwright (not ``time.sleep``) so the
    page's requests, which pass through Python's route handlers, keep flowing.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        value = target.evaluate(expression, arg)
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {expression}"
        target.wait_for_timeout(50)


def hover_until(page: Any, where: Callable[[], tuple[float, float]], shown: Callable[[], Any],
                *, timeout_s: float = 60.0, what: str = "the hover to show") -> None:
    """Move the mouse to ``where()`` until ``shown()`` is true.

    A single move is lost when the view re-lays itself out between reading its geometry and the
    move (a frame resized by its host, a late font): each try reads the geometry again, leaves
    the page's corner first so the next move is a real move, and polls ``shown`` for a second.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        page.mouse.move(0, 0)
        page.mouse.move(*where())
        settle = min(deadline, time.monotonic() + 1.0)
        while time.monotonic() < settle:
            if shown():
                return
            page.wait_for_timeout(30)
        if shown():
            return
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
