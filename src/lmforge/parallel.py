"""The one process pool every data stage shares: ordered results, a progress bar."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

from tqdm import tqdm

T = TypeVar("T")
R = TypeVar("R")


def resolve_workers(num_workers: int) -> int:
    """``0`` means all cores this process may use."""
    if num_workers > 0:
        return num_workers
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def imap_ordered(
    fn: Callable[[T], R],
    items: Iterable[T],
    num_workers: int = 0,
    desc: str | None = None,
    total: int | None = None,
) -> Iterator[R]:
    """Apply ``fn`` to each item on a process pool, yielding results in input order.

    ``fn`` must be a module-level function (picklable). With one worker it runs in this
    process, which keeps tracebacks and profilers simple. Results stream: at most a few
    items per worker are in flight, so memory stays bounded by the pool size.
    """
    items = list(items) if total is None and not hasattr(items, "__len__") else items
    n = total if total is not None else len(items)  # type: ignore[arg-type]
    workers = min(resolve_workers(num_workers), max(n, 1))
    bar = tqdm(total=n, desc=desc, unit="part", disable=desc is None, leave=False)
    try:
        if workers <= 1:
            for item in items:
                yield fn(item)
                bar.update()
            return
        method = start_method()
        if method == "fork":
            preload_for_workers()
        with _workers_die_on_sigterm(), \
                mp.get_context(method).Pool(workers, maxtasksperchild=64) as pool:
            for result in pool.imap(fn, items, chunksize=1):
                yield result
                bar.update()
    finally:
        bar.close()


def start_method() -> str:
    """How the pool starts its workers: fork, the cheapest, where it is safe; forkserver
    in a process that has loaded Ray; spawn where there is no fork (macOS, Windows).

    A forked child holds only the thread that forked, with every lock as it was: one
    that another thread held stays held, and the child hangs when it takes it. Ray's
    driver runs ~25 native threads (gRPC, its core worker), and ~10 of them outlive
    ``ray.shutdown()``. (A test run hung once in a process that had run Ray: two forked
    workers dead, the pool waiting on them; this is the likely cause, not reproduced.)
    forkserver's workers are forked from a clean single-threaded server process.
    """
    methods = mp.get_all_start_methods()
    if "fork" not in methods:
        return "spawn"
    if "ray" in sys.modules and "forkserver" in methods:
        return "forkserver"
    return "fork"


def preload_for_workers() -> None:
    """Import here, once, what tasks would import in every forked worker of every pool:
    ``pyarrow.parquet.read_table`` imports ``pyarrow.dataset`` on its first call, 0.2 s a
    worker, again in each new pool (a stage's every map). Only where this process reads
    Parquet at all."""
    if "pyarrow.parquet" in sys.modules:
        import pyarrow.dataset  # noqa: F401


@contextlib.contextmanager
def _workers_die_on_sigterm() -> Iterator[None]:
    """SIGTERM at its default action while a pool lives, so forked workers inherit that.

    A forked worker inherits this process's Python signal handlers. Ray's driver has one
    that raises SystemExit: a worker that ``Pool.terminate()`` stops before it has begun
    (all tasks done by the others; on a busy machine it had not run yet) then unwound a
    copy of this process's own stack instead of dying. Only the main thread may set it.
    """
    handler = signal.getsignal(signal.SIGTERM)
    if threading.current_thread() is not threading.main_thread() or handler in (
            signal.SIG_DFL, None):
        yield
        return
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        yield
    finally:
        # A generator closed from another thread cannot set it there: SIG_DFL stays.
        with contextlib.suppress(ValueError):
            signal.signal(signal.SIGTERM, handler)
