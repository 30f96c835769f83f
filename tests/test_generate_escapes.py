"""``generate`` prints no terminal escape sequence: byte-level vocabularies hold ESC, and a
prompt read from standard input may hold anything.

A tiny GPT-2 with a byte-level vocabulary (the 256 bytes, no merges) whose head always picks
the ESC byte: its tokens and generated text carry raw control characters, which every table
shows as their escapes (``\\x1b``), as a capture's tables do; JSON keeps the data exact with
JSON's own escapes.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

import pytest

ESC = "\x1b"
CSI = "\x9b"  # the C1 control sequence introducer
PROMPT = f"hi {ESC}]0;TITLE{ESC}\\ there {CSI}31m"


@pytest.fixture(scope="module")
def byte_gpt2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    out = tmp_path_factory.mktemp("byte-gpt2")
    vocab = {char: byte for byte, char in bytes_to_unicode().items()}
    vocab["<|endoftext|>"] = 256
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>",
                            bos_token="<|endoftext|>").save_pretrained(out)
    config = GPT2Config(vocab_size=257, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                        bos_token_id=256, eos_token_id=None, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    with torch.no_grad():  # every position's logits: the ESC byte (27) first
        direction = torch.randn(32)
        model.transformer.ln_f.weight.zero_()
        model.transformer.ln_f.bias.copy_(direction)
        model.lm_head.weight.zero_()
        model.lm_head.weight[0x1B] = direction
    model.save_pretrained(out)
    return out


def _run(invoke: Any, folder: Path, *args: str) -> Any:
    result = invoke("generate", "-", "-m", str(folder), "-n", "2", "--device", "cpu", *args,
                    input=PROMPT)
    assert result.exit_code == 0, result.output
    for text in (result.stdout, result.stderr):
        assert ESC not in text and CSI not in text, repr(text)
    return result


def test_tables_show_control_characters_as_escapes(byte_gpt2: Path, invoke: Any,
                                                   tmp_path: Path) -> None:
    table = _run(invoke, byte_gpt2).stdout
    assert "Generated: \\x1b\\x1b" in table and "Prompt: hi \\x1b]0;TITLE\\x1b\\ there" in table
    assert "\\x9b31m" in table
    markdown = _run(invoke, byte_gpt2, "-f", "markdown").stdout
    assert "Generated: \\x1b\\x1b" in markdown and "| \\x1b |" in markdown
    every_key = _run(invoke, byte_gpt2, "-f", "csv", "-k", "100").stdout
    rows = list(csv.DictReader(io.StringIO(every_key)))
    assert {row["token"] for row in rows} == {"\\x1b"}
    assert any(row["key"] == "\\x1b" for row in rows)
    written = tmp_path / "top.md"
    _run(invoke, byte_gpt2, "-o", str(written))
    assert ESC not in written.read_text() and "\\x1b" in written.read_text()


def test_json_keeps_the_text_exact_with_json_escapes(byte_gpt2: Path, invoke: Any) -> None:
    output = _run(invoke, byte_gpt2, "-f", "json").stdout
    data = json.loads(output)
    assert data["prompt"] == PROMPT and data["text"] == ESC * 2
    assert "\\u001b" in output and "\\u009b" in output
    assert data["tokens"][-2:] == ["\\x1b", "\\x1b"]  # token labels: as the tables show them


def test_recorded_tokens_hold_escapes(byte_gpt2: Path, tmp_path: Path) -> None:
    from attnviz.long.generate import load_generation
    from attnviz.session import Session

    steps: list[str] = []
    result = Session(use_cache=False).generate(
        PROMPT, model=str(byte_gpt2), max_new_tokens=2, device="cpu",
        on_step=lambda step: steps.append(step.token))
    assert steps == ["\\x1b", "\\x1b"]
    assert all(ESC not in token for token in result.tokens)
    assert result.text == ESC * 2  # the record keeps the text itself
    saved = json.loads((result.save(tmp_path / "g") / "generation.json").read_text())
    saved["tokens"][0] = ESC + "[31m"  # a hostile dump
    (tmp_path / "g" / "generation.json").write_text(json.dumps(saved))
    assert load_generation(tmp_path / "g").tokens[0] == "\\x1b[31m"
