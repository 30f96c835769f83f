"""Peak memory and time of capturing one layer vs all layers, attnviz vs plain output_attentions.

A tiny Llama-style model (random weights, 4096-token context) is built locally. For each input
length, each approach runs in a fresh Python process (so peak RSS belongs to that measurement
alone) and reports:

* peak RSS of the process (``ru_maxrss``), and the growth of RSS during the capture call;
* wall time of the capture call (model already loaded, one short warm-up pass done), the best
  of up to ``--repeat`` runs (fewer when they pass 10 s together).

Approaches:

* ``plain all``: ``model(**inputs, output_attentions=True)`` then ``np.stack`` of every
  layer's ``[head, query, key]`` as float32: what a script usually does.
* ``plain one``: the same forward pass, keeping only the last layer.
* ``attnviz all``: ``HFSource.capture(text)``: every layer, written into one preallocated array.
* ``attnviz one``: ``HFSource.capture(text, layers=[last])``: a hook on that layer only; the
  other layers run with the fused kernel and never build their attention matrices.

A second part times batched capture (``capture_batch``) against one-by-one capture on the
bundled MiniLM.

Targets (issue 6): at 4096 tokens, ``attnviz one`` peaks at most 1/4 of ``plain all`` and is no
slower. Timings are noisy on a shared machine; the ratios are measured in the same run.

Run::

    python benchmarks/bench_memory.py                  # ~4-5 minutes on 2 CPU cores
    python benchmarks/bench_memory.py --lengths 512 1024 --skip-batch
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

LAYERS = 8  # decoder layers of the benchmark model
HEADS = 4
CONTEXT = 4096
MODES = ("plain-all", "plain-one", "attnviz-all", "attnviz-one")
TIME_BUDGET = 10.0  # seconds of timed runs per measurement before repeats stop


def build_model(folder: Path, layers: int = LAYERS) -> None:
    """Save a random tiny Llama with a 4096-token context and MiniLM's WordPiece tokenizer."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaModel

    from attnviz.models.hf import bundled_model_path

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=30522, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=layers, num_attention_heads=HEADS,
                         num_key_value_heads=2, max_position_embeddings=CONTEXT)
    LlamaModel(config).save_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(bundled_model_path())
    tokenizer.model_max_length = CONTEXT
    tokenizer.save_pretrained(folder)


def make_text(folder: Path, tokens: int) -> str:
    """Whole-word vocabulary entries, enough for ``tokens`` tokens (the rest is truncated)."""
    from transformers import AutoTokenizer

    vocab = sorted(w for w in AutoTokenizer.from_pretrained(folder).get_vocab()
                   if w.isalpha() and w.isascii() and len(w) > 2)
    rng = random.Random(0)
    return " ".join(rng.choice(vocab) for _ in range(tokens + 64))


def peak_rss_mib() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024


def current_rss_mib() -> float:
    try:
        import psutil
    except ImportError:  # pragma: no cover
        return float("nan")
    return float(psutil.Process().memory_info().rss) / (1024 * 1024)


def worker(mode: str, tokens: int, folder: Path, repeat: int) -> dict[str, float]:
    """One measurement (runs in its own process): peak RSS, and the best time of up to
    ``repeat`` runs (fewer once they add up to ``TIME_BUDGET`` seconds)."""
    import numpy as np
    import torch

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    text = make_text(folder, tokens)
    if mode.startswith("plain"):
        from transformers import AutoModel, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(folder)
        model = AutoModel.from_pretrained(folder, attn_implementation="eager").eval()
        inputs = tokenizer(text, truncation=True, max_length=tokens, return_tensors="pt")
        with torch.inference_mode():
            model(**tokenizer("warm up", return_tensors="pt"), output_attentions=True)

        def run() -> tuple[int, ...]:
            with torch.inference_mode():
                out = model(**inputs, output_attentions=True, use_cache=False)
                if mode == "plain-all":
                    weights = np.stack([a[0].float().numpy() for a in out.attentions])
                else:
                    weights = out.attentions[-1][0].float().numpy().copy()
            return tuple(weights.shape)
    else:
        from attnviz.models.hf import HFSource

        source = HFSource(str(folder), device="cpu")
        source.capture("warm up")
        layers = None if mode == "attnviz-all" else [source.num_layers - 1]

        def run() -> tuple[int, ...]:
            capture = source.capture(text, layers=layers, max_tokens=tokens)
            return tuple(capture.weights.shape)

    before = current_rss_mib()
    times = []
    while len(times) < repeat and sum(times) < TIME_BUDGET:
        start = time.perf_counter()
        shape = run()  # the result is dropped before the next run: peak RSS is one run's
        times.append(time.perf_counter() - start)
    if shape[-1] != tokens:
        raise SystemExit(f"expected {tokens} tokens, got shape {shape}")
    return {"peak_mib": peak_rss_mib(), "before_mib": before, "seconds": min(times),
            "runs": len(times)}


def measure(mode: str, tokens: int, folder: Path, repeat: int) -> dict[str, float]:
    result = subprocess.run(
        [sys.executable, __file__, "--worker", mode, str(tokens), str(folder), str(repeat)],
        capture_output=True, text=True, check=False,
        env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    if result.returncode != 0:
        raise SystemExit(f"{mode} at {tokens} tokens failed:\n{result.stderr[-3000:]}")
    return dict(json.loads(result.stdout.strip().splitlines()[-1]))


def memory_part(lengths: list[int], layers: int, repeat: int) -> list[str]:
    lines = []
    with tempfile.TemporaryDirectory(prefix="attnviz-bench-") as tmp:
        folder = Path(tmp) / "tiny-llama-4k"
        build_model(folder, layers)
        print(f"Model: Llama-style, {layers} layers x {HEADS} heads, hidden 64, "
              f"context {CONTEXT}, random weights; float32 on CPU "
              f"({os.cpu_count()} cores)\n")
        header = ("| tokens | approach | peak RSS (MiB) | RSS growth in capture (MiB) | "
                  "time (s) | peak vs plain all | time vs plain all |")
        lines += [header, "|---:|---|---:|---:|---:|---:|---:|"]
        print(header)
        print(lines[-1])
        results: dict[tuple[int, str], dict[str, float]] = {}
        for tokens in lengths:
            for mode in MODES:
                results[tokens, mode] = measure(mode, tokens, folder, repeat)
            base = results[tokens, "plain-all"]
            for mode in MODES:
                r = results[tokens, mode]
                line = (f"| {tokens} | {mode.replace('-', ' ')} | {r['peak_mib']:.0f} | "
                        f"{r['peak_mib'] - r['before_mib']:.0f} | {r['seconds']:.2f} | "
                        f"{r['peak_mib'] / base['peak_mib']:.2f} | "
                        f"{r['seconds'] / base['seconds']:.2f} |")
                lines.append(line)
                print(line, flush=True)
        top = max(lengths)
        one, plain = results[top, "attnviz-one"], results[top, "plain-all"]
        memory_ratio = one["peak_mib"] / plain["peak_mib"]
        time_ratio = one["seconds"] / plain["seconds"]
        verdict = [
            "",
            f"At {top} tokens, attnviz one layer vs plain output_attentions (all layers): "
            f"peak RSS {memory_ratio:.2f}x (target <= 0.25: "
            f"{'met' if memory_ratio <= 0.25 else 'NOT met'}), time {time_ratio:.2f}x "
            f"(target <= 1: {'met' if time_ratio <= 1 else 'NOT met'})",
        ]
        for line in verdict:
            print(line)
        lines += verdict
    return lines


def batch_part(count: int, repeat: int) -> list[str]:
    from attnviz.models.hf import HFSource

    rng = random.Random(1)
    words = ("the a cat dog sat on mat under tree quickly brown fox jumps over lazy river "
             "because morning evening students read books about attention heads").split()
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(4, 30))).capitalize() + "."
             for _ in range(count)]
    source = HFSource("minilm", device="cpu")
    source.capture_batch(texts[:8], batch_size=8)  # warm up

    def best(run: object) -> float:
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            run()  # type: ignore[operator]
            times.append(time.perf_counter() - start)
        return min(times)

    one_by_one = best(lambda: [source.capture(t) for t in texts])
    lines = ["", f"Batched capture, bundled MiniLM (6 layers x 12 heads), {count} texts of "
             f"4-30 words, all layers, CPU, best of {repeat}:", "",
             "| batch size | time (s) | texts/s | speed-up vs one by one |",
             "|---:|---:|---:|---:|",
             f"| 1 (one by one) | {one_by_one:.2f} | {count / one_by_one:.0f} | 1.00 |"]
    for size in (8, 32):
        seconds = best(lambda size=size: source.capture_batch(texts, batch_size=size))
        lines.append(f"| {size} | {seconds:.2f} | {count / seconds:.0f} | "
                     f"{one_by_one / seconds:.2f} |")
    for line in lines:
        print(line)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    parser.add_argument("--layers", type=int, default=LAYERS)
    parser.add_argument("--texts", type=int, default=64, help="texts in the batch benchmark")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs; the best is kept")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--skip-batch", action="store_true")
    parser.add_argument("--markdown", type=Path, help="also write the tables to this file")
    parser.add_argument("--worker", nargs=4, metavar=("MODE", "TOKENS", "FOLDER", "REPEAT"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        mode, tokens, folder, repeat = args.worker
        print(json.dumps(worker(mode, int(tokens), Path(folder), int(repeat))))
        return
    if any(n > CONTEXT or n < 2 for n in args.lengths):
        parser.error(f"lengths must be between 2 and {CONTEXT}")
    lines: list[str] = []
    if not args.skip_memory:
        lines += memory_part(sorted(args.lengths), args.layers, args.repeat)
    if not args.skip_batch:
        lines += batch_part(args.texts, args.repeat)
    if args.markdown:
        args.markdown.write_text("\n".join(lines) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
