"""Benchmark: a new text through a warm session vs a cold ``attnviz heatmap`` process.

For texts of 16, 64 and 256 MiniLM tokens (special tokens included), each measured with a
text never seen before (so the capture cache misses), compare:

* cold: ``attnviz heatmap "<new text>" --layer 0 --head 0 -o out.png`` as a fresh process, which
  imports torch and transformers, loads the model, runs it and draws one figure;
* warm: ``Session.capture("<new text>")`` in this process, the model already loaded (the
  cache is on, as for a user: a lookup that misses, the forward pass, the cache write);
* warm + figure: the same plus ``attnviz heatmap``'s figure, when ``Capture.heatmap`` exists.

Both sides run in the same run on the same machine, so the ratio holds when the machine is busy;
the target is a warm 64-token capture in at most 1/50 of the cold command.

    python benchmarks/bench_session.py                # 2 cold runs and 7 warm runs per size
    python benchmarks/bench_session.py --cold 1 --warm 5
    python benchmarks/bench_session.py --threads 1    # both sides on one torch thread

On a machine shared with other work, torch's default of one thread per core suffers most (its
threads wait for each other while descheduled): the load average is printed with the figures,
and ``--threads 1`` gives both sides the same single thread.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SIZES = (16, 64, 256)
TARGET_SIZE = 64
TARGET_RATIO = 50.0
WORDS = ("the quick brown fox jumps over the lazy dog while an old cat sleeps on a warm mat "
         "near the window and a small bird sings in the tall green tree outside").split()


def make_text(tokenizer: Any, tokens: int, serial: int) -> str:
    """A text of exactly ``tokens`` tokens (specials included), new for every ``serial``."""
    words = [f"run{serial}"]
    while len(tokenizer(" ".join(words))["input_ids"]) < tokens:
        words.append(WORDS[len(words) % len(WORDS)])
    while len(tokenizer(" ".join(words))["input_ids"]) > tokens:
        words.pop()
    text = " ".join(words)
    assert len(tokenizer(text)["input_ids"]) == tokens, tokens
    return text


def _figure_of(drawn: Any) -> Any:
    """The figure of what ``Capture.heatmap`` returns: ``(figure, axes)``."""
    return drawn[0] if isinstance(drawn, tuple) else drawn


def time_cold(text: str, out: Path, env: dict[str, str]) -> float:
    command = [sys.executable, "-m", "attnviz", "heatmap", text, "--layer", "0", "--head", "0",
               "-o", str(out)]
    start = time.perf_counter()
    subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    if not out.is_file() or out.stat().st_size == 0:
        raise SystemExit(f"the cold command wrote no figure: {' '.join(command)}")
    return wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cold", type=int, default=2, help="cold processes per size")
    parser.add_argument("--warm", type=int, default=7, help="warm captures per size")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads on both sides (default: torch's own choice)")
    args = parser.parse_args()
    if args.cold < 1 or args.warm < 1:
        raise SystemExit("--cold and --warm must be at least 1")

    with tempfile.TemporaryDirectory(prefix="attnviz-bench-session-") as folder:
        root = Path(folder)
        os.environ["ATTNVIZ_CACHE_DIR"] = str(root / "cache")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("MPLBACKEND", "Agg")
        if args.threads is not None:
            os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the cold processes' torch
        env = dict(os.environ)
        load_before = os.getloadavg()[0]

        start = time.perf_counter()
        from attnviz.session import Session

        if args.threads is not None:
            import torch

            torch.set_num_threads(args.threads)
        session = Session()
        source = session.source()  # the warm model: loaded once, here
        load_s = time.perf_counter() - start
        tokenizer = source.tokenizer  # type: ignore[attr-defined]
        session.capture(make_text(tokenizer, 16, -1))  # first forward pass: lazy kernels
        figure = None
        try:
            from attnviz.capture import Capture

            figure = getattr(Capture, "heatmap", None)
        except ImportError:
            pass
        if figure is not None:
            import matplotlib.pyplot as plt

            plt.close(_figure_of(figure(session.capture(make_text(tokenizer, 16, -2)), 0, 0)))

        serial = 0
        rows = []
        for size in SIZES:
            warm, warm_figure = [], []
            for _ in range(args.warm):
                serial += 1
                text = make_text(tokenizer, size, serial)
                begin = time.perf_counter()
                capture = session.capture(text)
                warm.append(time.perf_counter() - begin)
                assert capture.num_tokens == size
                if figure is not None:
                    import matplotlib.pyplot as plt

                    begin = time.perf_counter()
                    drawn = _figure_of(figure(capture, 0, 0))
                    drawn.savefig(root / f"warm-{serial}.png")
                    plt.close(drawn)
                    warm_figure.append(warm[-1] + time.perf_counter() - begin)
            cold = []
            for _ in range(args.cold):
                serial += 1
                cold.append(time_cold(make_text(tokenizer, size, serial),
                                      root / f"cold-{serial}.png", env))
            rows.append((size, statistics.median(cold), statistics.median(warm),
                         statistics.median(warm_figure) if warm_figure else None))
        assert session.loads == 1, "the warm session loaded the model again"
        load_after = os.getloadavg()[0]

    import torch

    print(f"MiniLM (6 layers x 12 heads), {torch.get_num_threads()} torch threads, "
          f"{os.cpu_count()} CPUs; warm model load once: {load_s:.2f} s; medians of "
          f"{args.cold} cold / {args.warm} warm runs, every text new (cache misses); load "
          f"average {load_before:.1f} before, {load_after:.1f} after")
    print(f"{'tokens':>6}  {'cold heatmap':>12}  {'warm capture':>12}  {'ratio':>7}  "
          f"{'warm + figure':>13}")
    for size, cold_s, warm_s, figure_s in rows:
        extra = f"{figure_s * 1000:10.1f} ms" if figure_s is not None else f"{'-':>13}"
        print(f"{size:>6}  {cold_s:10.2f} s  {warm_s * 1000:9.1f} ms  {cold_s / warm_s:6.0f}x  "
              f"{extra}")
    size, cold_s, warm_s, _ = next(row for row in rows if row[0] == TARGET_SIZE)
    ratio = cold_s / warm_s
    verdict = "met" if ratio >= TARGET_RATIO else "NOT met"
    print(f"target: warm {TARGET_SIZE}-token capture <= 1/{TARGET_RATIO:.0f} of the cold "
          f"command: 1/{ratio:.0f} ({verdict})")


if __name__ == "__main__":
    main()
