"""Where attention comes from: the toy module, Hugging Face models, the bundled MiniLM.

Use :func:`load_source` to get an object with a ``capture(text, pair, layers=, heads=)``
method returning a :class:`~attnviz.capture.Capture`. Importing this package is cheap; torch
and transformers are imported when a source is created.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from attnviz.capture import Capture
    from attnviz.models.toy import ToyConfig

DEFAULT_MODEL = "minilm"
TOY_MODEL = "toy"


def default_model() -> str:
    """The model used when ``--model`` is not given: ``$ATTNVIZ_MODEL`` or ``minilm``."""
    return os.environ.get("ATTNVIZ_MODEL", "").strip() or DEFAULT_MODEL


class AttentionSource(Protocol):
    """Anything that turns text into a capture."""

    name: str
    num_layers: int
    num_heads: int

    def capture(self, text: str, pair: str | None = None, *, layers: list[int] | None = None,
                heads: list[int] | None = None, max_tokens: int | None = None,
                truncate: bool = True) -> Capture: ...

    def identity(self) -> dict[str, object]: ...


@dataclass
class ModelSpec:
    """Everything needed to load a model (what ``--model`` and its options say)."""

    name: str = field(default_factory=default_model)
    revision: str | None = None
    trust_remote_code: bool = False
    device: str = "auto"
    dtype: str = "float32"
    toy: ToyConfig | None = None
    device_map: str | None = None  # "auto": spread over GPUs/CPU/disk with Accelerate
    max_memory: dict[int | str, int | str] | None = None  # per-device budget for device_map


def load_source(spec: ModelSpec | str | None = None) -> AttentionSource:
    """Load the model a :class:`ModelSpec` (or a bare model name) describes."""
    if spec is None:
        spec = ModelSpec()
    elif isinstance(spec, str):
        spec = ModelSpec(name=spec)
    if spec.name == TOY_MODEL:
        from attnviz.models.toy import ToySource

        if spec.device_map is not None:
            from attnviz.errors import UsageError

            raise UsageError("--device-map is for Hugging Face models; the toy model is tiny",
                             "drop --device-map, or use --device")

        return ToySource(spec.toy, device=spec.device, dtype=spec.dtype)
    from attnviz.models.hf import HFSource

    return HFSource(spec.name, revision=spec.revision, trust_remote_code=spec.trust_remote_code,
                    device=spec.device, dtype=spec.dtype, device_map=spec.device_map,
                    max_memory=spec.max_memory)


def capture_many(source: AttentionSource, texts: Sequence[str],
                 pairs: Sequence[str | None] | None = None, *, batch_size: int = 8,
                 layers: list[int] | None = None, heads: list[int] | None = None,
                 max_tokens: int | None = None, truncate: bool = True) -> Iterator[Capture]:
    """One capture per text, in order: in padded batches when the source supports it.

    Hugging Face sources run ``batch_size`` texts per forward pass
    (:meth:`~attnviz.models.hf.HFSource.iter_captures`); other sources capture one by one.
    """
    batched = getattr(source, "iter_captures", None)
    if callable(batched):
        yield from batched(texts, pairs, batch_size=batch_size, layers=layers, heads=heads,
                           max_tokens=max_tokens, truncate=truncate)
        return
    pair_list = [None] * len(texts) if pairs is None else list(pairs)
    if len(pair_list) != len(texts):
        from attnviz.errors import UsageError

        raise UsageError(f"got {len(texts)} texts but {len(pair_list)} pairs")
    for text, pair in zip(texts, pair_list):
        yield source.capture(text, pair, layers=layers, heads=heads, max_tokens=max_tokens,
                             truncate=truncate)
