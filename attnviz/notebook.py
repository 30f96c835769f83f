"""Inline views in Jupyter Notebook 7, JupyterLab, VS Code and Colab.

:func:`show` returns an :class:`AttentionView`, an `anywidget <https://anywidget.dev>`_ widget
that draws the HTML report's own front end (``render/assets/report.js``, mounted in a shadow
root) inline::

    import attnviz
    cap = attnviz.capture_text("The cat sat on the mat because it was warm.")
    view = attnviz.show(cap, view="heatmap", layer=5, head=4)
    view.layer, view.heads          # what is selected in the browser, kept in sync
    view.head = 7                   # select from Python: the view follows

Each view is self-contained: its JavaScript, CSS and data travel with the widget (no CDN, no
network at all), and element ids, styles and state live in the view's own shadow root, so any
number of views share a notebook without touching each other. Only the selection (view, layer,
heads, words, special tokens, colour scale) may come back from the browser; the data flows from
Python only.

What a saved notebook shows without the kernel that made it. Jupyter's widget renderer needs a
kernel: opened with none, a widget output stays "Loading widget..." (JupyterLab 4, Notebook 7),
and with a new kernel but no widget state saved in the notebook it reads "Error displaying
widget: model not found". So a view displayed in a notebook is two outputs: the widget, and its
static copy (:func:`static_html`: the self-contained report in a sandboxed ``<iframe srcdoc>``,
over a PNG image of the view). A small style sheet in the copy shows one of the two: the widget
while it is on the page, the copy otherwise. Where frames are stripped (an untrusted notebook in
JupyterLab or Notebook 7, a preview on a website) the image shows, with a line on how to trust
the notebook. Notebooks run by nbclient or papermill also keep the widget state, which JupyterLab
and Notebook 7 load when a kernel starts.
"""

from __future__ import annotations

import base64
import html
import json
import re
import sys
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import anywidget
import traitlets

from attnviz.errors import UsageError

if TYPE_CHECKING:
    from attnviz.capture import Capture

VIEWS = ("head", "model", "heatmap", "stats")
# Weights one inline view may carry (its data sits in the notebook): 16.7 M, e.g. 72 heads of
# 480 tokens. Past it, select layers or heads first.
MAX_VIEW_WEIGHTS = 1 << 24
# A capture shown by just evaluating it (its _repr_html_) embeds the report only up to this.
MAX_REPR_WEIGHTS = 1 << 21
# The static image of a view: at most this wide, in pixels (a notebook's output width).
IMAGE_WIDTH_PX = 880
# Fallback frames: heights in pixels. Above the views sit the title, the controls and a hint,
# below them the footer; the views are fitted into the rest (heatmap and model view).
FRAME_CHROME_PX = 250
FRAME_MIN_PX, FRAME_MAX_PX = 420, 1100
HEIGHT_RANGE = (100, 10_000)  # a frame height given from Python

# The selection: what the browser may set (everything else flows from Python only).
_SYNCED = ("view", "layer", "heads", "words", "special", "scale", "gamma", "vmax")
_SCALE_KEYS = ("scale", "gamma", "vmax")

# The widget's glue: report.js mounted in a shadow root, the selection synced both ways.
_GLUE = """
const REPORT_STYLE = %(style)s;
const REPORT_BODY = %(body)s;
const SYNCED = %(synced)s;

function render({ model, el }) {
  // While this is on the page, the view's static copy (the next output) hides itself.
  el.setAttribute("data-attnviz-live", model.get("_view_key") || "");
  const shadow = el.shadowRoot || el.attachShadow({ mode: "open" });
  const style = document.createElement("style");
  style.textContent = REPORT_STYLE;
  const box = document.createElement("div");
  box.className = "attnviz embedded";
  box.tabIndex = 0; // focus it to move with the arrow keys
  box.innerHTML = REPORT_BODY; // the package's own static markup; data goes in as text only
  shadow.replaceChildren(style, box);
  const read = () => Object.fromEntries(SYNCED.map((key) => [key, model.get(key)]));
  const view = attnvizMount(shadow, model.get("_report"), {
    host: el,
    selection: read(),
    onChange(selection) {
      let changed = false;
      for (const key of SYNCED) {
        if (JSON.stringify(model.get(key)) !== JSON.stringify(selection[key])) {
          model.set(key, selection[key]);
          changed = true;
        }
      }
      if (changed) model.save_changes();
    },
  });
  // Several traits change in one message from Python: apply them together.
  let queued = false;
  const follow = () => {
    if (queued) return;
    queued = true;
    queueMicrotask(() => {
      queued = false;
      view.set(read());
    });
  };
  for (const key of SYNCED) model.on("change:" + key, follow);
  return () => {
    for (const key of SYNCED) model.off("change:" + key, follow);
    view.destroy();
    el.removeAttribute("data-attnviz-live");
  };
}

export default { render };
"""

# Shown where the frame is stripped (an untrusted notebook, a website's preview).
_TRUST_NOTE = (
    "<b>attnviz</b>: a static image of the view ({what}). The interactive view needs a "
    "trusted notebook: in JupyterLab or Notebook 7 run <i>Trust Notebook</i> from the command "
    "palette (or <code>jupyter trust NOTEBOOK.ipynb</code>) and open it again, or run the cell.")

# The static copy's style sheet: show the live widget or its copy, never both, never the
# widget's "Loading widget..." or "model not found". Keyed by the view, so it touches nothing
# else on the page; .jp-OutputArea-child is an output of JupyterLab and Notebook 7.
_COPY_STYLE = """<style>
:root:has([data-attnviz-live="{key}"]) [data-attnviz-static="{key}"],
:root:has([data-attnviz-live="{key}"]) .jp-OutputArea-child:has([data-attnviz-static="{key}"]),
.jp-OutputArea-child:not(:has([data-attnviz-live])):has(+ .jp-OutputArea-child
  [data-attnviz-static="{key}"]) {{ display: none; }}
</style>"""


def _widget_module() -> str:
    """The widget's ES module: ``report.js`` (it exports ``mount``) and the glue above."""
    from attnviz.render.html import report_body, report_module, report_style

    return report_module() + _GLUE % {
        "style": json.dumps(report_style()),
        "body": json.dumps(report_body()),
        "synced": json.dumps(list(_SYNCED)),
    }


def _check_size(capture: Capture, limit: int, what: str) -> None:
    size = int(capture.weights.size)
    if size > limit:
        shape = capture.weights.shape
        raise UsageError(
            f"this capture holds {size:,} weights ({shape[0]} layers x {shape[1]} heads x "
            f"{shape[2]}x{shape[3]} tokens), too many for {what} (at most {limit:,})",
            "show a part of it: capture.select(layers=[...], heads=[...]), or capture fewer "
            "tokens with max_tokens=")


def _check_capture(capture: Any) -> None:
    from attnviz.capture import Capture

    if not isinstance(capture, Capture):
        raise UsageError(f"attnviz.show needs a Capture, not {type(capture).__name__}",
                         "make one with attnviz.capture_text(text), attnviz.capture(model, "
                         "tokenizer, text), Capture.from_attentions(...) or load_capture(path)")


def _index(value: Any, what: str) -> int:
    """A layer or head index given from Python: a whole number (numpy integers too)."""
    import numbers

    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise UsageError(f"{what} must be a whole number such as 3 or -1, not {value!r:.40}")
    return int(value)


def _selection(capture: Capture, view: str, layer: int | None, head: int | None,
               heads: Sequence[int] | str | int | None) -> dict[str, Any]:
    if view not in VIEWS:
        raise UsageError(f"unknown view {view!r}: expected one of {', '.join(VIEWS)}")
    if head is not None and heads is not None:
        raise UsageError("give head= or heads=, not both")
    chosen_layer = (capture.layers[capture.layer_position(_index(layer, "layer"))]
                    if layer is not None else capture.layers[0])
    if head is not None:
        chosen_heads = [capture.heads[capture.head_position(_index(head, "head"))]]
    elif heads is not None:
        if isinstance(heads, str):  # "0,2-4", as the command line and capture_text take it
            from attnviz.selection import parse_selection

            picked = parse_selection(heads, capture.num_heads, "head")
        elif hasattr(heads, "__iter__"):
            picked = [_index(h, "head") for h in heads]
        else:
            picked = [_index(heads, "heads")]
        if not picked:
            raise UsageError("heads=[] selects no head",
                             "leave heads out to show every head, or name some: heads=[0, 3]")
        chosen_heads = sorted({capture.heads[capture.head_position(h)] for h in picked})
    else:
        chosen_heads = list(capture.heads)
    return {"view": view, "layer": chosen_layer, "heads": chosen_heads}


def _python_words(error: UsageError) -> UsageError:
    """The command line's ``--scale log`` / ``--gamma 9`` as a Python caller writes them."""
    def words(text: str | None) -> str | None:
        if text is None:
            return None
        text = re.sub(r"--scale ([a-z]+)", r"scale='\1'", text)
        return re.sub(r"--(scale|gamma|vmax)(?: (-?[\d.]+(?:e-?\d+)?|'[^']*'))?",
                      lambda m: f"{m.group(1)}={m.group(2)}" if m.group(2) else m.group(1), text)

    return UsageError(words(error.message) or error.message, words(error.hint))


def _colour_scale(scale: Any, gamma: Any, vmax: Any) -> dict[str, Any]:
    """``scale``, ``gamma`` and ``vmax`` checked as the command line checks them."""
    from attnviz.render.html import colour_scale

    for name, value in (("scale", scale), ("vmax", vmax)):
        if isinstance(value, bool) or not isinstance(value, (str, int, float, type(None))):
            raise UsageError(f"{name} must be a string or a number, not {value!r:.40}")
    if gamma is not None and (isinstance(gamma, bool) or not isinstance(gamma, (int, float))):
        raise UsageError(f"gamma must be a number such as 0.5, not {gamma!r:.40}")
    try:
        return colour_scale(scale, gamma, vmax)
    except UsageError as error:
        raise _python_words(error) from None


def _check_precision(precision: Any) -> None:
    if isinstance(precision, bool) or precision not in (8, 16) or not isinstance(
            precision, int):
        raise UsageError(f"precision must be 8 or 16 (bits per weight), not {precision!r:.40}",
                         "8: error at most 0.002, the smallest data; 16: error at most 7.63e-6")


def _checked_view(capture: Any, precision: Any, view: str, layer: int | None, head: int | None,
                  heads: Sequence[int] | str | int | None, scale: Any = None, gamma: Any = None,
                  vmax: Any = None) -> dict[str, Any]:
    """Check what an inline view is asked to show; its initial selection and colour scale."""
    _check_capture(capture)
    _check_precision(precision)
    _check_size(capture, MAX_VIEW_WEIGHTS, "an inline view")
    return _selection(capture, view, layer, head, heads) | _colour_scale(scale, gamma, vmax)


# --------------------------------------------------------------------------- static copies
def frame_height(capture: Capture, view: str = "head") -> int:
    """Pixels a fallback frame needs to show ``view`` of ``capture`` without scrolling inside.

    The heatmap and the model view are fitted into the frame (the report is told so); the head
    view of a long text and a long statistics table scroll past :data:`FRAME_MAX_PX`.
    """
    tokens, layers, heads = capture.num_tokens, len(capture.layers), len(capture.heads)
    if view == "heatmap":
        # title and margin, the rotated key labels (about 7 px a character), the matrix (cells
        # of up to 36 px; the report makes them smaller to fit)
        label = min(148, 8 + 7 * max((len(t) for t in capture.display_tokens), default=1))
        content = 38 + label + max(120, min(36 * tokens, 620))
    elif view == "model":
        content = 24 + layers * 66  # the head labels, then a row of thumbnails per layer
    elif view == "stats":
        content = 30 + 26 * (layers * heads + 1)
    else:
        content = 20 * tokens + 60  # a row per token
    return max(FRAME_MIN_PX, min(FRAME_MAX_PX, FRAME_CHROME_PX + content))


def iframe(document: str, *, height: int, title: str = "attnviz report") -> str:
    """A sandboxed ``<iframe srcdoc>`` holding a whole HTML document.

    The sandbox lets the report's own script run (and Save PNG download) but gives it an
    opaque origin: it cannot reach the notebook page, and the report's Content-Security-Policy
    still forbids every network request.
    """
    return (f'<iframe class="attnviz-report" title="{html.escape(title)}" '
            'sandbox="allow-scripts allow-downloads" '
            f'style="width: 100%; height: {int(height)}px; border: 1px solid #d8dce2; '
            'border-radius: 6px; background: #fff; grid-area: 1 / 1; z-index: 1;" '
            f'srcdoc="{html.escape(document, quote=True)}"></iframe>')


def _view_image(capture: Capture, selection: dict[str, Any], words: bool,
                exclude_special: bool) -> tuple[bytes, str]:
    """A PNG of the selection as the command line draws it, and what it shows.

    The model view is the overview of every layer and head; the other views are the heatmap of
    the selected layer and head (the mean of the selected heads).
    """
    from attnviz.render import heatmap

    options = heatmap.FigureOptions(scale=selection["scale"], vmax=selection["vmax"],
                                    gamma=selection["gamma"] if selection["scale"] == "power"
                                    else None, words=words, exclude_special=exclude_special,
                                    annot=capture.num_tokens <= 16)
    layer, heads = selection["layer"], list(selection["heads"]) or list(capture.heads)
    if selection["view"] == "model":
        figure = heatmap.capture_grid_figure(capture, None, options=options)
        what = "every layer and head"
    elif len(heads) == 1:
        figure = heatmap.capture_head_figure(capture, layer, heads[0], options=options).fig
        what = f"layer {layer}, head {heads[0]}"
    else:
        shown = capture if heads == list(capture.heads) else capture.select(heads=heads)
        figure = heatmap.capture_head_figure(shown, layer, "mean", options=options).fig
        what = f"layer {layer}, mean of {len(heads)} heads"
    width_in = float(figure.get_figwidth())
    dpi = max(heatmap.MIN_DPI, min(heatmap.DEFAULT_DPI, IMAGE_WIDTH_PX / width_in))
    return _palette_png(heatmap.figure_bytes(figure, "png", dpi)), what


def _palette_png(png: bytes) -> bytes:
    """``png`` with 256 colours: a quarter of the bytes a notebook has to keep, or less."""
    import io

    from PIL import Image

    with Image.open(io.BytesIO(png)) as image:
        reduced = image.convert("RGB").quantize(256, method=Image.Quantize.FASTOCTREE)
    out = io.BytesIO()
    reduced.save(out, format="PNG", optimize=True)
    return out.getvalue()


def _static_copy(document: str, height: int, title: str, image: tuple[bytes, str] | None,
                 key: str | None = None) -> str:
    """The frame over the image and its note; the frame covers both where frames run."""
    parts = ['<div class="attnviz-static" style="display: grid;"'
             + (f' data-attnviz-static="{key}"' if key else "") + ">"]
    if image is not None:
        png, what = image
        parts.append(
            f'<div style="grid-area: 1 / 1; max-height: {int(height)}px; overflow: hidden;">'
            f'<p>{_TRUST_NOTE.format(what=html.escape(what))}</p>'
            f'<img alt="{html.escape(title)}: {html.escape(what)}" '
            f'style="max-width: 100%; max-height: {max(100, int(height) - 70)}px;" '
            f'src="data:image/png;base64,{base64.b64encode(png).decode("ascii")}"></div>')
    parts.append(iframe(document, height=height, title=title))
    parts.append("</div>")
    if key:
        parts.append(_COPY_STYLE.format(key=key))
    return "".join(parts)


def _fallback(data: dict[str, Any], capture: Capture, *, image: bool, words: bool,
              exclude_special: bool, height: int | None, key: str | None = None) -> str:
    from attnviz.render.html import render_html

    low, high = HEIGHT_RANGE
    if height is not None and (isinstance(height, bool) or not isinstance(height, int)
                               or not low <= height <= high):
        raise UsageError(f"height must be a whole number of pixels from {low} to {high}, not "
                         f"{height!r:.40}", "leave it out for the height the view needs")

    selection = data["initial"]
    data = {**data, "fit": True}  # views fitted into the frame's height
    height = height or frame_height(capture, selection.get("view", "head"))
    picture = _view_image(capture, selection, words, exclude_special) if image else None
    return _static_copy(render_html(data), height, str(data["title"]), picture, key)


def static_html(capture: Capture, *, view: str = "head", layer: int | None = None,
                head: int | None = None, heads: Sequence[int] | str | int | None = None,
                words: bool = False, exclude_special: bool = False, precision: int = 8,
                title: str | None = None, height: int | None = None, scale: str | None = None,
                gamma: float | None = None, vmax: str | float | None = None,
                image: bool = True) -> str:
    """The static fallback: the self-contained report of ``capture`` in a sandboxed frame.

    It works wherever HTML does (nbconvert, a notebook without its kernel), with no widget
    machinery and no network. With ``image`` (default) the frame lies over a PNG of the view
    and a line on how to trust the notebook: what shows where frames are stripped (an
    untrusted notebook in JupyterLab or Notebook 7, previews on websites). The frame is
    ``height`` pixels high (default: what the view needs, :func:`frame_height`). Other options
    as in :func:`show`.
    """
    from attnviz.render.html import report_data

    selection = _checked_view(capture, precision, view, layer, head, heads, scale, gamma, vmax)
    data = report_data([capture], title=title, precision=precision, words=words,
                       exclude_special=exclude_special, selection=selection)
    return _fallback(data, capture, image=image, words=words, exclude_special=exclude_special,
                     height=height)


def capture_html(capture: Capture) -> str:
    """What a notebook shows for a bare capture: the report inline, or a summary if large."""
    if int(capture.weights.size) <= MAX_REPR_WEIGHTS:
        return static_html(capture)
    shape = " x ".join(str(n) for n in capture.weights.shape)
    return (f"<p><b>attnviz capture</b> of {html.escape(capture.model_label)}: "
            f"{capture.num_tokens} tokens, weights [layer, head, query, key] = {shape}. "
            "Too large to embed by default: use <code>capture.show()</code>, or "
            "<code>capture.select(layers=[...]).show()</code>.</p>")


def _in_kernel() -> bool:
    """Whether a view is shown as two outputs (the widget, then its static copy): in a Jupyter
    kernel, except under Colab (outputs in separate frames, which the copy's style sheet cannot
    reach) and VS Code (not tried): there the widget's bundle carries the copy instead."""
    shell = sys.modules.get("IPython")
    ipython = shell.get_ipython() if shell is not None else None
    if ipython is None or type(ipython).__name__ != "ZMQInteractiveShell":
        return False
    return "google.colab" not in sys.modules and "__vsc_ipynb_file__" not in ipython.user_ns


class AttentionView(anywidget.AnyWidget):
    """An inline, interactive view of one capture: the HTML report's front end in a widget.

    The selection is synced both ways: read or set :attr:`view`, :attr:`layer`,
    :attr:`heads` (or :attr:`head` for one), :attr:`words`, :attr:`special` and the colour
    scale (:attr:`scale`, :attr:`gamma`, :attr:`vmax`) from Python, and clicks in the browser
    update them. Layers and heads are the model's indices. The data flows from Python only:
    the browser may set the selection and nothing else.

    Args:
        capture: the capture to show.
        view: ``head``, ``model``, ``heatmap`` or ``stats``.
        layer: the layer to open on (default: the first one held).
        head: one head to open on; ``heads`` several (default: all heads held).
        words: merge subword tokens into words.
        exclude_special: hide special tokens (rows renormalised).
        precision: bits per weight in the view's data, 8 or 16 (see
            :func:`attnviz.render.html.quantise`).
        title: the heading; default names the model and text.
        scale, gamma, vmax: the colour scale, as the command line's ``--scale``, ``--gamma``
            and ``--vmax`` (default ``power`` with gamma 0.5, top ``"auto"``: the largest
            weight shown).
    """

    _esm = _widget_module()
    _report = traitlets.Dict().tag(sync=True)
    _view_key = traitlets.Unicode().tag(sync=True)
    view = traitlets.Unicode("head").tag(sync=True)
    layer = traitlets.Int(0).tag(sync=True)
    heads = traitlets.List(traitlets.Int()).tag(sync=True)
    words = traitlets.Bool(False).tag(sync=True)
    special = traitlets.Bool(True).tag(sync=True)
    scale = traitlets.Unicode("power").tag(sync=True)
    gamma = traitlets.Float(0.5).tag(sync=True)
    vmax = traitlets.Union([traitlets.Unicode(), traitlets.Float()],
                           default_value="auto").tag(sync=True)

    def __init__(self, capture: Capture, *, view: str = "head", layer: int | None = None,
                 head: int | None = None, heads: Sequence[int] | str | int | None = None,
                 words: bool = False, exclude_special: bool = False, precision: int = 8,
                 title: str | None = None, scale: str | None = None,
                 gamma: float | None = None, vmax: str | float | None = None) -> None:
        from attnviz.render.html import report_data

        selection = _checked_view(capture, precision, view, layer, head, heads, scale, gamma,
                                  vmax)
        self._capture = capture
        report = report_data([capture], title=title, precision=precision, words=words,
                             exclude_special=exclude_special, selection=selection)
        super().__init__(_report=report, _view_key=uuid.uuid4().hex, words=bool(words),
                         special=not exclude_special, **selection)

    @property
    def capture(self) -> Capture:
        """The capture on show."""
        return self._capture

    @property
    def head(self) -> int | None:
        """The selected head when exactly one is selected, else ``None``; set it to select one."""
        return self.heads[0] if len(self.heads) == 1 else None

    @head.setter
    def head(self, value: int) -> None:
        self.heads = [value]

    def __repr__(self) -> str:
        what = f"layer {self.layer}, " + (f"head {self.head}" if self.head is not None
                                          else f"{len(self.heads)} heads")
        return (f"AttentionView({self.view} view of {self._capture.model_label}: "
                f"{self._capture.num_tokens} tokens, {what})")

    # Values from Python and from the browser pass through these checks alike.
    @traitlets.validate("view")
    def _valid_view(self, proposal: dict[str, Any]) -> str:
        value = str(proposal["value"])
        if value not in VIEWS:
            raise traitlets.TraitError(f"unknown view {value!r}: expected one of "
                                       f"{', '.join(VIEWS)}")
        return value

    # A layer or head is a model index the capture holds (negative from the end, kept as the
    # index it names); true/false are not indices, and a selection of no head shows nothing.
    @traitlets.validate("layer")
    def _valid_layer(self, proposal: dict[str, Any]) -> int:
        try:
            index = _index(proposal["value"], "layer")
            return self._capture.layers[self._capture.layer_position(index)]
        except UsageError as error:
            raise traitlets.TraitError(error.message) from None

    @traitlets.validate("heads")
    def _valid_heads(self, proposal: dict[str, Any]) -> list[int]:
        try:
            picked = [_index(h, "head") for h in proposal["value"]]
            if not picked:
                raise UsageError("heads=[] selects no head")
            return sorted({self._capture.heads[self._capture.head_position(h)]
                           for h in picked})
        except UsageError as error:
            raise traitlets.TraitError(error.message) from None

    @traitlets.validate("scale", "gamma", "vmax")
    def _valid_scale(self, proposal: dict[str, Any]) -> Any:
        # Each on its own: a gamma kept while another scale is shown applies when power is back.
        name, value = proposal["trait"].name, proposal["value"]
        trial = {"scale": "power", "gamma": None, "vmax": None, name: value}
        try:
            checked = _colour_scale(trial["scale"], trial["gamma"], trial["vmax"])
        except UsageError as error:
            raise traitlets.TraitError(error.message) from None
        return checked[name]

    def set_state(self, sync_data: dict[str, Any]) -> None:
        """Apply a state the browser sent: only the selection, and only valid values.

        Anything else (the data, the widget's code) flows from Python only; a message naming it
        is refused as a whole, and so is a selection that does not check (the browser is then
        sent the state Python holds).
        """
        refused = sorted(set(sync_data) - set(_SYNCED))
        if refused:
            self.log.warning("attnviz: the browser may set only the selection (%s); ignored a "
                             "message setting %s", ", ".join(_SYNCED), ", ".join(refused))
            self.send_state([key for key in sync_data if key in _SYNCED])
            return
        try:
            super().set_state(sync_data)
        except traitlets.TraitError as error:
            self.log.warning("attnviz: ignored a selection from the browser: %s", error)
            self.send_state(list(sync_data))

    def _current(self) -> dict[str, Any]:
        """The report data with the current selection as its initial one."""
        data = dict(self._report)
        data["initial"] = {**data["initial"], "view": self.view, "layer": self.layer,
                           "heads": list(self.heads), "words": self.words,
                           "special": self.special, "scale": self.scale, "gamma": self.gamma,
                           "vmax": self.vmax}
        return data

    def static_html(self, height: int | None = None, *, image: bool = True) -> str:
        """The static copy of the current selection (see :func:`static_html`)."""
        return _fallback(self._current(), self._capture, image=image, words=self.words,
                         exclude_special=not self.special, height=height)

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        bundle = super()._repr_mimebundle_(**kwargs)
        if bundle is None:
            return None
        data, metadata = bundle
        # Front ends with widgets pick the widget; the others (nbconvert, previews) the HTML.
        return {**data, "text/html": self.static_html()}, metadata

    def _ipython_display_(self, **kwargs: Any) -> None:
        """In a Jupyter kernel: the widget, then its static copy as an output of its own."""
        from IPython.display import display

        bundle = super()._repr_mimebundle_(**kwargs)
        if bundle is None:
            return
        if not _in_kernel():
            data, metadata = self._repr_mimebundle_(**kwargs)
            display(data, metadata=metadata, raw=True)
            return
        data, metadata = bundle
        display(data, metadata=metadata, raw=True)
        copy = _fallback(self._current(), self._capture, image=True, words=self.words,
                         exclude_special=not self.special, height=None, key=self._view_key)
        display({"text/html": copy, "text/plain": f"(static copy of {self!r})"}, raw=True)


# A stand-in for the anywidget model: get/set/on/off/save_changes over plain values.
_PREVIEW_HOST = """
function standInModel(values) {
  const handlers = {};
  return {
    values, saves: 0,
    get(key) { return values[key]; },
    set(key, value) { values[key] = value; for (const h of handlers["change:" + key] || []) h(); },
    on(name, h) { (handlers[name] = handlers[name] || []).push(h); },
    off(name, h) { handlers[name] = (handlers[name] || []).filter((x) => x !== h); },
    save_changes() { this.saves += 1; },
  };
}
const states = JSON.parse(document.getElementById("attnviz-states").textContent);
window.attnvizModels = states.map(standInModel);
window.attnvizCleanups = window.attnvizModels.map((model, i) =>
  render({ model, el: document.getElementById("view" + i) }));
"""


def preview_page(views: Sequence[AttentionView], captions: Sequence[str] | None = None) -> str:
    """A standalone page that runs the views' ES module as a notebook would, without Jupyter.

    Each view gets a stand-in for its widget model (``window.attnvizModels[i]``: ``get``,
    ``set``, ``on``, ``off``, ``save_changes``, and ``values``), so the page shows what the
    notebook shows and its selection can be read and set from the page's JavaScript. Used for
    screenshots and browser tests; ``captions`` go above the views as code.
    """
    from attnviz.render.html import script_json

    if not views:
        raise UsageError("a preview needs at least one view")
    states = [{key: getattr(view, key) for key in _SYNCED}
              | {"_report": view._report, "_view_key": view._view_key} for view in views]
    parts = []
    for i, _ in enumerate(views):
        if captions is not None and i < len(captions):
            parts.append(f'<pre class="caption">{html.escape(captions[i])}</pre>')
        parts.append(f'<div id="view{i}" class="view"></div>')
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<title>attnviz views</title><style>body { margin: 16px; font-family: system-ui, "
            "sans-serif; } .caption { margin: 18px 0 6px; padding: 6px 10px; "
            "background: #f5f6f8; border: 1px solid #d8dce2; border-radius: 4px; "
            "font-size: 13px; } .view { margin-bottom: 8px; }</style></head><body>"
            + "".join(parts)
            + f'<script type="application/json" id="attnviz-states">{script_json(states)}'
            # Inside strings, "<\/" is "</": no text in the module can close its element.
            "</script><script type=\"module\">" + views[0]._esm.replace("</", "<\\/")
            + _PREVIEW_HOST
            + "</script></body></html>")


def show(capture: Capture, view: str = "head", *, layer: int | None = None,
         head: int | None = None, heads: Sequence[int] | str | int | None = None,
         words: bool = False, exclude_special: bool = False, precision: int = 8,
         title: str | None = None, scale: str | None = None, gamma: float | None = None,
         vmax: str | float | None = None) -> AttentionView:
    """Show a capture inline in a notebook: the report's views, interactive.

    Args:
        capture: the capture (from :func:`attnviz.capture_text`, :func:`attnviz.capture`,
            :meth:`~attnviz.capture.Capture.from_attentions` or a saved dump).
        view: ``head`` (lines between tokens), ``model`` (every layer and head),
            ``heatmap`` or ``stats`` (head statistics).
        layer: the layer to open on; ``head`` one head, or ``heads`` several (a list, one
            index, or a selection such as ``"0,2-4"``). Negative indices count from the end.
        words: merge subword tokens into words; ``exclude_special`` hide special tokens.
        precision: bits per weight in the view's data (8: error <= 0.002; 16: <= 7.63e-6).
        title: the heading; default names the model and text.
        scale: the colour scale, ``power`` (default), ``linear`` or ``log``; ``gamma`` the
            power scale's exponent (default 0.5); ``vmax`` the weight in the top colour,
            ``"auto"`` (default: the largest weight shown) or a number (``1``: fixed 0..1).
            As the command line's ``--scale``, ``--gamma`` and ``--vmax``.

    Returns:
        The widget; its ``layer``, ``heads``/``head``, ``view`` and colour scale follow the
        browser and can be set from Python.

    Raises:
        UsageError: not a capture, an unknown view, a layer or head not in the capture (or not
            a whole number), a precision other than 8 or 16, a colour scale the command line
            would refuse, or a capture too large to embed (the message says how to select a
            part).
    """
    return AttentionView(capture, view=view, layer=layer, head=head, heads=heads, words=words,
                         exclude_special=exclude_special, precision=precision, title=title,
                         scale=scale, gamma=gamma, vmax=vmax)


__all__ = ["AttentionView", "show", "static_html", "capture_html", "iframe", "frame_height",
           "preview_page", "VIEWS"]
