"""Take a screenshot of attnviz's inline notebook views (the README's picture).

Usage::

    python scripts/screenshot_notebook.py sample_outputs/notebook_views.png

It captures a short sentence with the bundled MiniLM, makes two views with ``attnviz.show``
(the head view with a token hovered, and a heatmap) and runs their widget module the way
Jupyter does, on a page from ``attnviz.notebook.preview_page``, in headless Chromium with every
network request blocked. Chromium comes from the system (``bash scripts/install_browser.sh``).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from chromium_shot import finish, guarded_page, png_parser, written

SAMPLE_TEXT = "The cat sat on the mat because it was warm."
CAPTIONS = [
    "cap = attnviz.capture_text(\"The cat sat on the mat because it was warm.\")\n"
    "attnviz.show(cap, view=\"head\", layer=5, heads=[4, 11])",
    "view = attnviz.show(cap, view=\"heatmap\", layer=5, head=4)\n"
    "view.layer, view.head          # (5, 4): follows the clicks; set it to move the view",
]


def screenshot_views(png_path: Path | str, *, width: int = 1000, height: int = 1440,
                     hover_query: int = 8) -> Path:
    """Render the two sample views and save a screenshot of the page.

    Args:
        png_path: where the PNG goes (folders are created).
        width: viewport width in CSS pixels; ``height`` the viewport height.
        hover_query: the query token hovered in the head view (8 is "it").

    Raises:
        RuntimeError: the page reached for the network or logged an error.
    """
    import attnviz
    from attnviz.notebook import preview_page

    capture = attnviz.capture_text(SAMPLE_TEXT, device="cpu")
    views = [attnviz.show(capture, view="head", layer=5, heads=[4, 11]),
             attnviz.show(capture, view="heatmap", layer=5, head=4)]
    png_path = Path(png_path)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    problems: list[str] = []
    with tempfile.TemporaryDirectory() as folder:
        page_path = Path(folder) / "views.html"
        page_path.write_text(preview_page(views, captions=CAPTIONS), encoding="utf-8")
        with guarded_page(width, height, ("file:",), problems) as page:
            page.goto(page_path.as_uri())
            for i in range(len(views)):
                page.wait_for_selector(f"#view{i}[data-ready='1']", timeout=30_000)
            page.hover(f"#view0 #hv-left .tok[data-i='{hover_query}']")
            page.screenshot(path=str(png_path))
    return finish(png_path, problems, "the views")


def main(argv: list[str] | None = None) -> int:
    args = png_parser(__doc__, width=1000, height=1440).parse_args(argv)
    return written(screenshot_views(args.png, width=args.width, height=args.height))


if __name__ == "__main__":
    sys.exit(main())
