"""Conformance: each text model type of transformers, built tiny from its own configuration
class, gives on every path the model's own eager attention or one clear refusal.

The default run checks a representative set (:data:`tests._conformance.FAST_TYPES`); the
full sweep over every type is ``pytest -m conformance_full`` (deselected by default), and
``python scripts/conformance_table.py`` runs it and writes docs/models.md.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests import _conformance as conformance

# What the families must give (a prefix of the outcome), beside "no wrong, no crash".
EXPECTED: dict[str, dict[str, str]] = {
    "convbert": {"full": "equal"},  # head_ratio: fewer real heads than the config says
    "nemotron_h": {"full": "equal", "long": "equal", "generate": "equal"},  # some layers only
    "gpt_oss": {"full": "equal", "generate": "equal", "long": "refused"},  # sinks
    "deepseek_v4": {"generate": "equal", "long": "refused"},
    "diffllama": {"full": "equal", "long": "equal", "generate": "equal"},  # two calls a layer
    "longformer": {"full": "refused: ", "long": "refused"},  # a band of offsets
    "yoso": {"full": "refused", "long": "refused"},  # 3-D weights
    # multi-head latent attention (keys of two parts, per query head)
    "deepseek_v3": {"full": "equal", "long": "equal", "generate": "equal"},
    # linear-attention layers beside full ones: attention in some layers only
    "qwen3_next": {"full": "equal", "long": "equal", "generate": "equal"},
    "longt5": {"full": "refused", "long": "refused"},  # local blocks
    "fsmt": {"full": "equal", "long": "refused"},  # its encoder has no config
    "llama": {"full": "equal", "long": "equal", "generate": "equal", "norm": "works"},
    "bert": {"full": "equal", "long": "equal", "norm-res-ln": "works"},
}


_RESULTS: dict[str, conformance.Result] = {}


def _checked(model_type: str, root: Path) -> conformance.Result:
    """The census of one type, built once per test session."""
    if model_type not in _RESULTS:
        kinds = conformance.mappings()[model_type]
        with conformance.quiet():
            built = conformance.build(model_type, kinds, root / model_type)
            assert built.reason is None, built.reason
            _RESULTS[model_type] = conformance.check(built)
    return _RESULTS[model_type]


@pytest.fixture(scope="module")
def built_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("conformance")


@pytest.mark.parametrize("model_type", conformance.FAST_TYPES)
def test_representative_types_are_equal_or_refused(model_type: str, built_root: Path) -> None:
    result = _checked(model_type, built_root)
    assert result.built is None, result.built
    assert not result.failures(), result.failures()
    for path, outcome in result.paths.items():
        assert outcome.split(":")[0] in ("equal", "works", "refused", "n/a"), (path, outcome)
        if outcome.startswith("refused"):
            assert "\n" not in outcome and "Traceback" not in outcome
    for path, prefix in EXPECTED.get(model_type, {}).items():
        assert result.paths[path].startswith(prefix), (path, result.paths[path])


def test_refusals_name_the_reason(built_root: Path) -> None:
    """The band layout and 3-D refusals say what the weights are, not only that they fail."""
    assert "band" in _checked("longformer", built_root).paths["full"]
    assert "not [batch, head, query, key]" in _checked("yoso", built_root).paths["full"]
    assert "sinks" in _checked("gpt_oss", built_root).paths["long"]


def test_a_model_that_switches_itself_to_full_attention_is_checked_against_it(
        built_root: Path) -> None:
    """BigBird (block_sparse) runs full attention on a short text and returns no weights; its
    reference is the same weights loaded with full attention, whose output it matches."""
    import transformers

    with conformance.quiet():
        built = conformance.build("big_bird", ["causal", "masked"], built_root / "big_bird")
        assert built.folder is not None, built.reason
        config = transformers.AutoConfig.from_pretrained(built.folder)
        assert config.attention_type == "block_sparse"
        ids, reference = conformance._reference(built.folder, "AutoModel", conformance.TEXT,
                                                None)
        result = conformance.check(built, ("full",))
    size = int(ids.shape[1])
    assert [r.shape for r in reference] == [(config.num_attention_heads, size, size)] * \
        config.num_hidden_layers
    assert result.paths["full"] == "equal", result.paths
    # the full-attention weights are taken only when the model's output is the same
    import torch

    weights = (torch.rand(1, 2, 3, 3),)
    states = torch.zeros(1, 3, 8)

    def full(**overrides: str) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        assert overrides == {"attention_type": "original_full"}
        return states, weights

    assert conformance._switched_to_full(built.folder, states.clone(), full) == weights
    assert conformance._switched_to_full(built.folder, states + 1e-3, full) == ()


# ------------------------------------------------------------------ the census can fail
def test_the_comparison_catches_a_wrong_matrix() -> None:
    rng = np.random.default_rng(0)
    want = [rng.random((2, 5, 5)) for _ in range(2)]
    assert conformance._compare([w.copy() for w in want], want, "x") == "equal"
    off = [w.copy() for w in want]
    off[1][0, 2, 3] += 1e-4
    assert conformance._compare(off, want, "x").startswith("wrong: x differs by")
    assert conformance._compare(want[:1], want, "x").startswith("wrong: x has 1 layers")


def test_extra_key_columns_with_weight_are_no_square_reference() -> None:
    weights = np.full((2, 4, 5), 0.2)
    assert conformance._square([weights], 4) is None  # the fifth column carries weight
    weights[:, :, 4] = 0.0
    assert conformance._square([weights], 4)[0].shape == (2, 4, 4)
    assert conformance._square([np.ones((4, 9))], 4) is None  # 3-D weights: not per head


def test_a_foreign_exception_is_a_crash_and_a_clear_error_a_refusal() -> None:
    from attnviz.errors import ModelLoadError

    assert conformance._refusal(IndexError("list index out of range")).startswith("crash")
    outcome = conformance._refusal(ModelLoadError("it cannot", "do this instead"))
    assert outcome == "refused: it cannot (do this instead)"


# ------------------------------------------------------------------ shapes from the outputs
def test_describe_reads_shapes_from_the_outputs() -> None:
    import torch

    from attnviz.models._shape import describe

    square = [torch.rand(1, 2, 5, 5) for _ in range(3)]
    shape = describe(square, 5, "m")
    assert shape is not None and (shape.num_layers, shape.num_heads, shape.problem) == (3, 2, None)
    mixed = describe([torch.rand(1, 2, 5, 5), torch.rand(1, 4, 5, 5)], 5, "m")
    assert mixed is not None and "different numbers of heads (2, 4)" in str(mixed.problem)
    extra = describe([torch.rand(1, 2, 5, 6)], 5, "m")
    assert extra is not None and "1 key column more than there are tokens" in str(extra.problem)
    flat = describe([torch.rand(1, 5, 8)], 5, "m")
    assert flat is not None and "not [batch, head, query, key]" in str(flat.problem)
    hybrid = describe([None, torch.rand(1, 2, 5, 5), None], 5, "m")
    assert hybrid is not None and (hybrid.num_layers, hybrid.problem) == (1, None)
    assert describe([], 5, "m") is None and describe([None], 5, "m") is None


def test_the_long_seam_refuses_layers_of_another_head_layout(tmp_path: Path) -> None:
    """Gemma-4-style layers of different head sizes cannot share one long capture's files."""
    from attnviz.long.record import LongUnsupported
    from attnviz.long.seam import _check_layout, _Recorder

    recorder = _Recorder(layers=[0, 1], folder=tmp_path, dtype="float32", budget=1 << 20,
                         num_heads=4)
    _check_layout(0, 4, 2, 8, recorder)  # the first layer sets the layout
    recorder.num_kv_heads, recorder.head_dim = 2, 8
    _check_layout(1, 4, 2, 8, recorder)
    with pytest.raises(LongUnsupported, match="size 512 where the layers before it have 2 of "
                                              "size 8"):
        _check_layout(1, 4, 2, 512, recorder)
    with pytest.raises(LongUnsupported, match="runs 64 query heads where the model returns 4"):
        _check_layout(1, 64, 2, 8, recorder)


@pytest.mark.conformance_full
def test_every_type_is_equal_or_refused() -> None:
    """The full sweep (slow): no wrong matrix and no crash on any type or path."""
    failures = {r.model_type: r.failures() for r in conformance.census() if r.failures()}
    assert not failures, failures


def test_the_committed_table_lists_every_type_with_no_wrong_or_crash() -> None:
    """docs/models.md (the full sweep's output) names every text model type of the installed
    transformers' mappings, once, and counts no wrong matrix and no crash."""
    import re

    text = (Path(__file__).resolve().parents[1] / "docs" / "models.md").read_text("utf-8")
    listed = re.findall(r"^\| ([\w.-]+) \| ((?:causal|masked|seq2seq)(?:, \w+)*) \|", text,
                        re.MULTILINE)
    names = [name for name, _ in listed]
    assert len(names) == len(set(names))
    known = conformance.mappings()
    assert set(names) == set(known), set(names) ^ set(known)
    assert all(kinds == ", ".join(known[name]) for name, kinds in listed)
    summary = dict(re.findall(r"^\| (full|long|generate|norm|norm-res-ln|alti|value-zeroing) "
                              r"\|((?: \d+ \|){6})$", text, re.MULTILINE))
    assert set(summary) == set(conformance.PATHS)
    for path, cells in summary.items():
        wrong, crash = (int(n) for n in cells.split("|")[-3:-1])
        assert (wrong, crash) == (0, 0), path
    assert "Types not run" not in text
