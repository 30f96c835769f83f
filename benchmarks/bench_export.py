"""Benchmark: every head of the default model to PNG, attnviz export vs what users write today.

For a 36-token and a 128-token text, all 72 heads (6 layers x 12 heads) of the bundled MiniLM
are drawn as PNGs of the size ``attnviz heatmap --layer L --head H`` makes (no cell values at
these lengths, as attnviz's default), by:

* naive: what users write today, a new figure per head: ``seaborn.heatmap`` with token tick
  labels, ``savefig``, ``close``;
* floor: no drawing at all, each matrix colour-mapped, scaled (nearest, Pillow) to the same
  pixel size and saved as PNG with Pillow (``compress_level=1``, its fastest setting); and,
  for comparison, the same image saved with attnviz's own PNG writer, which skips the rows a
  nearest upscale repeats (nearly all rows of a bare heatmap, few of a labelled figure);
* attnviz: the fast renderer (frame drawn once per text, heads composited in), in one process;
  and the ``export`` command itself (heads only, and everything) with ``--jobs 1`` and
  ``--jobs 2``.

Then whole processes, as a user runs them: ``attnviz export --from DUMP`` (72 heads, 6 layer
grids, the overview, the capture and topk.csv; ``--jobs`` left to its default) against a plain
seaborn loop over the same 72 heads in a fresh ``python`` (importing seaborn, loading the
capture, drawing). Both ratios, CPU and wall, are printed for each length; the target is 10x.

Every method writes real files and runs in a fresh process, whose peak resident memory is
reported. It also measures memory against the number of texts (``export`` of 1 and of N texts)
and cold vs cached wall time of ``attnviz heatmap`` (two subprocess runs, the first with an
empty capture cache). Ratios use CPU seconds against baselines measured in the same run, so
they hold on a busy machine; wall seconds do not.

    python benchmarks/bench_export.py            # everything (~10 minutes on 2 cores)
    python benchmarks/bench_export.py --quick    # seaborn on 12 heads, extrapolated to 72
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

ANNOT_UP_TO = 30  # cell values up to this many tokens (attnviz's default): none at 36 or 128
SENTENCE = ("The quick brown fox jumps over the lazy dog while the old cat sleeps on a warm "
            "mat near the window, and a small bird sings in the tall green tree outside. ")


def _peak_rss_mb(who: str = "self") -> float:
    """Peak resident memory of this process, or of its largest finished child process."""
    import resource

    kind = resource.RUSAGE_SELF if who == "self" else resource.RUSAGE_CHILDREN
    peak = resource.getrusage(kind).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024


class _Clock:
    """Wall time and CPU time (this process and its finished children) since creation."""

    def __init__(self) -> None:
        self.wall = time.perf_counter()
        self.cpu = self._cpu()

    @staticmethod
    def _cpu() -> float:
        t = os.times()
        return t.user + t.system + t.children_user + t.children_system

    def result(self, **fields: Any) -> dict[str, Any]:
        return {"seconds": time.perf_counter() - self.wall, "cpu": self._cpu() - self.cpu,
                **fields}


def _in_child(function: str, *args: Any) -> dict[str, Any]:
    """Run ``function(*args)`` of this module in a fresh process; it returns a result dict."""
    with ProcessPoolExecutor(max_workers=1,
                             mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_call, function, *args).result()  # type: ignore[no-any-return]


def _call(function: str, *args: Any) -> dict[str, Any]:
    result: dict[str, Any] = globals()[function](*args)
    result["peak_mb"] = _peak_rss_mb()
    result["worker_peak_mb"] = _peak_rss_mb("children")
    return result


# --------------------------------------------------------------------------- methods
def naive(capture_dir: str, out: str, heads: int) -> dict[str, Any]:
    """A new seaborn figure per head, the way users write it today."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns

    from attnviz.capture import load_capture
    from attnviz.render.heatmap import head_figure_size

    capture = load_capture(capture_dir)
    labels = capture.display_tokens
    annot = capture.num_tokens <= ANNOT_UP_TO
    pairs = [(layer, head) for layer in capture.layers for head in capture.heads][:heads]
    clock = _Clock()
    for layer, head in pairs:
        fig, ax = plt.subplots(figsize=head_figure_size(capture.num_tokens))
        sns.heatmap(capture.matrix(layer, head), xticklabels=labels, yticklabels=labels,
                    cmap="viridis", annot=annot, fmt=".2f", ax=ax)
        ax.set_title(f"{capture.model}: layer {layer}, head {head}")
        fig.savefig(Path(out) / f"L{layer}_H{head}.png", dpi=100)
        plt.close(fig)
    return clock.result(pngs=len(pairs))


def floor(capture_dir: str, out: str, writer: str) -> dict[str, Any]:
    """No drawing: colour-map, nearest-scale to attnviz's PNG size, save."""
    import matplotlib
    import numpy as np
    from PIL import Image

    from attnviz.capture import load_capture
    from attnviz.render.fast import encode_png
    from attnviz.render.heatmap import head_figure_size

    capture = load_capture(capture_dir)
    cmap = matplotlib.colormaps["viridis"]
    lut = cmap(np.arange(cmap.N), bytes=True)[:, :3]  # [N, 3] uint8
    width, height = (round(v * 100) for v in head_figure_size(capture.num_tokens))
    clock = _Clock()
    count = 0
    for layer in capture.layers:
        for head in capture.heads:
            bins = np.clip(capture.matrix(layer, head) * cmap.N, 0, cmap.N - 1).astype(np.intp)
            small = Image.fromarray(lut[bins])  # [query, key, 3]
            image = small.resize((width, height), Image.Resampling.NEAREST)
            path = Path(out) / f"L{layer}_H{head}.png"
            if writer == "pillow":
                image.save(path, compress_level=1)
            else:
                path.write_bytes(encode_png(np.asarray(image)))
            count += 1
    return clock.result(pngs=count)


def fast_heads(capture_dir: str) -> dict[str, Any]:
    """attnviz's fast renderer in one process: frame once, 72 heads composited, files written."""
    import attnviz.render.fast  # noqa: F401  (imported before the clock, as the baselines do)
    from attnviz.capture import load_capture
    from attnviz.export import RenderTask, render_task

    capture = load_capture(capture_dir)
    heads = tuple((layer, head) for layer in capture.layers for head in capture.heads)
    annot = capture.num_tokens <= ANNOT_UP_TO
    task = RenderTask(capture_dir, heads, (), False, "png", 100, "viridis", annot, False, False)
    clock = _Clock()
    written, _ = render_task(task)
    return clock.result(pngs=written)


def export_run(dumps: list[str], out: str, jobs: int, figures: list[str]) -> dict[str, Any]:
    """The export command's library call on saved captures (the model is not timed)."""
    from attnviz.capture import load_capture
    from attnviz.export import ExportItem, ExportOptions, export_items

    annot = load_capture(dumps[0], mmap=True).num_tokens <= ANNOT_UP_TO
    items = [ExportItem(dump=Path(d), origin=d) for d in dumps]
    clock = _Clock()
    summary = export_items(items, out, ExportOptions(jobs=jobs, figures=tuple(figures),
                                                     annot=annot))
    heads = sum(1 for p in Path(out).rglob("heads/*.png"))
    return clock.result(pngs=heads, files=summary.files_written)


def capture_texts(out: str, sizes: list[int], extra: int) -> dict[str, Any]:
    """Capture the benchmark texts with the default model and save them."""
    from attnviz.models import load_source

    source = load_source("minilm")
    saved = {}
    for size in sizes:
        capture = source.capture(SENTENCE * 8, max_tokens=size)
        assert capture.num_tokens == size, capture.num_tokens
        path = Path(out) / f"tokens{size}"
        capture.save(path)
        saved[str(size)] = str(path)
    for number in range(extra):
        capture = source.capture(f"Text number {number}: " + SENTENCE * 3, max_tokens=32)
        path = Path(out) / f"extra{number}"
        capture.save(path)
        saved[f"extra{number}"] = str(path)
    return {"paths": saved}


def seaborn_loop(capture_dir: str, out: str, heads: int) -> None:
    """The plain seaborn loop as a user writes it, run as a whole process (``--seaborn-loop``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns

    from attnviz.capture import load_capture
    from attnviz.render.heatmap import head_figure_size

    capture = load_capture(capture_dir)
    labels = capture.display_tokens
    Path(out).mkdir(parents=True, exist_ok=True)
    pairs = [(layer, head) for layer in capture.layers for head in capture.heads][:heads]
    for layer, head in pairs:
        fig, ax = plt.subplots(figsize=head_figure_size(capture.num_tokens))
        sns.heatmap(capture.matrix(layer, head), xticklabels=labels, yticklabels=labels,
                    cmap="viridis", ax=ax)
        ax.set_title(f"{capture.model}: layer {layer}, head {head}")
        fig.savefig(Path(out) / f"L{layer}_H{head}.png", dpi=100)
        plt.close(fig)


def _process(command: list[str], env: dict[str, str] | None = None) -> dict[str, float]:
    """Wall and CPU seconds (user + system) of one whole child process."""
    import resource

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    subprocess.run(command, env=env, check=True, capture_output=True)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"seconds": wall, "cpu": cpu}


def whole_processes(capture_dir: str, root: Path, quick: bool) -> dict[str, Any]:
    """``attnviz export --from DUMP`` vs a seaborn loop, each a whole process.

    With ``quick``, the loop draws 12 heads; it is extrapolated to 72 from a run that only
    starts up (imports, loading the capture) and the per-head cost of the 12.
    """
    env = {**os.environ, "ATTNVIZ_CACHE_DIR": str(root / "cache"), "HF_HUB_OFFLINE": "1"}
    ours = _process([sys.executable, "-m", "attnviz", "export", "--from", capture_dir, "-o",
                     str(root / f"whole-attnviz-{Path(capture_dir).name}")], env)
    loop = [sys.executable, __file__, "--seaborn-loop", capture_dir]
    if quick:
        start = _process([*loop, str(root / "whole-sns-0"), "0"], env)
        twelve = _process([*loop, str(root / "whole-sns-12"), "12"], env)
        seaborn = {key: start[key] + (twelve[key] - start[key]) / 12 * 72 for key in start}
    else:
        seaborn = _process([*loop, str(root / "whole-sns-72"), "72"], env)
    return {"attnviz": ours, "seaborn": seaborn, "extrapolated": quick}


def heatmap_wall(cache_dir: str, out: str) -> list[float]:
    """Wall time of two ``attnviz heatmap`` subprocess runs: cold cache, then cached."""
    env = {**os.environ, "ATTNVIZ_CACHE_DIR": cache_dir}
    command = [sys.executable, "-m", "attnviz", "heatmap", SENTENCE.strip(), "--layer", "2",
               "--head", "3", "-o", str(Path(out) / "heatmap.png")]
    walls = []
    for _ in range(2):
        started = time.perf_counter()
        subprocess.run(command, env=env, check=True, capture_output=True)
        walls.append(time.perf_counter() - started)
    return walls


# --------------------------------------------------------------------------- report
def _row(name: str, result: dict[str, Any], naive_cpu: float, floors: dict[str, float]) -> str:
    """One table line; ratios use CPU seconds per PNG (robust on a shared machine)."""
    pngs = max(result["pngs"], 1)
    cpu_per_png = result["cpu"] / pngs
    rate = pngs / result["seconds"] if result["seconds"] else float("inf")
    vs_floor = "  ".join(f"{cpu_per_png / f:6.2f}x" for f in floors.values())
    workers = result.get("worker_peak_mb") or 0.0
    memory = f"{result['peak_mb']:4.0f} MB" + (f" (+ workers {workers:.0f} MB each)"
                                               if workers else "")
    return (f"  {name:<42} {result['seconds']:7.2f} s {result['cpu']:7.2f} s {rate:7.1f} "
            f"{naive_cpu / cpu_per_png:8.1f}x  {vs_floor}   {memory}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="time the naive baseline on 12 heads and extrapolate to 72")
    parser.add_argument("--memory-texts", type=int, default=8,
                        help="texts for the memory-vs-texts check (default 8)")
    parser.add_argument("--json", type=Path, help="also write the figures to this JSON file")
    parser.add_argument("--seaborn-loop", nargs=3, metavar=("DUMP", "OUT", "HEADS"),
                        help=argparse.SUPPRESS)  # one whole-process baseline run
    args = parser.parse_args()
    if args.seaborn_loop:
        dump, out, heads = args.seaborn_loop
        seaborn_loop(dump, out, int(heads))
        return
    sizes = [36, 128]
    report: dict[str, Any] = {"cores": os.cpu_count(), "python": sys.version.split()[0]}
    with tempfile.TemporaryDirectory(prefix="attnviz-bench-") as tmp:
        root = Path(tmp)
        paths = _in_child("capture_texts", str(root), sizes, args.memory_texts)["paths"]
        print(f"attnviz export benchmark: bundled MiniLM (6 layers x 12 heads = 72 PNGs per "
              f"text), {os.cpu_count()} cores\n")
        header = (f"  {'method':<42} {'wall':>9} {'CPU':>9} {'PNG/s':>7} {'faster':>9}  "
                  f"{'x floor (Pillow, attnviz PNG)':>16}   peak RSS\n"
                  f"  {'':<42} {'':>9} {'':>9} {'(wall)':>7} {'than naive':>10}")
        for size in sizes:
            capture_dir = paths[str(size)]
            results: dict[str, dict[str, Any]] = {}
            heads = 12 if args.quick else 72
            for name, function, extra in (("naive", "naive", heads),
                                          ("floor_pillow", "floor", "pillow"),
                                          ("floor_attnviz", "floor", "attnviz")):
                out = root / f"{name}-{size}"
                out.mkdir()
                results[name] = _in_child(function, capture_dir, str(out), extra)
            naive_result = results["naive"]
            naive_per_png = naive_result["cpu"] / naive_result["pngs"]
            floors = {k: results[k]["cpu"] / results[k]["pngs"]
                      for k in ("floor_pillow", "floor_attnviz")}
            results["fast"] = _in_child("fast_heads", capture_dir)
            for jobs in (1, 2):
                out = root / f"export-heads-j{jobs}-{size}"
                results[f"export_heads_j{jobs}"] = _in_child(
                    "export_run", [capture_dir], str(out), jobs, ["heads"])
                out = root / f"export-all-j{jobs}-{size}"
                results[f"export_all_j{jobs}"] = _in_child(
                    "export_run", [capture_dir], str(out), jobs,
                    ["heads", "layers", "overview"])
            annot = "cell values written, " if size <= ANNOT_UP_TO else "no cell values, "
            pixels = " x ".join(str(round(v * 100)) for v in _size(size))
            print(f"{size} tokens ({annot}PNG {pixels} px)")
            print(header)
            extrapolated = " (12 heads, x6)" if args.quick else ""
            print(_row(f"naive seaborn, new figure per head{extrapolated}",
                       {**naive_result, "pngs": 72,
                        "seconds": naive_result["seconds"] / naive_result["pngs"] * 72,
                        "cpu": naive_per_png * 72},
                       naive_per_png, floors))
            print(_row("floor: colour-map + scale + Pillow PNG", results["floor_pillow"],
                       naive_per_png, floors))
            print(_row("floor: colour-map + scale + attnviz PNG", results["floor_attnviz"],
                       naive_per_png, floors))
            print(_row("attnviz fast renderer, 1 process", results["fast"], naive_per_png,
                       floors))
            for jobs in (1, 2):
                print(_row(f"attnviz export, heads only, --jobs {jobs}",
                           results[f"export_heads_j{jobs}"], naive_per_png, floors))
            for jobs in (1, 2):
                result = results[f"export_all_j{jobs}"]
                print(_row(f"attnviz export, all {result['files']} files, --jobs {jobs}",
                           result, naive_per_png, floors))
            fast_per_png = results["fast"]["cpu"] / results["fast"]["pngs"]
            print(f"  targets (CPU time per PNG of the fast renderer): >= 20x faster than naive: "
                  f"{naive_per_png / fast_per_png:.1f}x; <= 3x the raw floor (Pillow): "
                  f"{fast_per_png / floors['floor_pillow']:.2f}x "
                  f"[{fast_per_png / floors['floor_attnviz']:.2f}x the floor written with "
                  f"attnviz's PNG writer]\n")
            whole = whole_processes(capture_dir, root, args.quick)
            ours, theirs = whole["attnviz"], whole["seaborn"]
            note = " (seaborn: 12 heads, extrapolated to 72)" if args.quick else ""
            print(f"  whole process{note}: attnviz export --from DUMP {ours['seconds']:.2f} s "
                  f"wall, {ours['cpu']:.2f} s CPU; seaborn loop over the 72 heads "
                  f"{theirs['seconds']:.2f} s wall, {theirs['cpu']:.2f} s CPU")
            print(f"  whole-process ratio at {size} tokens (target >= 10x): "
                  f"{theirs['cpu'] / ours['cpu']:.1f}x CPU, "
                  f"{theirs['seconds'] / ours['seconds']:.1f}x wall\n")
            report[f"tokens_{size}"] = {"naive_per_png": naive_per_png, "results": results,
                                        "naive_heads_timed": heads, "whole_process": whole}
        # Memory against the number of texts: 1 text vs N texts, same settings.
        extra = [paths[f"extra{i}"] for i in range(args.memory_texts)]
        one = _in_child("export_run", extra[:1], str(root / "mem1"), 1, ["heads"])
        many = _in_child("export_run", extra, str(root / "memN"), 1, ["heads"])
        print(f"memory vs texts (export --jobs 1, 32-token texts, heads): 1 text "
              f"{one['peak_mb']:.0f} MB, {len(extra)} texts {many['peak_mb']:.0f} MB peak RSS "
              f"({many['seconds'] / len(extra):.2f} s per text)")
        report["memory"] = {"one": one, "many": many, "texts": len(extra)}
        cold, cached = heatmap_wall(str(root / "cache"), str(root))
        print(f"attnviz heatmap wall time (subprocess): cold cache {cold:.2f} s, cached "
              f"{cached:.2f} s ({cold / cached:.1f}x)")
        report["heatmap"] = {"cold": cold, "cached": cached}
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, default=str), encoding="utf-8")


def _size(tokens: int) -> tuple[float, float]:
    from attnviz.render.heatmap import head_figure_size

    return head_figure_size(tokens)


if __name__ == "__main__":
    main()
