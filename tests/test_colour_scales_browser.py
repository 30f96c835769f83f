"""The front end's colour scales equal the command line's: defaults, mapping and colour bar.

``report.js`` (the HTML report, the notebook view and the live page share it) is run in
headless Chromium and its scale functions are compared value by value with
:class:`attnviz.render.heatmap.ColourScale`, the code behind ``--scale``, ``--gamma`` and
``--vmax``.
Then a report paints a heatmap and its pixels are compared with the colours the figures give the
same (8-bit) weights.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from attnviz.capture import Capture
from attnviz.errors import UsageError
from attnviz.render import colours, heatmap
from attnviz.render.html import colour_scale, decode_weights, read_report_data, write_report
from tests._browser import watch

pytestmark = pytest.mark.slow

REPORT_JS = Path(heatmap.__file__).parent / "assets" / "report.js"


@pytest.fixture(scope="module")
def scales_page(browser: Any) -> Iterator[Any]:
    """A blank page with report.js loaded as a script (its scale functions are globals)."""
    context = browser.new_context()
    page = context.new_page()
    outside: list[str] = []
    errors: list[str] = []
    watch(context, page, ("about:", "data:"), outside, errors)
    page.set_content("<!DOCTYPE html><html><body></body></html>")
    page.add_script_tag(content=REPORT_JS.read_text(encoding="utf-8"))
    yield page
    assert outside == [] and errors == []
    context.close()


def test_defaults_and_colour_map_are_the_command_lines(scales_page: Any) -> None:
    js = scales_page.evaluate("({...ATTNVIZ_SCALE, lut: Array.from(ATTNVIZ_VIRIDIS)})")
    assert js["kind"] == heatmap.DEFAULT_SCALE == "power"
    assert js["gamma"] == heatmap.DEFAULT_GAMMA == 0.5
    assert js["vmax"] == heatmap.DEFAULT_VMAX == "auto"
    assert sorted(js["kinds"]) == sorted(heatmap.SCALES)
    assert tuple(js["gammaRange"]) == heatmap.GAMMA_RANGE
    assert js["vmaxLimit"] == heatmap.VMAX_LIMIT
    assert js["logDecades"] == heatmap.LOG_DECADES
    table = heatmap.colour_table("viridis")
    assert js["bins"] == table.size
    assert np.array_equal(np.array(js["lut"], dtype=np.uint8).reshape(-1, 3), table.rgb)
    assert colour_scale() == {"scale": "power", "gamma": 0.5, "vmax": "auto"}


SCALES = [("power", 0.5, "auto"), ("power", 0.3, "auto"), ("power", 2.0, 1.0),
          ("linear", 0.5, "auto"), ("linear", 0.5, 0.25), ("log", 0.5, "auto"),
          ("log", 0.5, 1.0), ("power", 0.5, 0.05)]


@pytest.mark.parametrize(("kind", "gamma", "vmax"), SCALES)
def test_mapping_equals_the_figures(scales_page: Any, kind: str, gamma: float,
                                    vmax: str | float) -> None:
    rng = np.random.default_rng(7)
    # Attention-like weights, and the edges: 0, the top, above it, far below it, denormals.
    matrix = rng.dirichlet(np.full(12, 0.3), size=12).astype(np.float32)
    edges = np.array([0.0, 1.0, 0.5, 1e-7, 1e-30, 0.001, 0.999, 0.25], dtype=np.float32)
    values = np.concatenate([matrix.ravel(), edges])
    scale = heatmap.ColourScale.of(kind, gamma if kind == "power" else None, vmax)
    resolved = scale.resolve(matrix)
    units = resolved.unit(values)
    bins = heatmap.colour_table("viridis").unit_bins(units)
    got = scales_page.evaluate(
        """([kind, gamma, vmax, matrix, values]) => {
             const scale = attnvizCheckScale(kind, gamma, vmax);
             const resolved = attnvizResolveScale(scale, [new Float32Array(matrix)]);
             const units = values.map((v) => attnvizScaleUnit(resolved, v));
             return {top: resolved.top, auto: resolved.auto, units,
                     bins: units.map(attnvizScaleBin),
                     ticks: attnvizScaleTicks(resolved), label: attnvizScaleLabel(resolved)};
           }""",
        [kind, gamma, vmax, matrix.ravel().tolist(), values.astype(np.float64).tolist()])
    assert got["top"] == resolved.top and got["auto"] == resolved.auto
    np.testing.assert_allclose(got["units"], units, rtol=1e-12, atol=1e-15)
    assert got["bins"] == bins.tolist()
    assert [t["unit"] for t in got["ticks"]] == resolved.tick_units()
    np.testing.assert_allclose([t["value"] for t in got["ticks"]], resolved.tick_values(),
                               rtol=1e-12)
    assert [t["label"] for t in got["ticks"]] == resolved.tick_labels()
    assert got["label"] == resolved.label().replace("\n", ", ").split(", ", 1)[1]


@pytest.mark.parametrize(("kind", "gamma", "vmax"), [
    ("spline", 0.5, "auto"), ("power", 0.01, "auto"), ("power", 6, "auto"),
    ("power", "nan", "auto"), ("linear", 0.5, 0), ("linear", 0.5, -1), ("log", 0.5, 2e6),
    ("log", 0.5, "many")])
def test_invalid_scales_are_refused_alike(scales_page: Any, kind: str, gamma: Any,
                                          vmax: Any) -> None:
    with pytest.raises(UsageError):
        heatmap.ColourScale(kind, float(gamma), heatmap.parse_vmax(vmax)).check()
    assert scales_page.evaluate("a => attnvizCheckScale(...a)", [kind, gamma, vmax]) is None


def _capture() -> Capture:
    rng = np.random.default_rng(3)
    weights = rng.dirichlet(np.full(7, 0.4), size=(2, 3, 7)).astype(np.float32)
    tokens = ["[CLS]", "the", "cat", "sat", "on", "it", "[SEP]"]
    return Capture.from_attentions(weights, tokens, model="toy", text="the cat sat on it")


@pytest.mark.parametrize(("fragment", "kind", "gamma", "vmax", "label"), [
    ("", "power", 0.5, "auto", "sqrt scale, top = max shown"),
    ("&scale=log", "log", 0.5, "auto", "log scale, top = max shown"),
    ("&scale=power&gamma=1.5&vmax=1", "power", 1.5, 1.0, "power 1.5 scale, top = 1.00 (fixed)"),
    ("&scale=1", "linear", 0.5, 1.0, "linear scale, top = 1.00 (fixed)"),  # an older address
])
def test_report_paints_the_figures_colours(browser: Any, tmp_path: Path, fragment: str,
                                           kind: str, gamma: float, vmax: str | float,
                                           label: str) -> None:
    capture = _capture()
    path = write_report([capture], tmp_path / "report.html")
    data = read_report_data(path.read_text(encoding="utf-8"))
    weights = decode_weights(data["docs"][0]["weights"])  # what the page holds: 8-bit weights
    context = browser.new_context(viewport={"width": 1100, "height": 900},
                                  device_scale_factor=1)
    try:
        page = context.new_page()
        outside: list[str] = []
        errors: list[str] = []
        watch(context, page, ("file:", "data:"), outside, errors)
        page.goto(path.as_uri() + "#view=heatmap&layer=1&heads=2" + fragment)
        page.wait_for_selector("html[data-ready='1']")
        canvas = page.locator("#hm-canvas")
        assert canvas.get_attribute("data-scale") == label
        assert page.input_value("#scale") == kind
        assert page.is_visible("#gamma") == (kind == "power")
        matrix = weights[1, 2]
        scale = heatmap.ColourScale.of(kind, gamma if kind == "power" else None, vmax)
        expected, _ = scale.resolve(matrix).colours(matrix, heatmap.colour_table("viridis"))
        x0, y0, cell = (float(canvas.get_attribute(f"data-{key}")) for key in ("x0", "y0", "cell"))
        pixels = page.evaluate(
            """([x0, y0, cell, n]) => {
                 const ctx = document.getElementById("hm-canvas").getContext("2d");
                 const out = [];
                 for (let i = 0; i < n; i++) for (let j = 0; j < n; j++) {
                   // a corner of the cell, clear of the value written in its middle
                   const d = ctx.getImageData(Math.floor(x0 + j * cell + 2),
                                              Math.floor(y0 + i * cell + 2), 1, 1).data;
                   out.push([d[0], d[1], d[2]]);
                 }
                 return out;
               }""", [x0, y0, cell, capture.num_tokens])
        assert np.array_equal(np.array(pixels).reshape(expected.shape), expected)
        assert page.evaluate("location.hash").count("scale=") == 1
        assert outside == [] and errors == []
    finally:
        context.close()


def test_scale_controls_change_the_view_and_the_address(browser: Any, tmp_path: Path) -> None:
    path = write_report([_capture()], tmp_path / "report.html")
    context = browser.new_context(viewport={"width": 1100, "height": 900})
    try:
        page = context.new_page()
        page.goto(path.as_uri() + "#view=heatmap")
        page.wait_for_selector("html[data-ready='1']")
        page.select_option("#scale", "log")
        assert page.get_attribute("#hm-canvas", "data-scale") == "log scale, top = max shown"
        assert "scale=log" in page.evaluate("location.hash")
        assert not page.is_visible("#gamma")
        page.select_option("#scale", "power")
        page.fill("#gamma", "9")  # out of range: the scale in use stays, and shows again
        page.dispatch_event("#gamma", "change")
        assert page.input_value("#gamma") == "0.5"
        page.fill("#gamma", "0.25")
        page.dispatch_event("#gamma", "change")
        page.select_option("#vmax", "1")
        assert page.get_attribute("#hm-canvas", "data-scale") == (
            "power 0.25 scale, top = 1.00 (fixed)")
        assert "gamma=0.25&vmax=1" in page.evaluate("location.hash")
        page.click(".tabs button[data-view=model]")
        assert page.get_attribute("#mv-grid", "data-top") == "1"
    finally:
        context.close()


def test_tick_labels_are_written_as_the_figures_write_them(scales_page: Any) -> None:
    values = [0.0, 0.125, 0.135, 0.375, 1.0, 0.5, 0.0625, 0.05, 0.0125, 0.001, 0.00025,
              5e-05, 1.25e-05, 0.09999, 0.099, 1e-07, 2.5, 123.0, 1e6]
    got = scales_page.evaluate("vs => vs.map(attnvizFormatWeight)", values)
    assert got == [colours._format_value(v) for v in values]
