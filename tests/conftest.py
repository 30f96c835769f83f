"""Shared fixtures: each model is loaded once per test session; tiny models are built locally."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

# Never reach for the network in tests: a hub lookup must fail fast and clearly.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("MPLBACKEND", "Agg")

# A test run started in the background of a non-interactive shell (`cmd &`) inherits SIGINT
# ignored, and so would every command a test starts: tests that press Ctrl-C on a child would
# see it ignored, as the shell asked. Handled here, the signal is back to its default in every
# child (exec resets a handled signal; an ignored one stays ignored).
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

SENTENCE = "The cat sat on the mat"


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory,
                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test gets its own capture cache folder (never the user's)."""
    monkeypatch.setenv("ATTNVIZ_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    monkeypatch.delenv("ATTNVIZ_MODEL", raising=False)
    monkeypatch.delenv("ATTNVIZ_SERVER", raising=False)
    monkeypatch.delenv("ATTNVIZ_DEBUG", raising=False)
    # Progress lines of long steps depend on how busy the machine is: tests that count
    # standard error's lines see none (tests/test_long_progress.py turns them on).
    import attnviz.cli._steps as steps

    monkeypatch.setattr(steps, "QUIET_SECONDS", 3600.0)


@pytest.fixture(scope="session")
def minilm():
    """The bundled pretrained MiniLM, loaded once."""
    from attnviz.models.hf import HFSource

    return HFSource("minilm", device="cpu")


@pytest.fixture(scope="session")
def minilm_capture(minilm):
    return minilm.capture(SENTENCE)


def _save_tiny(model_cls, config, tokenizer_dir: Path, out: Path) -> Path:
    import torch
    from transformers import AutoTokenizer

    torch.manual_seed(0)
    model = model_cls(config)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_gpt2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight GPT-2 saved with save_pretrained (uses MiniLM's tokenizer vocab)."""
    from transformers import GPT2Config, GPT2Model

    from attnviz.models.hf import bundled_model_path

    config = GPT2Config(vocab_size=30522, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                        bos_token_id=101, eos_token_id=102)
    return _save_tiny(GPT2Model, config, bundled_model_path(),
                      tmp_path_factory.mktemp("tiny-gpt2"))


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight Llama saved with save_pretrained."""
    from transformers import LlamaConfig, LlamaModel

    from attnviz.models.hf import bundled_model_path

    config = LlamaConfig(vocab_size=30522, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128)
    return _save_tiny(LlamaModel, config, bundled_model_path(),
                      tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """Headless Chromium driven by Playwright, one per test module (see ``tests/_browser.py``);
    skips the module's browser tests when no Chromium binary is installed."""
    from tests._browser import launch_chromium

    yield from launch_chromium()


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


@pytest.fixture
def invoke(runner: CliRunner) -> Callable[..., object]:
    """Run the CLI in-process; returns click's Result (exit_code, stdout, stderr)."""
    import attnviz.cli._common as common
    from attnviz.cli import app

    def run(*args: str, input: str | None = None):  # noqa: A002 - click's name
        common._SESSION = None  # each invocation starts cold, as a new process would
        return runner.invoke(app, [str(a) for a in args], input=input)

    return run


@pytest.fixture()
def forbid_loading(monkeypatch: pytest.MonkeyPatch) -> Callable[[], list[str]]:
    """Call it to make any model load from then on fail the test; returns the list of the
    names that were tried (a test asserts it stays empty)."""
    import attnviz.models as models

    def forbid() -> list[str]:
        tried: list[str] = []

        def load(spec=None):  # type: ignore[no-untyped-def]
            tried.append(getattr(spec, "name", str(spec)))
            raise AssertionError(f"the model {tried[-1]} was loaded")

        monkeypatch.setattr(models, "load_source", load)
        return tried

    return forbid


def _reuse_minilm(patch: pytest.MonkeyPatch, minilm) -> None:
    """Make float32 loads of MiniLM return the session's MiniLM instead of loading it again."""
    import attnviz.models as models

    real = models.load_source

    def load(spec=None):
        name = spec if isinstance(spec, str) else getattr(spec, "name", "minilm")
        if name == "minilm" and getattr(spec, "dtype", "float32") == "float32":
            return minilm
        return real(spec)

    patch.setattr(models, "load_source", load)


@pytest.fixture
def cli_minilm(monkeypatch: pytest.MonkeyPatch, minilm):
    """Make CLI commands reuse the session's MiniLM instead of loading it again."""
    _reuse_minilm(monkeypatch, minilm)
    return minilm


@pytest.fixture(scope="module")
def patched_minilm(minilm) -> Iterator[Any]:
    """Model loads of 'minilm' return the test session's MiniLM, for a whole test module."""
    patch = pytest.MonkeyPatch()
    _reuse_minilm(patch, minilm)
    yield minilm
    patch.undo()
