"""DVC stage: raw files (jsonl, jsonl.gz/.zst, parquet, txt) -> data/ingested/."""

from __future__ import annotations

from lmforge.config import Params
from lmforge.data.ingest import run_ingest
from lmforge.data.report import print_report
from lmforge.executor import make_executor
from lmforge.io import write_json
from lmforge.stage import run_stage


def main(params: Params) -> None:
    executor = make_executor(params.executor, params.ingest.num_workers)
    metrics = run_ingest(params.ingest, "data/ingested", executor)
    write_json("metrics/ingest.json", metrics)
    print_report("ingest", metrics, "data/ingested/rejects.parquet")


if __name__ == "__main__":
    run_stage(main)
