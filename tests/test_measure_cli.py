"""``--measure`` end to end: every command that shows or saves attention, against the measure
computed directly (``attnviz.measures.compute`` on the bundled MiniLM, outside the capture path).

The reference here never goes through a source, the session, the cache or the CLI: it tokenizes
the text itself, calls ``measures.compute`` and stacks the layers. Everything the commands print
or write is compared with it (or with an independent numpy computation on top of it).
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from attnviz import measures
from attnviz.capture import Capture, load_capture
from attnviz.errors import UsageError
from tests.conftest import SENTENCE

TOL = 2e-6  # float32 values printed with 6 decimals
MEASURE = "norm"
NORM_LABEL = "norm ||\u03b1f(x)||"


def reference(minilm: Any, text: str = SENTENCE, pair: str | None = None,
              measure: str = MEASURE) -> np.ndarray:
    """``[layer, head, query, key]`` float64 of ``measure``, straight from the measures."""
    enc = minilm.tokenizer(text, pair, return_tensors="pt")
    kept = ("input_ids", "attention_mask") + (
        ("token_type_ids",) if minilm.config.model_type == "bert" else ())  # GPT-2 takes none
    inputs = {k: v for k, v in enc.items() if k in kept}
    per_layer = measures.compute(measure, minilm.model, inputs, minilm.config)
    return np.stack([layer[0].double().numpy() for layer in per_layer])


def assert_clean(result: Any, code: int, fragment: str) -> None:
    output = result.stdout + result.stderr
    assert result.exit_code == code, output
    assert fragment in " ".join(output.split()), output
    assert "Traceback" not in output


@pytest.fixture(scope="module")
def norm_ref(minilm: Any) -> np.ndarray:
    return reference(minilm)


# --------------------------------------------------------------------------- the record
def test_source_capture_keeps_the_selection_of_the_measure(minilm: Any,
                                                            norm_ref: np.ndarray) -> None:
    cap = minilm.capture(SENTENCE, layers=[1, 4], heads=[2, 7], measure="norm")
    np.testing.assert_allclose(cap.weights, norm_ref[np.ix_([1, 4], [2, 7])], atol=1e-6)
    assert (cap.layers, cap.heads, cap.measure) == ([1, 4], [2, 7], "norm")
    assert cap.meta["measure_conventions"] == measures.conventions("norm")
    assert cap.measure_label == NORM_LABEL and not cap.rows_sum_to_one
    assert cap.title_start == f"minilm: {NORM_LABEL}, "
    # Not attention: the rows are amounts (the reference's own rows do not sum to 1 either).
    assert not np.allclose(norm_ref.sum(-1), 1.0, atol=1e-3)
    weights = minilm.capture(SENTENCE, layers=[1], heads=[2])
    assert weights.measure == "weights" and "measure" not in weights.meta
    assert weights.title_start == "minilm: "


def test_sidecar_round_trip(minilm: Any, tmp_path: Path) -> None:
    cap = minilm.capture(SENTENCE, layers=[0, 5], measure="norm")
    cap.save(tmp_path / "norm")
    back = load_capture(tmp_path / "norm")
    np.testing.assert_array_equal(back.weights, cap.weights)
    assert back.meta["measure"] == "norm"
    assert back.meta["measure_conventions"] == cap.meta["measure_conventions"]
    sidecar = json.loads((tmp_path / "norm" / "capture.json").read_text("utf-8"))
    assert sidecar["meta"]["measure"] == "norm"
    assert sidecar["meta"]["measure_conventions"]["reference"].startswith("Kobayashi")
    # Attention weights write no measure at all (their sidecar is what it always was).
    minilm.capture(SENTENCE, layers=[0]).save(tmp_path / "weights")
    plain = json.loads((tmp_path / "weights" / "capture.json").read_text("utf-8"))
    assert "measure" not in plain["meta"] and "measure_conventions" not in plain["meta"]


def test_a_saved_measure_is_checked_as_a_measure_not_as_attention(minilm: Any,
                                                                   tmp_path: Path) -> None:
    cap = minilm.capture(SENTENCE, layers=[0], measure="norm")
    cap.save(tmp_path / "n")
    sidecar = tmp_path / "n" / "capture.json"
    data = json.loads(sidecar.read_text("utf-8"))
    data["meta"].pop("measure")  # now it claims to be attention: rows must sum to 1
    sidecar.write_text(json.dumps(data), "utf-8")
    with pytest.raises(Exception, match="sum to"):
        load_capture(tmp_path / "n")


def test_session_cache_keys_per_measure(patched_minilm: Any, norm_ref: np.ndarray) -> None:
    from attnviz.session import Session

    session = Session()
    weights = session.capture(SENTENCE, layers="2")
    assert session.forwards == 1 and weights.measure == "weights"
    norm = session.capture(SENTENCE, layers="2", measure="norm")
    assert session.forwards == 2, "norm was served from the weights entry"
    np.testing.assert_allclose(norm.weights, norm_ref[[2]], atol=1e-6)
    again = session.capture(SENTENCE, layers="2", measure="norm")
    assert session.forwards == 2, "a repeat of norm ran the model again"
    assert again.measure == "norm"
    np.testing.assert_array_equal(again.weights, norm.weights)
    weights_again = session.capture(SENTENCE, layers="2")
    assert session.forwards == 2 and weights_again.measure == "weights"
    np.testing.assert_array_equal(weights_again.weights, weights.weights)


def test_requests_batches_and_python_api(patched_minilm: Any, minilm: Any,
                                         norm_ref: np.ndarray) -> None:
    import attnviz
    from attnviz.request import CaptureRequest
    from attnviz.session import Session

    session = Session(use_cache=False)
    request = CaptureRequest(text=SENTENCE, layer=3, head=1, measure="NORM")
    assert request.measure == "norm"
    np.testing.assert_allclose(session.run(request).weights, norm_ref, atol=1e-6)
    other = "A dog barked at the mailman"
    batch = list(session.run_texts(CaptureRequest(measure="norm", layers="1"),
                                   [(SENTENCE, None), (other, None)], batch_size=4))
    np.testing.assert_allclose(batch[0].weights, norm_ref[[1]], atol=1e-6)
    np.testing.assert_allclose(batch[1].weights, reference(minilm, other)[[1]], atol=1e-6)
    assert [c.measure for c in batch] == ["norm", "norm"]  # type: ignore[union-attr]
    own = attnviz.capture(minilm.model, minilm.tokenizer, SENTENCE, layers="0",
                          measure="norm")
    np.testing.assert_allclose(own.weights, norm_ref[[0]], atol=1e-6)
    assert own.measure == "norm"


def test_python_usage_errors(patched_minilm: Any) -> None:
    import attnviz
    from attnviz.request import CaptureRequest
    from attnviz.session import Session

    with pytest.raises(UsageError, match="unknown measure 'attention'"):
        CaptureRequest(text="x", measure="attention")
    with pytest.raises(UsageError, match="measure must be a name"):
        CaptureRequest(text="x", measure=3)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="toy model gives attention weights only"):
        Session(use_cache=False).capture("a b", model="toy", measure="norm")
    with pytest.raises(UsageError, match="measure must be a name"):
        attnviz.capture_text("a b", model="toy", measure=5)
    with pytest.raises(UsageError, match="builds attention weights, not the measure 'norm'"):
        Capture.from_attentions([np.full((1, 1, 2, 2), 0.5)], ["a", "b"], measure="norm")


# --------------------------------------------------------------------------- the commands
def test_top_k_csv_json_and_table(invoke: Any, cli_minilm: Any, norm_ref: np.ndarray) -> None:
    result = invoke("top-k", SENTENCE, "--measure", "norm", "-l", "1", "--head", "2",
                    "-k", "3", "--format", "csv")
    assert result.exit_code == 0, result.output
    rows = list(csv.DictReader(io.StringIO(result.stdout)))
    assert list(rows[0]) == ["query_index", "query", "rank", "key_index", "key", "norm"]
    matrix = norm_ref[1, 2]
    for query in range(matrix.shape[0]):
        expected = np.argsort(-matrix[query], kind="stable")[:3]
        got = [r for r in rows if int(r["query_index"]) == query]
        assert [int(r["key_index"]) for r in got] == list(expected)
        np.testing.assert_allclose([float(r["norm"]) for r in got], matrix[query, expected],
                                   atol=TOL)
    as_json = json.loads(invoke("top-k", SENTENCE, "--measure", "norm", "-l", "1", "--head",
                                "2", "--format", "json").stdout)
    assert as_json["measure"] == "norm" and f"{NORM_LABEL}, layer 1, head 2" in as_json["title"]
    table = invoke("top-k", SENTENCE, "--measure", "norm", "-l", "1", "--head", "2")
    assert f"minilm: {NORM_LABEL}, layer 1, head 2" in table.stdout
    plain = invoke("top-k", SENTENCE, "-l", "1", "--head", "2", "--format", "csv")
    assert plain.stdout.splitlines()[0].endswith(",weight")


def test_heatmap_titles_and_names(invoke: Any, cli_minilm: Any, tmp_path: Path,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from PIL import Image

    from attnviz.render.heatmap import head_title, layer_title, overview_title

    monkeypatch.chdir(tmp_path)
    result = invoke("heatmap", SENTENCE, "--measure", "norm", "--layer", "2", "--head", "3")
    assert result.exit_code == 0, result.output
    path = Path(result.stdout.strip())
    assert path.name.endswith("_L2_H3_norm.png")
    with Image.open(path) as image:
        assert image.format == "PNG" and np.asarray(image.convert("L")).std() > 5
    cap = cli_minilm.capture(SENTENCE, layers=[2], measure="norm")
    assert head_title(cap, 2, 3) == f"minilm: {NORM_LABEL}, layer 2, head 3"
    assert layer_title(cap, 2).startswith(f"minilm: {NORM_LABEL}, layer 2")
    assert overview_title(cap).startswith(f"minilm: {NORM_LABEL}, ")
    # The figure itself: its title and its colour bar's label name the measure.
    from matplotlib.text import Text

    from attnviz.render.heatmap import capture_grid_figure, capture_head_figure

    for fig in (capture_head_figure(cap, 2, 3).fig, capture_grid_figure(cap, 2)):
        texts = [t.get_text() for t in fig.findobj(Text)]
        assert any(t.startswith(f"minilm: {NORM_LABEL}, layer 2") for t in texts), texts
        assert any(t.startswith(NORM_LABEL) for t in texts), texts  # the colour bar
        assert not any("attention weight" in t for t in texts)


def test_dump_and_from(invoke: Any, cli_minilm: Any, tmp_path: Path,
                       norm_ref: np.ndarray) -> None:
    out = tmp_path / "cat"
    result = invoke("dump", SENTENCE, "--measure", "norm", "--layers", "0,3", "-o", out)
    assert result.exit_code == 0, result.output
    cap = load_capture(out)
    np.testing.assert_allclose(cap.weights, norm_ref[[0, 3]], atol=1e-6)
    assert cap.measure == "norm"
    shown = invoke("top-k", "--from", out, "-l", "3", "--head", "0", "--format", "json")
    assert json.loads(shown.stdout)["measure"] == "norm"
    same = invoke("top-k", "--from", out, "--measure", "norm", "-l", "3", "--head", "0")
    assert same.exit_code == 0, same.output
    other = invoke("top-k", "--from", out, "--measure", "weights", "-l", "3", "--head", "0")
    assert_clean(other, 2, "holds the measure norm, not weights")
    assert other.stderr.count("Error:") == 1
    # export --from checks a measure named explicitly too, before writing anything; without
    # --measure it exports what the capture holds.
    figs = tmp_path / "figs"
    wrong = invoke("export", "--from", out, "--measure", "weights", "--figures", "overview",
                   "-o", figs)
    assert_clean(wrong, 2, "holds the measure norm, not weights")
    assert not figs.exists()
    for flags in ((), ("--measure", "norm")):
        kept = invoke("export", "--from", out, *flags, "--figures", "overview", "-o", figs)
        assert kept.exit_code == 0, kept.output
    # A dump of a cached capture (the second run) writes the same record.
    again = invoke("dump", SENTENCE, "--measure", "norm", "--layers", "0,3", "-o",
                   tmp_path / "again.npy")
    assert again.exit_code == 0, again.output
    np.testing.assert_array_equal(load_capture(tmp_path / "again.npy").weights, cap.weights)


def test_heads_row_normalises_and_says_so(invoke: Any, cli_minilm: Any,
                                          norm_ref: np.ndarray) -> None:
    result = invoke("heads", SENTENCE, "--measure", "norm", "--format", "json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["measure"] == "norm"
    assert "norm rows scaled to sum to 1 before the statistics" in report["title"]
    assert report["title"].startswith(f"minilm: {NORM_LABEL}, 1 text")
    rows = {(r["layer"], r["head"]): r for r in report["heads"]}
    tokens = norm_ref.shape[-1]
    for layer, head in ((0, 0), (3, 7), (5, 11)):
        block = norm_ref[layer, head]
        p = block / block.sum(-1, keepdims=True)
        entropy = -(p * np.log(np.where(p > 0, p, 1))).sum(-1) / np.log(tokens)
        assert rows[(layer, head)]["entropy"] == pytest.approx(entropy.mean(), abs=1e-6)
        assert rows[(layer, head)]["self"] == pytest.approx(np.diagonal(p).mean(), abs=1e-6)
        assert rows[(layer, head)]["first"] == pytest.approx(p[:, 0].mean(), abs=1e-6)
    table = invoke("heads", SENTENCE, "--measure", "norm")
    assert "rows scaled to sum to 1" in " ".join(table.stdout.split())
    as_csv = list(csv.DictReader(io.StringIO(invoke("heads", SENTENCE, "--measure", "norm",
                                                    "--format", "csv").stdout)))
    assert {row["measure"] for row in as_csv} == {"norm"}
    first = next(r for r in as_csv if (r["layer"], r["head"]) == ("3", "7"))
    assert float(first["self"]) == pytest.approx(rows[(3, 7)]["self"], abs=1e-6)
    plain = invoke("heads", SENTENCE, "--format", "csv").stdout.splitlines()[0]
    assert "measure" not in plain


def test_rollout_of_norm(invoke: Any, cli_minilm: Any, tmp_path: Path,
                         norm_ref: np.ndarray) -> None:
    out = tmp_path / "roll.png"
    result = invoke("rollout", SENTENCE, "--measure", "norm", "-o", out)
    assert result.exit_code == 0, result.output
    assert "each head's rows were scaled to sum to 1" in " ".join(result.stderr.split())
    matrix = np.load(tmp_path / "roll.npy")
    expected = None
    for layer in range(norm_ref.shape[0]):  # lowest first
        heads = norm_ref[layer] / norm_ref[layer].sum(-1, keepdims=True)
        fused = heads.mean(axis=0)
        mixed = 0.5 * fused + 0.5 * np.eye(fused.shape[0])
        mixed /= mixed.sum(-1, keepdims=True)
        expected = mixed if expected is None else mixed @ expected
    np.testing.assert_allclose(matrix, expected, atol=1e-5)
    np.testing.assert_allclose(matrix.sum(-1), 1.0, atol=1e-5)
    # Attention flow takes the same row-scaled heads.
    from attnviz.analysis.flow import flow_weights

    flowed = invoke("rollout", SENTENCE, "--measure", "norm", "--method", "flow", "-o",
                    tmp_path / "flow.png")
    assert flowed.exit_code == 0, flowed.output
    heads = norm_ref / norm_ref.sum(-1, keepdims=True)
    np.testing.assert_allclose(np.load(tmp_path / "flow.npy"), flow_weights(heads), atol=1e-5)
    assert "each head's rows were scaled" in " ".join(flowed.stderr.split())


def test_html_report_names_the_measure(invoke: Any, cli_minilm: Any, tmp_path: Path,
                                       norm_ref: np.ndarray) -> None:
    from attnviz.render.html import decode_weights, read_report_data

    out = tmp_path / "norm.html"
    result = invoke("html", SENTENCE, "--measure", "norm", "--precision", "16", "-o", out)
    assert result.exit_code == 0, result.output
    data = read_report_data(out.read_text("utf-8"))
    doc = data["docs"][0]
    assert doc["measure"] == "norm" and doc["measure_label"] == NORM_LABEL
    assert NORM_LABEL in data["title"]
    decoded = decode_weights(doc["weights"])
    top = float(norm_ref.max())
    np.testing.assert_allclose(decoded, norm_ref, atol=max(top, 1.0) / 65535)


def test_report_weights_above_one_keep_their_values() -> None:
    from attnviz.render.html import decode_weights, encode_weights

    rng = np.random.default_rng(0)
    values = rng.uniform(0, 7.5, size=(2, 3, 4, 4)).astype(np.float32)
    block = encode_weights(values, 16)
    assert block["range"] == pytest.approx(float(values.max()))
    np.testing.assert_allclose(decode_weights(block), values, atol=float(values.max()) / 65535)
    attention = np.full((1, 1, 2, 2), 0.5, dtype=np.float32)
    assert "range" not in encode_weights(attention, 8)  # attention's blocks are as before


def test_compare_and_export(invoke: Any, cli_minilm: Any, minilm: Any, tmp_path: Path,
                            norm_ref: np.ndarray) -> None:
    other = "The dog sat on the mat"
    result = invoke("compare", SENTENCE, other, "--measure", "norm", "-l", "2", "--head", "4",
                    "--format", "json", "-o", tmp_path / "c.png")
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    assert document["a"]["measure"] == document["b"]["measure"] == "norm"
    b_ref = reference(minilm, other)
    for change in document["changes"]:
        i, j = change["query_index"], change["key_index"]
        assert change["a"] == pytest.approx(norm_ref[2, 4, i, j], abs=1e-5)
        assert change["b"] == pytest.approx(b_ref[2, 4, i, j], abs=1e-5)
    out = tmp_path / "figs"
    exported = invoke("export", SENTENCE, "--measure", "norm", "--layers", "1", "--heads",
                      "0", "--figures", "heads", "--jobs", "1", "-o", out)
    assert exported.exit_code == 0, exported.output
    folder = next(p for p in out.iterdir() if p.is_dir())
    rows = list(csv.DictReader(io.StringIO((folder / "topk.csv").read_text("utf-8"))))
    assert "norm" in rows[0] and "weight" not in rows[0]
    first = [r for r in rows if r["query_index"] == "1"]
    expected = np.argsort(-norm_ref[1, 0, 1], kind="stable")[:3]
    assert [int(r["key_index"]) for r in first] == list(expected)
    np.testing.assert_allclose([float(r["norm"]) for r in first], norm_ref[1, 0, 1, expected],
                               atol=TOL)
    saved = load_capture(folder)
    assert saved.measure == "norm"
    np.testing.assert_allclose(saved.weights, norm_ref[np.ix_([1], [0])], atol=1e-6)
    manifest = json.loads((folder / "export.json").read_text("utf-8"))
    assert manifest["settings"]["measure"] == "norm"
    # The PNG frames were laid out with the measure's colour bar label (drawn in this process).
    from attnviz.export import draw

    assert any(NORM_LABEL in key for key in draw._HEAD_TEMPLATES)


def test_weights_by_name_is_the_default(invoke: Any, cli_minilm: Any) -> None:
    args = ("top-k", SENTENCE, "-l", "0", "--head", "1", "--format", "csv")
    assert invoke(*args, "--measure", "weights").stdout == invoke(*args).stdout


@pytest.mark.parametrize("args", [
    ("top-k", SENTENCE, "-l", "0", "--head", "0"),
    ("heatmap", SENTENCE, "-l", "0"),
    ("heads", SENTENCE),
    ("rollout", SENTENCE),
    ("compare", SENTENCE, "The dog sat"),
])
def test_usage_errors(invoke: Any, forbid_loading: Any, args: tuple[str, ...]) -> None:
    tried = forbid_loading()
    bad = invoke(*args, "--measure", "attention")
    assert_clean(bad, 2, "unknown measure 'attention': choose one of weights, norm")
    assert bad.stderr.count("Error:") == 1
    if args[0] != "compare":
        toy = invoke(*args, "--model", "toy", "--measure", "norm")
        assert_clean(toy, 2, "the toy model gives attention weights only, not the measure norm")
    assert tried == []


# --------------------------------------------------------------------------- the other measures
@pytest.mark.parametrize("measure", ["alti", "value-zeroing", "norm-res-ln"])
def test_other_measures_top_k_and_dump(invoke: Any, cli_minilm: Any, minilm: Any,
                                       tmp_path: Path, measure: str) -> None:
    expected = reference(minilm, measure=measure)
    result = invoke("top-k", SENTENCE, "--measure", measure, "-l", "4", "--head", "5",
                    "-k", "2", "--format", "csv")
    assert result.exit_code == 0, result.output
    rows = list(csv.DictReader(io.StringIO(result.stdout)))
    assert list(rows[0])[-1] == measure
    for query in range(expected.shape[2]):
        keys = np.argsort(-expected[4, 5, query], kind="stable")[:2]
        got = [r for r in rows if int(r["query_index"]) == query]
        np.testing.assert_allclose(sorted(float(r[measure]) for r in got),
                                   sorted(expected[4, 5, query, keys]), atol=TOL)
    dumped = invoke("dump", SENTENCE, "--measure", measure, "--heads", "0,5", "-o",
                    tmp_path / "d")
    assert dumped.exit_code == 0, dumped.output
    cap = load_capture(tmp_path / "d")
    np.testing.assert_allclose(cap.weights, expected[:, [0, 5]], atol=1e-6)
    assert cap.measure == measure and cap.meta["measure_conventions"]["name"] == measure
    # What the README says of each measure: whose rows sum to 1, which repeat per head.
    sums_to_one = bool(np.allclose(expected.sum(-1), 1.0, atol=1e-4))
    assert cap.rows_sum_to_one is sums_to_one
    assert sums_to_one is (measure in ("alti", "value-zeroing"))
    np.testing.assert_array_equal(expected[:, 0], expected[:, 5])  # defined per layer


def test_alti_rows_are_distributions_so_nothing_is_rescaled(invoke: Any, cli_minilm: Any,
                                                            minilm: Any, tmp_path: Path) -> None:
    expected = reference(minilm, measure="alti")
    np.testing.assert_allclose(expected.sum(-1), 1.0, atol=1e-5)
    heads = json.loads(invoke("heads", SENTENCE, "--measure", "alti", "--format",
                              "json").stdout)
    assert heads["measure"] == "alti" and "scaled" not in heads["title"]
    assert heads["title"].startswith("minilm: ALTI contributions, ")
    out = tmp_path / "roll.png"
    rolled = invoke("rollout", SENTENCE, "--measure", "alti", "-o", out)
    assert rolled.exit_code == 0 and "scaled" not in rolled.stderr, rolled.output
    # ALTI holds the residual path: its layers are multiplied as they are (Ferrando et al.'s
    # compute_joint_attention(..., res=False)), no 0.5 I mixed in.
    assert "holds the residual path already" in " ".join(rolled.stderr.split())
    result = None
    for layer in range(expected.shape[0]):
        fused = expected[layer].mean(axis=0)
        fused /= fused.sum(-1, keepdims=True)
        result = fused if result is None else fused @ result
    np.testing.assert_allclose(np.load(tmp_path / "roll.npy"), result, atol=1e-5)


def test_a_causal_model(tiny_gpt2_dir: Path, tmp_path: Path) -> None:
    from attnviz.models.hf import HFSource
    from attnviz.session import Session

    source = HFSource(str(tiny_gpt2_dir), device="cpu")
    cap = source.capture(SENTENCE, measure="norm")
    expected = reference(source, measure="norm")
    np.testing.assert_allclose(cap.weights, expected, atol=1e-6)
    assert cap.causal
    assert np.all(np.triu(cap.weights[0, 0], 1) == 0)
    cap.save(tmp_path / "g")
    assert load_capture(tmp_path / "g").measure == "norm"
    session = Session(use_cache=False)
    batch = list(session.captures([SENTENCE, "A dog"], model=str(tiny_gpt2_dir),
                                  batch_size=2, measure="norm"))
    np.testing.assert_allclose(batch[0].weights, expected, atol=1e-6)  # type: ignore[union-attr]


def test_measures_refused_where_they_do_not_apply(invoke: Any, cli_minilm: Any,
                                                  tiny_llama_dir: Path, tmp_path: Path) -> None:
    pre_ln = invoke("top-k", SENTENCE, "--model", tiny_llama_dir, "--measure", "norm-res-ln",
                    "-l", "0", "--head", "0")
    assert_clean(pre_ln, 2, "measure 'norm-res-ln' is not defined for model type 'llama'")
    assert pre_ln.stderr.count("Error:") == 1
    corpus = tmp_path / "texts.txt"
    corpus.write_text("The cat sat\nA dog barked\n", "utf-8")
    ray = invoke("heads", "--input", corpus, "--engine", "ray", "--measure", "norm")
    assert_clean(ray, 2, "--measure is not available with --engine ray yet")
    invoke("dump", SENTENCE, "--measure", "norm", "--layers", "0", "-o", tmp_path / "a")
    invoke("dump", "The dog sat", "--layers", "0", "-o", tmp_path / "b")
    mixed = invoke("compare", "--from", tmp_path / "a", "--from", tmp_path / "b", "-l", "0")
    assert_clean(mixed, 2, "A holds the measure norm and B weights")


def test_notebook_view_names_the_measure(minilm: Any) -> None:
    from attnviz.notebook import capture_html

    cap = minilm.capture(SENTENCE, layers=[1], measure="norm")
    shown = capture_html(cap)
    assert f"attnviz: minilm, {NORM_LABEL}: {SENTENCE}" in shown  # the view's title
    plain = capture_html(minilm.capture(SENTENCE, layers=[1]))
    assert f"attnviz: minilm: {SENTENCE}" in plain and "minilm, norm" not in plain


def test_heads_of_a_corpus(invoke: Any, cli_minilm: Any, minilm: Any, tmp_path: Path) -> None:
    texts = [SENTENCE, "A dog barked at the mailman"]
    corpus = tmp_path / "texts.txt"
    corpus.write_text("\n".join(texts) + "\n", "utf-8")
    result = invoke("heads", "--input", corpus, "--measure", "norm", "--format", "json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["measure"] == "norm" and report["texts"] == 2
    assert "norm rows scaled to sum to 1 before the statistics" in report["title"]
    rows = {(r["layer"], r["head"]): r for r in report["heads"]}
    selfs, count = 0.0, 0
    for text in texts:  # every query row of every text counts once
        block = reference(minilm, text)[2, 9]
        p = block / block.sum(-1, keepdims=True)
        selfs += float(np.diagonal(p).sum())
        count += p.shape[0]
    assert rows[(2, 9)]["self"] == pytest.approx(selfs / count, abs=1e-6)


def test_memory_is_checked_before_the_pass(minilm: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    import psutil

    from attnviz.errors import InputError

    calls: list[str] = []
    monkeypatch.setattr(measures, "compute", lambda *a: calls.append("compute") or [])
    # Room for the kept layer, not for the measure of every layer and head it is cut from.
    kept = 1 * 1 * 8 * 8 * 4
    monkeypatch.setattr(psutil, "virtual_memory",
                        lambda: types.SimpleNamespace(available=int(kept * 20)))
    with pytest.raises(InputError, match="6 layers x 12 heads"):
        minilm.capture(SENTENCE, layers=[0], heads=[0], measure="norm")
    assert calls == []
    assert minilm.capture(SENTENCE, layers=[0], heads=[0]).weights.shape == (1, 1, 8, 8)
