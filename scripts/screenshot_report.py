"""Take a screenshot of an attnviz HTML report in headless Chromium (the README's picture).

Usage::

    python scripts/screenshot_report.py report.html shot.png [--fragment '#view=model']
    python scripts/screenshot_report.py --sample sample_outputs/html_report.png

``--sample`` builds a MiniLM report of a short sentence first. The page opens with every
network request blocked. Chromium comes from the system (``bash scripts/install_browser.sh``),
driven by Playwright for Python; the PNG is reduced to a 256-colour palette when it would be
larger than 300 KB.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
MAX_BYTES = 300_000
SAMPLE_TEXT = "The cat sat on the mat because it was warm."
SAMPLE_FRAGMENT = "#view=head&layer=5&heads=4,11"  # "it" looks at "cat" here


def chromium_binary() -> str:
    """The system Chromium, or a clear error naming the install script."""
    for candidate in ("/usr/bin/chromium", shutil.which("chromium"),
                      shutil.which("chromium-browser")):
        if candidate and Path(candidate).is_file():
            return candidate
    raise SystemExit("error: no Chromium found; install it with: bash scripts/install_browser.sh")


def screenshot_report(html_path: Path | str, png_path: Path | str, *, fragment: str = "",
                      width: int = 1100, height: int = 640, hover_query: int | None = None
                      ) -> Path:
    """Open ``html_path`` in headless Chromium and save a screenshot of the viewport.

    Args:
        html_path: the report.
        png_path: where the PNG goes (folders are created).
        fragment: an address fragment selecting the view, e.g. ``#view=model`` or
            ``#view=head&layer=2&heads=0,1``.
        width: viewport width in CSS pixels; height: viewport height.
        hover_query: in the head view, hover this query token to show its tooltip.

    Returns:
        The PNG's path.

    Raises:
        RuntimeError: the page reached for the network or logged an error.
    """
    from playwright.sync_api import sync_playwright

    html_path = Path(html_path).resolve()
    png_path = Path(png_path)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    problems: list[str] = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium_binary(),
                                             args=CHROMIUM_ARGS)
        try:
            context = browser.new_context(viewport={"width": width, "height": height})

            def guard(route: Any) -> None:
                if route.request.url.startswith(("file:", "data:", "blob:")):
                    route.continue_()
                else:
                    problems.append(f"network request: {route.request.url}")
                    route.abort()

            context.route("**/*", guard)
            page = context.new_page()
            page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda error: problems.append(str(error)))
            page.goto(html_path.as_uri() + fragment)
            page.wait_for_selector("html[data-ready='1']", timeout=30_000)
            if hover_query is not None:
                page.hover(f"#hv-left .tok[data-i='{hover_query}']")
            page.screenshot(path=str(png_path))
        finally:
            browser.close()
    if problems:
        raise RuntimeError("the report misbehaved: " + "; ".join(problems))
    _shrink(png_path)
    return png_path


def _shrink(png_path: Path) -> None:
    """Re-encode a large screenshot with a 256-colour palette (UI pictures lose nothing)."""
    if png_path.stat().st_size <= MAX_BYTES:
        return
    from PIL import Image

    with Image.open(png_path) as image:
        small = image.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT)
    small.save(png_path, optimize=True)


def make_sample(png_path: Path | str) -> Path:
    """Screenshot of a MiniLM report of a short sentence, head view with a token hovered."""
    from attnviz import capture_text
    from attnviz.render.html import write_report

    capture = capture_text(SAMPLE_TEXT, device="cpu")
    with tempfile.TemporaryDirectory() as folder:
        report = write_report([capture], Path(folder) / "report.html")
        return screenshot_report(report, png_path, fragment=SAMPLE_FRAGMENT, hover_query=8)  # "it"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("report", nargs="?", type=Path, help="the HTML report")
    parser.add_argument("png", nargs="?", type=Path, help="the screenshot to write")
    parser.add_argument("--fragment", default="", help="address fragment, e.g. '#view=model'")
    parser.add_argument("--width", type=int, default=1100)
    parser.add_argument("--height", type=int, default=640)
    parser.add_argument("--hover", type=int, default=None, help="query token to hover")
    parser.add_argument("--sample", type=Path, metavar="PNG",
                        help="build a MiniLM report and screenshot it to PNG")
    args = parser.parse_args(argv)
    if args.sample is not None:
        path = make_sample(args.sample)
    elif args.report is not None and args.png is not None:
        path = screenshot_report(args.report, args.png, fragment=args.fragment,
                                 width=args.width, height=args.height, hover_query=args.hover)
    else:
        parser.error("give REPORT and PNG, or --sample PNG")
    print(f"{path} ({path.stat().st_size / 1000:.0f} KB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
