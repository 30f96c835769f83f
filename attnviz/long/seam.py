"""The capture seam: record queries, keys and log-sum-exp while the model runs its own kernel.

transformers routes every attention call of a modern model through its attention-function
registry (``ALL_ATTENTION_FUNCTIONS``, keyed by ``config._attn_implementation``). For one
forward pass :func:`capture_long` registers a wrapper under a name of its own
(``attnviz-long-sdpa`` and so on), points the model's configurations at it, and puts them back
in ``finally``. The wrapper receives exactly what the kernel gets (queries and keys after
RoPE, before grouped-query expansion, the mask, ``scaling``, ``sliding_window``), records
them for the selected layers, computes each query row's log-sum-exp and then calls the
original function, so the model's outputs come from its own kernel (sdpa, flash or eager).
The mask function registered beside it is the base implementation's, so the model builds the
masks it always builds.
"""

from __future__ import annotations

import contextvars
import math
import shutil
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

import attnviz.long.kernels as kernels
import attnviz.long.scan as scan
from attnviz.errors import UsageError
from attnviz.long.record import (
    SIDECAR,
    STORAGE_DTYPES,
    LongCapture,
    LongUnsupported,
    check_summary,
    layer_file,
    to_storage,
    write_sidecar,
)
from attnviz.models._torch import routed_attention

_PREFIX = "attnviz-long-"
_ACTIVE: contextvars.ContextVar[_Recorder | None] = contextvars.ContextVar(
    "attnviz_long_recorder", default=None)
# Keyword arguments that change the scores in ways the weights here do not reproduce.
#: Largest difference from the exact log-sum-exp, on sampled rows, of a kernel's that is kept.
KERNEL_LSE_TOLERANCE = 5e-6
_UNSUPPORTED_KWARGS = {"softcap": "logit softcapping", "s_aux": "attention sinks (s_aux)",
                       "position_bias": "a relative position bias", "sinks": "attention sinks"}


@dataclass
class _Recorder:
    """What one forward pass records; the wrapper fills it layer by layer."""

    layers: list[int]
    folder: Path
    dtype: str
    budget: int
    calls: int = 0
    scales: dict[int, float] = field(default_factory=dict)
    windows: dict[int, int | None] = field(default_factory=dict)
    causal: bool | None = None
    num_kv_heads: int = 0
    head_dim: int = 0
    num_tokens: int = 0
    problem: str | None = None
    num_heads: int = 0  # the loaded model's heads per layer (0: not known)
    last_call: tuple[Any, Any, Any] = (None, None, None)  # module, query, key
    #: With a summary asked for: the key features, atlas block and top k of the scans.
    features: torch.Tensor | None = None
    block: int = 0
    k: int = 0
    scans: dict[int, scan.LayerScan] = field(default_factory=dict)
    #: Where each layer's log-sum-exp came from (the kernel's name, or the chunked pass).
    methods: dict[int, str] = field(default_factory=dict)
    #: Take the log-sum-exp from the fused kernel where it returns one.
    use_kernel: bool = True
    #: Called with (attention calls seen, calls the pass makes) as the forward goes on.
    progress: Callable[[int, int], None] | None = None

    @property
    def last(self) -> int:
        """The last layer recorded: the forward stops after it."""
        return max(self.layers)

    def record(self, module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               mask: torch.Tensor | None, scaling: float | None,
               kwargs: dict[str, Any]) -> tuple[bool, torch.Tensor | None]:
        """Record one attention call.

        Returns:
            Whether it was the last layer wanted, and the kernel's output ``[1, head, T, dim]``
            when the log-sum-exp came from the fused kernel (``None`` otherwise).
        """
        layer = self._layer_of(module, query, key)
        if layer is not None and self.progress is not None and layer <= self.last:
            self.progress(layer, self.last + 1)  # layers done before this one
        if layer is None or layer not in self.layers:
            return False, None
        for name, what in _UNSUPPORTED_KWARGS.items():
            if kwargs.get(name) is not None:
                raise LongUnsupported(f"layer {layer} uses {what}, which the long capture does "
                                      "not reproduce")
        if query.shape[0] != 1 or key.shape[0] != 1:
            raise LongUnsupported("the long capture takes one text at a time (batch size 1)")
        if query.shape[2] != key.shape[2]:
            raise LongUnsupported("the attention call had queries and keys of different "
                                  "lengths (a key/value cache or cross-attention)")
        heads, kv_heads = int(query.shape[1]), int(key.shape[1])
        _check_layout(layer, heads, kv_heads, int(query.shape[-1]), self)
        if kv_heads < 1 or heads % kv_heads:
            raise LongUnsupported(f"layer {layer} has {heads} query heads and {kv_heads} key "
                                  "heads, not a grouped-query layout")
        causal = kwargs.get("is_causal")
        if causal is None:
            causal = getattr(module, "is_causal", None)
        if causal is None:
            raise LongUnsupported(f"layer {layer}'s attention module does not say whether it "
                                  "is causal (no is_causal attribute)")
        window = kwargs.get("sliding_window")
        window = int(window) if window else None
        if window is not None and not causal:
            raise LongUnsupported("a sliding window in a bidirectional model is not supported")
        size = int(query.shape[2])
        if window is not None and window >= size:
            window = None  # the window covers the whole text: plain causal attention
        scale = float(scaling) if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
        _check_mask(mask, size, bool(causal), window, layer)
        q = _rounded(query[0].detach(), self.dtype)  # [head, T, dim] float32
        k = _rounded(key[0].detach(), self.dtype)  # [kv_head, T, dim] float32
        output: torch.Tensor | None = None
        if self.features is not None:  # everything derived, from the pass that finds the lse
            found = scan.scan_layer(q, k, scale, bool(causal), window,
                                    self.features.to(q.device), block=self.block,
                                    k=min(self.k, size), budget=self.budget)
            lse = found.lse
            self.scans[layer] = found
            self.methods[layer] = "summary scan"
        else:
            lse, output = self._kernel_lse(query, key, value, q, k, mask, scale, bool(causal),
                                           window, layer, float(kwargs.get("dropout") or 0.0))
        for kind, tensor in (("q", q), ("k", k), ("lse", lse)):
            array = tensor if kind == "lse" else to_storage(tensor, self.dtype)
            _write_npy(self.folder, layer_file(kind, layer), array)
        self.scales[layer] = scale
        self.windows[layer] = window
        if self.causal is not None and self.causal != bool(causal):
            raise LongUnsupported("the model mixes causal and bidirectional layers")
        self.causal = bool(causal)
        self.num_kv_heads, self.head_dim, self.num_tokens = kv_heads, int(query.shape[-1]), size
        return layer == self.last, output

    def _kernel_lse(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, scale: float,
                    causal: bool, window: int | None, layer: int, dropout: float
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layer's log-sum-exp ``[head, T]`` and the kernel's output: from the model's own
        fused kernel call where it returns one, else the exact chunked pass (output ``None``).

        The log-sum-exp must normalise the queries and keys as stored: when storing rounds
        them (a float32 model kept as bfloat16), the kernel runs once more on the rounded
        copies for it (one more kernel call, still a fraction of the chunked pass).
        """
        found = None
        if self.use_kernel and not dropout:
            found = kernels.kernel_attention(query.detach(), key.detach(), value.detach(), mask,
                                             scale, causal)
        if found is None:
            self.methods[layer] = "chunked"
            return kernels.lse_chunked(q, k, scale, causal, window, self.budget), None
        output, lse, name = found
        if not _stored_exactly(query.dtype, self.dtype):
            rounded = kernels.kernel_attention(q[None], k[None], k[None], mask, scale, causal)
            if rounded is None:  # pragma: no cover - the same kernel took the model's inputs
                self.methods[layer] = "chunked"
                return kernels.lse_chunked(q, k, scale, causal, window, self.budget), output
            lse = rounded[1]
        # The kernel's float32 rounding of large scores differs from the chunked pass's (the
        # weights are read back as exp(scale * q.k - lse) the chunked way): its log-sum-exp
        # is taken only where it agrees with the exact one on the rows most likely to differ.
        rows = kernels.sample_rows(q)
        exact = kernels.lse_rows(q, k, scale, causal, window, rows, self.budget)
        if float((lse[:, rows.to(lse.device)] - exact).abs().max()) > KERNEL_LSE_TOLERANCE:
            self.methods[layer] = "chunked"
            return kernels.lse_chunked(q, k, scale, causal, window, self.budget), output
        self.methods[layer] = name
        return lse, output

    def _layer_of(self, module: Any, query: torch.Tensor, key: torch.Tensor) -> int | None:
        """The layer of one attention call, counted in call order (the order of
        ``outputs.attentions``; ALBERT's one shared module is every layer); ``None`` for a
        module's second call with the very same queries and keys (differential attention runs
        each module twice for one set of weights)."""
        last, self.last_call = self.last_call, (module, query, key)
        if last[0] is module and last[1] is query and last[2] is key:
            return None
        self.calls += 1
        return self.calls - 1


def _stored_exactly(model_dtype: torch.dtype, dtype: str) -> bool:
    """Whether storing queries and keys of ``model_dtype`` as ``dtype`` keeps every value."""
    return dtype == "float32" or getattr(torch, dtype) == model_dtype


def _check_layout(layer: int, heads: int, kv_heads: int, head_dim: int,
                  recorder: _Recorder) -> None:
    """Refuse heads other than the loaded model's, and layers whose head layout differs from
    the layers recorded before them (a long capture holds one layout)."""
    if recorder.num_heads and heads != recorder.num_heads:
        raise LongUnsupported(f"layer {layer} runs {heads} query heads where the model returns "
                              f"{recorder.num_heads} heads of weights")
    if recorder.head_dim and (head_dim, kv_heads) != (recorder.head_dim,
                                                      recorder.num_kv_heads):
        raise LongUnsupported(
            f"layer {layer} has {kv_heads} key heads of size {head_dim} where the layers before "
            f"it have {recorder.num_kv_heads} of size {recorder.head_dim}: a long capture "
            "holds one head layout", "capture layers of each layout separately (--layers)")


def _rounded(tensor: torch.Tensor, dtype: str) -> torch.Tensor:
    """float32 copy of ``tensor`` as it will be stored (rounded to the 16-bit type first), so
    the log-sum-exp normalises exactly the weights that are read back."""
    if dtype != "float32":
        tensor = tensor.to(getattr(torch, dtype))
    return tensor.to(torch.float32).contiguous()


def _write_npy(folder: Path, name: str, array: torch.Tensor | np.ndarray) -> None:
    from attnviz.fileio import atomic_write

    data = array.detach().cpu().numpy() if isinstance(array, torch.Tensor) else array
    atomic_write(folder / name, lambda handle: np.save(handle, data, allow_pickle=False),
                 root=folder)


def _check_mask(mask: torch.Tensor | None, size: int, causal: bool, window: int | None,
                layer: int) -> None:
    """Check a few rows of the mask the kernel gets against the mask the weights assume.

    A mask is only passed when it cannot be skipped (a sliding window shorter than the text,
    or a bias); anything other than the causal/window pattern (an ALiBi or relative bias, a
    padding mask) cannot be reproduced from queries and keys alone.
    """
    if mask is None:
        return
    if mask.dim() != 4 or mask.shape[-1] < size or mask.shape[-2] < size:
        raise LongUnsupported(f"layer {layer} gets an attention mask of shape "
                              f"{tuple(mask.shape)}, which the long capture cannot read")
    rows = sorted({0, 1, size // 3, size // 2, size - 2, size - 1} & set(range(size)))
    picked = mask[0, :, rows, :size].to("cpu")  # [head or 1, rows, T]
    if picked.dtype == torch.bool:
        allowed = picked
    else:
        finite = picked.float()
        # Masked positions hold the dtype's minimum (or -inf), visible ones 0: any other
        # value is a bias the weights here would miss.
        allowed = finite > torch.finfo(finite.dtype).min / 2
        if bool((finite[allowed] != 0).any()):
            raise LongUnsupported(f"layer {layer} adds a position bias to its scores (ALiBi or "
                                  "relative positions), which the long capture does not "
                                  "reproduce")
    for n, row in enumerate(rows):
        line = torch.zeros(1, size)
        kernels.apply_mask(line, row, 0, causal, window)
        want = line[0] > kernels.MASKED_BELOW
        if not bool((allowed[:, n, :] == want).all()):
            raise LongUnsupported(f"layer {layer}'s attention mask is not the causal/window "
                                  "pattern the long capture assumes (padding or a custom mask)")


def _wrapper(base: str) -> Callable[..., Any]:
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, *args: Any, **kwargs: Any) -> Any:
        recorder = _ACTIVE.get()
        last, output = False, None
        if recorder is not None:
            scaling = kwargs.get("scaling", args[1] if len(args) > 1 else None)
            dropout = kwargs.get("dropout", args[0] if args else 0.0)
            answer = recorder.record(module, query, key, value, attention_mask, scaling,
                                     {**kwargs, "dropout": dropout})
            # (last layer?, kernel output); a recorder that only watches answers no tuple.
            last, output = answer if isinstance(answer, tuple) else (bool(answer), None)
        if base == "eager":
            # Each model file has its own eager function (GPT-2's and BERT's differ).
            original: Any = getattr(sys.modules[type(module).__module__],
                                    "eager_attention_forward", None)
            if original is None:
                raise LongUnsupported(f"{type(module).__name__} has no eager attention "
                                      "function to run")
        elif base == "sdpa":
            original = sdpa_attention_forward
        else:
            original = AttentionInterface._global_mapping[base]
        if last:
            from attnviz.models.hooks import StopForward

            raise StopForward
        if output is not None and base == "sdpa":
            # The very call sdpa_attention_forward makes; its layout is [batch, T, head, dim].
            return output.transpose(1, 2).contiguous(), None
        return original(module, query, key, value, attention_mask, *args, **kwargs)

    return attention


_REGISTERED: set[str] = set()


def _register(base: str) -> str:
    """Register the recording wrapper around ``base`` (once); returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    name = _PREFIX + base
    if name not in _REGISTERED:
        AttentionInterface.register(name, _wrapper(base))
        mask = cast(Callable[..., Any], AttentionMaskInterface._global_mapping[base])
        AttentionMaskInterface.register(name, mask)
        _REGISTERED.add(name)
    return name


def _base_implementation(hf_model: Any) -> str:
    """The kernel the capture runs: the model's own, or sdpa for a model loaded eager (the
    eager kernel builds each layer's ``T x T`` weights) when it supports sdpa."""
    from transformers import AttentionInterface

    config = getattr(hf_model.model, "config", None)
    if config is None:  # an encoder taken out of its model (FSMT) never reads the registry
        raise LongUnsupported(f"{hf_model.name} ({hf_model.model_type}) does not run its "
                              "attention through transformers' attention functions",
                              "capture it the usual way, with a shorter text")
    current = str(getattr(config, "_attn_implementation", None) or "eager")
    if current == "eager":
        return "sdpa" if getattr(hf_model, "_supports_sdpa", False) else "eager"
    if current.startswith(_PREFIX):
        current = current[len(_PREFIX):]
    if current != "sdpa" and current not in AttentionInterface._global_mapping:
        raise LongUnsupported(f"the model runs {current!r} attention, which the long capture "
                              "does not know")
    return current


#: Every configuration of a model pointed at one attention function (kept under this name for
#: :mod:`attnviz.long.generate`).
_routed = routed_attention


def capture_long(hf_model: Any, text: str, *, pair: str | None = None,
                 layers: list[int] | None = None, max_tokens: int | None = None,
                 dtype: str = "float32", folder: str | Path | None = None,
                 chunk_bytes: int = kernels.DEFAULT_CHUNK_BYTES, summary: bool = False,
                 block: int | None = None, k: int = 0,
                 progress: Callable[[int, int], None] | None = None,
                 use_kernel: bool = True) -> LongCapture:
    """Capture queries, keys and log-sum-exp of ``text`` while the model runs its own kernel.

    Args:
        hf_model: a loaded :class:`attnviz.models.hf.HFSource`.
        text: the input; ``pair`` an optional second sentence.
        layers: model layers to record (absolute or negative); all when ``None``.
        max_tokens: an extra limit on the number of tokens (longer texts are truncated, with
            a warning in ``meta["warnings"]``).
        dtype: how queries and keys are stored: ``float32``, ``float16`` or ``bfloat16``
            (log-sum-exp is always float32).
        folder: where the files go (created; a capture already there is replaced); a
            temporary folder removed with the capture when ``None``.
        chunk_bytes: bytes one chunk of scores may take.
        summary: also compute what :meth:`LongCapture.summarise` gives (statistics,
            attention received, the atlas at ``block`` and every head's top ``k``) in the
            same pass over the scores that finds the log-sum-exp, about twice as fast as
            capturing and then summarising; the files written are the same.
        block, k: the summary's atlas block and top keys per query (see
            :meth:`LongCapture.summarise`).
        progress: called with ``(layers done, layers the pass runs)`` as each layer's
            attention starts and once at the end (the forward stops after the last recorded
            layer).
        use_kernel: take each layer's log-sum-exp from the model's fused kernel call where
            it returns one (``meta["lse"]`` says, per recorded layer); ``False``: always the
            exact chunked pass.

    Returns:
        The :class:`LongCapture`, memory-mapped from ``folder``.

    Raises:
        LongUnsupported: the model cannot be captured this way (use ``hf_model.capture``).
        UsageError: a bad ``dtype``, layer, ``chunk_bytes``, ``block`` or ``k``.
        InputError: an empty text.
    """
    if dtype not in STORAGE_DTYPES:
        raise UsageError(f"invalid dtype {dtype!r} for a long capture: expected "
                         f"{', '.join(STORAGE_DTYPES)}")
    if chunk_bytes < 1 << 20:
        raise UsageError(f"chunk_bytes must be at least 1 MiB, got {chunk_bytes}")
    model = getattr(hf_model, "model", None)
    if model is None or not hasattr(hf_model, "encode"):
        raise UsageError("capture_long needs a Hugging Face model source (HFSource)")
    keep, _heads = hf_model._selection(layers, None)
    enc, warnings = hf_model.encode(text, pair, max_tokens, True)
    tokens, word_ids, special = hf_model.tokens_of(enc)
    display = hf_model.display_of(tokens, special)
    if not summary and (block is not None or k):
        raise UsageError("block and k describe a summary: pass summary=True with them")
    summary_block = check_summary(len(tokens), block, k)
    base = _base_implementation(hf_model)
    name = _register(base)
    temporary = folder is None
    from attnviz.capture_files import long_temp_folder
    from attnviz.fileio import ensure_dir, remove_file

    # Named after this process: once it is gone, the next --long command removes the folder.
    target = long_temp_folder() if folder is None else Path(folder)

    ensure_dir(target)
    # An old sidecar out first: a folder whose sidecar is there describes the arrays beside it.
    remove_file(target / SIDECAR, target)
    recorder = _Recorder(layers=sorted(keep), folder=target, dtype=dtype, budget=chunk_bytes,
                         num_heads=int(getattr(hf_model, "num_heads", 0) or 0),
                         use_kernel=use_kernel, progress=progress)
    if summary:
        recorder.block, recorder.k = summary_block, int(k)
        recorder.features = scan.key_features(display, special)
    token = _ACTIVE.set(recorder)
    try:
        _run(hf_model, enc, name)
        if progress is not None and recorder.layers:
            progress(recorder.last + 1, recorder.last + 1)
    except BaseException:
        if temporary:
            shutil.rmtree(target, ignore_errors=True)
        raise
    finally:
        _ACTIVE.reset(token)
    missing = [layer for layer in recorder.layers if layer not in recorder.scales]
    if missing:
        if temporary:
            shutil.rmtree(target, ignore_errors=True)
        raise LongUnsupported(
            f"{hf_model.name} ({hf_model.model_type}) does not run its attention through "
            f"transformers' attention functions (layer {missing[0]} was never seen)",
            "capture it the usual way, with a shorter text")
    meta: dict[str, Any] = {
        "source": "huggingface", "model_type": hf_model.model_type,
        "revision": hf_model.revision, "device": str(hf_model.device),
        "model_dtype": str(hf_model.dtype).replace("torch.", ""), "kernel": base,
        "lse": [recorder.methods[layer] for layer in recorder.layers],
        "warnings": warnings, "identity": hf_model.identity()}
    sidecar = {
        "model": hf_model.name, "text": text, "pair": pair, "tokens": tokens,
        "display_tokens": display, "word_ids": word_ids,
        "special": special, "layers": recorder.layers, "num_layers": hf_model.num_layers,
        "num_heads": hf_model.num_heads, "num_kv_heads": recorder.num_kv_heads,
        "head_dim": recorder.head_dim, "dtype": dtype, "causal": bool(recorder.causal),
        "scales": [recorder.scales[layer] for layer in recorder.layers],
        "windows": [recorder.windows[layer] for layer in recorder.layers], "meta": meta}
    write_sidecar(target, sidecar)
    capture = LongCapture.open(target)
    if summary:
        capture._summary = scan.build_summary(
            [recorder.scans[layer] for layer in recorder.layers], layers=recorder.layers,
            block=recorder.block, k=min(recorder.k, capture.num_tokens), model=capture.model,
            causal=capture.causal)
    if temporary:
        capture._cleanup = weakref.finalize(capture, shutil.rmtree, str(target), True)
    return capture


def _run(hf_model: Any, enc: Any, name: str) -> None:
    from attnviz.models.hooks import StopForward

    inputs = hf_model._model_inputs(enc)
    with torch.inference_mode(), _routed(hf_model.model, name):
        try:
            hf_model._call(inputs)
        except StopForward:
            pass
