"""Whole-process long-context commands against a whole-process sdpa forward of the same model.

Every measurement is a fresh process, timed from its start to its exit (Python start-up,
imports, model load, tokenising, writing included) with its own peak RSS and CPU time
(user + system, all threads: steadier than wall time on a shared machine; ``wait4``), and
divided by the baseline measured in the same run: a script that loads the same model with
transformers' default sdpa kernel and runs one forward pass over the same text, read from
standard input like the commands.

The model is ``scripts/tiny_llama.py``'s (the issue-18 Llama: 4 layers, 8 heads, 2 key/value
heads, hidden size 256, RoPE, random weights, the bundled WordPiece tokenizer) with its text of
``--tokens`` tokens, built into a temporary folder.

Commands (``--commands``, all by default):

* ``one-head``: ``attnviz top-k - --model DIR --layer 2 --head 3 -k 3 -f csv``
* ``heads``: ``attnviz heads - --model DIR --long -f csv`` (every head's statistics and sinks)
* ``all-heads``: ``python -c`` capture_long(summary=True, k=5) then the mean's atlas of
  layer 2 and the sinks: every head's atlas, top-k, statistics and sinks from one pass
* ``export``: ``attnviz export --input - --model DIR --long -o OUT`` (one text)
* ``html``: ``attnviz html --long-from CAP -o OUT.html`` of a capture saved beforehand with
  ``attnviz dump - --model DIR --long -o CAP`` (not timed)

Targets at 16k tokens (issue 23): one-head <= 1.3x wall and <= 1.2x peak RSS of the forward;
all-heads <= 2x; export <= 2.5x; html <= 1.5x.

Run::

    python benchmarks/bench_long_cli.py --tokens 16000 --repeat 2
    python benchmarks/bench_long_cli.py --tokens 65536 --commands one-head all-heads
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

ROOT = Path(__file__).resolve().parent.parent
COMMANDS = ("one-head", "heads", "all-heads", "export", "html")
#: The largest text the benchmark builds (the model's positions are 131072).
MAX_TOKENS = 131072

FORWARD = """
import sys, torch
from transformers import AutoModel, AutoTokenizer
folder = sys.argv[1]
text = sys.stdin.read()
tokenizer = AutoTokenizer.from_pretrained(folder)
model = AutoModel.from_pretrained(folder, attn_implementation="sdpa").eval()
with torch.inference_mode():
    model(**tokenizer(text, return_tensors="pt")).last_hidden_state.sum().item()
"""

ALL_HEADS = """
import sys
from attnviz.long import capture_long
from attnviz.models.hf import HFSource
text = sys.stdin.read()
cap = capture_long(HFSource(sys.argv[1], device="cpu"), text, summary=True, block=64, k=5)
cap.atlas(2, "mean", 1024)
cap.sinks()
cap.head_stats()
cap.close()
"""


def run(argv: list[str], stdin: Path | None, env: dict[str, str]
        ) -> tuple[float, float, float]:
    """Wall seconds, peak RSS (MiB) and CPU seconds (user + system, all threads) of one
    process, start to exit."""
    handle = open(stdin, "rb") if stdin is not None else subprocess.DEVNULL  # noqa: SIM115
    try:
        start = time.perf_counter()
        process = subprocess.Popen(argv, stdin=handle, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.PIPE, env=env, cwd=str(ROOT))
        assert process.stderr is not None
        errors = process.stderr.read()
        _pid, status, usage = os.wait4(process.pid, 0)
        wall = time.perf_counter() - start
        process.returncode = os.waitstatus_to_exitcode(status)
    finally:
        if stdin is not None:
            handle.close()  # type: ignore[union-attr]
    if process.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({process.returncode}):\n"
                         f"{errors.decode(errors='replace')[-2000:]}")
    peak = usage.ru_maxrss / (1 << 20) if sys.platform == "darwin" else usage.ru_maxrss / 1024
    return wall, peak, usage.ru_utime + usage.ru_stime


def command(name: str, model: Path, work: Path) -> tuple[list[str], bool]:
    """The argv of a command and whether it reads the text on standard input."""
    attnviz = [sys.executable, "-m", "attnviz"]
    if name == "forward":
        return [sys.executable, "-c", FORWARD, str(model)], True
    if name == "one-head":
        return [*attnviz, "top-k", "-", "--model", str(model), "--layer", "2", "--head", "3",
                "-k", "3", "-f", "csv"], True
    if name == "heads":
        return [*attnviz, "heads", "-", "--model", str(model), "--long", "-f", "csv"], True
    if name == "all-heads":
        return [sys.executable, "-c", ALL_HEADS, str(model)], True
    if name == "export":
        out = work / f"export-{time.monotonic_ns()}"
        return [*attnviz, "export", "--input", "-", "--model", str(model), "--long", "-o",
                str(out)], True
    if name == "html":
        return [*attnviz, "html", "--long-from", str(work / "capture"), "-o",
                str(work / "report.html")], False
    raise ValueError(name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[16000],
                        help=f"text lengths (16 to {MAX_TOKENS})")
    parser.add_argument("--commands", nargs="+", choices=COMMANDS, default=list(COMMANDS))
    parser.add_argument("--repeat", type=int, default=1,
                        help="runs of each command (and of the forward before each); the "
                             "median is shown")
    parser.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS per run")
    args = parser.parse_args()
    if any(not 16 <= t <= MAX_TOKENS for t in args.tokens):
        parser.error(f"--tokens must be between 16 and {MAX_TOKENS}")
    if not 1 <= args.repeat <= 10:
        parser.error("--repeat must be between 1 and 10")
    sys.path.insert(0, str(ROOT / "scripts"))
    from tiny_llama import build

    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               ATTNVIZ_CACHE_DIR=tempfile.mkdtemp(prefix="attnviz-bench-cache-"))
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    print(f"{'tokens':>7} {'command':>10} {'wall s':>8} {'peak MiB':>9} {'cpu s':>8} "
          f"{'x wall':>7} {'x RSS':>6} {'x cpu':>6}   (forward: the runs beside each command; "
          "medians)", flush=True)
    for tokens in args.tokens:
        with tempfile.TemporaryDirectory(prefix="attnviz-bench-long-cli-") as tmp:
            work = Path(tmp)
            model = build(work / "llama", tokens=tokens)
            text = model / "text.txt"
            if "html" in args.commands:  # the saved capture html reads (not timed)
                subprocess.run([sys.executable, "-m", "attnviz", "dump", "-", "--model",
                                str(model), "--long", "-o", str(work / "capture")],
                               stdin=text.open("rb"), stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, env=env, check=True, cwd=str(ROOT))
            for name in args.commands:
                base, rows = [], []
                for _ in range(args.repeat):  # the forward right before each run: same load
                    argv, reads = command("forward", model, work)
                    base.append(run(argv, text if reads else None, env))
                    argv, reads = command(name, model, work)
                    rows.append(run(argv, text if reads else None, env))
                wall, peak, cpu = (statistics.median(r[i] for r in rows) for i in range(3))
                base_wall, base_peak, base_cpu = (statistics.median(b[i] for b in base)
                                                  for i in range(3))
                print(f"{tokens:>7} {'forward':>10} {base_wall:>8.2f} {base_peak:>9.0f} "
                      f"{base_cpu:>8.2f} {1:>7.2f} {1:>6.2f} {1:>6.2f}", flush=True)
                print(f"{tokens:>7} {name:>10} {wall:>8.2f} {peak:>9.0f} {cpu:>8.2f} "
                      f"{wall / base_wall:>7.2f} {peak / base_peak:>6.2f} "
                      f"{cpu / base_cpu:>6.2f}", flush=True)

if __name__ == "__main__":
    main()
