"""DVC stage: train the sentencepiece tokenizer on a sample of data/mixed/train."""

from __future__ import annotations

from pathlib import Path

from lmforge.config import Params
from lmforge.io import write_json
from lmforge.stage import run_stage
from lmforge.stage_deps import require_dependency
from lmforge.tokenizer.build import build_tokenizer, summary


def main(params: Params) -> None:
    # Under DVC an init_from folder must be a dep of this stage, or editing it would
    # leave `dvc status` clean and models/tokenizer stale: checked before any work.
    require_dependency("tokenizer", params.tokenizer.init_from)
    root = Path()  # relative: a queued experiment runs in a temp copy of the repo
    metrics = build_tokenizer(root / "data/mixed/train", root / "data/mixed/val",
                              root / "models/tokenizer", params.tokenizer)
    write_json(root / "metrics/tokenizer.json", metrics)
    print(summary(metrics))


if __name__ == "__main__":
    run_stage(main)
