"""``value-zeroing``: Mohebbi et al. (2023), "Quantifying Context Mixing in Transformers" (EACL).

For layer ``l`` and every token ``j``: set token ``j``'s value vector to zero (in every head,
bias included), rerun layer ``l`` on its real input and compare each token's output with the
original by cosine distance::

    vz[i, j] = (1 - cos(h_i, h_i^(not j))) / sum_k (1 - cos(h_i, h_i^(not k)))

``h_i`` is the whole layer's output (after the feed-forward block and, in BERT, both
LayerNorms), as in the reference code. Rows sum to 1 (a row that no zeroing moves stays 0); in a
causal model the upper triangle is 0. The measure is defined per layer (the reference zeroes a
token's value in all heads at once): the one ``[query, key]`` matrix is repeated for every
head. Each layer is rerun from a float64 copy of itself, ``tokens`` times (in batches of zeroed
copies), so the cost is ``layers * tokens`` layer passes over ``tokens`` tokens.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, cast

from attnviz.measures._collect import (
    CHUNK_BYTES,
    Adapter,
    LayerRecord,
    adapter_for,
    collect,
    layers_of,
    mismatch_error,
    per_layer,
    relative_mismatch,
    value_columns,
)

if TYPE_CHECKING:
    import torch
    from torch import nn

def _row(value: Any, row: int, batch: int) -> Any:
    """``value`` for one batch row, floating tensors in float64 (tuples and lists followed).

    A key/value cache becomes ``None``: a rerun must neither read nor extend it.
    """
    import torch

    if type(value).__name__.endswith("Cache"):
        return None
    if isinstance(value, torch.Tensor):
        if batch > 1 and value.dim() >= 2 and value.shape[0] == batch:
            value = value[row:row + 1]
        return value.to(torch.float64) if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        return type(value)(_row(item, row, batch) for item in value)
    return value


@contextlib.contextmanager
def _zeroing(module: nn.Module, columns: tuple[int, int],
             positions: list[int]) -> Iterator[None]:
    """Zero the value vector (output ``columns`` of the value module) of ``positions[c]`` in
    copy ``c`` of the batch (all heads)."""
    import torch

    start, stop = columns

    def hook(_module: nn.Module, _args: Any, output: torch.Tensor) -> torch.Tensor:
        output = output.clone()
        rows = torch.arange(len(positions), device=output.device)
        tokens = torch.tensor(positions, device=output.device)
        output[rows, tokens, start:stop] = 0
        return output

    handle = module.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def _value_columns(layer: nn.Module, adapter: Adapter, heads: int) -> tuple[int, int]:
    """The value module's output columns that hold the value vectors."""
    import torch

    value = cast(torch.Tensor, layer.get_submodule(adapter.value).weight)
    inner = cast(torch.Tensor, layer.get_submodule(adapter.out_proj).weight)  # [out, in] ([in,
    # out] for Conv1D)
    width = int(value.shape[1] if adapter.conv1d else value.shape[0])
    head_dim = int(inner.shape[0] if adapter.conv1d else inner.shape[1]) // heads
    return value_columns(adapter, width, heads, head_dim)


def _rerun(layer: nn.Module, record: LayerRecord, row: int, batch: int,
           copies: int) -> torch.Tensor:
    """Layer output ``[copies, token, model]`` for batch row ``row``, float64."""
    import torch

    args = [_row(a, row, batch) for a in record.args]
    kwargs = {k: _row(v, row, batch) for k, v in record.kwargs.items()}
    hidden = args[0] if args else kwargs["hidden_states"]
    hidden = hidden.expand(copies, -1, -1)
    if args:
        args[0] = hidden
    else:
        kwargs["hidden_states"] = hidden
    output = layer(*args, **kwargs)
    return (output[0] if isinstance(output, tuple) else output).to(torch.float64)


def value_zeroing_layers(model: Any, inputs: dict[str, Any], config: Any) -> list[torch.Tensor]:
    """Value zeroing of every layer, float32 ``[batch, head, query, key]``, rows sum to 1."""
    import torch

    adapter = adapter_for(config, "value-zeroing")
    records = collect(model, inputs, adapter, keep_layer_calls=True)
    result = []
    for index, (layer, record) in enumerate(zip(layers_of(model, adapter), records)):
        assert record.probs is not None and record.residual is not None
        batch, heads, tokens, _ = record.probs.shape
        width = int(record.residual.shape[-1])
        # A rerun of n copies holds about n * tokens * (heads * tokens + 8 * width) floats.
        step = max(1, 4 * CHUNK_BYTES // (8 * tokens * (heads * tokens + 8 * width)))
        twin = copy.deepcopy(layer).to(torch.float64).eval()
        value_module = twin.get_submodule(adapter.value)
        columns = _value_columns(twin, adapter, heads)
        scores = torch.zeros(batch, tokens, tokens, dtype=torch.float64,
                             device=record.residual.device)
        with torch.inference_mode():
            for row in range(batch):
                original = _rerun(twin, record, row, batch, 1)  # [1, T, D]
                if record.output is not None:  # the rerun must be the layer's real pass
                    difference = relative_mismatch(original[0], record.output[row])
                    if difference is not None:
                        raise mismatch_error(adapter, f"a rerun of layer {index}", difference)
                for start in range(0, tokens, step):
                    positions = list(range(start, min(tokens, start + step)))
                    with _zeroing(value_module, columns, positions):
                        zeroed = _rerun(twin, record, row, batch, len(positions))  # [n, T, D]
                    cosine = torch.nn.functional.cosine_similarity(zeroed, original, dim=-1)
                    scores[row, :, start:start + len(positions)] = (1 - cosine).clamp(min=0).T
        del twin
        total = scores.sum(-1, keepdim=True)
        scores = scores / torch.where(total > 0, total, torch.ones_like(total))
        result.append(per_layer(scores, heads))
    return result
