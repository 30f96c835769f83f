"""The conformance census: every text model type of transformers' causal-LM, masked-LM and
seq2seq mappings, built tiny from its own configuration class, checked on every path.

For one model type, :func:`build` shrinks the default configuration (hidden size, layers,
heads, vocabulary), makes the attention far from uniform (query and key projections scaled
up) and saves the random model with the bundled MiniLM tokenizer. :func:`check` then loads
it back through attnviz's public paths (the full capture, the long path, generate for causal
language models, each measure) and compares every matrix with the same model's own eager
``outputs.attentions``: each path is ``equal`` (within 1e-5, a float64 rerun deciding where
float32 rounding is in question) or ``refused`` with attnviz's one-line message. Anything
else is a failure: ``wrong`` (a matrix that differs) or ``crash`` (an exception that is not
an :class:`~attnviz.errors.AttnvizError`).

A model that returns no weights is its own reference only in one case: it switched itself to
full attention (BigBird's ``block_sparse`` on a short text), and the same weights loaded with
full attention give the same output and real weights (see :func:`_switched_to_full`).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ATOL = 1e-5
TEXT = "The cat sat on the mat while the dog slept by the door"
PROMPT = "The cat sat on the mat"
NEW_TOKENS = 3
MEASURES = ("norm", "norm-res-ln", "alti", "value-zeroing")
PATHS = ("full", "long", "generate", *MEASURES)
VOCAB = 30522  # the bundled MiniLM tokenizer's
MAX_PARAMETERS = 30_000_000  # past this a "tiny" model is not small

#: The fast default set: representative families (encoders, decoders, grouped-query and
#: sliding-window decoders, encoder-decoders, band/local layouts, sinks, differential and
#: hybrid attention, 3-D attentions, multi-head latent attention, linear-attention hybrids).
#: The full sweep takes every type.
FAST_TYPES = ("bert", "gpt2", "llama", "qwen2", "mistral", "gemma", "phi3", "olmo", "t5",
              "bart", "longformer", "convbert", "gpt_oss", "deepseek_v4", "diffllama",
              "nemotron_h", "yoso", "longt5", "fsmt", "deepseek_v3", "qwen3_next")


def mappings() -> dict[str, list[str]]:
    """Model type -> the mappings it is in (``causal``, ``masked``, ``seq2seq``)."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
        MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
    )

    kinds: dict[str, list[str]] = {}
    for kind, names in (("causal", MODEL_FOR_CAUSAL_LM_MAPPING_NAMES),
                        ("masked", MODEL_FOR_MASKED_LM_MAPPING_NAMES),
                        ("seq2seq", MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES)):
        for name in names:
            kinds.setdefault(name, []).append(kind)
    return dict(sorted(kinds.items()))


# ----------------------------------------------------------------------------- building
# Sizes set wherever the configuration has the field (several names for one idea).
_SIZES: dict[str, int] = {
    "hidden_size": 32, "d_model": 32, "n_embd": 32, "dim": 32, "embed_dim": 32,
    "model_dim": 32, "n_embed": 32, "embedding_size": 32, "word_embed_proj_dim": 32,
    "num_hidden_layers": 2, "n_layer": 2, "num_layers": 2, "n_layers": 2,
    "encoder_layers": 2, "decoder_layers": 2, "num_decoder_layers": 2,
    "num_attention_heads": 4, "n_head": 4, "num_heads": 4, "n_heads": 4,
    "encoder_attention_heads": 4, "decoder_attention_heads": 4,
    "num_key_value_heads": 2, "n_kv_heads": 2, "num_kv_heads": 2,
    "intermediate_size": 64, "n_inner": 64, "ffn_dim": 64, "d_ff": 64,
    "encoder_ffn_dim": 64, "decoder_ffn_dim": 64, "hidden_dim": 64, "ffn_hidden_size": 64,
    "head_dim": 8, "d_kv": 8, "kv_channels": 8, "attention_head_size": 8,
    "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8, "q_lora_rank": 16,
    "kv_lora_rank": 16, "global_head_dim": 8, "head_size": 8, "rotary_dim": 4,
    "mamba_d_head": 16,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
    "n_shared_experts": 1, "moe_num_experts": 4, "num_shared_experts": 1, "n_group": 1,
    "topk_group": 1, "first_k_dense_replace": 1,
    "max_position_embeddings": 128, "n_positions": 128, "n_ctx": 128,
    "max_seq_len": 128, "seq_length": 128, "max_sequence_length": 128,
    "sliding_window": 8, "attention_window": 8, "local_window_size": 8,
    "vocab_size": 30522, "src_vocab_size": 30522, "tgt_vocab_size": 30522,
    "ssm_state_size": 8, "mamba_d_state": 8, "mamba_n_heads": 4, "mamba_head_dim": 16,
    "mamba_d_conv": 4, "mamba_expand": 2, "conv_kernel": 4, "state_size": 8,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
    "linear_value_head_dim": 8, "time_step_rank": 4,
}


#: ``ATTNVIZ_CONFORMANCE_SIZES=alt``: other sizes than the committed table's, to find what
#: depends on them (six heads over three key heads, three layers, a window of 5, a text of
#: about 40 tokens, more new tokens).
if os.environ.get("ATTNVIZ_CONFORMANCE_SIZES") == "alt":
    _SIZES.update({
        **dict.fromkeys(("hidden_size", "d_model", "n_embd", "dim", "embed_dim", "model_dim",
                         "n_embed", "embedding_size", "word_embed_proj_dim"), 48),
        **dict.fromkeys(("num_hidden_layers", "n_layer", "num_layers", "n_layers",
                         "encoder_layers", "decoder_layers", "num_decoder_layers"), 3),
        **dict.fromkeys(("num_attention_heads", "n_head", "num_heads", "n_heads",
                         "encoder_attention_heads", "decoder_attention_heads"), 6),
        **dict.fromkeys(("num_key_value_heads", "n_kv_heads", "num_kv_heads"), 3),
        **dict.fromkeys(("intermediate_size", "n_inner", "ffn_dim", "d_ff", "encoder_ffn_dim",
                         "decoder_ffn_dim", "hidden_dim", "ffn_hidden_size"), 96),
        "sliding_window": 5, "attention_window": 6, "local_window_size": 5,
    })
    TEXT = ("Once upon a time a small grey cat sat on the warm mat by the kitchen door, "
            "watching the rain fall on the garden while the old dog slept in the hall")
    PROMPT = "Once upon a time a small grey cat sat on the warm mat"
    NEW_TOKENS = 5
#: ``ATTNVIZ_CONFORMANCE_SIZES=mqa``: eight query heads over one key head, four layers (a
#: layer pattern's first four), a window of 3 and a 25-token text.
elif os.environ.get("ATTNVIZ_CONFORMANCE_SIZES") == "mqa":
    _SIZES.update({
        **dict.fromkeys(("num_hidden_layers", "n_layer", "num_layers", "n_layers",
                         "encoder_layers", "decoder_layers", "num_decoder_layers"), 4),
        **dict.fromkeys(("num_attention_heads", "n_head", "num_heads", "n_heads",
                         "encoder_attention_heads", "decoder_attention_heads"), 8),
        **dict.fromkeys(("num_key_value_heads", "n_kv_heads", "num_kv_heads"), 1),
        **dict.fromkeys(("head_dim", "d_kv", "kv_channels", "attention_head_size",
                         "head_size"), 4),
        "sliding_window": 3, "attention_window": 4, "local_window_size": 3,
    })
    TEXT = "A quick brown fox jumps over the lazy dog, and then the dog wakes up and barks"
    PROMPT = "A quick brown fox jumps over the lazy dog"
    NEW_TOKENS = 4

# Fields tied to the head size, left alone by the gentler tries (their sums must agree).
_HEAD_FIELDS = {"head_dim", "d_kv", "kv_channels", "attention_head_size", "qk_nope_head_dim",
                "qk_rope_head_dim", "v_head_dim", "q_lora_rank", "kv_lora_rank",
                "global_head_dim", "head_size", "num_key_value_heads", "n_kv_heads",
                "num_kv_heads", "sliding_window", "attention_window", "local_window_size",
                "rotary_dim"}
# The tries, smallest first: every size; then not the head layout (hidden 64); then layers,
# widths of the feed-forward and experts and the vocabulary only.
_TRIES: tuple[dict[str, int], ...] = (
    _SIZES,
    {**{k: v for k, v in _SIZES.items() if k not in _HEAD_FIELDS},
     **dict.fromkeys(("hidden_size", "d_model", "n_embd", "dim", "embed_dim", "model_dim",
                      "n_embed", "embedding_size", "word_embed_proj_dim"), 64)},
    {k: v for k, v in _SIZES.items() if k in {
        "num_hidden_layers", "n_layer", "num_layers", "n_layers", "encoder_layers",
        "decoder_layers", "num_decoder_layers", "intermediate_size", "n_inner", "ffn_dim",
        "d_ff", "encoder_ffn_dim", "decoder_ffn_dim", "moe_intermediate_size",
        "shared_expert_intermediate_size", "num_experts", "num_local_experts",
        "n_routed_experts", "num_experts_per_tok", "moe_num_experts", "vocab_size",
        "max_position_embeddings", "n_positions"}},
)


def _keep_attention(values: list[Any], layers: int) -> list[Any]:
    """The first ``layers`` of a hybrid's layer pattern, the last of them swapped for its
    first attention layer when there is none among them (Qwen3-Next's three linear layers
    before a full one, RecurrentGemma's two recurrent blocks before an attention block)."""
    names = [str(v).lower() for v in values]
    attention = [i for i, n in enumerate(names) if ("attention" in n or "attn" in n)
                 and not any(w in n for w in ("linear", "recurrent", "mamba", "conv"))]
    if not attention or attention[0] < layers:
        return values[:layers]
    return [*values[:layers - 1], values[attention[0]]]


def _shrink(config: Any, sizes: dict[str, int] = _SIZES) -> None:
    for name, value in sizes.items():
        try:
            current = getattr(config, name, None)
        except Exception:  # noqa: BLE001 - per-layer attributes refuse a global read
            continue
        if isinstance(current, int) and not isinstance(current, bool) and current > value:
            with contextlib.suppress(Exception):
                setattr(config, name, value)
    layers = next((getattr(config, n) for n in ("num_hidden_layers", "n_layer", "num_layers")
                   if isinstance(vars(config).get(n), int)), 2)
    for name, value in list(vars(config).items()):
        if name.endswith(("layer_types", "_pattern", "layers_block_type", "block_types",
                          "mlp_layer_types", "attention_layers")) and isinstance(value, list) \
                and len(value) > layers:
            # One layer of each kind where there are few kinds (a hybrid keeps its attention
            # layers), else the first layers.
            kinds = list(dict.fromkeys(str(v) for v in value))
            shorter = [value[[str(v) for v in value].index(k)] for k in kinds] \
                if len(kinds) <= 4 and name == "layers_block_type" else _keep_attention(
                    value, layers)
            with contextlib.suppress(Exception):
                setattr(config, name, shorter)
    if isinstance(vars(config).get("attn_layer_offset"), int) and \
            config.attn_layer_offset >= layers:  # Jamba: an attention layer among the first
        config.attn_layer_period, config.attn_layer_offset = layers, layers - 1
    if "qk_head_dim" in vars(config):  # multi-head latent attention derives it at init
        with contextlib.suppress(Exception):
            config.qk_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
    if "kv_lora_rank" in vars(config) and "num_key_value_heads" in vars(config):
        with contextlib.suppress(Exception):  # its keys are per query head (DeepSeek V2/V3)
            config.num_key_value_heads = config.num_attention_heads
    for name in ("vocab_size", "src_vocab_size", "tgt_vocab_size"):
        # The MiniLM tokenizer's ids must be in range (Blenderbot has 8008, ESM C 64).
        value = vars(config).get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value < VOCAB:
            with contextlib.suppress(Exception):
                setattr(config, name, VOCAB)
    for name in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id",
                 "sep_token_id", "cls_token_id"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value >= 30522:
            with contextlib.suppress(Exception):
                setattr(config, name, 0)
    for name in ("use_cache",):
        if hasattr(config, name):
            setattr(config, name, True)


_QK = re.compile(r"(^|[._])(q_proj|k_proj|query|key|q|k|wq|wk|q_a_proj|q_b_proj|kv_a_proj"
                 r"_with_mqa|kv_b_proj|c_attn|qkv_proj|Wqkv|query_key_value|qkv|in_proj|"
                 r"W_pack|q_lin|k_lin|k_proj_layer|q_proj_layer)([._]|$)")


def sharpen(model: Any, factor: float = 6.0) -> int:
    """Scale the query and key projections so the attention is far from uniform; returns how
    many weights were scaled."""
    import torch

    count = 0
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() == 2 and "embed" not in name and _QK.search(name):
                parameter.mul_(factor)
                count += 1
    return count


def _classes(kinds: list[str]) -> list[str]:
    """The head class to build: the whole encoder-decoder where there is one (BART's causal
    class is its decoder alone), else the causal or masked language model."""
    if "seq2seq" in kinds:
        return ["AutoModelForSeq2SeqLM"]
    if "causal" in kinds:
        return ["AutoModelForCausalLM"]
    return ["AutoModelForMaskedLM"]


@dataclass
class Built:
    """A tiny model saved to ``folder`` (or why it could not be built small)."""

    model_type: str
    kinds: list[str]
    folder: Path | None = None
    reason: str | None = None


def _try_build(model_type: str, kinds: list[str], sizes: dict[str, int]
               ) -> tuple[Any, str | None]:
    """The model built at ``sizes`` and run once eagerly, or ``None`` and why not."""
    import torch
    import transformers
    from transformers import CONFIG_MAPPING

    config = CONFIG_MAPPING[model_type]()
    parts = [config, *(vars(config).get(name) for name in ("text_config", "encoder", "decoder"))]
    try:
        for part in parts:
            if part is not None and hasattr(part, "to_dict"):
                _shrink(part, sizes)
    except Exception as exc:  # noqa: BLE001
        return None, f"its configuration does not take small sizes: {_one_line(exc)}"
    try:
        torch.manual_seed(0)
        auto = getattr(transformers, _classes(kinds)[0])
        with contextlib.redirect_stderr(io.StringIO()):
            model = auto.from_config(config, attn_implementation="eager")
    except Exception as exc:  # noqa: BLE001
        return None, f"transformers cannot build it small: {_one_line(exc)}"
    size = sum(p.numel() for p in model.parameters())
    if size > MAX_PARAMETERS:
        return None, (f"transformers builds it with {size / 1e6:.0f}M parameters at the "
                      "smallest sizes tried")
    ids = torch.tensor([[101, 1996, 4937, 2938, 2006, 1996, 13523, 102]])
    try:
        with torch.no_grad():
            inner = model.get_encoder() if getattr(model.config, "is_encoder_decoder",
                                                   False) else model
            try:
                inner.eval()(input_ids=ids, output_attentions=True, use_cache=False)
            except TypeError:  # no use_cache argument
                inner.eval()(input_ids=ids, output_attentions=True)
    except Exception as exc:  # noqa: BLE001
        return None, f"transformers cannot run it small: {_one_line(exc)}"
    return model, None


def build(model_type: str, kinds: list[str], folder: Path) -> Built:
    """Build, sharpen and save a tiny random ``model_type`` with the MiniLM tokenizer."""
    from transformers import CONFIG_MAPPING, AutoTokenizer

    from attnviz.models.hf import bundled_model_path

    result = Built(model_type, kinds)
    try:
        CONFIG_MAPPING[model_type]()
    except Exception as exc:  # noqa: BLE001 - a census records why
        result.reason = f"its configuration class does not build: {_one_line(exc)}"
        return result
    subs = [k for k in (getattr(CONFIG_MAPPING[model_type](), "sub_configs", None) or {})
            if any(w in k for w in ("vision", "audio", "speech", "image", "video"))]
    if subs:
        result.reason = f"not a text-only model (it has {', '.join(sorted(subs))})"
        return result
    tokenizer = AutoTokenizer.from_pretrained(bundled_model_path())
    tokenizer.model_max_length = 128
    reasons = []
    for sizes in _TRIES:
        model, why = _try_build(model_type, kinds, sizes)
        if model is None:
            reasons.append(why)
            continue
        sharpen(model)
        try:
            model.save_pretrained(folder)
            tokenizer.save_pretrained(folder)
        except Exception as exc:  # noqa: BLE001
            reasons.append(f"transformers cannot save it: {_one_line(exc)}")
            continue
        break
    else:
        result.reason = str(reasons[0])
        return result
    result.folder = folder
    return result


# ----------------------------------------------------------------------------- checking
@dataclass
class Result:
    """Per path: ``equal``, ``refused: <message>``, ``n/a: <why>``, ``wrong: ...``, or
    ``crash: ...``."""

    model_type: str
    kinds: list[str]
    built: str | None = None  # why it could not be built, or None
    paths: dict[str, str] = field(default_factory=dict)

    def failures(self) -> dict[str, str]:
        return {path: outcome for path, outcome in self.paths.items()
                if outcome.startswith(("wrong", "crash"))}


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}"[:300]


def _refusal(exc: BaseException) -> str:
    """``refused: ...`` for a clear AttnvizError; ``crash: ...`` for anything else."""
    from attnviz.errors import AttnvizError

    if isinstance(exc, AttnvizError):
        message, hint = str(exc.message).strip(), str(exc.hint or "").strip()
        if message and "\n" not in message and "Traceback" not in message:
            return f"refused: {message}" + (f" ({hint})" if hint and "\n" not in hint else "")
        return f"crash: an unclear refusal {message[:200]!r}"
    where = traceback.extract_tb(exc.__traceback__)
    inside = [f for f in where if "/attnviz/" in f.filename]
    spot = f" at {Path(inside[-1].filename).name}:{inside[-1].lineno}" if inside else ""
    return f"crash: {_one_line(exc)}{spot}"


def _reference(folder: Path, model_class: str, text: str, dtype: Any) -> tuple[Any, list[Any]]:
    """Input ids and the eager model's own attentions (one ``[head, query, key]`` array per
    returned layer, any shape), in ``dtype``."""
    import torch
    import transformers
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    enc = tokenizer(text, return_tensors="pt")

    def run(**overrides: Any) -> tuple[Any, tuple[Any, ...]]:
        model = getattr(transformers, model_class).from_pretrained(
            folder, attn_implementation="eager", dtype=dtype, **overrides).eval()
        if getattr(model.config, "is_encoder_decoder", False) and hasattr(model, "get_encoder"):
            model = model.get_encoder()
        with torch.no_grad():
            out = model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"],
                        output_attentions=True, return_dict=True)
        attentions = getattr(out, "attentions", None) or getattr(out, "encoder_attentions",
                                                                 None)
        return out[0], tuple(a for a in attentions or () if a is not None)

    states, attentions = run()
    if not attentions:
        attentions = _switched_to_full(folder, states, run)
    return enc["input_ids"], [a[0].double().numpy() for a in attentions]


def _switched_to_full(folder: Path, states: Any, run: Any) -> tuple[Any, ...]:
    """The reference of a model that returns no attention weights because it switched itself
    to full attention, or ``()`` (no reference) for any other model.

    BigBird configured with ``attention_type="block_sparse"`` runs full attention on a text
    shorter than its sparse pattern (``(5 + 2 * num_random_blocks) * block_size`` tokens: it
    logs "Changing attention type to 'original_full'"), and then, in transformers 5.24,
    returns an empty ``outputs.attentions``: the switch replaces the attention modules after
    the output recorders were attached. Its reference is the same saved weights loaded with
    ``attention_type="original_full"``, taken only when that model's output equals the
    configured model's (to :data:`ATOL`), so that both ran the same attention; otherwise the
    model has no reference, and a path that gives matrices for it is ``wrong``.
    """
    from transformers import AutoConfig

    kind = getattr(AutoConfig.from_pretrained(folder), "attention_type", None)
    if kind in (None, "original_full"):
        return ()
    full_states, attentions = run(attention_type="original_full")
    if full_states.shape != states.shape or \
            float((full_states - states).abs().max()) > ATOL:
        return ()
    return tuple(attentions)


def _square(reference: list[Any], size: int) -> list[Any] | None:
    """The reference as token x token matrices, or None when it is not one (extra key
    columns that carry weight, band layouts, 3-D weights)."""
    import numpy as np

    square = []
    for array in reference:
        if array.ndim != 3 or array.shape[1] != size or array.shape[2] < size:
            return None
        if array.shape[2] > size and float(np.abs(array[:, :, size:]).max()) > ATOL:
            return None
        square.append(array[:, :, :size])
    return square


def _compare(got: Any, want: list[Any], what: str) -> str:
    import numpy as np

    if want is None:
        return f"wrong: {what} gave a token x token matrix, but the model's own attention " \
               "is not one (extra key columns, a band layout or 3-D weights)"
    stacked = [np.asarray(w) for w in want]
    if len(got) != len(stacked):
        return f"wrong: {what} has {len(got)} layers, the model returns {len(stacked)}"
    worst = 0.0
    for layer, (mine, theirs) in enumerate(zip(got, stacked)):
        mine = np.asarray(mine, dtype=np.float64)
        if mine.shape != theirs.shape:
            return f"wrong: {what} layer {layer} has shape {mine.shape}, the model's " \
                   f"{theirs.shape}"
        worst = max(worst, float(np.abs(mine - theirs).max()))
    return "equal" if worst <= ATOL else f"wrong: {what} differs by {worst:.2g}"


def check(built: Built, paths: tuple[str, ...] = PATHS) -> Result:
    """Run every path of one built model and compare with its eager attentions."""
    result = Result(built.model_type, built.kinds, built.reason)
    if built.folder is None:
        return result
    folder = built.folder
    try:
        try:
            ids, reference = _reference(folder, "AutoModel", TEXT, None)
        except ValueError:  # no bare model class for it: the language model's own
            ids, reference = _reference(folder, _classes(built.kinds)[0], TEXT, None)
    except Exception as exc:  # noqa: BLE001 - a census records why
        result.built = f"transformers cannot run it small: {_one_line(exc)}"
        return result
    size = int(ids.shape[1])
    want = _square(reference, size)
    note = "the eager model returns no attention weights"
    session = _session()  # keeps the model warm from path to path
    for path in paths:
        if path == "generate" and "causal" not in built.kinds:
            result.paths[path] = "n/a: not a causal language model"
            continue
        try:
            outcome = _run_path(session, path, folder, want)
        except Exception as exc:  # noqa: BLE001
            outcome = _refusal(exc)
        if outcome == "equal" and not reference and path != "generate":
            outcome = f"wrong: a result where the eager model itself fails ({note})"
        if outcome.startswith("wrong") and path in ("full", "long", "generate"):
            outcome = _in_float64(session, path, folder, outcome)
        result.paths[path] = outcome
    return result


def _session() -> Any:
    from attnviz.session import Session

    return Session(use_cache=False)


def _run_path(session: Any, path: str, folder: Path, want: list[Any] | None) -> str:
    import numpy as np

    if path == "full" or path in MEASURES:
        measure = "weights" if path == "full" else path
        capture = session.capture(TEXT, model=str(folder), measure=measure)
        if path != "full":
            return _measure_outcome(capture, folder, measure)
        got = np.asarray(capture.weights, dtype=np.float64)
        if capture.weights.shape[0] != capture.num_layers or \
                capture.weights.shape[1] != capture.num_heads:
            return "wrong: the capture does not hold every layer and head"
        return _compare(list(got), want, "the full capture")
    if path == "long":
        cap = session.capture_long(TEXT, model=str(folder))
        got = [np.stack([cap.rows(layer, head, 0, cap.num_tokens)
                         for head in range(cap.num_heads)]) for layer in cap.layers]
        return _compare(got, want, "the long capture")
    if path == "generate":
        return _generate(session, folder)
    raise ValueError(path)


def _measure_outcome(capture: Any, folder: Path, measure: str) -> str:
    """A measure's numbers are checked against independent recomputations in
    ``tests/test_measures.py``; here it must give a finite capture of every layer and head
    (``works``), or refuse."""
    import numpy as np

    weights = np.asarray(capture.weights)
    if weights.shape[:2] != (capture.num_layers, capture.num_heads) or \
            not np.isfinite(weights).all():
        return f"wrong: the {measure} capture has shape {weights.shape} or non-finite values"
    return "works"


def _generate(session: Any, folder: Path) -> str:
    """Generate a few tokens, then compare each recorded row with the eager model's own
    attention over the generated sequence."""
    import numpy as np

    result = session.generate(PROMPT, model=str(folder), max_new_tokens=NEW_TOKENS)
    if result.steps == 0:
        return "equal"
    ids = result.token_ids
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, attn_implementation="eager").eval()
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids[:-1]]), output_attentions=True,
                    return_dict=True)
    size = len(ids) - 1
    reference = [a[0].double().numpy() for a in out.attentions if a is not None]
    square = _square(reference, size)
    if square is None:
        return "wrong: generate gave rows, but the model's own attention is not token x token"
    rows = np.asarray(result.rows, dtype=np.float64)  # [layer, head, step, key]
    if rows.shape[0] != len(square) or rows.shape[1] != square[0].shape[0]:
        return f"wrong: generate kept {rows.shape[:2]} layers x heads, the model has " \
               f"{(len(square), square[0].shape[0])}"
    first = result.prompt_length - 1
    worst = 0.0
    for layer, matrix in enumerate(square):
        want = matrix[:, first:first + rows.shape[2], :]
        worst = max(worst, float(np.abs(rows[layer] - want).max()))
    return "equal" if worst <= ATOL else f"wrong: generate differs by {worst:.2g}"


def _in_float64(session: Any, path: str, folder: Path, outcome: str) -> str:
    """Where float32 differs by more than the tolerance but less than 1e-3, rerun the path
    and the reference with the model in float64: float32 rounding when they then agree."""
    import torch

    found = re.search(r"differs by ([0-9.e+-]+)", outcome)
    if found is None or float(found.group(1)) > 1e-3 or path == "generate":
        return outcome
    source = session.source(str(folder))
    try:
        source.model.to(torch.float64)
        ids, reference = _reference(folder, "AutoModel", TEXT, torch.float64)
        rerun = _run_path(session, path, folder, _square(reference, int(ids.shape[1])))
    except Exception as exc:  # noqa: BLE001 - e.g. expert kernels that take no float64
        return f"{outcome} (no float64 rerun to decide: {_one_line(exc)})"
    finally:
        source.model.to(torch.float32)
    return "equal" if rerun == "equal" else outcome


@contextlib.contextmanager
def quiet() -> Any:
    """transformers' load reports and progress bars off while the census runs."""
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    import warnings

    with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        yield


def census(types: list[str] | None = None, root: Path | None = None,
           paths: tuple[str, ...] = PATHS) -> list[Result]:
    """Build and check every type (or ``types``); models are built under ``root``."""
    import tempfile

    kinds = mappings()
    chosen = list(kinds) if types is None else [t for t in types if t in kinds]
    results = []
    with tempfile.TemporaryDirectory(prefix="conformance-") as tmp:
        base = Path(root or tmp)
        for model_type in chosen:
            folder = base / model_type.replace("/", "_")
            with quiet():
                built = build(model_type, kinds[model_type], folder)
                results.append(check(built, paths))
    return results
