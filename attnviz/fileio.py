"""Writing files safely: atomically, inside a chosen folder, with names valid everywhere.

Every command that writes goes through this module. The rules it keeps:

* **Nothing is written through a symbolic link inside the output folder.** The folder a user
  names (``-o OUT_DIR``, or the folder of ``-o file.png``) is theirs to choose, links and all;
  below it, every folder is opened with ``O_NOFOLLOW`` relative to its parent's descriptor, so
  a link planted inside (``OUT_DIR/text -> ~``) is refused with a :class:`LinkError` naming it,
  and no race can redirect a write. A link standing where a *file* goes is replaced, never
  written through.
* **Temporary files are unique and exclusive**: ``.NAME.PID.RANDOM.tmp``, created with
  ``O_CREAT | O_EXCL | O_NOFOLLOW`` in the target's folder, then renamed onto the target. A
  name planted in advance is never opened.
* **Stale temporaries are ours only**: a later run removes, in a folder it writes to, regular
  files whose names match that pattern and whose process is gone. Nothing else is deleted.
* OS errors become :class:`~attnviz.errors.OutputError` with a message that names the fix.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import re
import secrets
import stat
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any, cast

from attnviz.diskfull import OutputFile, is_no_space, no_space_error
from attnviz.errors import NotAFileError, OutputError
from attnviz.inputs import (  # noqa: F401 - re-exported: fileio is the public face
    INPUT_LINE_LIMIT,
    INPUT_SIZE_LIMIT,
    _shorten,
    open_input,
    read_input_text,
    read_line,
    safe_child,
    short_hash,
    slugify,
)

NAME_MAX = 255  # bytes in one file name on every common file system
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_BINARY = getattr(os, "O_BINARY", 0)
# Descriptor-relative calls (openat, mkdirat, renameat, unlinkat) make every step race-free.
_DIR_FD = (_O_NOFOLLOW != 0 and _O_DIRECTORY != 0
           and {os.open, os.mkdir, os.rename, os.unlink, os.stat} <= os.supports_dir_fd
           and os.scandir in os.supports_fd)

# Our temporary files: ".<target name>.<pid>.<8 hex>.tmp".
_TEMP_RE = re.compile(r"^\..+\.(?P<pid>[0-9]+)\.[0-9a-f]{8}\.tmp$")
# Temporaries of earlier versions (mkstemp: ".<target name>.<8 random>.tmp"), removed once old.
_LEGACY_TEMP_RE = re.compile(r"^\..+\.[a-z0-9_]{8}\.tmp$")
_LEGACY_TEMP_AGE = 3600.0  # seconds
_CLEANED: set[tuple[int, int]] = set()  # folders (device, inode) cleaned by this process


class LinkError(OutputError):
    """A symbolic link stands where attnviz would write inside the output folder."""


# --------------------------------------------------------------------------- messages
def _describe_os_error(exc: OSError, path: Path) -> OutputError:
    if is_no_space(exc):
        return no_space_error(path)
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return OutputError(f"cannot write {path}: permission denied",
                           "choose a writable output location with -o")
    if exc.errno == errno.ENOTDIR or exc.errno == errno.EEXIST:
        return OutputError(f"cannot write {path}: a file stands where a folder is needed",
                           "choose another output location with -o")
    if exc.errno == errno.EISDIR:
        return OutputError(f"cannot write {path}: it is a folder",
                           "give a file name, e.g. -o attention.png")
    if exc.errno == errno.ENAMETOOLONG:
        return OutputError(f"cannot write {_shorten(path)}: the file name is too long",
                           f"choose a shorter output name with -o (at most {NAME_MAX} bytes "
                           "per name)")
    if exc.errno == errno.ELOOP:
        return LinkError(f"cannot write {path}: too many symbolic links",
                         "choose another output location with -o")
    return OutputError(f"cannot write {path}: {exc.strerror or exc}")


def _check_name_length(path: Path) -> None:
    for part in path.parts:
        if len(os.fsencode(part)) > NAME_MAX:
            raise OutputError(f"cannot write {_shorten(path)}: the name {_shorten(part, 40)!r} "
                              f"is too long ({len(os.fsencode(part))} bytes)",
                              f"choose a shorter output name with -o (at most {NAME_MAX} bytes "
                              "per name)")


def _link_error(shown: Path, dir_fd: int | None, name: str) -> OutputError:
    """What to say about ``name`` that could not be opened as a folder."""
    try:
        info = os.stat(name if dir_fd is not None else shown, dir_fd=dir_fd,
                       follow_symlinks=False)
    except OSError as exc:
        return _describe_os_error(exc, shown)
    if stat.S_ISLNK(info.st_mode):
        try:
            target = os.readlink(name if dir_fd is not None else shown, dir_fd=dir_fd)
        except OSError:
            target = "?"
        return LinkError(f"{shown} is a symbolic link (to {target}); attnviz never writes "
                         "through links inside the output folder",
                         "remove the link, or choose another output folder with -o")
    return OutputError(f"cannot write {shown}: a file stands where a folder is needed",
                       "choose another output location with -o")


# --------------------------------------------------------------------------- folders
def ensure_dir(path: Path | str, *, created: list[Path] | None = None) -> Path:
    """Create ``path`` (and parents) as a folder, with an :class:`OutputError` on failure.

    ``path`` is the folder the user chose, so links in it are followed. Folders this call made
    are appended to ``created`` (outermost first) when a list is given.
    """
    path = Path(path)
    _check_name_length(path)
    missing: list[Path] = []
    probe = path
    while True:
        try:
            os.stat(probe)
            break
        except FileNotFoundError:
            missing.append(probe)
            if probe.parent == probe:
                break
            probe = probe.parent
        except OSError:
            break  # reported by mkdir below
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise OutputError(f"cannot use {path} as a folder: a file with that name exists",
                          "choose another output folder with -o") from None
    except OSError as exc:
        raise _describe_os_error(exc, path) from None
    if created is not None:
        created.extend(reversed(missing))
    return path


def remove_empty_dirs(folders: Sequence[Path]) -> None:
    """Remove ``folders`` (innermost last in the list) that are still empty; never raises."""
    for folder in reversed(list(folders)):
        with contextlib.suppress(OSError):
            os.rmdir(folder)


def _split(target: Path, root: Path | None) -> tuple[Path, tuple[str, ...], str]:
    """``(root, folders between root and target, file name)``; refuses ``..`` and absolute
    parts, so nothing can leave ``root``."""
    if root is None:
        parent = target.parent
        return (parent if str(parent) else Path(".")), (), target.name
    try:
        relative = target.relative_to(root)
    except ValueError:
        raise OutputError(f"refusing to write {target} outside {root}") from None
    parts = relative.parts
    if not parts or any(p in ("", ".", "..") for p in parts):
        raise OutputError(f"refusing to write {target} outside {root}")
    return root, tuple(parts[:-1]), parts[-1]


def _folder_parts(folder: Path, root: Path | str | None) -> tuple[Path, tuple[str, ...]]:
    """``(root, names from root down to folder)`` for :func:`open_folder`."""
    if root is not None and folder == Path(root):
        return folder, ()
    base, parents, name = _split(folder, None if root is None else Path(root))
    return base, (*parents, name)


class _Folder:
    """An open folder: a descriptor where the OS supports it, else a checked path."""

    def __init__(self, path: Path, fd: int | None) -> None:
        self.path = path
        self.fd = fd

    def at(self, name: str) -> str:
        """The first argument of an ``*at`` call for ``name`` (the name, or the full path)."""
        return name if self.fd is not None else str(self.path / name)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def lstat(self, name: str) -> os.stat_result:
        return os.stat(self.at(name), dir_fd=self.fd, follow_symlinks=False)

    def names(self) -> list[str]:
        try:
            with os.scandir(self.fd if self.fd is not None else self.path) as entries:
                return [entry.name for entry in entries]
        except OSError:
            return []

    def child(self, name: str, *, create: bool) -> _Folder:
        """Open the sub-folder ``name`` without following a link (create it if asked)."""
        shown = self.path / name
        for _attempt in range(3):
            if self.fd is None:  # no descriptor-relative calls: check, then use the path
                if os.path.islink(shown):
                    raise _link_error(shown, None, name)
                if os.path.isdir(shown):
                    return _Folder(shown, None)
            else:
                try:
                    fd = os.open(name, os.O_RDONLY | _O_DIRECTORY | _O_NOFOLLOW | _O_CLOEXEC,
                                 dir_fd=self.fd)
                    return _Folder(shown, fd)
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
                        raise _link_error(shown, self.fd, name) from None
                    raise _describe_os_error(exc, shown) from None
            if not create:
                raise FileNotFoundError(errno.ENOENT, "no such folder", str(shown))
            try:
                os.mkdir(self.at(name), 0o777, dir_fd=self.fd)
            except FileExistsError:
                continue  # made by someone else meanwhile (or a file/link: reported above)
            except OSError as exc:
                raise _describe_os_error(exc, shown) from None
        raise _link_error(shown, self.fd, name)


@contextlib.contextmanager
def open_folder(root: Path | str, parts: Sequence[str] = (), *, create: bool = True
                ) -> Iterator[_Folder]:
    """Open ``root / parts...`` for writing: ``root`` as the user gave it, each part below it
    without following links (a link raises :class:`LinkError`)."""
    root = Path(root) if str(root) else Path(".")
    _check_name_length(root)
    if os.path.exists(root) and not os.path.isdir(root):
        raise OutputError(f"cannot write into {root}: it is a file, not a folder",
                          "choose another output location with -o")
    if create:
        ensure_dir(root)
    folder: _Folder
    if _DIR_FD:
        try:
            folder = _Folder(root, os.open(root, os.O_RDONLY | _O_DIRECTORY | _O_CLOEXEC))
        except OSError as exc:
            if exc.errno == errno.ENOTDIR:
                raise OutputError(f"cannot write into {root}: it is a file, not a folder",
                                  "choose another output location with -o") from None
            raise _describe_os_error(exc, root) from None
    else:
        folder = _Folder(root, None)
    try:
        for part in parts:
            child = folder.child(part, create=create)
            folder.close()
            folder = child
        yield folder
    finally:
        folder.close()


def check_folder(path: Path | str, root: Path | str) -> bool:
    """Whether ``path`` (inside ``root``) is a real folder; ``False`` if it does not exist.

    Raises:
        LinkError: ``path`` or a folder between ``root`` and it is a symbolic link.
        OutputError: a file stands there.
    """
    target, root = Path(path), Path(root)
    if target == root:
        return os.path.isdir(root)
    base, parts, name = _split(target, root)
    try:
        with open_folder(base, (*parts, name), create=False):
            return True
    except FileNotFoundError:
        return False


def list_folder(path: Path | str, root: Path | str | None = None) -> list[str]:
    """Names in the folder ``path`` (below ``root`` without links); ``[]`` if it is missing,
    a link or unreadable."""
    base, parts = _folder_parts(Path(path), root)
    try:
        with open_folder(base, parts, create=False) as folder:
            return folder.names()
    except (OSError, OutputError):
        return []


def remove_file(path: Path | str, root: Path | str | None = None) -> bool:
    """Remove the file (or the link itself) ``path``; never follows a link, never removes a
    folder. Returns whether something was removed.

    Raises:
        OutputError: it exists but cannot be removed.
    """
    target = Path(path)
    base, parts, name = _split(target, None if root is None else Path(root))
    try:
        with open_folder(base, parts, create=False) as folder:
            try:
                if stat.S_ISDIR(folder.lstat(name).st_mode):
                    return False
                os.unlink(folder.at(name), dir_fd=folder.fd)
            except FileNotFoundError:
                return False
            except OSError as exc:
                raise OutputError(f"cannot replace {target}: {exc.strerror or exc}") from None
            return True
    except FileNotFoundError:
        return False
    except LinkError:
        return False  # a link below root: nothing of ours is behind it


# --------------------------------------------------------------------------- temporaries
def _temp_name(name: str) -> str:
    short = os.fsencode(name)[:80].decode("utf-8", "ignore") or "file"
    return f".{short}.{os.getpid()}.{secrets.token_hex(4)}.tmp"


def _create_temp(folder: _Folder, name: str, target: Path, *, read: bool = False
                 ) -> tuple[str, int]:
    """Create a new, unique temporary file beside ``name``; returns its name and descriptor
    (write-only, or read-write with ``read``)."""
    flags = ((os.O_RDWR if read else os.O_WRONLY) | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW
             | _O_CLOEXEC | _O_BINARY)
    for _attempt in range(100):
        tmp = _temp_name(name)
        try:
            return tmp, os.open(folder.at(tmp), flags, 0o666, dir_fd=folder.fd)
        except FileExistsError:
            continue
        except OSError as exc:
            raise _describe_os_error(exc, target) from None
    raise OutputError(f"cannot create a temporary file beside {target}",
                      "remove the files named .*.tmp in that folder")


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    if sys.platform == "win32":  # os.kill would end the process there
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, OSError):
        return True
    return True


def _is_stale(name: str, info: os.stat_result) -> bool:
    if not stat.S_ISREG(info.st_mode):
        return False  # only our own regular files are ever removed
    match = _TEMP_RE.match(name)
    if match is not None:
        try:
            pid = int(match.group("pid"))
        except ValueError:
            return False
        if sys.platform == "win32":
            return time.time() - info.st_mtime > _LEGACY_TEMP_AGE
        return not _pid_alive(pid)
    if _LEGACY_TEMP_RE.match(name):
        return time.time() - info.st_mtime > _LEGACY_TEMP_AGE
    return False


def _clean_folder(folder: _Folder, *, force: bool = False) -> int:
    """Remove stale temporaries of ours from an open folder (once per process unless
    ``force``); returns how many."""
    try:
        info = (os.fstat(folder.fd) if folder.fd is not None else os.stat(folder.path))
    except OSError:
        return 0
    key = (info.st_dev, info.st_ino)
    if key in _CLEANED and not force:
        return 0
    _CLEANED.add(key)
    removed = 0
    for name in folder.names():
        if not name.endswith(".tmp") or not name.startswith("."):
            continue
        try:
            if _is_stale(name, folder.lstat(name)):
                os.unlink(folder.at(name), dir_fd=folder.fd)
                removed += 1
        except OSError:
            pass
    return removed


def clean_temporaries(path: Path | str, root: Path | str | None = None, *,
                      force: bool = True) -> int:
    """Remove stale temporaries of ours in the folder ``path`` (reached below ``root`` without
    links; a link is left alone). Returns how many were removed."""
    base, parts = _folder_parts(Path(path), root)
    try:
        with open_folder(base, parts, create=False) as folder:
            return _clean_folder(folder, force=force)
    except (OSError, OutputError):
        return 0


# --------------------------------------------------------------------------- atomic writes
@contextlib.contextmanager
def _atomic(target: Path, root: Path | None) -> Iterator[tuple[_Folder, str, int]]:
    """Create a temporary file beside ``target``; rename it onto ``target`` on success.

    Yields ``(folder, temporary name, descriptor)``; the caller owns the descriptor (it must
    be closed when the block ends). The temporary file is removed if the block raises.
    """
    _check_name_length(target)
    base, parts, name = _split(target, root)
    if name in ("", ".", ".."):
        raise OutputError(f"cannot write {target}: it is a folder",
                          "give a file name, e.g. -o attention.png")
    with open_folder(base, parts) as folder:
        try:
            existing = folder.lstat(name)
        except FileNotFoundError:
            existing = None
        except OSError as exc:
            raise _describe_os_error(exc, target) from None
        if existing is not None and stat.S_ISDIR(existing.st_mode):
            raise OutputError(f"cannot write {target}: it is a folder",
                              "give a file name, e.g. -o attention.png")
        if existing is not None:
            _check_replaceable(folder, name, existing, target)
        _clean_folder(folder)
        created: list[str] = []  # set with Ctrl-C held: a temporary is never left unremoved
        try:
            with signals_held():
                tmp, fd = _create_temp(folder, name, target)
                created.append(tmp)
            yield folder, tmp, fd
            # rename() replaces a link standing at the target itself, never what it points to
            os.replace(folder.at(tmp), folder.at(name), src_dir_fd=folder.fd,
                       dst_dir_fd=folder.fd)
        except OSError as exc:
            _unlink_all(folder, created)
            raise _describe_os_error(exc, target) from None
        except BaseException:
            _unlink_all(folder, created)
            raise


def _unlink_all(folder: _Folder, names: list[str]) -> None:
    for name in names:
        with contextlib.suppress(OSError):
            os.unlink(folder.at(name), dir_fd=folder.fd)


_KINDS = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISFIFO, "a named pipe"), (stat.S_ISSOCK, "a socket"))


def _special_kind(mode: int) -> str | None:
    """``"a character device"`` etc. for what is neither a regular file, a folder nor a link."""
    return next((kind for test, kind in _KINDS if test(mode)), None)


def _check_replaceable(folder: _Folder, name: str, existing: os.stat_result,
                       target: Path) -> None:
    """Refuse to replace a device, pipe or socket, or a link to one (``-o /dev/null``,
    ``-o /dev/stdout``): a file is written to a temporary name and renamed over the target, so
    writing "to" one would put a regular file in its place."""
    kind = _special_kind(existing.st_mode)
    what = f"{target} is {kind}"
    home = os.path.realpath(folder.path)  # the folder the target is in, links resolved
    if kind is None and stat.S_ISLNK(existing.st_mode):
        try:
            leads = os.readlink(folder.at(name), dir_fd=folder.fd)
            pointed = os.stat(folder.at(name), dir_fd=folder.fd)  # where the link leads
        except OSError:
            return  # a dangling or looping link: replaced, never followed
        kind = _special_kind(pointed.st_mode)
        what = f"{target} is a link to {kind}"
        if kind is None and (home == "/dev" or leads.startswith(("/proc/", "/dev/fd/",
                                                                  "/dev/std"))):
            # /dev/stdout and friends: standard output redirected to a file is still not a
            # file to replace (that would replace the system's link)
            kind, what = "a stream", f"{target} is a link to {leads}"
    if kind is None and home.startswith("/proc/"):
        kind, what = "a stream", f"{target} is a process's file descriptor"  # /proc/self/fd/1
    if kind is not None:
        raise NotAFileError(f"cannot write {target}: {what}, not a regular file (attnviz "
                            "writes a new file and renames it into place)",
                            "name a file to write; leave out -o where a command prints to "
                            "standard output")


def check_output(path: Path | str | None, option: str = "-o", *, folder: bool = False
                 ) -> None:
    """Refuse, before any work, an output that cannot be written as asked: a device, pipe or
    socket, or a link to one, or a stream (``/dev/stdout``, ``/proc/self/fd/1``); and an
    existing folder where a file is meant (``folder=False``). A usage error (exit 2) naming
    the option. The write itself checks again (:func:`atomic_path`)."""
    if path is None:
        return
    target = Path(path)
    try:
        existing = os.lstat(target)
    except OSError:
        return  # nothing there yet (or nothing to tell): the write says what is wrong
    kind = _special_kind(existing.st_mode)
    what = f"{target} is {kind}"
    if stat.S_ISLNK(existing.st_mode):
        try:
            leads = os.readlink(target)
            pointed = os.stat(target)
        except OSError:
            return  # dangling or looping: replaced by the write, never followed
        kind = _special_kind(pointed.st_mode)
        what = f"{target} is a link to {kind}"
        home = os.path.realpath(target.parent)
        if kind is None and (home == "/dev" or leads.startswith(("/proc/", "/dev/fd/",
                                                                  "/dev/std"))):
            kind, what = "a stream", f"{target} is a link to {leads}"
        existing = pointed
    if kind is None and os.path.realpath(target.parent).startswith("/proc/"):
        kind, what = "a stream", f"{target} is a process's file descriptor"
    if kind is not None:
        raise NotAFileError(f"{option} {target}: {what}, not a regular file (attnviz writes a "
                            "new file and renames it into place)",
                            "name a file to write; leave out -o where a command prints to "
                            "standard output")
    if stat.S_ISDIR(existing.st_mode) and not folder:
        raise NotAFileError(f"{option} {target}: it is a folder; {option} names a file",
                            f"name a file in it: {option} {target}{os.sep}NAME")


@contextlib.contextmanager
def atomic_path(target: Path | str, *, root: Path | str | None = None) -> Iterator[Path]:
    """Yield a new temporary path in the target's folder; rename it onto ``target`` on success.

    The temporary file exists (created exclusively, empty) when the block starts. It is
    removed if the body raises (including ``KeyboardInterrupt``), so an interrupted write never
    leaves a half-written ``target``. OS errors become :class:`OutputError` with a message that
    says what to do.

    Args:
        target: the file to write.
        root: the output folder the user chose, an ancestor of ``target``; the folders between
            it and ``target`` are created and never followed if they are links. Default: the
            target's own folder.
    """
    target = Path(target)
    with _atomic(target, None if root is None else Path(root)) as (folder, tmp, fd):
        os.close(fd)
        yield folder.path / tmp


@contextlib.contextmanager
def atomic_open(target: Path | str, mode: str = "wb", *, root: Path | str | None = None,
                encoding: str | None = None) -> Iterator[IO[Any]]:
    """Open a new temporary file for ``target`` (``"wb"`` or ``"w"``); it replaces ``target``
    when the block ends without an error. See :func:`atomic_path` for ``root``."""
    if mode not in ("wb", "w"):
        raise ValueError(f"mode must be 'wb' or 'w', not {mode!r}")
    target = Path(target)
    with _atomic(target, None if root is None else Path(root)) as (_folder, _tmp, fd):
        try:
            handle = os.fdopen(fd, "wb")
        except BaseException:
            os.close(fd)
            raise
        with handle:
            try:  # every write goes through diskfull.write_chunk (a full disk keeps its errno)
                output = OutputFile(handle)
                shown = cast("IO[Any]", output if mode == "wb" else
                             io.TextIOWrapper(cast(Any, output), encoding=encoding))
                yield shown
                shown.flush()
                handle.flush()
                os.fsync(handle.fileno())
            except OSError as exc:
                raise _describe_os_error(exc, target) from None


def atomic_write(target: Path | str, write: Callable[[IO[bytes]], object], *,
                 root: Path | str | None = None) -> Path:
    """Write ``target`` atomically by calling ``write(binary_file)`` on a temporary file."""
    target = Path(target)
    with atomic_open(target, "wb", root=root) as handle:
        write(handle)
    return target


def atomic_write_text(target: Path | str, text: str, *, root: Path | str | None = None) -> Path:
    """Write UTF-8 text atomically."""
    return atomic_write(target, lambda handle: handle.write(text.encode("utf-8")), root=root)


@contextlib.contextmanager
def scratch_file(folder: Path | str, name: str) -> Iterator[IO[str]]:
    """A text file for this run's own use in ``folder``, created exclusively and removed at
    the end (at once where the OS allows, so a killed run leaves nothing behind)."""
    folder = Path(folder)
    with open_folder(folder, ()) as opened, signals_held():
        tmp, fd = _create_temp(opened, name, folder / name, read=True)
        unlinked = False
        with contextlib.suppress(OSError):
            os.unlink(opened.at(tmp), dir_fd=opened.fd)
            unlinked = True
        path = opened.path / tmp
    try:
        handle = os.fdopen(fd, "w+", encoding="utf-8")
    except BaseException:
        os.close(fd)
        raise
    try:
        with handle:
            yield handle
    finally:
        if not unlinked:
            with contextlib.suppress(OSError):
                os.unlink(path)


# --------------------------------------------------------------------------- folder lock
@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Hold off Ctrl-C and SIGTERM for a few steps that must happen together.

    Two writes that describe one state (a folder's manifest and its index entry) must both
    happen or neither, and a temporary file must be known to the code that removes it: a
    signal arriving in the block is noted and raised again when the block ends (so its own
    handler runs then, or the default action happens). Python runs signal handlers in the main
    thread only, so this works there; elsewhere it does nothing.
    """
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread() or _wakeup_fd_in_use():
        yield  # an event loop's wakeup descriptor would see the signal twice: leave it be
        return
    received: list[int] = []

    def note(signum: int, _frame: object) -> None:
        received.append(signum)

    previous: dict[int, Any] = {}
    for signum in (signal.SIGINT, getattr(signal, "SIGTERM", None)):
        if signum is not None and signal.getsignal(signum) is not None:
            previous[signum] = signal.signal(signum, note)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        _deliver(list(dict.fromkeys(received)))


def _deliver(signals: list[int]) -> None:
    """Raise each held signal again, in order; a handler that raises does not drop the rest."""
    import signal

    if signals:
        try:
            signal.raise_signal(signals[0])
        finally:
            _deliver(signals[1:])


def _wakeup_fd_in_use() -> bool:
    """Whether an event loop (asyncio) listens for signals on a wakeup descriptor."""
    import signal

    try:
        fd = signal.set_wakeup_fd(-1)
    except (ValueError, OSError):
        return False
    if fd != -1:
        signal.set_wakeup_fd(fd)
    return fd != -1


class FolderLock:
    """An exclusive, non-blocking lock on an output folder (``flock`` on a lock file in it).

    The lock file is created with ``O_NOFOLLOW`` and removed when the lock is released. Where
    ``fcntl`` is missing (Windows) the lock does nothing.
    """

    def __init__(self, folder: Path | str, name: str, what: str = "another run") -> None:
        self.folder = Path(folder)
        self.name = name
        self.what = what
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock.

        Raises:
            OutputError: another process holds it ("... (pid N)"), or it cannot be created.
            LinkError: the lock file is a symbolic link.
        """
        try:
            import fcntl
        except ImportError:  # pragma: no cover - Windows
            return
        path = self.folder / self.name
        with open_folder(self.folder, ()) as folder:
            for _attempt in range(10):
                try:
                    fd = os.open(folder.at(self.name),
                                 os.O_RDWR | os.O_CREAT | _O_NOFOLLOW | _O_CLOEXEC, 0o666,
                                 dir_fd=folder.fd)
                except OSError as exc:
                    if exc.errno in (errno.ELOOP, errno.EMLINK):
                        raise _link_error(path, folder.fd, self.name) from None
                    raise _describe_os_error(exc, path) from None
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError as exc:
                    if exc.errno in _NO_LOCKS:  # a file system without locks: go on unlocked
                        self._fd = fd
                        return
                    owner = _read_pid(fd)
                    os.close(fd)
                    if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                        who = f" (pid {owner})" if owner else ""
                        raise OutputError(f"{self.what} is writing to {self.folder}{who}",
                                          "wait for it to finish, or choose another output "
                                          "folder with -o") from None
                    raise _describe_os_error(exc, path) from None
                # The file may have been removed by its last holder after we opened it: then
                # our lock is on a file nobody else sees, so start again.
                try:
                    same = os.fstat(fd).st_ino == folder.lstat(self.name).st_ino
                except OSError:
                    same = False
                if not same:
                    os.close(fd)
                    continue
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    os.close(fd)
                    raise OutputError(f"{path} is not a regular file",
                                      "remove it and run the command again")
                os.ftruncate(fd, 0)
                os.write(fd, f"{os.getpid()}\n".encode())
                self._fd = fd
                return
        raise OutputError(f"cannot lock {path}", "run the command again")

    def release(self) -> None:
        """Remove the lock file and release the lock (never raises)."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        with contextlib.suppress(OSError, OutputError), \
                open_folder(self.folder, (), create=False) as folder:
            if os.fstat(fd).st_ino == folder.lstat(self.name).st_ino:
                os.unlink(folder.at(self.name), dir_fd=folder.fd)
        os.close(fd)

    def __enter__(self) -> FolderLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


_NO_LOCKS = {getattr(errno, name) for name in ("ENOLCK", "EOPNOTSUPP", "ENOTSUP", "ENOSYS")
             if hasattr(errno, name)}


def _read_pid(fd: int) -> int | None:
    try:
        data = os.pread(fd, 32, 0)
        return int(data.decode("ascii").strip() or "0") or None
    except (OSError, ValueError, UnicodeDecodeError, AttributeError):
        return None
