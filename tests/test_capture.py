"""The capture record: save, load, select, and refuse corrupt dumps."""

import json
import subprocess
import sys

import numpy as np
import pytest

from attnviz.capture import Capture, clean_token, load_capture
from attnviz.errors import DumpError, UsageError


def make_capture(layers=2, heads=3, tokens=4, seed=0) -> Capture:
    rng = np.random.default_rng(seed)
    raw = rng.random((layers, heads, tokens, tokens)).astype(np.float32)
    weights = raw / raw.sum(-1, keepdims=True)
    toks = ["[CLS]"] + [f"w{i}" for i in range(tokens - 2)] + ["[SEP]"]
    return Capture(tokens=toks, word_ids=[None, *range(tokens - 2), None],
                   special=[True] + [False] * (tokens - 2) + [True], weights=weights,
                   layers=list(range(layers)), heads=list(range(heads)), num_layers=layers,
                   num_heads=heads, model="test", causal=False, text="w0 w1")


@pytest.mark.parametrize("name", ["folder", "cap.npy", "cap.json"])
def test_round_trip(tmp_path, name):
    capture = make_capture()
    capture.save(tmp_path / name)
    loaded = load_capture(tmp_path / name)
    np.testing.assert_array_equal(loaded.weights, capture.weights)
    assert loaded.tokens == capture.tokens
    assert loaded.word_ids == capture.word_ids
    assert loaded.special == capture.special
    assert loaded.layers == capture.layers and loaded.heads == capture.heads
    assert not list(tmp_path.rglob("*.tmp"))


def test_files_readable_with_numpy_and_json_alone(tmp_path):
    make_capture().save(tmp_path / "c")
    array = np.load(tmp_path / "c" / "attention.npy", allow_pickle=False)
    sidecar = json.loads((tmp_path / "c" / "capture.json").read_text())
    assert list(array.shape) == sidecar["shape"]
    assert sidecar["axes"] == ["layer", "head", "query", "key"]
    assert sidecar["tokens"][0] == "[CLS]"


def test_float16_storage(tmp_path):
    capture = make_capture()
    capture.save(tmp_path / "c", float16=True)
    assert np.load(tmp_path / "c" / "attention.npy").dtype == np.float16
    loaded = load_capture(tmp_path / "c")
    assert loaded.weights.dtype == np.float32
    assert np.abs(loaded.weights - capture.weights).max() < 5e-4


def test_mmap_reads_slices(tmp_path):
    capture = make_capture()
    capture.save(tmp_path / "c")
    loaded = load_capture(tmp_path / "c", mmap=True)
    assert isinstance(loaded.weights, np.memmap)
    np.testing.assert_array_equal(loaded.matrix(1, 2), capture.weights[1, 2])


def test_select_and_positions():
    capture = make_capture(layers=4, heads=3)
    sub = capture.select([1, 3], [2])
    assert sub.weights.shape == (2, 1, 4, 4)
    np.testing.assert_array_equal(sub.matrix(3, 2), capture.weights[3, 2])
    np.testing.assert_array_equal(sub.matrix(-1, -1), capture.weights[3, 2])
    with pytest.raises(UsageError, match="layer 0 is not in this capture"):
        sub.matrix(0, 2)


def test_clean_token():
    assert clean_token("##ing") == "ing"
    assert clean_token("\u0120cat") == "cat"
    assert clean_token("\u2581the") == "the"
    assert clean_token("\u0120") == "\u2423"


def test_load_does_not_import_torch(tmp_path):
    make_capture().save(tmp_path / "c")
    code = ("import sys; from attnviz.capture import load_capture; "
            f"c = load_capture({str(tmp_path / 'c')!r}); "
            "print(c.weights.shape, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "(2, 3, 4, 4) False"


def test_record_imports_nothing_above_it():
    """capture.py and the modules it is built from import only what lies below the record."""
    import ast
    from pathlib import Path

    import attnviz.capture_format

    below = {"attnviz.capture_build", "attnviz.capture_files", "attnviz.capture_format",
             "attnviz.errors", "attnviz.fileio", "attnviz.reading", "attnviz.selection"}
    folder = Path(attnviz.capture_format.__file__).parent
    for name in ("capture.py", "capture_build.py", "capture_format.py"):
        tree = ast.parse((folder / name).read_text(encoding="utf-8"))
        imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                     for alias in node.names}
        ours = {module for module in imported if module and module.split(".")[0] == "attnviz"}
        assert ours <= below, (name, ours - below)


def test_views_load_figures_and_notebook_on_first_use(tmp_path):
    """Capture.heatmap and a notebook's display go through the views the package root
    registers: nothing that draws is imported before they are called."""
    make_capture().save(tmp_path / "c")
    code = ("import sys; from attnviz.capture import load_capture; "
            f"c = load_capture({str(tmp_path / 'c')!r}); "
            "heavy = ('attnviz.render.heatmap', 'attnviz.notebook', 'matplotlib'); "
            "before = [m for m in heavy if m in sys.modules]; "
            "fig, ax = c.heatmap(1, 2, cmap='magma'); html = c._repr_html_(); "
            "print(before, type(fig).__name__, ax.get_figure() is fig, "
            "'attnviz.notebook' in sys.modules, '<iframe' in html)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[] Figure True True True"


def test_register_view_refuses_unknown_names():
    from attnviz.capture import register_view

    with pytest.raises(ValueError, match="unknown capture view 'plot'"):
        register_view("plot", print)


# ------------------------------------------------------------------------- corrupt dumps
def _corrupt(tmp_path, how):
    folder = tmp_path / "c"
    make_capture().save(folder)
    npy, side = folder / "attention.npy", folder / "capture.json"
    meta = json.loads(side.read_text())
    if how == "missing sidecar":
        side.unlink()
    elif how == "missing weights":
        npy.unlink()
    elif how == "truncated npy":
        npy.write_bytes(npy.read_bytes()[:100])
    elif how == "wrong shape":
        np.save(npy, np.zeros((2, 3, 5, 5), np.float32))
    elif how == "nan":
        arr = np.load(npy)
        arr[1, 2, 3, 1] = np.nan
        np.save(npy, arr)
    elif how == "lying json":
        meta["shape"] = [9, 9, 9, 9]
        side.write_text(json.dumps(meta))
    elif how == "pickle":
        with open(npy, "wb") as handle:
            np.save(handle, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    elif how == "not json":
        side.write_text("{not json")
    elif how == "not a capture":
        side.write_text(json.dumps({"hello": 1}))
    elif how == "int weights":
        np.save(npy, np.zeros((2, 3, 4, 4), np.int64))
    return folder


@pytest.mark.parametrize(("how", "fragment"), [
    ("missing sidecar", "no JSON sidecar"),
    ("missing weights", "has no weights"),
    ("truncated npy", "cannot read"),
    ("wrong shape", "shape"),
    ("nan", "NaN"),
    ("lying json", "shape"),
    ("pickle", "cannot read"),
    ("not json", "cannot read"),
    ("not a capture", "not an attnviz capture"),
    ("int weights", "float32/float16"),
])
def test_corrupt_dumps_are_clear_errors(tmp_path, how, fragment):
    folder = _corrupt(tmp_path, how)
    with pytest.raises(DumpError) as info:
        load_capture(folder)
    assert fragment in str(info.value)


def test_missing_path(tmp_path):
    with pytest.raises(DumpError, match="does not exist"):
        load_capture(tmp_path / "nope")


def test_pickle_payload_never_executes(tmp_path):
    folder = _corrupt(tmp_path, "pickle")
    with pytest.raises(DumpError):
        load_capture(folder)


def test_written_files_have_normal_permissions(tmp_path):
    import os
    import stat

    make_capture().save(tmp_path / "c")
    umask = os.umask(0)
    os.umask(umask)
    mode = stat.S_IMODE((tmp_path / "c" / "attention.npy").stat().st_mode)
    assert mode == 0o666 & ~umask
