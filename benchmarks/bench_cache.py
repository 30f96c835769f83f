"""Benchmark: ``heads --input`` with the capture cache on must take time linear in the lines.

For 1k, 5k and 20k distinct lines on the toy model, three fresh processes run
``attnviz heads --input FILE --model toy``:

* ``cold``: cache on and empty, so every line is captured and stored (the case that was
  quadratic: eviction re-listed the whole cache after every store);
* ``warm``: the same again, every line read back from the cache (checksums verified);
* ``no-cache``: ``--no-cache``, the baseline of the same run.

It prints wall and CPU seconds (CPU of the child process, steadier on a busy machine), the time
per line, the ratio to ``--no-cache`` and, for linearity, each size's time per line against the
smallest size's. Then, in this process, the cost of one ``store`` when the cache already holds
1k and N entries (flat when bookkeeping is O(1)).

    python benchmarks/bench_cache.py                 # 1k, 5k, 20k lines (a few minutes)
    python benchmarks/bench_cache.py --sizes 300 1200
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORDS = ("the cat sat on mat dog ran fast over hill red blue green a an of in tree bird sings "
         "near window old young river bank loan sea sky").split()


def _write_lines(path: Path, count: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as handle:
        for i in range(count):
            words = [rng.choice(WORDS) for _ in range(rng.randint(4, 14))]
            handle.write(" ".join(words) + f" {i}\n")


def _child_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _run(lines: Path, cache: Path, *extra: str) -> tuple[float, float]:
    """Wall and CPU seconds of one ``heads --input`` process."""
    env = {**os.environ, "ATTNVIZ_CACHE_DIR": str(cache), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "attnviz", "heads", "--input", str(lines), "--model", "toy",
               "--format", "csv", *extra]
    cpu, wall = _child_cpu(), time.perf_counter()
    done = subprocess.run(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          check=False)
    wall, cpu = time.perf_counter() - wall, _child_cpu() - cpu
    if done.returncode != 0:
        raise SystemExit(f"heads --input failed ({done.returncode}): {done.stderr.decode()}")
    return wall, cpu


def _store_cost(folder: Path, sizes: list[int]) -> list[tuple[int, float]]:
    """Microseconds per ``store`` once the cache holds each of ``sizes`` entries."""
    os.environ["ATTNVIZ_CACHE_DIR"] = str(folder)
    from attnviz import cache
    from attnviz.models import ModelSpec
    from attnviz.models.toy import ToyConfig, ToySource

    source = ToySource(ToyConfig(), device="cpu")
    spec = ModelSpec(name="toy", toy=ToyConfig())
    capture = source.capture("the cat sat on the mat near the old window")
    results, stored, probe = [], 0, 200
    for size in sizes:
        while stored < size:
            cache.store(cache.capture_key(spec, f"fill {stored}"), capture)
            stored += 1
        start = time.perf_counter()
        for i in range(probe):
            cache.store(cache.capture_key(spec, f"probe {size} {i}"), capture)
        results.append((size, (time.perf_counter() - start) / probe * 1e6))
        stored += probe
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 5000, 20000])
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="attnviz-bench-cache-") as tmp:
        root = Path(tmp)
        for count in args.sizes:
            lines = root / f"lines{count}.txt"
            _write_lines(lines, count)
            cache = root / f"cache{count}"
            cold = _run(lines, cache)
            warm = _run(lines, cache)
            plain = _run(lines, root / "unused", "--no-cache")
            rows.append((count, cold, warm, plain))
            print(f"{count:>6} lines  cold {cold[0]:7.1f} s wall {cold[1]:7.1f} s cpu | "
                  f"warm {warm[0]:6.1f} s wall {warm[1]:6.1f} s cpu | "
                  f"no-cache {plain[0]:6.1f} s wall {plain[1]:6.1f} s cpu | "
                  f"cold/no-cache {cold[1] / plain[1]:.2f}x cpu, warm/no-cache "
                  f"{warm[1] / plain[1]:.2f}x cpu", flush=True)
        base = rows[0]
        print("\ntime per line (ms, cpu), and against the smallest size (1.00 = linear):")
        for count, cold, warm, plain in rows:
            print(f"{count:>6} lines  cold {cold[1] / count * 1e3:6.2f} "
                  f"({cold[1] / count / (base[1][1] / base[0]):.2f}x)  "
                  f"warm {warm[1] / count * 1e3:6.2f} "
                  f"({warm[1] / count / (base[2][1] / base[0]):.2f}x)  "
                  f"no-cache {plain[1] / count * 1e3:6.2f} "
                  f"({plain[1] / count / (base[3][1] / base[0]):.2f}x)")
        print("\none store (in process), by entries already in the cache:")
        for size, micros in _store_cost(root / "store", [1000, max(args.sizes)]):
            print(f"{size:>6} entries  {micros:7.0f} us per store")


if __name__ == "__main__":
    main()
