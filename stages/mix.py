"""DVC stage: data/deduped/ -> data/mixed/{train,val}/ (split per domain, re-weighted)."""

from __future__ import annotations

from lmforge.config import Params
from lmforge.data.mix import run_mix
from lmforge.data.report import print_report
from lmforge.io import write_json
from lmforge.stage import run_stage


def main(params: Params) -> None:
    metrics = run_mix(params.mix, "data/deduped", "data/mixed")
    write_json("metrics/mix.json", metrics)
    print_report("mix", metrics)


if __name__ == "__main__":
    run_stage(main)
