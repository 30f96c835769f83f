"""Hugging Face models: the bundled MiniLM, any hub id, or a local folder.

Models are loaded with ``attn_implementation="eager"``: the fused ``sdpa`` kernels that
transformers uses by default never materialise the attention matrix, and then
``output_attentions=True`` gives ``None`` for every layer. Weights are read by forward hooks on
the selected layers only (:mod:`attnviz.models.hooks`); :meth:`HFSource.capture_batch` runs many
texts in padded batches; ``device_map="auto"`` spreads a big model with Accelerate.
"""

from __future__ import annotations

import contextlib
import inspect
import shutil
import tempfile
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from attnviz.capture import Capture, clean_token, guess_word_ids
from attnviz.errors import InputError, ModelLoadError, UsageError
from attnviz.models._loading import (  # noqa: F401 - bundled_model_path is re-exported
    _friendly_load_error,
    _hub_reachable,
    _quiet_logger,
    _size,
    _weights_fingerprint,
    bundled_model_path,
    memory_advice,
    unknown_warnings,
)
from attnviz.models._torch import DEVICE_MAPS

BUNDLED_NAME = "minilm"

# Errors transformers and huggingface_hub raise when a model cannot be found or read.
_LOAD_ERRORS: tuple[type[BaseException], ...] = (OSError, ValueError, KeyError, RuntimeError,
                                                 TypeError, AttributeError, ImportError)
try:  # transformers 5 validates config fields strictly (huggingface_hub's strict dataclasses)
    from huggingface_hub.errors import StrictDataclassError

    _LOAD_ERRORS += (StrictDataclassError,)
except ImportError:  # pragma: no cover - older huggingface_hub
    pass


class HFSource:
    """Captures attention from a Hugging Face model.

    Attention is read by forward hooks on the selected layers' attention modules
    (:mod:`attnviz.models.hooks`), so peak memory grows with the layers and heads kept, not
    with the model; models whose layers cannot be hooked fall back to ``output_attentions``.

    Args:
        name: ``"minilm"`` for the bundled model, a hub id, or a local folder.
        revision: a hub branch, tag or commit.
        trust_remote_code: allow the model's own Python code to run (off by default).
        device: ``auto|cpu|cuda|cuda:N|mps``.
        dtype: ``float32|float16|bfloat16``; captured weights are float32 whatever this is.
        device_map: ``auto`` (or ``balanced``, ``balanced_low_0``, ``sequential``) spreads the
            model over the GPUs, CPU memory and, past ``max_memory``, disk, with Hugging Face
            Accelerate. ``device`` must then stay ``auto``.
        max_memory: per-device budget for ``device_map``, e.g. ``{0: "10GiB", "cpu": "30GiB"}``.
        offload_folder: where weights that fit nowhere else go with ``device_map``; a temporary
            folder (removed at exit) by default.
        fused_other_layers: run the layers that are not captured with the fused ``sdpa``
            kernel, which never builds their attention matrices. The captured weights then
            differ from a pure eager run by about 1e-7; ``False`` makes them bit-identical to
            ``output_attentions=True``.
    """

    #: How the model is loaded: the bare model with eager attention (a subclass may ask for a
    #: language-model head and the model's fused kernel).
    _auto_class = "AutoModel"
    _attn_implementation: str | None = "eager"  # None: transformers' default (sdpa if it can)

    def __init__(self, name: str = BUNDLED_NAME, *, revision: str | None = None,
                 trust_remote_code: bool = False, device: str = "auto",
                 dtype: str = "float32", device_map: str | None = None,
                 max_memory: Mapping[int | str, int | str] | None = None,
                 offload_folder: str | Path | None = None,
                 fused_other_layers: bool = True) -> None:
        from attnviz.models._torch import resolve_device, resolve_dtype

        self.name = name
        if device_map is not None:
            device_map = device_map.strip().lower()
            if device_map not in DEVICE_MAPS:
                raise UsageError(f"invalid --device-map {device_map!r}: expected "
                                 f"{', '.join(DEVICE_MAPS)}")
            if (device or "auto").strip().lower() != "auto":
                raise UsageError("--device and --device-map cannot be combined",
                                 "use --device-map auto alone: it picks the devices")
        elif max_memory is not None:
            raise UsageError("max_memory needs a device map", "pass device_map=\"auto\" too")
        self.device_map = device_map
        self.max_memory = dict(max_memory) if max_memory is not None else None
        self.offload_folder = str(offload_folder) if offload_folder is not None else None
        self.fused_other_layers = fused_other_layers
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

    def _device_map_kwargs(self) -> dict[str, Any]:
        try:
            import accelerate  # noqa: F401 - transformers needs it for device_map
        except ImportError:
            raise ModelLoadError("--device-map needs Hugging Face Accelerate, which is not "
                                 "installed", "install it with: pip install accelerate") from None
        folder = self.offload_folder
        if folder is None:
            folder = tempfile.mkdtemp(prefix="attnviz-offload-")
            weakref.finalize(self, shutil.rmtree, folder, True)
        kwargs: dict[str, Any] = {"device_map": self.device_map, "offload_folder": folder}
        if self.max_memory is not None:
            kwargs["max_memory"] = self.max_memory
        return kwargs

    def _load(self, trust_remote_code: bool) -> None:
        import transformers
        from transformers import AutoConfig, AutoTokenizer

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
        load_kwargs: dict[str, Any] = {"config": config,
                                       "attn_implementation": self._attn_implementation,
                                       "dtype": self.dtype, **kwargs}
        quiet: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
        if self.device_map is not None:
            load_kwargs.update(self._device_map_kwargs())
            # Accelerate logs "Some parameters are on the meta device" for every offload.
            quiet = _quiet_logger("accelerate")
        try:
            with quiet:
                auto_class = getattr(transformers, self._auto_class)
                model = auto_class.from_pretrained(self.location, **load_kwargs)
        except _LOAD_ERRORS as exc:
            raise _friendly_load_error(self.name, exc, self.is_local) from None
        self._adopt(model, config)

    def _adopt(self, model: Any, config: Any, *, place: bool = True) -> None:
        """Read what a capture needs (shape, limits, attention modules) from a loaded model.

        Args:
            model: the loaded transformers model.
            config: its configuration.
            place: move the model to ``self.device`` and switch it to eval mode (models loaded
                here). ``False`` leaves a model someone else owns where and as it is
                (:mod:`attnviz.models.own`); its inputs then go to its embeddings' device.
        """
        from attnviz.models._shape import probe
        from attnviz.models.hooks import find_attention_modules

        self.config = config
        self._supports_sdpa = bool(getattr(model, "_supports_sdpa", False))
        self.hf_device_map: dict[str, Any] | None = getattr(model, "hf_device_map", None)
        self.encoder_decoder = bool(getattr(config, "is_encoder_decoder", False))
        if self.encoder_decoder and hasattr(model, "get_encoder"):
            model = model.get_encoder()  # self-attention of the encoder stack
        if not place or self.device_map is not None:
            self.device = _input_device(model)
        else:
            model = model.to(self.device)
        self.model = model.eval() if place else model
        self._forward_params = _parameters_of(model.forward)
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
        self.last_method = ""  # "hooks" or "output_attentions": how the last capture ran
        # Layers and heads as the model's own outputs have them, not as its config says.
        shape = self.probed = probe(self)
        if shape is not None and shape.problem is not None:
            raise ModelLoadError(shape.problem, _SHAPE_HINT)
        if shape is not None:
            self.num_layers, self.num_heads = shape.num_layers, shape.num_heads
        elif not self.num_layers or not self.num_heads:
            attentions = self.forward_attentions(self.tokenizer("Hello world",
                                                                return_tensors="pt"))
            self.num_layers, self.num_heads = len(attentions), int(attentions[0].shape[1])
        self.attention_modules = find_attention_modules(self.model, self.num_layers)

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

    # ------------------------------------------------------------------ tokens
    def _limit(self, max_tokens: int | None) -> tuple[int | None, str]:
        """The token limit in force and who sets it (for messages)."""
        if max_tokens is not None and (self.max_tokens is None or max_tokens < self.max_tokens):
            return max_tokens, "set by --max-tokens"
        return self.max_tokens, f"the limit for {self.name}"

    def _check_length(self, text: str, pair: str | None, limit: int | None, whose: str,
                      truncate: bool, what: str = "the text") -> list[str]:
        """Validate one input against the token limit; returns warnings about dropped tokens."""
        if not text.strip() or (pair is not None and not pair.strip()):
            raise InputError(f"{what} is empty", "give a sentence such as "
                             "\"The cat sat on the mat\"")
        length = len(self.tokenizer(text, pair, add_special_tokens=True)["input_ids"])
        content = len(self.tokenizer(text, pair, add_special_tokens=False)["input_ids"])
        if length == 0 or content == 0:
            raise InputError(f"{what} has no tokens for {self.name} besides special tokens",
                             "give visible words, e.g. \"The cat sat on the mat\"")
        specials = length - content
        needed = specials + (2 if pair is not None else 1)
        if limit is not None and limit < needed:
            raise UsageError(
                f"a limit of {limit} tokens ({whose}) leaves no room for the text: {self.name} "
                f"adds {specials} special tokens", f"use --max-tokens {needed} or more")
        if limit is None or length <= limit:
            return []
        if not truncate:
            raise InputError(
                f"{what} is {length} tokens long, more than the limit of {limit} tokens "
                f"({whose})",
                f"shorten the text{', raise --max-tokens,' if 'max-tokens' in whose else ''} or "
                f"pass --truncate to keep the first {limit} tokens")
        side = "last" if getattr(self.tokenizer, "truncation_side", "right") == "left" \
            else "first"  # the tokenizer decides which end it cuts
        return [f"{what} is {length} tokens long; kept the {side} {limit} tokens ({whose}), "
                f"dropped {length - limit}"]

    def encode(self, text: str, pair: str | None, max_tokens: int | None,
               truncate: bool = True) -> tuple[Any, list[str]]:
        """Tokenize one input; returns the encoding and any warnings (e.g. tokens dropped).

        Raises:
            InputError: the text is empty, or longer than the limit and ``truncate`` is off.
        """
        limit, whose = self._limit(max_tokens)
        warnings = self._check_length(text, pair, limit, whose, truncate)
        enc = self.tokenizer(text, pair, return_tensors="pt", return_special_tokens_mask=True,
                             truncation=bool(warnings), max_length=limit if warnings else None)
        if enc["input_ids"].shape[1] == 0:
            raise InputError("the text produced no tokens for this model")
        return enc, warnings

    def tokens_of(self, enc: Any, row: int = 0) -> tuple[list[str], list[int | None], list[bool]]:
        """Tokens, global word ids and special flags of one encoded row."""
        ids = enc["input_ids"][row].tolist()
        tokens = [str(t) for t in self.tokenizer.convert_ids_to_tokens(ids)]
        # The mask flags the specials the tokenizer added; one typed in the text ("[SEP]",
        # "<|endoftext|>") becomes the same id and is just as special.
        specials = self.special_ids()
        special = [bool(s) or i in specials
                   for s, i in zip(enc["special_tokens_mask"][row].tolist(), ids)]
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

    def special_ids(self) -> frozenset[int]:
        """Ids of the tokenizer's special tokens ([CLS], [SEP], <|endoftext|>, ...).

        The unknown-word token is left out unless it doubles as another special token (as
        GPT-2's <|endoftext|> does): it stands for a word the vocabulary lacks, not a marker.
        """
        cached: tuple[Any, frozenset[int]] | None = getattr(self, "_special_id_cache", None)
        if cached is not None and cached[0] is self.tokenizer:
            return cached[1]
        tokenizer = self.tokenizer
        ids = {int(i) for i in (getattr(tokenizer, "all_special_ids", None) or [])}
        unknown = getattr(tokenizer, "unk_token_id", None)
        named = {getattr(tokenizer, f"{name}_token_id", None)
                 for name in ("bos", "eos", "sep", "cls", "pad", "mask")}
        if unknown is not None and unknown not in named:
            ids.discard(int(unknown))
        self._special_id_cache = (tokenizer, frozenset(ids))
        return self._special_id_cache[1]

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

    # ------------------------------------------------------------------ forward passes
    def _model_inputs(self, enc: Any) -> dict[str, Any]:
        """The model's keyword arguments for an encoding (one row or a padded batch)."""
        inputs = {k: v.to(self.device) for k, v in enc.items()
                  if k in ("input_ids", "attention_mask", "token_type_ids")}
        if "token_type_ids" in inputs and self.model_type not in _TOKEN_TYPE_MODELS:
            inputs.pop("token_type_ids")
        mask = inputs.get("attention_mask")
        if (mask is not None and "position_ids" in self._forward_params
                and self.model_type not in _POSITIONS_FROM_IDS and bool((mask[:, 0] == 0).any())):
            # Left padding: count positions from each row's first real token, as in an
            # unpadded run (what generate() does).
            inputs["position_ids"] = (mask.long().cumsum(-1) - 1).clamp(min=0)
        if "use_cache" in self._forward_params:
            inputs["use_cache"] = False  # no key/value cache: nothing is generated
        return inputs

    def _call(self, inputs: dict[str, Any], output_attentions: bool = False) -> Any:
        from attnviz.models.hooks import StopForward

        extra = {"output_attentions": True} if output_attentions else {}
        try:
            return self.model(**inputs, **extra, return_dict=True)
        except StopForward:
            raise
        except (RuntimeError, ValueError, TypeError, IndexError) as exc:
            text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            if "memory" in text.lower():
                raise InputError(
                    f"the forward pass of {self.name} ran out of memory ({text[:200]})",
                    "select fewer layers or heads (--layers, --heads), shorten the input "
                    "(--max-tokens), use --dtype bfloat16, or --device-map auto") from None
            raise ModelLoadError(f"the forward pass of {self.name} failed: {text[:300]}",
                                 "try --dtype float32 or --device cpu") from None

    def forward_attentions(self, enc: Any) -> tuple[torch.Tensor, ...]:
        """Run the model with ``output_attentions``; one ``(batch, head, query, key)`` per layer.

        This keeps every layer's weights at once; :meth:`capture` keeps only what it is asked
        for.
        """
        with torch.inference_mode():
            return self._attentions_of(self._call(self._model_inputs(enc),
                                                  output_attentions=True))

    def _attentions_of(self, outputs: Any) -> tuple[torch.Tensor, ...]:
        attentions = getattr(outputs, "attentions", None)
        if attentions is None:
            attentions = getattr(outputs, "encoder_attentions", None)
        if not attentions or any(a is None for a in attentions):
            raise ModelLoadError(
                f"{self.name} did not return attention weights (model type {self.model_type})",
                "attnviz needs a transformer that supports output_attentions with eager attention",
            )
        return tuple(attentions)

    def _run(self, enc: Any, layers: list[int], heads: list[int] | None,
             sink: Callable[[int, torch.Tensor], None]) -> None:
        """One forward pass handing each selected layer's ``[batch, head, query, key]`` to sink.

        Hooks first; if the hooked modules do not return weights that look like a softmax,
        the model is marked as not hookable and ``output_attentions`` is used from then on.
        """
        from attnviz.models._shape import describe

        if not layers:
            return
        inputs = self._model_inputs(enc)
        modules = self.attention_modules
        if modules is not None:
            fused = self.fused_other_layers and self._supports_sdpa
            try:
                recording = self._hooked_pass(modules, inputs, layers, heads, sink, fused)
            except ModelLoadError:
                if not fused:
                    raise
                # Some attention variants are eager-only; run every layer eagerly instead.
                self.fused_other_layers = False
                recording = self._hooked_pass(modules, inputs, layers, heads, sink, False)
            if recording.complete:
                self.last_method = "hooks"
                return
            self.attention_modules = None  # not hookable: do not try again
        self.last_method = "output_attentions"
        with torch.inference_mode():
            attentions = self._attentions_of(self._call(inputs, output_attentions=True))
            shape = describe(attentions, int(inputs["input_ids"].shape[1]), self.name)
            if shape is not None and shape.problem is None and (
                    shape.num_layers != self.num_layers or shape.num_heads != self.num_heads):
                shape.problem = (f"{self.name} returned {shape.num_layers} layers of "
                                 f"{shape.num_heads} heads, not the {self.num_layers} x "
                                 f"{self.num_heads} it had when loaded")
            if shape is not None and shape.problem is not None:
                raise ModelLoadError(shape.problem, _SHAPE_HINT)
            for layer in layers:
                weights = attentions[layer]
                if heads is not None:
                    weights = weights[:, heads]
                sink(layer, weights)

    def _hooked_pass(self, modules: list[torch.nn.Module], inputs: dict[str, Any],
                     layers: list[int], heads: list[int] | None,
                     sink: Callable[[int, torch.Tensor], None], fused: bool) -> Any:
        from attnviz.models.hooks import StopForward, record_attention

        with torch.inference_mode(), record_attention(
                modules, layers, heads, sink, num_heads=self.num_heads,
                # Accelerate's offload hooks must see every block finish.
                stop_after_last=self.hf_device_map is None,
                fused_other_layers=fused) as recording:
            try:
                self._call(inputs)
            except StopForward:
                pass
        return recording

    # ------------------------------------------------------------------ capture
    def _selection(self, layers: Sequence[int] | None,
                   heads: Sequence[int] | None) -> tuple[list[int], list[int]]:
        from attnviz.selection import resolve_index

        keep_layers = (list(range(self.num_layers)) if layers is None else list(dict.fromkeys(
            resolve_index(int(i), self.num_layers, "layer") for i in layers)))
        keep_heads = (list(range(self.num_heads)) if heads is None else list(dict.fromkeys(
            resolve_index(int(i), self.num_heads, "head") for i in heads)))
        return keep_layers, keep_heads

    def _fill(self, enc: Any, layers: list[int], heads: list[int], arrays: list[np.ndarray],
              spans: list[tuple[int, int]]) -> list[bool]:
        """Run the model and copy row ``i``'s span into ``arrays[i]``; returns causal flags.

        Args:
            enc: the encoding, ``B`` rows.
            layers: model layers to capture.
            heads: heads to keep.
            arrays: per row, ``[layer, head, query, key]`` arrays to fill (RAM or memory-map).
            spans: per row, the ``(start, stop)`` positions of its real (unpadded) tokens.
        """
        from attnviz.models._torch import to_numpy
        from attnviz.models.hooks import is_causal_block

        positions = {layer: i for i, layer in enumerate(layers)}
        causal: list[bool | None] = [None] * len(arrays)

        def sink(layer: int, weights: torch.Tensor) -> None:  # [batch, head, query, key]
            for row, (array, (start, stop)) in enumerate(zip(arrays, spans)):
                block = weights[row, :, start:stop, start:stop]  # [head, query, key]
                if causal[row] is None:
                    # Masking is a property of the model: one layer tells (and a full check of
                    # every layer would read every matrix again).
                    causal[row] = is_causal_block(block)
                array[positions[layer]] = to_numpy(block)

        every_head = heads == list(range(self.num_heads))
        self._run(enc, layers, None if every_head else heads, sink)
        return [bool(flag) and stop - start > 1 for flag, (start, stop) in zip(causal, spans)]

    def _check_memory(self, shapes: Sequence[tuple[int, ...]], measure: str = "weights"
                      ) -> None:
        """Refuse a capture that cannot fit in free memory, before running the model."""
        try:
            import psutil
        except ImportError:  # pragma: no cover - psutil comes with accelerate
            return
        needed = sum(4 * int(np.prod(shape)) for shape in shapes)
        available = int(psutil.virtual_memory().available)
        if needed <= 0.9 * available:
            return
        layers, heads, tokens = shapes[0][0], shapes[0][1], max(s[-1] for s in shapes)
        what = "this capture" if measure == "weights" else f"--measure {measure}"
        raise InputError(
            f"{what} needs {_size(needed)} ({layers} layers x {heads} heads x "
            f"{tokens}x{tokens} values, float32) but only {_size(available)} of memory is free",
            memory_advice(shapes, int(0.9 * available), measure))

    def _make_capture(self, text: str, pair: str | None, tokens: list[str],
                      word_ids: list[int | None], special: list[bool], weights: np.ndarray,
                      layers: list[int], heads: list[int], causal: bool,
                      warnings: list[str]) -> Capture:
        warnings = [*warnings, *unknown_warnings(self, text, pair, tokens, special)]
        meta: dict[str, Any] = {
            "source": "huggingface", "model_type": self.model_type, "revision": self.revision,
            "dtype": str(self.dtype).replace("torch.", ""), "device": str(self.device),
            "warnings": warnings, "method": self.last_method}
        if self.hf_device_map is not None:
            meta["device_map"] = sorted({str(v) for v in self.hf_device_map.values()})
        return Capture(
            tokens=tokens, word_ids=word_ids, special=special, weights=weights,
            layers=list(layers), heads=list(heads), num_layers=self.num_layers,
            num_heads=self.num_heads, model=self.name, causal=causal, text=text, pair=pair,
            display_tokens=self.display_of(tokens, special), meta=meta)

    def capture(self, text: str, pair: str | None = None, *, layers: list[int] | None = None,
                heads: list[int] | None = None, max_tokens: int | None = None,
                truncate: bool = True, allocate: Allocator | None = None,
                measure: str = "weights") -> Capture:
        """Run the model on ``text`` (and ``pair``) and return the capture.

        Args:
            text: the input text.
            pair: an optional second sentence (BERT-style sentence pair).
            layers: model layers to keep (absolute or negative indices); all when ``None``.
            heads: heads to keep; all when ``None``.
            max_tokens: an extra limit on the number of tokens.
            truncate: drop tokens past the limit with a warning; ``False`` raises instead.
            allocate: called with the shape ``[layer, head, query, key]`` once the tokens are
                known; returns the array to fill (e.g. a float16 memory-map, see
                :mod:`attnviz.stream`). Each layer is written as soon as it has run. Default:
                a float32 array in memory.
            measure: ``weights`` (attention), or a measure of :mod:`attnviz.measures`
                computed after the usual pass and kept with the same selection.

        Raises:
            InputError: empty or too long text, or a capture bigger than free memory.
            ModelLoadError: the forward pass failed or returned no weights.
        """
        from attnviz.measures import check_supported
        from attnviz.models._measure import fill_measure, measure_meta

        measure = check_supported(measure, self.config)  # before the pass: a model type it fits
        enc, warnings = self.encode(text, pair, max_tokens, truncate)
        keep_layers, keep_heads = self._selection(layers, heads)
        size = int(enc["input_ids"].shape[1])
        shape = (len(keep_layers), len(keep_heads), size, size)
        # A measure is computed for every layer and head before the selection is kept.
        every = [(self.num_layers, self.num_heads, size, size)] if measure != "weights" else []
        if allocate is None:
            self._check_memory([*every, shape], measure)  # the message names the larger
            weights = np.empty(shape, dtype=np.float32)
        else:
            self._check_memory(every, measure)
            weights = allocate(shape)
        (causal,) = self._fill(enc, keep_layers, keep_heads, [weights], [(0, size)])
        if measure != "weights":
            fill_measure(measure, self.model, self._model_inputs(enc), self.config,
                         keep_layers, keep_heads, weights, name=self.name)
        tokens, word_ids, special = self.tokens_of(enc)
        capture = self._make_capture(text, pair, tokens, word_ids, special, weights,
                                     keep_layers, keep_heads, causal, warnings)
        capture.meta.update(measure_meta(measure))
        return capture

    def capture_batch(self, texts: Sequence[str], pairs: Sequence[str | None] | None = None, *,
                      batch_size: int = 8, layers: list[int] | None = None,
                      heads: list[int] | None = None, max_tokens: int | None = None,
                      truncate: bool = True, padding_side: str = "right",
                      measure: str = "weights") -> list[Capture]:
        """Capture many texts, ``batch_size`` at a time; one capture per text, in order.

        Each capture equals the unbatched :meth:`capture` of its text within 1e-5: padded
        positions are masked in the model and cut from the result. See :meth:`iter_captures`.
        """
        return list(self.iter_captures(texts, pairs, batch_size=batch_size, layers=layers,
                                       heads=heads, max_tokens=max_tokens, truncate=truncate,
                                       padding_side=padding_side, measure=measure))

    def iter_captures(self, texts: Sequence[str], pairs: Sequence[str | None] | None = None, *,
                      batch_size: int = 8, layers: list[int] | None = None,
                      heads: list[int] | None = None, max_tokens: int | None = None,
                      truncate: bool = True, padding_side: str = "right",
                      measure: str = "weights") -> Iterator[Capture]:
        """Yield one capture per text, in input order, running the model in padded batches.

        Every text is checked (empty, too long) before the first batch runs. Texts are sorted
        by length within windows of ``4 * batch_size`` so that a batch holds texts of similar
        length (less padding); only one window of captures is held at a time.

        Args:
            texts: the inputs.
            pairs: an optional second sentence per text (``None`` entries allowed).
            batch_size: texts per forward pass.
            layers, heads, max_tokens, truncate: as in :meth:`capture`.
            padding_side: ``right`` or ``left``. Left padding passes each row's own position
                ids; models that take none, or derive them from the padding token (RoBERTa),
                are padded on the right instead. Both give the same weights.
            measure: as in :meth:`capture`; a measure other than weights runs text by text
                (its computation takes one unpadded text).

        Raises:
            UsageError: bad ``batch_size``, ``padding_side`` or ``pairs`` length.
            InputError: a text is empty or too long (the message says which).
        """
        texts = list(texts)
        pair_list: list[str | None] = [None] * len(texts) if pairs is None else list(pairs)
        if len(pair_list) != len(texts):
            raise UsageError(f"got {len(texts)} texts but {len(pair_list)} pairs")
        if batch_size < 1:
            raise UsageError(f"--batch-size must be at least 1, got {batch_size}")
        if padding_side not in ("left", "right"):
            raise UsageError(f"invalid padding side {padding_side!r}: expected left or right")
        if padding_side == "left" and ("position_ids" not in self._forward_params
                                       or self.model_type in _POSITIONS_FROM_IDS):
            padding_side = "right"  # right padding never moves a real token's position
        from attnviz.measures import check_measure

        if check_measure(measure) != "weights":  # every text checked before the first runs
            _ = [self._check_length(t, p, *self._limit(max_tokens), truncate)
                 for t, p in zip(texts, pair_list)]
            yield from (self.capture(t, p, layers=layers, heads=heads, max_tokens=max_tokens,
                                     truncate=truncate, measure=measure)
                        for t, p in zip(texts, pair_list))
            return
        keep_layers, keep_heads = self._selection(layers, heads)
        limit, whose = self._limit(max_tokens)
        count = len(texts)
        warnings = [self._check_length(text, pair, limit, whose, truncate,
                                       what=f"text {i + 1} of {count}" if count > 1 else "the text")
                    for i, (text, pair) in enumerate(zip(texts, pair_list))]
        lengths = [len(self.tokenizer(t, p, truncation=limit is not None,
                                      max_length=limit)["input_ids"])
                   for t, p in zip(texts, pair_list)]
        window = 4 * batch_size
        for start in range(0, count, window):
            indices = range(start, min(count, start + window))
            order = sorted(indices, key=lambda i: (pair_list[i] is not None, lengths[i]))
            done: dict[int, Capture] = {}
            batch: list[int] = []
            for i in order:
                if batch and (len(batch) == batch_size
                              or (pair_list[batch[0]] is None) != (pair_list[i] is None)):
                    done.update(self._capture_rows(batch, texts, pair_list, warnings, limit,
                                                   keep_layers, keep_heads, padding_side))
                    batch = []
                batch.append(i)
            if batch:
                done.update(self._capture_rows(batch, texts, pair_list, warnings, limit,
                                               keep_layers, keep_heads, padding_side))
            for i in indices:
                yield done.pop(i)

    def _ensure_pad_token(self) -> None:
        """GPT-2-style tokenizers have no pad token; padded positions are masked, so any works."""
        tokenizer = self.tokenizer
        if tokenizer.pad_token is not None:
            return
        self.special_ids()  # before a stand-in pad token joins the tokenizer's specials
        for candidate in (tokenizer.eos_token, tokenizer.unk_token, tokenizer.bos_token):
            if candidate is not None:
                tokenizer.pad_token = candidate
                return
        tokenizer.pad_token = tokenizer.convert_ids_to_tokens(0)

    def _capture_rows(self, indices: list[int], texts: list[str], pairs: list[str | None],
                      warnings: list[list[str]], limit: int | None, layers: list[int],
                      heads: list[int], padding_side: str) -> dict[int, Capture]:
        """Capture the texts at ``indices`` in one padded forward pass."""
        self._ensure_pad_token()
        batch_pairs = [pairs[i] for i in indices] if pairs[indices[0]] is not None else None
        enc = self.tokenizer([texts[i] for i in indices], batch_pairs, padding=True,
                             padding_side=padding_side, truncation=limit is not None,
                             max_length=limit, return_tensors="pt",
                             return_special_tokens_mask=True)
        mask = enc["attention_mask"]
        spans = []
        for row in range(len(indices)):
            real = mask[row].nonzero().flatten().tolist()
            start, stop = (real[0], real[-1] + 1) if real else (0, 0)
            if stop - start != len(real) or not real:
                raise ModelLoadError(f"the tokenizer of {self.name} padded a text inside it",
                                     "capture the texts one by one")
            spans.append((start, stop))
        shapes = [(len(layers), len(heads), stop - start, stop - start) for start, stop in spans]
        self._check_memory(shapes)
        arrays = [np.empty(shape, dtype=np.float32) for shape in shapes]
        causal = self._fill(enc, layers, heads, arrays, spans)
        captures = {}
        for row, i in enumerate(indices):
            start, stop = spans[row]
            tokens, word_ids, special = self.tokens_of(enc, row)
            captures[i] = self._make_capture(
                texts[i], pairs[i], tokens[start:stop], word_ids[start:stop],
                special[start:stop], arrays[row], layers, heads, causal[row], warnings[i])
        return captures


_SHAPE_HINT = ("attnviz works with models whose attention weights are token x token in every "
               "layer: BERT, RoBERTa, GPT-2, Llama, Mistral, Qwen, Gemma, Phi, T5, BART...")

# Models that compute position ids from input_ids and the padding index themselves.
_POSITIONS_FROM_IDS = {"roberta", "xlm-roberta", "xlm-roberta-xl", "camembert", "longformer",
                       "luke", "data2vec-text", "ibert", "mpnet", "esm"}

# Called with a [layer, head, query, key] shape; returns the array a capture is written into.
Allocator = Callable[[tuple[int, int, int, int]], np.ndarray]


def _input_device(model: Any) -> torch.device:
    """Where a dispatched model (device_map) wants its inputs: the embeddings' device."""
    try:
        embeddings = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        embeddings = None
    hook = getattr(embeddings, "_hf_hook", None)
    device = getattr(hook, "execution_device", None)
    if device is not None:
        return torch.device(f"cuda:{device}" if isinstance(device, int) else device)
    weight = getattr(embeddings, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.device.type != "meta":
        return weight.device
    return torch.device("cpu")


def _parameters_of(function: Callable[..., Any]) -> set[str]:
    try:
        return set(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return set()


_TOKEN_TYPE_MODELS = {"bert", "albert", "electra", "xlnet", "funnel", "layoutlm", "mobilebert",
                      "squeezebert", "ernie", "nezha", "roc_bert", "megatron-bert", "big_bird",
                      "convbert", "rembert", "splinter", "canine", "mpnet", "deberta", "deberta-v2"}


def _first_attr(obj: object, names: tuple[str, ...], default: Any) -> Any:
    for name in names:
        value = getattr(obj, name, None)
        if value is not None:
            return value
    return default
