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

import contextlib
import json
import math
import re
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


def guess_word_ids(tokens: list[str], special: list[bool]) -> list[int | None]:
    """Word ids from subword markers, for tokenizers that do not report them.

    ``##`` continues the previous word (WordPiece); ``Ġ`` and ``▁`` start a new one (BPE and
    SentencePiece); in a marker-starting tokenizer a piece without a marker continues the word.
    """
    starts_marked = any(t.startswith(("\u0120", "\u2581")) for t in tokens)
    word_ids: list[int | None] = []
    current = -1
    previous_special = True
    for token, is_special in zip(tokens, special):
        if is_special:
            word_ids.append(None)
            previous_special = True
            continue
        if token.startswith("##"):
            new_word = previous_special
        elif starts_marked:
            new_word = previous_special or token.startswith(("\u0120", "\u2581"))
        else:
            new_word = True
        if new_word or current < 0:
            current += 1
        word_ids.append(current)
        previous_special = False
    return word_ids


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

    def __repr__(self) -> str:
        """One line (what a notebook shows as text): the weights are not written out."""
        text = " ".join(self.text.split())
        short = text if len(text) <= 40 else text[:39] + "\u2026"
        measure = self.meta.get("measure")
        return (f"Capture({self.model!r}: {self.num_tokens} tokens, {len(self.layers)} layers "
                f"x {len(self.heads)} heads" + (", causal" if self.causal else "")
                + (f", {measure}" if measure else "") + f", text={short!r})")

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

    @property
    def mean_label(self) -> str:
        """How :meth:`mean_matrix` is named in titles: ``mean of all heads`` or ``mean of heads
        0, 2`` (a capture holding some of the heads)."""
        return ("mean of all heads" if len(self.heads) == self.num_heads
                else f"mean of heads {format_indices(self.heads)}")

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

    # ----------------------------------------------------------------- from your own run
    @classmethod
    def from_attentions(cls, attentions: Any, tokens: Any, *, batch_index: int = 0,
                        attention_mask: Any = None, tokenizer: Any = None,
                        special: Sequence[bool] | None = None,
                        word_ids: Sequence[int | None] | None = None,
                        layers: Sequence[int] | None = None, heads: Sequence[int] | None = None,
                        num_layers: int | None = None, num_heads: int | None = None,
                        model: str = "model", text: str | None = None, pair: str | None = None,
                        causal: bool | None = None, meta: dict[str, Any] | None = None
                        ) -> Capture:
        """A capture from attention weights you already have, e.g. ``outputs.attentions``.

        Args:
            attentions: one ``[batch, head, query, key]`` array per layer (torch tensors on any
                device and dtype, or numpy), as ``model(..., output_attentions=True)`` returns
                them; a single stacked ``[layer, batch, head, query, key]`` array also works,
                and ``[head, query, key]`` per layer for an unbatched run.
            tokens: the row's tokens (strings, or ids with ``tokenizer``): either every
                position of the padded row or only its real tokens. A batch of rows (a list of
                lists, or a 2-D id tensor) is indexed with ``batch_index``.
            batch_index: which row of the batch (negative counts from the end).
            attention_mask: ``[batch, key]`` (or ``[key]``) mask of the batch; positions where
                it is 0 (padding, left or right) are dropped from both axes.
            tokenizer: optional; turns ids into tokens and tells which tokens are special.
            special: per token, whether it is special ([CLS], <s>...); default: from the
                tokenizer, else tokens that look like ``[CLS]`` or ``<s>``.
            word_ids: per token, its word (``None`` for special tokens); default: guessed
                from subword markers (``##``, ``Ġ``, ``▁``).
            layers: the model layer of each entry of ``attentions`` (default ``0..L-1``);
                ``heads`` likewise for the head axis.
            num_layers: how many layers the model has (default: one past the last layer);
                ``num_heads`` likewise.
            model: the model's name; ``text``/``pair`` the input (default: the joined tokens).
            causal: whether queries only see earlier keys (default: every weight above the
                diagonal is exactly 0).
            meta: anything else to keep.

        Returns:
            The capture, float32 weights ``[layer, head, query, key]`` of the real tokens.

        Raises:
            UsageError: shapes that disagree (layers, batch, tokens, mask), a batch index out
                of range, ``None`` weights (a fused attention kernel), arguments of the wrong
                type, or weights that are not attention: NaN or infinity, negative values,
                rows that do not sum to 1 (0 for a row with every key masked), weight above the
                diagonal of a capture said to be ``causal``.
        """
        import numbers

        import numpy as np

        if isinstance(batch_index, bool) or not isinstance(batch_index, numbers.Integral):
            raise UsageError(f"batch_index must be an integer (a row of the batch), not "
                             f"{batch_index!r:.40}")
        batch_index = int(batch_index)
        _check_strings(model=model, text=text, pair=pair)
        if meta is not None and not isinstance(meta, dict):
            raise UsageError(f"meta must be a dict, not {type(meta).__name__}")
        stacked, rows = _stack_attentions(attentions, batch_index)  # [layer, head, query, key]
        count_l, count_h, size, size_k = stacked.shape
        if size != size_k:
            raise UsageError(f"attention weights must be square over query and key, got "
                             f"{size}x{size_k}")
        if size == 0:
            raise UsageError("the attention weights cover no tokens (0 query and key positions)")
        keep = list(range(size))
        if attention_mask is not None:
            mask = _as_array(attention_mask)
            if mask.ndim == 2:
                if rows is not None and mask.shape[0] != rows:
                    raise UsageError(f"the attention mask has {mask.shape[0]} rows but the "
                                     f"batch of weights has {rows}",
                                     "pass the mask of the same batch ([batch, key])")
                mask = mask[_row(batch_index, mask.shape[0], "attention_mask")]
            if mask.ndim != 1 or mask.shape[0] != size:
                raise UsageError(f"the attention mask has shape {tuple(mask.shape)} but the "
                                 f"weights cover {size} positions",
                                 "pass the mask of the same batch ([batch, key])")
            if mask.dtype.kind not in "biuf" or not np.isin(mask, (0, 1)).all():
                raise UsageError("the attention mask must hold 0 (padding) and 1 (real "
                                 "tokens) only; this looks like an additive mask",
                                 "pass inputs['attention_mask'] as the tokenizer returned it")
            keep = [int(i) for i in np.flatnonzero(mask != 0)]
            if not keep:
                raise UsageError(f"row {batch_index} of the attention mask has no real tokens")
        token_list = _token_row(tokens, batch_index, tokenizer)
        if len(token_list) == size:
            token_list = [token_list[i] for i in keep]
        elif len(token_list) != len(keep):
            raise UsageError(
                f"got {len(token_list)} tokens for {size} positions ({len(keep)} real)",
                "pass the row's tokens, padded or not, e.g. "
                "tokenizer.convert_ids_to_tokens(inputs['input_ids'][batch_index])")
        index = np.asarray(keep)
        weights = np.ascontiguousarray(stacked[:, :, index][:, :, :, index], dtype=np.float32)
        if not np.isfinite(weights).all():
            raise UsageError("the attention weights contain NaN or infinite values")
        flags = _special_flags(token_list, special, tokenizer, size, keep)
        words = (_word_ids(word_ids) if word_ids is not None
                 else guess_word_ids(token_list, flags))
        if len(words) == size and size != len(keep):
            words = [words[i] for i in keep]
        if len(words) != len(token_list):
            raise UsageError(f"got {len(words)} word ids for {len(token_list)} tokens")
        layer_list = _indices(layers, count_l, "layers")
        head_list = _indices(heads, count_h, "heads")
        if len(layer_list) != count_l or len(head_list) != count_h:
            raise UsageError(f"layers/heads name {len(layer_list)} layers and {len(head_list)} "
                             f"heads but the weights hold {count_l} and {count_h}")
        total_l = _count(num_layers, "num_layers", max(layer_list) + 1)
        total_h = _count(num_heads, "num_heads", max(head_list) + 1)
        if any(not 0 <= i < total_l for i in layer_list) or any(
                not 0 <= i < total_h for i in head_list):
            raise UsageError("layer or head indices outside 0..num_layers-1 / 0..num_heads-1")
        if causal is None:
            upper = np.triu(np.ones((len(keep), len(keep)), dtype=bool), 1)
            causal = len(keep) > 1 and not bool(weights[:, :, upper].any())
        try:  # what load_capture checks, so that a saved capture loads back
            _check_weights(weights, layer_list, head_list, bool(causal))
        except _Invalid as exc:
            raise UsageError(f"these are not attention weights: {exc}",
                             "pass post-softmax weights (outputs.attentions of a run with "
                             "output_attentions=True) and, for a padded batch, the "
                             "attention_mask that run used") from None
        empty = np.argwhere(weights.sum(axis=-1) < 0.5)  # real tokens attend somewhere
        if len(empty):
            layer, head, query = (int(v) for v in empty[0])
            raise UsageError(f"these are not attention weights: the row of query {query} "
                             f"(layer {layer_list[layer]}, head {head_list[head]}) is all 0",
                             "pass post-softmax weights and, for a padded batch, the "
                             "attention_mask that run used (its padding is dropped)")
        info: dict[str, Any] = {"source": "attentions", "warnings": []}
        info.update(meta or {})
        if text is None:
            shown = [t for t, s in zip(token_list, flags) if not s]
            joined = None
            if tokenizer is not None and hasattr(tokenizer, "convert_tokens_to_string"):
                with contextlib.suppress(Exception):
                    joined = str(tokenizer.convert_tokens_to_string(shown)).strip()
            text = joined or " ".join(clean_token(t) for t in shown)
        return cls(tokens=token_list, word_ids=words, special=flags, weights=weights,
                   layers=layer_list, heads=head_list, num_layers=int(total_l),
                   num_heads=int(total_h), model=model, causal=bool(causal), text=text,
                   pair=pair, meta=info)

    # ----------------------------------------------------------------- figures
    def heatmap(self, layer: int, head: int | str = "mean", ax: Any = None,
                **options: Any) -> tuple[Any, Any]:
        """Draw one head as ``attnviz heatmap --layer L --head H`` draws it.

        Args:
            layer: model layer (negative counts from the end).
            head: model head, or ``"mean"`` of the layer's held heads.
            ax: a matplotlib ``Axes`` of your own figure to draw into; ``None``: a new figure
                sized from the content, exactly as the command line makes it.
            **options: the figure options of :class:`attnviz.render.heatmap.FigureOptions`:
                ``cmap``, ``scale`` (``linear``/``power``/``log``), ``gamma``, ``vmax``
                (``"auto"`` or a number; ``1`` for the fixed 0..1 scale), ``annot``, ``dpi``,
                ``words``, ``exclude_special``, ``tokens``/``queries``/``keys`` (windows such
                as ``"10:40"`` or ``"bank:loan"``).

        Returns:
            ``(figure, axes)``: the matplotlib ``Figure`` and the heatmap's ``Axes``. Save with
            ``figure.savefig("head.png")``.
        """
        from attnviz.render.heatmap import FigureOptions, capture_head_figure

        names = set(FigureOptions.__dataclass_fields__) - {"extra"}
        unknown = sorted(set(options) - names)
        if unknown:
            raise UsageError(f"unknown figure option {unknown[0]!r}",
                             f"use any of: {', '.join(sorted(names))}")
        artists = capture_head_figure(self, layer, head, options=FigureOptions(**options), ax=ax)
        return artists.fig, artists.ax

    # ----------------------------------------------------------------- notebooks
    def show(self, view: str = "head", **options: Any) -> Any:
        """An inline view in a notebook; see :func:`attnviz.show` for the options."""
        from attnviz.notebook import show

        return show(self, view=view, **options)

    def _repr_html_(self) -> str:
        """Notebooks display a capture as the self-contained report in an iframe."""
        from attnviz.notebook import capture_html

        return capture_html(self)

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
        data = np.ascontiguousarray(self.weights, dtype=np.float16 if float16 else np.float32)
        sidecar = self.sidecar()
        sidecar["dtype"] = str(data.dtype)
        sidecar["weights_file"] = npy_path.name
        text = _sidecar_text(sidecar)  # before any file is touched: a bad meta loses nothing
        ensure_dir(npy_path.parent)
        # Old sidecar out, weights in, new sidecar last: a sidecar always describes the weights
        # beside it, so an interrupted save never pairs new weights with old metadata.
        json_path.unlink(missing_ok=True)
        atomic_write(npy_path, lambda handle: np.save(handle, data, allow_pickle=False))
        atomic_write_text(json_path, text)
        return npy_path


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


def format_indices(indices: Sequence[int]) -> str:
    return ", ".join(str(i) for i in indices) if len(indices) <= 12 else (
        f"{indices[0]}..{indices[-1]} ({len(indices)} in all)")


def _as_array(value: Any) -> np.ndarray:
    """A numpy array from numpy data or a torch tensor on any device and dtype."""
    import numpy as np

    if value is None:
        raise UsageError("the attention weights are None: the model ran with a fused kernel "
                         "(sdpa, flash attention) that never builds them",
                         "load the model with attn_implementation=\"eager\", or use "
                         "attnviz.capture(model, tokenizer, text)")
    detach = getattr(value, "detach", None)
    if callable(detach):  # torch: bfloat16 has no numpy type, so go through float32
        value = detach().float().cpu().numpy()
    return np.asarray(value)


def _row(index: int, size: int, what: str) -> int:
    if not -size <= index < size:
        raise UsageError(f"batch index {index} is out of range: {what} holds {size} rows "
                         f"(0..{size - 1})")
    return index % size


def _check_strings(**values: Any) -> None:
    """``model`` must be a non-empty string; ``text`` and ``pair`` strings or ``None``."""
    for name, value in values.items():
        if value is None and name != "model":
            continue
        if not isinstance(value, str) or (name == "model" and not value.strip()):
            raise UsageError(f"{name} must be a {'non-empty ' if name == 'model' else ''}"
                             f"string, not {value!r:.40}")


def _whole(value: Any) -> bool:
    import numbers

    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _indices(values: Sequence[int] | None, count: int, name: str) -> list[int]:
    """``layers``/``heads`` of :meth:`Capture.from_attentions`: distinct whole numbers."""
    if values is None:
        return list(range(count))
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise UsageError(f"{name} must be a list of indices, not {type(values).__name__}")
    items = list(values)
    if not all(_whole(i) for i in items):
        raise UsageError(f"{name} must hold whole numbers, not {items!r:.60}")
    result = [int(i) for i in items]
    if any(not 0 <= i < MAX_COUNT for i in result):
        raise UsageError(f"{name} must lie in 0..{MAX_COUNT - 1}, not {items!r:.60}")
    repeated = sorted({i for i in result if result.count(i) > 1})
    if repeated:
        raise UsageError(f"{name} lists {name[:-1]} {repeated[0]} twice",
                         f"give each {name[:-1]} of the weights once, in order")
    return result


def _count(value: int | None, name: str, default: int) -> int:
    if value is None:
        return default
    if not _whole(value) or not 1 <= value <= MAX_COUNT:
        raise UsageError(f"{name} must be a whole number from 1 to {MAX_COUNT}, not "
                         f"{value!r:.40}")
    return int(value)


def _word_ids(values: Any) -> list[int | None]:
    items = list(values)
    for item in items:
        if item is not None and (not _whole(item) or item < 0):
            raise UsageError(f"word ids must be whole numbers from 0 (None for special "
                             f"tokens), not {item!r:.40}")
    return [None if item is None else int(item) for item in items]


def _stack_attentions(attentions: Any, batch_index: int) -> tuple[np.ndarray, int | None]:
    """``[layer, head, query, key]`` of one batch row from per-layer or stacked weights, and
    the number of rows in the batch (``None`` for unbatched weights)."""
    import numpy as np

    if not isinstance(attentions, (list, tuple)) and not hasattr(attentions, "shape") and (
            hasattr(attentions, "__iter__") and not isinstance(attentions, (str, bytes, dict))):
        attentions = list(attentions)  # a generator of layers
    if isinstance(attentions, (list, tuple)):
        if not attentions:
            raise UsageError("no attention weights: the sequence of layers is empty (a model "
                             "that ran with sdpa or flash attention returns none)",
                             "load the model with attn_implementation=\"eager\", or use "
                             "attnviz.capture(model, tokenizer, text)")
        layers = [_as_array(a) for a in attentions]
    else:
        stacked = _as_array(attentions)
        if stacked.ndim not in (4, 5):
            raise UsageError(f"expected one [batch, head, query, key] array per layer, got an "
                             f"array of shape {tuple(stacked.shape)}")
        layers = list(stacked)
    shapes = {tuple(a.shape) for a in layers}
    if len(shapes) != 1:
        raise UsageError(f"the layers' weights differ in shape: {sorted(shapes)}")
    kinds = {a.dtype.kind for a in layers}
    if not kinds <= {"f", "i", "u"}:
        raise UsageError(f"attention weights must be real numbers, got {layers[0].dtype} "
                         "values", "pass the float weights of outputs.attentions")
    first = layers[0]
    rows = None
    if first.ndim == 4:
        rows = int(first.shape[0])
        row = _row(batch_index, rows, "the batch")
        layers = [a[row] for a in layers]
    elif first.ndim != 3:
        raise UsageError(f"expected [batch, head, query, key] per layer, got shape "
                         f"{tuple(first.shape)}")
    return np.stack([np.asarray(a, dtype=np.float32) for a in layers]), rows


def _token_row(tokens: Any, batch_index: int, tokenizer: Any) -> list[str]:
    """One row of tokens as strings (ids are converted with the tokenizer)."""
    example = "e.g. tokenizer.convert_ids_to_tokens(inputs['input_ids'][0])"
    if hasattr(tokens, "tolist"):
        tokens = tokens.tolist()
    if isinstance(tokens, str):
        raise UsageError("tokens must be a list of tokens, not one string", example)
    if isinstance(tokens, (bytes, dict)) or not hasattr(tokens, "__iter__"):
        raise UsageError(f"tokens must be a list of token strings (or ids with tokenizer=), "
                         f"not {type(tokens).__name__}", example)
    items = list(tokens)
    if items and isinstance(items[0], (list, tuple)):
        items = list(items[_row(batch_index, len(items), "tokens")])
    if items and not isinstance(items[0], str):
        if not all(_whole(i) for i in items):
            raise UsageError(f"tokens must be strings, or token ids with tokenizer=, not "
                             f"{items[0]!r:.40}", example)
        if tokenizer is None:
            raise UsageError("tokens are ids: pass tokenizer= to turn them into tokens",
                             "or pass tokenizer.convert_ids_to_tokens(ids)")
        ids = [int(i) for i in items]
        negative = next((i for i in ids if i < 0), None)
        if negative is not None:
            raise UsageError(f"token id {negative} is not in the tokenizer's vocabulary "
                             "(ids are 0 or more)", "pass the input ids the model ran on")
        try:
            items = list(tokenizer.convert_ids_to_tokens(ids))
        except (OverflowError, ValueError, IndexError, TypeError) as exc:
            raise UsageError(f"the tokenizer cannot turn these ids into tokens ({exc})",
                             "pass the input ids the model ran on") from None
        # A vocabulary may have gaps (len(tokenizer) is no bound): ask the tokenizer itself.
        unknown = next((i for i, t in zip(ids, items) if not isinstance(t, str)), None)
        if unknown is not None:
            raise UsageError(f"token id {unknown} is not in the tokenizer's vocabulary",
                             "pass the input ids the model ran on")
    if not all(isinstance(t, str) for t in items):
        raise UsageError("tokens must all be strings (or all token ids with tokenizer=)",
                         example)
    return list(items)


# Spellings of special tokens: [CLS], <|endoftext|>, <s>, </s>, <pad>.
_SPECIAL_RE = re.compile(r"\[[A-Z_]+\]|<\|[^|<>]+\|>|</?[a-z_]+>")


def _looks_special(token: str) -> bool:
    return bool(_SPECIAL_RE.fullmatch(token))


def _special_flags(tokens: list[str], special: Sequence[bool] | None, tokenizer: Any,
                   size: int, keep: list[int]) -> list[bool]:
    if special is not None:
        items = list(special)
        if not all(isinstance(s, bool) or (_whole(s) and s in (0, 1))
                   or type(s).__name__ == "bool_" for s in items):
            raise UsageError("special must hold True/False per token (or 1/0)")
        flags = [bool(s) for s in items]
        if len(flags) == size and size != len(keep):
            flags = [flags[i] for i in keep]
        if len(flags) != len(tokens):
            raise UsageError(f"got {len(flags)} special flags for {len(tokens)} tokens")
        return flags
    known = getattr(tokenizer, "all_special_tokens", None)
    if known:
        names = {str(t) for t in known}
        return [t in names for t in tokens]
    return [_looks_special(t) for t in tokens]


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
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise DumpError(f"cannot read {json_path}: {exc}",
                        "the sidecar is corrupt: create the capture again") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        raise DumpError(f"{json_path} is not an attnviz capture sidecar",
                        "create one with: attnviz dump \"your text\" -o my_capture")
    try:
        with np.errstate(all="ignore"):  # a lying header overflows numpy's size arithmetic
            weights = np.load(npy_path, mmap_mode="r" if mmap else None, allow_pickle=False)
    except (OSError, ValueError, EOFError, OverflowError, MemoryError) as exc:
        raise DumpError(f"cannot read {npy_path}: {exc}",
                        "the weights file is truncated or corrupt: create the capture again"
                        ) from None
    capture = capture_from_parts(meta, weights, origin=str(json_path), check_all=not mmap)
    if not mmap and capture.weights.dtype != np.float32:
        capture.weights = capture.weights.astype(np.float32)
    return capture


#: How far a row of weights may sum from 1: float16 storage rounds each weight by at most
#: 2**-11 of its size, and half-precision models compute the softmax in 16 bits.
ROW_SUM_TOLERANCE = 1e-2
#: Most layers or heads a sidecar may state (no model comes near; bounds every allocation).
MAX_COUNT = 1_000_000
_AXES = ["layer", "head", "query", "key"]


class _Invalid(ValueError):
    """A sidecar field or the weights break the capture format; the message names which."""


def capture_from_parts(meta: dict[str, Any], weights: np.ndarray, *, origin: str,
                       check_all: bool = True) -> Capture:
    """A :class:`Capture` from a parsed sidecar and its weights, after checking both.

    Every field must have its documented type and a sensible value (finite whole numbers in
    range, no duplicate layers or heads, lists as long as the tokens); the weights must be
    float32/float16 ``[layer, head, query, key]`` of the described shape, finite, non-negative,
    each row summing to 1 (within :data:`ROW_SUM_TOLERANCE`; an all-zero row is allowed) and,
    for a causal capture, zero above the diagonal.

    Args:
        meta: the sidecar as parsed JSON.
        weights: the array from the ``.npy`` file (may be memory-mapped).
        origin: the sidecar's path, for messages.
        check_all: check the values of every row; ``False`` checks the first query row of each
            layer and head only (a memory-mapped capture may be larger than memory).

    Raises:
        DumpError: which field or which part of the weights is wrong.
    """
    try:
        return _capture_from(meta, weights, check_all=check_all)
    except _Invalid as exc:
        raise DumpError(f"{origin} is not a valid capture: {exc}",
                        "the capture is damaged or was not written by attnviz: create it again "
                        "with attnviz dump") from None


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


def _capture_from(meta: dict[str, Any], weights: np.ndarray, check_all: bool = True) -> Capture:
    """Check a parsed sidecar and its weights (raises :class:`_Invalid`, a ``ValueError``)."""
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
    # A memory-mapped capture may be larger than memory: check its first query rows only.
    _check_weights(weights if check_all else weights[:, :, :1, :], layers, heads, causal)
    return Capture(
        tokens=tokens, word_ids=word_ids, special=special, weights=weights,
        layers=layers, heads=heads, num_layers=num_layers, num_heads=num_heads,
        model=model, causal=causal, text=text, pair=pair,
        display_tokens=display, meta=dict(extra),
    )


def _check_weights(weights: np.ndarray, layers: list[int], heads: list[int],
                   causal: bool) -> None:
    """Attention rows: finite, non-negative, summing to 1 (or 0), causal when marked so.

    ``weights`` is ``[layer, head, query, key]``, possibly only the first queries.
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
        lowest = int(np.argmin(block))
        if float(block.flat[lowest]) < -1e-6:
            raise _Invalid(f"the weights hold negative values ({float(block.flat[lowest]):.4g} "
                           f"at {where(position, lowest, block.shape)}): attention weights "
                           "are never negative")
        off = np.abs(sums - 1.0) > ROW_SUM_TOLERANCE
        off &= np.abs(sums) > 1e-6  # a row with every key excluded sums to 0
        if off.any():
            flat = int(np.argmax(off))
            raise _Invalid(f"the weights of {where(position, flat, sums.shape)} sum to "
                           f"{float(sums.flat[flat]):.4g}: each row of attention weights must "
                           f"sum to 1 (within {ROW_SUM_TOLERANCE:g})")
        if causal and keys > 1:
            future = np.where(later, block, 0)
            worst = int(np.argmax(future))
            if float(future.flat[worst]) > 1e-3:
                raise _Invalid(f"the sidecar says \"causal\": true, but "
                               f"{where(position, worst, future.shape)} gives weight "
                               f"{float(future.flat[worst]):.4g} to a later key")
