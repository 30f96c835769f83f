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

    Keyword options are those of :class:`attnviz.models.ModelSpec` (``revision``, ``device``,
    ``dtype``, ``trust_remote_code``, ``toy``) and of the source's ``capture`` method
    (``layers``, ``heads``, ``max_tokens``).
    """
    from attnviz.models import ModelSpec, default_model, load_source

    spec_keys = {"revision", "trust_remote_code", "device", "dtype", "toy"}
    spec = ModelSpec(name=model or default_model(),
                     **{k: v for k, v in options.items() if k in spec_keys})
    rest = {k: v for k, v in options.items() if k not in spec_keys}
    return load_source(spec).capture(text, pair, **rest)


def __getattr__(name: str) -> Any:
    if name in ("Capture", "load_capture"):
        from attnviz import capture as _capture_module

        return getattr(_capture_module, name)
    raise AttributeError(f"module 'attnviz' has no attribute {name!r}")
