"""Tiny random-weight Llama models and long texts for the long-context view's tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

WORDS = ("the cat sat on mat while a dog ran past her house and birds sang in old trees near "
         "river where children played with red ball every summer morning before school began "
         "then teacher called them inside to read stories about kings queens ships stars").split()


def long_text(tokens: int) -> str:
    """A text of about ``tokens`` WordPiece tokens (every word above is one token)."""
    return " ".join(WORDS[(i * 7 + i // len(WORDS)) % len(WORDS)] for i in range(tokens))


def build_tiny_llama(folder: Path, *, positions: int = 1024, layers: int = 2, heads: int = 4,
                     kv_heads: int = 2, hidden: int = 32) -> Path:
    """A random-weight Llama (grouped-query attention, RoPE) saved to ``folder`` with the
    bundled MiniLM's WordPiece tokenizer."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from attnviz.models.hf import bundled_model_path

    config = LlamaConfig(vocab_size=30522, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, max_position_embeddings=positions)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(bundled_model_path(), model_max_length=positions).save_pretrained(
        folder)
    return folder


def capture_tiny_llama(model_dir: Path, tokens: int, out: Path) -> Path:
    """A long capture of ``tokens`` tokens of :func:`long_text` by the model in ``model_dir``,
    saved to ``out``."""
    from attnviz.long import capture_long
    from attnviz.models.hf import HFSource

    source = HFSource(str(model_dir), device="cpu")
    capture_long(source, long_text(tokens + 16), max_tokens=tokens, folder=out).close()
    return out


def build_tiny_mistral(folder: Path, *, positions: int = 1024, window: int = 16) -> Path:
    """A random-weight Mistral with a sliding window of ``window`` keys, saved to ``folder``."""
    import torch
    from transformers import AutoTokenizer, MistralConfig, MistralForCausalLM

    from attnviz.models.hf import bundled_model_path

    config = MistralConfig(vocab_size=30522, hidden_size=32, intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=positions, sliding_window=window)
    torch.manual_seed(0)
    MistralForCausalLM(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(bundled_model_path(), model_max_length=positions).save_pretrained(
        folder)
    return folder


def write_long(folder: Path, q: Any, k: Any, *, causal: bool = True, window: int | None = None,
               scale: float = 0.25, dtype: str = "float32", lse: Any = None) -> Path:
    """A long capture folder written from queries ``q`` ``[layer, head, T, dim]`` and keys
    ``k`` ``[layer, kv_head, T, dim]`` (numpy float32), its log-sum-exp computed as a capture
    computes it (``lse`` ``[layer, head, T]`` replaces it)."""
    import numpy as np
    import torch

    from attnviz.long import kernels
    from attnviz.long.record import layer_file, to_storage, write_sidecar

    folder.mkdir(parents=True, exist_ok=True)
    layers, heads, size, dim = q.shape
    for layer in range(layers):
        qt = torch.from_numpy(np.ascontiguousarray(q[layer], dtype=np.float32))
        kt = torch.from_numpy(np.ascontiguousarray(k[layer], dtype=np.float32))
        if dtype != "float32":  # stored rounded, and the log-sum-exp of what is stored
            qt = qt.to(getattr(torch, dtype)).float()
            kt = kt.to(getattr(torch, dtype)).float()
        found = (kernels.lse_chunked(qt, kt, scale, causal, window).numpy() if lse is None
                 else np.asarray(lse[layer], dtype=np.float32))
        np.save(folder / layer_file("q", layer), to_storage(qt, dtype))
        np.save(folder / layer_file("k", layer), to_storage(kt, dtype))
        np.save(folder / layer_file("lse", layer), found)
    tokens = [f"t{i}" for i in range(size)]
    write_sidecar(folder, {
        "model": "synthetic", "text": " ".join(tokens), "tokens": tokens,
        "display_tokens": tokens, "word_ids": list(range(size)), "special": [False] * size,
        "layers": list(range(layers)), "num_layers": layers, "num_heads": heads,
        "num_kv_heads": k.shape[1], "head_dim": dim, "dtype": dtype, "causal": causal,
        "scales": [scale] * layers, "windows": [window] * layers})
    return folder
