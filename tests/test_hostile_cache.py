"""A hostile or unlucky capture cache: foreign files, symbolic links, damaged entries, huge runs.

Families covered: the cache removes only what it created (clear and eviction, never through a
symbolic link); a damaged entry is detected by its checksum, recaptured, replaced and warned
about once; storing costs O(1) amortised (no rescan of the folder per store); a size limit that
is not a number is a clear message, not a traceback.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import attnviz.models
from attnviz import cache
from attnviz.models import ModelSpec
from attnviz.models.toy import ToyConfig, ToySource

TEXT = "The cat sat on the mat"
TOY = ["--model", "toy", "--toy-layers", "2", "--toy-heads", "2"]


def _spec() -> ModelSpec:
    return ModelSpec(name="toy", toy=ToyConfig(layers=2, heads=2))


@pytest.fixture(scope="module")
def source() -> ToySource:
    return ToySource(ToyConfig(layers=2, heads=2), device="cpu")


def _store(source: ToySource, text: str) -> str:
    key = cache.capture_key(_spec(), text)
    assert cache.store(key, source.capture(text))
    return key


def _folder() -> Path:
    return cache.cache_dir() / cache.CAPTURES


def _own_bytes() -> int:
    names = [p for p in _folder().iterdir() if p.suffix in (".npy", ".json")
             and len(p.stem) == 64 and not p.is_symlink()]
    return sum(p.stat().st_size for p in names)


def _refuse_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(spec: Any = None) -> Any:
        raise AssertionError("the model was loaded although the capture is cached")

    monkeypatch.setattr(attnviz.models, "load_source", refuse)


# =========================================================================== family 3
FOREIGN = ["notes.txt", "captures.json", ".notes.tmp", "README", "a" * 64 + ".npz",
           "A" * 64 + ".npy", "b" * 64 + ".npy.bak", "c" * 64 + ".txt", "x" + "d" * 64 + ".json",
           "e" * 63 + ".npy", "f" * 65 + ".json", ".hidden.npy"]


def _plant_foreign(folder: Path) -> dict[Path, bytes]:
    planted = {}
    for index, name in enumerate(FOREIGN):
        path = folder / name
        path.write_bytes(f"mine {index}".encode())
        planted[path] = path.read_bytes()
    (folder / "sub").mkdir()
    (folder / "sub" / ("0" * 64 + ".npy")).write_bytes(b"nested")
    planted[folder / "sub" / ("0" * 64 + ".npy")] = b"nested"
    return planted


def test_clear_removes_only_its_own_entries(source, tmp_path):
    keys = [_store(source, f"{TEXT} {word}") for word in ("one", "two")]
    folder = _folder()
    planted = _plant_foreign(folder)
    stale = folder / f".{keys[0]}.npy.k2j4h5g6.tmp"  # a killed store's temporary: ours
    stale.write_bytes(b"half")
    entries, freed = cache.clear()
    assert entries == 2 and freed > 0
    for path, content in planted.items():
        assert path.read_bytes() == content, path
    assert not stale.exists()
    assert not [p for p in folder.iterdir() if p.name.startswith(keys[0]) or
                p.name.startswith(keys[1])]


def test_cli_clear_keeps_a_users_file(invoke, tmp_path, monkeypatch):
    """The issue's reproduction: notes.txt beside the cache entries survives `cache clear`."""
    monkeypatch.setenv("ATTNVIZ_CACHE_DIR", str(tmp_path / "d"))
    (tmp_path / "d" / "captures").mkdir(parents=True)
    (tmp_path / "d" / "captures" / "notes.txt").write_text("mine\n")
    filled = invoke("top-k", TEXT, *TOY, "-l", "0", "--head", "0")
    assert filled.exit_code == 0, filled.output
    result = invoke("cache", "clear")
    assert result.exit_code == 0, result.output
    assert "Removed 1 cached capture" in result.stdout
    assert (tmp_path / "d" / "captures" / "notes.txt").read_text() == "mine\n"
    assert cache.info().entries == 0


def test_eviction_removes_only_its_own_entries(source, monkeypatch):
    folder = _folder()
    folder.mkdir(parents=True, exist_ok=True)
    planted = _plant_foreign(folder)
    big = folder / "dataset.bin"
    big.write_bytes(b"\0" * 2_000_000)  # not ours: neither removed nor counted
    planted[big] = big.read_bytes()
    keys = [_store(source, f"{TEXT} {i}") for i in range(4)]
    per_entry = _own_bytes() / 4
    monkeypatch.setenv(cache.ENV_MAX_MB, str(2.5 * per_entry / 1024 / 1024))
    cache.evict()
    for path, content in planted.items():
        assert path.read_bytes() == content, path
    assert cache.info().entries == 2
    assert cache.lookup(keys[-1]) is not None and cache.lookup(keys[0]) is None


def test_a_symlinked_entry_is_never_followed(source, tmp_path):
    outside = tmp_path / "outside"
    evil = source.capture("something else entirely")
    evil.save(outside / "victim.npy")
    before = {p.name: p.read_bytes() for p in outside.iterdir()}
    key = cache.capture_key(_spec(), TEXT)
    folder = _folder()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{key}.npy").symlink_to(outside / "victim.npy")
    (folder / f"{key}.json").symlink_to(outside / "victim.json")
    assert cache.lookup(key) is None  # never read through the link
    cache.store(key, source.capture(TEXT))
    assert {p.name: p.read_bytes() for p in outside.iterdir()} == before
    cache.clear()
    cache.evict(0)
    assert {p.name: p.read_bytes() for p in outside.iterdir()} == before


def test_a_symlinked_captures_folder_is_refused(invoke, source, tmp_path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    key = cache.capture_key(_spec(), TEXT)
    source.capture(TEXT).save(outside / f"{key}.npy")
    (outside / "notes.txt").write_text("mine")
    before = {p.name: p.read_bytes() for p in outside.iterdir()}
    cache.cache_dir().mkdir(parents=True, exist_ok=True)
    _folder().symlink_to(outside, target_is_directory=True)
    assert cache.lookup(key) is None
    stored = invoke("top-k", TEXT + " again", *TOY, "-l", "0", "--head", "0")
    assert stored.exit_code == 0, stored.output
    assert "symbolic link" in stored.stderr
    cleared = invoke("cache", "clear")
    assert cleared.exit_code == 1 and "symbolic link" in cleared.stderr
    assert "Traceback" not in cleared.output
    cache.evict(0)
    assert {p.name: p.read_bytes() for p in outside.iterdir()} == before


def test_odd_files_under_entry_names_are_left_alone(source):
    """A FIFO or a folder named like an entry: never read (no hang), replaced or removed."""
    import signal

    key = cache.capture_key(_spec(), TEXT)
    folder = _folder()
    folder.mkdir(parents=True, exist_ok=True)
    os.mkfifo(folder / f"{key}.json")
    (folder / f"{key}.npy").mkdir()
    signal.signal(signal.SIGALRM, lambda *_: pytest.fail("reading the cache hung on a FIFO"))
    signal.alarm(20)
    try:
        assert cache.lookup(key) is None
        assert cache.store(key, source.capture(TEXT)) is False
        assert cache.clear() == (0, 0)
        cache.evict(0)
    finally:
        signal.alarm(0)
    assert (folder / f"{key}.json").is_fifo() and (folder / f"{key}.npy").is_dir()


# =========================================================================== family 4
def _damage_one_weight(key: str) -> None:
    npy = _folder() / f"{key}.npy"
    weights = np.load(npy)
    weights[1, 0, 2, 3] *= 1e-20
    np.save(npy, weights)


def test_a_damaged_weight_is_a_miss_recaptured_and_replaced(source):
    from attnviz.session import Session

    key = _store(source, TEXT)
    fresh = source.capture(TEXT)
    _damage_one_weight(key)
    warnings: list[str] = []
    assert cache.lookup(key, warn=warnings.append) is None
    assert len(warnings) == 1 and "damaged" in warnings[0]
    session = Session(warn=warnings.append)
    again = session.capture(TEXT, model=_spec())
    np.testing.assert_array_equal(again.weights, fresh.weights)
    assert session.forwards == 1
    hit = cache.lookup(key)
    assert hit is not None
    np.testing.assert_array_equal(hit.weights, fresh.weights)


@pytest.mark.parametrize("damage", ["token", "no checksum", "checksum", "flip a byte",
                                    "layers"])
def test_damaged_entries_are_misses(source, damage):
    key = _store(source, TEXT)
    side = _folder() / f"{key}.json"
    npy = _folder() / f"{key}.npy"
    meta = json.loads(side.read_text())
    if damage == "token":
        meta["tokens"][1] = "dog"
    elif damage == "no checksum":
        meta = {k: v for k, v in meta.items() if "sha256" not in k}
    elif damage == "checksum":
        field = next(k for k in meta if "sha256" in k)
        meta[field] = "0" * 64
    elif damage == "layers":
        meta["layers"] = [1, 0]
    if damage == "flip a byte":
        data = bytearray(npy.read_bytes())
        data[-5] ^= 0x01
        npy.write_bytes(bytes(data))
    else:
        side.write_text(json.dumps(meta))
    assert cache.lookup(key) is None


def test_cli_prints_the_right_numbers_after_damage(invoke, monkeypatch):
    args = ["top-k", TEXT, *TOY, "-l", "1", "--head", "0", "-f", "json"]
    truth = invoke(*args, "--no-cache")
    first = invoke(*args)
    assert first.exit_code == 0 and first.stdout == truth.stdout
    for entry in _folder().glob("*.npy"):
        _damage_one_weight(entry.stem)
    second = invoke(*args)
    assert second.exit_code == 0, second.output
    assert second.stdout == truth.stdout
    assert second.stderr.count("Warning:") == 1 and "damaged" in second.stderr
    _refuse_loading(monkeypatch)
    third = invoke(*args)
    assert third.exit_code == 0, third.output
    assert third.stdout == truth.stdout and "Warning" not in third.stderr


def test_many_damaged_entries_warn_once(invoke, tmp_path):
    lines = tmp_path / "texts.txt"
    lines.write_text("\n".join(f"{TEXT} number {i}" for i in range(5)) + "\n")
    args = ["heads", "--input", lines, *TOY, "--format", "json"]
    first = invoke(*args)
    assert first.exit_code == 0, first.output
    entries = list(_folder().glob("*.npy"))
    assert len(entries) == 5
    for entry in entries:
        _damage_one_weight(entry.stem)
    second = invoke(*args)
    assert second.exit_code == 0, second.output
    assert second.stderr.count("damaged") == 1, second.stderr
    assert json.loads(second.stdout) == json.loads(first.stdout)


# =========================================================================== family 9
def _count_listings(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Count listings of the captures folder (scandir, listdir, Path.iterdir)."""
    calls: list[str] = []
    real_scandir, real_listdir = os.scandir, os.listdir

    def is_captures(path: Any) -> bool:
        try:
            return Path(os.fsdecode(path)).resolve() == _folder().resolve()
        except (TypeError, OSError):
            return False

    def scandir(path: Any = ".") -> Any:
        if is_captures(path):
            calls.append("scandir")
        return real_scandir(path)

    def listdir(path: Any = ".") -> Any:
        if is_captures(path):
            calls.append("listdir")
        return real_listdir(path)

    monkeypatch.setattr(os, "scandir", scandir)
    monkeypatch.setattr(os, "listdir", listdir)
    return calls


def test_storing_does_not_rescan_the_folder(source, monkeypatch):
    captures = [source.capture(f"{TEXT} {i}") for i in range(300)]
    calls = _count_listings(monkeypatch)
    for i, capture in enumerate(captures):
        assert cache.store(cache.capture_key(_spec(), f"{TEXT} {i}"), capture)
    assert len(calls) <= 2, len(calls)
    assert cache.info().entries == 300


def test_the_running_total_keeps_the_cache_under_its_limit(source, monkeypatch):
    _store(source, f"{TEXT} 99")
    per_entry = _own_bytes()
    cache.clear()
    limit = 10 * per_entry
    monkeypatch.setenv(cache.ENV_MAX_MB, str(limit / 1024 / 1024))
    keys = []
    for i in range(40):
        keys.append(_store(source, f"{TEXT} {i}"))
        assert _own_bytes() <= limit
        assert cache.lookup(keys[-1]) is not None
    assert 5 <= cache.info().entries <= 10
    assert cache.lookup(keys[0]) is None


def test_a_damaged_usage_record_is_rebuilt(source, monkeypatch):
    for i in range(3):
        _store(source, f"{TEXT} {i}")
    per_entry = _own_bytes() / 3
    for garbage in (b"{", b"[]", b'{"bytes": -5}', b'{"bytes": "x"}', b'{"bytes": 1e999}'):
        (_folder() / cache.USAGE).write_bytes(garbage)
        _store(source, f"{TEXT} {garbage!r}")
    monkeypatch.setenv(cache.ENV_MAX_MB, str(4.5 * per_entry / 1024 / 1024))
    (_folder() / cache.USAGE).write_bytes(b"not json")
    _store(source, "last")
    assert _own_bytes() <= 4.5 * per_entry


def test_clear_resets_the_usage_record(source, monkeypatch):
    for i in range(3):
        _store(source, f"{TEXT} {i}")
    cache.clear()
    calls = _count_listings(monkeypatch)
    _store(source, "after")
    assert len(calls) <= 1
    assert cache.info().entries == 1


# =========================================================================== family 10
@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "-1", "lots", "1e999", "NaN"])
def test_a_bad_size_limit_is_a_message_not_a_traceback(invoke, monkeypatch, tmp_path, value):
    monkeypatch.setenv(cache.ENV_MAX_MB, value)
    info = invoke("cache", "info")
    assert info.exit_code == 2, info.output
    assert cache.ENV_MAX_MB in info.stderr and "Traceback" not in info.output
    truth = invoke("top-k", TEXT, *TOY, "-l", "0", "--head", "0", "-f", "csv", "--no-cache")
    result = invoke("top-k", TEXT, *TOY, "-l", "0", "--head", "0", "-f", "csv")
    assert result.exit_code == 0, result.output
    assert result.stdout == truth.stdout
    assert cache.ENV_MAX_MB in result.stderr and "Traceback" not in result.output
    lines = tmp_path / "texts.txt"
    lines.write_text("\n".join(f"{TEXT} {i}" for i in range(4)))
    heads = invoke("heads", "--input", lines, *TOY)
    assert heads.exit_code == 0, heads.output
    assert heads.stderr.count(cache.ENV_MAX_MB) <= 1


def test_a_zero_limit_stores_nothing(invoke, monkeypatch):
    monkeypatch.setenv(cache.ENV_MAX_MB, "0")
    result = invoke("top-k", TEXT, *TOY, "-l", "0", "--head", "0")
    assert result.exit_code == 0 and "Warning" not in result.stderr
    assert cache.info().entries == 0
