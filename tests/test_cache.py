"""The capture cache: keys, storage, the CLI skipping the model, ``attnviz cache``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import attnviz.models
from attnviz import cache
from attnviz.models import ModelSpec
from attnviz.models.toy import ToyConfig

TEXT = "The cat sat on the mat"
TOY = ["--model", "toy", "--toy-layers", "2", "--toy-heads", "2"]


def _toy_spec(**changes: object) -> ModelSpec:
    config = ToyConfig(layers=2, heads=2, **changes)  # type: ignore[arg-type]
    return ModelSpec(name="toy", toy=config)


def _count_loads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Wrap load_source: record each call."""
    calls: list[str] = []
    real = attnviz.models.load_source

    def counting(spec=None):  # type: ignore[no-untyped-def]
        calls.append(getattr(spec, "name", str(spec)))
        return real(spec)

    monkeypatch.setattr(attnviz.models, "load_source", counting)
    return calls


def test_cache_dir_follows_the_environment(monkeypatch: pytest.MonkeyPatch,
                                           tmp_path: Path) -> None:
    monkeypatch.setenv("ATTNVIZ_CACHE_DIR", str(tmp_path / "here"))
    assert cache.cache_dir() == tmp_path / "here"
    monkeypatch.delenv("ATTNVIZ_CACHE_DIR")
    monkeypatch.setattr(cache.sys, "platform", "linux")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.cache_dir() == tmp_path / "xdg" / "attnviz"
    monkeypatch.setattr(cache.sys, "platform", "darwin")
    assert cache.cache_dir() == Path.home() / "Library" / "Caches" / "attnviz"


def test_key_depends_on_everything_that_changes_the_weights() -> None:
    base = cache.capture_key(_toy_spec(), TEXT)
    assert base == cache.capture_key(_toy_spec(), TEXT)
    assert len(base) == 64
    others = {
        cache.capture_key(_toy_spec(), TEXT + "!"),
        cache.capture_key(_toy_spec(), TEXT, "A pair"),
        cache.capture_key(_toy_spec(seed=1), TEXT),
        cache.capture_key(ModelSpec(name="toy", toy=ToyConfig(layers=2, heads=2),
                                    dtype="float16"), TEXT),
        cache.capture_key(_toy_spec(), TEXT, max_tokens=3),
        cache.capture_key(_toy_spec(), TEXT, layers="0"),
        cache.capture_key(ModelSpec(name="minilm"), TEXT),
    }
    assert base not in others and len(others) == 7
    # Spelling of a selection does not matter; "all" is no selection.
    assert cache.capture_key(_toy_spec(), TEXT, layers=" all ") == base
    assert cache.capture_key(_toy_spec(), TEXT, heads="0, 1") == cache.capture_key(
        _toy_spec(), TEXT, heads="0,1")


def test_minilm_identity_fingerprints_its_files_without_loading() -> None:
    identity = cache.model_identity(ModelSpec(name="minilm"))
    names = [row[0] for row in identity["files"]]
    assert "model.safetensors" in names and "config.json" in names


def test_store_and_lookup_round_trip() -> None:
    from attnviz.models.toy import ToySource

    capture = ToySource(ToyConfig(layers=2, heads=2)).capture(TEXT)
    key = cache.capture_key(_toy_spec(), TEXT)
    assert cache.lookup(key) is None
    assert cache.store(key, capture)
    hit = cache.lookup(key)
    assert hit is not None and hit.tokens == capture.tokens
    assert np.array_equal(hit.weights, capture.weights)
    assert cache.info().entries == 1


def test_damaged_entry_is_a_miss_and_is_removed() -> None:
    from attnviz.models.toy import ToySource

    capture = ToySource(ToyConfig(layers=2, heads=2)).capture(TEXT)
    key = cache.capture_key(_toy_spec(), TEXT)
    cache.store(key, capture)
    npy = cache.cache_dir() / cache.CAPTURES / f"{key}.npy"
    npy.write_bytes(b"garbage")
    assert cache.lookup(key) is None
    assert not npy.exists()


def test_eviction_keeps_the_cache_under_its_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    from attnviz.models.toy import ToySource

    source = ToySource(ToyConfig(layers=2, heads=2))
    sizes = []
    for word in ("one", "two", "three", "four"):
        capture = source.capture(f"{TEXT} {word}")
        cache.store(cache.capture_key(_toy_spec(), word), capture)
        sizes.append(cache.info().bytes)
    per_entry = sizes[0]
    monkeypatch.setenv(cache.ENV_MAX_MB, str(2.5 * per_entry / 1024 / 1024))
    removed = cache.evict()
    assert removed == 2
    assert cache.info().entries == 2
    # The most recently stored survive.
    assert cache.lookup(cache.capture_key(_toy_spec(), "four")) is not None
    assert cache.lookup(cache.capture_key(_toy_spec(), "one")) is None


def test_second_heatmap_skips_loading_the_model(invoke, monkeypatch: pytest.MonkeyPatch,
                                                tmp_path: Path) -> None:
    calls = _count_loads(monkeypatch)
    first = invoke("heatmap", TEXT, *TOY, "--layer", "1", "--head", "0",
                   "-o", tmp_path / "a.png")
    assert first.exit_code == 0, first.output
    assert calls == ["toy"]

    def refuse(spec=None):  # type: ignore[no-untyped-def]
        raise AssertionError("the model was loaded although the capture is cached")

    monkeypatch.setattr(attnviz.models, "load_source", refuse)
    second = invoke("heatmap", TEXT, *TOY, "--layer", "1", "--head", "0",
                    "-o", tmp_path / "b.png")
    assert second.exit_code == 0, second.output
    assert (tmp_path / "a.png").read_bytes() == (tmp_path / "b.png").read_bytes()
    topk = invoke("top-k", TEXT, *TOY, "--layer", "0", "--head", "1", "--format", "json")
    assert topk.exit_code == 0, topk.output
    assert json.loads(topk.stdout)["rows"]


def test_a_cached_full_capture_serves_a_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    from attnviz.session import Session

    loads = _count_loads(monkeypatch)
    full = Session().capture(TEXT, model=_toy_spec())
    part = Session().capture(TEXT, model=_toy_spec(), layers="1", heads="0")
    assert len(loads) == 1
    assert part.layers == [1] and part.heads == [0]
    assert np.array_equal(part.weights[0, 0], full.weights[1, 0])


def test_no_cache_runs_the_model_and_writes_nothing(invoke,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _count_loads(monkeypatch)
    for _ in range(2):
        result = invoke("top-k", TEXT, *TOY, "--no-cache", "-l", "0", "--head", "0")
        assert result.exit_code == 0, result.output
    assert calls == ["toy", "toy"]
    assert cache.info().entries == 0


def test_a_different_text_or_model_misses(invoke, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _count_loads(monkeypatch)
    for args in ([TEXT, *TOY], [TEXT + " again", *TOY], [TEXT, *TOY, "--seed", "3"],
                 [TEXT, *TOY]):
        result = invoke("top-k", *args, "-l", "0", "--head", "0")
        assert result.exit_code == 0, result.output
    assert len(calls) == 3  # the last one is the first one again


def test_cache_clear_and_info(invoke) -> None:
    from attnviz.models.toy import ToySource

    capture = ToySource(ToyConfig(layers=2, heads=2)).capture(TEXT)
    for word in ("a", "b"):
        cache.store(cache.capture_key(_toy_spec(), word), capture)
    info = invoke("cache", "info")
    assert info.exit_code == 0, info.output
    assert "2 cached captures" in info.stdout and str(cache.cache_dir()) in info.stdout
    cleared = invoke("cache", "clear")
    assert cleared.exit_code == 0, cleared.output
    assert "Removed 2 cached captures" in cleared.stdout
    assert cache.info().entries == 0
    assert not any((cache.cache_dir() / cache.CAPTURES).iterdir())
    again = invoke("cache", "clear")
    assert again.exit_code == 0 and "Removed 0 cached captures" in again.stdout


def test_unwritable_cache_only_warns(invoke, monkeypatch: pytest.MonkeyPatch,
                                     tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("ATTNVIZ_CACHE_DIR", str(blocker))
    result = invoke("top-k", TEXT, *TOY, "-l", "0", "--head", "0", "--format", "csv")
    assert result.exit_code == 0, result.output
    assert "could not keep the capture in the cache" in result.stderr
    assert result.stdout.startswith("query_index,")


def test_entries_carry_a_checksum_of_their_bytes() -> None:
    import hashlib

    from attnviz.models.toy import ToySource

    capture = ToySource(ToyConfig(layers=2, heads=2)).capture(TEXT)
    key = cache.capture_key(_toy_spec(), TEXT)
    cache.store(key, capture)
    folder = cache.cache_dir() / cache.CAPTURES
    sidecar = json.loads((folder / f"{key}.json").read_text())
    rest = {k: v for k, v in sidecar.items() if k != cache.CHECKSUM}
    expected = hashlib.sha256((folder / f"{key}.npy").read_bytes() + b"\0" + json.dumps(
        rest, sort_keys=True, ensure_ascii=True).encode("ascii")).hexdigest()
    assert sidecar[cache.CHECKSUM] == expected
    # The entry is an ordinary capture too.
    from attnviz.capture import load_capture

    np.testing.assert_array_equal(load_capture(folder / f"{key}.npy").weights, capture.weights)


def test_usage_record_tracks_the_bytes_on_disk() -> None:
    from attnviz.models.toy import ToySource

    source = ToySource(ToyConfig(layers=2, heads=2))
    for i in range(12):
        cache.store(cache.capture_key(_toy_spec(), f"{TEXT} {i}"), source.capture(f"{TEXT} {i}"))
    record = json.loads((cache.cache_dir() / cache.CAPTURES / cache.USAGE).read_text())
    assert record["bytes"] == cache.info().bytes > 0


def test_stale_temporaries_go_when_the_cache_is_trimmed(monkeypatch: pytest.MonkeyPatch) -> None:
    import os
    import time

    from attnviz.models.toy import ToySource

    capture = ToySource(ToyConfig(layers=2, heads=2)).capture(TEXT)
    key = cache.capture_key(_toy_spec(), TEXT)
    cache.store(key, capture)
    folder = cache.cache_dir() / cache.CAPTURES
    stale, fresh = folder / f".{key}.npy.abc12345.tmp", folder / f".{key}.json.xyz98765.tmp"
    for path in (stale, fresh):
        path.write_bytes(b"half written")
    old = time.time() - 2 * 3600
    os.utime(stale, (old, old))
    cache.evict()
    assert not stale.exists() and fresh.exists()  # a fresh one may belong to a running store
    assert cache.info().entries == 1


@pytest.mark.parametrize("option", [["--device", "gpu0"], ["--dtype", "float8"],
                                    ["--device-map", "everywhere"], ["--device-map", "auto"]])
def test_a_cached_text_does_not_hide_a_bad_model_option(invoke, option) -> None:
    """Options are checked before the cache answers: the same text cached still fails."""
    first = invoke("top-k", TEXT, *TOY, "-l", "0", "--head", "0")
    assert first.exit_code == 0, first.output
    assert cache.info().entries == 1
    again = invoke("top-k", TEXT, *TOY, "-l", "0", "--head", "0", *option)
    assert again.exit_code == 2, again.output
    assert option[0] in again.stderr
