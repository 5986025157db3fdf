"""Every data stage on a three-node Ray cluster, against the local pool, byte for byte.

The demo corpus x10 (``bench_data_scale.make_corpus``: copy 0 as shipped, then exact,
near and far copies with new ids) goes through ingest, filter, dedup, decontam, mix and
shards three times, each run in a fresh process (``bench_data_scale.py --child``):

* ``local``: the process pool of 2 (the reference bytes);
* ``ray3``: a head and two worker nodes of one CPU each (``ray.cluster_utils.Cluster``,
  Ray's own multi-node harness, on this machine), every task leaving a mark of the node
  it ran on and its function;
* ``ray3-kill``: the same, and the first worker node is removed (its raylet and workers
  killed) the first time it runs a filter task. Ray reruns the lost tasks on the nodes
  left (``executor.max_retries``); a stage that still fails is rerun, as a user reruns
  ``dvc repro``, and resumes where it was.

Printed (and written with ``--out``): each stage's wall seconds per run, the nodes each
task function ran on, the stage reruns, and whether every output file equals the local
run's.

    python bench/bench_ray_cluster.py [--copies 10] [--work /tmp/lmforge_ray3] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
if str(BENCH) not in sys.path:  # its sibling benches, when loaded by path (demo_docs.py)
    sys.path.insert(0, str(BENCH))

from bench_data_scale import (  # noqa: E402
    CLUSTER_NODES,
    ENV_TOKENIZER,
    REPO,
    STAGES,
    TOKENIZER,
    compare_trees,
    make_corpus,
)

KINDS = ("local", "ray3", "ray3-kill")
def run(kind: str, corpus: Path, root: Path) -> dict[str, Any]:
    """One child run of the six stages (bench_data_scale.py's), its figures."""
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(BENCH)]),
           "RAY_USAGE_STATS_ENABLED": "0", "LMFORGE_TRACKING": "off"}
    env.pop("LMFORGE_EXECUTOR", None)
    env.pop("RAY_ADDRESS", None)
    if not TOKENIZER.is_file():
        env[ENV_TOKENIZER] = str(root.parent / "tokenizer" / TOKENIZER.name)
    with open(root / "log.txt", "w") as log:
        subprocess.run([sys.executable, str(BENCH / "bench_data_scale.py"), "--child", kind,
                        str(corpus), str(root), str(root / "figures.json")], env=env,
                       stdout=log, stderr=log, check=True)
    return json.loads((root / "figures.json").read_text())


def markdown(found: dict[str, Any]) -> str:
    """The committed run's table (bench/RESULTS.md, block ``ray_cluster``)."""
    runs = found["runs"]
    lines = ["| stage | local pool, s | 3 nodes, s | 3 nodes, a node killed, s | stage "
             "reruns | task functions: nodes they ran on (3 nodes / killed run) | "
             "outputs as local's |", "|---|---:|---:|---:|---:|---|---|"]
    for stage in STAGES:
        on, killed = runs["ray3"]["ran_on"][stage], runs["ray3-kill"]["ran_on"][stage]
        fns = [f"`{fn}` {n} / {killed.get(fn, 0)}" for fn, n in on.items()]
        same = all(not found["differ"][k][stage] for k in ("ray3", "ray3-kill"))
        lines.append(f"| {stage} | {runs['local']['stages'][stage]['wall_s']:.1f} | "
                     f"{runs['ray3']['stages'][stage]['wall_s']:.1f} | "
                     f"{runs['ray3-kill']['stages'][stage]['wall_s']:.1f} | "
                     f"{runs['ray3-kill']['stages'][stage].get('reruns', 0)} | "
                     f"{', '.join(fns)} | {'identical' if same else 'DIFFER'} |")
    killed = runs["ray3-kill"].get("killed_node")
    lines += ["", f"x{found['copies']} corpus, {found['docs']:,} documents, "
              f"{found['files']} output files; the worker node was "
              f"{'removed' if killed else 'NOT removed'} in the killed run."]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--copies", type=int, default=10)
    ap.add_argument("--work", type=Path, default=Path("/tmp/lmforge_ray3"))
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    work = args.work.resolve()
    corpus = make_corpus(work / f"corpus_x{args.copies}", args.copies)
    runs, t = {}, time.perf_counter()
    for kind in KINDS:
        runs[kind] = run(kind, corpus, work / kind)
        print(f"{kind}: " + " ".join(f"{s} {runs[kind]['stages'][s]['wall_s']:.1f}"
                                     for s in STAGES), flush=True)
    ref = work / "local" / "data"
    outputs = dict(zip(STAGES, ("ingested", "filtered", "deduped", "decontam", "mixed",
                                "shards"), strict=True))
    differ = {k: {s: compare_trees(ref / o, work / k / "data" / o) for s, o in outputs.items()}
              for k in KINDS[1:]}
    found = {"copies": args.copies, "nodes": CLUSTER_NODES, "runs": runs, "differ": differ,
             "docs": runs["local"]["stages"]["ingest"]["metrics"]["total"]["in"],
             "files": sum(1 for p in ref.rglob("*") if p.is_file()),
             "seconds": round(time.perf_counter() - t, 1)}
    print(markdown(found))
    if args.out:
        args.out.write_text(json.dumps(found, indent=1) + "\n")


if __name__ == "__main__":
    main()
