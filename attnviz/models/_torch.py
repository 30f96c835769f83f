"""Device and dtype choices shared by every model source."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from attnviz.errors import DeviceError, UsageError

if TYPE_CHECKING:
    import numpy as np
    import torch

DEVICE_CHOICES = "auto, cpu, cuda, cuda:N or mps"
DTYPES = ("float32", "float16", "bfloat16")
DTYPE_NAMES = (*DTYPES, "fp32", "fp16", "bf16")  # what --dtype accepts
# Accepted values of device_map (Accelerate's strategies).
DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")


def resolve_device(name: str = "auto") -> torch.device:
    """Turn ``auto|cpu|cuda|cuda:N|mps`` into a device that exists on this machine.

    ``auto`` picks CUDA when present, then MPS, then the CPU.

    Raises:
        UsageError: the name is not a device name.
        DeviceError: the device is not available here.
    """
    import torch

    name = (name or "auto").strip().lower()
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        mps = getattr(torch.backends, "mps", None)
        if mps is not None and mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if name == "cpu":
        return torch.device("cpu")
    match = re.fullmatch(r"cuda(?::(\d+))?", name)
    if match:
        if not torch.cuda.is_available():
            raise DeviceError(
                f"--device {name} was requested but CUDA is not available "
                f"(torch {torch.__version__} sees no CUDA GPU)",
                "use --device cpu (or --device auto), or install a CUDA build of torch",
            )
        index = int(match.group(1) or 0)
        count = torch.cuda.device_count()
        if index >= count:
            raise DeviceError(f"--device {name} does not exist: this machine has {count} "
                              f"CUDA device(s) (cuda:0..cuda:{count - 1})")
        return torch.device("cuda", index)
    if name == "mps":
        mps = getattr(torch.backends, "mps", None)
        if mps is None or not mps.is_available():
            raise DeviceError("--device mps was requested but Apple MPS is not available here",
                              "use --device cpu or --device auto")
        return torch.device("mps")
    raise UsageError(f"invalid --device {name!r}: expected {DEVICE_CHOICES}")


def resolve_dtype(name: str = "float32") -> torch.dtype:
    """Turn ``float32|float16|bfloat16`` into a torch dtype."""
    import torch

    table = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
             "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
    key = (name or "float32").strip().lower()
    if key not in table:
        raise UsageError(f"invalid --dtype {name!r}: expected one of {', '.join(DTYPES)}")
    return table[key]


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """float32 numpy copy of a tensor on any device and dtype."""
    import torch

    return tensor.detach().to(device="cpu", dtype=torch.float32).numpy()


def attention_configs(model: Any) -> list[Any]:
    """Every configuration object the model's attention code may read (no duplicates): the
    model's, its modules' and their sub-configurations, each holding ``_attn_implementation``.
    """
    found: dict[int, Any] = {}
    pending = [getattr(model, "config", None)]
    modules = getattr(model, "modules", None)
    if callable(modules):
        pending += [getattr(module, "config", None) for module in modules()]
    while pending:
        config = pending.pop()
        if config is None or id(config) in found or not hasattr(config, "_attn_implementation"):
            continue
        found[id(config)] = config
        for key in getattr(config, "sub_configs", None) or ():
            pending.append(getattr(config, key, None))
    return list(found.values())


@contextlib.contextmanager
def routed_attention(model: Any, name: str) -> Iterator[None]:
    """Point every configuration of ``model`` at the attention function ``name`` (``eager``,
    ``sdpa`` or one registered with transformers); restore them in ``finally``."""
    missing = object()
    configs = attention_configs(model)
    saved = [(config, config.__dict__.get("_attn_implementation_internal", missing))
             for config in configs]
    try:
        for config in configs:
            # The private field: the property setter validates names against the hub's list.
            config.__dict__["_attn_implementation_internal"] = name
        yield
    finally:
        for config, value in saved:
            if value is missing:
                config.__dict__.pop("_attn_implementation_internal", None)
            else:
                config.__dict__["_attn_implementation_internal"] = value
