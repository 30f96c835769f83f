"""Run the conformance census over every text model type and write docs/models.md.

Every model type of transformers' causal-LM, masked-LM and seq2seq mappings is built tiny
from its own configuration class (random weights, sharpened attention, the bundled MiniLM
tokenizer) and checked on each path against the model's own eager ``outputs.attentions``
(see ``tests/_conformance.py``)::

    python scripts/conformance_table.py                 # every type -> docs/models.md
    python scripts/conformance_table.py llama gpt2      # a few types, table on stdout
    python scripts/conformance_table.py --jobs 4        # four worker processes

Types run in worker processes (each imports torch and transformers once). The exit status
is 1 when any path gave a wrong matrix or crashed, else 0.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


#: Address space a worker may use: a type whose "small" build still needs more fails with
#: MemoryError and is listed, instead of taking the machine's memory (one took 23 GB).
WORKER_MEMORY = 8 << 30
WORKER_SECONDS = 900


def _one(model_type: str) -> dict[str, Any]:
    import resource

    from tests import _conformance as conformance

    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = WORKER_MEMORY if hard == resource.RLIM_INFINITY else min(WORKER_MEMORY, hard)
    if soft == resource.RLIM_INFINITY or soft > limit:
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        result = conformance.census([model_type])[0]
    except Exception as exc:  # noqa: BLE001 - the census itself must not stop the sweep
        return {"type": model_type, "kinds": [], "built": None,
                "paths": {"full": f"crash: the census failed: {exc!r:.200}"}}
    return {"type": model_type, "kinds": result.kinds, "built": result.built,
            "paths": result.paths}


def _in_worker(model_type: str, kinds: list[str], variant: str) -> dict[str, Any]:
    """One type in its own process (a type that takes the process down, or runs past
    ``WORKER_SECONDS``, costs only its own row)."""
    import subprocess

    env = dict(os.environ, ATTNVIZ_CONFORMANCE_SIZES=variant)
    try:
        done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker",
                               model_type], capture_output=True, text=True, env=env,
                              timeout=WORKER_SECONDS, check=False)
    except subprocess.TimeoutExpired:
        return {"type": model_type, "kinds": kinds, "built": None,
                "paths": {"full": f"crash: the census ran past {WORKER_SECONDS} s"}}
    lines = done.stdout.strip().splitlines()
    if done.returncode == 0 and lines:
        return dict(json.loads(lines[-1]))
    why = f"signal {-done.returncode}" if done.returncode < 0 else f"exit {done.returncode}"
    tail = done.stderr.strip().splitlines()[-1:] or [""]
    return {"type": model_type, "kinds": kinds, "built": None,
            "paths": {"full": f"crash: the worker process died ({why}) {tail[0][:200]}"}}


def _die_with_parent() -> None:
    """A worker ends when the sweep that started it does (killed or interrupted)."""
    import threading
    import time

    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def _clean(message: str) -> str:
    """A refusal as the table shows it: temporary model folders named ``<model>``."""
    message = re.sub(r"/\S*?/conformance-[^/\s]+/[\w.-]+", "<model>", message)
    return message.replace("|", "\\|")


def table(rows: list[dict[str, Any]], not_run: list[str] | None = None) -> tuple[str, int]:
    """The markdown of docs/models.md and the number of wrong or crashed paths; ``not_run``:
    types the sweep did not reach."""
    from tests._conformance import PATHS

    built = [r for r in rows if not r["built"]]
    counts = {path: Counter(r["paths"].get(path, "").split(":")[0] for r in built)
              for path in PATHS}
    notes: dict[str, int] = {}
    lines = ["| model type | mappings | " + " | ".join(PATHS) + " |",
             "|---|---|" + "---|" * len(PATHS)]
    failures = 0
    for row in built:
        cells = []
        for path in PATHS:
            outcome = row["paths"].get(path, "")
            kind, _, why = outcome.partition(": ")
            if kind in ("refused", "wrong", "crash", "n/a"):
                number = notes.setdefault(_clean(f"{kind}: {why}"), len(notes) + 1)
                cells.append(f"{kind} [{number}](#note-{number})")
                failures += kind in ("wrong", "crash")
            else:
                cells.append(kind)
        lines.append(f"| {row['type']} | {', '.join(row['kinds'])} | " + " | ".join(cells) + " |")
    summary = ["| path | " + " | ".join(("equal", "works", "refused", "n/a", "wrong", "crash"))
               + " |", "|---|---|---|---|---|---|---|"]
    for path in PATHS:
        found = counts[path]
        summary.append(f"| {path} | " + " | ".join(str(found.get(k, 0)) for k in
                                                  ("equal", "works", "refused", "n/a", "wrong",
                                                   "crash")) + " |")
    skipped = [r for r in rows if r["built"]]
    text = [
        "# Model types: what each path gives",
        "",
        "Every model type of transformers' causal-LM, masked-LM and seq2seq mappings, built "
        "tiny from its own configuration class (random weights with sharpened attention, the "
        "bundled MiniLM tokenizer), saved, and loaded back through attnviz. Each path is "
        "compared with the same model's own eager `outputs.attentions` (to 1e-5; a float64 "
        "rerun decides where float32 rounding is in question). A model that returns no "
        "weights because it switched itself to full attention (BigBird configured "
        "`block_sparse`, on a text shorter than its sparse pattern) is compared with the same "
        "weights loaded with `attention_type=\"original_full\"`, whose output it equals:",
        "",
        "- **equal**: every layer and head matches the model's own attention;",
        "- **works** (measures): a finite measure of every layer and head (its numbers are "
        "checked against independent recomputations in `tests/test_measures.py`);",
        "- **refused**: one line saying why and what works (the numbered note);",
        "- **n/a**: the path does not apply (generate needs a causal language model);",
        "- **wrong** / **crash**: a defect to fix (counted in the summary below).",
        "",
        "Regenerate with `python scripts/conformance_table.py` (the full sweep; "
        "`pytest -m conformance_full` runs the same census as a test, and the default "
        "`pytest` run checks a representative set). Generated with transformers "
        f"{_transformers_version()}.",
        "",
        f"{len(built)} types built and checked; {len(skipped)} could not be built small "
        "(listed at the end).",
        "",
        *summary,
        "",
        *lines,
        "",
        "## Notes",
        "",
    ]
    for message, number in notes.items():
        text.append(f"<a id=\"note-{number}\"></a>{number}. {message}")
        text.append("")
    text += ["## Types transformers cannot build small", "",
             "| model type | mappings | why |", "|---|---|---|"]
    text += [f"| {r['type']} | {', '.join(r['kinds'])} | {_clean(str(r['built']))} |"
             for r in skipped]
    if not_run:
        text += ["", "## Types not run in this sweep", "",
                 f"{len(not_run)} types were not reached: {', '.join(not_run)}. "
                 "`python scripts/conformance_table.py` runs them."]
    return "\n".join(text) + "\n", failures


def _transformers_version() -> str:
    import transformers

    return str(transformers.__version__)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("types", nargs="*", help="model types (default: every type)")
    parser.add_argument("--jobs", type=int, default=2, help="worker processes (default 2)")
    parser.add_argument("--out", type=Path, default=None,
                        help="where to write the table (default: docs/models.md for the "
                             "full sweep, stdout for chosen types)")
    parser.add_argument("--results", type=Path, default=None,
                        help="also append every type's outcomes here as it finishes "
                             "(JSON lines)")
    parser.add_argument("--reuse", type=Path, default=None,
                        help="outcomes of an earlier --results run: types there with no "
                             "wrong or crashed path are not run again")
    parser.add_argument("--no-run", action="store_true",
                        help="only write the table of the --reuse outcomes (types without "
                             "one are listed as not run)")
    parser.add_argument("--variant", choices=("default", "alt", "mqa"), default="default",
                        help="the sizes to build at: default (the committed table), alt "
                             "(six heads over three key heads, three layers, a window of 5, "
                             "a longer text) or mqa (eight heads over one, four layers, a "
                             "window of 3)")
    parser.add_argument("--worker", metavar="TYPE", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _die_with_parent()
        print(json.dumps(_one(args.worker)))
        return 0
    from tests._conformance import mappings

    known = mappings()
    unknown = [t for t in args.types if t not in known]
    if unknown:
        parser.error(f"not in transformers' mappings: {', '.join(unknown)}")
    if not 1 <= args.jobs <= 64:
        parser.error("--jobs must be from 1 to 64")
    types = args.types or list(known)
    from tests._conformance import FAST_TYPES

    types.sort(key=lambda t: (t not in FAST_TYPES, t))  # the representative set first
    rows: list[dict[str, Any]] = []
    if args.reuse is not None:
        earlier = [json.loads(line) for line in args.reuse.read_text("utf-8").splitlines()
                   if line.strip()]
        rows = [r for r in earlier if r["type"] in types and (args.no_run or (
            not r["built"] and not any(o.startswith(("wrong", "crash"))
                                       for o in r["paths"].values())))]
        types = [t for t in types if t not in {r["type"] for r in rows}]
    elif args.no_run:
        parser.error("--no-run needs --reuse")
    not_run = sorted(types) if args.no_run else []
    if args.no_run:
        types = []
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        futures = {pool.submit(_in_worker, t, known[t], args.variant): t for t in types}
        for done in concurrent.futures.as_completed(futures):
            row = done.result()
            model_type = row["type"]
            rows.append(row)
            if args.results is not None:  # as they come: an interrupted sweep keeps its rows
                with args.results.open("a", encoding="utf-8") as handle:
                    handle.write(json.dumps(row) + "\n")
            bad = [p for p, o in row["paths"].items() if o.startswith(("wrong", "crash"))]
            print(f"{len(rows)} {model_type}: "
                  f"{row['built'] or ('FAIL ' + ', '.join(bad) if bad else 'ok')}", flush=True)
    rows.sort(key=lambda r: r["type"])
    text, failures = table(rows, not_run)
    out = args.out or (ROOT / "docs" / "models.md" if not args.types else None)
    if out is None:
        sys.stdout.write(text)
    else:
        from attnviz.fileio import atomic_write_text

        atomic_write_text(out, text)
        print(f"wrote {out}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
