"""The zoomable long-context view inline in a notebook: one head over the whole context.

:func:`show_long` returns a :class:`LongAttentionView`, an anywidget widget that draws the same
front end as ``attnviz serve``'s page ``/long`` (``render/assets/long.js``, mounted in a shadow
root)::

    from attnviz.long import load_long
    from attnviz.notebook_long import show_long

    view = show_long(load_long("book_long/"))

The widget carries the capture's description (tokens, sizes, atlas levels); atlas levels, exact
tiles and the head statistics are asked of the kernel as the widget's custom messages and come
back as float32 buffers, computed on demand from the capture's queries, keys and log-sum-exp,
so nothing of ``T x T`` size travels or sits in the notebook. A request is bounded as the
server bounds it (``max_values`` values in one answer); the browser can ask for data and
nothing else.

The live view needs its kernel. As :func:`attnviz.show` does, a displayed view is two outputs:
the widget and its static copy (:func:`static_long_html`: the offline long report,
``attnviz html --long-from``, in a sandboxed ``<iframe srcdoc>`` over a PNG of the first
head's atlas), and a small style sheet shows the widget while it is on the page and the copy
otherwise: a saved notebook reopened without a kernel, or with a new one that has no widget
state, shows the copy instead of "Error displaying widget: model not found". The copy holds
the atlas levels that fit :data:`STATIC_CELLS` cells.
"""

from __future__ import annotations

import json
import uuid
from typing import TYPE_CHECKING, Annotated, Any, Literal

import anywidget
import traitlets

from attnviz.errors import AttnvizError, UsageError
from attnviz.server.long_routes import _Head, _head_value
from attnviz.server.requests import _Request, between, one_of

if TYPE_CHECKING:
    import numpy as np

    from attnviz.long import LongCapture

#: Values in one answer to the browser (a tile, or an atlas level's sums and maxima).
MAX_VALUES = 1 << 22
#: Atlas cells the static copy embeds (every level, layer and head): at most 512 KiB of float32
#: before compression, so a saved notebook stays small.
STATIC_CELLS = 1 << 17
#: The static copy's frame height, in pixels.
STATIC_HEIGHT_PX = 860

_Layer = Annotated[int, between(-(1 << 20), 1 << 20)]
_Pos = Annotated[int, between(0, 1 << 24)]


class _Ask(_Request):
    request: Annotated[int, between(0, 1 << 52)]


class TileMessage(_Ask):
    """The browser asks for ``A[q0:q1, k0:k1]`` of one head (or ``"mean"``)."""

    kind: Annotated[Literal["tile"], one_of("tile")]
    layer: _Layer
    head: _Head
    q0: _Pos
    q1: _Pos
    k0: _Pos
    k1: _Pos


class AtlasMessage(_Ask):
    """The browser asks for one atlas level of one head."""

    kind: Annotated[Literal["atlas"], one_of("atlas")]
    layer: _Layer
    head: _Head
    block: Annotated[int, between(16, 1 << 20)]


class StatsMessage(_Ask):
    """The browser asks for the head statistics and the top sinks."""

    kind: Annotated[Literal["stats"], one_of("stats")]


_GLUE = """
const LONG_STYLE = %(style)s;
const LONG_BODY = %(body)s;

// The kernel answers the view's requests: each message carries a number, the answer names it.
// `alive` runs at the first answer: only then is the widget live (a widget restored from saved
// state, with no kernel object behind it, never hears back, and its static copy stays shown).
function kernelSource(model, alive) {
  let next = 0;
  const waiting = new Map();
  const listener = (msg, buffers) => {
    if (!msg || msg.kind !== "answer" || !waiting.has(msg.request)) return;
    alive();
    const wait = waiting.get(msg.request);
    waiting.delete(msg.request);
    if (msg.error) wait.reject(new Error(msg.error));
    else wait.resolve({ msg, buffers: buffers || [] });
  };
  model.on("msg:custom", listener);
  const ask = (body) => new Promise((resolve, reject) => {
    next += 1;
    waiting.set(next, { resolve, reject });
    model.send(Object.assign({ request: next }, body));
  });
  const floats = (b) => new Float32Array(
    b.buffer ? b.buffer.slice(b.byteOffset, b.byteOffset + b.byteLength) : b);
  return {
    exact: true,
    listener,
    async info() { return model.get("_info"); },
    async atlas(layer, head, block) {
      const { msg, buffers } = await ask({ kind: "atlas", layer, head, block });
      const n = msg.shape[0];
      const values = floats(buffers[0]);
      return { n, sums: values.subarray(0, n * n), maxes: values.subarray(n * n) };
    },
    async tile(layer, head, q0, q1, k0, k1) {
      const { buffers } = await ask({ kind: "tile", layer, head, q0, q1, k0, k1 });
      return floats(buffers[0]);
    },
    async stats() {
      const { msg } = await ask({ kind: "stats" });
      return msg.stats;
    },
  };
}

function render({ model, el }) {
  const shadow = el.shadowRoot || el.attachShadow({ mode: "open" });
  const style = document.createElement("style");
  style.textContent = LONG_STYLE;
  const box = document.createElement("div");
  box.className = "attnviz-long";
  box.innerHTML = LONG_BODY; // the package's own static markup; data goes in as text only
  shadow.replaceChildren(style, box);
  // Once the kernel answers, the view's static copy (the next output) hides itself.
  let live = false;
  const source = kernelSource(model, () => {
    if (live) return;
    live = true;
    el.setAttribute("data-attnviz-live", model.get("_view_key") || "");
    shadow.getElementById("long-error").hidden = true;
  });
  el.attnvizLong = attnvizLongMount(shadow, source, el);
  const silent = setTimeout(() => {
    if (live) return;
    const box = shadow.getElementById("long-error");
    box.textContent = "No answer from the kernel: this view asks the kernel that made it for " +
      "its data. Run the cell again; the saved copy of the view shows meanwhile.";
    box.hidden = false;
  }, 8000);
  return () => {
    clearTimeout(silent);
    model.off("msg:custom", source.listener);
    el.removeAttribute("data-attnviz-live");
  };
}

export default { render };
"""


def _module() -> str:
    from attnviz.render.long_html import asset, long_body, long_module

    return long_module() + _GLUE % {"style": json.dumps(asset("long.css")),
                                    "body": json.dumps(long_body("attnviz long context"))}


class LongAttentionView(anywidget.AnyWidget):
    """An inline, zoomable view of one long capture (see the module docstring).

    Args:
        capture: the long capture (:func:`attnviz.long.load_long`, or
            :func:`attnviz.long.capture_long`).
        max_values: the most values one answer to the browser may hold.
    """

    _esm = _module()
    _info = traitlets.Dict().tag(sync=True)
    _view_key = traitlets.Unicode().tag(sync=True)

    def __init__(self, capture: LongCapture, *, max_values: int = MAX_VALUES) -> None:
        from attnviz.server.long_routes import AtlasCache, view_payload

        if max_values < 1:
            raise UsageError(f"max_values must be at least 1, got {max_values}")
        self._capture = capture
        self._max_values = int(max_values)
        self._atlas = AtlasCache()
        self._stats: dict[str, Any] | None = None
        self._copy: str | None = None
        super().__init__(_info=view_payload("notebook", capture, self._max_values),
                         _view_key=uuid.uuid4().hex)
        self.on_msg(self._on_message)

    @property
    def capture(self) -> LongCapture:
        """The capture on show."""
        return self._capture

    def __repr__(self) -> str:
        return (f"LongAttentionView({self._capture.model_label!r}, "
                f"{int(self._capture.num_tokens):,} tokens)")

    def set_state(self, sync_data: dict[str, Any]) -> None:
        """Refuse a state the browser sent: the view's description flows from Python only,
        and the browser asks for data with messages (:meth:`answer`); it is sent the state
        Python holds instead."""
        self.log.warning("attnviz: the browser may set nothing of a long view; ignored a "
                         "message setting %s", ", ".join(sorted(map(str, sync_data)))[:200])
        self.send_state([key for key in sync_data if key in self.keys])

    def answer(self, content: Any) -> tuple[dict[str, Any], list[bytes]]:
        """The answer to one request of the browser: its JSON part and its float32 buffers.

        Raises:
            AttnvizError: a request this view does not take (unknown, out of range, too big).
        """
        import numpy as np

        from attnviz.server.requests import parse

        kind = content.get("kind") if isinstance(content, dict) else None
        models: dict[str, type[_Ask]] = {"tile": TileMessage, "atlas": AtlasMessage,
                                         "stats": StatsMessage}
        if str(kind) not in models:
            raise UsageError(f"unknown request {str(kind)[:40]!r}: expected tile, atlas or stats")
        message: _Ask = parse(models[str(kind)], content, max_chars=64, max_k=1)
        cap = self._capture
        if isinstance(message, TileMessage):
            count = max(0, message.q1 - message.q0) * max(0, message.k1 - message.k0)
            self._bound(count, "the tile")
            weights = cap.tile(message.layer, _head_value(message.head), message.q0,
                               message.q1, message.k0, message.k1)
            return {"shape": list(weights.shape)}, [_bytes(weights)]
        if isinstance(message, AtlasMessage):
            side = -(-int(cap.num_tokens) // message.block)
            self._bound(2 * side * side, "the atlas")
            sums, maxes = self._atlas.atlas(cap, message.layer, _head_value(message.head),
                                            message.block)
            return {"shape": list(sums.shape)}, [_bytes(np.concatenate([sums.ravel(),
                                                                        maxes.ravel()]))]
        if self._stats is None:
            from attnviz.render.long_html import long_stats

            self._stats = long_stats(cap)
        return {"stats": self._stats}, []

    def static_html(self) -> str:
        """This view's static copy (:func:`static_long_html`), keyed to the view so the live
        widget hides it while it is on the page; made once."""
        if self._copy is None:
            self._copy = static_long_html(self._capture, key=self._view_key)
        return self._copy

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

        from attnviz.notebook import _in_kernel

        bundle = super()._repr_mimebundle_(**kwargs)
        if bundle is None:
            return
        if not _in_kernel():
            data, metadata = self._repr_mimebundle_(**kwargs)
            display(data, metadata=metadata, raw=True)
            return
        # made before the widget is shown: anything printed while it is made (a warning)
        # would otherwise fall between the two outputs, which must be neighbours
        copy = self.static_html()
        data, metadata = bundle
        display(data, metadata=metadata, raw=True)
        display({"text/html": copy, "text/plain": f"(static copy of {self!r})"}, raw=True)

    def _bound(self, count: int, what: str) -> None:
        if count > self._max_values:
            raise UsageError(f"{what} holds {count:,} values; this view sends at most "
                             f"{self._max_values:,} at once", "ask for a smaller part")

    def _on_message(self, widget: Any, content: Any, buffers: Any) -> None:
        request = content.get("request") if isinstance(content, dict) else None
        try:
            reply, data = self.answer(content)
        except AttnvizError as error:
            text = error.message + (f": {error.hint}" if error.hint else "")
            reply, data = {"error": text}, []
        self.send({"kind": "answer", "request": request, **reply}, data)


def _bytes(values: np.ndarray) -> bytes:
    import numpy as np

    return np.ascontiguousarray(values, dtype="<f4").tobytes()


def static_long_html(capture: LongCapture, *, max_cells: int = STATIC_CELLS,
                     key: str | None = None, image: bool = True) -> str:
    """The static copy of a long view: the offline long report (the atlas levels that fit
    ``max_cells``, the statistics and sinks) in a sandboxed frame, over a PNG of the first
    layer's head 0 as ``attnviz heatmap --from`` draws its atlas (``image``), shown where
    frames are stripped (an untrusted notebook). Works with no kernel and no network."""
    from attnviz.notebook import _static_copy
    from attnviz.render.long_html import long_report_data, render_long_html

    data = long_report_data(capture, max_cells=max_cells)
    picture = _atlas_image(capture) if image else None
    return _static_copy(render_long_html(data), STATIC_HEIGHT_PX, str(data["title"]), picture,
                        key)


def _atlas_image(capture: LongCapture) -> tuple[bytes, str]:
    """A PNG of the first recorded layer's head 0 (its atlas), and what it shows."""
    from attnviz.notebook import IMAGE_WIDTH_PX, _palette_png
    from attnviz.render import heatmap
    from attnviz.render.atlas import HEAD_BLOCKS, atlas_head_figure

    layer = int(capture.layers[0])
    # at the block of the summary the report data has just made: no further pass over the head
    blocks = min(HEAD_BLOCKS, -(-int(capture.num_tokens) // capture.summarise().block))
    figure, block = atlas_head_figure(capture, layer, 0, options=heatmap.FigureOptions(),
                                      blocks=blocks)
    dpi = max(heatmap.MIN_DPI, min(heatmap.DEFAULT_DPI,
                                   IMAGE_WIDTH_PX / float(figure.get_figwidth())))
    png = heatmap.figure_bytes(figure, "png", dpi)
    return _palette_png(png), f"layer {layer}, head 0, {block}-token blocks"


def show_long(capture: LongCapture, *, max_values: int = MAX_VALUES) -> LongAttentionView:
    """Show a long capture inline: one head (or the mean) over the whole context, zoomable
    from the block atlas down to exact token weights (see :class:`LongAttentionView`)."""
    return LongAttentionView(capture, max_values=max_values)


__all__ = ["LongAttentionView", "show_long", "static_long_html"]
