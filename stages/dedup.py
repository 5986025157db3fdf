"""DVC stage: data/filtered/ -> data/deduped/ (+ clusters.parquet: id -> cluster, kept)."""

from __future__ import annotations

from lmforge.config import Params
from lmforge.data.dedup import run_dedup
from lmforge.data.report import print_report
from lmforge.executor import make_executor
from lmforge.io import write_json
from lmforge.stage import run_stage


def main(params: Params) -> None:
    executor = make_executor(params.executor, params.dedup.num_workers)
    metrics = run_dedup(params.dedup, "data/filtered", "data/deduped", executor)
    write_json("metrics/dedup.json", metrics)
    print_report("dedup", metrics)


if __name__ == "__main__":
    run_stage(main)
