"""One data stage alone, this tree's ``src/`` against a baseline revision's, interleaved.

The stage runs on the x10 corpus that ``bench/bench_data_scale.py`` builds under ``--work``
(ingest reads it; shards reads ``--mixed``, a mixed/ folder, with ``--tokenizer``; mix and
dedup read ``--input``), with
params.yaml's settings and 2 workers, each run in a fresh process, alternating old/new
(then new/old) for ``--rounds`` rounds. Printed per run and summed up: wall seconds and the
CPU seconds of the run's process tree (the driver plus the local pool's workers; on Ray
the driver alone, as Ray's workers are not its children), and new/old ratios of the
minimum and the median. Meant for a change that should not cost throughput, on shared
cores where a whole-pipeline run is too noisy.

    .venv/bin/python bench/bench_stage_ab.py ingest --baseline REV [--kind local|ray]
        [--rounds 4] [--work /tmp/lmforge_scale] [--mixed DIR --tokenizer FILE] [--input DIR]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _common import REPO
from bench_data_scale import checkout_src


def cpu_seconds() -> float:
    """User + system seconds of this process and the children it has waited for."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def worker_pid() -> int:
    """A Ray warm-up task."""
    return os.getpid()


def run_once(args: argparse.Namespace, out: Path) -> None:
    """Run the stage once (a child process) and print ``RESULT wall cpu``."""
    from lmforge.config import ExecutorConfig, SourceConfig, load_params
    from lmforge.executor import LocalExecutor, RayExecutor

    p = load_params(REPO / "params.yaml")
    shutil.rmtree(out, ignore_errors=True)
    if args.kind == "ray":
        import ray

        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
        warm = ray.remote(num_cpus=1)(worker_pid)
        ray.get([warm.remote() for _ in range(4)])  # the workers exist before the clock starts
        executor = RayExecutor(ExecutorConfig("ray"))
    else:
        executor = LocalExecutor(2)
    c0, t0 = cpu_seconds(), time.perf_counter()
    if args.stage == "ingest":
        from lmforge.data.ingest import run_ingest

        corpus = args.work / "corpus_x10"
        p.ingest.sources = [SourceConfig(path=str(corpus / s.domain / "*.jsonl.gz"),
                                         domain=s.domain) for s in p.ingest.sources]
        run_ingest(p.ingest, out, executor)
    elif args.stage == "mix":
        from lmforge.data.mix import run_mix

        run_mix(p.mix, args.input, out, executor)
    elif args.stage == "dedup":
        from lmforge.data.dedup import run_dedup

        run_dedup(p.dedup, args.input, out, executor)
    else:
        from lmforge.shards.build import build_shards

        build_shards(args.mixed, args.tokenizer, out, p.shards, executor)
    print(f"RESULT {time.perf_counter() - t0:.3f} {cpu_seconds() - c0:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("stage", choices=["ingest", "dedup", "mix", "shards"])
    ap.add_argument("--baseline", required=True, metavar="REV")
    ap.add_argument("--kind", choices=["local", "ray"], default="local")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--work", type=Path, default=Path("/tmp/lmforge_scale"))
    ap.add_argument("--mixed", type=Path, help="shards: the mixed/ folder to encode")
    ap.add_argument("--tokenizer", type=Path, help="shards: the tokenizer model")
    ap.add_argument("--input", type=Path,
                    help="mix: its input folder (parts and clusters.parquet), e.g. "
                         "bench/bench_mix_driver.py's x30 one; dedup: a filtered folder, "
                         "e.g. bench/bench_dedup_driver.py's x30 one")
    ap.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        run_once(args, args.child)
        return
    code = {"old": checkout_src(args.baseline, args.work / "ab_base"), "new": REPO / "src"}
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in code}
    for r in range(args.rounds):
        for k in ("old", "new") if r % 2 == 0 else ("new", "old"):
            env = {**os.environ, "PYTHONPATH": str(code[k]), "RAY_USAGE_STATS_ENABLED": "0"}
            proc = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--child",
                                   str(args.work / f"ab_{args.stage}_{k}")],
                                  capture_output=True, text=True, env=env, check=True)
            line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
            wall, cpu = map(float, line.split()[1:])
            times[k].append((wall, cpu))
            print(f"round {r} {k}: wall {wall:.2f} s, cpu {cpu:.2f} s, load "
                  f"{os.getloadavg()[0]:.1f}", flush=True)
    for i, name in ((0, "wall"), (1, "cpu")):
        old, new = ([t[i] for t in times[k]] for k in ("old", "new"))
        print(f"{args.stage} {args.kind} {name}: old min {min(old):.2f} median "
              f"{statistics.median(old):.2f}, new min {min(new):.2f} median "
              f"{statistics.median(new):.2f}; new/old min {min(new) / min(old):.2f}, median "
              f"{statistics.median(new) / statistics.median(old):.2f}")


if __name__ == "__main__":
    main()
