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
nothing else. It needs a running kernel: a saved notebook shows no view without one.
"""

from __future__ import annotations

import json
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
function kernelSource(model) {
  let next = 0;
  const waiting = new Map();
  const listener = (msg, buffers) => {
    if (!msg || msg.kind !== "answer" || !waiting.has(msg.request)) return;
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
  const source = kernelSource(model);
  el.attnvizLong = attnvizLongMount(shadow, source, el);
  return () => model.off("msg:custom", source.listener);
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

    def __init__(self, capture: LongCapture, *, max_values: int = MAX_VALUES) -> None:
        from attnviz.server.long_routes import AtlasCache, view_payload

        if max_values < 1:
            raise UsageError(f"max_values must be at least 1, got {max_values}")
        self._capture = capture
        self._max_values = int(max_values)
        self._atlas = AtlasCache()
        self._stats: dict[str, Any] | None = None
        super().__init__(_info=view_payload("notebook", capture, self._max_values))
        self.on_msg(self._on_message)

    @property
    def capture(self) -> LongCapture:
        """The capture on show."""
        return self._capture

    def __repr__(self) -> str:
        return (f"LongAttentionView({self._capture.model_label!r}, "
                f"{int(self._capture.num_tokens):,} tokens)")

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


def show_long(capture: LongCapture, *, max_values: int = MAX_VALUES) -> LongAttentionView:
    """Show a long capture inline: one head (or the mean) over the whole context, zoomable
    from the block atlas down to exact token weights (see :class:`LongAttentionView`)."""
    return LongAttentionView(capture, max_values=max_values)


__all__ = ["LongAttentionView", "show_long"]
