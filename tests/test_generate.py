"""Attention of generated tokens: rows recorded beside the model's own kernel and KV cache.

Every recorded row is checked against an eager forward pass of the whole sequence (prompt and
generated tokens) with ``output_attentions=True``; the tokens against ``model.generate``.
"""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from attnviz.errors import DumpError, InputError, ModelLoadError, UsageError
from attnviz.session import Session, make_spec, spec_key

PROMPT = "The cat sat on the mat and looked at the dog"
N = 6
VOCAB = 30522


def _save(model_cls: Any, config: Any, out: Path) -> Path:
    import torch
    from transformers import AutoTokenizer

    from attnviz.models.hf import bundled_model_path

    torch.manual_seed(0)
    model_cls(config).save_pretrained(out)
    AutoTokenizer.from_pretrained(bundled_model_path()).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def lm_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny random causal LMs: Llama with grouped-query attention, GPT-2, Mistral with a
    sliding window of 4 (shorter than prompt + generation), Qwen2 mixing full and
    sliding-window layers."""
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    root = tmp_path_factory.mktemp("causal-lms")
    small = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
             "num_attention_heads": 4, "max_position_embeddings": 128, "bos_token_id": 101,
             "eos_token_id": None}
    return {
        "llama": _save(LlamaForCausalLM, LlamaConfig(num_hidden_layers=2, num_key_value_heads=2,
                                                     **small), root / "llama"),
        "gpt2": _save(GPT2LMHeadModel, GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32,
                                                  n_layer=2, n_head=4, bos_token_id=101,
                                                  eos_token_id=None), root / "gpt2"),
        "mistral": _save(MistralForCausalLM, MistralConfig(
            num_hidden_layers=2, num_key_value_heads=2, sliding_window=4, **small),
            root / "mistral"),
        "qwen2": _save(Qwen2ForCausalLM, Qwen2Config(
            num_hidden_layers=3, num_key_value_heads=1, use_sliding_window=True,
            sliding_window=4, max_window_layers=1,
            layer_types=["full_attention", "sliding_attention", "sliding_attention"], **small),
            root / "qwen2"),
    }


@pytest.fixture(scope="module")
def session() -> Session:
    return Session(use_cache=False, max_models=4)


def eager_reference(folder: Path, ids: list[int], prompt_length: int, steps: int,
                    sample: bool = False) -> tuple[np.ndarray, list[int]]:
    """Rows ``P-1 .. P+steps-2`` over keys ``0 .. P+steps-2`` of an eager forward pass of the
    whole sequence ``[layer, head, step, key]``, and greedy ``model.generate`` tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    with torch.no_grad():
        attentions = model(torch.tensor([ids]), output_attentions=True).attentions
        greedy = model.generate(torch.tensor([ids[:prompt_length]]), max_new_tokens=steps,
                                do_sample=False, pad_token_id=0)
    full = np.stack([a[0].numpy() for a in attentions])  # (L, H, T, T)
    end = prompt_length + steps - 1
    return full[:, :, prompt_length - 1:end, :end], [int(i) for i in greedy[0]]


@pytest.mark.parametrize("name", ["llama", "gpt2", "mistral", "qwen2"])
def test_rows_equal_an_eager_recomputation(name: str, lm_dirs: dict[str, Path],
                                           session: Session) -> None:
    result = session.generate(PROMPT, model=str(lm_dirs[name]), max_new_tokens=N,
                              device="cpu")
    assert result.steps == N and len(result.tokens) == result.prompt_length + N
    expected, greedy = eager_reference(lm_dirs[name], result.token_ids, result.prompt_length, N)
    assert result.rows.shape == expected.shape
    np.testing.assert_allclose(result.rows, expected, atol=1e-5, rtol=0)
    assert result.token_ids == greedy  # greedy decoding, as model.generate does it
    for step in range(N):  # each row is a distribution over the keys before the token
        keys = result.keys_of(step)
        np.testing.assert_allclose(result.rows[:, :, step, :keys].sum(-1), 1.0, atol=1e-5)
        assert not result.rows[:, :, step, keys:].any()
    # Rows reach the tokens generated before: the last step's keys include the token before.
    assert (result.rows[:, :, -1, result.prompt_length + N - 2] > 0).all()
    assert result.meta["stopped"] == "max_new_tokens" and result.meta["sample"] is False
    assert result.meta["kernel"] == "sdpa"  # the model ran its own fused kernel


def test_sliding_window_bites(lm_dirs: dict[str, Path], session: Session) -> None:
    result = session.generate(PROMPT, model=str(lm_dirs["mistral"]), max_new_tokens=N,
                              device="cpu")
    window = 4
    for step in range(N):
        query = result.prompt_length - 1 + step
        # Keys further back than the window get no weight; the window's own keys do.
        assert not result.rows[:, :, step, :query - window + 1].any()
        assert (result.rows[:, :, step, query - window + 1:query + 1] > 0).all()


def test_layer_and_head_selection(lm_dirs: dict[str, Path], session: Session) -> None:
    folder = str(lm_dirs["llama"])
    every = session.generate(PROMPT, model=folder, max_new_tokens=3, device="cpu")
    some = session.generate(PROMPT, model=folder, max_new_tokens=3, device="cpu",
                            layers="-1", heads=[0, 3])
    assert some.layers == [1] and some.heads == [0, 3]
    np.testing.assert_array_equal(some.rows, every.rows[1:, [0, 3]])
    with pytest.raises(UsageError, match="layer 0 was not recorded"):
        some.matrix(0)
    with pytest.raises(UsageError, match="layer 5 is out of range"):
        session.generate(PROMPT, model=folder, layers="5", device="cpu")


def test_top_k_equals_an_argsort(lm_dirs: dict[str, Path], session: Session) -> None:
    result = session.generate(PROMPT, model=str(lm_dirs["llama"]), max_new_tokens=N,
                              device="cpu")
    expected, _ = eager_reference(lm_dirs["llama"], result.token_ids, result.prompt_length, N)
    for head, matrix in (("mean", expected[-1].mean(axis=0)), (2, expected[-1, 2])):
        rows = result.top_k(-1, head, 4)
        assert len(rows) == N
        for step, row in enumerate(rows):
            keys = result.prompt_length + step
            order = np.argsort(-matrix[step, :keys], kind="stable")[:4]
            assert [t["key_index"] for t in row["top"]] == order.tolist()
            assert [t["weight"] for t in row["top"]] == pytest.approx(
                matrix[step, order].tolist(), abs=1e-5)
            assert row["position"] == keys and row["token"] == result.tokens[keys]
            assert [t["key"] for t in row["top"]] == [result.tokens[j] for j in order]


def test_sampling_repeats_with_a_seed(lm_dirs: dict[str, Path], session: Session) -> None:
    folder = str(lm_dirs["gpt2"])
    first = session.generate(PROMPT, model=folder, max_new_tokens=N, sample=True, seed=7,
                             device="cpu")
    again = session.generate(PROMPT, model=folder, max_new_tokens=N, sample=True, seed=7,
                             device="cpu")
    assert first.token_ids == again.token_ids and first.meta["seed"] == 7
    np.testing.assert_array_equal(first.rows, again.rows)
    expected, greedy = eager_reference(lm_dirs["gpt2"], first.token_ids, first.prompt_length,
                                       N)
    np.testing.assert_allclose(first.rows, expected, atol=1e-5, rtol=0)
    assert first.token_ids != greedy  # a random model's sample is not its greedy choice
    drawn = session.generate(PROMPT, model=folder, max_new_tokens=2, sample=True,
                             device="cpu")
    assert isinstance(drawn.meta["seed"], int)  # kept, so the sample can be repeated
    with pytest.raises(UsageError, match=r"only applies to sampling \(sample=True\)"):
        session.generate(PROMPT, model=folder, seed=3, device="cpu")


def test_stops_at_end_of_sequence(lm_dirs: dict[str, Path], session: Session,
                                  tmp_path: Path) -> None:
    greedy = session.generate(PROMPT, model=str(lm_dirs["gpt2"]), max_new_tokens=N,
                              device="cpu")
    folder = shutil.copytree(lm_dirs["gpt2"], tmp_path / "gpt2-eos")
    generation_config = json.loads((folder / "generation_config.json").read_text())
    generated = greedy.token_ids[greedy.prompt_length:]
    eos = generated[-1]  # the end: generation stops where this token first comes
    steps = generated.index(eos) + 1
    generation_config["eos_token_id"] = eos
    (folder / "generation_config.json").write_text(json.dumps(generation_config))
    stopped = session.generate(PROMPT, model=str(folder), max_new_tokens=N, device="cpu")
    assert stopped.steps == steps < N and stopped.meta["stopped"] == "end of sequence"
    assert stopped.token_ids == greedy.token_ids[:greedy.prompt_length + steps]
    np.testing.assert_array_equal(stopped.rows,
                                  greedy.rows[:, :, :steps, :stopped.rows.shape[3]])


def test_steps_arrive_as_generated(lm_dirs: dict[str, Path], session: Session) -> None:
    """on_step sees every token, with its rows, before generation ends; raising stops it."""
    seen: list[Any] = []
    result = session.generate(PROMPT, model=str(lm_dirs["mistral"]), max_new_tokens=N,
                              device="cpu", heads="0,2", on_step=seen.append)
    assert [s.step for s in seen] == list(range(N))
    for step in seen:
        assert step.tokens == result.tokens[:step.position + 1]
        assert step.token_id == result.token_ids[step.position]
        np.testing.assert_array_equal(step.rows, result.rows[:, :, step.step, :step.position])
        assert step.top(-1, 2, 3) == result.top_k(-1, 2, 3)[step.step]
        assert step.top(0, "mean", 2) == result.top_k(0, "mean", 2)[step.step]

    class Enough(ValueError):  # a ValueError of the caller's own, not a model failure
        pass

    def stop(step: Any) -> None:
        if step.step == 1:
            raise Enough

    with pytest.raises(Enough):
        session.generate(PROMPT, model=str(lm_dirs["mistral"]), max_new_tokens=N,
                         device="cpu", on_step=stop)
    # The model runs its own kernel again afterwards, and the seam is idle.
    key = "generate " + spec_key(make_spec(str(lm_dirs["mistral"]), device="cpu"))
    assert session._models[key].model.config._attn_implementation == "sdpa"
    session.forget(make_spec(str(lm_dirs["mistral"]), device="cpu"))
    assert key not in session._models


def test_continuation_pieces_are_marked_as_in_captures(lm_dirs: dict[str, Path],
                                                       session: Session) -> None:
    """WordPiece pieces keep a mark (``·bel``), as captures' tables show them: generated ids
    have no word ids, so the tokenizer's ``##`` tells."""
    from attnviz.analysis.tokens import piece_labels

    text = "unbelievably navigators"
    result = session.generate(text, model=str(lm_dirs["llama"]), max_new_tokens=2,
                              device="cpu")
    capture = session.capture(text, model=str(lm_dirs["llama"]), device="cpu")
    prompt = result.tokens[:result.prompt_length]
    assert prompt == piece_labels(capture)[:result.prompt_length]
    assert "\u00b7bel" in prompt and "un" in prompt


def test_save_and_load(lm_dirs: dict[str, Path], session: Session, tmp_path: Path) -> None:
    from attnviz.long.generate import load_generation

    result = session.generate(PROMPT, model=str(lm_dirs["llama"]), max_new_tokens=4,
                              device="cpu", heads="1-2")
    folder = result.save(tmp_path / "gen")
    rows = np.load(folder / "rows.npy")
    sidecar = json.loads((folder / "generation.json").read_text())
    np.testing.assert_array_equal(rows, result.rows)
    assert sidecar["axes"] == ["layer", "head", "step", "key"] and sidecar["heads"] == [1, 2]
    # the fields README names, each present
    readme = (Path(__file__).parents[1] / "README.md").read_text(encoding="utf-8")
    named = readme[readme.index("`DIR/generation.json` ("):][:200]
    for key in ("tokens", "token_ids", "prompt_length", "layers", "heads", "model"):
        assert f"`{key}`" in named and key in sidecar
    assert "`meta.seed`" in named and "seed" in sidecar["meta"]
    back = load_generation(folder)
    assert back.tokens == result.tokens and back.text == result.text
    assert back.top_k(-1, 2, 3) == result.top_k(-1, 2, 3)
    np.save(folder / "rows.npy", rows[:, :, :2])
    with pytest.raises(DumpError, match="has shape"):
        load_generation(folder)
    with pytest.raises(DumpError, match="not a saved generation"):
        load_generation(tmp_path / "missing")


def test_package_root_and_errors(lm_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
                                 ) -> None:
    import attnviz
    import attnviz.session as session_module
    from attnviz.long.generate import _RowRecorder

    monkeypatch.setattr(session_module, "_DEFAULT", Session(use_cache=False))
    assert "generate" in attnviz.__all__
    result = attnviz.generate(PROMPT, str(lm_dirs["gpt2"]), max_new_tokens=2, device="cpu")
    assert result.steps == 2 and result.generated == result.tokens[-2:]
    with pytest.raises(UsageError, match="no causal language-model head"):
        attnviz.generate(PROMPT, "minilm")
    with pytest.raises(UsageError, match="max_new_tokens.*from 1 to 4096"):
        attnviz.generate(PROMPT, str(lm_dirs["gpt2"]), max_new_tokens=0)
    with pytest.raises(UsageError, match="positions"):  # 64 positions in this GPT-2
        attnviz.generate(PROMPT, str(lm_dirs["gpt2"]), max_new_tokens=60, device="cpu")
    import attnviz.long.generate as generation

    monkeypatch.setattr(generation, "MAX_ROW_BYTES", 1000)
    with pytest.raises(InputError, match=r"more than the bound of 1000 B\n.*\(layers, heads\)"):
        attnviz.generate(PROMPT, str(lm_dirs["gpt2"]), max_new_tokens=4, device="cpu")
    monkeypatch.undo()
    monkeypatch.setattr(session_module, "_DEFAULT", Session(use_cache=False))
    # A model whose attention bypasses the registry records nothing: said, not guessed.
    monkeypatch.setattr(_RowRecorder, "record", lambda *args: None)
    with pytest.raises(ModelLoadError, match="attention-function registry"):
        attnviz.generate(PROMPT, str(lm_dirs["gpt2"]), max_new_tokens=2, device="cpu")


# --------------------------------------------------------------------------- command line
def test_cli_formats(invoke: Any, lm_dirs: dict[str, Path], session: Session,
                     tmp_path: Path) -> None:
    folder = str(lm_dirs["llama"])
    reference = session.generate(PROMPT, model=folder, max_new_tokens=N, device="cpu")
    args = [PROMPT, "-m", folder, "-n", N, "--device", "cpu", "-l", 0, "--head", 1, "-k", 2]
    table = invoke("generate", *args)
    assert table.exit_code == 0, table.output
    top = reference.top_k(0, 1, 2)
    assert "Generated:" in table.stdout and "layer 0, head 1, top 2" in table.stdout
    first = top[0]["top"][0]
    assert f"{first['key_index']}:{first['key']}" in table.stdout

    as_csv = invoke("generate", *args, "-f", "csv")
    assert as_csv.exit_code == 0, as_csv.output
    cells = list(csv.DictReader(io.StringIO(as_csv.stdout)))
    assert len(cells) == N * 2
    for cell in cells:
        item = top[int(cell["step"])]["top"][int(cell["rank"]) - 1]
        assert int(cell["key_index"]) == item["key_index"]
        assert float(cell["weight"]) == pytest.approx(item["weight"], abs=1e-6)
        assert int(cell["position"]) == reference.prompt_length + int(cell["step"])

    as_json = invoke("generate", *args, "-f", "json")
    assert as_json.exit_code == 0, as_json.output
    data = json.loads(as_json.stdout)
    assert data["rows"] == top and data["tokens"] == reference.tokens
    assert data["text"] == reference.text and data["prompt_length"] == reference.prompt_length

    out = tmp_path / "top.json"
    written = invoke("generate", *args, "-f", "json", "-o", out)
    assert written.exit_code == 0, written.output
    assert json.loads(out.read_text()) == data

    markdown = tmp_path / "top.md"
    assert invoke("generate", *args, "-o", markdown).exit_code == 0
    assert f"| {reference.prompt_length} | " in markdown.read_text()


def test_cli_reads_the_prompt_from_standard_input(invoke: Any, lm_dirs: dict[str, Path],
                                                   session: Session) -> None:
    result = invoke("generate", "-", "-m", lm_dirs["gpt2"], "-n", 3, "--device", "cpu", "-f",
                    "json", input=PROMPT + "\n")
    assert result.exit_code == 0, result.output
    reference = session.generate(PROMPT + "\n", model=str(lm_dirs["gpt2"]), max_new_tokens=3,
                                 device="cpu")
    assert json.loads(result.stdout)["tokens"] == reference.tokens


def test_cli_runs_here_whatever_attnviz_server_says(invoke: Any, lm_dirs: dict[str, Path],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATTNVIZ_SERVER", "http://127.0.0.1:9")  # nothing listens there
    result = invoke("generate", PROMPT, "-m", lm_dirs["gpt2"], "-n", 2, "--device", "cpu",
                    "-f", "csv")
    assert result.exit_code == 0, result.output
    assert "$ATTNVIZ_SERVER is not used" in result.stderr
    assert len(result.stdout.splitlines()) == 1 + 2 * 3


def test_cli_dump_round_trip(invoke: Any, lm_dirs: dict[str, Path], session: Session,
                             tmp_path: Path) -> None:
    from attnviz.long.generate import load_generation

    folder = str(lm_dirs["mistral"])
    result = invoke("generate", PROMPT, "-m", folder, "-n", 4, "--device", "cpu", "--layers",
                    "1", "--dump", tmp_path / "dump", "-f", "csv")
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("step,position,token")  # the notice goes to stderr
    saved = load_generation(tmp_path / "dump")
    expected, _ = eager_reference(lm_dirs["mistral"], saved.token_ids, saved.prompt_length, 4)
    assert saved.layers == [1]
    np.testing.assert_allclose(saved.rows, expected[1:], atol=1e-5, rtol=0)


@pytest.mark.parametrize(("args", "code", "message"), [
    (["-n", "0"], 2, "from 1 to 4096"),
    (["-n", "5000"], 2, "from 1 to 4096"),
    (["-n", "60"], 2, "64 positions"),
    (["--seed", "3"], 2, "a seed only applies to sampling (--sample)"),
    (["--sample", "--seed", "-1"], 2, "seed must be a whole number from 0"),
    (["-l", "9"], 2, "layer 9 is out of range"),
    (["--head", "x"], 2, "invalid head"),
    (["--layers", "0", "-l", "1"], 2, "--layer 1 is not among --layers 0"),
    (["--heads", "0-1", "--head", "3"], 2, "--head 3 is not among --heads 0-1"),
    (["--dump", "a-file"], 2, "--dump a-file: a file with that name exists"),
    (["-k", "0"], 2, "'-k' / '--top-k'"),
])
def test_cli_errors(invoke: Any, lm_dirs: dict[str, Path], args: list[str], code: int,
                    message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    Path("a-file").write_text("not a folder")
    result = invoke("generate", PROMPT, "-m", lm_dirs["gpt2"], "--device", "cpu", *args)
    assert result.exit_code == code, result.output
    assert message in result.stderr and "Traceback" not in result.output


@pytest.mark.parametrize(("out", "message"), [
    ("gd2", "-o gd2 names the --dump folder gd2"),
    ("gd2/table.csv", "is inside the --dump folder gd2"),
    ("gd2/../gd2/rows.npy", "is inside the --dump folder gd2"),
])
def test_cli_refuses_out_in_the_dump_folder_before_loading(
        invoke: Any, lm_dirs: dict[str, Path], out: str, message: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, forbid_loading: Any) -> None:
    monkeypatch.chdir(tmp_path)
    forbid_loading()
    result = invoke("generate", PROMPT, "-m", lm_dirs["gpt2"], "-n", 2, "--dump", "gd2",
                    "-o", out)
    assert result.exit_code == 2, result.output
    assert message in result.stderr and "Traceback" not in result.output
    assert list(tmp_path.iterdir()) == []  # nothing written, not even the folder


def test_cli_out_beside_the_dump_folder_is_fine(invoke: Any, lm_dirs: dict[str, Path],
                                                tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    result = invoke("generate", PROMPT, "-m", lm_dirs["gpt2"], "-n", 2, "--device", "cpu",
                    "--dump", "gd2", "-o", "gd2.csv", "-f", "csv")
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (tmp_path / "gd2").iterdir()) == ["generation.json",
                                                                      "rows.npy"]
    assert (tmp_path / "gd2.csv").read_text().startswith("step,position,token")


@pytest.mark.parametrize(("model", "message"), [
    ("minilm", "no causal language-model head (it is a BertModel)"),
    ("toy", "the toy model has no language-model head"),
])
def test_cli_refuses_models_that_cannot_generate(invoke: Any, model: str, message: str,
                                                 forbid_loading: Any) -> None:
    forbid_loading()
    result = invoke("generate", PROMPT, "-m", model)
    assert result.exit_code == 2, result.output
    assert message in result.stderr and "Traceback" not in result.output


def test_cli_subprocess(lm_dirs: dict[str, Path]) -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run([sys.executable, "-m", "attnviz", "generate", PROMPT, "-m",
                           str(lm_dirs["qwen2"]), "-n", "3", "--device", "cpu", "-f", "json"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert len(data["rows"]) == 3 and len(data["tokens"]) == data["prompt_length"] + 3


def test_cli_help(invoke: Any) -> None:
    result = invoke("generate", "--help")
    assert result.exit_code == 0 and "Examples" in result.stdout
    assert "--max-new-tokens" in result.stdout and "<bool>" not in result.stdout


def test_readme_python_example(lm_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
                               ) -> None:
    """The README's Python example, run on a tiny Llama; its comments' claims hold."""
    import re

    import attnviz.session as session_module

    monkeypatch.setattr(session_module, "_DEFAULT", Session(use_cache=False))
    monkeypatch.chdir(lm_dirs["llama"].parent)
    (lm_dirs["llama"].parent / "my-llama").symlink_to(lm_dirs["llama"])
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    section = readme.split("### `attnviz generate`", 1)[1].split("\n### ", 1)[0]
    code = re.findall(r"```python\n(.*?)```", section, re.S)[0]
    namespace: dict[str, Any] = {}
    exec(code, namespace)  # noqa: S102 - the README's own example
    result = namespace["result"]
    prompt = result.prompt_length
    assert result.rows.shape == (2, 4, 8, prompt + 7)
    assert (Path("story") / "rows.npy").is_file()
    assert result.top_k(layer=-1, head="mean", k=3)[0]["top"][0]["key_index"] < prompt


@pytest.mark.parametrize(("dtype", "atol"), [("float32", 1e-5), ("bfloat16", 3e-2)])
def test_cuda_rows_equal_eager_on_cpu(lm_dirs: dict[str, Path], dtype: str, atol: float) -> None:
    """On a GPU (the model's own CUDA kernel, and 16-bit weights), the rows still equal an
    eager float32 recomputation on the CPU of the same tokens."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    for name in ("llama", "mistral"):
        result = Session(use_cache=False).generate(PROMPT, model=str(lm_dirs[name]),
                                                   max_new_tokens=N, device="cuda",
                                                   dtype=dtype)
        assert result.meta["device"].startswith("cuda") and result.rows.dtype == np.float32
        expected, greedy = eager_reference(lm_dirs[name], result.token_ids,
                                           result.prompt_length, N)
        np.testing.assert_allclose(result.rows, expected, atol=atol, rtol=0)
        if dtype == "float32":
            assert result.token_ids == greedy


# --------------------------------------------------------------------------- attnviz serve
def test_serve_streams_generated_tokens(lm_dirs: dict[str, Path], session: Session) -> None:
    from starlette.testclient import TestClient

    from attnviz.server.app import create_app
    from attnviz.server.engine import Limits

    llama = str(lm_dirs["llama"])
    app = create_app([llama, "minilm"], limits=Limits(max_tokens=64), device="cpu")
    client = TestClient(app, base_url="http://127.0.0.1:8000")
    reference = session.generate(PROMPT, model=llama, max_new_tokens=4, device="cpu")
    for head in (2, "mean"):
        answer = client.post("/api/generate", json={"text": PROMPT, "max_new_tokens": 4,
                                                    "layer": 1, "head": head, "k": 3})
        assert answer.status_code == 200, answer.text
        assert answer.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in answer.text.splitlines()]
        assert lines[:-1] == reference.top_k(1, head, 3)  # one line per token, in order
        done = lines[-1]
        assert done["done"] is True and done["tokens"] == reference.tokens
        assert done["text"] == reference.text and done["steps"] == 4

    def error(body: dict[str, Any], status: int = 422) -> str:
        answer = client.post("/api/generate", json={"text": PROMPT, **body})
        assert answer.status_code == status, answer.text
        return str(answer.json()["error"]["message"])

    assert "no causal language-model head" in error({"model": "minilm"})
    assert "layer 9 is out of range" in error({"layer": 9})
    assert "'max_new_tokens'" in error({"max_new_tokens": 0})
    assert "at most 64" in error({"max_new_tokens": 65})
    assert "not served here" in error({"model": "gpt2"}, 404)
    # A client that stops reading: the server goes on answering.
    with client.stream("POST", "/api/generate", json={"text": PROMPT, "max_new_tokens": 20}
                       ) as stream:
        first = json.loads(next(stream.iter_lines()))
        assert first["step"] == 0
    again = client.post("/api/generate", json={"text": PROMPT, "max_new_tokens": 2})
    assert again.status_code == 200 and len(again.text.splitlines()) == 3


def test_byte_level_pieces_are_marked_but_newlines_and_the_word_after_are_not() -> None:
    """BPE names: a piece has no word-start marker and joins letters; a newline ("Ċ") and the
    word after it (no marker either) are words of their own."""
    from types import SimpleNamespace

    from attnviz.long.generate import _labels

    names = ["the", "\u0120mat", "\u010a", "the", "\u0120un", "bel", "iev", "\u0120dog", "."]
    shown = ["the", "mat", "\\n", "the", "un", "bel", "iev", "dog", "."]
    vocab = {name: i for i, name in enumerate(names)}
    tokenizer = SimpleNamespace(
        convert_ids_to_tokens=lambda ids: [names[i] for i in ids], get_vocab=lambda: vocab,
        backend_tokenizer=SimpleNamespace(model=SimpleNamespace()))
    source = SimpleNamespace(tokenizer=tokenizer, special_ids=lambda: set(),
                             display_of=lambda tokens, special: [shown[names.index(t)]
                                                                 for t in tokens])
    assert _labels(source, list(range(len(names)))) == [  # type: ignore[arg-type]
        "the", "mat", "\\n", "the", "un", "\u00b7bel", "\u00b7iev", "dog", "."]
