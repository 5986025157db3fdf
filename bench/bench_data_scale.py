"""The data stages at scale: demo corpus x1, x10 and xN, on the local pool vs Ray, same 2 CPUs.

ingest -> filter -> dedup -> decontam -> mix -> shards run in-process (the ``run_*``
functions the stages call, params.yaml's settings, ``num_workers`` 2), each (corpus,
executor) in a fresh Python process: ``local`` = the process pool of 2, ``ray`` =
``ray.init(num_cpus=2)`` started by that process (start-up and two warm-up tasks not
counted), then one Ray task per part. ``--rounds`` runs of each, interleaved (local, ray,
ray, local, ...): the best wall time and the largest memory figure are reported, as the
cores are shared and noisy. One more Ray run per corpus (``ray-traced``, not timed)
traces the driver's Python heap. ``--baseline REV`` adds the Ray runs of revision REV's
``src/`` (``ray@base``), so a change is measured against what it replaces in one run.

The x10 corpus (built once under ``--work``) repeats every demo document as 10 copies
with new ids: copy 0 as it was; of the others (seeded), 15 % exact copies, 70 % near
copies (~1 % of the words, or CJK characters, replaced by others of the same text; a line
dropped, swapped or inserted) and 15 % far copies (a quarter of the words replaced, 30 %
of the lines dropped: below the LSH threshold, so dedup keeps them).

Printed (and written with ``--out``): wall seconds per stage and ray/local throughput
(local seconds / ray seconds; target >= 0.8 at x10; ray/base against the baseline); peak
memory per worker at x1 vs x10 (should stay flat): the kernel's VmHWM of the pool's
children or of the ``ray::`` worker processes (reset per stage via /proc/PID/clear_refs),
and the anonymous memory the stage's tasks added (RssAnon sampled every 0.05 s, less its
value at the fork or the stage's start); the driver's memory per stage at x1 and x10 and
what it adds per document (its RSS; in the traced run its Python heap and Arrow's pool):
a driver that holds per-part bookkeeping only adds ~0 B/doc; input MB/s/core and
docs/s/core per stage at x10 on the local pool; the pickled bytes of the tasks and results
(what Ray's object store and RPCs carry); the mix driver's heap per document and its
intermediate files; whether every run's output tree is byte-identical to local's.

Recorded per stage besides (the inputs of bench/project_tb.py's 1 TB projection): the
driver's own CPU seconds and its reaped pool workers'; the bytes read and written through
system calls (``rchar`` + ``wchar`` of the driver and, on the local pool, its reaped
workers); the intermediate files (:class:`FileWatch`). ``--mid`` (default 10) runs a scale
between x1 and x``--copies`` too, so that what grows per document can be taken past the
fixed blocks a small corpus does not fill. The kinds ``ray3`` and ``ray3-kill`` (a
three-node cluster, with a worker node killed mid-filter) are bench_ray_cluster.py's.

    .venv/bin/python bench/bench_data_scale.py [--copies 10] [--mid 10] [--rounds 2]
        [--baseline REV] [--work /tmp/lmforge_scale] [--out scale.json] [--keep]
"""

from __future__ import annotations

import argparse
import filecmp
import gzip
import json
import os
import pickle
import random
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from _common import DEMO, REPO, checkout_src

STAGES = ("ingest", "filter", "dedup", "decontam", "mix", "shards")
CORES = 2
# The demo's tokenizer when `dvc repro` made it, else one trained by the first run (x1,
# local) on its own mixed/train, with params.yaml's settings, and kept under --work.
TOKENIZER = REPO / "models" / "tokenizer" / "tokenizer.model"
ENV_TOKENIZER = "LMFORGE_BENCH_TOKENIZER"
KINDS = ("local", "ray")
TRACED = "ray-traced"  # one more Ray run per scale, its driver under tracemalloc (not timed)
# Shares of the copies after the first: exact, near (the rest), far.
EXACT, FAR = 0.15, 0.15
_CJK = re.compile("[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff]")
_WORD = re.compile(r"\S+")


# ------------------------------------------------------------------ the x10 corpus


def _change_tokens(text: str, share: float, rng: random.Random) -> str:
    """Replace ``share`` of the words (CJK characters for CJK text), at least one, by
    other words (characters) of the same text."""
    cjk = _CJK.findall(text)
    spans = ([m.span() for m in _CJK.finditer(text)] if len(cjk) > 0.3 * len(text)
             else [m.span() for m in _WORD.finditer(text)])
    if len(spans) < 2:
        return text + " ."
    pool = [text[a:b] for a, b in spans]
    pick = sorted(rng.sample(range(len(spans)), max(1, round(share * len(spans)))))
    out, last = [], 0
    for i in pick:
        a, b = spans[i]
        out += [text[last:a], rng.choice(pool)]
        last = b
    out.append(text[last:])
    return "".join(out)


def vary(text: str, kind: str, donor: str, rng: random.Random) -> str:
    """A copy of ``text``: ``exact``, ``near`` (Jaccard well above the LSH threshold) or
    ``far`` (well below it)."""
    if kind == "exact":
        return text
    lines = text.split("\n")
    if kind == "far":
        if len(lines) >= 4:
            drop = set(rng.sample(range(len(lines)), int(0.3 * len(lines))))
            lines = [ln for i, ln in enumerate(lines) if i not in drop]
        return _change_tokens("\n".join(lines), 0.25, rng)
    if len(lines) >= 8:  # one line operation; short texts (verse) only get word changes
        op, i = rng.randrange(3), rng.randrange(len(lines) - 1)
        if op == 0:
            del lines[i]
        elif op == 1:
            lines[i], lines[i + 1] = lines[i + 1], lines[i]
        else:
            donor_lines = [ln for ln in donor.split("\n") if ln.strip()] or ["."]
            lines.insert(i, rng.choice(donor_lines))
    return _change_tokens("\n".join(lines), 0.01, rng)


def make_corpus(root: Path, copies: int, seed: int = 0) -> Path:
    """The demo corpus x ``copies`` under ``root`` (kept, rebuilt only when missing):
    ``<domain>/part-SSSS-KK.jsonl.gz`` is copy K of demo file S, so each file has the
    size of a demo file and ingest keeps the sorted order (copy 0 first)."""
    stamp = root / ".done"
    if stamp.is_file() and stamp.read_text() == f"{copies} {seed}":
        return root
    shutil.rmtree(root, ignore_errors=True)
    for src in sorted(DEMO.glob("*/*.jsonl.gz")):
        with gzip.open(src, "rt", encoding="utf-8") as f:
            recs = [json.loads(line) for line in f]
        texts = [r["text"] for r in recs]
        for k in range(copies):
            out = root / src.parent.name / f"{src.name.split('.')[0]}-{k:02d}.jsonl.gz"
            out.parent.mkdir(parents=True, exist_ok=True)
            with gzip.open(out, "wt", encoding="utf-8", compresslevel=6) as f:
                for j, rec in enumerate(recs):
                    rec = dict(rec)
                    if k:
                        rng = random.Random(f"{seed}:{rec.get('id', j)}:{k}")
                        r = rng.random()
                        kind = "exact" if r < EXACT else "far" if r > 1 - FAR else "near"
                        rec["text"] = vary(rec["text"], kind, texts[(j + k) % len(texts)], rng)
                        rec["id"] = f"{rec.get('id', j)}~{k}"
                    f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    stamp.write_text(f"{copies} {seed}")
    return root


# ------------------------------------------------------------------ one run (child)


def _status_kib(pid: int | str, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1])
    return 0


def _reset_hwm(pid: int | str) -> None:
    """Reset a process's VmHWM to its current RSS (Linux >= 4.0)."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _children(pid: int) -> list[int]:
    """The child processes of ``pid`` (from every thread's /proc children list)."""
    out = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/children") as f:
                    out += [int(c) for c in f.read().split()]
            except OSError:
                continue
    except OSError:
        pass
    return out


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


class Sampler(threading.Thread):
    """Peak memory of the worker processes, sampled every ``interval`` s: the driver's
    pool children (local), or its ``ray::`` descendants (Ray's workers; the process tree
    is walked every ``rescan`` s, as they live long).

    ``worker_peak_kib``: the kernel's VmHWM. A forked pool worker's counts the driver's
    pages it shares from the fork; a Ray worker's, all it kept from earlier stages
    (VmHWM is reset to the current RSS when a stage starts). ``worker_growth_kib``:
    the largest sampled anonymous RSS (RssAnon: heap and buffers, no shared libraries)
    less the worker's RssAnon when first seen in the stage (just after the fork, or at
    the stage's start): what the stage's tasks themselves allocated."""

    def __init__(self, ray: bool, interval: float = 0.05, rescan: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.ray, self.interval, self.rescan = ray, interval, rescan
        self.lock = threading.Lock()
        self.hwm: dict[int, int] = {}
        self.anon: dict[int, int] = {}
        self.first: dict[int, int] = {}
        self.kind: dict[int, bool] = {}  # pid -> is a worker
        self.pids: list[int] = []
        self.scanned = 0.0
        self.driver_anon = self.driver_anon0 = self.driver_arrow = self.driver_arrow0 = 0

    def workers(self) -> list[int]:
        if self.ray and time.monotonic() - self.scanned < self.rescan:
            return self.pids
        found, todo = [], _children(os.getpid())
        while todo:
            pid = todo.pop()
            if pid not in self.kind:
                cmd = _cmdline(pid)
                self.kind[pid] = ((cmd.startswith("ray::") and "Agent" not in cmd) if self.ray
                                  else "resource_tracker" not in cmd)
            if self.kind[pid]:
                found.append(pid)
            if self.ray:
                todo += _children(pid)
        self.pids, self.scanned = found, time.monotonic()
        return found

    def sample(self) -> None:
        self.sample_driver()
        for pid in self.workers():
            try:
                hwm, anon = _status_kib(pid, "VmHWM:"), _status_kib(pid, "RssAnon:")
            except OSError:
                continue
            with self.lock:
                self.first.setdefault(pid, anon)
                self.hwm[pid] = max(self.hwm.get(pid, 0), hwm)
                self.anon[pid] = max(self.anon.get(pid, 0), anon)

    def sample_driver(self) -> None:
        """The driver's own anonymous RSS and Arrow's allocations (its memory pool holds
        what tracemalloc cannot see), their largest values since :meth:`begin`."""
        import pyarrow as pa

        anon, arrow = _status_kib("self", "RssAnon:"), pa.total_allocated_bytes() // 1024
        with self.lock:
            self.driver_anon = max(self.driver_anon, anon)
            self.driver_arrow = max(self.driver_arrow, arrow)

    def begin(self) -> None:
        import pyarrow as pa

        self.scanned = 0.0
        for pid in self.workers():
            _reset_hwm(pid)
        with self.lock:
            self.hwm, self.anon, self.first = {}, {}, {}
            self.driver_anon = self.driver_anon0 = _status_kib("self", "RssAnon:")
            self.driver_arrow = self.driver_arrow0 = pa.total_allocated_bytes() // 1024
        self.sample()

    def end(self) -> dict[str, int]:
        """Largest worker VmHWM and anonymous growth in KiB, and workers seen, since
        :meth:`begin`; the driver's anonymous RSS and Arrow allocations grown since then."""
        self.sample()
        with self.lock:
            return {"worker_peak_kib": max(self.hwm.values(), default=0),
                    "worker_growth_kib": max((a - self.first[p] for p, a in self.anon.items()),
                                             default=0),
                    "workers_seen": len(self.hwm),
                    "driver_anon_growth_kib": self.driver_anon - self.driver_anon0,
                    "driver_arrow_growth_kib": self.driver_arrow - self.driver_arrow0}

    def run(self) -> None:
        while True:
            self.sample()
            time.sleep(self.interval)


METER = {"tasks": 0, "task_bytes": 0, "result_bytes": 0}
_WORK_DIR = re.compile(r"^\.(?P<name>[^.]+)(\.partial|\..*\.tmp)$")


def _files(data: Path) -> dict[str, int]:
    """Every file under ``data`` (relative path -> bytes), a stage's work directory
    (``.NAME.partial``, ``.NAME.XXXX.tmp``) named as the directory it becomes."""
    found = {}
    for dirpath, _, names in os.walk(data):
        rel = Path(dirpath).relative_to(data).parts
        if rel and (m := _WORK_DIR.match(rel[0])):
            rel = (m["name"], *rel[1:])
        for name in names:
            try:
                found["/".join((*rel, name))] = os.stat(os.path.join(dirpath, name)).st_size
            except OSError:  # removed meanwhile
                continue
    return found


class FileWatch:
    """The intermediate files of a stage: those under data/ when any of its maps starts
    that neither were there before the stage nor are its outputs at the end (each
    map's scratch, plans, completion marks). A lower bound: a file made and removed
    within one map is not seen. Also the largest total size of such files."""

    def __init__(self, data: Path) -> None:
        self.data = data
        self.before: dict[str, int] = {}
        self.seen: dict[str, int] = {}
        self.peak_bytes = 0

    def begin(self) -> None:
        self.before, self.seen, self.peak_bytes = _files(self.data), {}, 0

    def look(self) -> None:
        new = {k: v for k, v in _files(self.data).items() if k not in self.before}
        self.seen.update(new)
        self.peak_bytes = max(self.peak_bytes, sum(new.values()))

    def end(self) -> dict[str, int]:
        after = _files(self.data)
        scratch = [k for k in self.seen if k not in after]
        return {"intermediate_files": len(scratch),
                "intermediate_peak_bytes": self.peak_bytes,
                "output_files": sum(1 for k in after if k not in self.before)}


WATCH: list[FileWatch] = []  # the run's watch, looked at as each map starts


def _meter_executor() -> None:
    """Count the pickled bytes of every task sent and result returned (both executors
    pay the same small cost): what Ray moves through its object store and RPCs; and
    let the file watch look at the data tree as each map starts."""
    from lmforge.executor import Executor

    plain = Executor.map

    def metered(self, fn, tasks, desc=None, log=None):
        tasks = list(tasks)
        for watch in WATCH:
            watch.look()
        METER["tasks"] += len(tasks)
        METER["task_bytes"] += sum(len(pickle.dumps(t, protocol=5)) for t in tasks)
        for result in plain(self, fn, tasks, desc, log):
            METER["result_bytes"] += len(pickle.dumps(result, protocol=5))
            yield result

    Executor.map = metered


def _io_chars() -> tuple[int, int]:
    """(rchar, wchar) of this process and its reaped children: every byte read and
    written through system calls (files, and the pool's pipes), the workers' included
    once the pool has reaped them; a Ray worker is no child, so on Ray the driver's."""
    with open("/proc/self/io") as f:
        fields = dict(line.split(": ") for line in f.read().splitlines())
    return int(fields["rchar"]), int(fields["wchar"])


def _cpu_seconds() -> tuple[float, float]:
    """(the driver's own CPU seconds, its reaped children's): user + system."""
    t = os.times()
    return t.user + t.system, t.children_user + t.children_system


def eval_sets(params: Any) -> dict[str, str]:
    """The decontam stage's evaluation sets (stages/decontam.py), as absolute paths: the
    runs work elsewhere than the repository."""
    sys.path.insert(0, str(REPO))
    from stages.decontam import eval_sets as stage_sets

    return {name: str(REPO / path) for name, path in stage_sets(params).items()}


def train_tokenizer(cfg: Any, path: Path) -> None:
    """Train the tokenizer stage's model on this run's data/mixed, into ``path``."""
    from lmforge.io import atomic_path
    from lmforge.tokenizer.build import build_tokenizer

    build_tokenizer("data/mixed/train", "data/mixed/val", "tokenizer", cfg)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        shutil.copyfile(Path("tokenizer") / path.name, tmp)
    shutil.rmtree("tokenizer")


CLUSTER_KINDS = ("ray3", "ray3-kill")  # bench_ray_cluster.py's: three Ray nodes
CLUSTER_NODES = 3
KILL_AT = "filter.filter_part"  # ray3-kill removes a worker node when it first runs this
CURRENT = {"stage": ""}  # the stage running, for the marks


def on_node(marks: str, stage: str, fn: Any, task: Any) -> Any:
    """Run ``fn(task)`` on a Ray worker, leaving a mark of the stage, function and node."""
    import ray

    node = ray.get_runtime_context().get_node_id()
    (Path(marks) / f"{stage}.{fn.__name__}@{node}").touch()
    return fn(task)


def ran_on(marks: Path) -> dict[str, dict[str, int]]:
    """Per stage and task function, on how many nodes it ran (from the marks)."""
    nodes: dict[str, dict[str, set[str]]] = {}
    for mark in marks.iterdir():
        name, node = mark.name.split("@")
        stage, fn = name.split(".", 1)
        nodes.setdefault(stage, {}).setdefault(fn, set()).add(node)
    return {stage: {fn: len(v) for fn, v in sorted(fns.items())}
            for stage, fns in nodes.items()}


def start_cluster(marks: Path, kill: bool) -> tuple[Any, dict[str, bool]]:
    """A head and two worker nodes of one CPU each (``ray.cluster_utils.Cluster``, Ray's
    multi-node harness, on this machine), every task marking where it ran; with
    ``kill``, the first worker node is removed (raylet and workers killed) the first
    time it runs a ``KILL_AT`` task. Returns the cluster and {"killed": ...}."""
    import functools

    import ray
    from ray.cluster_utils import Cluster

    from lmforge.executor import RayExecutor

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    workers = [cluster.add_node(num_cpus=1) for _ in range(CLUSTER_NODES - 1)]
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    marks.mkdir(parents=True, exist_ok=True)
    plain = RayExecutor._run
    RayExecutor._run = lambda self, fn, tasks: plain(
        self, functools.partial(on_node, str(marks), CURRENT["stage"], fn), tasks)
    doomed: dict[str, bool] = {}
    if kill:
        def kill_when_busy() -> None:
            mark = marks / f"{KILL_AT}@{workers[0].node_id}"
            while not mark.exists():
                time.sleep(0.01)
            cluster.remove_node(workers[0], allow_graceful=False)
            doomed["killed"] = True

        threading.Thread(target=kill_when_busy, daemon=True).start()
    return cluster, doomed


def run_child(kind: str, corpus: Path, root: Path, out: Path) -> None:
    """Run the six stages on ``corpus`` into ``root``/data with ``kind``; figures to
    ``out``. ``ray-traced`` also traces the driver's Python heap (tracemalloc: slower, so
    that run is not timed)."""
    from lmforge.config import ExecutorConfig, SourceConfig, load_params
    from lmforge.data.decontam import run_decontam
    from lmforge.data.dedup import run_dedup
    from lmforge.data.filtering import run_filter
    from lmforge.data.ingest import run_ingest
    from lmforge.data.mix import run_mix, val_ids
    from lmforge.executor import ExecutorError, LocalExecutor, RayExecutor
    from lmforge.shards.build import build_shards

    os.chdir(root)  # relative data/ paths, as the stages use (Ray tasks run here too)
    params = load_params(REPO / "params.yaml")
    params.ingest.sources = [SourceConfig(path=str(corpus / s.domain / "*.jsonl.gz"),
                                          domain=s.domain) for s in params.ingest.sources]
    for section in ("ingest", "filter", "dedup", "decontam", "mix", "shards"):
        getattr(params, section).num_workers = CORES
    sets = eval_sets(params)
    figures: dict[str, Any] = {"kind": kind, "stages": {}}
    on_ray = kind.startswith("ray")
    t0 = time.perf_counter()
    cluster = None
    if kind in CLUSTER_KINDS:
        cluster, doomed = start_cluster(root / "marks", kill=kind == "ray3-kill")
        figures["nodes"] = CLUSTER_NODES
    elif on_ray:
        import ray

        ray.init(num_cpus=CORES, include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
    if on_ray:
        import ray

        @ray.remote(num_cpus=1)
        def warm() -> int:
            return os.getpid()

        ray.get([warm.remote() for _ in range(2 * CORES)])  # the workers exist
        executor = RayExecutor(ExecutorConfig(kind="ray"))
    else:
        executor = LocalExecutor(CORES)
    figures["startup_s"] = round(time.perf_counter() - t0, 2)
    _meter_executor()
    sampler = Sampler(on_ray)
    sampler.start()

    def decontam() -> dict[str, Any]:  # as stages/decontam.py: mix's val ids, then the scan
        held_out = val_ids(params.mix, "data/deduped", executor)
        return run_decontam(params.decontam, sets, "data/deduped", "data/decontam", executor,
                            held_out)

    steps = {
        "ingest": lambda: run_ingest(params.ingest, "data/ingested", executor),
        "filter": lambda: run_filter(params.filter, "data/ingested", "data/filtered", {},
                                     executor),
        "dedup": lambda: run_dedup(params.dedup, "data/filtered", "data/deduped", executor),
        "decontam": decontam,
        "mix": lambda: run_mix(params.mix, "data/decontam", "data/mixed", executor),
        "shards": lambda: build_shards("data/mixed", tokenizer, "data/shards", params.shards,
                                       executor=executor),
    }
    tokenizer = Path(os.environ.get(ENV_TOKENIZER, TOKENIZER))
    traced = kind == TRACED
    if traced:
        import tracemalloc

        tracemalloc.start()
    watch = FileWatch(root / "data")
    WATCH.append(watch)
    for stage in STAGES:
        if stage == "shards" and not tokenizer.is_file():  # not part of the measured stage
            train_tokenizer(params.tokenizer, tokenizer)
        METER.update(tasks=0, task_bytes=0, result_bytes=0)
        CURRENT["stage"] = stage
        sampler.begin()
        watch.begin()
        _reset_hwm("self")
        rss0 = _status_kib("self", "VmRSS:")
        if traced:
            tracemalloc.reset_peak()
            heap0 = tracemalloc.get_traced_memory()[0]
        io0, cpu0, start = _io_chars(), _cpu_seconds(), time.perf_counter()
        reruns = 0
        while True:  # as a user reruns a stage that failed: it resumes where it was
            try:
                metrics = steps[stage]()
                break
            except ExecutorError:
                if cluster is None or reruns == 2:
                    raise
                reruns += 1
        wall = time.perf_counter() - start
        cpu, io = _cpu_seconds(), _io_chars()
        heap = {"driver_heap_growth_kib": (tracemalloc.get_traced_memory()[1] - heap0) // 1024
                } if traced else {}
        figures["stages"][stage] = {
            "wall_s": round(wall, 3), **sampler.end(), **heap, **watch.end(),
            "driver_cpu_s": round(cpu[0] - cpu0[0], 3),
            "children_cpu_s": round(cpu[1] - cpu0[1], 3),
            "read_chars": io[0] - io0[0], "written_chars": io[1] - io0[1], "reruns": reruns,
            "driver_peak_kib": _status_kib("self", "VmHWM:"),
            "driver_growth_kib": _status_kib("self", "VmHWM:") - rss0, **METER,
            "metrics": {k: metrics[k] for k in ("total", "exact_dups", "near_dups", "clusters")
                        if k in metrics}}
    if on_ray:
        import ray

        ray.shutdown()
    if cluster is not None:
        cluster.shutdown()
        figures["killed_node"] = doomed.get("killed", False)
        figures["ran_on"] = ran_on(root / "marks")
    out.write_text(json.dumps(figures, indent=1))


# ------------------------------------------------------------------ the parent

OUTPUTS = ("ingested", "filtered", "deduped", "decontam", "mixed", "shards")  # each stage's output dir


def text_size(path: Path, stage: str) -> tuple[int, int, int]:
    """(documents, UTF-8 bytes of text, text bytes of the largest file) a stage reads
    from ``path``: a task's input is one file (ingest), a part, or a row range of one."""
    docs = size = largest = 0
    if stage == "ingest":
        for f in sorted(path.glob("*/*.jsonl.gz")):
            one = 0
            with gzip.open(f, "rt", encoding="utf-8") as fh:
                for line in fh:
                    docs += 1
                    one += len(json.loads(line)["text"].encode())
            size, largest = size + one, max(largest, one)
        return docs, size, largest
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    # A stage's parts (not filter's rejects/); mixed/ has them under train/ and val/.
    for f in sorted(path.glob("part-*.parquet")) or sorted(path.glob("*/part-*.parquet")):
        col = pq.read_table(f, columns=["text"]).column("text")
        one = pc.sum(pc.binary_length(col)).as_py() or 0
        docs, size, largest = docs + len(col), size + one, max(largest, one)
    return docs, size, largest


def task_units(corpus: Path, data: Path) -> dict[str, int]:
    """What each stage's work is cut by: ingest's input files, the other stages' input
    parts (mixed/'s splits together)."""
    units = {"ingest": len(list(corpus.glob("*/*.jsonl.gz")))}
    for stage, src in zip(STAGES[1:], OUTPUTS[:-1], strict=True):
        units[stage] = (len(list((data / src).glob("part-*.parquet")))
                        or len(list((data / src).glob("*/part-*.parquet"))))
    return units


def tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def compare_trees(a: Path, b: Path) -> list[str]:
    """The files that differ between two output trees (or exist in one only)."""
    fa = {str(p.relative_to(a)) for p in a.rglob("*") if p.is_file()}
    fb = {str(p.relative_to(b)) for p in b.rglob("*") if p.is_file()}
    return sorted(fa ^ fb) + sorted(p for p in fa & fb
                                    if not filecmp.cmp(a / p, b / p, shallow=False))


def mix_driver(mix_input: Path, work: Path) -> dict[str, Any]:
    """The mix driver traced on ``mix_input`` (bench/bench_mix_driver.py's child: tasks in
    2 worker processes, tracemalloc on the driver): documents, heap peak, Arrow's peak,
    intermediate files."""
    figures = work / "mix_driver.json"
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "LMFORGE_TRACKING": "off"}
    subprocess.run([sys.executable, str(REPO / "bench" / "bench_mix_driver.py"), "--child",
                    str(mix_input), str(work / "mix_driver_out"), str(figures)],
                   env=env, check=True, stderr=subprocess.DEVNULL)
    shutil.rmtree(work / "mix_driver_out", ignore_errors=True)
    return json.loads(figures.read_text())


def driver_rates(ingested: Path, out: Path) -> dict[str, Any]:
    """What the serial driver steps do on one core, on their own: ingest's old loop (every
    row of every file read back, ids checked against those seen, written into parts; best
    of 2) over ``ingested`` while the code has it, and dedup's exact grouping + union-find
    on 4 M synthetic documents (the recipe of the dedup module's docstring)."""
    import numpy as np

    from lmforge.data import dedup

    rates: dict[str, Any] = ingest_driver_rate(ingested, out)
    n = 4_000_000
    rng = np.random.default_rng(0)
    keys = rng.integers(0, 2**63, (n, 2), dtype=np.uint64)
    keys[1::5] = keys[::5][: len(keys[1::5])]
    edges = rng.integers(0, n, (n // 10, 2))
    t = time.perf_counter()
    parent = dedup.exact_groups(keys)
    dedup.union(parent, edges[:, 0], edges[:, 1])
    dedup.compress(parent)
    rates["dedup_driver_ns_per_doc"] = round((time.perf_counter() - t) / n * 1e9, 1)
    return rates


def ingest_driver_rate(ingested: Path, out: Path) -> dict[str, Any]:
    """Ingest's old driver loop alone (best of 2), or nothing once ingest has no such loop."""
    import pyarrow as pa

    from lmforge.data import ingest
    from lmforge.data.records import PartWriter, iter_batches

    if not hasattr(ingest, "drop_duplicate_ids"):
        return {}
    files = sorted(ingested.glob("part-*.parquet"))
    best = float("inf")
    for _ in range(2):
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        seen: set[str] = set()
        t = time.perf_counter()
        parts = PartWriter(out, 500)
        for f in files:
            for batch in iter_batches(f):
                parts.add(ingest.drop_duplicate_ids(pa.Table.from_batches([batch]), seen)[0])
        parts.close()
        best = min(best, time.perf_counter() - t)
    shutil.rmtree(out, ignore_errors=True)
    return {"ingest_driver_s": round(best, 3), "ingest_driver_docs": len(seen)}


def load() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--copies", type=int, default=10)
    ap.add_argument("--mid", type=int, default=10,
                    help="a scale between x1 and x--copies also run (skipped if not between): "
                         "what grows per document is taken from it to the largest, past "
                         "the fixed blocks a small corpus does not fill")
    ap.add_argument("--rounds", type=int, default=2,
                    help="runs of each (corpus, executor), interleaved local-ray-ray-local...; "
                         "the best wall time and the largest memory are reported")
    ap.add_argument("--work", type=Path, default=Path("/tmp/lmforge_scale"))
    ap.add_argument("--out", type=Path)
    ap.add_argument("--keep", action="store_true", help="keep the runs' output trees")
    ap.add_argument("--baseline", metavar="REV",
                    help="also run the Ray executor on src/ of git revision REV (kinds "
                         "ray@base, ray-traced@base): ratios against it, outputs compared")
    ap.add_argument("--child", nargs=4, metavar=("KIND", "CORPUS", "ROOT", "OUT"),
                    help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        kind, corpus, root, out = args.child
        run_child(kind, Path(corpus), Path(root), Path(out))
        return

    work, n = args.work.resolve(), args.copies
    started, load_start = time.perf_counter(), load()
    t = time.perf_counter()
    scales = (1, args.mid, n) if 1 < args.mid < n else (1, n)
    corpora = {s: make_corpus(work / f"corpus_x{s}", s) if s > 1 else DEMO for s in scales}
    print(f"corpora x{scales}: {work} ({time.perf_counter() - t:.0f} s)", flush=True)
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("LMFORGE_EXECUTOR", None)
    env.pop("RAY_ADDRESS", None)  # the run starts its own 2-CPU Ray
    if not TOKENIZER.is_file():
        env[ENV_TOKENIZER] = str(work / "tokenizer" / TOKENIZER.name)
    kinds, traced = list(KINDS), [TRACED]
    envs = {k: env for k in (*KINDS, TRACED)}
    if args.baseline:
        base = checkout_src(args.baseline, work / "base")
        for k in ("ray", TRACED):
            envs[f"{k}@base"] = {**env, "PYTHONPATH": str(base)}
        kinds.append("ray@base")
        traced.append(f"{TRACED}@base")
    runs: dict[int, dict[str, list]] = {s: {k: [] for k in kinds + traced} for s in scales}
    for scale in scales:
        for r in range(args.rounds):
            for kind in (kinds if r % 2 == 0 else kinds[::-1]) + (traced if r == 0 else []):
                root = work / f"x{scale}" / kind / f"r{r}"
                shutil.rmtree(root, ignore_errors=True)
                root.mkdir(parents=True)
                t = time.perf_counter()
                with open(root / "log.txt", "w") as log:
                    subprocess.run([sys.executable, __file__, "--child", kind.split("@")[0],
                                    str(corpora[scale]), str(root), str(root / "figures.json")],
                                   env=envs[kind], stdout=log, stderr=log, check=True)
                runs[scale][kind].append(json.loads((root / "figures.json").read_text()))
                walls = " ".join(f"{s} {runs[scale][kind][-1]['stages'][s]['wall_s']:.1f}"
                                 for s in STAGES)
                print(f"x{scale} {kind} round {r}: {time.perf_counter() - t:.0f} s ({walls}); "
                      f"load {load()}", flush=True)

    ref = {s: work / f"x{s}" / "local" / "r0" / "data" for s in scales}
    inputs = {s: {st: text_size(corpora[s] if st == "ingest" else ref[s] / src, st)
                  for st, src in zip(STAGES, ("", *OUTPUTS[:-1]), strict=True)} for s in scales}
    differ = {s: {f"{k}/r{r}": compare_trees(ref[s], work / f"x{s}" / k / f"r{r}" / "data")
                  for k, rounds in runs[s].items() for r in range(len(rounds))
                  if (k, r) != ("local", 0)}
              for s in scales}
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    clusters = pq.read_table(ref[n] / "deduped" / "clusters.parquet", columns=["id", "domain"])
    report = {
        "copies": n, "scales": scales, "cores": CORES, "rounds": args.rounds, "baseline": args.baseline, "load_start": load_start,
        "load_end": load(), "runs": runs,
        "inputs": {s: dict(v) for s, v in inputs.items()},
        "outputs_bytes": {s: {st: tree_bytes(ref[s] / o) for st, o in zip(STAGES, OUTPUTS,
                                                                           strict=True)}
                          for s in scales},
        "files": {s: sum(1 for p in ref[s].rglob("*") if p.is_file()) for s in scales},
        "task_units": {s: task_units(corpora[s], ref[s]) for s in scales},
        "input_gz_bytes": {s: sum(f.stat().st_size for f in corpora[s].glob("*/*.jsonl.gz"))
                           for s in scales},
        "differ": differ,
        "mix_driver": {s: mix_driver(ref[s] / "decontam", work) for s in scales},
        "driver_rates": driver_rates(ref[n] / "ingested", work / "driver_probe"),
        "dedup_id_domain_bytes_per_doc": round(
            sum(pc.sum(pc.binary_length(clusters.column(c))).as_py() + 4 * len(clusters)
                for c in ("id", "domain")) / len(clusters), 1),
    }
    report["seconds"] = round(time.perf_counter() - started, 1)
    print_report(report, n)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    if not args.keep:
        for scale in scales:
            shutil.rmtree(work / f"x{scale}", ignore_errors=True)


def print_driver(r: dict[str, Any], n: int) -> None:
    """The driver's memory per stage at x1 and xN, and what it adds per document: the
    stages whose driver is O(documents) show a slope that does not fall with N."""
    runs, inputs = r["runs"], r["inputs"]
    measures = [(k, "driver_growth_kib", "RSS") for k in runs[n] if "traced" not in k]
    measures += [(k, key, name) for k in runs[n] if "traced" in k
                 for key, name in (("driver_heap_growth_kib", "py heap"),
                                   ("driver_arrow_growth_kib", "arrow"))]
    print(f"\ndriver memory per stage, MiB at x1 -> x{n}, and B/doc = (x{n} - x1) / (docs "
          f"x{n} - docs x1): RSS = peak VmHWM less VmRSS at the stage's start (allocator reuse "
          "hides some); py heap = tracemalloc's peak (Python + numpy), arrow = Arrow's pool, "
          "in the traced run")
    print(f"{'stage':8s} " + " | ".join(f"{f'{k} {name}':>24s}" for k, _, name in measures))
    for stage in STAGES:
        d1, dn = inputs[1][stage][0], inputs[n][stage][0]
        cells = []
        for kind, key, _ in measures:
            a = max(f["stages"][stage].get(key, 0) for f in runs[1][kind]) / 1024
            b = max(f["stages"][stage].get(key, 0) for f in runs[n][kind]) / 1024
            per_doc = (b - a) * 2**20 / max(dn - d1, 1)
            cells.append(f"{a:6.1f} {b:6.1f} {per_doc:6.0f} B/d")
        print(f"{stage:8s} " + " | ".join(f"{c:>24s}" for c in cells))


def print_report(r: dict[str, Any], n: int) -> None:
    runs, inputs = r["runs"], r["inputs"]

    def best(scale: int, kind: str, stage: str | None = None) -> float:
        """Best (smallest) wall seconds of a stage, or of the sum of all stages, over rounds."""
        rounds = runs[scale][kind]
        if stage:
            return min(f["stages"][stage]["wall_s"] for f in rounds)
        return min(sum(s["wall_s"] for s in f["stages"].values()) for f in rounds)

    def peak(scale: int, kind: str, stage: str, key: str) -> float:
        return max(f["stages"][stage][key] for f in runs[scale][kind]) / 1024

    startup = max(f["startup_s"] for f in runs[n]["ray"])
    based = "ray@base" in runs[n]
    print(f"\nwall seconds, {CORES} CPUs, best of {r['rounds']} interleaved rounds (load average "
          f"{r['load_start']} -> {r['load_end']}; Ray start-up up to {startup} s, not counted)")
    print(f"{'stage':8s} {'x1 local':>9s} {'x1 ray':>8s} {'ray/local':>9s} "
          f"{f'x{n} local':>9s} {f'x{n} ray':>8s} {'ray/local':>9s}"
          + (f" {f'x{n} base':>9s} {'ray/base':>8s}" if based else ""))
    for stage in (*STAGES, None):
        a, b = best(1, "local", stage), best(1, "ray", stage)
        c, d = best(n, "local", stage), best(n, "ray", stage)
        e = best(n, "ray@base", stage) if based else 0.0
        print(f"{stage or 'overall':8s} {a:9.1f} {b:8.1f} {a / b:9.2f} {c:9.1f} {d:8.1f} "
              f"{c / d:9.2f}" + (f" {e:9.1f} {e / d:8.2f}" if based else ""))
    print(f"ray/local: local seconds / ray seconds, i.e. Ray's throughput against the pool's "
          f"(target >= 0.8 at x{n})" + ("; ray/base: the baseline revision's Ray seconds / "
                                        f"this tree's ({r['baseline']})" if based else "")
          + ". Overall per round:")
    for scale in (1, n):
        for kind in runs[scale]:
            walls = [sum(s["wall_s"] for s in f["stages"].values()) for f in runs[scale][kind]]
            print(f"  x{scale} {kind}: " + " ".join(f"{w:.1f}" for w in walls))

    print(f"\npeak memory per worker, MiB (largest over the stage's workers and the rounds), "
          f"x1 -> x{n}")
    print(f"{'stage':8s} {'VmHWM':>7s} {'local':>5s} {'':>5s} {'ratio':>5s} {'ray':>5s} "
          f"{'':>5s} {'ratio':>5s} | {'grow':>4s} {'local':>5s} {'':>5s} {'ratio':>5s} "
          f"{'ray':>5s} {'':>5s} {'ratio':>5s} | {'largest input MB':>16s}")
    for stage in STAGES:
        cells = []
        for key in ("worker_peak_kib", "worker_growth_kib"):
            for kind in KINDS:
                a, b = peak(1, kind, stage, key), peak(n, kind, stage, key)
                cells.append(f"{a:5.0f} {b:5.0f} {b / a:5.2f}")
        big = inputs[1][stage][2] / 1e6, inputs[n][stage][2] / 1e6
        print(f"{stage:8s} {'':7s} {cells[0]} {cells[1]} | {'':4s} {cells[2]} {cells[3]} | "
              f"{big[0]:7.1f} {big[1]:8.1f}")
    print("(VmHWM: the kernel's peak RSS; grow: peak RssAnon less that at the fork / stage start."
          " A task's memory follows the largest file or part it is given, not the corpus)")
    print_driver(r, n)

    print(f"\nper-core throughput at x{n}, local pool of {CORES} (input text of each stage; "
          "best round), and what crosses the executor (pickled tasks + results)")
    print(f"{'stage':8s} {'docs in':>8s} {'MB in':>7s} {'MB/s/core':>9s} {'docs/s/core':>11s} "
          f"{'MB out':>7s} {'tasks':>5s} {'task KB':>8s} {'result KB':>9s} {'B/doc':>6s}")
    for stage in STAGES:
        docs, size, _ = inputs[n][stage]
        st = runs[n]["local"][0]["stages"][stage]
        sec = best(n, "local", stage) * CORES
        moved = st["task_bytes"] + st["result_bytes"]
        print(f"{stage:8s} {docs:8d} {size / 1e6:7.1f} {size / 1e6 / sec:9.3f} "
              f"{docs / sec:11.1f} {r['outputs_bytes'][n][stage] / 1e6:7.1f} {st['tasks']:5d} "
              f"{st['task_bytes'] / 1e3:8.1f} {st['result_bytes'] / 1e3:9.1f} "
              f"{moved / max(docs, 1):6.1f}")
    d1 = runs[1]["local"][0]["stages"]["dedup"]["metrics"]
    dn = runs[n]["local"][0]["stages"]["dedup"]["metrics"]
    removed = dn["total"]["in"] - dn["total"]["kept"]
    print(f"\ndedup x{n}: {dn['total']['in']} in, {dn['total']['kept']} kept: removed {removed} "
          f"({removed / dn['total']['in']:.1%}): {dn['exact_dups']} exact + {dn['near_dups']} "
          f"near duplicates (x1: {d1['total']['in']} in, {d1['exact_dups']} exact + "
          f"{d1['near_dups']} near)")
    m1, m = r["mix_driver"][1], r["mix_driver"][n]
    grow = (m["peak_bytes"] - m1["peak_bytes"]) / (m["docs"] - m1["docs"])
    print(f"mix driver heap (traced peak, tasks in 2 worker processes): x1 "
          f"{m1['peak_bytes'] / 2**20:.1f} MiB ({m1['docs']} docs), x{n} "
          f"{m['peak_bytes'] / 2**20:.1f} MiB ({m['docs']} docs): {grow:.0f} B/doc added; "
          f"intermediate files x1 {m1['intermediate_files']}, x{n} {m['intermediate_files']}")
    dr = r["driver_rates"]
    mb = inputs[n]["ingest"][1] / 1e6
    if "ingest_driver_s" in dr:
        print(f"ingest driver alone (one core): {mb / dr['ingest_driver_s']:.0f} MB/s of text, "
              f"{dr['ingest_driver_docs'] / dr['ingest_driver_s']:.0f} docs/s (every row passes "
              f"through it), i.e. "
              f"{mb / dr['ingest_driver_s'] / (mb / best(n, 'local', 'ingest') / CORES):.1f} "
              "cores of ingest workers")
    print(f"dedup driver: ids + domains {r['dedup_id_domain_bytes_per_doc']} B/doc (Arrow), on "
          f"top of the module docstring's figures; exact grouping + union-find "
          f"{dr['dedup_driver_ns_per_doc']:.0f} ns/doc")
    for scale in (1, n):
        bad = {k: v for k, v in r["differ"][scale].items() if v}
        runs_compared = ", ".join(r["differ"][scale])
        print(f"x{scale} outputs ({r['files'][scale]} files, "
              f"{sum(r['outputs_bytes'][scale].values()) / 1e6:.1f} MB) vs local/r0: "
              + (f"byte-identical ({runs_compared})" if not bad else f"DIFFER: {bad}"))
    print(f"bench: {r['seconds']:.0f} s in all")


if __name__ == "__main__":
    main()
