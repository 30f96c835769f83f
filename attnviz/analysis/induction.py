"""Induction heads: the repeated random-token test (Olsson et al., 2022).

The model reads ``n`` random tokens followed by the same ``n`` tokens again (after a BOS token
when the model has one). At the second occurrence of a token, an induction head attends to the
token that followed its first occurrence, so it can predict what comes next. A head's
*induction score* is its mean attention weight on exactly that key over the ``n`` query
positions of the second copy::

    positions:  [bos] t_0 .. t_{n-1}  t_0 .. t_{n-1}
    query p+n+k (second t_k)  ->  key p+k+1 (the token after the first t_k),  k = 0..n-1

Random tokens carry no meaning, so only a copying mechanism scores high: uniform attention
scores about ``1 / (n + k)``, and previous-token or same-token heads score about 0. The
tokens of one sequence are distinct, so each query has exactly one induction target.

The test needs a live model (it runs the model on a generated sequence): a Hugging Face
source, the toy model, or any object with ``attention_on_ids(ids) -> [layer, head, T, T]``
and ``vocab_size``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from attnviz.errors import UsageError

DEFAULT_LENGTH = 50  # random tokens per copy, as in TransformerLens' induction demo
DEFAULT_SEQUENCES = 4  # random sequences averaged over
TOY_VOCAB = 1000  # random "words" the toy model is tested on

RunIds = Callable[[list[int]], np.ndarray]


@dataclass
class InductionResult:
    """Induction scores of every layer and head of a model.

    Attributes:
        scores: ``[layer, head]`` mean weight on the induction target (0..1), all model layers
            and heads.
        length: random tokens per copy.
        sequences: how many random sequences were averaged.
        prefix: token ids put before the sequence (a BOS token, or nothing).
        seed: seed of the random tokens (``numpy.random.RandomState(seed)``).
        token_ids: the random tokens of each sequence (one copy; the model read
            ``prefix + ids + ids``), so the test can be rerun exactly.
    """

    scores: np.ndarray
    length: int
    sequences: int
    prefix: list[int]
    seed: int = 0
    token_ids: list[list[int]] = field(default_factory=list)

    def for_capture(self, layers: Sequence[int], heads: Sequence[int]) -> np.ndarray:
        """The ``[layer, head]`` scores of the given model layers and heads."""
        return self.scores[np.ix_(list(layers), list(heads))]

    def settings(self) -> dict[str, Any]:
        """How the test ran, for JSON output: enough to rerun it and get the same scores.

        ``length``, ``sequences``, ``seed``, ``prefix_tokens`` (how many), ``prefix_ids`` and
        ``token_ids`` (the random tokens of each sequence; the model read
        ``prefix_ids + ids + ids``).
        """
        return {"length": self.length, "sequences": self.sequences, "seed": self.seed,
                "prefix_tokens": len(self.prefix), "prefix_ids": list(self.prefix),
                "token_ids": [list(ids) for ids in self.token_ids]}


def repeated_sequence(vocab: np.ndarray, length: int, rng: np.random.RandomState,
                      prefix: Sequence[int] = ()) -> list[int]:
    """``prefix + t + t`` for ``length`` distinct random tokens ``t`` drawn from ``vocab``."""
    if len(vocab) < length:
        raise UsageError(f"the vocabulary has {len(vocab)} usable tokens, fewer than the "
                         f"{length} distinct tokens the induction test needs")
    tokens = [int(t) for t in rng.choice(vocab, size=length, replace=False)]
    return [*prefix, *tokens, *tokens]


def induction_stripe(attention: np.ndarray, length: int, prefix: int = 0) -> np.ndarray:
    """Per-head induction scores of one run.

    Args:
        attention: ``[layer, head, T, T]`` with ``T = prefix + 2 * length``.
        length: random tokens per copy.
        prefix: tokens before the first copy.

    Returns:
        ``[layer, head]`` mean weight from query ``prefix + length + k`` to key
        ``prefix + k + 1`` over ``k = 0..length-1``.
    """
    k = np.arange(length)
    queries = prefix + length + k
    keys = prefix + k + 1
    return np.asarray(attention[:, :, queries, keys], dtype=np.float64).mean(axis=-1)


def induction_scores_from(run: RunIds, vocab: np.ndarray, *, length: int = DEFAULT_LENGTH,
                          sequences: int = DEFAULT_SEQUENCES, prefix: Sequence[int] = (),
                          seed: int = 0) -> InductionResult:
    """Run the repeated random-token test with any function from token ids to attention.

    Args:
        run: token ids (length ``T``) -> attention ``[layer, head, T, T]``.
        vocab: token ids to draw from (no special tokens).
        length: random tokens per copy.
        sequences: how many random sequences to average over.
        prefix: ids to put first (e.g. BOS).
        seed: seed of the random tokens.
    """
    if length < 2:
        raise UsageError("the induction test needs at least 2 random tokens per copy",
                         "use a model that accepts at least 5 tokens")
    if sequences < 1:
        raise UsageError("the induction test needs at least one random sequence")
    rng = np.random.RandomState(seed)
    runs = []
    token_ids = []
    for _ in range(sequences):
        ids = repeated_sequence(np.asarray(vocab), length, rng, prefix)
        token_ids.append(ids[len(prefix):len(prefix) + length])
        runs.append(induction_stripe(run(ids), length, len(prefix)))
    return InductionResult(scores=np.mean(runs, axis=0), length=length, sequences=sequences,
                           prefix=list(prefix), seed=seed, token_ids=token_ids)


def _hf_runner(source: Any) -> tuple[RunIds, np.ndarray, list[int], int | None]:
    import torch

    from attnviz.models._torch import to_numpy

    tokenizer = source.tokenizer
    size = len(tokenizer)
    config_size = getattr(source.config, "vocab_size", None)
    if isinstance(config_size, int) and config_size > 0:
        size = min(size, config_size)
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    vocab = np.array([i for i in range(size) if i not in special], dtype=np.int64)
    bos = getattr(tokenizer, "bos_token_id", None)
    prefix = [int(bos)] if isinstance(bos, int) else []

    def run(ids: list[int]) -> np.ndarray:
        tensor = torch.tensor([ids], dtype=torch.long)
        enc = {"input_ids": tensor, "attention_mask": torch.ones_like(tensor)}
        attentions = source.forward_attentions(enc)
        return np.stack([to_numpy(a[0]) for a in attentions])

    return run, vocab, prefix, source.max_tokens


def _toy_runner(source: Any) -> tuple[RunIds, np.ndarray, list[int], int | None]:
    import torch

    from attnviz.models._torch import to_numpy

    def run(ids: list[int]) -> np.ndarray:
        words = [f"tok{i}" for i in ids]
        with torch.inference_mode():
            x = source.model.embed(words).to(device=source.device, dtype=source.dtype)
            per_layer = source.model(x)
        return np.stack([to_numpy(w) for w in per_layer])

    return run, np.arange(TOY_VOCAB), [], None


def _runner(source: Any) -> tuple[RunIds, np.ndarray, list[int], int | None]:
    if hasattr(source, "attention_on_ids"):
        prefix = [int(i) for i in getattr(source, "prefix_ids", [])]
        return (source.attention_on_ids, np.arange(int(source.vocab_size)), prefix,
                getattr(source, "max_tokens", None))
    kind = type(source).__name__
    if kind == "ToySource":
        return _toy_runner(source)
    if kind == "HFSource":
        return _hf_runner(source)
    raise UsageError(f"cannot run the induction test on {kind}",
                     "use --model toy or a Hugging Face decoder model")


def induction_scores(source: Any, *, length: int = DEFAULT_LENGTH,
                     sequences: int = DEFAULT_SEQUENCES, seed: int = 0) -> InductionResult:
    """Induction scores of every head of a live model (repeated random-token test).

    Args:
        source: a :class:`~attnviz.models.hf.HFSource`, a
            :class:`~attnviz.models.toy.ToySource`, or an object with ``vocab_size`` and
            ``attention_on_ids(ids: list[int]) -> ndarray [layer, head, T, T]`` (optionally
            ``prefix_ids`` and ``max_tokens``).
        length: random tokens per copy; shortened to fit the model's maximum length.
        sequences: random sequences to average over.
        seed: seed of the random tokens.

    Returns:
        ``[layer, head]`` scores for all of the model's layers and heads.
    """
    run, vocab, prefix, max_tokens = _runner(source)
    if max_tokens is not None:
        length = min(length, (int(max_tokens) - len(prefix)) // 2)
    length = min(length, len(vocab))
    return induction_scores_from(run, vocab, length=length, sequences=sequences, prefix=prefix,
                                 seed=seed)


def induction_heads(result: InductionResult, threshold: float | None = None
                    ) -> list[tuple[int, int, float]]:
    """``(layer, head, score)`` of the heads scoring at least ``threshold``, best first."""
    from attnviz.analysis.stats import INDUCTION_SCORE

    limit = INDUCTION_SCORE if threshold is None else threshold
    found = [(int(layer), int(head), float(result.scores[layer, head]))
             for layer, head in zip(*np.nonzero(result.scores >= limit))]
    return sorted(found, key=lambda item: -item[2])
