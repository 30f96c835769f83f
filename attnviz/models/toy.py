"""The toy model: multi-head self-attention written like reference code.

Each block computes, for every head h::

    Q = X W_Q[h]   K = X W_K[h]   V = X W_V[h]          # (T, d_k)
    A = softmax(Q K^T / sqrt(d_k) + causal_mask)         # (T, T), rows sum to 1
    head_h = A V
    out = concat(head_1..head_H) W_O                      # (T, d_model)

and blocks are stacked with a residual connection and a layer norm. Everything is seeded:
weights come from the seed, and each distinct (lower-cased) word gets an embedding derived from
the word and the seed, so the same text and seed give identical weights on every machine, and a
repeated word gets the same embedding. Numbers are drawn with numpy's legacy ``RandomState``,
whose streams numpy guarantees never to change.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import unicodedata
from dataclasses import asdict, dataclass
from typing import cast

import numpy as np
import torch
from torch import nn

from attnviz.capture import Capture
from attnviz.errors import InputError, UsageError

_WORD = re.compile(r"\w+|[^\w\s]", re.UNICODE)

#: Tokens the toy model takes, like a real model's own limit: past it a text is cut (with a
#: warning) or refused with ``truncate=False``; ``max_tokens`` (``--max-tokens``) moves it.
DEFAULT_MAX_TOKENS = 2048


@dataclass(frozen=True)
class ToyConfig:
    """Settings of the toy model."""

    d_model: int = 16  # embedding width; split evenly over the heads
    heads: int = 2  # attention heads per block
    layers: int = 1  # stacked attention blocks
    causal: bool = False  # mask future keys with -inf before the softmax
    scale: bool = True  # divide scores by sqrt(d_k); False shows softmax saturation
    seed: int = 0  # seeds the projection weights and the word embeddings

    def __post_init__(self) -> None:
        if self.heads < 1 or self.d_model < 1 or self.layers < 1:
            raise UsageError(
                "toy model: --toy-heads, --d-model and --toy-layers must be at least 1")
        if self.d_model % self.heads:
            raise UsageError(
                f"toy model: --d-model {self.d_model} is not divisible by --toy-heads "
                f"{self.heads}",
                f"pick a d_model that is a multiple of {self.heads}, e.g. {self.heads * 8}",
            )
        if self.d_model > 4096 or self.heads > 256 or self.layers > 64:
            raise UsageError(
                "toy model: keep --d-model <= 4096, --toy-heads <= 256, --toy-layers <= 64")
        if not 0 <= self.seed < 2**32:
            raise UsageError(f"toy model: --seed {self.seed} is out of range (0..4294967295)")

    @property
    def d_k(self) -> int:
        return self.d_model // self.heads


def split_words(text: str) -> list[str]:
    """The toy tokenizer: words and single punctuation marks, in order.

    Control and format characters (category C*) are not words and are dropped.
    """
    return [w for w in _WORD.findall(text)
            if not all(unicodedata.category(ch).startswith("C") for ch in w)]


def word_embedding(word: str, d_model: int, seed: int) -> np.ndarray:
    """Deterministic embedding ``(d_model,)`` of a word: the same word and seed, the same vector."""
    digest = hashlib.sha256(f"{seed}\x1f{word.lower()}".encode("utf-8", "surrogatepass")).digest()
    rng = np.random.RandomState(int.from_bytes(digest[:4], "little"))
    return rng.standard_normal(d_model).astype(np.float32)


class ToySelfAttention(nn.Module):
    """One multi-head self-attention block with the manual softmax path."""

    def __init__(self, config: ToyConfig, rng: np.random.RandomState) -> None:
        super().__init__()
        self.config = config
        d = config.d_model

        def weight() -> nn.Parameter:
            # Scaled so scores have unit-ish variance before the 1/sqrt(d_k).
            return nn.Parameter(torch.from_numpy(
                (rng.standard_normal((d, d)) / math.sqrt(d)).astype(np.float32)))

        self.W_Q = weight()  # (d_model, d_model): all heads side by side
        self.W_K = weight()
        self.W_V = weight()
        self.W_O = weight()

    def steps(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """Every intermediate of the block, for all heads (what ``explain`` prints).

        Args: x (T, d_model). Returns q, k, v (H, T, d_k); scores, scaled, masked, weights
        (H, T, T); heads (H, T, d_k), each head's weighted sum of V rows.
        """
        cfg = self.config
        T = x.shape[0]
        q = (x @ self.W_Q).view(T, cfg.heads, cfg.d_k).transpose(0, 1)  # (H, T, d_k)
        k = (x @ self.W_K).view(T, cfg.heads, cfg.d_k).transpose(0, 1)  # (H, T, d_k)
        v = (x @ self.W_V).view(T, cfg.heads, cfg.d_k).transpose(0, 1)  # (H, T, d_k)
        scores = q @ k.transpose(-2, -1)  # (H, T, T)
        scaled = scores / math.sqrt(cfg.d_k) if cfg.scale else scores
        masked = scaled
        if cfg.causal:
            future = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
            masked = scaled.masked_fill(future, float("-inf"))
        weights = torch.softmax(masked.float(), dim=-1).to(x.dtype)  # (H, T, T)
        heads = weights @ v  # (H, T, d_k)
        return {"q": q, "k": k, "v": v, "scores": scores, "scaled": scaled, "masked": masked,
                "weights": weights, "heads": heads}

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Args: x (T, d_model). Returns (output (T, d_model), weights (H, T, T))."""
        step = self.steps(x)
        T = x.shape[0]
        out = step["heads"].transpose(0, 1).reshape(T, self.config.d_model) @ self.W_O
        return out, step["weights"]  # (T, d_model), (H, T, T)


class ToyModel(nn.Module):
    """Stacked toy attention blocks: ``x = layer_norm(x + attention(x))`` per block."""

    def __init__(self, config: ToyConfig) -> None:
        super().__init__()
        self.config = config
        rng = np.random.RandomState(config.seed)
        self.blocks = nn.ModuleList(ToySelfAttention(config, rng) for _ in range(config.layers))

    def embed(self, words: list[str]) -> torch.Tensor:
        """(T, d_model) embeddings of the words."""
        vectors = [word_embedding(w, self.config.d_model, self.config.seed) for w in words]
        return torch.from_numpy(np.stack(vectors))

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Args: x (T, d_model). Returns one (H, T, T) weight tensor per block."""
        all_weights = []
        for block in self.blocks:
            out, weights = block(x)
            x = nn.functional.layer_norm(x + out, (self.config.d_model,))
            all_weights.append(weights)
        return all_weights


class ToySource:
    """Captures attention from the toy model."""

    def __init__(self, config: ToyConfig | None = None, device: str = "auto",
                 dtype: str = "float32") -> None:
        from attnviz.models._torch import resolve_device, resolve_dtype

        self.config = config or ToyConfig()
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype)
        self.model = ToyModel(self.config).to(device=self.device, dtype=self.dtype).eval()
        self.name = "toy"
        self.num_layers = self.config.layers
        self.num_heads = self.config.heads
        self.max_tokens = DEFAULT_MAX_TOKENS

    def identity(self) -> dict[str, object]:
        """What determines this source's weights (for cache keys)."""
        return {"model": "toy", **asdict(self.config), "dtype": str(self.dtype)}

    def capture(self, text: str, pair: str | None = None, *, layers: list[int] | None = None,
                heads: list[int] | None = None, max_tokens: int | None = None,
                truncate: bool = True, measure: str = "weights") -> Capture:
        """Run the toy model on ``text`` (and ``pair``) and return the capture.

        Past the limit (:data:`DEFAULT_MAX_TOKENS` words, or ``max_tokens`` when given, which
        may raise it) the first words are kept with a warning in ``meta["warnings"]``, or, with
        ``truncate=False``, :class:`InputError` is raised.

        Raises:
            InputError: no words, too many words with ``truncate=False``, or a capture that
                would not fit in free memory.
            UsageError: a ``measure`` other than ``weights`` (the toy model has attention only).
        """
        from attnviz.models._measure import check_measure_for
        from attnviz.models._torch import to_numpy

        check_measure_for(self.name, measure)

        words = split_words(text)
        second = split_words(pair) if pair is not None else []
        if not words or (pair is not None and not second):
            raise InputError("the text has no words to attend over",
                             "give a sentence such as \"The cat sat on the mat\"")
        tokens, warnings = self._limit(words + second, max_tokens, truncate)
        keep_layers = layers if layers is not None else list(range(self.num_layers))
        keep_heads = heads if heads is not None else list(range(self.num_heads))
        check_memory(self.config, len(tokens), len(keep_layers))
        with torch.inference_mode():
            x = self.model.embed(tokens).to(device=self.device, dtype=self.dtype)
            per_layer = self.model(x)
        weights = np.stack([to_numpy(per_layer[i][keep_heads]) for i in keep_layers])
        return Capture(
            tokens=tokens, word_ids=list(range(len(tokens))), special=[False] * len(tokens),
            weights=weights.astype(np.float32, copy=False), layers=list(keep_layers),
            heads=list(keep_heads), num_layers=self.num_layers, num_heads=self.num_heads,
            model="toy", causal=self.config.causal, text=text, pair=pair,
            meta={"source": "toy", "toy": asdict(self.config), "dtype": str(self.dtype),
                  "device": str(self.device), "warnings": warnings,
                  # no separator token: record where the second segment starts (if kept)
                  **({"pair_start": len(words)} if second and len(tokens) > len(words)
                     else {})},
        )


    def _limit(self, tokens: list[str], max_tokens: int | None,
               truncate: bool) -> tuple[list[str], list[str]]:
        """The tokens within the limit, and a warning when some were dropped."""
        limit = self.max_tokens if max_tokens is None else max_tokens
        if len(tokens) <= limit:
            return tokens, []
        over = (f"more than --max-tokens {limit}" if max_tokens is not None
                else f"more than the toy model's limit of {limit} tokens (raise it with "
                     "--max-tokens)")
        if not truncate:
            raise InputError(f"the text has {len(tokens)} words, {over}",
                             f"shorten the text, pass --max-tokens {len(tokens)} to take it "
                             f"whole, or --truncate to keep the first {limit} words")
        return tokens[:limit], [f"the text has {len(tokens)} words, {over}; kept the first "
                                f"{limit}, dropped {len(tokens) - limit}"]


def _free_memory() -> int | None:
    """Bytes of memory available now, or ``None`` when the system does not say."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:  # pragma: no cover - psutil comes with accelerate
        pass
    try:  # pragma: no cover - fallback
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, ValueError, OSError):  # pragma: no cover
        return None


def _size(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.1f} GiB"  # pragma: no cover


def check_memory(config: ToyConfig, tokens: int, kept_layers: int) -> None:
    """Refuse a toy run whose ``[head, query, key]`` arrays cannot fit in free memory.

    Every block holds its weights plus about three working copies (scores, scaled, masked),
    and the capture stacks the kept layers once more.
    """
    needed = 4 * config.heads * tokens * tokens * (config.layers + 3 + kept_layers)
    available = _free_memory()
    if available is None or needed <= 0.8 * available:
        return
    raise InputError(
        f"the toy model needs about {_size(needed)} of memory for {tokens} tokens "
        f"({config.layers} layers x {config.heads} heads x {tokens}x{tokens} weights) but "
        f"only {_size(available)} is free",
        f"lower --max-tokens (the default limit is {DEFAULT_MAX_TOKENS}), shorten the text, "
        "or use fewer --toy-heads/--toy-layers")


@dataclass
class HeadTrace:
    """Every intermediate of one toy head on one input, for the step-by-step ``explain`` view.

    Attributes:
        tokens: the words, length ``T``.
        layer: block index; head: head index.
        x: ``(T, d_model)`` input of the block (embeddings for block 0).
        q, k, v: ``(T, d_k)`` the head's queries, keys and values.
        scores: ``(T, T)`` raw ``Q K^T``.
        scaled: ``(T, T)`` ``scores / sqrt(d_k)``, or ``scores`` again without scaling.
        masked: ``(T, T)`` ``scaled`` with ``-inf`` on future keys of a causal model.
        weights: ``(T, T)`` ``softmax(masked)`` per row (rows sum to 1), equal to the capture.
        output: ``(T, d_k)`` ``weights @ v``, the head's output before ``W_O``.
        scale: the factor applied to the scores (``1/sqrt(d_k)`` or 1).
        causal: whether future keys were masked.
    """

    tokens: list[str]
    layer: int
    head: int
    x: np.ndarray
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    scores: np.ndarray
    scaled: np.ndarray
    masked: np.ndarray
    weights: np.ndarray
    output: np.ndarray
    scale: float
    causal: bool


def _trace_block(block: ToySelfAttention, x: torch.Tensor, head: int) -> dict[str, torch.Tensor]:
    """The intermediates of one head: the block's own :meth:`ToySelfAttention.steps`."""
    step = block.steps(x)
    return {"x": x, "q": step["q"][head], "k": step["k"][head], "v": step["v"][head],
            "scores": step["scores"][head], "scaled": step["scaled"][head],
            "masked": step["masked"][head], "weights": step["weights"][head],
            "output": step["heads"][head]}


def trace_head(source: ToySource, text: str, layer: int = 0, head: int = 0,
               pair: str | None = None) -> HeadTrace:
    """Run the toy model on ``text`` and return every intermediate of one head.

    Args:
        source: the toy model.
        text: the input text (split into words as in :meth:`ToySource.capture`).
        layer: block index (0-based, negative counts from the end).
        head: head index (0-based, negative counts from the end).
        pair: an optional second text, appended as in :meth:`ToySource.capture`.

    Returns:
        The trace; its ``weights`` equal ``source.capture(text).matrix(layer, head)``.
    """
    from attnviz.models._torch import to_numpy
    from attnviz.selection import resolve_index

    layer = resolve_index(layer, source.num_layers, "layer")
    head = resolve_index(head, source.num_heads, "head")
    tokens = split_words(text) + (split_words(pair) if pair is not None else [])
    if not tokens:
        raise InputError("the text has no words to attend over",
                         "give a sentence such as \"The cat sat on the mat\"")
    if len(tokens) > source.max_tokens:
        raise InputError(f"the text has {len(tokens)} words, more than the toy model's limit "
                         f"of {source.max_tokens} tokens",
                         "shorten the text: the step-by-step view is for a few words")
    check_memory(source.config, len(tokens), 1)
    model = source.model
    with torch.inference_mode():
        x = model.embed(tokens).to(device=source.device, dtype=source.dtype)
        for block in model.blocks[:layer]:
            out, _ = block(x)
            x = nn.functional.layer_norm(x + out, (model.config.d_model,))
        parts = _trace_block(cast(ToySelfAttention, model.blocks[layer]), x, head)
    arrays = {name: to_numpy(value).astype(np.float64) for name, value in parts.items()}
    cfg = source.config
    return HeadTrace(tokens=tokens, layer=layer, head=head,
                     scale=1.0 / math.sqrt(cfg.d_k) if cfg.scale else 1.0, causal=cfg.causal,
                     **arrays)
