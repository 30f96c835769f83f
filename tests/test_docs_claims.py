"""What README.md and docs/ claim about installing and about speed can be checked: the install
line works from a checkout, and every speed figure names the benchmark that reproduces it."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# A ratio ("12x", "0.23x") or "N times faster", on a line about time, memory or speed.
FIGURE = re.compile(r"\b\d+(?:\.\d+)?x\b(?! ?\d)|\btimes (?:faster|slower)\b")
ABOUT_SPEED = re.compile(r"faster|slower|speed|time|memory|RSS|p50|seconds|peak", re.I)
BENCHMARK = re.compile(r"benchmarks/(bench_\w+\.py)")


def _sections(path: Path) -> list[tuple[int, list[str]]]:
    """The file's sections (a heading to the next), each with its first line number."""
    sections: list[tuple[int, list[str]]] = []
    lines: list[str] = []
    start, fenced = 1, False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if line.startswith("```"):
            fenced = not fenced
        if line.startswith("#") and not fenced:
            sections.append((start, lines))
            lines, start = [], number
        lines.append(line)
    sections.append((start, lines))
    return sections


def unnamed_speed_figures(path: Path) -> list[str]:
    """Lines with a speed figure in a section that names no existing benchmark script."""
    found = []
    for start, lines in _sections(path):
        named = [name for name in BENCHMARK.findall("\n".join(lines))
                 if (ROOT / "benchmarks" / name).is_file()]
        if named:
            continue
        found += [f"{path.name}:{start + offset}: {line.strip()}"
                  for offset, line in enumerate(lines)
                  if FIGURE.search(line) and ABOUT_SPEED.search(line)]
    return found


def test_every_speed_figure_names_its_benchmark():
    documents = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    assert len(documents) > 3
    unnamed = [line for path in documents for line in unnamed_speed_figures(path)]
    assert not unnamed, "\n".join(unnamed)


def test_the_rule_catches_a_figure_without_a_command(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("## Speed\n\nIt is 40 to 70 times faster than a seaborn loop.\n\n"
                    "## Other\n\nBatching is 2.7x faster (`python benchmarks/bench_memory.py`).\n",
                    encoding="utf-8")
    assert unnamed_speed_figures(page) == ["page.md:3: It is 40 to 70 times faster than a "
                                           "seaborn loop."]


def test_the_first_install_command_works_from_a_checkout():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    install = readme.split("## Install", 1)[1]
    commands = [line.split("#")[0].strip() for line in install.splitlines()
                if line.startswith("pip install")]
    assert commands[0] == "pip install .", commands  # attnviz is not on PyPI
    assert (ROOT / "pyproject.toml").is_file()
    assert all(command != "pip install attnviz" for command in commands)


def test_export_speed_agrees_between_readme_and_docs():
    """docs/export.md and README give the same whole-export ratios (both from bench_export)."""
    pattern = re.compile(r"runs (\d+)x \(36 tokens\)\s+to (\d+)x \(128 tokens\) faster")
    readme = pattern.findall((ROOT / "README.md").read_text(encoding="utf-8"))
    docs = pattern.findall((ROOT / "docs" / "export.md").read_text(encoding="utf-8"))
    assert readme and docs and set(readme) == set(docs), (readme, docs)
    assert "40 to 70 times" not in (ROOT / "docs" / "export.md").read_text(encoding="utf-8")


def _alti_rows(minilm, distance):  # type: ignore[no-untyped-def]
    """Per-layer ALTI of MiniLM (float64 ``[layer, query, key]``) with ``distance(output,
    vectors)`` as the L1 distance: attnviz's own loop (attnviz.measures.alti) otherwise."""
    import torch

    from attnviz.measures._collect import (
        adapter_for,
        block_vectors,
        collect,
        layer_parts,
        layers_of,
    )

    enc, _ = minilm.encode("The cat sat on the mat because it was warm.", None, None)
    inputs = minilm._model_inputs(enc)
    adapter = adapter_for(minilm.config, "alti")
    with torch.inference_mode():
        records = collect(minilm.model, inputs, adapter)
    layers = []
    for index, (layer, record) in enumerate(zip(layers_of(minilm.model, adapter), records)):
        batch, heads, tokens, _ = record.probs.shape
        parts = layer_parts(layer, adapter, heads)
        out = torch.zeros(batch, tokens, tokens, dtype=torch.float64)
        for rows, vectors, output in block_vectors(record, parts, heads, adapter, index):
            closeness = (output.abs().sum(-1)[:, :, None] - distance(output, vectors)).clamp(
                min=0)
            out[:, rows] = closeness / closeness.sum(-1, keepdim=True)
        layers.append(out[0])
    return torch.stack(layers)


def test_the_alti_reference_differs_by_pairwise_distances_eps_only(minilm):
    """docs/analysis.md: the authors' L1 distance is ``pairwise_distance(..., p=1)``, whose
    ``eps=1e-6`` is added to every component; that, and nothing else, is the difference."""
    import torch
    from torch.nn.functional import pairwise_distance

    def exact(output, vectors):  # type: ignore[no-untyped-def]
        return (output[:, :, None, :] - vectors).abs().sum(-1)

    def reference(eps):  # type: ignore[no-untyped-def]
        def distance(output, vectors):  # type: ignore[no-untyped-def]
            return pairwise_distance(output[:, :, None, :].expand_as(vectors), vectors, p=1,
                                     eps=eps)
        return distance

    ours = _alti_rows(minilm, exact)
    with_eps = (_alti_rows(minilm, reference(1e-6)) - ours).abs().amax(dim=(1, 2))
    without = (_alti_rows(minilm, reference(0.0)) - ours).abs().max()
    assert float(without) < 1e-9  # the same computation once eps is gone
    assert 3e-5 < float(with_eps.max()) < 5e-5, with_eps  # "a few 1e-5" (3.4e-5 here)
    text = (ROOT / "docs" / "analysis.md").read_text(encoding="utf-8")
    assert "pairwise_distance(..., p=1)" in text and "eps=1e-6" in text
    assert "unbiased=False" in text and "d0f1468" in text
    assert torch.isfinite(ours).all()
