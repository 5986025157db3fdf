"""DVC stage: data/decontam/ -> data/mixed/{train,val}/ (split per domain, re-weighted)."""

from __future__ import annotations

from lmforge.config import Params
from lmforge.data.mix import run_mix, shortfall_line
from lmforge.data.report import print_report
from lmforge.executor import make_executor
from lmforge.io import write_json
from lmforge.stage import run_stage


def main(params: Params) -> None:
    executor = make_executor(params.executor, params.mix.num_workers)
    metrics = run_mix(params.mix, "data/decontam", "data/mixed", executor)
    write_json("metrics/mix.json", metrics)
    print_report("mix", metrics)
    for domain, short in metrics["shortfalls"].items():
        print(f"{shortfall_line(domain, short, params.mix)}; within mix.max_shortfall "
              f"{params.mix.max_shortfall}")
    for domain, m in sorted(metrics["domains"].items()):
        if m["val_below_minimum"]:
            cfg = params.mix
            print(f"mix: warning: {domain}: val holds {m['val_docs']} documents, "
                  f"{m['val_chars']:,} characters (asked: {cfg.min_val_docs}, "
                  f"{cfg.min_val_chars:,}); mix.max_val_fraction={cfg.max_val_fraction} "
                  "keeps the rest for training, so its val figures are rough")


if __name__ == "__main__":
    run_stage(main)
