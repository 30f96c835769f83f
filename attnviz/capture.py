"""The capture record: everything downstream of a model works from this one type.

A :class:`Capture` holds the tokens of one input, which word each token belongs to, which tokens
are special, and the attention weights ``[layer, head, query, key]`` of the layers and heads that
were kept. It is saved as ``attention.npy`` plus a JSON sidecar ``capture.json`` and loaded back
with numpy and json alone, so re-rendering never imports torch.

On disk (see README, "The capture format")::

    my_capture/                    or   my_capture.npy + my_capture.json
        attention.npy              float32 or float16, shape [layer, head, query, key]
        capture.json               tokens, word ids, layers, heads, model, ...
"""

from __future__ import annotations

import json
import math
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from attnviz.errors import DumpError, UsageError

if TYPE_CHECKING:
    import numpy as np

FORMAT_NAME = "attnviz-capture"
FORMAT_VERSION = 1
NPY_NAME = "attention.npy"
JSON_NAME = "capture.json"

_MARKERS = ("##", "\u0120", "\u2581")  # WordPiece, byte-level BPE (Ġ), SentencePiece (▁)


def clean_token(token: str) -> str:
    """Display form of a token: ``##ing`` -> ``ing``, ``Ġcat`` -> ``cat``, ``▁the`` -> ``the``.

    A token that is nothing but a marker or whitespace is shown as ``␣``; byte-level newlines
    (``Ċ``) as ``\\n``.
    """
    shown = token
    for marker in _MARKERS:
        if shown.startswith(marker):
            shown = shown[len(marker):]
            break
    shown = shown.replace("\u010a", "\\n").replace("\u0109", "\\t").replace("\u0120", " ")
    shown = shown.replace("\u2581", " ").strip()
    # Control characters would draw as missing glyphs: show their escapes instead.
    shown = "".join(f"\\x{ord(ch):02x}" if unicodedata.category(ch) == "Cc" else ch
                    for ch in shown)
    return shown if shown else "\u2423"


@dataclass
class Capture:
    """Attention captured from one input.

    Attributes:
        tokens: tokens as the tokenizer shows them (``##ing``, ``Ġcat``), length ``T``.
        display_tokens: the same tokens without subword markers, for labels.
        word_ids: for each token, the index of the word it belongs to, or ``None`` for special
            tokens. Words of a second sentence (``pair``) continue the numbering.
        special: for each token, whether it is a special token ([CLS], [SEP], <s>, ...).
        weights: float32 (or float16 on disk) array ``[layer, head, query, key]`` holding the
            layers in :attr:`layers` and the heads in :attr:`heads`.
        layers: the model's layer index of each entry on axis 0 of :attr:`weights`.
        heads: the model's head index of each entry on axis 1 of :attr:`weights`.
        num_layers: how many layers the model has (for messages and negative indices).
        num_heads: how many heads per layer the model has.
        model: the model's name (``minilm``, ``toy``, a hub id or a folder).
        causal: whether queries attend only to earlier keys (decoder models).
        text: the input text.
        pair: the second sentence of a sentence pair, or ``None``.
        meta: anything else worth keeping (model type, revision, dtype, device, toy config).
    """

    tokens: list[str]
    word_ids: list[int | None]
    special: list[bool]
    weights: np.ndarray
    layers: list[int]
    heads: list[int]
    num_layers: int
    num_heads: int
    model: str
    causal: bool
    text: str
    pair: str | None = None
    display_tokens: list[str] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.display_tokens:
            self.display_tokens = [clean_token(t) for t in self.tokens]

    # ----------------------------------------------------------------- shape helpers
    @property
    def num_tokens(self) -> int:
        """Number of tokens ``T`` (query and key axes)."""
        return len(self.tokens)

    def layer_position(self, layer: int) -> int:
        """Position on axis 0 of :attr:`weights` of model layer ``layer`` (negative allowed)."""
        from attnviz.selection import resolve_index

        absolute = resolve_index(layer, self.num_layers, "layer")
        if absolute not in self.layers:
            raise UsageError(
                f"layer {layer} is not in this capture: it holds layers "
                f"{format_indices(self.layers)}",
                "capture again with that layer selected, or pick one of those",
            )
        return self.layers.index(absolute)

    def head_position(self, head: int) -> int:
        """Position on axis 1 of :attr:`weights` of model head ``head`` (negative allowed)."""
        from attnviz.selection import resolve_index

        absolute = resolve_index(head, self.num_heads, "head")
        if absolute not in self.heads:
            raise UsageError(
                f"head {head} is not in this capture: it holds heads "
                f"{format_indices(self.heads)}",
                "capture again with that head selected, or pick one of those",
            )
        return self.heads.index(absolute)

    def matrix(self, layer: int, head: int) -> np.ndarray:
        """The ``[query, key]`` float32 matrix of one model layer and head."""
        import numpy as np

        return np.asarray(
            self.weights[self.layer_position(layer), self.head_position(head)], dtype=np.float32
        )

    def mean_matrix(self, layer: int) -> np.ndarray:
        """The ``[query, key]`` mean over the held heads of one model layer."""
        import numpy as np

        block = np.asarray(self.weights[self.layer_position(layer)], dtype=np.float32)
        return block.mean(axis=0)

    def select(self, layers: Sequence[int] | None = None,
               heads: Sequence[int] | None = None) -> Capture:
        """A new capture holding only the given model layers and heads (absolute indices)."""
        import numpy as np

        layer_pos = [self.layer_position(i) for i in (self.layers if layers is None else layers)]
        head_pos = [self.head_position(i) for i in (self.heads if heads is None else heads)]
        weights = np.asarray(self.weights[np.ix_(layer_pos, head_pos)], dtype=np.float32)
        return replace(
            self,
            weights=weights,
            layers=[self.layers[p] for p in layer_pos],
            heads=[self.heads[p] for p in head_pos],
            tokens=list(self.tokens),
            display_tokens=list(self.display_tokens),
            word_ids=list(self.word_ids),
            special=list(self.special),
            meta=dict(self.meta),
        )

    def with_weights(self, weights: np.ndarray, **changes: Any) -> Capture:
        """A copy with new weights (and any other changed fields), e.g. after merging words."""
        return replace(self, weights=weights, **changes)

    # ----------------------------------------------------------------- save / load
    def sidecar(self) -> dict[str, Any]:
        """The JSON sidecar as a dict (everything but the weights)."""
        return {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "shape": list(self.weights.shape),
            "axes": ["layer", "head", "query", "key"],
            "model": self.model,
            "causal": self.causal,
            "text": self.text,
            "pair": self.pair,
            "layers": list(self.layers),
            "heads": list(self.heads),
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "tokens": list(self.tokens),
            "display_tokens": list(self.display_tokens),
            "word_ids": list(self.word_ids),
            "special": list(self.special),
            "meta": self.meta,
        }

    def save(self, path: Path | str, *, float16: bool = False) -> Path:
        """Write the capture atomically; returns the path of the ``.npy`` file.

        ``path`` ending in ``.npy`` writes ``path`` and ``path.with_suffix('.json')``; any other
        path is a folder holding ``attention.npy`` and ``capture.json``.
        """
        import numpy as np

        from attnviz.fileio import atomic_write, atomic_write_text, ensure_dir

        npy_path, json_path = _paths_for_save(Path(path))
        ensure_dir(npy_path.parent)
        data = np.ascontiguousarray(self.weights, dtype=np.float16 if float16 else np.float32)
        sidecar = self.sidecar()
        sidecar["dtype"] = str(data.dtype)
        sidecar["weights_file"] = npy_path.name
        # Old sidecar out, weights in, new sidecar last: a sidecar always describes the weights
        # beside it, so an interrupted save never pairs new weights with old metadata.
        json_path.unlink(missing_ok=True)
        atomic_write(npy_path, lambda handle: np.save(handle, data, allow_pickle=False))
        atomic_write_text(json_path, json.dumps(sidecar, ensure_ascii=False, indent=1))
        return npy_path


def format_indices(indices: Sequence[int]) -> str:
    return ", ".join(str(i) for i in indices) if len(indices) <= 12 else (
        f"{indices[0]}..{indices[-1]} ({len(indices)} in all)")


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


def load_capture(path: Path | str, *, mmap: bool = False) -> Capture:
    """Load a capture saved by :meth:`Capture.save` (no torch needed).

    Args:
        path: the capture folder, or its ``.npy`` or ``.json`` file.
        mmap: memory-map the weights instead of reading them, so only the slices a command
            uses are read from disk.

    Raises:
        DumpError: the files are missing, unreadable, or disagree with each other.
    """
    import numpy as np

    path = Path(path)
    if not path.exists():
        raise DumpError(f"capture {path} does not exist",
                        "create one with: attnviz dump \"your text\" -o my_capture")
    npy_path, json_path = _paths_for_load(path)
    if not json_path.is_file():
        raise DumpError(f"capture {path} has no JSON sidecar ({json_path.name} is missing)",
                        "the capture is incomplete: create it again with attnviz dump")
    if not npy_path.is_file():
        raise DumpError(f"capture {path} has no weights ({npy_path.name} is missing)",
                        "the capture is incomplete: create it again with attnviz dump")
    try:
        meta = json.loads(json_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DumpError(f"cannot read {json_path}: {exc}",
                        "the sidecar is corrupt: create the capture again") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        raise DumpError(f"{json_path} is not an attnviz capture sidecar",
                        "create one with: attnviz dump \"your text\" -o my_capture")
    try:
        weights = np.load(npy_path, mmap_mode="r" if mmap else None, allow_pickle=False)
    except (OSError, ValueError, EOFError) as exc:
        raise DumpError(f"cannot read {npy_path}: {exc}",
                        "the weights file is truncated or corrupt: create the capture again"
                        ) from None
    try:
        capture = _capture_from(meta, weights, check_all=not mmap)
    except (KeyError, TypeError, ValueError) as exc:
        raise DumpError(f"{json_path} is malformed: {exc}",
                        "create the capture again with attnviz dump") from None
    if not mmap and capture.weights.dtype != np.float32:
        capture.weights = capture.weights.astype(np.float32)
    return capture


def _capture_from(meta: dict[str, Any], weights: np.ndarray, check_all: bool = True) -> Capture:
    import numpy as np

    if weights.dtype not in (np.float32, np.float16) or weights.ndim != 4:
        raise ValueError(f"weights must be float32/float16 with 4 axes, got {weights.dtype} "
                         f"with shape {weights.shape}")
    tokens = [str(t) for t in meta["tokens"]]
    layers = [int(i) for i in meta["layers"]]
    heads = [int(i) for i in meta["heads"]]
    expected = (len(layers), len(heads), len(tokens), len(tokens))
    if tuple(weights.shape) != expected or list(meta.get("shape", expected)) != list(expected):
        raise ValueError(f"weights have shape {tuple(weights.shape)} but the sidecar describes "
                         f"{expected} (layers, heads, tokens, tokens)")
    word_ids = [None if w is None else int(w) for w in meta["word_ids"]]
    special = [bool(s) for s in meta["special"]]
    display = [str(t) for t in meta.get("display_tokens") or []]
    if len(word_ids) != len(tokens) or len(special) != len(tokens) or (
            display and len(display) != len(tokens)):
        raise ValueError("tokens, word_ids, special and display_tokens differ in length")
    num_layers, num_heads = int(meta["num_layers"]), int(meta["num_heads"])
    if any(not 0 <= i < num_layers for i in layers) or any(not 0 <= i < num_heads for i in heads):
        raise ValueError("layer or head indices outside the model's range")
    # A memory-mapped capture may be larger than RAM: check its first query rows only.
    probe = weights if check_all else weights[:, :, :1, :]
    if probe.size and not math.isfinite(float(np.sum(probe, dtype=np.float64))):
        raise DumpError("the weights contain NaN or infinite values",
                        "the capture is corrupt: create it again with attnviz dump")
    return Capture(
        tokens=tokens, word_ids=word_ids, special=special, weights=weights,
        layers=layers, heads=heads, num_layers=num_layers, num_heads=num_heads,
        model=str(meta["model"]), causal=bool(meta["causal"]), text=str(meta["text"]),
        pair=None if meta.get("pair") is None else str(meta["pair"]),
        display_tokens=display, meta=dict(meta.get("meta") or {}),
    )
