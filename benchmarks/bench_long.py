"""Long captures against the sdpa forward pass of the same model, at 4k to 32k tokens.

The model is the Llama of issue 18: 4 layers, 8 heads, 2 key/value heads, hidden size 256,
RoPE, random weights, saved to a temporary folder with the bundled WordPiece tokenizer. Every
measurement runs in a fresh Python process (so its peak RSS, ``ru_maxrss``, is its own), after
the model is loaded and one short warm-up pass is done; time is text in, result out
(tokenising included), wall and CPU (user + system, all threads).

Measurements:

* ``forward``: ``model(**tokenizer(text))`` with transformers' default sdpa kernel: the floor.
* ``one-head``: ``capture_long(source, text, layers=[2])`` then ``cap.topk(2, 3, k=5)`` (the
  forward stops after layer 2, the layer asked for).
* ``all-heads``: ``capture_long(source, text, summary=True, block=64, k=5)`` (the summary
  computed in the capture's own pass over the scores): every head's atlas (64-token blocks,
  pooled to 256 and 1024), top-5 keys per query, statistics, attention received and sinks,
  and the mean's 1024-token atlas of layer 2.

Targets (issue 18), at 16k tokens: one-head <= 2x the forward's time and <= 1.5x its peak RSS;
all-heads <= 4x the forward's time; memory O(T x d).

Each time here starts after the model is loaded and warmed up, so it leaves out Python's
start-up, the imports and the model load that a command pays: these ratios are of the library
calls alone. ``benchmarks/bench_long_cli.py`` times whole commands, start to exit, against a
whole-process forward; README's figures name which of the two they come from.

Run::

    python benchmarks/bench_long.py                       # 4k, 16k and 32k: minutes
    python benchmarks/bench_long.py --tokens 16000 --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = ("forward", "one-head", "all-heads")
CONTEXT = 65536


def build_model(folder: Path) -> None:
    """Save the issue's random Llama and MiniLM's WordPiece tokenizer into ``folder``."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaModel

    from attnviz.models.hf import bundled_model_path

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=30522, hidden_size=256, intermediate_size=1024,
                         num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                         max_position_embeddings=CONTEXT)
    LlamaModel(config).save_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(bundled_model_path())
    tokenizer.model_max_length = CONTEXT
    tokenizer.save_pretrained(folder)


def make_text(tokens: int) -> str:
    """Random whole words of the vocabulary: at least ``tokens`` tokens (cut to that many)."""
    from transformers import AutoTokenizer

    from attnviz.models.hf import bundled_model_path

    vocab = sorted(w for w in AutoTokenizer.from_pretrained(bundled_model_path()).get_vocab()
                   if w.isalpha() and w.isascii() and len(w) > 2)
    rng = random.Random(0)
    return " ".join(rng.choice(vocab) for _ in range(tokens + 64))


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def worker(mode: str, folder: Path, tokens: int) -> dict[str, float]:
    """One measurement (in its own process)."""
    import torch

    text = make_text(tokens)
    if mode == "forward":
        from transformers import AutoModel, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(folder)
        model = AutoModel.from_pretrained(folder).eval()  # sdpa: transformers' default

        def run(words: str, limit: int) -> object:
            enc = tokenizer(words, return_tensors="pt", truncation=True, max_length=limit)
            with torch.inference_mode():
                return model(**enc).last_hidden_state

    else:
        from attnviz.long import capture_long
        from attnviz.models.hf import HFSource

        source = HFSource(str(folder), device="cpu")

        def run(words: str, limit: int) -> object:
            if mode == "one-head":
                cap = capture_long(source, words, layers=[2], max_tokens=limit)
                result: object = cap.topk(2, 3, 5)
            else:
                cap = capture_long(source, words, max_tokens=limit, summary=True, block=64,
                                   k=5)
                cap.summarise(block=64, k=5)  # held: free
                result = (cap.atlas(2, "mean", 1024), cap.sinks())
            cap.close()
            return result

    run(text, 64)  # warm-up: first-call costs are not the measurement
    start_wall, start_cpu = time.perf_counter(), _cpu()
    run(text, tokens)
    wall, cpu = time.perf_counter() - start_wall, _cpu() - start_cpu
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak_mib = peak / (1 << 20) if sys.platform == "darwin" else peak / 1024
    return {"wall_s": wall, "cpu_s": cpu, "peak_mib": peak_mib, "threads": torch.get_num_threads()}


def measure(mode: str, folder: Path, tokens: int, threads: int | None) -> dict[str, float]:
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    out = subprocess.run([sys.executable, __file__, "--worker", mode, "--model", str(folder),
                          "--tokens", str(tokens)], env=env, check=True, capture_output=True,
                         text=True)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4000, 16000, 32000],
                        help="input lengths (each at most 65536)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--threads", type=int, default=None, help="torch threads per run")
    parser.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if any(not 16 <= t <= CONTEXT for t in args.tokens):
        parser.error(f"--tokens must be between 16 and {CONTEXT}")
    if args.worker:
        print(json.dumps(worker(args.worker, args.model, args.tokens[0])))
        return
    with tempfile.TemporaryDirectory(prefix="attnviz-bench-long-") as tmp:
        folder = Path(tmp) / "llama"
        build_model(folder)
        print(f"{'tokens':>7} {'mode':>10} {'wall s':>8} {'cpu s':>8} {'peak MiB':>9} "
              f"{'x wall':>7} {'x cpu':>6} {'x RSS':>6}")
        for tokens in args.tokens:
            base: dict[str, float] | None = None
            for mode in ("forward", *[m for m in args.modes if m != "forward"]):
                row = measure(mode, folder, tokens, args.threads)
                if mode == "forward":
                    base = row
                assert base is not None
                print(f"{tokens:>7} {mode:>10} {row['wall_s']:>8.2f} {row['cpu_s']:>8.2f} "
                      f"{row['peak_mib']:>9.0f} {row['wall_s'] / base['wall_s']:>7.2f} "
                      f"{row['cpu_s'] / base['cpu_s']:>6.2f} "
                      f"{row['peak_mib'] / base['peak_mib']:>6.2f}", flush=True)


if __name__ == "__main__":
    main()
