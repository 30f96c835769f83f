"""Attention of generated tokens: generation with the key/value cache and the model's own kernel.

The model runs :meth:`generate` as usual (``sdpa``, the key/value cache), through the long
capture's seam (:mod:`attnviz.long.seam`): its wrapper in transformers' attention-function
registry (``AttentionInterface``) hands each attention call to the recorder here and runs the
model's own kernel for the layer's output. The recorder computes one attention row per head:
the row of the query that produced the next token, ``softmax(scale * q . K^T + mask)``, from
the query and the cached keys the kernel is given (after RoPE, before grouped-query expansion:
each query head reads its key/value head group itself), under the causal mask, the sliding
window and the mask the model built. That is one row per layer and head per step, over all
tokens so far::

    from attnviz.session import Session
    result = Session().generate("The cat sat on the", model="./my-gpt2", max_new_tokens=8)
    result.text                        # the generated text
    result.rows.shape                  # (layers, heads, steps, keys): [layer, head, step, key]
    result.top_k(layer=-1, head="mean", k=3)

Step ``i`` is the generation of token ``P + i`` (``P`` prompt tokens): its row is the attention
of the query at position ``P + i - 1`` (the last prompt token for step 0, then the token
generated before) over keys ``0 .. P + i - 1``: the prompt and every token generated before it.
Rows are stored padded in ``[layer, head, step, key]`` with ``P + steps - 1`` keys; the keys
after ``P + i - 1`` of step ``i`` are 0, as in a causal attention matrix, so the array equals
rows ``P - 1 .. P + steps - 2`` of an eager capture of the whole sequence.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from attnviz.errors import DumpError, InputError, ModelLoadError, UsageError

if TYPE_CHECKING:
    import torch

    from attnviz.models import ModelSpec
    from attnviz.models.hf import HFSource

#: Most tokens one ``generate`` call may produce (``--max-new-tokens``).
MAX_NEW_TOKENS = 4096
#: Most bytes the recorded rows may take (float32 ``[layer, head, step, key]``).
MAX_ROW_BYTES = 4 * 1024**3
FORMAT_NAME = "attnviz-generation"
FORMAT_VERSION = 1
ROWS_NAME = "rows.npy"
JSON_NAME = "generation.json"


# --------------------------------------------------------------------------- the result
class _Recorded:
    """Layer and head lookups shared by :class:`Generation` and :class:`Step`."""

    layers: list[int]
    heads: list[int]
    num_layers: int
    num_heads: int

    def _layer(self, layer: int) -> int:
        from attnviz.selection import resolve_index

        absolute = resolve_index(layer, self.num_layers, "layer")
        if absolute not in self.layers:
            raise UsageError(f"layer {layer} was not recorded (recorded: "
                             f"{', '.join(map(str, self.layers))})",
                             "record it with --layers, or leave --layers out")
        return self.layers.index(absolute)

    def _head(self, head: int | str) -> int | None:
        """Position of ``head`` on the head axis; ``None`` for ``"mean"``."""
        from attnviz.selection import parse_int, resolve_index

        if head == "mean":
            return None
        if isinstance(head, str):
            head = parse_int(head, "head")
        absolute = resolve_index(head, self.num_heads, "head")
        if absolute not in self.heads:
            raise UsageError(f"head {head} was not recorded (recorded: "
                             f"{', '.join(map(str, self.heads))})",
                             "record it with --heads, or leave --heads out")
        return self.heads.index(absolute)

    def _pick(self, rows: np.ndarray, layer: int, head: int | str) -> np.ndarray:
        """``rows[layer, head]`` of ``[layer, head, ...]`` (the mean over heads for "mean")."""
        li, hi = self._layer(layer), self._head(head)
        if hi is None:
            return np.asarray(rows[li].mean(axis=0), dtype=np.float32)
        return np.asarray(rows[li, hi], dtype=np.float32)


def _top_entry(row: np.ndarray, tokens: list[str], step: int, position: int, k: int
               ) -> dict[str, Any]:
    """One generated token's strongest keys (ties to the earlier position)."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise UsageError(f"k must be a whole number of at least 1, not {k!r:.40}")
    from attnviz.analysis.topk import top_keys

    order = top_keys(row, min(k, row.shape[-1]))
    return {"step": step, "position": position, "token": tokens[position],
            "top": [{"key_index": int(j), "key": tokens[int(j)],
                     "weight": round(float(row[j]), 6)} for j in order]}


@dataclass
class Step(_Recorded):
    """One generated token as soon as it is chosen (the ``on_step`` callback of
    :func:`generate`): ``rows`` is ``[layer, head, key]`` over keys ``0 .. position - 1``;
    ``tokens`` holds the prompt and the tokens generated so far, this one last."""

    step: int
    position: int
    token_id: int
    tokens: list[str]
    rows: np.ndarray
    layers: list[int]
    heads: list[int]
    num_layers: int
    num_heads: int

    @property
    def token(self) -> str:
        return self.tokens[self.position]

    def top(self, layer: int = -1, head: int | str = "mean", k: int = 3) -> dict[str, Any]:
        """This token's ``k`` strongest keys, as one entry of :meth:`Generation.top_k`."""
        return _top_entry(self._pick(self.rows, layer, head), self.tokens, self.step,
                          self.position, k)


@dataclass
class Generation(_Recorded):
    """What :func:`generate` returns: the tokens and each generated token's attention rows.

    Attributes:
        prompt: the prompt text.
        text: the generated text (decoded, special tokens left out).
        tokens: every token, prompt then generated (readable labels, control characters as
            their escapes: ``\\x1b``).
        token_ids: their vocabulary ids.
        prompt_length: how many of ``tokens`` are the prompt (``P``).
        rows: float32 ``[layer, head, step, key]``: step ``i`` is the attention of the query at
            ``P + i - 1`` over keys ``0 .. P + i - 1``; later keys are 0 (padding, as causal
            masking would give). ``steps`` is the number of generated tokens.
        layers: model layer of each entry on axis 0; ``heads`` likewise for axis 1.
        num_layers: the model's layers; ``num_heads`` its query heads.
        model: the model's name; ``meta``: how it ran (sampling, seed, stop reason, dtype).
    """

    prompt: str
    text: str
    tokens: list[str]
    token_ids: list[int]
    prompt_length: int
    rows: np.ndarray
    layers: list[int]
    heads: list[int]
    num_layers: int
    num_heads: int
    model: str
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def steps(self) -> int:
        """Generated tokens (one attention row per layer and head each)."""
        return int(self.rows.shape[2])

    @property
    def generated(self) -> list[str]:
        """The generated tokens."""
        return self.tokens[self.prompt_length:]

    def keys_of(self, step: int) -> int:
        """How many keys step ``step``'s row covers (``P + step``)."""
        return self.prompt_length + step

    def matrix(self, layer: int, head: int | str = "mean") -> np.ndarray:
        """``[step, key]`` rows of one layer and head (``"mean"``: the mean of the recorded
        heads); ``layer`` and ``head`` are model indices, negative from the end."""
        return self._pick(self.rows, layer, head)

    def top_k(self, layer: int = -1, head: int | str = "mean", k: int = 3
              ) -> list[dict[str, Any]]:
        """The ``k`` context tokens each generated token attended to most, strongest first.

        Returns:
            One dict per step: ``step``, ``position`` (of the generated token), ``token`` and
            ``top``, a list of ``key_index``, ``key`` and ``weight`` (rounded to 6 decimals).
            Ties go to the earlier position.
        """
        matrix = self.matrix(layer, head)
        return [_top_entry(matrix[step, :self.keys_of(step)], self.tokens, step,
                           self.prompt_length + step, k) for step in range(self.steps)]

    def sidecar(self) -> dict[str, Any]:
        """Everything but the rows, as JSON data (the ``generation.json`` of :meth:`save`)."""
        return {"format": FORMAT_NAME, "version": FORMAT_VERSION,
                "axes": ["layer", "head", "step", "key"],
                "rows": "step i: query at prompt_length + i - 1 over keys 0 .. prompt_length "
                        "+ i - 1; keys after that are 0 (padding)",
                "model": self.model, "prompt": self.prompt, "text": self.text,
                "tokens": self.tokens, "token_ids": self.token_ids,
                "prompt_length": self.prompt_length, "steps": self.steps,
                "layers": self.layers, "heads": self.heads, "num_layers": self.num_layers,
                "num_heads": self.num_heads, "meta": self.meta}

    def save(self, folder: Path | str) -> Path:
        """Write ``rows.npy`` (float32 ``[layer, head, step, key]``) and ``generation.json``
        into ``folder`` (created), each atomically; returns the folder."""
        from attnviz.fileio import atomic_write, atomic_write_text, ensure_dir

        folder = ensure_dir(Path(folder))
        rows = np.ascontiguousarray(self.rows, dtype=np.float32)
        atomic_write(folder / ROWS_NAME, lambda handle: np.save(handle, rows), root=folder)
        atomic_write_text(folder / JSON_NAME, json.dumps(self.sidecar(), ensure_ascii=False,
                                                         indent=1) + "\n", root=folder)
        return folder


def load_generation(folder: Path | str) -> Generation:
    """Read a folder written by :meth:`Generation.save` (numpy and json only).

    Raises:
        DumpError: a file is missing, or the sidecar and the rows disagree.
    """
    from attnviz.capture_build import escape_controls

    folder = Path(folder)
    hint = "write one with: attnviz generate \"PROMPT\" --dump FOLDER"
    from attnviz.reading import load_npy, read_text

    try:
        sidecar = json.loads(read_text(folder / JSON_NAME))
        rows = load_npy(folder / ROWS_NAME, mmap=False, hint=hint)
    except (OSError, ValueError) as exc:
        raise DumpError(f"{folder} is not a saved generation ({exc})", hint) from None
    if not isinstance(sidecar, dict) or sidecar.get("format") != FORMAT_NAME:
        raise DumpError(f"{folder / JSON_NAME} is not an attnviz generation sidecar", hint)
    try:
        result = Generation(
            prompt=str(sidecar["prompt"]), text=str(sidecar["text"]),
            tokens=[escape_controls(str(t)) for t in sidecar["tokens"]],
            token_ids=[int(i) for i in sidecar["token_ids"]],
            prompt_length=int(sidecar["prompt_length"]), rows=rows,
            layers=[int(i) for i in sidecar["layers"]], heads=[int(i) for i in sidecar["heads"]],
            num_layers=int(sidecar["num_layers"]), num_heads=int(sidecar["num_heads"]),
            model=str(sidecar["model"]), meta=dict(sidecar.get("meta", {})))
    except (KeyError, TypeError, ValueError) as exc:
        raise DumpError(f"{folder / JSON_NAME} lacks a field or has a bad value ({exc})",
                        hint) from None
    expected = (len(result.layers), len(result.heads), len(result.tokens) - result.prompt_length,
                max(len(result.tokens) - 1, 0))
    if rows.ndim != 4 or tuple(rows.shape) != expected:
        raise DumpError(f"{folder / ROWS_NAME} has shape {tuple(rows.shape)}; the sidecar says "
                        f"{expected} [layer, head, step, key]", hint)
    return result


# --------------------------------------------------------------------------- the seam
@contextlib.contextmanager
def recording(source: HFSource, recorder: _RowRecorder) -> Iterator[None]:
    """Route the model through the long capture's seam (:mod:`attnviz.long.seam`) while the
    block runs: its wrapper in transformers' attention-function registry hands every attention
    call to ``recorder``, then runs the model's own kernel; the model's configurations are put
    back in ``finally``."""
    from attnviz.long.seam import _ACTIVE, _base_implementation, _register, _routed

    name = _register(_base_implementation(source))
    token = _ACTIVE.set(cast("Any", recorder))  # any object with the recorder's record()
    try:
        with _routed(source.model, name):
            yield
    finally:
        _ACTIVE.reset(token)


class _RowRecorder:
    """Collects the last query's row of every (selected) layer and head, step by step."""

    def __init__(self, prompt_length: int, modules: Sequence[Any] | None, layers: list[int],
                 heads: list[int], num_layers: int = 0, num_heads: int = 0,
                 sinks_in_rows: bool | None = None) -> None:
        self.prompt_length = prompt_length
        # Whether the model's own weights give an attention sink its share (rows that sum to
        # less than 1, as gpt-oss's do); None: not known, and a sink is refused.
        self.sinks_in_rows = sinks_in_rows
        # Without modules found in the model, layers are numbered in the order of the first
        # step's attention calls (the order of outputs.attentions).
        self.layer_of = {id(module): index for index, module in enumerate(modules or ())}
        self.numbered = bool(modules)
        self.num_layers = num_layers or len(self.layer_of)
        self.num_heads = num_heads
        self.layers = layers
        self.heads = heads
        self.first: Any = None  # the first attention module called: a new step starts there
        # The first module's last query and keys: a second call with the very same tensors
        # (differential attention runs each module twice) is the same step.
        self.first_call: tuple[Any, Any] = (None, None)
        self.step = -1
        self.seen: list[set[int]] = []  # layers seen per step
        self.rows: list[dict[int, torch.Tensor]] = []  # per step: layer -> [head, key]
        self._index: torch.Tensor | None = None  # self.heads on the model's device

    def record(self, module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               mask: torch.Tensor | None, scaling: float | None, kwargs: dict[str, Any]
               ) -> tuple[bool, torch.Tensor | None]:
        """Record the last query's row of one attention call; never asks the seam to stop
        the forward pass, and leaves the output to the model's own kernel (``False, None``)."""
        self._record(module, query, key, mask, scaling, kwargs)
        return False, None

    def _record(self, module: Any, query: torch.Tensor, key: torch.Tensor,
                mask: torch.Tensor | None, scaling: float | None,
                kwargs: dict[str, Any]) -> None:
        import torch

        if self.first is None:
            self.first = module
        if module is self.first and (query is not self.first_call[0]
                                     or key is not self.first_call[1]):
            self.step += 1
            self.seen.append(set())
            self.rows.append({})
            self.first_call = (query, key)
        layer = self.layer_of.get(id(module))
        if layer is None and not self.numbered and self.step == 0:
            layer = self.layer_of[id(module)] = len(self.layer_of)
        if layer is None:
            raise ModelLoadError(f"an attention module of type {type(module).__name__} is not "
                                 "one of the model's layers", "generate cannot map its rows")
        self.seen[self.step].add(layer)
        if layer not in self.layers:
            return
        position = self.prompt_length - 1 + self.step  # of the query
        num_heads, kv_heads, length = query.shape[1], key.shape[1], key.shape[2]
        refuse_unusual(layer, num_heads, self.num_heads, length, position, kwargs)
        subset = self.heads != list(range(num_heads))
        if subset and (self._index is None or self._index.device != query.device):
            self._index = torch.tensor(self.heads, device=query.device)
        group = num_heads // kv_heads  # query heads per key/value head (grouped-query)
        with torch.no_grad():
            q = query[0, :, -1, :].float()  # (H, d)
            k = key[0].float()  # (Hkv, kv, d): each group of query heads reads its own
            if scaling is None:
                scaling = getattr(module, "scaling", None) or q.shape[-1] ** -0.5
            scores = torch.matmul(q.view(kv_heads, group, -1), k.transpose(-1, -2))
            scores = scores.view(num_heads, length) * float(scaling)  # (H, kv)
            if subset:
                scores = scores[self._index]  # (h, kv)
            softcap = kwargs.get("softcap")
            if softcap:
                scores = torch.tanh(scores / softcap) * softcap
            if mask is not None:
                row_mask = mask[0, :, -1, :length]  # (1 or H, kv)
                if row_mask.shape[0] > 1 and subset:
                    row_mask = row_mask[self._index]
                if row_mask.dtype == torch.bool:
                    scores = scores.masked_fill(~row_mask, float("-inf"))
                else:
                    scores = scores + row_mask.float()
            bias = kwargs.get("position_bias")
            if bias is not None:
                bias = bias[0, :, -1, :length].float()
                scores = scores + (bias[self._index] if subset and bias.shape[0] > 1 else bias)
            # Key positions: a dynamic cache holds the latest tokens (a sliding-window layer
            # only the window's); a static one holds position i at index i. Keys after the
            # query and, with a sliding window, before it are masked here too.
            first = position + 1 - length if length <= position + 1 else 0
            window = kwargs.get("sliding_window")
            low = max(0, position - int(window) + 1 - first) if window else 0
            high = position + 1 - first
            scores[:, :low] = float("-inf")  # scores is a fresh tensor here: ours to change
            scores[:, high:] = float("-inf")
            sinks = kwargs.get("s_aux", kwargs.get("sinks"))
            if sinks is not None and self.sinks_in_rows is None:
                raise ModelLoadError(f"layer {layer} uses attention sinks, and whether the "
                                     "model's weights give them a share is not known",
                                     "capture the text the usual way (attnviz heatmap)")
            if sinks is not None and self.sinks_in_rows:  # one more logit per head (gpt-oss)
                sink = sinks.float().reshape(-1)
                sink = sink[self._index] if subset else sink
                scores = torch.cat([scores, sink[:, None]], dim=-1)  # (h, kv + 1)
            weights = torch.softmax(scores, dim=-1)[:, :length]  # (h, kv); 0 where masked
            row = torch.zeros((len(self.heads), max(position + 1, first + length)),
                              dtype=torch.float32, device=weights.device)
            row[:, first:first + length] = weights
        # Kept on the model's device until generation ends: no copy (and no wait for the
        # device) inside the decoding loop.
        self.rows[self.step][layer] = row[:, :position + 1]


def refuse_unusual(layer: int, heads: int, expected: int, keys: int, position: int,
                   kwargs: dict[str, Any]) -> None:
    """Refuse what the rows here would get wrong: heads other than the loaded model's, more
    keys than tokens (memory or compressed entries), scores the kernel changes beyond the
    mask, scale, softcap, sinks and position bias applied here.

    Raises:
        ModelLoadError: the layer is not plain (grouped-query) softmax attention over tokens.
    """
    hint = "capture the prompt and its continuation the usual way (attnviz heatmap)"
    if expected and heads != expected:
        raise ModelLoadError(f"layer {layer} runs {heads} query heads where the model "
                             f"returns {expected}: generate cannot map its rows", hint)
    if keys > position + 1:
        raise ModelLoadError(f"layer {layer} attends to {keys} keys for {position + 1} tokens "
                             "(memory or compressed entries that are not tokens): generate "
                             "records attention between tokens only", hint)
    unknown = sorted(name for name in _SCORE_KWARGS if kwargs.get(name) is not None)
    if unknown:
        raise ModelLoadError(f"layer {layer}'s attention takes {', '.join(unknown)}, which "
                             "generate does not reproduce", hint)


# Keyword arguments of an attention call that change its weights in ways the rows here do not
# reproduce (softcap, sinks, position_bias and the sliding window are applied).
_SCORE_KWARGS = ("alibi", "alibi_slopes", "score_mod", "block_mask", "attention_bias",
                 "head_mask", "relative_position_bias")


# --------------------------------------------------------------------------- the model
def causal_lm_problem(config: dict[str, Any], name: str) -> str | None:
    """Why a model's ``config.json`` rules out generation (``None``: it may generate)."""
    architectures = [str(a) for a in config.get("architectures") or []]
    if config.get("is_encoder_decoder"):
        kind = ", ".join(architectures) or f"model type {config.get('model_type')}"
        return (f"{name} is an encoder-decoder model ({kind}); generate follows decoder-only "
                "language models")
    heads = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")
    if architectures and not any(a.endswith(heads) or a in _causal_classes()
                                 for a in architectures):
        return (f"{name} has no causal language-model head (it is a "
                f"{', '.join(architectures)}); generate needs a decoder-only model saved with "
                "its head (...ForCausalLM, ...LMHeadModel)")
    return None


def _causal_classes() -> set[str]:
    """transformers' causal language-model classes (BertGenerationDecoder is one)."""
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:  # pragma: no cover - transformers without the mapping
        return set()
    return {str(name) for name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()}


def check_causal_lm(spec: ModelSpec) -> None:
    """Refuse the toy model, encoders and models without a language-model head, from their
    ``config.json`` where it can be read without loading (else :func:`load_causal_lm` checks).

    Raises:
        ModelLoadError: the model cannot generate; the message says why.
    """
    from attnviz.models import TOY_MODEL, _config_file, check_model_name

    hint = "use a decoder-only model folder or hub id: GPT-2, Llama, Mistral, Qwen2..."
    if spec.name == TOY_MODEL:
        raise UsageError("the toy model has no language-model head: it cannot generate",
                         hint)
    check_model_name(spec.name)
    path = _config_file(spec)
    try:
        config = json.loads(path.read_text(encoding="utf-8")) if path is not None else None
    except (OSError, ValueError):
        return
    if isinstance(config, dict):
        problem = causal_lm_problem(config, spec.name)
        if problem:
            raise UsageError(problem, hint)


def load_causal_lm(spec: ModelSpec | str) -> HFSource:
    """A Hugging Face causal language model with its own fused attention (``sdpa``).

    Raises:
        ModelLoadError: the model cannot load, is an encoder, or has no language-model head.
    """
    from attnviz.models import ModelSpec, check_spec
    from attnviz.models.hf import HFSource

    if isinstance(spec, str):
        spec = ModelSpec(name=spec)
    check_spec(spec)
    check_causal_lm(spec)

    class CausalLMSource(HFSource):
        _auto_class = "AutoModelForCausalLM"
        _attn_implementation = None  # the model's own default: sdpa where it has it

        def _adopt(self, model: Any, config: Any, *, place: bool = True) -> None:
            problem = causal_lm_problem(config.to_dict(), self.name)
            if problem is None and (getattr(config, "is_decoder", None) is False
                                    and config.model_type in _ENCODER_TYPES):
                problem = f"{self.name} is an encoder ({config.model_type}), not a decoder"
            if problem:
                raise ModelLoadError(problem, "use a GPT-2, Llama, Mistral, Qwen2 or similar "
                                     "model folder or hub id")
            super()._adopt(model, config, place=place)
            if self.probed is not None and not self.probed.causal:
                raise ModelLoadError(
                    f"{self.name} attends to later tokens (bidirectional attention, e.g. a "
                    "BERT-style model whose config has is_decoder off): generate records "
                    "attention for a causal language model",
                    "save the model with is_decoder=True in config.json, or capture the text "
                    "the usual way (attnviz heatmap)")

    return CausalLMSource(spec.name, revision=spec.revision,
                          trust_remote_code=spec.trust_remote_code, device=spec.device,
                          dtype=spec.dtype, device_map=spec.device_map,
                          max_memory=spec.max_memory)


_ENCODER_TYPES = {"bert", "roberta", "xlm-roberta", "camembert", "electra", "distilbert",
                  "albert", "deberta", "deberta-v2", "mpnet", "ernie", "modernbert"}


# --------------------------------------------------------------------------- generation
def check_max_new_tokens(value: int) -> None:
    """Refuse a token count outside ``1 .. MAX_NEW_TOKENS``."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_NEW_TOKENS:
        raise UsageError(f"--max-new-tokens must be a whole number from 1 to {MAX_NEW_TOKENS}, "
                         f"not {value!r:.40}", "e.g. --max-new-tokens 20")


def prompt_fit_advice(limit: int, prompt_length: int, max_new_tokens: int) -> str:
    """What fits in a model's ``limit`` positions: how many prompt tokens leave room for
    ``max_new_tokens`` (``--max-tokens`` cuts the prompt to that), and how many new tokens
    the prompt as it is leaves room for (only when that is at least one)."""
    if max_new_tokens >= limit:
        return (f"the model holds {limit} positions: use --max-new-tokens {limit - 1} or "
                "less, with a one-token prompt")
    fit = limit - max_new_tokens
    advice = (f"{fit} prompt token{'s' if fit != 1 else ''} fit with {max_new_tokens} new "
              f"token{'s' if max_new_tokens != 1 else ''}: shorten the prompt, or cut it with "
              f"--max-tokens {fit}")
    room = limit - prompt_length
    if room >= 1:
        advice += f"; or keep the prompt and use --max-new-tokens {room} or less"
    return advice


def generate(source: HFSource, prompt: str, *, max_new_tokens: int = 20,
             sample: bool = False, seed: int | None = None, layers: list[int] | None = None,
             heads: list[int] | None = None, max_tokens: int | None = None,
             truncate: bool = True, on_step: Callable[[Step], None] | None = None
             ) -> Generation:
    """Generate up to ``max_new_tokens`` tokens after ``prompt`` and record their attention.

    Args:
        source: a model from :func:`load_causal_lm`.
        prompt: the text to continue.
        max_new_tokens: at most this many tokens (1 to :data:`MAX_NEW_TOKENS`); generation
            stops earlier at the model's end-of-sequence token.
        sample: sample from the model's distribution (its generation settings: temperature,
            top-k/top-p) instead of greedy decoding; ``seed`` makes it repeatable (a random
            seed is drawn and kept in ``meta["seed"]`` when ``None``).
        layers: model layers to record (``None``: all); ``heads`` likewise.
        max_tokens: a limit on the prompt's tokens; ``truncate`` cuts past it (else an error).
        on_step: called with each :class:`Step` as soon as its token is chosen (a live view);
            an exception it raises stops the generation and reaches the caller.

    Returns:
        The :class:`Generation`, rows ``[layer, head, step, key]``.

    Raises:
        UsageError: a bad count or seed, or prompt plus new tokens past the model's positions.
        InputError: an empty prompt or rows that would not fit in memory.
    """
    import torch

    check_max_new_tokens(max_new_tokens)
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)
                             or not 0 <= seed < 2**32):
        raise UsageError(f"the sampling seed must be a whole number from 0 to {2**32 - 1}, "
                         f"not {seed!r:.40}")
    if seed is not None and not sample:
        raise UsageError("a seed only applies to sampling (--sample): greedy decoding is "
                         "deterministic", "add --sample, or leave the seed out")
    modules = getattr(source, "attention_modules", None)
    enc, warnings = source.encode(prompt, None, max_tokens, truncate)
    prompt_length = int(enc["input_ids"].shape[1])
    limit = source.max_tokens
    if limit is not None and prompt_length + max_new_tokens > limit:
        raise UsageError(f"the prompt ({prompt_length} tokens) and --max-new-tokens "
                         f"{max_new_tokens} pass the {limit} positions of {source.name}",
                         prompt_fit_advice(limit, prompt_length, max_new_tokens))
    keep_layers, keep_heads = source._selection(layers, heads)
    size = 4 * len(keep_layers) * len(keep_heads) * max_new_tokens * (
        prompt_length + max_new_tokens)
    if size > MAX_ROW_BYTES:
        from attnviz.models._loading import _size

        raise InputError(f"the rows of {max_new_tokens} new tokens would take {_size(size)} "
                         f"({len(keep_layers)} layers x {len(keep_heads)} heads, float32), more "
                         f"than the bound of {_size(MAX_ROW_BYTES)}",
                         "record fewer layers or heads (--layers, --heads) or lower "
                         "--max-new-tokens")
    model = source.model
    if seed is None and sample:
        seed = int.from_bytes(os.urandom(4), "little")
    probed = getattr(source, "probed", None)
    recorder = _RowRecorder(prompt_length, modules, keep_layers, keep_heads,
                            source.num_layers, source.num_heads,
                            None if probed is None else not probed.rows_sum_to_one)
    inputs = {k: v.to(source.device) for k, v in enc.items()
              if k in ("input_ids", "attention_mask")}
    tokenizer = source.tokenizer
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else \
        tokenizer.eos_token_id
    options: dict[str, Any] = {"max_new_tokens": max_new_tokens, "do_sample": sample,
                               "cache_implementation": "dynamic", "pad_token_id": pad}
    if not sample:  # a model's own sampling settings would only raise warnings
        options.update(temperature=None, top_p=None, top_k=None)
    steps_out = None if on_step is None else _Steps(source, recorder,
                                                    enc["input_ids"][0].tolist(), on_step)
    if steps_out is not None:
        options["streamer"] = steps_out
    fork = torch.random.fork_rng(devices=[]) if sample else contextlib.nullcontext()
    with fork, torch.inference_mode(), recording(source, recorder):
        if sample:
            torch.manual_seed(seed if seed is not None else 0)
        try:
            output = model.generate(**inputs, **options)
        except _Raised as raised:  # on_step's own exception, as it raised it
            raise cast("BaseException", raised.__cause__) from None
        except (RuntimeError, ValueError, TypeError, IndexError, KeyError,
                AttributeError) as exc:
            text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            if "memory" in text.lower():
                raise InputError(f"generation with {source.name} ran out of memory "
                                 f"({text[:200]})", "lower --max-new-tokens, shorten the "
                                 "prompt or use --dtype bfloat16") from None
            raise ModelLoadError(f"generation with {source.name} failed: {text[:300]}",
                                 "try --dtype float32 or --device cpu") from None
    ids = [int(i) for i in output[0].tolist()]
    steps = len(ids) - prompt_length
    return _result(source, prompt, ids, prompt_length, recorder, keep_layers, keep_heads,
                   steps, {"sample": sample, "seed": seed, "warnings": warnings,
                           "max_new_tokens": max_new_tokens})


class _Raised(Exception):  # noqa: N818 - carries on_step's exception out of generate
    """``on_step`` raised (its exception is the ``__cause__``)."""


class _Steps:
    """A ``generate`` streamer that hands each new token, with its rows, to ``on_step``."""

    def __init__(self, source: HFSource, recorder: _RowRecorder, prompt: list[int],
                 on_step: Callable[[Step], None]) -> None:
        self.source = source
        self.recorder = recorder
        self.ids = list(prompt)
        self.tokens = _labels(source, self.ids)
        self.on_step = on_step
        self.started = False

    def put(self, value: torch.Tensor) -> None:
        if not self.started:  # generate hands over the prompt first
            self.started = True
            return
        for token_id in value.reshape(-1).tolist():
            step = len(self.ids) - self.recorder.prompt_length
            self.ids.append(int(token_id))
            self.tokens.append(_labels(self.source, self.ids[-2:])[-1])  # the one before
            # tells whether this one continues its word
            recorded = self.recorder.rows[step] if step < len(self.recorder.rows) else {}
            keys = len(self.ids) - 1
            rows = np.zeros((len(self.recorder.layers), len(self.recorder.heads), keys),
                            dtype=np.float32)
            for li, layer in enumerate(self.recorder.layers):
                if layer in recorded:
                    rows[li] = recorded[layer].cpu().numpy()
            try:
                self.on_step(Step(step=step, position=keys, token_id=int(token_id),
                                  tokens=list(self.tokens), rows=rows,
                                  layers=list(self.recorder.layers),
                                  heads=list(self.recorder.heads),
                                  num_layers=self.source.num_layers,
                                  num_heads=self.source.num_heads))
            except Exception as error:
                raise _Raised from error

    def end(self) -> None:
        return None


def _word_markers(source: HFSource) -> tuple[str, ...]:
    """The word-start markers (``Ġ``, ``▁``) the tokenizer's vocabulary uses (looked up
    once per model)."""
    cached = getattr(source, "_word_markers", None)
    if cached is None:
        try:
            vocab = list(source.tokenizer.get_vocab())
        except Exception:  # noqa: BLE001 - a tokenizer without a vocabulary listing
            vocab = []
        cached = tuple(m for m in ("\u0120", "\u2581") if any(t.startswith(m) for t in vocab))
        source._word_markers = cached  # type: ignore[attr-defined]
    return cached


def _labels(source: HFSource, ids: list[int]) -> list[str]:
    """Readable labels of token ids, as captures' tables show them: continuation pieces of a
    word marked (``un ·bel ·ie``). Generated ids have no word ids, so a piece is told by the
    tokenizer's own convention (WordPiece's ``##``; a BPE or SentencePiece piece without the
    word-start marker ``Ġ`` / ``▁`` that starts with a letter or digit)."""
    from attnviz.analysis.tokens import CONTINUATION_MARK
    from attnviz.capture_build import escape_controls

    names = [str(t) for t in source.tokenizer.convert_ids_to_tokens(ids)]
    specials = source.special_ids()
    special = [i in specials for i in ids]
    # Byte-level vocabularies hold ESC and the other control bytes: as their escapes
    # (``\x1b``), as a capture's display tokens, so no table or page can drive a terminal.
    shown = [escape_controls(t) for t in source.display_of(names, special)]
    model = getattr(getattr(source.tokenizer, "backend_tokenizer", None), "model", None)
    kind = type(model).__name__ if model is not None else ""
    prefix = str(getattr(model, "continuing_subword_prefix", None) or "##")
    markers = _word_markers(source)
    for i in range(1, len(names)):
        name = names[i]
        if special[i] or special[i - 1]:
            continue
        if kind == "WordPiece":
            piece = name.startswith(prefix)
        else:  # letters after letters, as shown (a newline "Ċ" shows as the escape "\\n")
            before = shown[i - 1]
            piece = (bool(markers) and not name.startswith(markers)
                     and shown[i][:1].isalnum() and before[-1:].isalnum()
                     and not before.startswith("\\"))
        if piece:
            shown[i] = CONTINUATION_MARK + shown[i]
    return shown


def _result(source: HFSource, prompt: str, ids: list[int], prompt_length: int,
            recorder: _RowRecorder, layers: list[int], heads: list[int], steps: int,
            meta: dict[str, Any]) -> Generation:
    """Check what the recorder saw against the tokens and build the record."""
    expected = set(range(source.num_layers))
    if steps > 0 and (recorder.step + 1 < steps or any(s != expected
                                                       for s in recorder.seen[:steps])):
        raise ModelLoadError(
            f"the attention of {source.name} ({source.model_type}) does not go through "
            "transformers' attention-function registry, so its rows cannot be recorded",
            "generate works with models that use AttentionInterface (GPT-2, Llama, Mistral, "
            "Qwen2 and most recent architectures)")
    keys = max(prompt_length + steps - 1, 0)
    rows = np.zeros((len(layers), len(heads), steps, keys), dtype=np.float32)
    for step in range(steps):
        for li, layer in enumerate(layers):
            row = recorder.rows[step][layer].cpu().numpy()
            rows[li, :, step, :row.shape[1]] = row
    tokenizer = source.tokenizer
    tokens = _labels(source, ids)
    eos = source.model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    meta = {**meta, "stopped": "end of sequence" if steps and ids[-1] in eos_ids
            else "max_new_tokens", "model_type": source.model_type,
            "dtype": str(source.dtype).replace("torch.", ""), "device": str(source.device),
            "kernel": str(getattr(source.model.config, "_attn_implementation", None)),
            "rows": "recomputed from each step's query and cached keys"}
    return Generation(prompt=prompt, text=str(tokenizer.decode(ids[prompt_length:],
                                                               skip_special_tokens=True)),
                      tokens=tokens, token_ids=ids, prompt_length=prompt_length, rows=rows,
                      layers=list(layers), heads=list(heads), num_layers=source.num_layers,
                      num_heads=source.num_heads, model=source.name, meta=meta)


__all__ = ["Generation", "MAX_NEW_TOKENS", "Step", "check_causal_lm", "generate", "load_causal_lm",
           "load_generation",
           "recording", "check_max_new_tokens"]
