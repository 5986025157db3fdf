"""DVC stage: tokenize data/mixed/{train,val} into data/shards/{train,val}."""

from __future__ import annotations

from pathlib import Path

from lmforge.config import Params
from lmforge.executor import make_executor
from lmforge.io import write_json
from lmforge.shards.build import build_shards
from lmforge.stage import run_stage


def main(params: Params) -> None:
    root = Path()  # relative: a queued experiment runs in a temp copy of the repo
    executor = make_executor(params.executor, params.shards.num_workers)
    metrics = build_shards(root / "data/mixed", root / "models/tokenizer",
                           root / "data/shards", params.shards, executor)
    write_json(root / "metrics/shards.json", metrics)
    for split in ("train", "val"):
        m = metrics[split]
        print(f"shards/{split}: {m['docs']} docs, {m['tokens']} tokens in {m['shards']} "
              f"shard(s), {m['tokens_per_sec']} tokens/s")


if __name__ == "__main__":
    run_stage(main)
