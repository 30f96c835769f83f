"""Every measure on CUDA equals the same measure on the CPU (skipped without a CUDA GPU).

The models are tiny random-weight BERT, GPT-2 and Llama (grouped queries) built from configs,
so nothing is read from disk.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnviz import measures

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def _model(kind: str) -> torch.nn.Module:
    from transformers import (
        BertConfig,
        BertModel,
        GPT2Config,
        GPT2Model,
        LlamaConfig,
        LlamaModel,
    )

    torch.manual_seed(0)
    if kind == "bert":
        config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                            num_attention_heads=4, intermediate_size=64)
        cls = BertModel
    elif kind == "gpt2":
        config = GPT2Config(vocab_size=100, n_positions=64, n_embd=32, n_layer=2, n_head=4)
        cls = GPT2Model
    else:
        config = LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=64)
        cls = LlamaModel
    config._attn_implementation = "eager"
    return cls(config).eval()


@pytest.mark.parametrize("kind", ["bert", "gpt2", "llama"])
def test_measures_on_cuda_equal_cpu(kind: str) -> None:
    model = _model(kind)
    ids = torch.tensor([[3, 14, 15, 92, 65, 35, 89, 79, 32]])
    names = [n for n in measures.MEASURES if not (n == "norm-res-ln" and kind != "bert")]
    cpu = {n: measures.compute(n, model, {"input_ids": ids}, model.config) for n in names}
    model = model.to("cuda")
    for name in names:
        gpu = measures.compute(name, model, {"input_ids": ids.to("cuda")}, model.config)
        assert all(layer.device.type == "cuda" for layer in gpu)
        for one, other in zip(cpu[name], gpu):
            np.testing.assert_allclose(other.cpu().numpy(), one.numpy(), atol=1e-5)
