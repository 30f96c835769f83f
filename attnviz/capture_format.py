"""The capture format on disk: file names, the sidecar's JSON text, and the checks a loaded
sidecar and its weights pass before they become a :class:`~attnviz.capture.Capture`.

A capture is ``attention.npy`` (float32 or float16 ``[layer, head, query, key]``) plus the
JSON sidecar ``capture.json`` in a folder, or ``NAME.npy`` plus ``NAME.json`` (see README,
"The capture format"). Everything here works with numpy and json alone.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from attnviz.errors import DumpError, UsageError

if TYPE_CHECKING:
    import numpy as np

FORMAT_NAME = "attnviz-capture"
FORMAT_VERSION = 1
NPY_NAME = "attention.npy"
JSON_NAME = "capture.json"

#: How far a row of weights may sum from 1: float16 storage rounds each weight by at most
#: 2**-11 of its size, and half-precision models compute the softmax in 16 bits.
ROW_SUM_TOLERANCE = 1e-2
#: Most layers or heads a sidecar may state (no model comes near; bounds every allocation).
MAX_COUNT = 1_000_000
_AXES = ["layer", "head", "query", "key"]


class _Invalid(ValueError):
    """A sidecar field or the weights break the capture format; the message names which."""


def _paths_for_save(path: Path) -> tuple[Path, Path]:
    if path.suffix == ".npy":
        return path, path.with_suffix(".json")
    if path.suffix == ".json":
        return path.with_suffix(".npy"), path
    return path / NPY_NAME, path / JSON_NAME


def _paths_for_load(path: Path) -> tuple[Path, Path]:
    if path.is_dir():
        return path / NPY_NAME, path / JSON_NAME
    if path.name in (NPY_NAME, JSON_NAME) and (path.parent / JSON_NAME).is_file():
        return path.parent / NPY_NAME, path.parent / JSON_NAME  # a file inside a capture folder
    if path.suffix in (".npy", ".json"):
        return path.with_suffix(".npy"), path.with_suffix(".json")
    raise DumpError(
        f"{path} is not a capture: expected a folder with {NPY_NAME} and {JSON_NAME}, "
        "or a .npy file with a .json sidecar",
        "create one with: attnviz dump \"your text\" -o my_capture",
    )


def _json_plain(value: Any) -> Any:
    """numpy scalars and small arrays as plain JSON values (anything else cannot be saved)."""
    import numpy as np

    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray) and value.size <= 10_000:
        return value.tolist()
    raise TypeError(f"{type(value).__name__} cannot be written to JSON")


def _sidecar_text(sidecar: dict[str, Any]) -> str:
    """The sidecar as JSON text, or a :class:`UsageError` naming the meta entry that is not
    JSON data (a tensor, an object)."""
    try:
        return json.dumps(sidecar, ensure_ascii=False, indent=1, default=_json_plain)
    except (TypeError, ValueError) as exc:
        meta = sidecar.get("meta")
        bad = [key for key, value in meta.items()
               if not _is_json(value)] if isinstance(meta, dict) else []
        where = f"meta[{bad[0]!r}]" if bad else "the capture's metadata"
        raise UsageError(f"cannot save the capture: {where} is not JSON data ({exc})",
                         "keep meta to strings, numbers, booleans, lists and dicts") from None


def _is_json(value: Any) -> bool:
    try:
        json.dumps(value, default=_json_plain)
    except (TypeError, ValueError):
        return False
    return True


def _shown(value: Any) -> str:
    """A field's value for a message: ``"false" (a string)``, ``infinity``, ``7``."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("infinity" if value > 0 else "-infinity")
    kind = ("true/false" if isinstance(value, bool) else "a string" if isinstance(value, str)
            else "an object" if isinstance(value, dict) else "a list" if isinstance(value, list)
            else "null" if value is None else "a number")
    text = json.dumps(value, ensure_ascii=False, default=str)
    text = text if len(text) <= 40 else text[:37] + "..."
    return text if kind in ("a number", "true/false", "null") else f"{text} ({kind})"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _field(meta: dict[str, Any], name: str) -> Any:
    if name not in meta:
        raise _Invalid(f"field \"{name}\" is missing")
    return meta[name]


def _count_field(meta: dict[str, Any], name: str) -> int:
    value = _field(meta, name)
    if not _is_int(value) or not 1 <= value <= MAX_COUNT:
        raise _Invalid(f"field \"{name}\" must be a whole number from 1 to {MAX_COUNT}, "
                       f"not {_shown(value)}")
    return int(value)


def _text_field(meta: dict[str, Any], name: str, *, optional: bool = False) -> str | None:
    value = meta.get(name) if optional else _field(meta, name)
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise _Invalid(f"field \"{name}\" must be a string{' or null' if optional else ''}, "
                       f"not {_shown(value)}")
    return value


def _list_field(meta: dict[str, Any], name: str) -> list[Any]:
    value = _field(meta, name)
    if not isinstance(value, list):
        raise _Invalid(f"field \"{name}\" must be a list, not {_shown(value)}")
    return value


def _index_field(meta: dict[str, Any], name: str, count: int, what: str) -> list[int]:
    """``layers`` or ``heads``: distinct whole numbers in ``0..count-1``, at least one."""
    values = _list_field(meta, name)
    for value in values:
        if not _is_int(value):
            raise _Invalid(f"field \"{name}\" must hold whole numbers, not {_shown(value)}")
    if not values:
        raise _Invalid(f"the capture holds no {what}s (field \"{name}\" is empty)")
    for value in values:
        if not 0 <= value < count:
            raise _Invalid(f"field \"{name}\" holds {what} {value}, outside 0..{count - 1} "
                           f"(\"num_{what}s\" is {count})")
    seen: set[int] = set()
    for value in values:
        if value in seen:
            raise _Invalid(f"field \"{name}\" lists {what} {value} twice")
        seen.add(value)
    return [int(v) for v in values]


def _token_fields(meta: dict[str, Any]) -> tuple[list[str], list[int | None], list[bool],
                                                  list[str]]:
    tokens = _list_field(meta, "tokens")
    if not tokens:
        raise _Invalid("the capture holds no tokens (field \"tokens\" is empty)")
    size = len(tokens)

    def same_length(name: str, values: list[Any]) -> None:
        if len(values) != size:
            raise _Invalid(f"field \"{name}\" has {len(values)} entries for {size} tokens")

    for token in tokens:
        if not isinstance(token, str):
            raise _Invalid(f"field \"tokens\" must hold strings, not {_shown(token)}")
    word_ids = _list_field(meta, "word_ids")
    same_length("word_ids", word_ids)
    for word in word_ids:
        if word is not None and (not _is_int(word) or word < 0):
            raise _Invalid("field \"word_ids\" must hold whole numbers from 0 (or null for "
                           f"special tokens), not {_shown(word)}")
    special = _list_field(meta, "special")
    same_length("special", special)
    for flag in special:
        if not isinstance(flag, bool):
            raise _Invalid(f"field \"special\" must hold true/false, not {_shown(flag)}")
    display = meta.get("display_tokens")
    if display is None:
        display = []
    if not isinstance(display, list):
        raise _Invalid(f"field \"display_tokens\" must be a list, not {_shown(display)}")
    if display:
        same_length("display_tokens", display)
        for token in display:
            if not isinstance(token, str):
                raise _Invalid(f"field \"display_tokens\" must hold strings, not "
                               f"{_shown(token)}")
    return list(tokens), list(word_ids), list(special), list(display)


def _check_header(meta: dict[str, Any]) -> None:
    """``format_version``, ``axes``, ``dtype``, ``weights_file``: optional, but typed."""
    version = meta.get("format_version", FORMAT_VERSION)
    if not _is_int(version) or version < 1:
        raise _Invalid(f"field \"format_version\" must be a whole number from 1, not "
                       f"{_shown(version)}")
    if version > FORMAT_VERSION:
        raise _Invalid(f"it was written by a newer attnviz (\"format_version\" {version}; "
                       f"this version reads {FORMAT_VERSION}): upgrade attnviz to read it")
    axes = meta.get("axes", _AXES)
    if axes != _AXES:
        raise _Invalid(f"field \"axes\" must be {json.dumps(_AXES)}, not {_shown(axes)}")
    for name in ("dtype", "weights_file"):
        _text_field(meta, name, optional=True)


def sidecar_fields(meta: dict[str, Any], weights: np.ndarray,
                   check_all: bool = True) -> dict[str, Any]:
    """Check a parsed sidecar and its weights; the fields of the
    :class:`~attnviz.capture.Capture` they describe (raises :class:`_Invalid`, a
    ``ValueError``)."""
    import numpy as np

    if not isinstance(meta, dict):
        raise _Invalid(f"the sidecar must be a JSON object, not {_shown(meta)}")
    _check_header(meta)
    num_layers = _count_field(meta, "num_layers")
    num_heads = _count_field(meta, "num_heads")
    layers = _index_field(meta, "layers", num_layers, "layer")
    heads = _index_field(meta, "heads", num_heads, "head")
    tokens, word_ids, special, display = _token_fields(meta)
    model = str(_text_field(meta, "model"))
    if not model:
        raise _Invalid("field \"model\" is empty")
    text = str(_text_field(meta, "text"))
    pair = _text_field(meta, "pair", optional=True)
    causal = _field(meta, "causal")
    if not isinstance(causal, bool):
        raise _Invalid(f"field \"causal\" must be true or false, not {_shown(causal)}")
    extra = meta.get("meta")
    if extra is None:
        extra = {}
    if not isinstance(extra, dict):
        raise _Invalid(f"field \"meta\" must be an object, not {_shown(extra)}")

    expected = (len(layers), len(heads), len(tokens), len(tokens))
    if "shape" in meta:
        shape = meta["shape"]
        if not isinstance(shape, list) or len(shape) != 4 or not all(
                _is_int(n) and n >= 0 for n in shape):
            raise _Invalid(f"field \"shape\" must be 4 whole numbers, not {_shown(shape)}")
        if tuple(shape) != expected:
            raise _Invalid(f"field \"shape\" is {json.dumps(shape)} but its layers, heads and "
                           f"tokens make {expected} (layers, heads, tokens, tokens)")
    if not isinstance(weights, np.ndarray) or weights.dtype not in (np.float32, np.float16) \
            or weights.ndim != 4:
        raise _Invalid(f"the weights must be float32/float16 with 4 axes, got "
                       f"{getattr(weights, 'dtype', type(weights).__name__)} with shape "
                       f"{tuple(getattr(weights, 'shape', ()))}")
    if tuple(weights.shape) != expected:
        raise _Invalid(f"the weights have shape {tuple(weights.shape)} but the sidecar "
                       f"describes {expected} (layers, heads, tokens, tokens)")
    measure = extra.get("measure", "weights")
    if not isinstance(measure, str) or not measure:
        raise _Invalid(f"meta \"measure\" must be a measure's name such as \"norm\", not "
                       f"{_shown(measure)}")
    # A memory-mapped capture may be larger than memory: check its first query rows only.
    _check_weights(weights if check_all else weights[:, :, :1, :], layers, heads, causal,
                   rows=measure == "weights")
    return {
        "tokens": tokens, "word_ids": word_ids, "special": special, "weights": weights,
        "layers": layers, "heads": heads, "num_layers": num_layers,
        "num_heads": num_heads, "model": model, "causal": causal, "text": text,
        "pair": pair, "display_tokens": display, "meta": dict(extra),
    }


def _check_rows(block: np.ndarray, sums: np.ndarray,
                where: Callable[[int, tuple[int, ...]], str]) -> None:
    """One layer's attention rows (``[head, query, key]``): non-negative, summing to 1 (or 0
    for a row with every key excluded)."""
    import numpy as np

    lowest = int(np.argmin(block))
    if float(block.flat[lowest]) < -1e-6:
        raise _Invalid(f"the weights hold negative values ({float(block.flat[lowest]):.4g} "
                       f"at {where(lowest, block.shape)}): attention weights are never negative")
    off = np.abs(sums - 1.0) > ROW_SUM_TOLERANCE
    off &= np.abs(sums) > 1e-6
    if off.any():
        flat = int(np.argmax(off))
        raise _Invalid(f"the weights of {where(flat, sums.shape)} sum to "
                       f"{float(sums.flat[flat]):.4g}: each row of attention weights must "
                       f"sum to 1 (within {ROW_SUM_TOLERANCE:g})")


def _check_weights(weights: np.ndarray, layers: list[int], heads: list[int],
                   causal: bool, *, rows: bool = True) -> None:
    """Attention rows: finite, non-negative, summing to 1 (or 0), causal when marked so.

    ``weights`` is ``[layer, head, query, key]``, possibly only the first queries. ``rows``
    False (a measure such as ``norm``, whose rows are not distributions): finite and causal
    only.
    """
    import numpy as np

    queries, keys = weights.shape[2], weights.shape[3]
    later = np.arange(keys)[None, :] > np.arange(queries)[:, None]  # [query, key]

    def where(position: int, flat: int, shape: tuple[int, ...]) -> str:
        head, query, *rest = (int(i) for i in np.unravel_index(flat, shape))
        key = f", key {rest[0]}" if rest else ""
        return f"layer {layers[position]}, head {heads[head]}, query {query}{key}"

    for position in range(weights.shape[0]):  # one layer at a time bounds the temporaries
        block = np.asarray(weights[position])  # [head, query, key]
        if not block.size:
            continue
        sums = block.sum(axis=-1, dtype=np.float64)  # [head, query]
        if not np.isfinite(sums).all():
            raise _Invalid("the weights contain NaN or infinite values")
        if rows:
            _check_rows(block, sums, functools.partial(where, position))
        if causal and keys > 1:
            future = np.where(later, block, 0)
            worst = int(np.argmax(future))
            if float(future.flat[worst]) > 1e-3:
                raise _Invalid(f"the sidecar says \"causal\": true, but "
                               f"{where(position, worst, future.shape)} gives weight "
                               f"{float(future.flat[worst]):.4g} to a later key")
