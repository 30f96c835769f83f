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
number of views share a notebook without touching each other. Where widgets cannot run
(nbconvert, a notebook preview on a website), the notebook shows the static fallback each view
also carries: the self-contained HTML report in a sandboxed ``<iframe srcdoc>``.
"""

from __future__ import annotations

import html
import json
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

_SYNCED = ("view", "layer", "heads", "words", "special")

# The widget's glue: report.js mounted in a shadow root, the selection synced both ways.
_GLUE = """
const REPORT_STYLE = %(style)s;
const REPORT_BODY = %(body)s;
const SYNCED = %(synced)s;

function render({ model, el }) {
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
  };
}

export default { render };
"""


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


def _check_precision(precision: Any) -> None:
    if isinstance(precision, bool) or precision not in (8, 16) or not isinstance(
            precision, int):
        raise UsageError(f"precision must be 8 or 16 (bits per weight), not {precision!r:.40}",
                         "8: error at most 0.002, the smallest data; 16: error at most 7.63e-6")


def _checked_view(capture: Any, precision: Any, view: str, layer: int | None, head: int | None,
                  heads: Sequence[int] | str | int | None) -> dict[str, Any]:
    """Check what an inline view is asked to show; its initial selection."""
    _check_capture(capture)
    _check_precision(precision)
    _check_size(capture, MAX_VIEW_WEIGHTS, "an inline view")
    return _selection(capture, view, layer, head, heads)


def _frame_height(capture: Capture) -> int:
    """Room for the head view of a short text without a second scroll bar; capped."""
    return max(520, min(860, 300 + 22 * capture.num_tokens))


def iframe(document: str, *, height: int, title: str = "attnviz report") -> str:
    """A sandboxed ``<iframe srcdoc>`` holding a whole HTML document.

    The sandbox lets the report's own script run (and Save PNG download) but gives it an
    opaque origin: it cannot reach the notebook page, and the report's Content-Security-Policy
    still forbids every network request.
    """
    return (f'<iframe class="attnviz-report" title="{html.escape(title)}" '
            'sandbox="allow-scripts allow-downloads" '
            f'style="width: 100%; height: {int(height)}px; border: 1px solid #d8dce2; '
            f'border-radius: 6px;" srcdoc="{html.escape(document, quote=True)}"></iframe>')


def static_html(capture: Capture, *, view: str = "head", layer: int | None = None,
                head: int | None = None, heads: Sequence[int] | str | int | None = None,
                words: bool = False, exclude_special: bool = False, precision: int = 8,
                title: str | None = None, height: int | None = None) -> str:
    """The static fallback: the self-contained report of ``capture`` in an iframe.

    It works wherever HTML does (nbconvert, JupyterLab without the kernel), with no widget
    machinery and no network. Options as in :func:`show`.
    """
    from attnviz.render.html import build_report, default_title

    selection = _checked_view(capture, precision, view, layer, head, heads)
    title = title or default_title([capture])
    document = build_report([capture], title=title, precision=precision, words=words,
                            exclude_special=exclude_special, selection=selection)
    return iframe(document, height=height or _frame_height(capture), title=title)


def capture_html(capture: Capture) -> str:
    """What a notebook shows for a bare capture: the report inline, or a summary if large."""
    if int(capture.weights.size) <= MAX_REPR_WEIGHTS:
        return static_html(capture)
    shape = " x ".join(str(n) for n in capture.weights.shape)
    return (f"<p><b>attnviz capture</b> of {html.escape(capture.model)}: "
            f"{capture.num_tokens} tokens, weights [layer, head, query, key] = {shape}. "
            "Too large to embed by default: use <code>capture.show()</code>, or "
            "<code>capture.select(layers=[...]).show()</code>.</p>")


class AttentionView(anywidget.AnyWidget):
    """An inline, interactive view of one capture: the HTML report's front end in a widget.

    The selection is synced both ways: read or set :attr:`view`, :attr:`layer`,
    :attr:`heads` (or :attr:`head` for one), :attr:`words` and :attr:`special` from Python,
    and clicks in the browser update them. Layers and heads are the model's indices.

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
    """

    _esm = _widget_module()
    _report = traitlets.Dict().tag(sync=True)
    view = traitlets.Unicode("head").tag(sync=True)
    layer = traitlets.Int(0).tag(sync=True)
    heads = traitlets.List(traitlets.Int()).tag(sync=True)
    words = traitlets.Bool(False).tag(sync=True)
    special = traitlets.Bool(True).tag(sync=True)

    def __init__(self, capture: Capture, *, view: str = "head", layer: int | None = None,
                 head: int | None = None, heads: Sequence[int] | str | int | None = None,
                 words: bool = False, exclude_special: bool = False, precision: int = 8,
                 title: str | None = None) -> None:
        from attnviz.render.html import report_data

        selection = _checked_view(capture, precision, view, layer, head, heads)
        self._capture = capture
        report = report_data([capture], title=title, precision=precision, words=words,
                             exclude_special=exclude_special, selection=selection)
        super().__init__(_report=report, view=selection["view"], layer=selection["layer"],
                         heads=selection["heads"], words=bool(words),
                         special=not exclude_special)

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

    # Values from Python and from the browser pass through these checks alike.
    @traitlets.validate("view")
    def _valid_view(self, proposal: dict[str, Any]) -> str:
        value = str(proposal["value"])
        if value not in VIEWS:
            raise traitlets.TraitError(f"unknown view {value!r}: expected one of "
                                       f"{', '.join(VIEWS)}")
        return value

    @traitlets.validate("layer")
    def _valid_layer(self, proposal: dict[str, Any]) -> int:
        try:
            return self._capture.layers[self._capture.layer_position(int(proposal["value"]))]
        except UsageError as error:
            raise traitlets.TraitError(error.message) from None

    @traitlets.validate("heads")
    def _valid_heads(self, proposal: dict[str, Any]) -> list[int]:
        try:
            return sorted({self._capture.heads[self._capture.head_position(int(h))]
                           for h in proposal["value"]})
        except UsageError as error:
            raise traitlets.TraitError(error.message) from None

    def static_html(self, height: int | None = None) -> str:
        """The static fallback of the current selection (see :func:`static_html`)."""
        from attnviz.render.html import render_html

        data = dict(self._report)
        data["initial"] = {**data["initial"], "view": self.view, "layer": self.layer,
                           "heads": list(self.heads), "words": self.words,
                           "special": self.special}
        return iframe(render_html(data), height=height or _frame_height(self._capture),
                      title=str(data["title"]))

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        bundle = super()._repr_mimebundle_(**kwargs)
        if bundle is None:
            return None
        data, metadata = bundle
        # Front ends with widgets pick the widget; the others (nbconvert, previews) the HTML.
        return {**data, "text/html": self.static_html()}, metadata


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
    states = [{key: getattr(view, key) for key in _SYNCED} | {"_report": view._report}
              for view in views]
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
         title: str | None = None) -> AttentionView:
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

    Returns:
        The widget; its ``layer``, ``heads``/``head`` and ``view`` follow the browser and can
        be set from Python.

    Raises:
        UsageError: not a capture, an unknown view, a layer or head not in the capture (or not
            a whole number), a precision other than 8 or 16, or a capture too large to embed
            (the message says how to select a part).
    """
    return AttentionView(capture, view=view, layer=layer, head=head, heads=heads, words=words,
                         exclude_special=exclude_special, precision=precision, title=title)


__all__ = ["AttentionView", "show", "static_html", "capture_html", "iframe",
           "preview_page", "VIEWS"]
