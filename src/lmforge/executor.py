"""Where the data stages run their per-part tasks: this machine's pool, or a Ray cluster.

A stage is a driver (lists the parts, merges results, writes what needs the whole
corpus) and per-part functions (module-level, picklable, reading and writing files).
An executor applies such a function to every task and yields the results in task
order, so what the driver writes does not depend on where the tasks ran:

- ``local`` (the default): the process pool of :mod:`lmforge.parallel`.
- ``ray``: one Ray task per item on an existing cluster (``executor.address`` or
  ``RAY_ADDRESS``) or a Ray instance started on this machine. Ray reruns a task whose
  worker or node died (``max_retries``); an exception raised by the task itself is not
  retried, and reaches the driver as it was raised (a one-line ``LmforgeError`` stays
  one line). Tasks run in the driver's working directory, so relative paths mean the
  same on every node: ``data/`` must be on storage every node mounts at that path.

With a :class:`PartLog`, each finished task is recorded, so a rerun after a kill
skips it and reuses its result (see :func:`lmforge.io.resumable_dir`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pickle
import socket
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from tqdm import tqdm

from lmforge.config import ExecutorConfig
from lmforge.errors import LmforgeError
from lmforge.io import atomic_path
from lmforge.parallel import imap_ordered

T = TypeVar("T")
R = TypeVar("R")

ENV_KIND = "LMFORGE_EXECUTOR"



def output_settings(cfg: Any) -> Any:
    """A stage's settings with ``num_workers`` zeroed: what its tasks and its resume
    fingerprint depend on. The worker count never changes the bytes, so a rerun with
    fewer workers (after running out of memory, say) resumes instead of starting over."""
    return dataclasses.replace(cfg, num_workers=0)


class ExecutorError(LmforgeError):
    """The engine could not run a task: Ray missing, the cluster unreachable, or a
    task that kept losing its worker."""


class PartLog:
    """Completion markers for one map's tasks: task ``i`` done, with its result.

    A marker holds a digest of the task, so a task that changed (other paths, other
    settings) is run again rather than answered from an old result.
    """

    def __init__(self, directory: str | os.PathLike) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)

    def _path(self, index: int) -> Path:
        return self.dir / f"{index:06d}.pkl"

    def get(self, index: int, task: Any) -> tuple[bool, Any]:
        """(True, result) when task ``index`` finished before as this same task."""
        path = self._path(index)
        if not path.is_file():
            return False, None
        try:
            digest, result = pickle.loads(path.read_bytes())
        except Exception:  # a marker from another version: run the task again
            return False, None
        return (True, result) if digest == task_digest(task) else (False, None)

    def put(self, index: int, task: Any, result: Any) -> None:
        """Record task ``index`` as done (atomically: a kill leaves no half marker)."""
        with atomic_path(self._path(index)) as tmp:
            tmp.write_bytes(pickle.dumps((task_digest(task), result), protocol=5))


def task_digest(task: Any) -> str:
    """A digest of a task's pickled form: equal tasks, equal digests."""
    return hashlib.blake2b(pickle.dumps(task, protocol=5), digest_size=16).hexdigest()


class Executor:
    """Apply a per-part function to tasks, yielding results in task order."""

    name = "executor"
    workers = 1  # how many tasks run at once

    def _run(self, fn: Callable[[T], R], tasks: list[T]) -> Iterator[R]:
        raise NotImplementedError

    def map(self, fn: Callable[[T], R], tasks: Iterable[T], desc: str | None = None,
            log: PartLog | None = None) -> Iterator[R]:
        """``fn(task)`` for every task, in order; tasks ``log`` has seen finish are
        skipped and answered from the log, and every new result is logged."""
        tasks = list(tasks)
        done: dict[int, Any] = {}
        if log is not None:
            for i, task in enumerate(tasks):
                found, result = log.get(i, task)
                if found:
                    done[i] = result
        todo = [i for i in range(len(tasks)) if i not in done]
        bar = tqdm(total=len(tasks), initial=len(done), desc=desc, unit="part",
                   disable=desc is None, leave=False)
        if done and desc is not None:
            bar.write(f"{desc}: {len(done)} of {len(tasks)} parts done before, skipped")
        try:
            results = self._run(fn, [tasks[i] for i in todo])
            for i in range(len(tasks)):
                if i in done:
                    yield done.pop(i)
                    continue
                result = next(results)
                if log is not None:
                    log.put(i, tasks[i], result)
                bar.update()
                yield result
        finally:
            bar.close()


class LocalExecutor(Executor):
    """This machine's process pool (``num_workers``; 0 = every core)."""

    name = "local"

    def __init__(self, num_workers: int = 0) -> None:
        from lmforge.parallel import resolve_workers

        self.num_workers = num_workers
        self.workers = resolve_workers(num_workers)

    def _run(self, fn: Callable[[T], R], tasks: list[T]) -> Iterator[R]:
        return imap_ordered(fn, tasks, self.num_workers)


def _in_dir(cwd: str, fn: Callable[[T], R], task: T) -> R:
    """Run ``fn(task)`` in the driver's working directory (on a Ray worker)."""
    if os.getcwd() != cwd:
        os.chdir(cwd)
    return fn(task)


def _import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ExecutorError("executor.kind is ray, but Ray is not installed: "
                            "pip install 'lmforge[ray]'") from None
    return ray


def check_reachable(address: str, timeout: float = 5.0) -> None:
    """Fail in seconds, with one line, when nothing listens at a ``host:port`` Ray
    address (``ray.init`` itself retries for minutes). ``auto`` and ``local`` pass."""
    hostport = address.removeprefix("ray://")
    if hostport in ("auto", "local") or ":" not in hostport:
        return
    host, _, port = hostport.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except (OSError, ValueError) as e:
        raise ExecutorError(f"executor: cannot reach the Ray cluster at {address}: "
                            f"{e.strerror or e}") from None


_END = object()
# Ray's tasks a slot (a worker's CPUs): running or queued; and started but not yet taken
# in order, finished ones included. Two keep every slot busy; the second bound keeps the
# results waiting behind a slow task (in Ray's object store) to a few a slot.
RUNNING_PER_SLOT = 2
HELD_PER_SLOT = 8


class RayExecutor(Executor):
    """One Ray task per item, at most ``RUNNING_PER_SLOT`` a slot of the cluster
    running or queued; results in task order."""

    name = "ray"

    def __init__(self, cfg: ExecutorConfig) -> None:
        self.ray = ray = _import_ray()
        self.cfg = cfg
        if not ray.is_initialized():
            address = cfg.address or os.environ.get("RAY_ADDRESS") or None
            if address:
                check_reachable(address)
            try:
                ray.init(address=address, include_dashboard=False, log_to_driver=True,
                         configure_logging=False)
            except (ConnectionError, RuntimeError, ValueError) as e:
                where = f"at {address}" if address else "on this machine"
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise ExecutorError(f"executor: cannot start or reach a Ray cluster {where}: "
                                    f"{first}") from None
        cpus = float(ray.cluster_resources().get("CPU", 1))
        self.workers = max(1, int(cpus // cfg.num_cpus))

    def _options(self) -> dict[str, Any]:
        opts: dict[str, Any] = {"num_cpus": self.cfg.num_cpus,
                                "max_retries": self.cfg.max_retries, "retry_exceptions": False}
        if self.cfg.memory_mb:
            opts["memory"] = self.cfg.memory_mb * 2**20
        return opts

    def _run(self, fn: Callable[[T], R], tasks: list[T]) -> Iterator[R]:
        """Results in task order; a new task starts whenever one finishes, not when the
        oldest does, so a slow task holds back only the results after it, not the
        cluster (``RUNNING_PER_SLOT`` tasks a slot running or queued, and at most
        ``HELD_PER_SLOT`` a slot started and not yet taken, finished ones waiting for
        their turn included)."""
        ray = self.ray
        remote = ray.remote(_in_dir).options(name=getattr(fn, "__name__", "task"),
                                             **self._options())
        cwd, it = os.getcwd(), iter(tasks)
        running_cap = RUNNING_PER_SLOT * self.workers
        held_cap = HELD_PER_SLOT * self.workers
        order: deque = deque()  # every task started and not yet yielded, in task order
        running: set = set()  # those not seen finished

        def start_more() -> None:
            while len(running) < running_cap and len(order) < held_cap:
                task = next(it, _END)
                if task is _END:
                    return
                ref = remote.remote(cwd, fn, task)
                order.append(ref)
                running.add(ref)

        start_more()
        while order:
            if order[0] in running:  # wait for any task, not only the oldest
                done, _ = ray.wait(list(running), num_returns=1)
                running.difference_update(done)
            else:
                yield self._get(order.popleft(), fn)
            start_more()

    def _get(self, ref: Any, fn: Callable) -> Any:
        ray = self.ray
        try:
            return ray.get(ref)
        except ray.exceptions.RayTaskError as e:
            cause = getattr(e, "cause", None)
            if isinstance(cause, BaseException):
                raise cause from None  # the task's own error, as the local pool gives it
            raise
        except (ray.exceptions.WorkerCrashedError, ray.exceptions.NodeDiedError,
                ray.exceptions.OutOfMemoryError, ray.exceptions.ObjectLostError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ExecutorError(
                f"ray: a {getattr(fn, '__name__', 'task')} task failed after "
                f"{self.cfg.max_retries} retries: {type(e).__name__}: {first}") from None


def make_executor(cfg: ExecutorConfig, num_workers: int = 0) -> Executor:
    """The executor ``cfg`` (or ``LMFORGE_EXECUTOR``) names; ``num_workers`` sizes the
    local pool."""
    kind = os.environ.get(ENV_KIND) or cfg.kind
    if kind == "local":
        return LocalExecutor(num_workers)
    if kind == "ray":
        return RayExecutor(cfg)
    raise ExecutorError(f"{ENV_KIND}={kind!r}: expected local or ray")
