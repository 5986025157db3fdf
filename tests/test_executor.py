"""The executor layer on the local pool: order, completion markers, and data stages that
resume after a kill with the same bytes and exact counts."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path

import pytest
from files import tree
from test_data_pipeline import make_raw, params

from lmforge.data.filtering import run_filter
from lmforge.data.ingest import run_ingest
from lmforge.data.mix import run_mix
from lmforge.executor import LocalExecutor, PartLog, make_executor
from lmforge.io import resumable_dir

REPO = Path(__file__).resolve().parents[1]


def square(x: int) -> int:
    return x * x


class Counting(LocalExecutor):
    """The local pool, counting the tasks it really runs."""

    def __init__(self, num_workers: int = 1) -> None:
        super().__init__(num_workers)
        self.ran = 0
        self.ran_by: dict[str, int] = {}

    def _run(self, fn, tasks):
        self.ran += len(tasks)
        self.ran_by[fn.__name__] = self.ran_by.get(fn.__name__, 0) + len(tasks)
        return super()._run(fn, tasks)


class Interrupted(LocalExecutor):
    """The local pool, stopped like Ctrl-C after ``after`` results of ``fn_name``."""

    def __init__(self, fn_name: str, after: int) -> None:
        super().__init__(1)
        self.fn_name, self.after = fn_name, after

    def _run(self, fn, tasks):
        for k, result in enumerate(super()._run(fn, tasks)):
            if fn.__name__ == self.fn_name and k == self.after:
                raise KeyboardInterrupt
            yield result


def test_map_keeps_order_on_any_worker_count():
    for workers in (1, 2):
        assert list(LocalExecutor(workers).map(square, range(20))) == [x * x for x in range(20)]


def sigterm_handler_here(_: int) -> str:
    return repr(signal.getsignal(signal.SIGTERM))


def test_pool_workers_die_on_sigterm_whatever_handler_this_process_has():
    """A Python SIGTERM handler here (Ray's driver has one that raises SystemExit) must
    not reach the forked workers: one terminated before it began would unwind a copy of
    this process's stack (a pytest worker's, which then reported a failed test)."""
    from lmforge.parallel import imap_ordered

    def raising(signum, frame):
        raise SystemExit(signum)

    old = signal.signal(signal.SIGTERM, raising)
    try:
        seen = set(imap_ordered(sigterm_handler_here, range(4), num_workers=2))
        assert signal.getsignal(signal.SIGTERM) is raising  # this process's, back
    finally:
        signal.signal(signal.SIGTERM, old)
    assert seen == {repr(signal.SIG_DFL)}


def modules_loaded(_: int) -> bool:
    return "pyarrow.dataset" in sys.modules


def test_forked_workers_start_with_what_parquet_reads_import():
    """pq.read_table imports pyarrow.dataset on first use (0.2 s a worker, in every pool):
    a process that reads Parquet loads it once, before forking, and its workers have it."""
    from lmforge.parallel import imap_ordered

    script = textwrap.dedent("""
        import sys
        import pyarrow.parquet
        from test_executor import modules_loaded
        from lmforge.parallel import imap_ordered
        before = "pyarrow.dataset" in sys.modules
        print(before, set(imap_ordered(modules_loaded, range(4), num_workers=2)))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).parent,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.stdout.split(None, 1) == ["False", "{True}\n"]
    assert list(imap_ordered(square, range(3), num_workers=2)) == [0, 1, 4]


def ray_loaded_here(_: int) -> bool:
    return "ray" in sys.modules


def test_a_process_that_loaded_ray_forks_its_workers_from_a_clean_server(monkeypatch):
    """Ray's threads outlive ray.shutdown(); a child forked among them may inherit a held
    lock and hang. With Ray loaded, workers come from a forkserver: they do not even
    share this process's modules (the stand-in for Ray is not in theirs)."""
    from lmforge import parallel

    monkeypatch.delitem(sys.modules, "ray", raising=False)
    assert parallel.start_method() == "fork"
    monkeypatch.setitem(sys.modules, "ray", types.ModuleType("ray"))
    assert parallel.start_method() == "forkserver"
    assert set(parallel.imap_ordered(ray_loaded_here, range(4), num_workers=2)) == {False}
    assert list(parallel.imap_ordered(square, range(5), num_workers=2)) == [0, 1, 4, 9, 16]


def test_part_log_answers_only_the_same_task(tmp_path):
    log = PartLog(tmp_path)
    log.put(0, ("a", 1), {"n": 3})
    assert log.get(0, ("a", 1)) == (True, {"n": 3})
    assert log.get(0, ("a", 2)) == (False, None)  # another task under the same index
    assert log.get(1, ("a", 1)) == (False, None)
    (tmp_path / "000002.pkl").write_bytes(b"half a marker")
    assert log.get(2, ("a", 1)) == (False, None)


def test_map_skips_logged_tasks_and_logs_new_ones(tmp_path):
    log = PartLog(tmp_path)
    first = Counting()
    assert list(first.map(square, range(5), log=log)) == [0, 1, 4, 9, 16]
    again = Counting()
    assert list(again.map(square, range(7), log=log)) == [0, 1, 4, 9, 16, 25, 36]
    assert (first.ran, again.ran) == (5, 2)


def test_resumable_dir_keeps_work_for_the_same_fingerprint_only(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(RuntimeError), resumable_dir(out, "v1") as work:
        (work / "kept.txt").write_text("from the first run")
        raise RuntimeError("killed")
    assert not out.exists()
    with pytest.raises(RuntimeError), resumable_dir(out, "v1") as work:
        assert (work / "kept.txt").read_text() == "from the first run"
        raise RuntimeError("killed again")
    with resumable_dir(out, "v2") as work:  # other inputs: start afresh
        assert not (work / "kept.txt").exists()
        (work / "result.txt").write_text("done")
        (work / ".done").mkdir()
    assert sorted(p.name for p in out.iterdir()) == ["result.txt"]
    assert not list(tmp_path.glob(".*"))
    with resumable_dir(out, "v3") as work:  # an existing output folder is replaced
        (work / "new.txt").write_text("new")
    assert sorted(p.name for p in out.iterdir()) == ["new.txt"]


def test_make_executor_reads_the_environment(monkeypatch):
    from lmforge.config import ExecutorConfig
    from lmforge.executor import ExecutorError

    monkeypatch.setenv("LMFORGE_EXECUTOR", "local")
    assert make_executor(ExecutorConfig(kind="ray"), 2).name == "local"
    monkeypatch.setenv("LMFORGE_EXECUTOR", "spark")
    with pytest.raises(ExecutorError, match="LMFORGE_EXECUTOR='spark'"):
        make_executor(ExecutorConfig(), 2)


@pytest.fixture
def ingested(tmp_path, monkeypatch):
    """The synthetic raw corpus of test_data_pipeline, ingested into many small parts."""
    make_raw(tmp_path)
    monkeypatch.chdir(tmp_path)
    p = params()
    p.ingest.part_docs = 8
    run_ingest(p.ingest, "data/ingested")
    return tmp_path, p


def test_ingest_resumes_after_an_interrupt(tmp_path, monkeypatch):
    make_raw(tmp_path)
    monkeypatch.chdir(tmp_path)
    cfg = params().ingest
    whole = run_ingest(cfg, "whole")
    with pytest.raises(KeyboardInterrupt):
        run_ingest(cfg, "resumed", Interrupted("ingest_file", 2))
    assert not Path("resumed").exists() and Path(".resumed.partial").is_dir()
    # Rerun with another worker count (as after running out of memory): the worker
    # count changes no byte, so the finished files are kept.
    rerun = Counting()
    assert run_ingest(dataclasses.replace(cfg, num_workers=cfg.num_workers + 3), "resumed",
                      rerun) == whole
    assert rerun.ran_by["ingest_file"] == whole["files"] - 2
    assert tree(Path("resumed")) == tree(Path("whole"))
    assert not Path(".resumed.partial").exists()


@pytest.mark.parametrize("step", ["find_duplicate_ids", "write_part"])
def test_ingest_resumes_in_its_later_maps(tmp_path, monkeypatch, step):
    """Killed while checking ids or writing parts: the rerun reads no file again and
    redoes only the tasks that had not finished."""
    make_raw(tmp_path)
    monkeypatch.chdir(tmp_path)
    cfg = dataclasses.replace(params().ingest, part_docs=20)
    whole = run_ingest(cfg, "whole", buckets=3)
    with pytest.raises(KeyboardInterrupt):
        run_ingest(cfg, "resumed", Interrupted(step, 1), buckets=3)
    rerun = Counting()
    assert run_ingest(cfg, "resumed", rerun, buckets=3) == whole
    total = {"find_duplicate_ids": 3, "write_part": whole["parts"]}
    assert whole["parts"] > 2
    assert rerun.ran_by.get("ingest_file", 0) == 0
    assert rerun.ran_by[step] == total[step] - 1
    assert tree(Path("resumed")) == tree(Path("whole"))


def test_mix_resumes_after_an_interrupt_in_each_step(ingested):
    root, p = ingested
    full = Counting()
    whole = run_mix(p.mix, "data/ingested", "whole", full)
    for step, after in (("measure_run", 3), ("join_names", 2), ("rank_range", 1),
                        ("scatter_batch", 2), ("gather_group", 1)):
        with pytest.raises(KeyboardInterrupt):
            run_mix(p.mix, "data/ingested", "resumed", Interrupted(step, after))
        rerun = Counting()
        assert run_mix(p.mix, "data/ingested", "resumed", rerun) == whole, step
        assert rerun.ran < full.ran, step  # the finished tasks were not run again
        assert tree(root / "resumed") == tree(root / "whole"), step


def test_changed_input_is_not_answered_from_old_work(ingested):
    root, p = ingested
    with pytest.raises(KeyboardInterrupt):
        run_filter(p.filter, "data/ingested", "filtered", executor=Interrupted("filter_part", 2))
    parts = sorted(Path("data/ingested").glob("part-*.parquet"))
    os.utime(parts[0], ns=(1, 1))  # as a rerun of ingest would leave it: new mtime
    rerun = Counting()
    run_filter(p.filter, "data/ingested", "filtered", executor=rerun)
    assert rerun.ran == len(parts)


def test_filter_killed_with_sigkill_resumes_with_the_same_bytes(ingested):
    """A real kill: the process dies between parts with no chance to clean up."""
    root, p = ingested
    n_parts = len(list(Path("data/ingested").glob("part-*.parquet")))
    whole = run_filter(p.filter, "data/ingested", "whole")
    script = textwrap.dedent("""
        import time
        import lmforge.data.filtering as f
        from lmforge.executor import LocalExecutor
        from test_data_pipeline import params
        real = f.filter_part
        def slow(task):
            time.sleep(0.3)
            return real(task)
        f.filter_part = slow  # one worker runs in this process: the patch applies
        f.run_filter(params().filter, "data/ingested", "filtered", executor=LocalExecutor(1))
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), str(REPO)])}
    proc = subprocess.Popen([sys.executable, "-c", script], env=env, cwd=root)
    done_dir = root / ".filtered.partial" / ".done"
    deadline = time.time() + 60
    while time.time() < deadline and len(list(done_dir.glob("*.pkl"))) < 3:
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    done = len(list(done_dir.glob("*.pkl")))
    assert 3 <= done < n_parts and not (root / "filtered").exists()

    rerun = Counting()
    metrics = run_filter(p.filter, "data/ingested", "filtered", executor=rerun)
    assert rerun.ran == n_parts - done
    assert metrics == whole
    assert tree(root / "filtered") == tree(root / "whole")
    for c in metrics["domains"].values():
        assert c["in"] == c["kept"] + sum(c["rejected"].values())


def test_a_pool_generator_closed_from_another_thread_does_not_raise_there():
    """imap_ordered's generator may be dropped by another thread; signal.signal only
    works in the main thread, so restoring the handler there must not raise."""
    import threading

    from lmforge.parallel import imap_ordered

    def raising(signum, frame):
        raise SystemExit(signum)

    old = signal.signal(signal.SIGTERM, raising)
    try:
        results = imap_ordered(square, range(8), num_workers=2)
        assert next(results) == 0  # the pool is up, SIGTERM at its default action
        errors: list[BaseException] = []

        def close() -> None:
            try:
                results.close()
            except BaseException as e:  # noqa: BLE001 (the test reports whatever it was)
                errors.append(e)

        closer = threading.Thread(target=close)
        closer.start()
        closer.join()
        assert errors == []
    finally:
        signal.signal(signal.SIGTERM, old)
