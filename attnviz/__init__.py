"""attnviz: see what a transformer's attention does.

The Python API mirrors the command line::

    from attnviz import capture_text, load_capture
    cap = capture_text("The cat sat on the mat")          # bundled MiniLM, all layers and heads
    cap.weights.shape                       # (6, 12, 8, 8): [layer, head, query, key]
    cap.save("cat")                                        # cat/attention.npy + cat/capture.json
    cap = load_capture("cat")                              # no torch needed

Bring your own model (any transformers model already in memory, on any device) and look at
the attention inline in a notebook::

    cap = attnviz.capture(model, tokenizer, "The cat sat on the mat")
    attnviz.show(cap, view="heatmap")

Importing this package is cheap: torch, transformers and matplotlib load on first use.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

# The record module loads first, so that the `capture` function below, not the module, is what
# `attnviz.capture` names (`from attnviz.capture import Capture` works as ever). It is cheap:
# numpy and everything heavier load on first use.
import attnviz.capture as _capture_module
from attnviz._version import __version__

if TYPE_CHECKING:
    from attnviz.capture import Capture
    from attnviz.long.generate import Generation
    from attnviz.notebook import AttentionView
    from attnviz.session import Session

__all__ = ["__version__", "Capture", "Session", "capture", "capture_text", "generate",
           "load_capture", "show"]


def capture_text(text: str, model: str | None = None, pair: str | None = None, **options: Any
                 ) -> Capture:
    """Capture the attention of ``model`` (default: the bundled MiniLM) on ``text``.

    Goes through the process-wide :func:`attnviz.session.default_session`: the model is loaded
    once and kept warm, and texts already in the capture cache skip the model. Keyword options
    are those of :class:`attnviz.models.ModelSpec` (``revision``, ``device``, ``dtype``,
    ``trust_remote_code``, ``toy``) and of :meth:`attnviz.session.Session.capture` (``layers``,
    ``heads``, ``max_tokens``, ``truncate``, ``use_cache``, ``measure``: ``"weights"`` or
    ``"norm"``, ``"norm-res-ln"``, ``"alti"``, ``"value-zeroing"``, see :mod:`attnviz.measures`).
    """
    from attnviz.session import default_session

    return default_session().capture(text, pair, model=model, **options)


def generate(prompt: str, model: str | None = None, *, max_new_tokens: int = 20,
             **options: Any) -> Generation:
    """Generate up to ``max_new_tokens`` tokens after ``prompt`` with a causal language model
    (its key/value cache and its own attention kernel) and record which tokens each generated
    token attended to: ``result.rows`` is ``[layer, head, step, key]``, ``result.top_k()``
    lists the strongest keys per generated token.

    Goes through :func:`attnviz.session.default_session` (the model stays warm). Options:
    ``sample``, ``seed``, ``layers``, ``heads``, ``max_tokens``, ``truncate`` and the model
    options of :class:`attnviz.models.ModelSpec`; see :meth:`attnviz.session.Session.generate`.
    """
    from attnviz.session import default_session

    return default_session().generate(prompt, model=model, max_new_tokens=max_new_tokens,
                                      **options)


def capture(model: Any, tokenizer: Any, text: str, pair: str | None = None, *,
            layers: str | int | Sequence[int] | None = None,
            heads: str | int | Sequence[int] | None = None,
            max_tokens: int | None = None, truncate: bool = True,
            measure: str = "weights") -> Capture:
    """Capture the attention of a transformers model you already hold, on ``text``.

    Any device, any dtype, no reload. A model running with ``sdpa`` or flash attention is
    switched to eager attention (and eval mode) for the call and restored afterwards.
    ``measure`` (``"norm"``, ``"norm-res-ln"``, ``"alti"``, ``"value-zeroing"``) captures that
    measure instead of the weights. See :func:`attnviz.models.own.capture`.
    """
    from attnviz.errors import python_names
    from attnviz.models.own import capture as capture_own

    with python_names():
        return capture_own(model, tokenizer, text, pair, layers=layers, heads=heads,
                           max_tokens=max_tokens, truncate=truncate, measure=measure)


def show(capture: Capture, view: str = "head", **options: Any) -> AttentionView:
    """Show a capture inline in a notebook (``view``: head, model, heatmap or stats).

    Options: ``layer``, ``head``/``heads``, ``words``, ``exclude_special``, ``precision``,
    ``title``; see :func:`attnviz.notebook.show`.
    """
    from attnviz.notebook import show as show_inline

    return show_inline(capture, view, **options)


def _heatmap_view(capture: Capture, /, layer: int, head: int | str = "mean", ax: Any = None,
                  **options: Any) -> tuple[Any, Any]:
    from attnviz.render.heatmap import capture_heatmap

    return capture_heatmap(capture, layer, head, ax, **options)


def _html_view(capture: Capture) -> str:
    from attnviz.notebook import capture_html

    return capture_html(capture)


# Capture.heatmap, Capture.show and a notebook's display of a capture draw through these: the
# record module imports nothing that draws, and figures and the notebook load on first use.
_capture_module.register_view("heatmap", _heatmap_view)
_capture_module.register_view("show", show)
_capture_module.register_view("html", _html_view)


def __getattr__(name: str) -> Any:
    if name in ("Capture", "load_capture"):
        return getattr(_capture_module, name)
    if name == "Session":  # torch still loads only when a session first captures
        from attnviz.session import Session

        return Session
    raise AttributeError(f"module 'attnviz' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
