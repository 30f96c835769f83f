"""Build a tiny random-weight Llama (grouped-query attention, RoPE) and a long text for it.

The model is the configuration of the long-context benchmark (4 layers, 8 heads, 2 key/value
heads, hidden size 256), saved with the bundled MiniLM's WordPiece tokenizer, so the long path
can be tried without a download::

    python scripts/tiny_llama.py llama/            # writes llama/ and llama/text.txt
    attnviz heatmap - --model llama --long --layer 1 --head 0 < llama/text.txt
"""

from __future__ import annotations

import argparse
from pathlib import Path

WORDS = ("the river ran past the old mill where a miller kept bread and flour for the town "
         "while children played by the water and birds sang in the trees above").split()


def build(out: Path, tokens: int = 8000, seed: int = 0) -> Path:
    """Save the model and a text of about ``tokens`` tokens (``out/text.txt``) into ``out``."""
    import numpy as np
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaModel

    from attnviz.models.hf import bundled_model_path

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=30522, hidden_size=256, intermediate_size=512,
                         num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                         max_position_embeddings=131072)
    model = LlamaModel(config)
    with torch.no_grad():  # random weights attend almost uniformly: sharpen them a little
        for layer in model.layers:
            layer.self_attn.q_proj.weight.mul_(4.0)
            layer.self_attn.k_proj.weight.mul_(4.0)
    model.save_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(bundled_model_path())
    tokenizer.model_max_length = 131072
    tokenizer.save_pretrained(out)
    rng = np.random.default_rng(seed)
    (out / "text.txt").write_text(" ".join(rng.choice(WORDS, tokens - 2)) + "\n",
                                  encoding="utf-8")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="folder for the model and text.txt")
    parser.add_argument("--tokens", type=int, default=8000, help="length of the text")
    args = parser.parse_args()
    build(args.out, args.tokens)


if __name__ == "__main__":
    main()
