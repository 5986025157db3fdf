"""Mix's driver at scale: its memory per document and the intermediate files it makes.

The input is the demo's mix input (``data/decontam``, parts and clusters.parquet) repeated
x1, x10 and x30 with new ids (``#k`` appended to every id and cluster name of copy k, so
the copies are separate documents and clusters). Each (scale, revision) runs ``run_mix``
in a fresh process with params.yaml's mix settings, its tasks on a pool of 2 worker
processes (never in the driver), the driver under tracemalloc: its Python and numpy heap
at the peak, and Arrow's pool at its peak (tracemalloc cannot see it). Printed: the peak
per scale and what it adds per document between x1 and the larger scales (the growth:
fixed costs such as imports cancel out), the intermediate files (counted when the first
gather task starts: every scatter and planning file exists then), the wall time, and
whether the output is byte-identical to the baseline revision's.

    python bench/bench_mix_driver.py [--scales 1,10,30] [--baseline REV] [--input DIR]
        [--out FILE]
"""

from __future__ import annotations

import argparse
import filecmp
import json
import math
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def replicate(src: Path, dst: Path, copies: int) -> int:
    """``copies`` copies of a mix input with new ids; returns the documents."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir(parents=True)
    parts = sorted(src.glob("part-*.parquet"))
    docs, k_out = 0, 0

    def renamed(table: pa.Table, column: str, k: int) -> pa.Table:
        if k == 0:
            return table
        values = pc.binary_join_element_wise(table.column(column), pa.scalar(f"#{k}"), "")
        return table.set_column(table.schema.get_field_index(column), column, values)

    for k in range(copies):
        for part in parts:
            table = renamed(pq.read_table(part), "id", k)
            pq.write_table(table, dst / f"part-{k_out:05d}.parquet", compression="zstd")
            docs += table.num_rows
            k_out += 1
    clusters = pq.read_table(src / "clusters.parquet")
    pq.write_table(pa.concat_tables(renamed(renamed(clusters, "id", k), "cluster", k)
                                    for k in range(copies)), dst / "clusters.parquet")
    return docs


def _untraced() -> None:
    """A forked worker stops the tracing it inherited (it would run several times slower)."""
    import tracemalloc

    tracemalloc.stop()


def pooled_executor() -> Any:
    """An executor whose every task runs in one of 2 worker processes, untraced."""
    from lmforge.executor import Executor

    class Pooled(Executor):
        name, workers = "pool", 2

        def _run(self, fn, tasks):
            with mp.get_context("fork").Pool(2, initializer=_untraced) as pool:
                yield from pool.imap(fn, tasks, chunksize=1)

    return Pooled()


def child(src: Path, out: Path, figures: Path) -> None:
    """One traced run of mix (in a fresh process)."""
    import tracemalloc

    import pyarrow as pa

    from lmforge.config import load_params
    from lmforge.data import mix

    cfg = load_params(REPO / "params.yaml").mix
    executor = pooled_executor()
    counted: dict[str, int] = {}
    partial = out.with_name(f".{out.name}.partial")
    plain_map = executor.map

    def map_counting(fn, tasks, desc=None, log=None):
        if fn.__name__ in ("gather_group", "gather_part") and "files" not in counted:
            counted["files"] = sum(1 for p in partial.rglob("*") if p.is_file()
                                   and p.parent != partial  # the stamp
                                   and p.parent.name not in (".done", "train", "val")
                                   and p.parent.parent.name != ".done")
        return plain_map(fn, tasks, desc, log)

    executor.map = map_counting
    tracemalloc.start()
    t = time.perf_counter()
    metrics = mix.run_mix(cfg, src, out, executor)
    wall = time.perf_counter() - t
    peak = tracemalloc.get_traced_memory()[1]
    docs = sum(d["in"] for d in metrics["domains"].values())
    figures.write_text(json.dumps({
        "docs": docs, "rows": metrics["train_docs"] + metrics["val_docs"], "peak_bytes": peak,
        "arrow_peak_bytes": pa.default_memory_pool().max_memory(), "wall_s": round(wall, 2),
        "intermediate_files": counted.get("files")}))


def code_label() -> str:
    """The checkout's commit, with ``+`` when src/ has changes not committed."""
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True, check=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "src"],
                           capture_output=True, text=True, check=True).stdout.strip()
    return head + ("+" if dirty else "")


def same_tree(a: Path, b: Path) -> bool:
    fa = sorted(str(p.relative_to(a)) for p in a.rglob("*") if p.is_file())
    fb = sorted(str(p.relative_to(b)) for p in b.rglob("*") if p.is_file())
    return fa == fb and all(filecmp.cmp(a / p, b / p, shallow=False) for p in fa)


def growth_per_doc(r: dict[str, Any], first: dict[str, Any]) -> float | None:
    """What the driver adds per document from the smaller scale's run ``first`` to
    ``r``: its heap's peak plus Arrow's pool's peak (tracemalloc cannot see Arrow's).
    Taken from the scale before (x10 to x30), not from x1: a fixed block (a batch read
    at once, a row group) that x1 does not fill would look like growth."""
    if r["docs"] == first["docs"]:
        return None
    held = r["peak_bytes"] + r["arrow_peak_bytes"]
    return round((held - first["peak_bytes"] - first["arrow_peak_bytes"])
                 / (r["docs"] - first["docs"]), 1)


def report(results: dict[str, dict[int, dict]], scales: list[int]) -> None:
    """The table: per revision and scale, peak, growth per document, files, wall."""
    print(f"{'revision':<10} {'scale':>5} {'docs':>8} {'heap peak MiB':>13} "
          f"{'growth B/doc':>12} {'Arrow peak MiB':>14} {'files':>7} {'wall s':>7}")
    for rev, by_scale in results.items():
        for s in scales:
            r = by_scale[s]
            before = by_scale[scales[max(0, scales.index(s) - 1)]]
            r["growth_bytes_per_doc"] = grow = growth_per_doc(r, before)
            print(f"{rev:<10} x{s:<4} {r['docs']:>8} {r['peak_bytes'] / 2**20:>13.1f} "
                  f"{grow if grow is not None else float('nan'):>12.1f} "
                  f"{r['arrow_peak_bytes'] / 2**20:>14.1f} "
                  f"{r['intermediate_files']!s:>7} {r['wall_s']:>7.1f}")


# The 1 TB projection's assumptions, as bench/RESULTS.md's "Projection: 1 TB of raw text":
TB_CHARS = 1e12  # characters of text (about bytes: mostly ASCII)
TB_DOCS = 1.18e8  # at the demo's 8.5 KB a document
PARQUET_PER_TEXT = 0.38  # zstd Parquet bytes per byte of text, measured at x10
CLUSTER_ROW_GROUP = 1 << 20  # clusters.parquet rows a row group (pyarrow's default)


def projection() -> dict[str, float]:
    """Mix's intermediate files and their row-group reads at 1 TB, from the modules'
    budgets: key files (measure runs), cluster, join and rank files, scatter files (two
    splits); reads: every join reads its bucket from each key and cluster file, every
    rank its range from each join file, every gather its group from each scatter file."""
    from lmforge.data.mix_measure import RUN_BYTES
    from lmforge.data.mix_ranks import MAX_BUCKETS
    from lmforge.data.mix_shuffle import SHUFFLE_CHARS

    runs = math.ceil(TB_CHARS * PARQUET_PER_TEXT / RUN_BYTES)
    names = math.ceil(TB_DOCS / CLUSTER_ROW_GROUP)
    buckets = min(MAX_BUCKETS, runs)
    scatter = math.ceil(TB_CHARS / SHUFFLE_CHARS)
    files = runs + names + 2 * buckets + 2 * scatter
    reads = buckets * (runs + names) + buckets * buckets + scatter * scatter
    return {"files": files, "reads": reads, "scatter_tasks": scatter, "measure_runs": runs,
            "buckets": buckets}


def _at_scale(by_scale: dict, s: int) -> dict[str, Any]:
    """A scale's figures, keyed by int (a fresh run) or str (read back from JSON)."""
    return by_scale[str(s)] if str(s) in by_scale else by_scale[s]


def table_lines(results: dict[str, dict], scales: list[int]) -> list[str]:
    """A driver bench's table: per revision and scale, heap peak, Arrow peak, growth per
    document (both), intermediate files, wall (bench_dedup_driver.py's too)."""
    lines = ["| code | scale | documents | driver heap at peak | added per document since "
             "the scale before (heap + Arrow) | Arrow pool peak | intermediate files | wall |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for rev, by_scale in results.items():
        for s in scales:
            r = _at_scale(by_scale, s)
            grow = growth_per_doc(r, _at_scale(by_scale, scales[max(0, scales.index(s) - 1)]))
            lines.append(f"| {rev} | x{s} | {r['docs']:,} | {r['peak_bytes'] / 2**20:.1f} MiB | "
                         + (f"{grow:,.0f} B" if grow is not None else "-")
                         + f" | {r['arrow_peak_bytes'] / 2**20:.1f} MiB | "
                         f"{r['intermediate_files']:,} | {r['wall_s']:.1f} s |")
    return lines


def identical_lines(found: dict[str, Any]) -> list[str]:
    """The line saying whether each scale's output equals the baseline's (none without)."""
    same = found.get("identical_to_baseline") or {}
    return (["Outputs byte-identical to the baseline's: "
             + ", ".join(f"x{s} {'yes' if v else 'NO'}" for s, v in same.items()) + "."]
            if same else [])


def markdown(found: dict[str, Any]) -> str:
    """The committed run's table (bench/RESULTS.md, block ``mix_driver``), and what its
    growth per document comes to at 1 TB."""
    scales, results = found["scales"], found["results"]
    lines = table_lines(results, scales)
    per_doc = {rev: growth_per_doc(_at_scale(by, scales[-1]), _at_scale(by, scales[-2]))
               for rev, by in results.items()}
    tb = projection()
    lines += ["", f"At 1 TB ({TB_DOCS / 1e8:.2f} × 10⁸ documents): the driver adds "
              + ", ".join(f"{v * TB_DOCS / 1e9:.1f} GB ({rev})" for rev, v in per_doc.items())
              + f"; intermediate files {tb['files']:,} ({tb['measure_runs']:,} key files, "
              f"{tb['scatter_tasks']:,} scatter tasks x 2 splits, {tb['buckets']} buckets x 2), "
              f"read {tb['reads']:,} times as Parquet row groups."]
    return "\n".join(lines + identical_lines(found))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scales", default="1,10,30")
    ap.add_argument("--baseline", metavar="REV", help="also run src/ of git revision REV")
    ap.add_argument("--input", type=Path, default=REPO / "data" / "decontam",
                    help="the mix input to repeat (the demo's, after `make demo`)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/lmforge_mix_driver"))
    ap.add_argument("--out", type=Path)
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(*(Path(a) for a in args.child))
        return
    source = args.input
    if not (source / "clusters.parquet").is_file():
        sys.exit(f"{source}: no mix input; run `dvc repro decontam` (or `make demo`) first")
    scales = [int(s) for s in args.scales.split(",")]
    work = args.work.resolve()
    srcs = {code_label(): REPO / "src"}
    if args.baseline:
        from _common import checkout_src  # bench/ is on the path when this runs as a script

        srcs[args.baseline] = checkout_src(args.baseline, work / "base")
    results: dict[str, dict[int, dict]] = {rev: {} for rev in srcs}
    identical: dict[int, bool] = {}
    for s in scales:
        docs = replicate(source, work / f"in_x{s}", s)
        print(f"x{s}: {docs} documents", flush=True)
        for rev, src in srcs.items():
            out = work / f"out_x{s}_{len(results[rev])}_{rev.replace('/', '_')}"
            shutil.rmtree(out, ignore_errors=True)
            env = {**os.environ, "PYTHONPATH": str(src), "LMFORGE_TRACKING": "off"}
            subprocess.run([sys.executable, __file__, "--child", str(work / f"in_x{s}"),
                            str(out), str(work / "figures.json")], env=env, check=True,
                           stderr=subprocess.DEVNULL)
            results[rev][s] = json.loads((work / "figures.json").read_text())
            results[rev][s]["out"] = str(out)
        if args.baseline:
            identical[s] = same_tree(Path(results[next(iter(srcs))][s]["out"]),
                                     Path(results[args.baseline][s]["out"]))
    report(results, scales)
    if identical:
        print("outputs byte-identical to the baseline's: "
              + ", ".join(f"x{s} {'yes' if v else 'NO'}" for s, v in identical.items()))
    if args.out:
        args.out.write_text(json.dumps({"scales": scales, "results": results,
                                        "identical_to_baseline": identical}, indent=1) + "\n")


if __name__ == "__main__":
    main()
