"""Benchmark: ``heads --input`` texts per second, local engine vs Ray (1 and 2 workers).

Runs the library functions behind ``attnviz heads --input`` on N generated texts (default 500,
4-30 words) with the bundled MiniLM (or ``--model toy``), capture cache off:

* local: :func:`attnviz.analysis.corpus.corpus_stats` with batched capture in this process
  (a fresh session, so the model load is included, as in a CLI run), with 2 torch threads
  (the default here), with 1 (what one Ray worker gets), and with 2 again at the end;
* ray: :func:`attnviz.engine.ray_heads.corpus_stats_ray` on a local Ray with 2 CPUs, with 1
  and 2 workers (each worker is one actor with one CPU, so torch runs one thread in it).

For every run it reports the wall time, the time to the first finished batch (for Ray: actor
start, imports and model load, the fixed cost of a run), and the steady rate after the first
batch. Ray's fixed start-up cost is measured on its own: ``ray.init`` of a local instance,
and a whole run over 2 texts (start-up plus almost no work). The results of every run are
checked against the local ones (largest difference of any statistic).

    python benchmarks/bench_ray.py                  # ~2-4 minutes on 2 busy cores
    python benchmarks/bench_ray.py --texts 200 --model toy
"""

from __future__ import annotations

import argparse
import os
import random
import time
from collections.abc import Sequence
from typing import Any

WORDS = ("the a cat dog sat ran on under mat rug quickly slowly big small red green house "
         "river bank money tree bird sang loudly over old young man woman child saw heard "
         "it and but because while").split()


def _texts(count: int, seed: int = 0) -> list[tuple[str, str | None]]:
    rng = random.Random(seed)
    return [(" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 30))) + ".", None)
            for _ in range(count)]


class _Timeline:
    """When each batch finished: wall time to the first, steady rate after it."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.marks: list[tuple[float, int]] = []

    def advance(self, count: int = 1) -> None:
        self.marks.append((time.perf_counter(), count))

    def summary(self, total: int) -> dict[str, float]:
        wall = time.perf_counter() - self.start
        first_time, first_count = self.marks[0]
        last_time = self.marks[-1][0]
        rest = total - first_count
        steady = rest / (last_time - first_time) if last_time > first_time and rest else 0.0
        return {"wall": wall, "first": first_time - self.start, "steady": steady,
                "rate": total / wall}


def _spec(model: str) -> Any:
    from attnviz.models import ModelSpec
    from attnviz.models.toy import ToyConfig

    if model == "toy":
        return ModelSpec(name="toy", toy=ToyConfig(layers=2, heads=4), device="cpu")
    return ModelSpec(name=model, device="cpu")


def _max_difference(a: Any, b: Any) -> float:
    import numpy as np

    ma, mb = a.sums.means(), b.sums.means()
    return max(float(np.abs(ma[k] - mb[k]).max()) for k in ma)


def run_local(texts: Sequence[tuple[str, str | None]], spec: Any, batch_size: int,
              threads: int) -> tuple[Any, dict[str, float]]:
    import torch

    from attnviz.analysis.corpus import corpus_stats
    from attnviz.session import Session

    torch.set_num_threads(threads)
    session = Session(use_cache=False)
    timeline = _Timeline()
    corpus = corpus_stats(
        texts, lambda text, pair: session.capture(text, pair, model=spec),
        capture_all=lambda chunk: session.captures(chunk, model=spec, batch_size=batch_size),
        advance=timeline.advance)
    return corpus, timeline.summary(len(texts))


def run_ray(texts: Sequence[tuple[str, str | None]], spec: Any, batch_size: int,
            workers: int) -> tuple[Any, dict[str, float]]:
    from attnviz.engine import RayOptions
    from attnviz.engine.ray_heads import corpus_stats_ray

    timeline = _Timeline()
    corpus, _, _ = corpus_stats_ray(texts, spec=spec, use_cache=False,
                                    options=RayOptions(workers=workers, batch_size=batch_size),
                                    advance=timeline.advance)
    return corpus, timeline.summary(len(texts))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--texts", type=int, default=500)
    parser.add_argument("--model", default="minilm")
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    texts = _texts(args.texts)
    spec = _spec(args.model)

    rows: list[tuple[str, dict[str, float], float]] = []
    local, stats = run_local(texts, spec, args.batch_size, 2)
    rows.append(("local (this process, 2 torch threads)", stats, 0.0))
    corpus, stats = run_local(texts, spec, args.batch_size, 1)
    rows.append(("local (this process, 1 torch thread)", stats, _max_difference(local, corpus)))

    from attnviz.engine.ray_cluster import init_local

    began = time.perf_counter()
    ray = init_local(2)
    init_seconds = time.perf_counter() - began
    try:
        _, tiny = run_ray(texts[:2], spec, args.batch_size, 1)
        for workers in (1, 2):
            corpus, stats = run_ray(texts, spec, args.batch_size, workers)
            rows.append((f"ray, {workers} worker{'s' if workers > 1 else ''}", stats,
                         _max_difference(local, corpus)))
    finally:
        began = time.perf_counter()
        ray.shutdown()
        shutdown_seconds = time.perf_counter() - began
    corpus, stats = run_local(texts, spec, args.batch_size, 2)  # again: the machine may be busy
    rows.append(("local again, 2 torch threads", stats, _max_difference(local, corpus)))

    print(f"\n{len(texts)} texts, model {args.model}, batch size {args.batch_size}, "
          f"{local.sums.tokens} tokens, cache off\n")
    print("| engine | wall (s) | texts/s (wall) | first batch after (s) | "
          "texts/s after the first batch | max difference vs local |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, stats, difference in rows:
        print(f"| {name} | {stats['wall']:.1f} | {stats['rate']:.0f} | {stats['first']:.1f} "
              f"| {stats['steady']:.0f} | {difference:.1e} |")
    print("\nRay's fixed cost:\n")
    print("| step | seconds |")
    print("|---|---:|")
    print(f"| ray.init of a local Ray (2 CPUs) | {init_seconds:.1f} |")
    print(f"| a whole run over 2 texts, 1 worker (actor start, imports, model load) | "
          f"{tiny['wall']:.1f} |")
    print(f"| ray.shutdown | {shutdown_seconds:.1f} |")


if __name__ == "__main__":
    main()
