"""The HTML report: one self-contained file with every view, its data, JavaScript and CSS inline.

The file needs no network, no CDN and no fonts: open it from disk, mail it, attach it to a
paper. A Content-Security-Policy in the file forbids every external load and every script but
the report's own (pinned by its SHA-256), so even a token that looks like HTML cannot run.

Layout of the embedded data (``<script type="application/json" id="attnviz-data">``)::

    {"format": "attnviz-report", "version": 1, "title": ..., "generator": "attnviz 0.2.0",
     "initial": {"words": false, "special": true, and optionally "view", "layer", "heads",
                 "scale", "gamma", "vmax"},
     "docs": [{"model", "model_label", "text", "pair", "causal", "layers", "heads", "num_layers",
               "num_heads", "tokens", "display_tokens", "special", "word_ids",
               "words": {"groups", "labels", "special"} or null,
               "stats": [head_table rows] or null,
               "weights": {"encoding": "zlib-base64", "bits": 8 or 16, "layout",
                           "shape": [layer, head, query, key], "data": "..."}}]}

and optionally ``"fit": true``: the views are fitted into the window's height (a notebook's
fallback frame, which cannot grow to its content).

Weights are quantised linearly, ``q = round(w * (2**bits - 1))`` (8 bits: error at most
1/510 ~ 0.002; 16 bits: at most 1/131070 ~ 7.6e-6), compressed with zlib and base64-encoded;
16-bit values are stored as two byte planes (all low bytes, then all high bytes), which
compresses better. The browser decodes them with ``DecompressionStream``.

Colours follow the command line's colour scales (``--scale power|linear|log``, ``--gamma``,
``--vmax auto|number``; default power 0.5 with the top at the largest weight shown): the same
defaults and the same mapping (:class:`attnviz.render.heatmap.ColourScale`), offered as controls.

One front end draws every view of this data: ``report.js`` defines ``attnvizMount(root, data,
options)``. The standalone report inlines it as a classic script, which mounts itself on the
page; the notebook widget (:mod:`attnviz.notebook`) and the live server load it as an ES module
(:func:`report_module`) and mount it in a shadow root holding :func:`report_body` and
:func:`report_style`, one per view.
"""

from __future__ import annotations

import base64
import hashlib
import html
import json
import math
import re
import zlib
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from string import Template
from typing import TYPE_CHECKING, Any

import numpy as np

from attnviz.errors import UsageError

if TYPE_CHECKING:
    from attnviz.capture import Capture

FORMAT_NAME = "attnviz-report"
FORMAT_VERSION = 1
PRECISIONS = (8, 16)
DEFAULT_PRECISION = 8
DEFAULT_TOP_K = 5
# What a selection (the report's initial view, a notebook view) may name.
SELECTION_KEYS = ("view", "layer", "heads", "scale", "gamma", "vmax")
# Past this many weights in one text, a browser tab needs hundreds of MB: refuse, say how to cut.
MAX_WEIGHTS_PER_TEXT = 1 << 28
_DATA_RE = re.compile(
    r'<script type="application/json" id="attnviz-data">(.*?)</script>', re.DOTALL)
# Characters that must not appear raw inside a <script> element or JavaScript source.
_SCRIPT_ESCAPES = {
    "<": "\\u003c",
    ">": "\\u003e",
    "&": "\\u0026",
    "\u2028": "\\u2028",
    "\u2029": "\\u2029",
}
_SCRIPT_ESCAPE_RE = re.compile("[<>&\u2028\u2029]")


# --------------------------------------------------------------------------- weights
def quantise(weights: np.ndarray, bits: int = DEFAULT_PRECISION) -> np.ndarray:
    """Linear quantisation of weights in ``[0, 1]`` to unsigned integers.

    Args:
        weights: float array of any shape (``[layer, head, query, key]`` here).
        bits: 8 (``uint8``) or 16 (``uint16``).

    Returns:
        ``round(clip(w, 0, 1) * (2**bits - 1))`` with the same shape.
    """
    _check_precision(bits)
    top = (1 << bits) - 1
    weights = np.asarray(weights)
    out = np.empty(weights.shape, dtype=np.uint8 if bits == 8 else np.uint16)
    flat_in, flat_out = weights.reshape(-1), out.reshape(-1)
    # In float64, a piece at a time: float32 products land on .5 exactly and round the wrong
    # way (an error just past the documented 1/(2*(2**bits-1))).
    step = 1 << 22
    for start in range(0, flat_in.size, step):
        piece = np.clip(flat_in[start:start + step].astype(np.float64), 0.0, 1.0)
        flat_out[start:start + step] = np.rint(piece * top)
    return out


def dequantise(values: np.ndarray, bits: int) -> np.ndarray:
    """Inverse of :func:`quantise`: float32 weights ``q / (2**bits - 1)``."""
    _check_precision(bits)
    return (np.asarray(values, dtype=np.float64) / ((1 << bits) - 1)).astype(np.float32)


def encode_weights(weights: np.ndarray, bits: int = DEFAULT_PRECISION, *,
                   fast: bool = False) -> dict[str, Any]:
    """Quantise, compress and base64-encode a ``[layer, head, query, key]`` array.

    ``fast`` compresses for speed (a live server, where the time to answer matters more than
    bytes): blocks past 1 MiB are stored uncompressed (zlib level 0), smaller ones at level 1;
    otherwise level 6. The decoder reads either.

    Values above 1 (a measure such as ``norm``, whose values are amounts, not weights) are
    divided by the largest value before they are quantised, and the block's ``range`` says by
    how much, so the decoders multiply it back; attention weights never need it.
    """
    weights = np.asarray(weights)
    largest = float(np.max(weights, initial=0.0))
    spread = largest if largest > 1.001 else None
    if spread is not None:
        weights = np.asarray(weights, dtype=np.float64) / spread
    quantised = np.ascontiguousarray(quantise(weights, bits))
    if bits == 8:
        raw = quantised.tobytes()
    else:  # byte planes: low bytes first, then high bytes
        pairs = quantised.astype("<u2").view(np.uint8).reshape(-1, 2)
        raw = np.ascontiguousarray(pairs.T).tobytes()
    block: dict[str, Any] = {
        "encoding": "zlib-base64",
        "bits": bits,
        "layout": "bytes" if bits == 8 else "byte-planes-le",
        "shape": [int(n) for n in quantised.shape],
        "data": base64.b64encode(zlib.compress(raw, _level(len(raw), fast))).decode("ascii"),
    }
    if spread is not None:
        block["range"] = spread
    return block


def _level(size: int, fast: bool) -> int:
    if not fast:
        return 6
    return 1 if size <= 1 << 20 else 0


def decode_weights(block: dict[str, Any]) -> np.ndarray:
    """Decode a weights block written by :func:`encode_weights` to float32 ``[l, h, q, k]``."""
    bits = int(block["bits"])
    shape = tuple(int(n) for n in block["shape"])
    raw = zlib.decompress(base64.b64decode(block["data"]))
    count = math.prod(shape)
    if bits == 8:
        values = np.frombuffer(raw, dtype=np.uint8, count=count)
    else:
        planes = np.frombuffer(raw, dtype=np.uint8, count=2 * count).reshape(2, count)
        values = planes[0].astype(np.uint16) | (planes[1].astype(np.uint16) << 8)
    values = dequantise(values.reshape(shape), bits)
    spread = block.get("range")
    return values if spread is None else (values * np.float32(spread)).astype(np.float32)


def _check_precision(bits: int) -> None:
    if bits not in PRECISIONS:
        raise UsageError(f"precision {bits} is not supported",
                         "use --precision 8 (smallest file) or --precision 16 (exact to 1e-5)")


# --------------------------------------------------------------------------- data
def script_json(value: Any) -> str:
    """JSON that is safe inside ``<script>``: no ``<``, ``>``, ``&``, U+2028 or U+2029.

    Those characters are written as ``\\uXXXX`` escapes, which JSON.parse reads back
    unchanged, so a token such as ``</script>`` can never close the element.
    """
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    return _SCRIPT_ESCAPE_RE.sub(lambda match: _SCRIPT_ESCAPES[match.group(0)], text)


def _json_number(value: Any) -> Any:
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        number = float(value)
        return round(number, 6) if math.isfinite(number) else None
    return value if value is None else str(value)


def head_stats(capture: Capture) -> list[dict[str, Any]] | None:
    """Rows of ``attnviz.analysis.stats.head_table`` as plain JSON values, or ``None``.

    ``None`` when the head-statistics module is not installed; the report then has no
    statistics panel.
    """
    import importlib

    try:
        stats = importlib.import_module("attnviz.analysis.stats")
    except ModuleNotFoundError as exc:
        if exc.name != "attnviz.analysis.stats":
            raise  # the module exists but is broken: a bug to see, not a panel to hide
        return None
    head_table = getattr(stats, "head_table", None)
    if head_table is None:
        return None
    rows = head_table(capture)
    return [{str(key): _json_number(value) for key, value in row.items()} for row in rows]


def word_units(capture: Capture) -> dict[str, Any] | None:
    """Word groups as :func:`attnviz.analysis.tokens.merge_words` forms them; None if 1:1."""
    from attnviz.analysis.tokens import join_pieces, word_groups

    groups = word_groups(capture)
    if len(groups) == capture.num_tokens:
        return None
    labels = [join_pieces([capture.display_tokens[i] for i in group]) for group in groups]
    return {"groups": groups, "labels": labels,
            "special": [bool(capture.special[group[0]]) for group in groups]}


def doc_data(capture: Capture, *, precision: int = DEFAULT_PRECISION) -> dict[str, Any]:
    """The JSON record of one capture in a report (see the module docstring)."""
    shape = tuple(capture.weights.shape)
    if math.prod(shape) > MAX_WEIGHTS_PER_TEXT:
        raise UsageError(
            f"the capture of {capture.num_tokens} tokens holds {math.prod(shape):,} weights "
            f"({shape[0]} layers x {shape[1]} heads), too many for a browser report",
            "keep fewer layers or heads with --layers/--heads, or fewer tokens with --max-tokens")
    measure = {} if capture.measure == "weights" else {
        "measure": capture.measure, "measure_label": capture.measure_label}
    return {
        "model": capture.model,
        "model_label": capture.model_label,
        **measure,
        "text": capture.text,
        "pair": capture.pair,
        "causal": bool(capture.causal),
        "layers": [int(i) for i in capture.layers],
        "heads": [int(i) for i in capture.heads],
        "num_layers": int(capture.num_layers),
        "num_heads": int(capture.num_heads),
        "tokens": list(capture.tokens),
        "display_tokens": list(capture.display_tokens),
        "special": [bool(s) for s in capture.special],
        "word_ids": [None if w is None else int(w) for w in capture.word_ids],
        "words": word_units(capture),
        "stats": head_stats(capture),
        "weights": encode_weights(np.asarray(capture.weights), precision),
    }


def default_title(captures: Sequence[Capture]) -> str:
    """``attnviz: <model>: <text>`` for one text, ``attnviz: N texts`` for several."""
    if len(captures) == 1:
        text = " ".join(captures[0].text.split())
        short = text if len(text) <= 60 else text[:59] + "\u2026"
        measure = captures[0].measure_label
        return f"attnviz: {captures[0].model_label}{', ' + measure if measure else ''}: {short}"
    return f"attnviz: {len(captures)} texts"


def report_data(captures: Sequence[Capture], *, title: str | None = None,
                precision: int = DEFAULT_PRECISION, top_k: int = DEFAULT_TOP_K,
                words: bool = False, exclude_special: bool = False,
                selection: dict[str, Any] | None = None) -> dict[str, Any]:
    """Everything the report's script reads, as a JSON-ready dict.

    ``selection`` opens the report on a view, layer and heads (``{"view": "heatmap",
    "layer": 3, "heads": [7]}``, model indices) and a colour scale (``"scale"``, ``"gamma"``,
    ``"vmax"`` as :func:`colour_scale` takes them); the address (``#...``) still overrides it.
    """
    from attnviz._version import __version__

    if not captures:
        raise UsageError("a report needs at least one capture", "give a TEXT, --from or --input")
    _check_precision(precision)
    if top_k < 1:
        raise UsageError(f"--top-k must be at least 1, got {top_k}")
    return {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "generator": f"attnviz {__version__}",
        "title": title or default_title(captures),
        "top_k": int(top_k),
        "initial": {"words": bool(words), "special": not exclude_special,
                    **_initial_selection(selection)},
        "docs": [doc_data(capture, precision=precision) for capture in captures],
    }


def _initial_selection(selection: dict[str, Any] | None) -> dict[str, Any]:
    if not selection:
        return {}
    unknown = set(selection) - set(SELECTION_KEYS)
    if unknown:
        raise UsageError(f"unknown selection key(s): {', '.join(sorted(unknown))}",
                         f"a selection has {', '.join(SELECTION_KEYS)}")
    chosen: dict[str, Any] = {}
    if selection.get("view") is not None:
        chosen["view"] = str(selection["view"])
    if selection.get("layer") is not None:
        chosen["layer"] = int(selection["layer"])
    if selection.get("heads") is not None:
        chosen["heads"] = [int(h) for h in selection["heads"]]
    if any(selection.get(key) is not None for key in ("scale", "gamma", "vmax")):
        chosen.update(colour_scale(selection.get("scale"), selection.get("gamma"),
                                   selection.get("vmax"), keep_gamma=True))
    return chosen


def colour_scale(scale: str | None = None, gamma: float | None = None,
                 vmax: str | float | None = None, *, keep_gamma: bool = False
                 ) -> dict[str, Any]:
    """A colour scale for the report's data, checked as the command line checks its options.

    Args:
        scale: ``power`` (default), ``linear`` or ``log``.
        gamma: the power scale's exponent (default 0.5; only with ``power``, unless
            ``keep_gamma``: a view's selection keeps it for when ``power`` is chosen again).
        vmax: ``"auto"`` (default: the largest weight shown) or a number (``1``: fixed 0..1).

    Returns:
        ``{"scale", "gamma", "vmax"}`` with ``vmax`` ``"auto"`` or a float.

    Raises:
        UsageError: an unknown scale, a gamma out of range or without ``power``, a bad vmax.
    """
    from attnviz.render.heatmap import ColourScale

    power = (scale or "power") == "power"
    checked = ColourScale.of(scale, gamma if power or not keep_gamma else None,
                             "auto" if vmax is None else vmax)
    if gamma is not None and not power and keep_gamma:
        checked = ColourScale(checked.kind, float(gamma), checked.vmax)
        checked.check()
    return {"scale": checked.kind, "gamma": float(checked.gamma),
            "vmax": "auto" if checked.vmax is None else float(checked.vmax)}


# --------------------------------------------------------------------------- HTML
def _asset(name: str) -> str:
    asset = resources.files("attnviz.render").joinpath("assets").joinpath(name)
    return asset.read_text(encoding="utf-8")


def report_body(title: str = "", generator: str = "") -> str:
    """The report's markup (``report_body.html``: controls, views, tooltip) for one mount.

    The standalone report puts it in its ``<body>``; an embedded view puts it in a shadow root
    and calls ``mount`` on it (see :func:`report_module`).
    """
    return Template(_asset("report_body.html")).substitute(
        title=html.escape(title), generator=html.escape(generator))


def report_module() -> str:
    """``report.js`` as an ES module that exports ``mount(root, data, options)``.

    ``root`` is a document or shadow root holding :func:`report_body` and the CSS of
    :func:`report_style`; ``data`` is :func:`report_data`; the options are described at the
    top of ``report.js``. The notebook widget and the live server use this; the standalone
    report inlines ``report.js`` as a classic script instead.
    """
    return _asset("report.js") + "\nexport { attnvizMount as mount };\n"


def report_style() -> str:
    """The report's CSS (``report.css``); it styles a page and a shadow root alike."""
    return _asset("report.css")


def _sha256(text: str) -> str:
    return "sha256-" + base64.b64encode(hashlib.sha256(text.encode("utf-8")).digest()).decode()


def render_html(data: dict[str, Any]) -> str:
    """The complete HTML document for report data made by :func:`report_data`."""
    script = _asset("report.js")
    style = _asset("report.css")
    # The policy forbids any network access and any script but ours, pinned by hash.
    csp = ("default-src 'none'; "
           f"script-src '{_sha256(script)}'; style-src '{_sha256(style)}'; "
           "img-src data: blob:; base-uri 'none'; form-action 'none'")
    return Template(_asset("template.html")).substitute(
        title=html.escape(str(data["title"])),
        generator=html.escape(str(data["generator"])),
        body=report_body(str(data["title"]), str(data["generator"])),
        csp=csp,
        style=style,
        data=script_json(data),
        script=script,
    )


def build_report(captures: Sequence[Capture], *, title: str | None = None,
                 precision: int = DEFAULT_PRECISION, top_k: int = DEFAULT_TOP_K,
                 words: bool = False, exclude_special: bool = False,
                 selection: dict[str, Any] | None = None) -> str:
    """The report for one or more captures, as an HTML string.

    Args:
        captures: one capture per text; each keeps its own layers, heads and tokens.
        title: page title; default names the model and text.
        precision: bits per stored weight, 8 or 16 (see :func:`quantise`).
        top_k: keys listed in the hover tooltip of the head view.
        words: open the report with the word-level toggle on.
        exclude_special: open the report with special tokens hidden.
        selection: open on a view, layer and heads (see :func:`report_data`).
    """
    return render_html(report_data(captures, title=title, precision=precision, top_k=top_k,
                                   words=words, exclude_special=exclude_special,
                                   selection=selection))


def write_report(captures: Sequence[Capture], path: Path | str, *, title: str | None = None,
                 precision: int = DEFAULT_PRECISION, top_k: int = DEFAULT_TOP_K,
                 words: bool = False, exclude_special: bool = False) -> Path:
    """Write the report for ``captures`` to ``path`` atomically and return the path.

    See :func:`build_report` for the options.
    """
    from attnviz.fileio import atomic_write_text

    document = build_report(captures, title=title, precision=precision, top_k=top_k,
                            words=words, exclude_special=exclude_special)
    return atomic_write_text(Path(path), document)


def read_report_data(document: str) -> dict[str, Any]:
    """The data embedded in a report's HTML (the inverse of :func:`render_html`'s embedding).

    Raises:
        UsageError: the text is not an attnviz report.
    """
    match = _DATA_RE.search(document)
    if match is None:
        raise UsageError("this file is not an attnviz HTML report",
                         "create one with: attnviz html \"your text\" -o report.html")
    data = json.loads(match.group(1))
    if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
        raise UsageError("this file is not an attnviz HTML report")
    return data
