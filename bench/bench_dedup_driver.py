"""Dedup's driver at scale: its memory per document and the intermediate files it makes.

The input is the demo corpus x1, x10 and x30 as bench_data_scale.py builds it (copy 0 as
shipped; of the other copies 15 % exact, 70 % near and 15 % far variants, new ids), taken
through ingest and filter with params.yaml's settings (once per scale, kept under
``--work``). Each (scale, revision) runs ``run_dedup`` in a fresh process with params.yaml's
dedup settings, its tasks on a pool of 2 worker processes (never in the driver), the
driver under tracemalloc (its Python and numpy heap at the peak) and Arrow's pool at its
peak. Printed as bench_mix_driver.py prints mix's: the peak per scale, what it adds per
document between x1 and the larger scales, the intermediate files (counted when the first
write task starts), the wall time, and whether the output is byte-identical to the
baseline revision's.

    python bench/bench_dedup_driver.py [--scales 1,10,30] [--baseline REV] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
if str(BENCH) not in sys.path:  # its sibling benches, when loaded by path (demo_docs.py)
    sys.path.insert(0, str(BENCH))

from bench_data_scale import make_corpus  # noqa: E402
from bench_mix_driver import (  # noqa: E402
    TB_DOCS,
    code_label,
    growth_per_doc,
    identical_lines,
    pooled_executor,
    report,
    same_tree,
    table_lines,
)

REPO = BENCH.parent
PARQUET_PER_TEXT = 0.38  # as bench_mix_driver.py: zstd Parquet bytes per byte of text
TB_PARTS = math.ceil(1e12 * PARQUET_PER_TEXT / (64 << 20))  # parts of ~64 MB at 1 TB
# The driver writes clusters.parquet a row group at a time: it holds up to 1Mi rows, a
# fixed ~100-170 MB that at x30 (87k rows) is the whole file and so looks like growth
# per document. One more run of this checkout's code with row groups of this many rows
# measures what grows with the corpus alone (its output is not compared: other row groups).
SMALL_ROW_GROUP = 4096
ENV_ROW_GROUP = "LMFORGE_BENCH_CLUSTER_ROW_GROUP"


def dedup_input(work: Path, scale: int) -> Path:
    """The filtered corpus at ``scale`` (ingest and filter run once, then kept)."""
    from lmforge.config import SourceConfig, load_params
    from lmforge.data.filtering import run_filter
    from lmforge.data.ingest import run_ingest
    from lmforge.executor import LocalExecutor

    out = work / f"in_x{scale}"
    stamp = work / f".in_x{scale}.done"
    if stamp.is_file() and out.is_dir():
        return out
    corpus = make_corpus(work / f"corpus_x{scale}", scale)
    params = load_params(REPO / "params.yaml")
    params.ingest.sources = [SourceConfig(path=str(corpus / s.domain / "*.jsonl.gz"),
                                          domain=s.domain) for s in params.ingest.sources]
    ingested = work / f"ingested_x{scale}"
    for path in (ingested, out):
        shutil.rmtree(path, ignore_errors=True)
    executor = LocalExecutor(2)
    cwd = Path.cwd()
    os.chdir(work)  # ingest writes its metrics beside its relative paths
    try:
        run_ingest(params.ingest, str(ingested), executor)
        run_filter(params.filter, str(ingested), str(out), {}, executor)
    finally:
        os.chdir(cwd)
    stamp.write_text("done")
    return out


def child(src: Path, out: Path, figures: Path) -> None:
    """One traced run of dedup (in a fresh process)."""
    import tracemalloc

    import pyarrow as pa

    from lmforge.config import load_params
    from lmforge.data import dedup

    cfg = load_params(REPO / "params.yaml").dedup
    small = os.environ.get(ENV_ROW_GROUP)
    if small:  # the memory run: clusters.parquet's row-group buffer far below the corpus
        dedup.CLUSTER_ROW_GROUP = int(small)
    executor = pooled_executor()
    counted: dict[str, int] = {}
    partial = out.with_name(f".{out.name}.partial")
    plain_map = executor.map

    def map_counting(fn, tasks, desc=None, log=None):
        if fn.__name__ == "write_part" and "files" not in counted:
            counted["files"] = sum(1 for p in partial.rglob("*") if p.is_file()
                                   and p.parent != partial  # the stamp
                                   and ".done" not in p.relative_to(partial).parts)
        return plain_map(fn, tasks, desc, log)

    executor.map = map_counting
    tracemalloc.start()
    t = time.perf_counter()
    metrics = dedup.run_dedup(cfg, src, out, executor)
    wall = time.perf_counter() - t
    peak = tracemalloc.get_traced_memory()[1]
    figures.write_text(json.dumps({
        "docs": metrics["total"]["in"], "kept": metrics["total"]["kept"],
        "peak_bytes": peak, "arrow_peak_bytes": pa.default_memory_pool().max_memory(),
        "wall_s": round(wall, 2), "intermediate_files": counted.get("files"),
        "parts": metrics["parts"]}))


def markdown(found: dict) -> str:
    """The committed run's table (bench/RESULTS.md, block ``dedup_driver``), and what its
    growth per document comes to at 1 TB."""
    scales, results = found["scales"], found["results"]
    rows = dict(results)
    if found.get("small_row_groups"):
        rows[f"{next(iter(results))}, clusters row groups of {SMALL_ROW_GROUP:,}"] = \
            found["small_row_groups"]
    lines = table_lines(rows, scales)
    top = str(scales[-1])
    # This code's default run grows by its row-group buffer up to 1Mi rows, then not: its
    # projection is the small row groups' growth plus that fixed buffer.
    per_doc = {rev: growth_per_doc(by[top], by[str(scales[-2])]) for rev, by in rows.items()
               if rev != next(iter(results)) or not found.get("small_row_groups")}
    rev, by = next(iter(results.items()))  # this checkout's code (the baseline is after it)
    files_per_part = by[top]["intermediate_files"] / by[top]["parts"]
    lines += ["", f"At 1 TB ({TB_DOCS / 1e8:.2f} × 10⁸ documents): the driver adds "
              + ", ".join(f"{v * TB_DOCS / 1e9:.1f} GB ({rev})" for rev, v in per_doc.items())
              + (" (and with 1Mi-row groups that one row group, ~0.2 GB, whatever the size)"
                 if found.get("small_row_groups") else "")
              + f"; intermediate files ~{files_per_part * TB_PARTS:,.0f} ({rev}'s "
              f"{files_per_part:.1f} a part over {TB_PARTS:,} parts of ~64 MB)."]
    return "\n".join(lines + identical_lines(found))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scales", default="1,10,30")
    ap.add_argument("--baseline", metavar="REV", help="also run src/ of git revision REV")
    ap.add_argument("--work", type=Path, default=Path("/tmp/lmforge_dedup_driver"))
    ap.add_argument("--out", type=Path)
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(*(Path(a) for a in args.child))
        return
    scales = [int(s) for s in args.scales.split(",")]
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    srcs = {code_label(): REPO / "src"}
    if args.baseline:
        from _common import checkout_src

        srcs[args.baseline] = checkout_src(args.baseline, work / "base")
    results: dict[str, dict[int, dict]] = {rev: {} for rev in srcs}
    small: dict[int, dict] = {}
    identical: dict[int, bool] = {}
    for s in scales:
        src = dedup_input(work, s)
        for rev, code in srcs.items():
            out = work / f"out_x{s}_{rev.replace('/', '_')}"
            shutil.rmtree(out, ignore_errors=True)
            env = {**os.environ, "PYTHONPATH": str(code), "LMFORGE_TRACKING": "off"}
            subprocess.run([sys.executable, __file__, "--child", str(src), str(out),
                            str(work / "figures.json")], env=env, check=True,
                           stderr=subprocess.DEVNULL)
            results[rev][s] = json.loads((work / "figures.json").read_text())
            results[rev][s]["out"] = str(out)
        current = next(iter(srcs))
        out = work / f"out_x{s}_small_row_groups"
        shutil.rmtree(out, ignore_errors=True)
        env = {**os.environ, "PYTHONPATH": str(srcs[current]), "LMFORGE_TRACKING": "off",
               ENV_ROW_GROUP: str(SMALL_ROW_GROUP)}
        subprocess.run([sys.executable, __file__, "--child", str(src), str(out),
                        str(work / "figures.json")], env=env, check=True,
                       stderr=subprocess.DEVNULL)
        small[s] = json.loads((work / "figures.json").read_text())
        print(f"x{s}: {results[next(iter(srcs))][s]['docs']} documents", flush=True)
        if args.baseline:
            identical[s] = same_tree(Path(results[next(iter(srcs))][s]["out"]),
                                     Path(results[args.baseline][s]["out"]))
    report(results, scales)
    report({f"{next(iter(srcs))}, {SMALL_ROW_GROUP}-row groups": small}, scales)
    if identical:
        print("outputs byte-identical to the baseline's: "
              + ", ".join(f"x{s} {'yes' if v else 'NO'}" for s, v in identical.items()))
    if args.out:
        args.out.write_text(json.dumps({"scales": scales, "results": results,
                                        "small_row_groups": small,
                                        "identical_to_baseline": identical}, indent=1) + "\n")


if __name__ == "__main__":
    main()
