"""Time and peak memory of each measure vs the plain eager capture, on the bundled MiniLM.

For each input length and each measure, a fresh Python process loads MiniLM (eager attention),
runs one short warm-up pass, then times one call:

* ``eager``: ``model(**inputs, output_attentions=True)``, every layer's weights (the baseline);
* ``norm``, ``norm-res-ln``, ``alti``, ``value-zeroing``: ``attnviz.measures.compute``.

Memory is the growth of the process's resident set (RSS) during the call: a thread samples
``/proc`` RSS (psutil) every millisecond and the figure is the peak minus the RSS just before the
call (torch's CPU tensors do not go through Python's allocator, so tracemalloc would miss them).
A fresh process per measurement keeps one measurement's freed memory from hiding the next's.
Ratios are against ``eager`` at the same length, in the same run.

Run::

    python benchmarks/bench_measures.py                        # 64, 256, 512 tokens
    python benchmarks/bench_measures.py --lengths 64 --measures norm alti
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time

MEASURES = ("eager", "norm", "norm-res-ln", "alti", "value-zeroing")
TEXT = ("The quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat. "
        * 200)


def worker(measure: str, tokens: int) -> dict[str, float]:
    import psutil
    import torch

    from attnviz import measures
    from attnviz.models.hf import HFSource

    source = HFSource("minilm", device="cpu")
    enc = source.tokenizer(TEXT, return_tensors="pt", truncation=True, max_length=tokens)
    inputs = source._model_inputs(enc)
    assert int(inputs["input_ids"].shape[1]) == tokens
    small = source._model_inputs(source.tokenizer("warm up", return_tensors="pt"))

    def run(inputs_: dict[str, torch.Tensor]) -> object:
        if measure == "eager":
            with torch.inference_mode():
                return source.model(**inputs_, output_attentions=True).attentions
        return measures.compute(measure, source.model, inputs_, source.config)

    run(small)
    process = psutil.Process()
    before = process.memory_info().rss
    peak = [before]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], process.memory_info().rss)
            time.sleep(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    result = run(inputs)
    seconds = time.perf_counter() - start
    done.set()
    sampler.join()
    del result
    return {"seconds": seconds, "peak_mib": (peak[0] - before) / 2 ** 20}


def measure_in_child(measure: str, tokens: int) -> dict[str, float]:
    out = subprocess.run([sys.executable, __file__, "--worker", measure, str(tokens)],
                         capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{measure} at {tokens} tokens failed:\n{out.stderr[-2000:]}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 256, 512])
    parser.add_argument("--measures", nargs="+", default=list(MEASURES[1:]),
                        choices=MEASURES[1:])
    parser.add_argument("--worker", nargs=2, metavar=("MEASURE", "TOKENS"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker[0], int(args.worker[1]))))
        return
    print(f"{'tokens':>6} {'measure':<14} {'time s':>9} {'x eager':>8} {'RSS +MiB':>9} "
          f"{'x eager':>8}")
    for tokens in args.lengths:
        base = measure_in_child("eager", tokens)
        print(f"{tokens:>6} {'eager':<14} {base['seconds']:>9.3f} {1:>8.1f} "
              f"{base['peak_mib']:>9.1f} {1:>8.1f}", flush=True)
        for name in args.measures:
            got = measure_in_child(name, tokens)
            time_ratio = got["seconds"] / base["seconds"]
            memory_ratio = got["peak_mib"] / max(base["peak_mib"], 1e-3)
            print(f"{tokens:>6} {name:<14} {got['seconds']:>9.3f} {time_ratio:>8.1f} "
                  f"{got['peak_mib']:>9.1f} {memory_ratio:>8.1f}", flush=True)


if __name__ == "__main__":
    main()
