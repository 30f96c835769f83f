"""One record, many storages: a short text captured full (every weight in an array) and long
(queries, keys and log-sum-exp) from the same tiny model answers every question of
:class:`attnviz.record.AttentionRecord` alike, within 1e-6, through the library and through
the command line (same tables in every format, same titles, same errors).
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

TOL = 1e-6
TEXT = "the cat sat on the mat while a dog ran past her house and birds sang"


@pytest.fixture(scope="module")
def sharp_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama (grouped-query attention, RoPE) with sharp attention: top-k has clear
    winners, so the order of keys is no coin toss between the two storages."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaModel

    from attnviz.models.hf import bundled_model_path

    torch.manual_seed(1)
    config = LlamaConfig(vocab_size=30522, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128)
    model = LlamaModel(config)
    with torch.no_grad():
        for layer in model.layers:
            layer.self_attn.q_proj.weight.mul_(6.0)
            layer.self_attn.k_proj.weight.mul_(6.0)
    out = tmp_path_factory.mktemp("sharp-llama")
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(bundled_model_path()).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def both(sharp_llama: Path) -> dict[str, Any]:
    """The same text as a full capture and as a long one."""
    from attnviz.request import CaptureRequest
    from attnviz.session import Session

    session = Session()
    full = session.run(CaptureRequest(text=TEXT, model=str(sharp_llama), long=False,
                                      use_cache=False))
    long = session.run(CaptureRequest(text=TEXT, model=str(sharp_llama), long=True))
    assert full.finest_block == 1 and long.finest_block > 1  # two storages, really
    assert type(full).__name__ == "Capture" and type(long).__name__ == "LongCapture"
    return {"full": full, "long": long}


def test_metadata_is_the_same(both: dict[str, Any]) -> None:
    full, long = both["full"], both["long"]
    for name in ("tokens", "display_tokens", "word_ids", "special", "num_tokens", "layers",
                 "heads", "num_layers", "num_heads", "causal", "text", "pair", "measure",
                 "measure_label", "rows_sum_to_one", "title_start", "model_label",
                 "mean_label"):
        assert getattr(full, name) == getattr(long, name), name
    assert full.num_tokens > 10 and full.causal


QUESTIONS = {
    "tile": lambda r, layer, head: r.tile(layer, head, 2, 9, 0, 7),
    "rows": lambda r, layer, head: r.rows(layer, head, 3, r.num_tokens),
    "topk values": lambda r, layer, head: r.topk(layer, head, 4)[1],
    "topk indices": lambda r, layer, head: r.topk(layer, head, 4, 1, 8)[0],
    "atlas sums": lambda r, layer, head: r.atlas(layer, head, 16)[0],
    "atlas maxes": lambda r, layer, head: r.atlas(layer, head, 16)[1],
    "received": lambda r, layer, head: r.received(layer, head),
    "seen by": lambda r, layer, head: r.seen_by(layer),
}


@pytest.mark.parametrize("question", sorted(QUESTIONS))
@pytest.mark.parametrize(("layer", "head"), [(0, 1), (1, 3), (-1, "mean"), (1, -2)])
def test_every_question_has_one_answer(both: dict[str, Any], question: str, layer: int,
                                       head: int | str) -> None:
    ask = QUESTIONS[question]
    full = np.asarray(ask(both["full"], layer, head))
    long = np.asarray(ask(both["long"], layer, head))
    assert full.shape == long.shape and full.dtype == long.dtype
    np.testing.assert_allclose(long, full, atol=TOL, rtol=0)


def test_statistics_sinks_and_every_weight(both: dict[str, Any]) -> None:
    full, long = both["full"], both["long"]
    stats_full, stats_long = full.head_stats(), long.head_stats()
    assert sorted(stats_full) == sorted(stats_long)
    for name in stats_full:
        np.testing.assert_allclose(stats_long[name], stats_full[name], atol=TOL, rtol=0,
                                   err_msg=name)
    for threshold in (0.05, 0.1, 0.3):
        np.testing.assert_allclose(long.sinks(threshold), full.sinks(threshold), atol=TOL)
    assert full.sinks(0.05).max() > 0  # some token draws attention: the answer is not empty
    dense = long.dense("a test")
    np.testing.assert_allclose(dense.weights, full.weights, atol=TOL, rtol=0)
    assert dense.dense("again") is dense


def test_the_answers_are_attention_itself(both: dict[str, Any]) -> None:
    """An independent check: the full capture's answers from its own array by numpy."""
    full = both["full"]
    matrix = np.asarray(full.weights[1, 2], dtype=np.float64)
    order = np.argsort(-matrix, axis=1, kind="stable")[:, :3]
    indices, values = full.topk(1, 2, 3)
    for i in range(full.num_tokens):
        visible = [j for j in order[i] if j <= i]
        assert list(indices[i][:len(visible)]) == visible
        assert all(j == -1 for j in indices[i][len(visible):])
    np.testing.assert_allclose(values[indices >= 0],
                               np.take_along_axis(matrix, np.maximum(indices, 0), 1)[indices >= 0],
                               atol=1e-7)
    sums, maxes = full.atlas(1, 2, 32)  # one block holds the text
    size = full.num_tokens
    assert sums.shape == (1, 1) and abs(float(sums[0, 0]) - size) < 1e-4
    assert float(maxes[0, 0]) == pytest.approx(matrix.max(), abs=1e-7)
    np.testing.assert_allclose(full.received(1, 2), matrix.sum(axis=0), atol=1e-6)


@pytest.mark.parametrize("ask", [
    lambda r: r.tile(5, 0, 0, 1, 0, 1),
    lambda r: r.tile(0, 9, 0, 1, 0, 1),
    lambda r: r.tile(0, "every", 0, 1, 0, 1),
    lambda r: r.tile(0, 0, 3, 3, 0, 1),
    lambda r: r.rows(0, 0, 0, r.num_tokens + 1),
    lambda r: r.topk(0, 0, 0),
    lambda r: r.topk(0, 0, 5000),
    lambda r: r.atlas(0, 0, 48),
    lambda r: r.received(-3, 0),
    lambda r: r.sinks(1.5),
    lambda r: r.layer_index(2),
    lambda r: r.head_index(-5),
])
def test_the_same_errors(both: dict[str, Any], ask: Any) -> None:
    from attnviz.errors import UsageError

    messages = []
    for kind in ("full", "long"):
        with pytest.raises(UsageError) as caught:
            ask(both[kind])
        messages.append((caught.value.message, caught.value.hint))
    assert messages[0] == messages[1]


def test_a_layer_not_held_reads_the_same(sharp_llama: Path) -> None:
    from attnviz.errors import UsageError
    from attnviz.request import CaptureRequest
    from attnviz.session import Session

    session = Session()
    records = [session.run(CaptureRequest(text=TEXT, model=str(sharp_llama), long=long,
                                          layers="1", use_cache=False))
               for long in (False, True)]
    messages = []
    for record in records:
        with pytest.raises(UsageError) as caught:
            record.tile(0, 0, 0, 1, 0, 1)
        messages.append(caught.value.message)
    assert messages[0] == messages[1] == "layer 0 is not in this capture: it holds layers 1"


# --------------------------------------------------------------------------- the command line
def _run(invoke: Any, *args: str) -> Any:
    result = invoke(*args)
    assert result.exit_code == 0, (result.stdout, result.stderr)
    return result


def _numbers(text: str) -> list[float]:
    import re

    return [float(x) for x in re.findall(r"-?\d+\.\d+", text)]


@pytest.mark.parametrize("fmt", ["json", "csv", "markdown", "table"])
@pytest.mark.parametrize("head", ["2", "mean"])
def test_top_k_prints_the_same_table(invoke: Any, sharp_llama: Path, fmt: str,
                                     head: str) -> None:
    outputs = [_run(invoke, "top-k", TEXT, "--model", str(sharp_llama), flag, "--no-cache",
                    "-l", "1", "--head", head, "-k", "3", "-f", fmt).stdout
               for flag in ("--no-long", "--long")]
    full, long = outputs
    if fmt == "json":
        a, b = json.loads(full), json.loads(long)
        assert a["title"] == b["title"] and a["k"] == b["k"] == 3
        for x, y in zip(a["rows"], b["rows"], strict=True):
            assert [t["key_index"] for t in x["top"]] == [t["key_index"] for t in y["top"]]
            assert [t["key"] for t in x["top"]] == [t["key"] for t in y["top"]]
            np.testing.assert_allclose([t["weight"] for t in x["top"]],
                                       [t["weight"] for t in y["top"]], atol=TOL)
    elif fmt == "csv":
        a_rows = list(csv.reader(io.StringIO(full)))
        b_rows = list(csv.reader(io.StringIO(long)))
        assert a_rows[0] == b_rows[0] and len(a_rows) == len(b_rows) > 10
        for x, y in zip(a_rows[1:], b_rows[1:]):
            assert x[:5] == y[:5] and abs(float(x[5]) - float(y[5])) <= 2e-6
    else:  # the words are the same; the numbers (3 decimals) agree to their last digit
        strip = [text.splitlines() for text in outputs]
        assert len(strip[0]) == len(strip[1])
        for x, y in zip(strip[0], strip[1]):
            assert "".join(c for c in x if not c.isdigit()) == \
                "".join(c for c in y if not c.isdigit())
        np.testing.assert_allclose(_numbers(long), _numbers(full), atol=1e-3)


@pytest.mark.parametrize("fmt", ["json", "csv"])
def test_heads_prints_the_same_table(invoke: Any, sharp_llama: Path, fmt: str) -> None:
    full, long = (_run(invoke, "heads", TEXT, "--model", str(sharp_llama), flag, "--no-cache",
                       "--no-induction", "-f", fmt).stdout
                  for flag in ("--no-long", "--long"))
    if fmt == "json":
        a, b = json.loads(full), json.loads(long)
        assert a["title"] == b["title"] and a["tokens"] == b["tokens"]
        assert a["sinks"] == b["sinks"] and "tokens" in a["sinks"]
        for x, y in zip(a["heads"], b["heads"], strict=True):
            assert x["layer"] == y["layer"] and x["head"] == y["head"]
            assert x["label"] == y["label"]
            for key, value in x.items():
                if isinstance(value, float):
                    assert abs(value - y[key]) <= 1e-5, key
    else:
        a_rows = list(csv.reader(io.StringIO(full)))
        b_rows = list(csv.reader(io.StringIO(long)))
        assert a_rows[0] == b_rows[0] and len(a_rows) == len(b_rows) == 9
        np.testing.assert_allclose(_numbers(long), _numbers(full), atol=1e-5)


@pytest.mark.parametrize("args", [
    ("top-k", "-l", "5", "--head", "0"),
    ("top-k", "-l", "0", "--head", "7"),
    ("top-k", "-l", "-3", "--head", "mean"),
    ("heatmap", "-l", "2"),
])
def test_the_same_errors_on_the_command_line(invoke: Any, sharp_llama: Path,
                                             args: tuple[str, ...]) -> None:
    results = [invoke(args[0], TEXT, "--model", str(sharp_llama), flag, *args[1:])
               for flag in ("--no-long", "--long")]
    for result in results:
        assert result.exit_code == 2 and "Traceback" not in result.stderr
    assert results[0].stderr == results[1].stderr


def test_a_window_is_drawn_with_the_same_labels(invoke: Any, sharp_llama: Path,
                                                tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The same window of the same head: the same title and token labels on both paths."""
    import matplotlib.figure

    titles: list[list[str]] = []
    original = matplotlib.figure.Figure.savefig

    def spy(self: Any, *args: Any, **kwargs: Any) -> Any:
        import matplotlib.text

        titles.append([t.get_text() for t in self.findobj(matplotlib.text.Text)
                       if t.get_text().strip()])
        return original(self, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", spy)
    for flag in ("--no-long", "--long"):
        _run(invoke, "heatmap", TEXT, "--model", str(sharp_llama), flag, "--no-cache", "-l",
             "1", "--head", "2", "--tokens", "2:9", "-o", str(tmp_path / f"w{flag}.png"))
    assert len(titles) == 2 and titles[0] and titles[0] == titles[1]


def test_readme_names_the_questions_both_answer() -> None:
    import re

    from attnviz.capture import Capture
    from attnviz.long import LongCapture

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    start = readme.index("returns a `LongCapture` (`tile`") + len("returns a `LongCapture` ")
    section = " ".join(readme[start:].split())[:400]
    assert "A full `Capture` answers the same questions" in section
    assert "within 1e-6" in section  # what the tests above hold it to
    named = re.findall(r"`(\w+)`", section[:section.index(")")])
    assert {"tile", "topk", "atlas", "head_stats", "sinks", "received"} <= set(named)
    for name in named:
        assert callable(getattr(Capture, name)) and callable(getattr(LongCapture, name))
