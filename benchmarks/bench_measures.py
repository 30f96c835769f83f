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

    python benchmarks/bench_measures.py                        # 64, 256, 512 tokens: ~30 min
    python benchmarks/bench_measures.py --lengths 64 --measures norm alti

One run on a shared two-core machine under heavy load (load average about 10, so absolute times
are inflated and noisy; ratios are within the run)::

    tokens measure           time s  x eager  RSS +MiB  x eager
        64 eager              0.673      1.0       7.6      1.0
        64 norm               1.301      1.9      20.2      2.6
        64 norm-res-ln        2.408      3.6     107.7     14.1
        64 alti               2.847      4.2     111.0     14.5
        64 value-zeroing     15.769     23.4     296.7     38.8
       256 eager              1.593      1.0      47.7      1.0
       256 norm               1.656      1.0     107.3      2.2
       256 norm-res-ln       20.826     13.1     319.9      6.7
       256 alti              29.492     18.5     327.0      6.9
       256 value-zeroing    328.597    206.3     622.6     13.0
       512 eager              2.570      1.0     132.5      1.0
       512 norm               3.036      1.2     286.4      2.2
       512 norm-res-ln       93.075     36.2     524.6      4.0
       512 alti             107.254     41.7     547.9      4.1
       512 value-zeroing    886.328    344.8     652.4      4.9

After that run ``norm-res-ln`` changed to the Gram-matrix form (below); rerun at 512 tokens,
lighter load: eager 0.54 s, 110 MiB; norm 0.87 s (1.6x), 314 MiB (2.9x); norm-res-ln 4.27 s
(7.9x, was 36x), 391 MiB (3.6x).

What dominates:

* ``norm``: one eager pass plus ``||f(x_j)||`` per head; about the eager time, and twice its
  memory (the float64 copy of each layer's attention).
* ``alti``: building the per-source vectors ``[query, key, model]`` of every layer,
  ``layers * tokens^2 * model`` float64 values, and their L1 distances, so the time grows with
  ``tokens^2 * model`` where the eager pass grows more slowly; the query chunks
  (``CHUNK_BYTES``, 64 MiB) cap the memory at a few hundred MiB at any length.
* ``norm-res-ln``: needs only lengths, so it never builds those vectors: a quadratic form over
  each key's ``heads x heads`` Gram matrix, ``layers * tokens^2 * heads^2`` operations.
* ``value-zeroing``: ``layers * tokens`` reruns of a layer over ``tokens`` tokens in float64,
  mostly the feed-forward block: ``tokens^2`` growth and by far the slowest; memory is the
  batches of zeroed copies (about 256 MiB of attention per batch) and the float64 layer copy.
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
