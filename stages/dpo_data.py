"""DVC stage ``dpo_data``: preference pairs -> data/dpo/{train,val} masked, packed shards.

See ``lmforge.finetune.build_pairs``. Every record in is kept or rejected
with a reason (metrics/dpo_data.json; the first rejects are printed).
"""

from __future__ import annotations

from pathlib import Path

from lmforge.config import Params
from lmforge.finetune.build_pairs import build_pairs
from lmforge.io import write_json
from lmforge.stage import run_stage

TOKENIZER = Path("models/tokenizer")  # the tokenizer stage's folder, either backend
OUT = Path("data/dpo")


def main(params: Params) -> None:
    metrics = build_pairs(params.dpo_data, TOKENIZER, OUT)
    write_json("metrics/dpo_data.json", metrics)
    c = metrics["counts"]
    reasons = ", ".join(f"{r} {n:,}" for r, n in sorted(c["rejected"].items(),
                                                          key=lambda kv: -kv[1]))
    print(f"dpo_data: {c['in']:,} in, {c['kept']:,} kept, {c['in'] - c['kept']:,} rejected"
          + (f" ({reasons})" if reasons else ""))
    for line in metrics["first_rejects"]:
        print(f"  {line}")
    for split in ("train", "val"):
        m = metrics[split]
        print(f"dpo_data/{split}: {m['pairs']:,} pairs in {m['rows']:,} rows of "
              f"{metrics['seq_len']}, {m['target_share']:.0%} of tokens are scored, "
              f"{m['pad_share']:.1%} padding")


if __name__ == "__main__":
    run_stage(main)
