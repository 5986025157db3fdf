"""The data stages on a real local Ray cluster: the same bytes as the local pool, a
killed worker retried, errors as one line, two nodes on one machine."""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from files import tree

from lmforge.config import ExecutorConfig, IngestConfig, Params, SourceConfig, load_params
from lmforge.errors import InputError

ray = pytest.importorskip("ray")

from lmforge.data import ingest  # noqa: E402
from lmforge.data.filtering import run_filter  # noqa: E402
from lmforge.executor import ExecutorError, LocalExecutor, RayExecutor  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "data" / "raw" / "demo"
DATA_STAGES = ("ingest", "filter", "dedup", "decontam", "mix")
# Figures of how long a run took, not of what it wrote.
TIMING_KEYS = {"seconds", "tokens_per_sec", "num_workers"}


def write_demo_slice(root: Path, lines: int = 60) -> None:
    """The first ``lines`` records of every demo file, in the demo's layout."""
    for src in sorted(DEMO.glob("*/*.jsonl.gz")):
        with gzip.open(src, "rt", encoding="utf-8") as f:
            head = [next(f) for _ in range(lines)]
        out = root / "data" / "raw" / src.parent.name / src.name
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(gzip.compress("".join(head).encode(), mtime=0))


def slice_params() -> Params:
    """params.yaml, scaled to the slice: small parts (many tasks), a small tokenizer."""
    p = load_params(REPO / "params.yaml")
    sources = [SourceConfig(f"data/raw/{s.domain}/*.jsonl.gz", s.domain) for s in p.ingest.sources]
    p.ingest = dataclasses.replace(p.ingest, sources=sources, part_docs=50, num_workers=2)
    p.filter = dataclasses.replace(p.filter, num_workers=2, min_docs=1, max_loss=1.0)
    p.dedup = dataclasses.replace(p.dedup, num_workers=2)
    p.mix = dataclasses.replace(p.mix, part_docs=120, min_val_docs=2, min_val_chars=1000,
                                max_shortfall=1.0, num_workers=2)
    p.tokenizer = dataclasses.replace(p.tokenizer, vocab_size=3500, sample_chars=300_000,
                                      num_threads=1)
    # decontam reads the repo's evaluation sets where they are.
    p.harness = dataclasses.replace(p.harness, task_dir=str(REPO / p.harness.task_dir))
    post = p.evaluate_post
    p.evaluate_post = dataclasses.replace(post, **{k: str(REPO / getattr(post, k))
                                                   for k in ("test", "test_mc", "test_pref")})
    p.decontam = dataclasses.replace(p.decontam, num_workers=2)
    p.shards = dataclasses.replace(p.shards, shard_tokens=20_000, num_workers=2)
    p.validate()
    return p


def run_stages(root: Path, monkeypatch, names: tuple[str, ...]) -> None:
    monkeypatch.syspath_prepend(str(REPO))  # the stages package lives at the repo root
    import importlib

    monkeypatch.chdir(root)
    p = slice_params()
    for name in names:
        importlib.import_module(f"stages.{name}").main(p)


def without_timing(obj):
    if isinstance(obj, dict):
        return {k: without_timing(v) for k, v in obj.items() if k not in TIMING_KEYS}
    return obj


@pytest.fixture(scope="module")
def local_run(tmp_path_factory):
    """The data stages, tokenizer and shards on the local pool: the reference."""
    root = tmp_path_factory.mktemp("local")
    write_demo_slice(root)
    mp = pytest.MonkeyPatch()
    try:
        mp.delenv("LMFORGE_EXECUTOR", raising=False)
        run_stages(root, mp, (*DATA_STAGES, "tokenizer", "shards"))
    finally:
        mp.undo()
    return root


def test_ray_run_writes_the_local_bytes(ray_cluster, local_run, tmp_path, monkeypatch):
    write_demo_slice(tmp_path)
    monkeypatch.setenv("LMFORGE_EXECUTOR", "ray")
    # Ids checked in several buckets here (the local run had one): the same bytes.
    monkeypatch.setattr(ingest, "ID_BUCKET_BYTES", 100_000)
    run_stages(tmp_path, monkeypatch, DATA_STAGES)
    # The tokenizer stage has no per-part tasks: take the local one, then shards on Ray.
    shutil.copytree(local_run / "models", tmp_path / "models")
    run_stages(tmp_path, monkeypatch, ("shards",))

    local, remote = tree(local_run / "data"), tree(tmp_path / "data")
    assert set(local) == set(remote)
    assert any(f.startswith("shards/train/") for f in local)
    assert len([f for f in local if f.startswith("ingested/part-")]) > 4  # many tasks
    for name in local:
        assert local[name] == remote[name], name
    assert_same_metrics(local_run, tmp_path)
    assert not list((tmp_path / "data").glob(".*")), "work directories left behind"


def _kill_first_task(prefix: bytes, killed: list[int], stop: threading.Event) -> None:
    """SIGKILL the first process whose title says it runs task ``prefix``."""
    while not stop.is_set() and not killed:
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if cmd.startswith(b"ray::" + prefix):
                os.kill(int(pid), signal.SIGKILL)
                killed.append(int(pid))
                return
        time.sleep(0.005)


def test_a_killed_worker_is_retried_and_the_output_is_unchanged(ray_cluster, local_run, tmp_path):
    cfg = slice_params().filter
    ingested = local_run / "data" / "ingested"
    for attempt in range(3):  # a task may finish before the watcher sees it: try again
        killed: list[int] = []
        stop = threading.Event()
        watcher = threading.Thread(target=_kill_first_task, args=(b"filter_part", killed, stop))
        watcher.start()
        out = tmp_path / f"filtered{attempt}"
        try:
            metrics = run_filter(cfg, ingested, out, executor=RayExecutor(ExecutorConfig("ray")))
        finally:
            stop.set()
            watcher.join()
        if killed:
            break
    assert killed, "no filter task was caught running"
    assert tree(out) == tree(local_run / "data" / "filtered")
    reference = json.loads((local_run / "metrics" / "filter.json").read_text())
    for domain, c in metrics["domains"].items():
        assert c == reference["domains"][domain]
        assert c["in"] == c["kept"] + sum(c["rejected"].values())


def test_ingest_checks_ids_on_ray_as_the_local_pool_does(ray_cluster, tmp_path):
    """Repeated ids across files: Ray's tasks group them in 4 buckets, the local pool in
    1; the same parts, rejects and counts, and no rows come back to the driver."""
    for k in range(4):
        rows = [json.dumps({"id": f"{(5 * k + i) % 12}" if i < 6 else f"{k}/{i}",
                            "text": f"document {k} {i} " * 20}) for i in range(40)]
        (tmp_path / f"f{k}.jsonl").write_text("\n".join(rows) + "\n")
    cfg = IngestConfig(sources=[SourceConfig(str(tmp_path / "f*.jsonl"), "en")],
                       part_docs=30, num_workers=1)
    local = ingest.run_ingest(cfg, tmp_path / "local", LocalExecutor(1), buckets=1)
    remote = ingest.run_ingest(cfg, tmp_path / "ray", RayExecutor(ExecutorConfig("ray")),
                               buckets=4)
    assert remote == local
    assert local["total"]["rejected"] == {"duplicate_id": 24 - 12}
    assert tree(tmp_path / "ray") == tree(tmp_path / "local")


def test_a_slow_task_holds_back_its_results_not_the_cluster(ray_cluster, tmp_path):
    """The first task sleeps while fifteen short ones come after it (2 slots): they all
    start while it runs (the old window of 2 a slot waited for the oldest task before
    starting a fifth), and the results still come back in task order."""
    def task(i: int, sleep: float) -> list[str]:  # run by subprocess.check_output
        return ["sh", "-c", f"date +%s.%N > {tmp_path}/start-{i}; sleep {sleep}; "
                            f"date +%s.%N > {tmp_path}/end-{i}; echo {i}"]

    tasks = [task(0, 3.0)] + [task(i, 0.05) for i in range(1, 16)]
    out = list(RayExecutor(ExecutorConfig("ray")).map(subprocess.check_output, tasks))
    assert [int(o) for o in out] == list(range(16))

    def at(name: str) -> float:
        return float((tmp_path / name).read_text())

    assert max(at(f"start-{i}") for i in range(1, 16)) < at("end-0")


def test_a_task_error_reaches_the_driver_as_raised(ray_cluster, tmp_path):
    """A corrupt part raises InputError inside the task: the same one line as locally."""
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "part-00000.parquet").write_bytes(b"PAR1 not really parquet")
    cfg = slice_params().filter
    with pytest.raises(InputError) as local_err:
        run_filter(cfg, tmp_path / "in", tmp_path / "a", executor=LocalExecutor(1))
    with pytest.raises(InputError) as ray_err:
        run_filter(cfg, tmp_path / "in", tmp_path / "b",
                   executor=RayExecutor(ExecutorConfig("ray")))
    assert str(ray_err.value) == str(local_err.value)
    assert "part-00000.parquet" in str(ray_err.value) and "\n" not in str(ray_err.value)


def test_missing_ray_is_one_line(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_ray(name, *args, **kwargs):
        if name == "ray":
            raise ImportError("No module named 'ray'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_ray)
    with pytest.raises(ExecutorError, match=r"pip install 'lmforge\[ray\]'"):
        RayExecutor(ExecutorConfig("ray"))


def run_cluster_script(script: str, cwd: Path) -> dict:
    """Run a script that starts its own Ray cluster in a fresh process (its workers can
    import this module); return the JSON it prints after ``RESULT``."""
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}"}
    env.pop("LMFORGE_EXECUTOR", None)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300, cwd=cwd, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def on_node(log_dir: str, fn, task):
    """Run ``fn(task)`` on a Ray worker, leaving a mark of which node ran which function."""
    node = ray.get_runtime_context().get_node_id()
    (Path(log_dir) / f"{fn.__name__}@{node}").touch()
    return fn(task)


def assert_same_metrics(local_run: Path, other: Path) -> None:
    """Every data stage's and shards' metrics as the local run's, timings aside."""
    for stage in (*DATA_STAGES, "shards"):
        a = json.loads((local_run / "metrics" / f"{stage}.json").read_text())
        b = json.loads((other / "metrics" / f"{stage}.json").read_text())
        assert without_timing(a) == without_timing(b), stage


def test_three_ray_nodes_on_one_machine_write_the_local_bytes(local_run, tmp_path):
    """A head and two worker nodes (ray.cluster_utils.Cluster), one CPU each, in a fresh
    process (the session's Ray instance is a single node): every data stage and shards,
    through their DVC entry points with ``LMFORGE_EXECUTOR=ray``, ids in several buckets;
    the local run's bytes and counts, and tasks on all three nodes."""
    pytest.importorskip("ray.cluster_utils")  # Ray's own multi-node test harness
    write_demo_slice(tmp_path)  # the same relative paths as the local run's
    shutil.copytree(local_run / "models", tmp_path / "models")  # the tokenizer stage's output
    marks = tmp_path / "marks"
    marks.mkdir()
    script = textwrap.dedent(f"""
        import functools, importlib, json, os, ray
        from ray.cluster_utils import Cluster
        import lmforge.executor as executor
        from lmforge.data import ingest
        from test_executor_ray import on_node, slice_params
        cluster = Cluster(initialize_head=True, head_node_args={{"num_cpus": 1}})
        for _ in range(2):
            cluster.add_node(num_cpus=1)
        ray.init(address=cluster.address, include_dashboard=False)
        os.environ.update(LMFORGE_EXECUTOR="ray", RAY_ADDRESS=cluster.address)
        plain = executor.RayExecutor._run
        executor.RayExecutor._run = lambda self, fn, tasks: plain(
            self, functools.partial(on_node, {str(marks)!r}, fn), tasks)
        ingest.ID_BUCKET_BYTES = 100_000  # several buckets (the local run had one)
        try:
            nodes = [n for n in ray.nodes() if n["Alive"]]
            p = slice_params()
            for name in {(*DATA_STAGES, "shards")!r}:
                importlib.import_module(f"stages.{{name}}").main(p)
            print("RESULT", json.dumps({{"nodes": len(nodes)}}))
        finally:
            ray.shutdown()
            cluster.shutdown()
    """)
    assert run_cluster_script(script, tmp_path)["nodes"] == 3
    local, remote = tree(local_run / "data"), tree(tmp_path / "data")
    assert sorted(f for f in local if not f.startswith("raw/")) == \
        sorted(f for f in remote if not f.startswith("raw/"))
    for name in local:
        assert local[name] == remote[name], name
    assert_same_metrics(local_run, tmp_path)
    ran = [m.name.split("@") for m in marks.iterdir()]
    assert len({node for _, node in ran}) == 3, ran
    assert {"ingest_file", "find_duplicate_ids", "write_part", "filter_part", "write_shard",
            "encode_piece"} <= {fn for fn, _ in ran}


def test_a_worker_node_killed_mid_stage_leaves_the_local_bytes(local_run, tmp_path):
    """Three nodes; the first time a filter task starts on one worker node, that node is
    removed (its raylet and workers killed). Ray reruns the lost tasks on the others; if
    they run out of retries the stage is rerun, resuming. Either way: the local bytes."""
    pytest.importorskip("ray.cluster_utils")
    marks = tmp_path / "marks"
    marks.mkdir()
    script = textwrap.dedent(f"""
        import functools, json, pathlib, threading, time, ray
        from ray.cluster_utils import Cluster
        import lmforge.executor as executor
        from lmforge.data.filtering import run_filter
        from test_executor_ray import on_node, slice_params
        cluster = Cluster(initialize_head=True, head_node_args={{"num_cpus": 1}})
        doomed = cluster.add_node(num_cpus=1)
        cluster.add_node(num_cpus=1)
        ray.init(address=cluster.address, include_dashboard=False)
        plain = executor.RayExecutor._run
        executor.RayExecutor._run = lambda self, fn, tasks: plain(
            self, functools.partial(on_node, {str(marks)!r}, fn), tasks)
        killed = []

        def kill_when_busy():
            mark = pathlib.Path({str(marks)!r}) / f"filter_part@{{doomed.node_id}}"
            while not mark.exists():
                time.sleep(0.01)
            cluster.remove_node(doomed, allow_graceful=False)
            killed.append(time.time())

        watcher = threading.Thread(target=kill_when_busy, daemon=True)
        watcher.start()
        runs = 0
        try:
            cfg = slice_params().filter
            while True:
                runs += 1
                try:
                    run_filter(cfg, {str(local_run / "data" / "ingested")!r}, "filtered",
                               executor=executor.RayExecutor(executor.ExecutorConfig("ray")))
                    break
                except executor.ExecutorError:
                    if runs == 3:
                        raise
            print("RESULT", json.dumps({{"killed": bool(killed), "runs": runs}}))
        finally:
            ray.shutdown()
            cluster.shutdown()
    """)
    result = run_cluster_script(script, tmp_path)
    assert result["killed"], "the node was never caught running a filter task"
    assert tree(tmp_path / "filtered") == tree(local_run / "data" / "filtered")
    assert not (tmp_path / ".filtered.partial").exists()


def test_an_unreachable_cluster_is_one_line_in_seconds(monkeypatch):
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    if ray.is_initialized():  # the session's instance would be reused
        monkeypatch.setattr(ray, "is_initialized", lambda: False)
    start = time.monotonic()
    with pytest.raises(ExecutorError, match=f"cannot reach the Ray cluster at 127.0.0.1:{port}"):
        RayExecutor(ExecutorConfig("ray"))
    assert time.monotonic() - start < 10
