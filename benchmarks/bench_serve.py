"""Benchmark: ``attnviz serve`` with MiniLM under concurrent clients, against a cold process.

Starts ``attnviz serve --model minilm`` on 127.0.0.1 (a free port; the server is killed with
its process group at the end, whatever happens), loads the model with one request, then:

* latency: one client sends new texts of 16, 64 and 256 tokens (every text is new, so no
  cache answers) and reports p50/p95 from request to full response, for the page's request
  (16-bit weights + head statistics) and for the ``--server`` client's (exact float32);
* load: 8 clients (httpx with asyncio) x 50 requests each, new 16- and 64-token texts, all at
  once: errors (must be 0), throughput and p50/p95 while the queue is full;
* baseline: cold ``attnviz heatmap "<new text>"`` processes (import, load, capture, draw), the
  median, and the ratio to the server's p50 for a new 64-token text (target: p50 <= 150 ms).

Every count and wait is bounded; the run prints a table and a JSON line.

    python benchmarks/bench_serve.py             # about 2-3 minutes on 2 cores
    python benchmarks/bench_serve.py --quick     # fewer requests, one cold run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

# Words that are one WordPiece token each in MiniLM's uncased vocabulary (checked at start).
WORDS = ("the cat dog sat on mat house tree bird sang in a small green garden near old river "
         "bank and boy girl ran to school with his her friend book read slowly under warm sun "
         "while red car drove past blue door of big city hall man woman saw light rain fell "
         "over hill field farm cow horse ate grass at night day morning evening sky star moon "
         "water fire stone road bridge ship sea wind snow ice cold hot long short new good bad "
         "happy sad little high low first last next other same open close walk talk eat drink "
         "sleep play work write sing run jump sit stand look find give take make know think "
         "see hear feel want need like love help keep hold bring come go get put say tell ask"
         ).split()
TOKENS = (16, 64, 256)
TARGET_P50_MS = 150.0


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    position = (len(ordered) - 1) * q
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


class Texts:
    """New texts of an exact token count (two special tokens plus n - 2 one-token words)."""

    def __init__(self, seed: int = 0) -> None:
        from transformers import AutoTokenizer

        from attnviz.models.hf import bundled_model_path

        tokenizer = AutoTokenizer.from_pretrained(bundled_model_path())
        self.words = sorted({w for w in WORDS if len(tokenizer.tokenize(w)) == 1})
        self.rng = random.Random(seed)
        self.seen: set[str] = set()

    def new(self, tokens: int) -> str:
        while True:
            text = " ".join(self.rng.choice(self.words) for _ in range(tokens - 2))
            if text not in self.seen:
                self.seen.add(text)
                return text


@contextmanager
def running_server(threads: int | None) -> Iterator[str]:
    """``attnviz serve --model minilm`` on a free port of 127.0.0.1; killed on the way out."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.pop("ATTNVIZ_SERVER", None)
    command = [sys.executable, "-m", "attnviz", "serve", "--model", "minilm", "--host",
               "127.0.0.1", "--port", "0", "--queue", "16"]
    if threads is not None:
        command += ["--threads", str(threads)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, env=env, start_new_session=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in process.stdout or []],
                     daemon=True).start()
    try:
        deadline = time.monotonic() + 120
        while True:
            if time.monotonic() > deadline or process.poll() is not None:
                raise RuntimeError("the server did not start")
            try:
                line = lines.get(timeout=0.5)
            except queue.Empty:
                continue
            match = re.search(r"attnviz serve: (http://127\.0\.0\.1:\d+)/", line)
            if match:
                yield match.group(1)
                return
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)


def page_body(text: str) -> dict[str, Any]:
    return {"text": text, "weights": "q16", "stats": True}


def client_body(text: str) -> dict[str, Any]:
    return {"text": text, "weights": "float32"}


def latency(url: str, texts: Texts, count: int, tokens: int, body: Any) -> list[float]:
    import httpx

    times = []
    with httpx.Client(base_url=url, timeout=60, trust_env=False) as client:
        for _ in range(count):
            text = texts.new(tokens)
            started = time.perf_counter()
            response = client.post("/api/capture", json=body(text))
            response.raise_for_status()
            payload = response.json()
            times.append((time.perf_counter() - started) * 1000)
            if len(payload["tokens"]) != tokens:
                raise RuntimeError(f"expected {tokens} tokens, got {len(payload['tokens'])}")
    return times


async def _load(url: str, texts: list[list[str]]) -> dict[str, Any]:
    import httpx

    errors: list[str] = []
    times: list[float] = []
    limits = httpx.Limits(max_connections=len(texts))
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits,
                                 trust_env=False) as client:
        async def one_client(mine: list[str]) -> None:
            for text in mine:
                started = time.perf_counter()
                try:
                    response = await client.post("/api/capture", json=page_body(text))
                    if response.status_code != 200:
                        errors.append(f"HTTP {response.status_code}: {response.text[:120]}")
                        continue
                    response.json()
                except Exception as error:  # a benchmark counts every failure
                    errors.append(repr(error)[:160])
                    continue
                times.append((time.perf_counter() - started) * 1000)

        started = time.perf_counter()
        await asyncio.wait_for(asyncio.gather(*(one_client(mine) for mine in texts)),
                               timeout=600)
        seconds = time.perf_counter() - started
    return {"clients": len(texts), "requests": sum(len(m) for m in texts),
            "errors": len(errors), "error_samples": errors[:3], "seconds": seconds,
            "per_second": len(times) / seconds, "p50_ms": percentile(times, 0.5),
            "p95_ms": percentile(times, 0.95)}


def cold_heatmap(texts: Texts, runs: int) -> list[float]:
    times = []
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.pop("ATTNVIZ_SERVER", None)
    with tempfile.TemporaryDirectory() as tmp:
        env["ATTNVIZ_CACHE_DIR"] = str(Path(tmp) / "cache")
        for run in range(runs):
            text = texts.new(64)
            started = time.perf_counter()
            subprocess.run([sys.executable, "-m", "attnviz", "heatmap", text, "--layer", "0",
                            "--head", "0", "-o", str(Path(tmp) / f"h{run}.png")],
                           check=True, capture_output=True, env=env, timeout=300)
            times.append((time.perf_counter() - started) * 1000)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests, one cold run")
    parser.add_argument("--threads", type=int, default=None,
                        help="the server's --threads (default: torch's choice)")
    args = parser.parse_args()
    counts = {16: 15, 64: 15, 256: 8} if args.quick else {16: 40, 64: 40, 256: 20}
    per_client = 20 if args.quick else 50
    texts = Texts()
    load_avg = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    results: dict[str, Any] = {"cpus": os.cpu_count(), "load_average": load_avg,
                               "threads": args.threads}
    with running_server(args.threads) as url:
        latency(url, texts, 3, 16, page_body)  # loads the model, warms the first paths
        results["page"] = {}
        results["client"] = {}
        for tokens in TOKENS:
            page = latency(url, texts, counts[tokens], tokens, page_body)
            exact = latency(url, texts, max(5, counts[tokens] // 2), tokens, client_body)
            results["page"][tokens] = {"p50_ms": percentile(page, 0.5),
                                       "p95_ms": percentile(page, 0.95), "n": len(page)}
            results["client"][tokens] = {"p50_ms": percentile(exact, 0.5),
                                         "p95_ms": percentile(exact, 0.95), "n": len(exact)}
        mixed = [[texts.new(16 if (c + i) % 2 else 64) for i in range(per_client)]
                 for c in range(8)]
        results["load"] = asyncio.run(_load(url, mixed))
    cold = cold_heatmap(texts, 1 if args.quick else 3)
    results["cold_heatmap_ms"] = statistics.median(cold)
    warm = results["page"][64]["p50_ms"]
    results["ratio_cold_to_warm_64"] = results["cold_heatmap_ms"] / warm
    results["target_met"] = warm <= TARGET_P50_MS

    print(f"attnviz serve, MiniLM, {results['cpus']} CPUs, load average {load_avg:.1f}")
    print(f"{'tokens':>6} {'page p50':>10} {'page p95':>10} {'float32 p50':>12} "
          f"{'float32 p95':>12}  (ms, one client, every text new)")
    for tokens in TOKENS:
        page, exact = results["page"][tokens], results["client"][tokens]
        print(f"{tokens:>6} {page['p50_ms']:>10.1f} {page['p95_ms']:>10.1f} "
              f"{exact['p50_ms']:>12.1f} {exact['p95_ms']:>12.1f}")
    load = results["load"]
    print(f"load: {load['clients']} clients x {load['requests'] // load['clients']} requests: "
          f"{load['errors']} errors, {load['per_second']:.1f} requests/s, "
          f"p50 {load['p50_ms']:.0f} ms, p95 {load['p95_ms']:.0f} ms")
    print(f"cold 'attnviz heatmap' (median of {len(cold)}): {results['cold_heatmap_ms']:.0f} ms;"
          f" {results['ratio_cold_to_warm_64']:.0f}x the server's p50 for a new 64-token text "
          f"({'meets' if results['target_met'] else 'misses'} the {TARGET_P50_MS:.0f} ms "
          "target)")
    print(json.dumps(results))
    if load["errors"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
