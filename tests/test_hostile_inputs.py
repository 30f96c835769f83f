"""Hostile inputs: unbounded sizes, lying capture sidecars, empty captures, typed special tokens.

Families covered: a ``-k`` far larger than the number of keys, standard input that never ends,
a text far longer than the toy model's limit (each must be bounded, with a message naming the
limit and the override); sidecars with infinities, wrong types, duplicate indices or weights that
are not attention, and captures with no tokens or no layers (a clear error from every command,
never a traceback); special tokens typed in the text (flagged like the ones the tokenizer adds).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from attnviz.capture import Capture, load_capture
from attnviz.errors import DumpError, InputError

TOY = ["--model", "toy"]
SENTENCE = "The cat sat on the mat"


def _clean(result: Any, code: int, *fragments: str) -> str:
    output = result.stdout + result.stderr
    assert result.exit_code == code, output
    for fragment in fragments:
        assert fragment in output, output
    assert "Traceback" not in output
    return output


# =========================================================================== family 8: bounds
# ---------------------------------------------------------------- top-k with a huge -k
@pytest.mark.parametrize("k", [10**7, 3_000_000_000])
@pytest.mark.parametrize("fmt", ["markdown", "json", "csv", "table"])
def test_top_k_beyond_the_keys_lists_every_key(invoke, fmt, k):
    result = invoke("top-k", SENTENCE, *TOY, "-l", "0", "--head", "0", "-k", str(k), "-f", fmt)
    output = _clean(result, 0)
    tokens = SENTENCE.split()
    if fmt == "json":
        data = json.loads(result.stdout)
        assert data["k"] == len(tokens)
        assert [len(row["top"]) for row in data["rows"]] == [len(tokens)] * len(tokens)
        for row in data["rows"]:
            assert sorted(t["key_index"] for t in row["top"]) == list(range(len(tokens)))
    elif fmt == "csv":
        lines = result.stdout.strip().splitlines()
        assert len(lines) == 1 + len(tokens) ** 2
    elif fmt == "markdown":
        header = result.stdout.splitlines()[2]
        assert header.count("top ") == len(tokens)
        assert f"top {len(tokens) + 1}" not in output
        assert len(result.stdout) < 10_000
    else:
        assert f"top {len(tokens)}" in output and len(output) < 20_000


def test_top_k_beyond_the_keys_in_a_causal_model(invoke):
    result = invoke("top-k", SENTENCE, *TOY, "--causal", "-l", "0", "--head", "1",
                    "-k", "99999999999", "-f", "json")
    _clean(result, 0)
    rows = json.loads(result.stdout)["rows"]
    assert [len(row["top"]) for row in rows] == [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize("k", [7, 10**12, 2**80])
def test_top_k_function_clamps_k(k):
    from attnviz.analysis.topk import top_k, topk_rows

    rng = np.random.default_rng(1)
    matrix = rng.random((5, 6))
    result = top_k(matrix, k)
    expected = np.argsort(-matrix, axis=1, kind="stable")
    assert [entry.keys for entry in result] == expected.tolist()
    rows = topk_rows(matrix, list("abcdef"), k)
    assert [len(row["top"]) for row in rows] == [6] * 5  # type: ignore[arg-type]


# ---------------------------------------------------------------- endless standard input
def test_stdin_over_the_limit_is_refused(invoke, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ATTNVIZ_MAX_INPUT_MB", "0.001")  # 1048 bytes
    result = invoke("heatmap", "-", *TOY, "-o", "x.png", input="word " * 1000)
    _clean(result, 2, "ATTNVIZ_MAX_INPUT_MB", "1048")
    assert not (tmp_path / "x.png").exists()
    small = invoke("top-k", "-", *TOY, "-l", "0", "--head", "0", "-f", "json",
                   input="word " * 200)
    _clean(small, 0)
    assert len(json.loads(small.stdout)["rows"]) == 200


@pytest.mark.parametrize("value", ["nan", "-1", "inf", "lots", "1e999"])
def test_bad_input_limit_names_the_variable(invoke, monkeypatch, tmp_path, value):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ATTNVIZ_MAX_INPUT_MB", value)
    result = invoke("top-k", "-", *TOY, "-l", "0", "--head", "0", input="a b c")
    _clean(result, 2, "ATTNVIZ_MAX_INPUT_MB")


def _limit_memory() -> None:  # pragma: no cover - runs in the child
    os.setsid()
    resource.setrlimit(resource.RLIMIT_AS, (3 * 1024**3, 3 * 1024**3))


def test_stdin_from_dev_zero_stops_at_the_limit(tmp_path):
    """A real process reading /dev/zero stops at the default limit with a clear message."""
    env = {**os.environ, "ATTNVIZ_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("ATTNVIZ_MAX_INPUT_MB", None)
    with open("/dev/zero", "rb") as zero:
        process = subprocess.Popen([sys.executable, "-m", "attnviz", "heatmap", "-", *TOY],
                                   stdin=zero, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   cwd=tmp_path, env=env, preexec_fn=_limit_memory)
        try:
            _, err = process.communicate(timeout=120)
        finally:
            if process.poll() is None:
                os.killpg(process.pid, 9)
                process.wait()
    stderr = err.decode()
    assert process.returncode == 2, stderr
    assert "ATTNVIZ_MAX_INPUT_MB" in stderr and "MB" in stderr
    assert "Traceback" not in stderr


# ---------------------------------------------------------------- the toy model's length limit
def _words(count: int) -> str:
    return " ".join(f"w{i % 97}" for i in range(count))


def test_toy_model_truncates_at_its_limit():
    from attnviz.models.toy import DEFAULT_MAX_TOKENS, ToySource

    source = ToySource(device="cpu")
    assert source.max_tokens == DEFAULT_MAX_TOKENS
    capture = source.capture(_words(DEFAULT_MAX_TOKENS + 500))
    assert capture.num_tokens == DEFAULT_MAX_TOKENS
    assert capture.weights.shape[-1] == DEFAULT_MAX_TOKENS
    message = capture.meta["warnings"][0]
    assert str(DEFAULT_MAX_TOKENS) in message and "--max-tokens" in message
    with pytest.raises(InputError) as info:
        source.capture(_words(DEFAULT_MAX_TOKENS + 1), truncate=False)
    assert str(DEFAULT_MAX_TOKENS) in str(info.value) and "--max-tokens" in str(info.value)
    exact = source.capture(_words(DEFAULT_MAX_TOKENS), truncate=False)
    assert exact.num_tokens == DEFAULT_MAX_TOKENS and not exact.meta["warnings"]


def test_toy_max_tokens_raises_or_lowers_the_limit():
    from attnviz.models.toy import DEFAULT_MAX_TOKENS, ToySource

    source = ToySource(device="cpu")
    longer = source.capture(_words(DEFAULT_MAX_TOKENS + 10), max_tokens=DEFAULT_MAX_TOKENS + 10,
                            truncate=False)
    assert longer.num_tokens == DEFAULT_MAX_TOKENS + 10
    np.testing.assert_allclose(longer.weights.sum(-1), 1.0, atol=1e-5)
    shorter = source.capture(_words(50), max_tokens=5)
    assert shorter.num_tokens == 5 and "--max-tokens" in shorter.meta["warnings"][0]


def test_toy_cli_long_text(invoke, tmp_path):
    from attnviz.models.toy import DEFAULT_MAX_TOKENS

    text = _words(DEFAULT_MAX_TOKENS + 100)
    refused = invoke("dump", text, *TOY, "--no-truncate", "-o", tmp_path / "a")
    _clean(refused, 2, str(DEFAULT_MAX_TOKENS), "--max-tokens")
    assert not (tmp_path / "a").exists()
    kept = invoke("dump", text, *TOY, "-o", tmp_path / "b")
    _clean(kept, 0, "Warning:", str(DEFAULT_MAX_TOKENS), "--max-tokens")
    assert load_capture(tmp_path / "b").num_tokens == DEFAULT_MAX_TOKENS


def test_toy_30k_words_is_truncated_not_gigabytes(invoke, tmp_path):
    """The issue's case: 30,000 words asked the toy for 7.2 GB."""
    from attnviz.models.toy import DEFAULT_MAX_TOKENS

    result = invoke("top-k", _words(30_000), *TOY, "-l", "0", "--head", "0", "-k", "1",
                    "-f", "csv", "--no-cache")
    _clean(result, 0, "30000", str(DEFAULT_MAX_TOKENS), "--max-tokens")
    assert len(result.stdout.strip().splitlines()) == 1 + DEFAULT_MAX_TOKENS


def test_toy_memory_guard_names_the_way_out(invoke):
    result = invoke("top-k", _words(30_000), *TOY, "--toy-heads", "64", "--d-model", "64",
                    "--max-tokens", "30000", "-l", "0", "--head", "0", "--no-cache")
    _clean(result, 2, "memory", "--max-tokens")


def test_toy_explain_refuses_a_text_past_the_limit(invoke):
    from attnviz.models.toy import DEFAULT_MAX_TOKENS

    result = invoke("explain", _words(DEFAULT_MAX_TOKENS + 1), "--token", "w1")
    _clean(result, 2, str(DEFAULT_MAX_TOKENS))


# =========================================================================== families 10 and 11
def _good_capture(tokens: int = 3, causal: bool = False) -> Capture:
    rng = np.random.default_rng(0)
    weights = rng.random((2, 2, tokens, tokens)).astype(np.float32)
    if causal:
        weights = np.tril(weights)
    weights /= weights.sum(-1, keepdims=True)
    names = [f"t{i}" for i in range(tokens)]
    return Capture(tokens=names, word_ids=list(range(tokens)), special=[False] * tokens,
                   weights=weights, layers=[0, 1], heads=[0, 1], num_layers=2, num_heads=2,
                   model="toy", causal=causal, text=" ".join(names))


Mutation = Callable[[dict[str, Any], np.ndarray], tuple[dict[str, Any], np.ndarray]]


def _dump(folder: Path, change: Mutation | None = None, raw: dict[str, str] | None = None,
          capture: Capture | None = None, float16: bool = False) -> Path:
    """Save a good capture, then let ``change`` rewrite its sidecar and weights.

    ``raw`` replaces quoted placeholders in the JSON text with literal JSON (``1e999``).
    """
    (capture or _good_capture()).save(folder, float16=float16)
    side = folder / "capture.json"
    meta = json.loads(side.read_text())
    weights = np.load(folder / "attention.npy")
    if change is not None:
        meta, weights = change(meta, weights)
        np.save(folder / "attention.npy", weights)
    text = json.dumps(meta)
    for placeholder, literal in (raw or {}).items():
        text = text.replace(json.dumps(placeholder), literal)
    side.write_text(text)
    return folder


def _set(**fields: Any) -> Mutation:
    def change(meta: dict[str, Any], weights: np.ndarray) -> tuple[dict[str, Any], np.ndarray]:
        meta.update(fields)
        return meta, weights

    return change


def _weights(edit: Callable[[np.ndarray], np.ndarray], **fields: Any) -> Mutation:
    def change(meta: dict[str, Any], weights: np.ndarray) -> tuple[dict[str, Any], np.ndarray]:
        weights = edit(weights.copy())
        meta.update(fields)
        meta["shape"] = list(weights.shape)
        return meta, weights

    return change


def _negative(w: np.ndarray) -> np.ndarray:
    w[0, 1, 0] = [-0.5, 1.0, 0.5]  # query 0: also seen by a memory-mapped load
    return w


def _zero_tokens(w: np.ndarray) -> np.ndarray:
    return np.zeros((2, 2, 0, 0), np.float32)


def _upper(w: np.ndarray) -> np.ndarray:
    w[1, 0, 0] = [0.5, 0.5, 0.0]
    return w


def _zero_row(w: np.ndarray) -> np.ndarray:
    w[0, 0, 1] = 0.0
    return w


NO_TOKENS = {"tokens": [], "word_ids": [], "special": [], "display_tokens": []}

# name -> (mutation, raw replacements, fragment of the message)
BAD_SIDECARS: dict[str, tuple[Mutation, dict[str, str], str]] = {
    # ---- family 10: numbers JSON can hold but Python cannot turn into indices
    "num_layers 1e999": (_set(num_layers="@X"), {"@X": "1e999"}, "num_layers"),
    "num_heads -Infinity": (_set(num_heads="@X"), {"@X": "-Infinity"}, "num_heads"),
    "num_layers NaN": (_set(num_layers="@X"), {"@X": "NaN"}, "num_layers"),
    "layers with 1e999": (_set(layers=[0, "@X"]), {"@X": "1e999"}, "layers"),
    "shape with Infinity": (_set(shape=["@X", 2, 3, 3]), {"@X": "Infinity"}, "shape"),
    "word_ids with 1e999": (_set(word_ids=[0, "@X", 2]), {"@X": "1e999"}, "word_ids"),
    "num_layers 1e30": (_set(num_layers=10**30), {}, "num_layers"),
    "no tokens": (_weights(_zero_tokens, **NO_TOKENS), {}, "no tokens"),
    "no layers": (_weights(lambda w: w[:0], layers=[]), {}, "no layers"),
    "no heads": (_weights(lambda w: w[:, :0], heads=[]), {}, "no heads"),
    "num_layers 0": (_weights(lambda w: w[:0], layers=[], num_layers=0), {}, "num_layers"),
    # ---- family 11: fields that lie about their type
    "causal is a string": (_set(causal="false"), {}, "causal"),
    "causal is 0": (_set(causal=0), {}, "causal"),
    "model is a dict": (_set(model={"name": "toy"}), {}, "model"),
    "model is a number": (_set(model=7), {}, "model"),
    "text is a list": (_set(text=["a"]), {}, "text"),
    "pair is a number": (_set(pair=3), {}, "pair"),
    "tokens are numbers": (_set(tokens=[1, 2, 3]), {}, "tokens"),
    "special is text": (_set(special=["no", "no", "no"]), {}, "special"),
    "word_ids hold text": (_set(word_ids=[0, "1", 2]), {}, "word_ids"),
    "word_ids hold a bool": (_set(word_ids=[0, True, 2]), {}, "word_ids"),
    "negative word id": (_set(word_ids=[-1, 0, 1]), {}, "word_ids"),
    "display_tokens are numbers": (_set(display_tokens=[1, 2, 3]), {}, "display_tokens"),
    "meta is a list": (_set(meta=[1]), {}, "meta"),
    "num_layers is true": (_set(num_layers=True), {}, "num_layers"),
    "num_layers is a string": (_set(num_layers="2"), {}, "num_layers"),
    "num_heads is 2.0": (_set(num_heads=2.0), {}, "num_heads"),
    "format_version from the future": (_set(format_version=99), {}, "format_version"),
    "layers is not a list": (_set(layers="0,1"), {}, "layers"),
    "duplicate layers": (_set(layers=[0, 0]), {}, "layers"),
    "duplicate heads": (_set(heads=[1, 1]), {}, "heads"),
    "layer index out of range": (_set(layers=[0, 5]), {}, "layers"),
    "axes reordered": (_set(axes=["head", "layer", "query", "key"]), {}, "axes"),
    "negative weights": (_weights(_negative), {}, "negative"),
    "rows sum to 2": (_weights(lambda w: w * 2), {}, "sum to 1"),
    "rows sum to 0.5": (_weights(lambda w: w * 0.5), {}, "sum to 1"),
    "causal with weight on the future": (_weights(_upper), {}, "causal"),
}
CAUSAL_CASES = {"causal with weight on the future"}


def _bad_dump(root: Path, name: str) -> Path:
    change, raw, _ = BAD_SIDECARS[name]
    capture = _good_capture(causal=name in CAUSAL_CASES)
    return _dump(root / name.replace(" ", "_"), change, raw, capture=capture)


@pytest.mark.parametrize("name", list(BAD_SIDECARS))
@pytest.mark.parametrize("mmap", [False, True])
def test_lying_sidecars_are_refused_with_the_field_named(tmp_path, name, mmap):
    folder = _bad_dump(tmp_path, name)
    with pytest.raises(DumpError) as info:
        load_capture(folder, mmap=mmap)
    assert BAD_SIDECARS[name][2] in str(info.value)
    assert "Traceback" not in str(info.value)


@pytest.mark.parametrize("change", [
    None,
    _weights(_zero_row),  # a row with every key excluded sums to 0
    _set(pair=None, meta={}, display_tokens=[]),
])
def test_honest_sidecars_still_load(tmp_path, change):
    folder = _dump(tmp_path / "ok", change)
    capture = load_capture(folder)
    assert capture.num_tokens == 3 and capture.layers == [0, 1]


def test_float16_rows_within_tolerance_load(tmp_path):
    rng = np.random.default_rng(3)
    weights = rng.random((1, 2, 400, 400)).astype(np.float32) ** 8
    weights /= weights.sum(-1, keepdims=True)
    capture = Capture(tokens=[f"t{i}" for i in range(400)], word_ids=list(range(400)),
                      special=[False] * 400, weights=weights, layers=[0], heads=[0, 1],
                      num_layers=1, num_heads=2, model="toy", causal=False, text="t")
    capture.save(tmp_path / "half", float16=True)
    loaded = load_capture(tmp_path / "half")
    assert np.abs(loaded.weights - weights).max() < 5e-4


def test_causal_capture_loads(tmp_path):
    folder = _dump(tmp_path / "causal", capture=_good_capture(causal=True))
    assert load_capture(folder).causal is True


def test_shape_mismatch_names_both_shapes(tmp_path):
    folder = _dump(tmp_path / "lie", _set(shape=[9, 9, 9, 9]))
    with pytest.raises(DumpError) as info:
        load_capture(folder)
    message = str(info.value)
    assert "[9, 9, 9, 9]" in message and "(2, 2, 3, 3)" in message
    wrong = _dump(tmp_path / "wrong")
    np.save(wrong / "attention.npy", np.zeros((2, 2, 4, 4), np.float32))
    with pytest.raises(DumpError) as info:
        load_capture(wrong)
    message = str(info.value)
    assert "(2, 2, 4, 4)" in message and "(2, 2, 3, 3)" in message


COMMANDS: dict[str, list[str]] = {
    "heatmap": ["heatmap", "--from", "{D}", "-o", "x.png"],
    "top-k": ["top-k", "--from", "{D}", "-l", "0", "--head", "0"],
    "dump": ["dump", "--from", "{D}", "-o", "copy"],
    "heads": ["heads", "--from", "{D}"],
    "rollout": ["rollout", "--from", "{D}", "-o", "r.png"],
    "html": ["html", "--from", "{D}", "-o", "r.html"],
    "export": ["export", "--from", "{D}", "-o", "out"],
    "compare": ["compare", "--from", "{D}", "--from", "{D}", "--layer", "0", "--head", "0",
                "-o", "c.png"],
}
EVERY_COMMAND_CASES = ["num_layers 1e999", "num_heads -Infinity", "no tokens", "no layers",
                       "causal is a string", "rows sum to 2"]


@pytest.fixture(scope="module")
def bad_dumps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("bad-dumps")
    for name in EVERY_COMMAND_CASES:
        _bad_dump(root, name)
    return root


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("name", EVERY_COMMAND_CASES)
def test_every_command_refuses_a_bad_capture(invoke, bad_dumps, tmp_path, monkeypatch, command,
                                              name):
    monkeypatch.chdir(tmp_path)
    folder = bad_dumps / name.replace(" ", "_")
    before = sorted(p.name for p in folder.iterdir())
    args = [a.replace("{D}", str(folder)) for a in COMMANDS[command]]
    result = invoke(*args)
    _clean(result, 1, BAD_SIDECARS[name][2])
    assert sorted(p.name for p in folder.iterdir()) == before
    # export lists the failed capture in its index; nothing else may be written
    leftovers = [p for p in tmp_path.rglob("*") if p.is_file()
                 and not (command == "export" and p.name.startswith("index."))]
    assert not leftovers, leftovers


# =========================================================================== family 12
def _special_ids(tokenizer: Any) -> set[int]:
    """The tokenizer's special ids, except an unknown-word id of its own."""
    ids = set(tokenizer.all_special_ids)
    named = {getattr(tokenizer, f"{n}_token_id", None)
             for n in ("bos", "eos", "sep", "cls", "pad", "mask")}
    if tokenizer.unk_token_id is not None and tokenizer.unk_token_id not in named:
        ids.discard(tokenizer.unk_token_id)
    return ids


def _expected_special(source: Any, text: str) -> list[bool]:
    ids = source.tokenizer(text)["input_ids"]
    specials = _special_ids(source.tokenizer)
    return [i in specials for i in ids]


TYPED = ["The cat [SEP] sat on the mat", "[CLS] [CLS] twice", "a [MASK] here and [PAD] there",
         "ends with [SEP]"]


@pytest.mark.parametrize("text", TYPED)
def test_typed_special_tokens_are_flagged_in_minilm(minilm, text):
    capture = minilm.capture(text)
    expected = _expected_special(minilm, text)
    assert capture.special == expected
    assert sum(expected) > 2  # the typed ones beside [CLS] ... [SEP]
    for flag, word in zip(capture.special, capture.word_ids):
        assert (word is None) == flag
    batch = minilm.capture_batch([text, SENTENCE])
    assert batch[0].special == expected


def test_unknown_words_are_not_special(minilm):
    capture = minilm.capture("a \U0001f600 b")
    assert "[UNK]" in capture.tokens
    assert capture.special == [True, False, False, False, True]


def test_typed_sep_counts_in_the_sep_statistic_and_exclusion(minilm):
    from attnviz.analysis.stats import stat_sums
    from attnviz.analysis.tokens import token_view

    text = "The cat [SEP] sat on the mat"
    capture = minilm.capture(text)
    typed = capture.tokens.index("[SEP]")
    assert 0 < typed < capture.num_tokens - 1
    ids = minilm.tokenizer(text)["input_ids"]
    specials = _special_ids(minilm.tokenizer)
    mask = np.array([i in specials and p > 0 for p, i in enumerate(ids)])
    expected = capture.weights[..., mask].sum(-1).mean(-1)  # [layer, head]
    np.testing.assert_allclose(stat_sums(capture).means()["sep"], expected, rtol=1e-6)
    view = token_view(capture, exclude_special=True)
    assert "[SEP]" not in view.tokens and "[CLS]" not in view.tokens
    assert view.num_tokens == capture.num_tokens - 3


def test_cli_exclude_special_drops_a_typed_sep(invoke, cli_minilm):
    result = invoke("top-k", "The cat [SEP] sat on the mat", "-l", "0", "--head", "0",
                    "--exclude-special", "-f", "json", "-k", "99")
    _clean(result, 0)
    rows = json.loads(result.stdout)["rows"]
    keys = {t["key"] for row in rows for t in row["top"]}
    assert "[SEP]" not in keys and "[SEP]" not in {row["query"] for row in rows}
    assert len(rows) == 6


def test_typed_sep_in_tiny_gpt2(tiny_gpt2_dir):
    from attnviz.models.hf import HFSource

    source = HFSource(str(tiny_gpt2_dir), device="cpu")
    text = "hello [SEP] world"
    capture = source.capture(text)
    assert capture.special == _expected_special(source, text)
    assert capture.special[capture.tokens.index("[SEP]")] is True


@pytest.fixture(scope="module")
def bpe_gpt2_dir(tiny_gpt2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny GPT-2 with a byte-level BPE tokenizer whose only special is <|endoftext|>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GPT2TokenizerFast

    folder = tmp_path_factory.mktemp("bpe-gpt2")
    for item in tiny_gpt2_dir.iterdir():
        if item.name.startswith(("config", "model")) or item.suffix == ".safetensors":
            shutil.copy(item, folder / item.name)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ["The cat sat on the mat.", "Hello world, the dog ran.", "A story ends here."] * 20
    tokenizer.train_from_iterator(corpus, trainer)
    wrapped = GPT2TokenizerFast(tokenizer_object=tokenizer, bos_token="<|endoftext|>",
                                eos_token="<|endoftext|>", unk_token="<|endoftext|>")
    wrapped.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(bos_token_id=0, eos_token_id=0)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_typed_endoftext_in_gpt2_is_special(bpe_gpt2_dir):
    from attnviz.models.hf import HFSource

    source = HFSource(str(bpe_gpt2_dir), device="cpu")
    text = "Hello world.<|endoftext|>The cat sat"
    capture = source.capture(text)
    assert "<|endoftext|>" in capture.tokens
    at = capture.tokens.index("<|endoftext|>")
    assert capture.special[at] is True and capture.word_ids[at] is None
    assert sum(capture.special) == 1
    assert capture.special == _expected_special(source, text)
    batch = source.capture_batch([text, "The dog ran"])
    assert batch[0].special == capture.special


# --------------------------------------------------------------------------- nothing left to show
ONLY_SPECIAL = "[CLS] [SEP]"  # typed special tokens: the whole input is special


@pytest.mark.parametrize("args", [
    ["heatmap", ONLY_SPECIAL, "--layer", "0", "--head", "0", "-o", "{o}/x.png"],
    ["heatmap", "[SEP]", "--layer", "0", "-o", "{o}/x.png"],
    ["heatmap", "[CLS]", "--words", "-o", "{o}/x.png"],
    ["top-k", ONLY_SPECIAL, "--layer", "0", "--head", "0"],
    ["heads", ONLY_SPECIAL],
    ["rollout", ONLY_SPECIAL, "-o", "{o}/r.png"],
    ["compare", ONLY_SPECIAL, "[SEP] [CLS]", "--layer", "0", "--head", "0", "-o", "{o}/c.png"],
])
def test_exclude_special_leaving_nothing_is_a_usage_error(invoke, cli_minilm, tmp_path: Path,
                                                          args: list[str]) -> None:
    """Only special tokens with --exclude-special: exit 2 with a message, nothing written."""
    out = tmp_path / "out"
    out.mkdir()
    result = invoke(*[a.replace("{o}", str(out)) for a in args], "--exclude-special")
    _clean(result, 2, "no tokens are left after --exclude-special", "[CLS]")
    assert list(out.iterdir()) == []


def test_export_fails_only_the_text_with_nothing_left(invoke, cli_minilm, tmp_path: Path
                                                       ) -> None:
    out = tmp_path / "out"
    result = invoke("export", ONLY_SPECIAL, SENTENCE, "--exclude-special", "--layers", "0",
                    "--figures", "overview", "--jobs", "1", "-o", out)
    _clean(result, 1, "no tokens are left after --exclude-special")
    index = json.loads((out / "index.json").read_text(encoding="utf-8"))
    statuses = {entry["text"]: entry["status"] for entry in index["texts"]}
    assert statuses == {ONLY_SPECIAL: "failed", SENTENCE: "exported"}
    folders = [p.name for p in out.iterdir() if p.is_dir()]
    assert len(folders) == 1 and folders[0].startswith("the-cat")  # no partial folder


def test_heads_over_a_corpus_skips_the_text_with_nothing_left(invoke, cli_minilm,
                                                               tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(f"{ONLY_SPECIAL}\n{SENTENCE}\n", encoding="utf-8")
    result = invoke("heads", "--input", corpus, "--exclude-special", "--format", "csv")
    output = _clean(result, 0)
    assert "skipped a text (no tokens are left" in output
    assert result.stdout.count("\n") == 1 + 6 * 12  # header and every head, from one text


@pytest.mark.parametrize(("args", "flags"), [
    (["rollout", "a b", *TOY, "-o", "{o}/r.png", "--bar", "{o}/r.png"], "--out and --bar"),
    (["rollout", "a b", *TOY, "--token", "b", "-o", "{o}/r.png", "--bar", "{o}/./r.png"],
     "--out and --bar"),
    (["rollout", "a b", *TOY, "--token", "b", "-o", "{o}/r.png", "--npy", "{o}/r_bar_b.npy",
      "--bar", "{o}/r_bar_b.png"], None),
    (["heads", "a b", *TOY, "--plot", "{o}/h.png", "-o", "{o}/h.png"], "--out and --plot"),
])
def test_two_outputs_never_name_one_file(invoke, tmp_path: Path, args: list[str],
                                         flags: str | None) -> None:
    out = tmp_path / "out"
    out.mkdir()
    result = invoke(*[a.replace("{o}", str(out)) for a in args])
    if flags is None:  # distinct names: all three written
        _clean(result, 0)
        assert sorted(p.name for p in out.iterdir()) == ["r.png", "r_bar_b.npy", "r_bar_b.png"]
        return
    _clean(result, 2, f"{flags} both name", "one file would replace the other")
    assert list(out.iterdir()) == []
