"""attnviz: see what a transformer's attention does.

The Python API mirrors the command line::

    from attnviz import capture_text, load_capture
    cap = capture_text("The cat sat on the mat")          # bundled MiniLM, all layers and heads
    cap.weights.shape                       # (6, 12, 8, 8): [layer, head, query, key]
    cap.save("cat")                                        # cat/attention.npy + cat/capture.json
    cap = load_capture("cat")                              # no torch needed

Importing this package is cheap: torch, transformers and matplotlib load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from attnviz.capture import Capture

__all__ = ["__version__", "Capture", "capture_text", "load_capture"]


def capture_text(text: str, model: str | None = None, pair: str | None = None, **options: Any
                 ) -> Capture:
    """Capture the attention of ``model`` (default: the bundled MiniLM) on ``text``.

    Goes through the process-wide :func:`attnviz.session.default_session`: the model is loaded
    once and kept warm, and texts already in the capture cache skip the model. Keyword options
    are those of :class:`attnviz.models.ModelSpec` (``revision``, ``device``, ``dtype``,
    ``trust_remote_code``, ``toy``) and of :meth:`attnviz.session.Session.capture` (``layers``,
    ``heads``, ``max_tokens``, ``truncate``, ``use_cache``).
    """
    from attnviz.session import default_session

    return default_session().capture(text, pair, model=model, **options)


def __getattr__(name: str) -> Any:
    if name in ("Capture", "load_capture"):
        from attnviz import capture as _capture_module

        return getattr(_capture_module, name)
    raise AttributeError(f"module 'attnviz' has no attribute {name!r}")
