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
import sys
import tempfile
from pathlib import Path

from chromium_shot import finish, guarded_page, written

SAMPLE_TEXT = "The cat sat on the mat because it was warm."
SAMPLE_FRAGMENT = "#view=head&layer=5&heads=4,11"  # "it" looks at "cat" here


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
    html_path = Path(html_path).resolve()
    png_path = Path(png_path)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    problems: list[str] = []
    with guarded_page(width, height, ("file:",), problems) as page:
        page.goto(html_path.as_uri() + fragment)
        page.wait_for_selector("html[data-ready='1']", timeout=30_000)
        if hover_query is not None:
            page.hover(f"#hv-left .tok[data-i='{hover_query}']")
        page.screenshot(path=str(png_path))
    return finish(png_path, problems, "the report")


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
    return written(path)


if __name__ == "__main__":
    sys.exit(main())
