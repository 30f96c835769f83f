"""The long-context view's data and its offline report: one self-contained HTML file.

The zoomable view (``render/assets/long.html``, ``long.js``, ``long.css``) draws one head's
attention over a whole long context. At the live server (``attnviz serve --long-from DIR``,
page ``/long``) it fetches atlas levels and exact tiles on demand; the offline report written
here (``attnviz html --long-from DIR -o report.html``) carries instead:

- the capture's description (:func:`long_info`: model, text, tokens, sizes, the palette);
- the head statistics ``{name: [layer][head]}`` and the top attention sinks
  (:func:`long_stats`);
- the coarser atlas levels of every head and of each layer's mean (:func:`report_levels`):
  levels are kept from the coarsest down while their cells (sums and maxima, every layer, every
  head and the mean) stay within ``max_cells`` (default :data:`MAX_REPORT_CELLS`, 2 Mi cells:
  at most 8 MiB of float32 before compression, about 11 MiB in the file at worst). Each
  ``[layer][head]`` entry is its sums then its maxima, little-endian float32, zlib-compressed
  and base64-encoded.

Layout of the embedded JSON (``<script type="application/json" id="attnviz-long-data">``)::

    {"format": "attnviz-long-report", "version": 1, "generator", "title", "model", "text",
     "num_tokens", "num_layers", "num_heads", "layers", "causal", "window", "display_tokens",
     "palette", "stats": {name: [[...]]}, "sinks": {"threshold", "top": [{position, fraction}]},
     "atlas": {"blocks": [...], "mean": true,
               "levels": [{"block", "n", "heads": {"<layer>": {"0": data, ..., "mean": data}}}]}}

Coarser levels come from the finest kept one by adding (sums) and taking the largest (maxima)
over 2 x 2 blocks, so the capture is read once per head.

When every head's whole ``[T, T]`` matrix (and each layer's mean) fits the same cell budget,
the report also carries them, exactly (``"exact": {"<layer>": {"0": data, ..., "mean": data}}``,
each ``T x T`` little-endian float32, zlib + base64, and ``"tile": {"max_values": T * T,
"view_side": T}``): the view then opens on exact cells with their values, as at the server, so
a short text reads token by token (a 12-token sentence with 12 layers of 12 heads takes 29,952
cells).
"""

from __future__ import annotations

import base64
import functools
import hashlib
import html
import re
import zlib
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from string import Template
from typing import TYPE_CHECKING, Any

import numpy as np

from attnviz.errors import UsageError

if TYPE_CHECKING:
    from attnviz.long import LongCapture

FORMAT_NAME = "attnviz-long-report"
FORMAT_VERSION = 1
#: Cells (sums and maxima of every kept level, layer and head, and the means) in a report.
MAX_REPORT_CELLS = 1 << 21
#: Blocks a side of the finest atlas level anything serves (1024^2 blocks).
MAX_ATLAS_SIDE = 1024
#: The finest block a long capture's atlas has.
MIN_BLOCK = 16
TOP_SINKS = 20
SINK_THRESHOLD = 0.3
_DATA_RE = re.compile(
    r'<script type="application/json" id="attnviz-long-data">(.*?)</script>', re.DOTALL)


def asset(name: str) -> str:
    """A file of ``render/assets``."""
    return resources.files("attnviz.render").joinpath("assets").joinpath(name).read_text(
        encoding="utf-8")


def long_body(title: str) -> str:
    """The view's markup (``long_body.html``: controls, canvas, panels), ``title`` escaped."""
    return Template(asset("long_body.html")).substitute(title=html.escape(title))


def long_page(*, title: str, generator: str, source: str, style: str, data: str, script: str,
              csp: str = "") -> str:
    """A whole page of the view (``long.html``); the pieces are HTML, inserted as they are."""
    return Template(asset("long.html")).substitute(
        csp=csp, generator=html.escape(generator), title=html.escape(title), source=source,
        style=style, body=long_body(title), data=data, script=script)


def colour_script() -> str:
    """The colour part of ``report.js`` (viridis and the command line's colour scales: every
    top-level definition before ``attnvizMount``), which the long view paints with too."""
    script = asset("report.js")
    return script[:script.index("function attnvizMount(")]


def long_script() -> str:
    """The long view's whole script: :func:`colour_script` then ``long.js``."""
    return colour_script() + "\n" + asset("long.js")


def long_module() -> str:
    """:func:`long_script` as an ES module exporting ``mount`` and ``offlineSource`` (the
    notebook widget mounts it in a shadow root holding :func:`long_body` and ``long.css``)."""
    return (long_script() + "\nexport { attnvizLongMount as mount, "
            "attnvizLongOfflineSource as offlineSource };\n")


@functools.lru_cache(maxsize=1)
def palette_hex() -> str:
    """Viridis as 256 RGB hex triples: the table ``report.js`` paints with (one source)."""
    script = asset("report.js")
    start = script.index("const ATTNVIZ_VIRIDIS_HEX =")
    end = script.index(";", start)
    return "".join(re.findall(r'"([0-9a-f]+)"', script[start:end]))


# --------------------------------------------------------------------------- atlas levels
def atlas_blocks(num_tokens: int, max_side: int = MAX_ATLAS_SIDE) -> list[int]:
    """Atlas block sizes for ``num_tokens`` tokens, finest first.

    Powers of two from the smallest whose level has at most ``max_side`` blocks a side (16 at
    least, the finest block a long capture aggregates) up to the first that covers the context
    in at most 4 blocks a side (always at least one level).
    """
    if num_tokens < 1 or max_side < 1:
        raise UsageError(f"an atlas needs tokens and blocks, got {num_tokens} and {max_side}")
    block = MIN_BLOCK
    while -(-num_tokens // block) > max_side:
        block *= 2
    blocks = [block]
    while -(-num_tokens // blocks[-1]) > 4:
        blocks.append(blocks[-1] * 2)
    return blocks


def pool_atlas(sums: np.ndarray, maxes: np.ndarray, factor: int
               ) -> tuple[np.ndarray, np.ndarray]:
    """A coarser atlas level: ``factor x factor`` blocks added (sums) and maxed (maxima).

    ``sums`` and ``maxes`` are ``[n, n]`` at block ``b``; the result is ``[ceil(n / factor)]``
    a side at block ``b * factor``, as the capture would give it (weights are >= 0, so the
    padding of the last partial block changes neither).
    """
    if factor == 1:
        return sums, maxes
    n = sums.shape[0]
    factor = max(1, min(factor, n))  # one cell holds it all: no padding beyond the grid
    m = -(-n // factor)
    pad = m * factor - n

    def fold(values: np.ndarray, how: Any) -> np.ndarray:
        padded = np.pad(values.astype(np.float64 if how is np.sum else np.float32),
                        ((0, pad), (0, pad)))
        return how(padded.reshape(m, factor, m, factor), axis=(1, 3)).astype(np.float32)

    return fold(sums, np.sum), fold(maxes, np.max)


def report_levels(num_tokens: int, num_layers: int, num_heads: int,
                  max_cells: int = MAX_REPORT_CELLS) -> list[int]:
    """The atlas blocks an offline report keeps, coarsest first.

    Levels are taken from the coarsest down while the cells of all kept levels (sums and
    maxima, ``num_layers x (num_heads + 1)`` of them: every head and the mean) stay within
    ``max_cells``; the coarsest level is always kept.
    """
    kept: list[int] = []
    total = 0
    for block in reversed(atlas_blocks(num_tokens)):
        n = -(-num_tokens // block)
        cells = 2 * n * n * num_layers * (num_heads + 1)
        if kept and total + cells > max_cells:
            break
        kept.append(block)
        total += cells
    return kept


def _pack(sums: np.ndarray, maxes: np.ndarray) -> str:
    raw = np.concatenate([np.ravel(sums), np.ravel(maxes)]).astype("<f4").tobytes()
    return base64.b64encode(zlib.compress(raw, 6)).decode("ascii")


def unpack_level(text: str, n: int) -> tuple[np.ndarray, np.ndarray]:
    """The inverse of one report entry: ``(sums, maxes)``, each ``[n, n]`` float32."""
    values = np.frombuffer(zlib.decompress(base64.b64decode(text)), dtype="<f4")
    return values[:n * n].reshape(n, n), values[n * n:].reshape(n, n)


# --------------------------------------------------------------------------- data
def long_info(capture: LongCapture) -> dict[str, Any]:
    """What the view needs to know of a long capture (not its weights)."""
    return {
        "model": str(capture.model),
        "model_label": capture.model_label,
        "text": str(capture.text),
        "num_tokens": int(capture.num_tokens),
        "num_layers": int(capture.num_layers),
        "num_heads": int(capture.num_heads),
        "layers": [int(layer) for layer in capture.layers],
        "causal": bool(capture.causal),
        "window": None if capture.window is None else int(capture.window),
        "windows": layer_windows(capture),
        "display_tokens": [str(t) for t in capture.display_tokens],
        "palette": palette_hex(),
    }


def layer_windows(capture: LongCapture) -> list[int | None]:
    """The sliding window of each recorded layer (``None``: the layer sees every earlier key)."""
    found = [capture.window_of(layer) for layer in capture.layers]
    return [None if w is None else int(w) for w in found]


def _plain(value: float) -> float | None:
    number = float(value)
    return round(number, 6) if np.isfinite(number) else None


def long_stats(capture: LongCapture, *, top: int = TOP_SINKS,
               threshold: float = SINK_THRESHOLD) -> dict[str, Any]:
    """Head statistics ``{name: [layer][head]}`` (rows: the recorded layers, in order) and the
    ``top`` tokens by sink fraction.

    The sink fraction of a token is the share of heads whose mean attention to it exceeds
    ``threshold`` (Gu et al.; :meth:`LongCapture.sinks`).
    """
    stats = {str(name): [[_plain(v) for v in row] for row in np.asarray(values)]
             for name, values in capture.head_stats().items()}
    sinks = np.asarray(capture.sinks(threshold=threshold), dtype=np.float64)
    order = np.argsort(-sinks, kind="stable")[:top]
    return {"stats": stats,
            "sinks": {"threshold": float(threshold),
                      "top": [{"position": int(i), "fraction": _plain(sinks[i])}
                              for i in order if sinks[i] > 0]}}


def long_report_data(capture: LongCapture, *, title: str | None = None,
                     max_cells: int = MAX_REPORT_CELLS,
                     progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Everything the offline report carries, as JSON-ready data (see the module docstring);
    ``progress(rows done, rows)`` follows the one pass over every head."""
    from attnviz._version import __version__

    if max_cells < 1:
        raise UsageError(f"the report's cell budget must be at least 1, got {max_cells}")
    T, H = int(capture.num_tokens), int(capture.num_heads)
    layers = [int(layer) for layer in capture.layers]
    blocks = report_levels(T, len(layers), H, max_cells)
    finest = blocks[-1]
    # one streamed pass over every head: the statistics, the finest kept atlas level (at
    # most the block head_stats asks for, so it needs no second pass) and the mean's maxima
    from attnviz.long.scan import auto_block

    capture.summarise(block=min(finest, auto_block(T)), mean=True, progress=progress)
    levels: list[dict[str, Any]] = [
        {"block": b, "n": -(-T // b), "heads": {str(layer): {} for layer in layers}}
        for b in blocks]
    for layer in layers:
        for head in [*range(H), "mean"]:
            sums, maxes = capture.atlas(layer, head, finest)
            sums = np.asarray(sums, dtype=np.float32)
            maxes = np.asarray(maxes, dtype=np.float32)
            for level in levels:
                pooled = pool_atlas(sums, maxes, level["block"] // finest)
                level["heads"][str(layer)][str(head)] = _pack(*pooled)
    data = {"format": FORMAT_NAME, "version": FORMAT_VERSION,
            "generator": f"attnviz {__version__}",
            "title": title or default_title(capture), **long_info(capture),
            **long_stats(capture)}
    data["atlas"] = {"blocks": sorted(blocks), "mean": True, "levels": levels}
    if T * T * len(layers) * (H + 1) <= max_cells:
        data["exact"] = {str(layer): {str(head): _pack_one(capture.tile(layer, head, 0, T, 0, T))
                                      for head in [*range(H), "mean"]}
                         for layer in layers}
        data["tile"] = {"max_values": T * T, "view_side": T}
    return data


def _pack_one(values: np.ndarray) -> str:
    raw = np.ascontiguousarray(values, dtype="<f4").tobytes()
    return base64.b64encode(zlib.compress(raw, 6)).decode("ascii")


def default_title(capture: LongCapture) -> str:
    """``attnviz: <model>: <N> tokens``."""
    return f"attnviz: {capture.model_label}: {int(capture.num_tokens):,} tokens"


# --------------------------------------------------------------------------- HTML
def _script_json(value: Any) -> str:
    from attnviz.render.html import script_json

    return script_json(value)


def _sha256(text: str) -> str:
    return "sha256-" + base64.b64encode(hashlib.sha256(text.encode("utf-8")).digest()).decode()


def render_long_html(data: dict[str, Any]) -> str:
    """The complete offline document for :func:`long_report_data`'s data."""
    script = long_script()
    style = asset("long.css")
    csp = ("default-src 'none'; "
           f"script-src '{_sha256(script)}'; style-src '{_sha256(style)}'; "
           "img-src data: blob:; base-uri 'none'; form-action 'none'")
    return long_page(
        csp=f'<meta http-equiv="Content-Security-Policy" content="{csp}">',
        generator=str(data["generator"]), title=str(data["title"]), source="offline",
        style=f"<style>{style}</style>",
        data=f'<script type="application/json" id="attnviz-long-data">'
             f"{_script_json(data)}</script>",
        script=f"<script>{script}</script>")


def write_long_report(capture: LongCapture, path: Path | str, *, title: str | None = None,
                      max_cells: int = MAX_REPORT_CELLS,
                      progress: Callable[[int, int], None] | None = None) -> Path:
    """Write the offline long-context report atomically and return its path."""
    from attnviz.fileio import atomic_write_text

    document = render_long_html(long_report_data(capture, title=title, max_cells=max_cells,
                                                 progress=progress))
    return atomic_write_text(Path(path), document)


def read_long_report(document: str) -> dict[str, Any]:
    """The data embedded in a long report (the inverse of :func:`render_long_html`).

    Raises:
        UsageError: the text is not an attnviz long-context report.
    """
    import json

    match = _DATA_RE.search(document)
    data = json.loads(match.group(1)) if match else None
    if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
        raise UsageError("this file is not an attnviz long-context report",
                         "create one with: attnviz html --long-from DIR -o report.html")
    return data
