"""Long contexts: attention of any length from queries, keys and log-sum-exp.

A full capture holds ``layers x heads x T x T`` weights, which no machine holds at LLM lengths.
A long capture keeps what the model's own kernel sees (queries after RoPE, keys before
grouped-query expansion, the scale and window) and each query row's log-sum-exp, on disk and
memory-mapped; any weight is then ``exp(scale * q.k - lse)`` under the mask, computed exactly
when it is asked for. See ``docs/long.md``.

Example::

    from attnviz.models.hf import HFSource
    from attnviz.long import capture_long

    cap = capture_long(HFSource("./llama"), text, dtype="bfloat16")
    indices, weights = cap.topk(layer=2, head=3, k=5)
    sums, maxes = cap.atlas(2, "mean", block=256)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from attnviz.long.record import MAX_TILE, MAX_TOPK, LongCapture, LongUnsupported, load_long

if TYPE_CHECKING:
    from attnviz.long.seam import capture_long

__all__ = ["MAX_TILE", "MAX_TOPK", "LongCapture", "LongUnsupported", "capture_long",
           "load_long"]


def __getattr__(name: str) -> Any:
    if name == "capture_long":  # imports torch and transformers: only when asked for
        from attnviz.long.seam import capture_long

        return capture_long
    raise AttributeError(f"module 'attnviz.long' has no attribute {name!r}")
