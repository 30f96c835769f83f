"""The HTML report without a browser: structure, escaping, data round-trip, the html command."""

from __future__ import annotations

import base64
import hashlib
import json
import re
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from attnviz.analysis.tokens import exclude_special, merge_words, word_groups
from attnviz.capture import Capture
from attnviz.render import html as report

HOSTILE = [
    "<img src=x onerror=alert(1)>",
    "</script><script>alert(2)</script>",
    "<!--",
    "\"><svg onload=alert(3)>",
    "&amp;&lt;",
    "line\u2028break\u2029",
]


def synthetic_capture(tokens: list[str], *, layers: int = 2, heads: int = 3, seed: int = 0,
                      word_ids: list[int | None] | None = None, text: str | None = None,
                      model: str = "synthetic") -> Capture:
    """A capture with random row-stochastic weights [layer, head, query, key]."""
    rng = np.random.default_rng(seed)
    count = len(tokens)
    logits = rng.normal(size=(layers, heads, count, count)) * 2.0
    weights = np.exp(logits)
    weights /= weights.sum(axis=-1, keepdims=True)
    special = [t in ("[CLS]", "[SEP]") for t in tokens]
    if word_ids is None:
        word_ids = []
        word = 0
        for token, is_special in zip(tokens, special):
            if is_special:
                word_ids.append(None)
            elif token.startswith("##") and word_ids and word_ids[-1] is not None:
                word_ids.append(word - 1)
            else:
                word_ids.append(word)
                word += 1
    return Capture(tokens=list(tokens), word_ids=word_ids, special=special,
                   weights=weights.astype(np.float32), layers=list(range(layers)),
                   heads=list(range(heads)), num_layers=layers, num_heads=heads, model=model,
                   causal=False, text=text if text is not None else " ".join(tokens))


@pytest.fixture
def hostile_capture() -> Capture:
    tokens = ["[CLS]", *HOSTILE, "cat", "##s", "[SEP]"]
    return synthetic_capture(tokens, text="hi " + " ".join(HOSTILE), model="</script><b>m")


def scripts_of(document: str) -> list[str]:
    return re.findall(r"<script\b[^>]*>(.*?)</script>", document, flags=re.DOTALL)


# --------------------------------------------------------------------------- encoding
@pytest.mark.parametrize("bits", [8, 16])
def test_weights_round_trip_within_quantisation_error(bits: int) -> None:
    capture = synthetic_capture(["a", "b", "c", "d", "e"], layers=3, heads=4)
    block = report.encode_weights(capture.weights, bits)
    assert block["bits"] == bits and block["shape"] == [3, 4, 5, 5]
    decoded = report.decode_weights(block)
    assert decoded.shape == capture.weights.shape and decoded.dtype == np.float32
    top = (1 << bits) - 1
    # Independent check: the stored integers are round(w * top) (float32 rounding may tip a
    # value lying on a half step to its neighbour), so the error is at most half a step.
    codes = decoded.astype(np.float64) * top
    np.testing.assert_allclose(codes, np.rint(codes), atol=0.05)
    differ = np.abs(np.rint(codes) - np.rint(capture.weights.astype(np.float64) * top))
    assert differ.max() <= 1 and np.mean(differ > 0) < 0.01
    assert np.abs(decoded - capture.weights).max() <= 0.5 / top + 1e-6


def test_byte_layout_of_16_bit_weights() -> None:
    weights = np.array([0.0, 1.0, 0.5, 1 / 65535], dtype=np.float32).reshape(1, 1, 2, 2)
    raw = __import__("zlib").decompress(base64.b64decode(
        report.encode_weights(weights, 16)["data"]))
    # Byte planes: all low bytes, then all high bytes (little-endian uint16 values).
    values = [0, 65535, 32768, 1]
    assert list(raw) == [v & 0xFF for v in values] + [v >> 8 for v in values]


def test_quantise_clips_and_rejects_unknown_precision() -> None:
    q = report.quantise(np.array([-0.5, 0.0, 0.5, 1.5]), 8)
    assert q.dtype == np.uint8 and q.tolist() == [0, 0, 128, 255]
    with pytest.raises(report.UsageError, match="precision 12"):
        report.quantise(np.zeros(3), 12)


def test_compression_shrinks_peaked_attention() -> None:
    # A diagonal-ish pattern like real heads: mostly near-zero weights compress well.
    count = 64
    weights = np.full((2, 2, count, count), 0.0, dtype=np.float32)
    weights[..., np.arange(count), np.arange(count)] = 1.0
    block = report.encode_weights(weights, 8)
    assert len(block["data"]) < weights.size / 20


# --------------------------------------------------------------------------- escaping
def test_script_json_escapes_html_breakers_and_round_trips() -> None:
    value = {"tokens": HOSTILE, "n": 1}
    text = report.script_json(value)
    for bad in ("<", ">", "&", "\u2028", "\u2029"):
        assert bad not in text
    assert json.loads(text) == value


def test_hostile_tokens_cannot_leave_the_data_script(hostile_capture: Capture) -> None:
    document = report.build_report([hostile_capture])
    # Exactly two script elements: the data and the report's own code.
    assert document.count("<script") == 2
    assert document.lower().count("</script") == 2
    assert "<img" not in document and "<svg" not in document and "<!--" not in document
    assert "alert(" not in scripts_of(document)[1]
    data = report.read_report_data(document)
    doc = data["docs"][0]
    assert doc["tokens"] == hostile_capture.tokens
    assert doc["text"] == hostile_capture.text
    assert doc["model"] == "</script><b>m"
    # The title is HTML-escaped where it is markup.
    title = re.search(r"<title>(.*?)</title>", document, flags=re.DOTALL)
    assert title is not None and "&lt;/script&gt;&lt;b&gt;m" in title.group(1)


def test_title_option_is_escaped(hostile_capture: Capture) -> None:
    document = report.build_report([hostile_capture], title="<script>alert(9)</script>")
    assert "<title>&lt;script&gt;alert(9)&lt;/script&gt;</title>" in document
    assert report.read_report_data(document)["title"] == "<script>alert(9)</script>"


# --------------------------------------------------------------------------- structure
def test_report_is_self_contained(hostile_capture: Capture) -> None:
    full = report.build_report([hostile_capture])
    assert full.startswith("<!DOCTYPE html>")
    # The data (which quotes the hostile tokens as JSON strings) aside, the markup and code:
    document = full.replace(scripts_of(full)[0], "")
    assert '<meta charset="utf-8">' in document
    # No address of anything outside the file.
    assert not re.search(r"https?://|//[a-z0-9.-]+\.[a-z]{2,}/", document, flags=re.IGNORECASE)
    # No tag loads anything: no src attribute, and the only href is the empty data: icon.
    assert not re.search(r"<[a-z][^>]*\ssrc\s*=", document, flags=re.IGNORECASE)
    assert re.findall(r"<[a-z][^>]*\shref\s*=\s*\"([^\"]*)\"", document) == ["data:,"]
    assert "@import" not in document and "url(" not in document


def test_content_security_policy_pins_the_inline_script_and_style() -> None:
    document = report.build_report([synthetic_capture(["a", "b"])])
    policy = re.search(r'http-equiv="Content-Security-Policy" content="([^"]+)"', document)
    assert policy is not None
    directives = dict(part.strip().split(" ", 1) for part in policy.group(1).split(";"))
    assert directives["default-src"] == "'none'"
    script = scripts_of(document)[1]
    style = re.search(r"<style>(.*?)</style>", document, flags=re.DOTALL)
    assert style is not None

    def pin(text: str) -> str:
        digest = base64.b64encode(hashlib.sha256(text.encode()).digest()).decode()
        return f"'sha256-{digest}'"

    assert directives["script-src"] == pin(script)
    assert directives["style-src"] == pin(style.group(1))


def test_report_data_describes_each_capture() -> None:
    first = synthetic_capture(["[CLS]", "un", "##real", "cat", "[SEP]"], layers=2, heads=3)
    second = synthetic_capture(["a", "b", "c"], layers=1, heads=2, seed=1, text="a b c")
    data = report.report_data([first, second], top_k=4, words=True, exclude_special=True)
    assert data["format"] == "attnviz-report" and data["top_k"] == 4
    assert data["initial"] == {"words": True, "special": False}
    assert [len(d["tokens"]) for d in data["docs"]] == [5, 3]
    one, two = data["docs"]
    assert one["layers"] == [0, 1] and one["heads"] == [0, 1, 2]
    assert one["special"] == [True, False, False, False, True]
    assert one["words"]["groups"] == word_groups(first) == [[0], [1, 2], [3], [4]]
    assert one["words"]["labels"] == merge_words(first).display_tokens
    assert one["words"]["special"] == [True, False, False, True]
    assert two["words"] is None  # every word is one token
    assert data["title"] == "attnviz: 2 texts"


def test_word_level_from_stored_data_matches_merge_words() -> None:
    capture = synthetic_capture(["[CLS]", "un", "##real", "##ly", "cat", "[SEP]"])
    doc = report.report_data([capture], precision=16)["docs"][0]
    decoded = report.decode_weights(doc["weights"])
    groups = doc["words"]["groups"]
    # The browser's arithmetic, in numpy: sum over key pieces, mean over query pieces.
    summed = np.stack([decoded[..., g].sum(-1) for g in groups], -1)
    merged = np.stack([summed[:, :, g, :].mean(2) for g in groups], 2)
    np.testing.assert_allclose(merged, merge_words(capture).weights, atol=1e-4)
    keep = [i for i, s in enumerate(doc["words"]["special"]) if not s]
    view = merged[:, :, keep][:, :, :, keep]
    view = view / view.sum(-1, keepdims=True)
    np.testing.assert_allclose(view, exclude_special(merge_words(capture)).weights, atol=1e-4)


def test_stats_panel_only_when_analysis_module_exists(monkeypatch: pytest.MonkeyPatch) -> None:
    capture = synthetic_capture(["a", "b", "c"], layers=1, heads=2)
    fake = types.ModuleType("attnviz.analysis.stats")
    fake.head_table = lambda cap: [  # type: ignore[attr-defined]
        {"layer": 0, "head": h, "label": "self", "entropy": np.float32(0.25), "distance": 1.0,
         "max_weight": float("nan")} for h in cap.heads]
    monkeypatch.setitem(sys.modules, "attnviz.analysis.stats", fake)
    stats = report.doc_data(capture)["stats"]
    assert stats == [{"layer": 0, "head": h, "label": "self", "entropy": 0.25, "distance": 1.0,
                      "max_weight": None} for h in (0, 1)]
    monkeypatch.setitem(sys.modules, "attnviz.analysis.stats", None)  # import fails
    assert report.doc_data(capture)["stats"] is None


def test_too_large_capture_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(report, "MAX_WEIGHTS_PER_TEXT", 10)
    with pytest.raises(report.UsageError, match="too many for a browser report"):
        report.build_report([synthetic_capture(["a", "b", "c"])])


def test_write_report_is_atomic_and_returns_path(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "r.html"
    path = report.write_report([synthetic_capture(["a", "b"])], target, title="T")
    assert path == target and report.read_report_data(path.read_text("utf-8"))["title"] == "T"
    assert [p.name for p in target.parent.iterdir()] == ["r.html"]


def test_read_report_data_rejects_other_files() -> None:
    with pytest.raises(report.UsageError, match="not an attnviz HTML report"):
        report.read_report_data("<html></html>")


# --------------------------------------------------------------------------- command line
def _data_of(path: Path) -> dict:
    return report.read_report_data(path.read_text(encoding="utf-8"))


def test_html_command_with_toy_model(invoke, tmp_path: Path) -> None:
    out = tmp_path / "toy.html"
    result = invoke("html", "The cat sat on the mat", "--model", "toy", "--toy-layers", "2",
                    "--toy-heads", "4", "--d-model", "16", "-o", out, "--precision", "16")
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == str(out)
    doc = _data_of(out)["docs"][0]
    assert doc["weights"]["shape"] == [2, 4, 6, 6] and doc["model"] == "toy"
    from attnviz.models.toy import ToyConfig, ToySource

    expected = ToySource(ToyConfig(d_model=16, heads=4, layers=2)).capture(
        "The cat sat on the mat")
    np.testing.assert_allclose(report.decode_weights(doc["weights"]), expected.weights,
                               atol=1e-5)


def test_html_command_from_dump_with_selection(invoke, tmp_path: Path) -> None:
    capture = synthetic_capture(["[CLS]", "a", "b", "[SEP]"], layers=3, heads=4)
    capture.save(tmp_path / "cap")
    out = tmp_path / "r.html"
    result = invoke("html", "--from", tmp_path / "cap", "--layers", "1-2", "--heads", "0,3",
                    "--words", "--exclude-special", "-k", "2", "-o", out)
    assert result.exit_code == 0, result.output
    data = _data_of(out)
    doc = data["docs"][0]
    assert doc["layers"] == [1, 2] and doc["heads"] == [0, 3]
    assert data["initial"] == {"words": True, "special": False} and data["top_k"] == 2
    np.testing.assert_allclose(report.decode_weights(doc["weights"]),
                               capture.weights[1:3][:, [0, 3]], atol=0.5 / 255 + 1e-7)


def test_html_command_input_file(invoke, tmp_path: Path) -> None:
    source = tmp_path / "texts.txt"
    source.write_text('The cat sat.\n\n{"text": "A dog ran", "pair": "It was fast"}\n'
                      "<b>bold</b> move\n", encoding="utf-8")
    out = tmp_path / "multi.html"
    result = invoke("html", "--input", source, "--model", "toy", "-o", out)
    assert result.exit_code == 0, result.output
    assert "skipped 1 blank line" in result.stderr
    docs = _data_of(out)["docs"]
    assert [d["text"] for d in docs] == ["The cat sat.", "A dog ran", "<b>bold</b> move"]
    assert docs[1]["pair"] == "It was fast"


def test_html_command_input_from_standard_input(invoke, tmp_path: Path) -> None:
    out = tmp_path / "stdin.html"
    result = invoke("html", "--input", "-", "--model", "toy", "-o", out,
                    input="first text\nsecond text\n")
    assert result.exit_code == 0, result.output
    assert [d["text"] for d in _data_of(out)["docs"]] == ["first text", "second text"]


def test_html_command_default_name(invoke, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    result = invoke("html", "Hello world", "--model", "toy")
    assert result.exit_code == 0, result.output
    path = Path(result.stdout.strip())
    assert path.name.startswith("attention_hello-world_") and path.suffix == ".html"
    assert _data_of(tmp_path / path)["docs"][0]["text"] == "Hello world"


@pytest.mark.parametrize(("args", "code", "fragment"), [
    (["--input", "IN", "some text"], 2, "--input cannot be combined"),
    (["--input", "IN", "--pair", "x"], 2, "--pair cannot be used with --input"),
    (["--input", "MISSING"], 2, "does not exist"),
    (["--input", "EMPTY"], 2, "holds no text"),
    (["--input", "BADJSON"], 2, "line 1: invalid JSON"),
    (["text", "--precision", "12"], 2, "--precision 12"),
    (["text", "-o", "report.txt"], 2, "does not end in .html"),
    (["text", "-o", "DIR"], 2, "it is a folder"),
    ([], 2, "give a TEXT"),
])
def test_html_command_errors(invoke, tmp_path: Path, args, code, fragment) -> None:
    (tmp_path / "in.txt").write_text("a text\n", encoding="utf-8")
    (tmp_path / "empty.txt").write_text("\n  \n", encoding="utf-8")
    (tmp_path / "bad.txt").write_text("{not json\n", encoding="utf-8")
    (tmp_path / "adir.html").mkdir()
    names = {"IN": tmp_path / "in.txt", "MISSING": tmp_path / "nope.txt",
             "EMPTY": tmp_path / "empty.txt", "BADJSON": tmp_path / "bad.txt",
             "DIR": tmp_path / "adir.html"}
    result = invoke("html", *[names.get(a, a) for a in args], "--model", "toy")
    assert result.exit_code == code, result.output
    assert fragment in result.stderr
    assert "Traceback" not in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "adir.html", "bad.txt", "empty.txt", "in.txt"]


def test_html_help_imports_nothing_heavy() -> None:
    code = ("import sys\nfrom attnviz.cli import main\n"
            "try:\n    main(['html', '--help'])\nexcept SystemExit:\n    pass\n"
            "heavy = [m for m in ('torch', 'transformers', 'matplotlib', 'seaborn', 'PIL') "
            "if m in sys.modules]\nprint('HEAVY', heavy)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, check=True)
    assert "HEAVY []" in result.stdout, result.stdout + result.stderr
    assert "--precision" in result.stdout
