"""Long captures: every number equals an eager capture of the same text (the existing
``HFSource.capture`` path, which reads the weights the eager kernel builds)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from attnviz.errors import DumpError, UsageError

TEXT = ("The cat sat on the mat, and the dog sat on the log. Then the cat saw the dog; "
        "the dog saw the cat. ") * 6


def _save(model_cls: Any, config: Any, out: Path) -> str:
    import torch
    from transformers import AutoTokenizer

    from attnviz.models.hf import bundled_model_path

    torch.manual_seed(0)
    model_cls(config).save_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(bundled_model_path())
    tokenizer.model_max_length = 1 << 62  # the model's positions set the limit, not BERT's 512
    tokenizer.save_pretrained(out)
    return str(out)


def _source(folder: str) -> Any:
    from attnviz.models.hf import HFSource

    return HFSource(folder, device="cpu")


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Grouped-query attention: 4 query heads read 2 key heads."""
    from transformers import LlamaConfig, LlamaModel

    config = LlamaConfig(vocab_size=30522, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=40000)
    return _source(_save(LlamaModel, config, tmp_path_factory.mktemp("long-llama")))


@pytest.fixture(scope="module")
def mistral(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A sliding window of 16 tokens, much shorter than the text."""
    from transformers import MistralConfig, MistralModel

    config = MistralConfig(vocab_size=30522, hidden_size=32, intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                           max_position_embeddings=4096, sliding_window=16)
    return _source(_save(MistralModel, config, tmp_path_factory.mktemp("long-mistral")))


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Layer 0 full attention, layer 1 a sliding window of 24 (max_window_layers=1)."""
    from transformers import Qwen2Config, Qwen2Model

    config = Qwen2Config(vocab_size=30522, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=4096, use_sliding_window=True,
                         sliding_window=24, max_window_layers=1)
    return _source(_save(Qwen2Model, config, tmp_path_factory.mktemp("long-qwen2")))


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import GPT2Config, GPT2Model

    config = GPT2Config(vocab_size=30522, n_positions=1024, n_embd=32, n_layer=2, n_head=4,
                        bos_token_id=101, eos_token_id=102)
    return _source(_save(GPT2Model, config, tmp_path_factory.mktemp("long-gpt2")))


def _blocks(matrix: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """Atlas of one ``[T, T]`` matrix by plain numpy padding."""
    size = matrix.shape[0]
    nb = -(-size // block)
    padded = np.zeros((nb * block, nb * block))
    padded[:size, :size] = matrix
    cells = padded.reshape(nb, block, nb, block)
    return cells.sum(axis=(1, 3)), cells.max(axis=(1, 3))


def _expected_stats(weights: np.ndarray, capture: Any, windows: dict[int, int | None]
                    ) -> dict[str, np.ndarray]:
    """The eager capture's statistics; ``entropy`` divided by the log of the keys each row
    sees, the window included (analysis.stats counts ``i + 1`` keys, unaware of windows)."""
    from attnviz.analysis.stats import stat_sums

    means = stat_sums(capture).means()
    size = weights.shape[-1]
    rows = np.arange(size)
    for position, layer in enumerate(capture.layers):
        seen = rows + 1 if capture.causal else np.full(size, size)
        if windows[layer]:
            seen = np.minimum(seen, windows[layer])
        block = weights[position].astype(np.float64)  # [head, query, key]
        logs = np.log(np.where(block > 0, block, 1.0))
        nats = -(block * logs).sum(-1)
        eligible = (block.sum(-1) > 1e-6) & (seen >= 2)[None, :]
        norm = nats / np.log(np.maximum(seen, 2))[None, :]
        means["entropy"][position] = np.where(eligible, norm, 0).sum(-1) / eligible.sum(-1)
    return means


def _check_against_eager(source: Any, text: str = TEXT, tolerance: float = 1e-5,
                         summary: bool = False) -> Any:
    from attnviz.long import capture_long

    # summary: the statistics, received attention, atlas and top-k come from the capture's
    # own pass over the scores rather than from a later scan; 16-token blocks, so later rows
    # rank only the keys of their 4 strongest blocks (the candidates).
    cap = (capture_long(source, text, summary=True, block=16, k=4) if summary else
           capture_long(source, text))
    assert (cap._summary is not None) == summary
    assert not summary or cap.num_tokens > 4 * 16
    reference = source.capture(text)
    weights = np.asarray(reference.weights)  # [layer, head, query, key]
    size = weights.shape[-1]
    assert cap.num_tokens == size and cap.tokens == reference.tokens
    assert cap.causal == reference.causal
    assert cap.layers == list(range(source.num_layers))
    for position, layer in enumerate(cap.layers):
        for head in range(cap.num_heads):
            np.testing.assert_allclose(cap.rows(layer, head, 0, size), weights[position, head],
                                       rtol=0, atol=tolerance)
            tile = cap.tile(layer, head, 7, 40, 3, 29)
            np.testing.assert_allclose(tile, weights[position, head, 7:40, 3:29], atol=tolerance)
            indices, values = cap.topk(layer, head, 4)
            order = np.argsort(-weights[position, head], axis=1, kind="stable")[:, :4]
            top = np.take_along_axis(weights[position, head], order, axis=1)
            visible = indices >= 0
            # Keys of (near-)equal weight may come in either order: the keys picked must
            # carry the largest weights, and the weights given must be theirs.
            picked = np.take_along_axis(weights[position, head], np.maximum(indices, 0), 1)
            np.testing.assert_allclose(np.where(visible, picked, 0), np.where(visible, top, 0),
                                       atol=tolerance)
            np.testing.assert_allclose(values, np.where(visible, top, 0), atol=tolerance)
            assert all(len(set(row[row >= 0])) == int((row >= 0).sum()) for row in indices)
            # A place is left empty exactly where the key there has no weight (masked).
            assert not np.any(top[~visible] > 0)
            sums, maxes = cap.atlas(layer, head, 16)
            want_sums, want_maxes = _blocks(weights[position, head], 16)
            np.testing.assert_allclose(sums, want_sums, atol=1e-4)
            np.testing.assert_allclose(maxes, want_maxes, atol=tolerance)
            np.testing.assert_allclose(cap.received(layer, head),
                                       weights[position, head].sum(axis=0), atol=1e-4)
        if summary:  # every head's top-4 of the summary
            held = cap._summary
            for head in range(cap.num_heads):
                matrix = weights[position, head]
                indices = held.top_indices[position, head]
                values = held.top_values[position, head]
                visible = indices >= 0
                order = np.argsort(-matrix, axis=1, kind="stable")[:, :4]
                top = np.take_along_axis(matrix, order, axis=1)
                picked = np.take_along_axis(matrix, np.maximum(indices, 0), 1)
                np.testing.assert_allclose(np.where(visible, picked, 0),
                                           np.where(visible, top, 0), atol=tolerance)
                np.testing.assert_allclose(values, np.where(visible, top, 0), atol=tolerance)
                assert not np.any(top[~visible] > 0)
        mean = weights[position].mean(axis=0)
        np.testing.assert_allclose(cap.tile(layer, "mean", 0, size, 0, size), mean,
                                   atol=tolerance)
        indices, values = cap.topk(layer, "mean", 3, q0=10, q1=30)
        order = np.argsort(-mean[10:30], axis=1, kind="stable")[:, :3]
        want = np.take_along_axis(mean[10:30], order, 1)
        np.testing.assert_allclose(values, want, atol=tolerance)
        np.testing.assert_allclose(np.take_along_axis(mean[10:30], indices, 1), want,
                                   atol=tolerance)
        sums, maxes = cap.atlas(layer, "mean", 32)
        want_sums, want_maxes = _blocks(mean, 32)
        np.testing.assert_allclose(sums, want_sums, atol=1e-4)
        np.testing.assert_allclose(maxes, want_maxes, atol=tolerance)
    expected = _expected_stats(weights, reference, cap.windows)
    stats = cap.head_stats()
    for key, value in expected.items():
        np.testing.assert_allclose(stats[key], value, rtol=1e-5, atol=tolerance, err_msg=key)
    # The summary's atlas (64-token blocks) and levels pooled from it.
    for block in (64, 128):
        for head in (0, "mean"):
            matrix = weights[-1, 0] if head == 0 else weights[-1].mean(axis=0)
            sums, maxes = cap.atlas(cap.layers[-1], head, block)
            want_sums, want_maxes = _blocks(matrix, block)
            np.testing.assert_allclose(sums, want_sums, atol=1e-4)
            np.testing.assert_allclose(maxes, want_maxes, atol=tolerance)
    # Sinks (Gu et al.): mean attention over the queries that see a token, over threshold.
    for threshold in (0.05, 0.3):
        count = np.zeros(size)
        for position, layer in enumerate(cap.layers):
            mean_received = weights[position].sum(axis=1) / cap.seen_by(layer)[None, :]
            count += (mean_received > threshold).sum(axis=0)
        np.testing.assert_allclose(cap.sinks(threshold),
                                   count / (len(cap.layers) * cap.num_heads))
    return cap


@pytest.mark.parametrize("summary", [False, True])
def test_llama_gqa_equals_eager(llama: Any, summary: bool) -> None:
    cap = _check_against_eager(llama, summary=summary)
    assert cap.num_kv_heads == 2 and cap.window is None and cap.causal
    assert cap.meta["kernel"] == "sdpa"  # the model's fused kernel ran, not eager


@pytest.mark.parametrize("summary", [False, True])
def test_mistral_sliding_window_equals_eager(mistral: Any, summary: bool) -> None:
    cap = _check_against_eager(mistral, summary=summary)
    assert cap.window == 16 and cap.num_tokens > 3 * 16
    row = cap.rows(1, 2, 100, 101)[0]
    assert np.count_nonzero(row) == 16 and row[85:101].all()  # keys 85..100 only


def test_qwen2_mixed_windows_equal_eager(qwen2: Any) -> None:
    cap = _check_against_eager(qwen2)
    assert cap.windows == {0: None, 1: 24}


def test_gpt2_equals_eager(gpt2: Any) -> None:
    cap = _check_against_eager(gpt2)
    assert cap.num_kv_heads == cap.num_heads == 4


@pytest.mark.parametrize("summary", [False, True])
def test_minilm_bidirectional_equals_eager(minilm: Any, summary: bool) -> None:
    cap = _check_against_eager(minilm, summary=summary)
    assert not cap.causal and cap.num_heads == 12


def test_layers_selection_and_early_stop(llama: Any) -> None:
    from attnviz.long import capture_long

    cap = capture_long(llama, TEXT, layers=[0])
    assert cap.layers == [0] and sorted(p.name for p in cap.folder.glob("*.npy")) == [
        "k_000.npy", "lse_000.npy", "q_000.npy"]
    reference = llama.capture(TEXT, layers=[0])
    np.testing.assert_allclose(cap.rows(0, 1, 0, cap.num_tokens), reference.weights[0, 1],
                               atol=1e-5)
    with pytest.raises(UsageError, match="layer 1 is not in this capture: it holds layers 0"):
        cap.tile(1, 0, 0, 4, 0, 4)


def test_rows_of_a_32k_capture_sum_to_one(tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaModel

    from attnviz.long import capture_long

    config = LlamaConfig(vocab_size=30522, hidden_size=16, intermediate_size=16,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=33000)
    source = _source(_save(LlamaModel, config, tmp_path / "model"))
    cap = capture_long(source, "cat " * 32766)
    assert cap.num_tokens == 32768
    for q0 in (0, 16000, 32768 - 64):
        for head in (0, 1):
            rows = cap.rows(0, head, q0, q0 + 64)
            np.testing.assert_allclose(rows.sum(axis=1), 1.0, atol=1e-4)
            assert not rows[:, q0 + 64:].any()  # causal: nothing after the query
    indices, values = cap.topk(0, 1, 3, q0=32700)
    assert indices.shape == (68, 3) and (indices <= np.arange(32700, 32768)[:, None]).all()


@pytest.mark.parametrize(("dtype", "tolerance"), [("float16", 2e-3), ("bfloat16", 2e-2)])
def test_16bit_storage(llama: Any, dtype: str, tolerance: float, tmp_path: Path) -> None:
    from attnviz.long import capture_long

    cap = capture_long(llama, TEXT, dtype=dtype, folder=tmp_path / "cap")
    reference = np.asarray(llama.capture(TEXT).weights)
    stored = np.load(tmp_path / "cap" / "q_001.npy", mmap_mode="r")
    assert stored.dtype == (np.float16 if dtype == "float16" else np.uint16)
    rows = cap.rows(1, 3, 0, cap.num_tokens)
    np.testing.assert_allclose(rows, reference[1, 3], atol=tolerance)
    # The log-sum-exp is taken over the rounded queries and keys: rows still sum to 1.
    np.testing.assert_allclose(rows.sum(axis=1), 1.0, atol=1e-5)
    assert np.abs(rows - reference[1, 3]).max() > 0  # rounding did happen


def test_save_and_load_round_trip(llama: Any, tmp_path: Path) -> None:
    from attnviz.long import capture_long, load_long

    cap = capture_long(llama, TEXT, dtype="bfloat16")
    temporary = cap.folder
    saved = cap.save(tmp_path / "saved")
    for mmap in (True, False):
        loaded = load_long(saved, mmap=mmap)
        assert loaded.tokens == cap.tokens and loaded.layers == cap.layers
        assert loaded.scales == cap.scales and loaded.dtype == "bfloat16"
        assert loaded.meta["identity"] == cap.meta["identity"]
        np.testing.assert_array_equal(loaded.tile(1, 2, 0, 50, 0, 50),
                                      cap.tile(1, 2, 0, 50, 0, 50))
    cap.close()
    assert not temporary.exists()  # the temporary folder goes with the capture
    (saved / "long.json").write_text("{", encoding="utf-8")
    with pytest.raises(DumpError, match="cannot read"):
        load_long(saved)
    with pytest.raises(DumpError, match="no long.json"):
        load_long(tmp_path)


def test_damaged_array_is_reported(llama: Any, tmp_path: Path) -> None:
    from attnviz.long import capture_long, load_long

    capture_long(llama, TEXT, folder=tmp_path / "cap")
    np.save(tmp_path / "cap" / "k_000.npy", np.zeros((2, 3, 8), dtype=np.float32))
    with pytest.raises(DumpError, match="k_000.npy holds"):
        load_long(tmp_path / "cap")


def test_bad_requests_are_usage_errors(llama: Any) -> None:
    from attnviz.long import capture_long

    cap = capture_long(llama, "The cat sat on the mat.")
    size = cap.num_tokens
    with pytest.raises(UsageError, match="query range 0:99"):
        cap.tile(0, 0, 0, 99, 0, 2)
    with pytest.raises(UsageError, match="head 9 is out of range"):
        cap.rows(0, 9, 0, 2)
    with pytest.raises(UsageError, match="number or \"mean\""):
        cap.rows(0, "max", 0, 2)
    with pytest.raises(UsageError, match="k must be between"):
        cap.topk(0, 0, 0)
    with pytest.raises(UsageError, match="power of two"):
        cap.atlas(0, 0, 48)
    with pytest.raises(UsageError, match="threshold"):
        cap.sinks(1.5)
    with pytest.raises(UsageError, match="pass summary=True"):
        capture_long(llama, "The cat", k=3)
    with pytest.raises(UsageError, match="block must be a power of two"):
        capture_long(llama, "The cat", summary=True, block=48)
    with pytest.raises(UsageError, match="k must be between 0 and"):
        capture_long(llama, "The cat", summary=True, k=5000)
    with pytest.raises(UsageError, match="invalid dtype"):
        capture_long(llama, "The cat", dtype="int8")
    indices, values = cap.topk(0, 0, 1000)  # more keys than the text has: every key, ranked
    assert indices.shape == (size, size)
    np.testing.assert_allclose(values.sum(axis=1), 1.0, atol=1e-5)


def test_model_without_the_registry_is_unsupported(tmp_path: Path) -> None:
    from transformers import BloomConfig, BloomModel

    from attnviz.long import LongUnsupported, capture_long

    config = BloomConfig(vocab_size=30522, hidden_size=32, n_layer=2, n_head=4)
    source = _source(_save(BloomModel, config, tmp_path / "bloom"))
    with pytest.raises(LongUnsupported, match="does not run its attention through"):
        capture_long(source, TEXT)
    assert source.model.config._attn_implementation == "eager"  # put back as it was


def test_softcapping_is_unsupported(tmp_path: Path) -> None:
    from transformers import Gemma2Config, Gemma2Model

    from attnviz.long import LongUnsupported, capture_long

    config = Gemma2Config(vocab_size=30522, hidden_size=32, intermediate_size=64,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=8, attn_logit_softcapping=50.0)
    source = _source(_save(Gemma2Model, config, tmp_path / "gemma2"))
    with pytest.raises(LongUnsupported, match="softcapping"):
        capture_long(source, TEXT)


def test_cuda_tiles_equal_cpu_tiles(llama: Any) -> None:
    import torch

    from attnviz.long import capture_long

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    cap = capture_long(llama, TEXT)
    on_cpu = cap.tile(1, 1, 0, 60, 0, 60)
    cap.device = "cuda"
    np.testing.assert_allclose(cap.tile(1, 1, 0, 60, 0, 60), on_cpu, atol=1e-6)
    indices, _values = cap.topk(1, 1, 3)
    assert indices.shape == (cap.num_tokens, 3)


def test_capture_on_cuda_equals_cpu(llama: Any) -> None:
    import torch

    from attnviz.long import capture_long
    from attnviz.models.hf import HFSource

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    on_gpu = HFSource(llama.location, device="cuda")
    cap = capture_long(on_gpu, TEXT)
    reference = capture_long(llama, TEXT)
    assert cap.meta["device"].startswith("cuda")
    size = cap.num_tokens
    for layer in cap.layers:
        np.testing.assert_allclose(cap.rows(layer, 3, 0, size), reference.rows(layer, 3, 0, size),
                                   atol=1e-4)
    np.testing.assert_allclose(cap.head_stats()["entropy"], reference.head_stats()["entropy"],
                               atol=1e-4)


def test_capture_into_a_used_folder_replaces_it(llama: Any, tmp_path: Path) -> None:
    from attnviz.long import capture_long, load_long

    capture_long(llama, TEXT, folder=tmp_path / "cap")
    again = capture_long(llama, "The dog sat on the log.", layers=[1], folder=tmp_path / "cap")
    loaded = load_long(tmp_path / "cap")
    assert loaded.text == "The dog sat on the log." and loaded.layers == [1]
    np.testing.assert_array_equal(loaded.rows(1, 0, 0, loaded.num_tokens),
                                  again.rows(1, 0, 0, again.num_tokens))
    with pytest.raises(UsageError, match="power of two from 16 to"):
        loaded.atlas(1, 0, 1 << 21)
