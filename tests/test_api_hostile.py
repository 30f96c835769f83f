"""The Python API given wrong things: clear attnviz errors, nothing lost, no silent wrong numbers.

Each case is what a careless or hostile caller of ``Capture``, ``Session``, ``show`` and the
analysis functions may pass; the answer must be a :class:`~attnviz.errors.UsageError` (or a
subclass) that says what to pass instead, never an error from deep inside numpy or matplotlib.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import attnviz
from attnviz.capture import Capture, load_capture
from attnviz.errors import DumpError, UsageError

UNIFORM = [np.full((1, 2, 3, 3), 1 / 3, dtype=np.float32)]  # one layer, batch 1, 2 heads
TOKENS = ["a", "b", "c"]


@pytest.fixture(scope="module")
def toy() -> Capture:
    session = attnviz.Session(use_cache=False)
    return session.capture("The cat sat on the mat", model="toy", toy={"layers": 2, "heads": 4})


def test_a_failed_save_keeps_the_capture_already_there(tmp_path: Path) -> None:
    good = Capture.from_attentions(UNIFORM, TOKENS)
    good.save(tmp_path / "c")
    before = {p.name: p.read_bytes() for p in (tmp_path / "c").iterdir()}
    for bad in ({"t": object()}, {"x": {"nested": {1, 2}}}):
        broken = Capture.from_attentions(UNIFORM, TOKENS, meta=bad)
        with pytest.raises(UsageError, match=rf"meta\[{next(iter(bad))!r}\] is not JSON data"):
            broken.save(tmp_path / "c")
    assert {p.name: p.read_bytes() for p in (tmp_path / "c").iterdir()} == before
    np.testing.assert_array_equal(load_capture(tmp_path / "c").weights, good.weights)


def test_numpy_values_in_meta_are_saved_as_numbers(tmp_path: Path) -> None:
    cap = Capture.from_attentions(UNIFORM, TOKENS,
                                  meta={"t": np.float32(1.5), "ids": np.arange(3)})
    cap.save(tmp_path / "c")
    meta = json.loads((tmp_path / "c" / "capture.json").read_text(encoding="utf-8"))["meta"]
    assert meta["t"] == 1.5 and meta["ids"] == [0, 1, 2]


@pytest.mark.parametrize("mask", [
    np.array([[0.0, 0.0, -1e9, -1e9]]),  # an additive (extended) mask
    np.array([[1.0, 0.5, 0.0, 0.0]]),
    np.array([["1", "1", "0", "0"]]),
])
def test_masks_other_than_zero_one_are_refused(mask: np.ndarray) -> None:
    weights = np.zeros((1, 1, 1, 4, 4), np.float32)
    weights[..., :2] = 0.5
    with pytest.raises(UsageError, match="0 .padding. and 1 .real tokens. only"):
        Capture.from_attentions(weights, ["[CLS]", "hi", "[PAD]", "[PAD]"], attention_mask=mask)
    kept = Capture.from_attentions(weights, ["[CLS]", "hi", "[PAD]", "[PAD]"],
                                   attention_mask=np.array([[True, True, False, False]]))
    assert kept.tokens == ["[CLS]", "hi"]


def test_rows_of_zeros_are_not_attention() -> None:
    with pytest.raises(UsageError, match="row of query 0 .layer 0, head 0. is all 0"):
        Capture.from_attentions([np.zeros((1, 1, 3, 3), np.float32)], TOKENS)


@pytest.mark.parametrize(("options", "fragment"), [
    ({"layers": [2_000_000]}, "layers must lie in 0..999999"),
    ({"num_layers": 10**12}, "num_layers must be a whole number from 1 to 1000000"),
    ({"num_heads": 0}, "num_heads must be a whole number from 1 to 1000000"),
])
def test_from_attentions_keeps_to_what_load_capture_accepts(options: dict[str, Any],
                                                             fragment: str) -> None:
    with pytest.raises(UsageError, match=fragment):
        Capture.from_attentions(UNIFORM, TOKENS, **options)


def test_token_ids_outside_the_vocabulary() -> None:
    class Tokenizer:  # ids 0..3 and 40: a vocabulary with a gap, as a WordLevel one may have
        vocab = {0: "[UNK]", 1: "a", 2: "b", 3: "c", 40: "d"}

        def __len__(self) -> int:
            return len(self.vocab)

        def convert_ids_to_tokens(self, ids: list[int]) -> list[str | None]:
            if any(i > 2**63 for i in ids):
                raise OverflowError("int too big to convert")
            return [self.vocab.get(i) for i in ids]

    for ids, fragment in (([-5, 1, 2], "token id -5 is not in"), ([1, 2, 7], "token id 7 is"),
                          ([1, 2, 10**30], "cannot turn these ids into tokens")):
        with pytest.raises(UsageError, match=fragment):
            Capture.from_attentions(UNIFORM, ids, tokenizer=Tokenizer())
    assert Capture.from_attentions(UNIFORM, [1, 2, 40], tokenizer=Tokenizer()).tokens == [
        "a", "b", "d"]


@pytest.mark.parametrize(("call", "fragment"), [
    (lambda c: c.matrix(0, 1.5), "head must be a whole number"),
    (lambda c: c.matrix(0, True), "head must be a whole number"),
    (lambda c: c.matrix("0", 0), "layer must be a whole number"),
    (lambda c: c.matrix(0.5, 0), "layer must be a whole number"),
    (lambda c: c.heatmap(0, "max"), 'or "mean"'),
    (lambda c: c.heatmap(0, None), "head must be a whole number"),
    (lambda c: c.heatmap(0, 1, dpi=10**6), "dpi must be a whole number from 20 to 600"),
    (lambda c: c.heatmap(0, 1, dpi=0), "dpi must be a whole number from 20 to 600"),
    (lambda c: c.heatmap(0, 1, tokens=5), "tokens must be a window"),
    (lambda c: c.heatmap(0, 1, words="yes"), "words must be True or False"),
    (lambda c: c.show(heads=[]), "heads=.. selects no head"),
])
def test_wrong_types_are_usage_errors(toy: Capture, call: Any, fragment: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    with pytest.raises(UsageError, match=fragment):
        call(toy)


def test_numpy_integers_are_whole_numbers(toy: Capture) -> None:
    np.testing.assert_array_equal(toy.matrix(np.int64(-1), np.int32(2)), toy.matrix(1, 2))


def test_rollout_start_layer_types(toy: Capture) -> None:
    from attnviz.analysis.rollout import rollout

    for bad in ("1", None, 1.5, True):
        with pytest.raises(UsageError, match="layer must be a whole number"):
            rollout(toy, start_layer=bad)


@pytest.mark.parametrize(("texts", "options", "fragment"), [
    ([("a", 5)], {}, "text 0 must be a .text, pair. of strings"),
    ([(5, None)], {}, "text 0 must be a .text, pair. of strings"),
    (["a"], {"batch_size": "8"}, "batch size .* must be a whole number from 1 to 1024"),
    (["a"], {"batch_size": None}, "batch size"),
    (["a"], {"batch_size": 2.5}, "batch size"),
    (["a"], {"batch_size": 10**9}, "batch size"),
])
def test_session_captures_checks_its_arguments(texts: list[Any], options: dict[str, Any],
                                               fragment: str) -> None:
    session = attnviz.Session(use_cache=False)
    with pytest.raises(UsageError, match=fragment):
        list(session.captures(texts, model="toy", **options))


def test_head_table_checks_the_induction_scores_shape() -> None:
    from attnviz.analysis.stats import head_table

    cap = attnviz.Session(use_cache=False).capture(
        "The cat sat on the mat", model="toy", toy={"layers": 3, "heads": 2}, layers="1,2")
    for scores in (np.array([[0.9, 0.9], [0, 0], [0, 0]]), np.ones((1, 2))):
        with pytest.raises(UsageError, match="the induction scores have shape"):
            head_table(cap, induction=scores)
    rows = head_table(cap, induction=np.array([[0.9, 0.0], [0.0, 0.0]]))
    assert [(r["layer"], r["head"], r["induction"]) for r in rows][:2] == [(1, 0, 0.9),
                                                                          (1, 1, 0.0)]


def test_a_huge_shape_in_a_memory_mapped_capture(tmp_path: Path) -> None:
    Capture.from_attentions(UNIFORM, TOKENS).save(tmp_path / "c")
    header = "{'descr': '<f4', 'fortran_order': False, 'shape': (100000, 100000, 100000, 100000), }"
    header = header.ljust(117) + "\n"
    (tmp_path / "c" / "attention.npy").write_bytes(b"\x93NUMPY\x01\x00"
                                                   + len(header).to_bytes(2, "little")
                                                   + header.encode("latin1"))
    for mmap in (True, False):
        with pytest.raises(DumpError):
            load_capture(tmp_path / "c", mmap=mmap)


def test_the_quantised_report_weights_keep_their_bound() -> None:
    """float32 products land on .5 and used to round the wrong way, just past the bound."""
    from attnviz.render.html import dequantise, quantise

    weights = np.random.default_rng(0).random(400_000).astype(np.float32)
    weights[:2] = [0.8661402464, 1.0]
    for bits in (8, 16):
        top = (1 << bits) - 1
        error = np.abs(quantise(weights, bits).astype(np.float64) / top - weights)
        assert error.max() <= 1 / (2 * top)
        back = dequantise(quantise(weights, bits), bits)
        assert back.dtype == np.float32 and np.abs(back - weights).max() <= 1 / (2 * top) + 1e-7


@pytest.mark.parametrize(("call", "python", "cli"), [
    (lambda s: s.capture("a b c d e f", model="toy", max_tokens=3, truncate=False),
     "pass max_tokens=6 to take it whole, or truncate=True", "pass --max-tokens 6"),
    (lambda s: s.capture("a", model="toy", toy={"heads": 3, "d_model": 16}),
     "toy['d_model']=16 is not divisible by toy['heads']=3", "--d-model 16"),
    # the hint names no command: the same words fit every command and Python
    (lambda s: s.capture("   ", model="toy"), 'e.g. "The cat sat on the mat"',
     'give a sentence, e.g. "The cat sat on the mat"'),
    (lambda s: list(s.captures(["a b c d"], model="toy", max_tokens=2, truncate=False))[0],
     None, None),
])
def test_errors_name_keywords_for_python_and_options_for_the_cli(
        call: Any, python: str | None, cli: str | None, invoke: Any) -> None:
    from attnviz.errors import AttnvizError

    session = attnviz.Session(use_cache=False)
    try:
        result = call(session)
    except AttnvizError as error:
        assert python is not None and python in str(error), str(error)
        assert "--" not in str(error)
    else:  # captures() reports a bad text as an InputError item, in Python's words too
        assert python is None and isinstance(result, AttnvizError)
        assert "max_tokens=2" in str(result) and "--" not in str(result)
        return
    cli_session = attnviz.Session(use_cache=False, python=False)  # what the CLI runs
    with pytest.raises(AttnvizError) as cli_error:
        call(cli_session)
    assert cli is not None and cli in str(cli_error.value)


@pytest.mark.parametrize(("message", "expected"), [
    ("cannot write /tmp/--model/x.png", "cannot write /tmp/--model/x.png"),
    ("not ('python train.py --model bert --layers 3', 1)",
     "not ('python train.py --model bert --layers 3', 1)"),
    ("--model /tmp/My Models/bert is a folder", "model /tmp/My Models/bert is a folder"),
    ("did you mean --model toy?", "did you mean model='toy'?"),
    ("use --dtype bfloat16, or --device-map auto", "use dtype='bfloat16', or device_map='auto'"),
    ("pass --max-tokens 6 or --truncate", "pass max_tokens=6 or truncate=True"),
    ('give a sentence, e.g. attnviz heatmap "The cat sat"', 'give a sentence, e.g. "The cat sat"'),
])
def test_python_wording_leaves_paths_and_quoted_text_alone(message: str, expected: str) -> None:
    from attnviz.errors import _python_text

    assert _python_text(message) == expected


def test_remote_session_speaks_python_too() -> None:
    from attnviz.server.client import RemoteSession

    with pytest.raises(UsageError) as error:
        RemoteSession("http://127.0.0.1:9").capture("x", model="toy", revision="main")
    assert "--" not in str(error.value) and "revision" in str(error.value)
    with pytest.raises(UsageError) as shaped:
        attnviz.Session().shape("toy", toy={"heads": 3})
    assert "toy['heads']=3" in str(shaped.value)

