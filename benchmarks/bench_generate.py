"""Benchmark: what recording the generated tokens' attention rows costs.

On a random-weight Llama (grouped-query attention, RoPE) saved to a temporary folder, three
greedy generations of the same ``--new`` tokens after a ``--prompt``-token prompt, in one run:

* ``sdpa``: ``model.generate`` with the model's fused kernel and the key/value cache (the floor);
* ``attnviz``: :func:`attnviz.long.generate.generate`, the same kernel and cache plus one row per
  layer and head per step, recomputed from the query and the cached keys;
* ``eager``: what tools do today, ``generate(output_attentions=True)`` with eager attention.

It prints the best wall time of ``--repeat`` runs, the ratio to ``sdpa`` and, on CUDA, the peak
memory; then checks that the recorded rows equal the eager ones (largest difference).

    python benchmarks/bench_generate.py --threads 1                # CPU, small
    python benchmarks/bench_generate.py --device cuda --layers 16 --heads 32 --kv-heads 8 \\
        --hidden 2048 --prompt 2000 --new 256
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _build(args: argparse.Namespace, folder: Path) -> Path:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer_dir = args.tokenizer
    if tokenizer_dir is None:
        from attnviz.models.hf import bundled_model_path

        tokenizer_dir = bundled_model_path()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=30522, hidden_size=args.hidden,
                         intermediate_size=args.hidden * 2, num_hidden_layers=args.layers,
                         num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                         max_position_embeddings=args.prompt + args.new + 16,
                         bos_token_id=101, eos_token_id=None)
    LlamaForCausalLM(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(folder)
    return folder


def _best(run: Callable[[], Any], repeat: int, device: str) -> tuple[float, Any, int]:
    import torch

    result = run()  # warm-up
    best = float("inf")
    peak = 0
    for _ in range(repeat):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        result = run()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
            peak = max(peak, int(torch.cuda.max_memory_allocated()))
        best = min(best, time.perf_counter() - start)
    return best, result, peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=200, help="prompt tokens")
    parser.add_argument("--new", type=int, default=64, help="generated tokens")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads for torch (1 gives steadier times on a busy machine)")
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="tokenizer folder (default: the bundled MiniLM's)")
    args = parser.parse_args()

    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from attnviz.long.generate import generate, load_causal_lm
    from attnviz.models import ModelSpec

    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="attnviz-bench-generate-") as tmp:
        folder = _build(args, Path(tmp) / "llama")
        source = load_causal_lm(ModelSpec(name=str(folder), device=args.device,
                                          dtype=args.dtype))
        # The model's positions, not the borrowed tokenizer's 512, bound the length here.
        source.max_tokens = args.prompt + args.new + 16
        words = ("the cat sat on the mat and looked at the dog " * args.prompt).split()
        prompt = " ".join(words[:args.prompt - 2])  # [CLS] and [SEP] make up the rest
        enc = source.tokenizer(prompt, return_tensors="pt", return_token_type_ids=False
                               ).to(source.device)
        length = int(enc["input_ids"].shape[1])
        plain = {"max_new_tokens": args.new, "do_sample": False, "pad_token_id": 0}

        def sdpa() -> Any:
            with torch.inference_mode():
                return source.model.generate(**enc, **plain)

        def recorded() -> Any:
            return generate(source, prompt, max_new_tokens=args.new)

        eager_model = AutoModelForCausalLM.from_pretrained(
            folder, attn_implementation="eager", dtype=getattr(torch, args.dtype)
        ).to(source.device).eval()

        def eager() -> Any:
            with torch.inference_mode():
                return eager_model.generate(**enc, **plain, output_attentions=True,
                                            return_dict_in_generate=True)

        timings = {name: _best(run, args.repeat, args.device)
                   for name, run in (("sdpa", sdpa), ("attnviz", recorded), ("eager", eager))}
        base = timings["sdpa"][0]
        print(f"Llama {args.layers} layers x {args.heads} heads ({args.kv_heads} key/value), "
              f"hidden {args.hidden}, {args.dtype} on {source.device}; prompt {length} "
              f"tokens, {args.new} new")
        print(f"{'run':<10}{'seconds':>10}{'x sdpa':>9}{'peak MiB':>10}")
        for name, (seconds, _, peak) in timings.items():
            print(f"{name:<10}{seconds:>10.3f}{seconds / base:>9.2f}"
                  f"{peak / 2**20 if peak else float('nan'):>10.0f}")
        result = timings["attnviz"][1]
        reference = timings["eager"][1]
        # eager's attentions per step: prefill (L x [1, H, P, P]) then L x [1, H, 1, P + i]
        worst = 0.0
        for step, layers in enumerate(reference.attentions[:result.steps]):
            for layer, weights in enumerate(layers):
                row = weights[0, :, -1].float().cpu().numpy()
                mine = result.rows[layer, :, step, :row.shape[-1]]
                worst = max(worst, float(np.abs(mine - row).max()))
        same = result.token_ids == [int(i) for i in reference.sequences[0]]
        print(f"recorded rows vs eager generate: largest difference {worst:.2e}; "
              f"same tokens: {same}")


if __name__ == "__main__":
    main()
