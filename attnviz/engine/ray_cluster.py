"""Ray for one run: connect to a cluster or start a local Ray, check resources, map batches.

:func:`ray_run` is a context manager: it connects to the cluster the options name (or, with no
address, to a running cluster when there is one and otherwise to a local Ray started for this
run), checks that the cluster has the CPUs and GPUs the workers ask for, keeps Ray's own
console logging and progress bars quiet (the CLI shows its own), and disconnects at the end,
shutting the local Ray down if it started one. A process that has already called ``ray.init``
keeps its Ray as it is.

:func:`map_batches` runs a worker class over batches of work with Ray Data: one actor per
worker, each built once (so each loads its model once), retried by Ray when it dies.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import pickle
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from attnviz.engine import RayOptions, import_ray
from attnviz.errors import AttnvizError, UsageError

#: A dead actor is restarted this many times, and a task on it retried this many times, before
#: the run fails (a worker that dies on every attempt must not loop forever).
MAX_RESTARTS = 4
MAX_TASK_RETRIES = 4
#: Texts of a block of the dataset, at most: small blocks keep every worker busy to the end and
#: make the progress bar move; a retried block repeats at most this much work.
MAX_BATCHES_PER_BLOCK = 16
#: Environment variable of the test hook that kills one worker after it has handled N texts.
KILL_HOOK = "ATTNVIZ_TEST_KILL_ACTOR_AFTER"

Note = Callable[[str], None]


@dataclass
class RayRun:
    """The Ray a run uses.

    Attributes:
        ray: the imported ``ray`` module.
        where: how it was reached, for messages (``a local Ray with 2 CPUs``, an address).
        started: whether this run started it (and shuts it down at the end).
        cpus: CPUs of the cluster; ``gpus`` likewise.
    """

    ray: ModuleType
    where: str
    started: bool
    cpus: float
    gpus: float


def local_cpus() -> int:
    """Cores this process may use (the CPUs a local Ray gets at most)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # macOS, Windows
        return max(1, os.cpu_count() or 1)


@contextlib.contextmanager
def ray_run(options: RayOptions, note: Note | None = None) -> Iterator[RayRun]:
    """Connect to (or start) Ray for one run; see the module docstring.

    Args:
        options: address, workers, GPUs per worker.
        note: called with one line saying which Ray runs the work.

    Raises:
        AttnvizError: Ray is not installed, or the cluster cannot be reached.
        UsageError: the cluster has fewer CPUs or GPUs than the workers ask for.
    """
    options.check()
    ray = import_ray()
    with _environment(RAY_USAGE_STATS_ENABLED="0"):  # Ray Data reads it at every run
        yield from _run(ray, options, note)


def _run(ray: ModuleType, options: RayOptions, note: Note | None) -> Iterator[RayRun]:
    owned = started = False
    with _quiet():
        if ray.is_initialized():
            where = "the Ray this process already uses"
        else:
            with _environment(RAY_BACKEND_LOG_LEVEL="fatal"), _no_stderr():
                where, started = _connect(ray, options)
            owned = True
    try:
        resources = ray.cluster_resources()
        run = RayRun(ray, where, started, float(resources.get("CPU", 0)),
                     float(resources.get("GPU", 0)))
        _check_resources(run, options)
        if note is not None:
            gpus = (f", {options.gpus_per_worker:g} GPU each" if options.gpus_per_worker else "")
            note(f"Ray: {options.workers} worker{'s' if options.workers != 1 else ''}{gpus} on "
                 f"{where}")
        with _quiet(), _data_context(ray), _notices_to_stderr(ray):
            yield run
    finally:
        if owned:
            with _quiet():
                ray.shutdown()


def _connect(ray: ModuleType, options: RayOptions) -> tuple[str, bool]:
    """``ray.init`` as the options ask; returns how Ray was reached and whether it was started
    for this run."""
    address = None if options.address is None else options.address.strip()
    common: dict[str, Any] = {"log_to_driver": False, "configure_logging": False,
                              "namespace": "attnviz"}  # as init_local
    environment = os.environ.get("RAY_ADDRESS", "").strip()
    if address in (None, "auto") and environment:
        _check_reachable(environment, "RAY_ADDRESS")
    elif address not in (None, "auto", "local"):
        _check_reachable(str(address), "--ray-address")
    if address in (None, "auto"):
        try:
            ray.init(address="auto", **common)
            return "the Ray cluster at " + _gcs_address(ray), False
        except ConnectionError:
            if address == "auto":
                raise AttnvizError(
                    "--ray-address auto: no running Ray cluster was found",
                    "start one with `ray start --head` (or set RAY_ADDRESS), or leave out "
                    "--ray-address to run on a local Ray started for this run") from None
    elif address != "local":
        try:
            ray.init(address=address, **common)
        except (ConnectionError, ValueError, RuntimeError) as exc:
            raise AttnvizError(f"cannot connect to the Ray cluster at {address}: "
                               f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}",
                               "check the address (host:port of the head node, or "
                               "ray://host:10001), or leave out --ray-address to run on a "
                               "local Ray") from None
        return f"the Ray cluster at {address}", False
    cores = local_cpus()
    needed = options.workers * options.cpus_per_worker
    if needed > cores:
        limit = max(1, math.floor(cores / options.cpus_per_worker))
        raise UsageError(f"--workers {options.workers} is more than a local Ray on this machine "
                         f"can run: at most {limit} (one per core, {cores} cores)",
                         f"use --workers {limit} or fewer, or start a Ray cluster and give its "
                         "address with --ray-address")
    cpus = max(1, math.ceil(needed))
    init_local(cpus)
    return f"a local Ray with {cpus} CPU{'s' if cpus != 1 else ''}", True


def init_local(cpus: int, env: dict[str, str] | None = None) -> ModuleType:
    """Start a local Ray for this process: ``cpus`` CPUs, no dashboard, workers' output kept
    in Ray's log files, listening on the loopback interface only (tests use it too).

    Args:
        cpus: CPUs Ray may schedule on (at most this many one-CPU workers run at once).
        env: environment variables for every worker process.

    Returns:
        The ``ray`` module.
    """
    ray = import_ray()
    extra: dict[str, Any] = {"runtime_env": {"env_vars": dict(env)}} if env else {}
    watchdog = _watch_for_driver_death()  # first: a kill during ray.init is covered too
    with _quiet(), _environment(RAY_BACKEND_LOG_LEVEL="fatal"), _no_stderr(), _loopback(ray):
        ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False,
                 configure_logging=False, namespace="attnviz", **extra)
    if watchdog is not None and watchdog.stdin is not None:
        with contextlib.suppress(OSError):  # workers started late are known by this id
            watchdog.stdin.write(ray.get_runtime_context().get_node_id().encode() + b"\n")
            watchdog.stdin.flush()
    return ray


# Runs in its own session, outside this process's group. Until end of file on its standard
# input, which comes when this process exits however it ends (kill -9 included), it notes
# every Ray process below this one (gcs, raylet, agents, workers: their titles are rewritten,
# so they are known by ancestry, and late workers by their --node-id); then it kills those
# still alive: Ray's agents and workers outlive a killed driver.
_WATCHDOG = r"""
import os, select, signal, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)
driver, node, received = int(sys.argv[1]), b"--node-id=?", b""

def table():
    rows = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as handle:
                    fields = handle.read().rsplit(b")", 1)[1].split()
                with open(f"/proc/{name}/cmdline", "rb") as handle:
                    command = handle.read()
            except OSError:
                continue
            rows[int(name)] = (int(fields[1]), fields[19], command)
    return rows

def is_ray(command):
    return b"ray" in command or node in command.split(b"\0")

seen = {}
while True:
    rows = table()
    below = {driver}
    for _ in range(8):
        below |= {pid for pid, (ppid, _, _) in rows.items() if ppid in below}
    for pid in below - {driver, os.getpid()}:
        if is_ray(rows[pid][2]):
            seen[pid] = rows[pid][1]
    if select.select([sys.stdin], [], [], 0.5)[0]:
        data = sys.stdin.buffer.read1(256)
        if not data:
            break
        received += data
        node = b"--node-id=" + received.split(b"\n")[0].strip()
for attempt in range(3):
    rows = table()
    doomed = {pid for pid, (ppid, start, command) in rows.items()
              if seen.get(pid) == start or node in command.split(b"\0")}
    for _ in range(8):  # and what they started since the last look
        doomed |= {pid for pid, (ppid, _, _) in rows.items() if ppid in doomed}
    for pid in doomed - {os.getpid()}:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    time.sleep(1.0)
"""
_WATCHDOGS: list[Any] = []  # kept open for the life of this process


def _watch_for_driver_death() -> Any:
    """Make sure a local Ray started here dies with this process (Linux, via ``/proc``).

    Returns:
        The watchdog process (its standard input stays open until this process ends), or
        ``None`` where there is no ``/proc``.
    """
    import subprocess
    import sys

    if not os.path.isdir("/proc"):
        return None
    watchdog = subprocess.Popen(
        [sys.executable, "-c", _WATCHDOG, str(os.getpid())], stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    _WATCHDOGS.append(watchdog)
    return watchdog


def _check_reachable(address: str, what: str, timeout: float = 5.0) -> None:
    """Fail fast when nothing listens at a cluster address (``ray.init`` would wait minutes).

    Raises:
        AttnvizError: the host does not answer on that port.
    """
    import socket

    target = address.split("://", 1)[-1].rstrip("/")
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        raise UsageError(f"{what} {address!r} is not an address of a Ray cluster",
                         "give host:port of the head node (e.g. 10.0.0.5:6379), "
                         "ray://host:10001, auto or local")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            pass
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise AttnvizError(f"cannot reach the Ray cluster at {address} ({what}): {reason}",
                           "start it with `ray start --head` on that machine, check the "
                           "address and port, or leave out --ray-address (and RAY_ADDRESS) "
                           "to run on a local Ray") from None


def _gcs_address(ray: ModuleType) -> str:
    try:
        return str(ray.get_runtime_context().gcs_address)
    except Exception:  # noqa: BLE001 - only used in a message
        return "auto"


@contextlib.contextmanager
def _environment(**values: str) -> Iterator[None]:
    """Environment variables (unless the user set them) while Ray starts its processes.

    Ray's C++ core logs to the driver's standard error; at the ``fatal`` level it keeps
    notices such as "constructor arguments in the object store" (Ray Data's actors) off the
    terminal (``ATTNVIZ_DEBUG=1`` shows them).
    """
    if os.environ.get("ATTNVIZ_DEBUG", "") not in ("", "0"):
        values = {k: v for k, v in values.items() if k != "RAY_BACKEND_LOG_LEVEL"}
    added = [name for name in values if name not in os.environ]
    for name in added:
        os.environ[name] = values[name]
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


@contextlib.contextmanager
def _no_stderr() -> Iterator[None]:
    """Keep the C++ core's start-up lines off standard error while ``ray.init`` runs (errors
    still arrive as exceptions; ``ATTNVIZ_DEBUG=1`` shows the lines)."""
    if os.environ.get("ATTNVIZ_DEBUG", "") not in ("", "0"):
        yield
        return
    import sys

    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no real standard error (e.g. captured by a test runner)
        yield
        return
    try:
        with open(os.devnull, "w") as sink:
            os.dup2(sink.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


@contextlib.contextmanager
def _loopback(ray: ModuleType) -> Iterator[None]:
    """Start a local Ray that listens on the loopback interface only.

    Ray binds its services to the address it reaches other machines from, even for a
    single-node instance; a Ray started just for this run needs no other machine. Ray's own
    switch for single-machine mode (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, the default on
    macOS and Windows) makes it use 127.0.0.1; the started processes inherit it. Usage
    statistics stay off unless the user turned them on.
    """
    saved = os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    constants = getattr(getattr(ray, "_private", None), "ray_constants", None)
    cluster_mode = getattr(constants, "ENABLE_RAY_CLUSTER", None)
    if constants is not None and cluster_mode is not None:
        constants.ENABLE_RAY_CLUSTER = False  # read when ray was imported; read again here
    try:
        with _environment(RAY_USAGE_STATS_ENABLED="0"):  # started processes keep it
            yield
    finally:
        if constants is not None and cluster_mode is not None:
            constants.ENABLE_RAY_CLUSTER = cluster_mode
        if saved is None:
            os.environ.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)
        else:
            os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = saved


def _check_resources(run: RayRun, options: RayOptions) -> None:
    """Refuse a run the cluster cannot hold (Ray would wait for the resources for ever)."""
    workers = options.workers
    cpus = workers * options.cpus_per_worker
    if cpus > run.cpus:
        limit = math.floor(run.cpus / options.cpus_per_worker)
        raise UsageError(f"--workers {workers} needs {cpus:g} CPUs but {run.where} has "
                         f"{run.cpus:g}: at most {limit} workers fit",
                         f"use --workers {max(1, limit)} or fewer, or add nodes to the cluster")
    gpus = workers * options.gpus_per_worker
    if gpus > run.gpus + 1e-9:
        if run.gpus == 0:
            raise UsageError(f"--gpus-per-worker {options.gpus_per_worker:g}: {run.where} has "
                             "no GPUs", "run on CPUs with --gpus-per-worker 0, or connect to a "
                             "cluster with GPUs (--ray-address)")
        limit = math.floor(run.gpus / options.gpus_per_worker + 1e-9)
        raise UsageError(f"--workers {workers} x --gpus-per-worker "
                         f"{options.gpus_per_worker:g} needs {gpus:g} GPUs but {run.where} "
                         f"has {run.gpus:g}: at most {limit} workers fit",
                         f"use --workers {max(1, limit)} or fewer, or a smaller "
                         "--gpus-per-worker (e.g. 0.5 puts two workers on a GPU)")


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Keep Ray's INFO/WARNING console lines off the terminal (its log files keep them).

    ``ATTNVIZ_DEBUG=1`` shows them.
    """
    if os.environ.get("ATTNVIZ_DEBUG", "") not in ("", "0"):
        yield
        return
    changed: list[tuple[logging.Logger | logging.Handler, int]] = []
    ray_logger = logging.getLogger("ray")
    changed.append((ray_logger, ray_logger.level))
    ray_logger.setLevel(logging.ERROR)
    data_logger = logging.getLogger("ray.data")
    for handler in data_logger.handlers:
        if "file" not in type(handler).__name__.lower():
            changed.append((handler, handler.level))
            handler.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for thing, level in changed:
            thing.setLevel(level)


@contextlib.contextmanager
def _notices_to_stderr(ray: ModuleType) -> Iterator[None]:
    """Ray prints the cluster's notices to the driver's standard output (e.g. "a worker died,
    the task will be retried"); during a run they go to standard error, so that standard
    output holds only the command's result (a CSV or JSON table)."""
    module = getattr(getattr(ray, "_private", None), "worker", None)
    original = getattr(module, "print_to_stdstream", None)
    if module is None or not callable(original):
        yield
        return

    def to_stderr(data: dict[str, Any], ignore_prefix: bool) -> None:
        original({**data, "is_err": True}, ignore_prefix)

    module.print_to_stdstream = to_stderr
    try:
        yield
    finally:
        module.print_to_stdstream = original


@contextlib.contextmanager
def _data_context(ray: ModuleType) -> Iterator[None]:
    """Ray Data without its own progress bars and statistics log (the CLI shows progress)."""
    context = ray.data.DataContext.get_current()
    names = ("enable_progress_bars", "enable_operator_progress_bars", "print_on_execution_start",
             "enable_auto_log_stats")
    saved = {name: getattr(context, name) for name in names if hasattr(context, name)}
    for name in saved:
        setattr(context, name, False)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(context, name, value)


def map_batches(run: RayRun, batches: Sequence[dict[str, Any]], worker: type,
                options: RayOptions, kwargs: dict[str, Any]) -> Iterator[Any]:
    """Run ``worker`` over ``batches`` in Ray Data actors; yields each batch's result.

    Each item of ``batches`` is one Ray task's work (``{"start": int, "work": str}``); the
    worker class is built once per actor with ``kwargs`` and called with Ray Data batches of
    one such row; it returns ``{"result": [pickled bytes]}``. Results arrive as tasks finish,
    not in input order. A dead actor is restarted and its task retried (the per-text outputs
    of both engines are idempotent, so a repeated task changes nothing).
    """
    ray = run.ray
    workers = max(1, min(options.workers, len(batches)))  # no idle actors on a short input
    per_block = max(1, min(MAX_BATCHES_PER_BLOCK, len(batches) // (workers * 8)))
    blocks = max(1, math.ceil(len(batches) / per_block))
    dataset = ray.data.from_items(list(batches), override_num_blocks=blocks)
    remote_args: dict[str, Any] = {"num_cpus": options.cpus_per_worker,
                                   "max_restarts": MAX_RESTARTS,
                                   "max_task_retries": MAX_TASK_RETRIES}
    if options.gpus_per_worker:
        remote_args["num_gpus"] = options.gpus_per_worker
    with warnings.catch_warnings():
        # Ray Data already restarts actors by default, but without a limit; the limits are
        # only settable through the generic remote arguments, which it marks deprecated.
        warnings.filterwarnings("ignore", message=".*ray_remote_args.*")
        mapped = dataset.map_batches(
            worker, batch_size=1, batch_format="numpy",
            compute=ray.data.ActorPoolStrategy(size=workers),
            fn_constructor_kwargs=kwargs, **remote_args)
    for row in mapped.iter_rows():
        yield pickle.loads(row["result"])  # noqa: S301 - our own workers' results


def kill_hook() -> tuple[int, str] | None:
    """The test hook: ``(texts after which one worker dies, marker file)`` or ``None``.

    With ``ATTNVIZ_TEST_KILL_ACTOR_AFTER=N``, the first worker that has handled N texts exits
    abruptly (as if killed) in the middle of its task, once per run: Ray restarts it and
    retries the task. The marker file (in a fresh temporary folder) records that it happened.
    """
    raw = os.environ.get(KILL_HOOK, "").strip()
    if not raw:
        return None
    try:
        after = int(raw)
    except ValueError:
        raise UsageError(f"{KILL_HOOK}={raw!r} is not a whole number") from None
    if after < 1:
        raise UsageError(f"{KILL_HOOK} must be at least 1")
    import tempfile

    return after, os.path.join(tempfile.mkdtemp(prefix="attnviz-kill-"), "killed")


def hook_fired(hook: tuple[int, str] | None) -> bool:
    """Whether the kill hook's worker died; removes the marker's folder."""
    if hook is None:
        return False
    import shutil

    fired = os.path.exists(hook[1])
    shutil.rmtree(os.path.dirname(hook[1]), ignore_errors=True)
    return fired


class WorkerBase:
    """What every worker actor does: run in the driver's folder, die once for the test hook.

    Args:
        cwd: the driver's working folder (relative paths in the options mean the same).
        kill: the test hook (see :func:`kill_hook`).
    """

    def __init__(self, cwd: str, kill: tuple[int, str] | None = None) -> None:
        if cwd and os.path.isdir(cwd):
            os.chdir(cwd)
        self.kill = kill
        self.handled = 0  # texts this process has finished

    def checkpoint(self) -> None:
        """With the test hook: once this process has finished N texts, end it now (once per
        run, whichever worker gets there first)."""
        if self.kill is None or self.handled < self.kill[0]:
            return
        try:
            fd = os.open(self.kill[1], os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except OSError:
            self.kill = None  # another worker (or this one, before a restart) already died
            return
        os.close(fd)
        os._exit(1)


def result_rows(results: list[Any]) -> dict[str, Any]:
    """A Ray Data batch of pickled results (one row each)."""
    import numpy as np

    out = np.empty(len(results), dtype=object)
    for i, result in enumerate(results):
        out[i] = pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
    return {"result": out}


def reraise(error: BaseException | None) -> None:
    """Raise an :class:`AttnvizError` a worker sent back (``None``: nothing)."""
    if error is None:
        return
    if isinstance(error, AttnvizError):
        raise error
    raise AttnvizError(f"a Ray worker failed: {error}")
