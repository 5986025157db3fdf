"""Peak memory of the four data stages on the demo corpus x1 and concatenated x4.

Each stage runs as its own process (``python -m stages.<name>``) in a scratch copy;
its peak RSS is read from ``getrusage(RUSAGE_CHILDREN)`` after it exits (the largest
of the stage's processes: the main one or a pool worker). The x4 corpus repeats every
document four times with distinct ids. Target: x4 peak <= 1.3 x the x1 peak, per stage.

    .venv/bin/python bench/bench_data_memory.py [--copies 4]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import DEMO, REPO

STAGES = ("ingest", "filter", "dedup", "mix")


def make_corpus(root: Path, copies: int) -> None:
    for src in sorted(DEMO.glob("*/*.jsonl.gz")):
        with gzip.open(src, "rt", encoding="utf-8") as f:
            lines = f.read().splitlines()
        out = root / "data" / "raw" / "demo" / src.parent.name / src.name
        out.parent.mkdir(parents=True, exist_ok=True)
        with gzip.open(out, "wt", encoding="utf-8") as f:
            for k in range(copies):
                for line in lines:
                    rec = json.loads(line)
                    rec["id"] = f"{rec['id']}~{k}" if "id" in rec else None
                    f.write(json.dumps(rec, ensure_ascii=False) + "\n")


def run_stages(root: Path) -> dict[str, int]:
    """Peak RSS in KiB per stage, each stage a fresh child of a fresh wrapper."""
    peaks = {}
    for stage in STAGES:
        probe = ("import resource, subprocess, sys; "
                 f"subprocess.run([sys.executable, '-m', 'stages.{stage}'], check=True, "
                 "stderr=subprocess.DEVNULL); "
                 "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
        env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
        out = subprocess.run([sys.executable, "-c", probe], cwd=root, env=env, check=True,
                             capture_output=True, text=True)
        peaks[stage] = int(out.stdout.strip().splitlines()[-1])
    return peaks


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--copies", type=int, default=4)
    args = ap.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for copies in (1, args.copies):
            root = Path(tmp) / f"x{copies}"
            make_corpus(root, copies)
            shutil.copy(REPO / "params.yaml", root)
            shutil.copytree(REPO / "stages", root / "stages")
            results[copies] = run_stages(root)
    for stage in STAGES:
        one, many = results[1][stage], results[args.copies][stage]
        print(f"{stage:7s} x1 {one / 1024:7.1f} MiB   x{args.copies} {many / 1024:7.1f} MiB   "
              f"ratio {many / one:.2f} (target <= 1.3)")


if __name__ == "__main__":
    main()
