"""DVC stage ``harness``: lm-evaluation-harness on the base, sft and dpo models, offline.

Reads params.harness (task folder, tasks, model folders, batch size, limit, device);
exports each model to Hugging Face format (a cache under models/hf, not an output),
runs lm-eval's multiple-choice tasks from data/tasks/demo on it, writes
metrics/harness.json (acc, acc_norm, standard errors and n per model and task, chance
per task) and metrics/harness.md (tasks as rows, models as columns), and logs the
figures to each model's MLflow run.
"""

from __future__ import annotations

import time
from pathlib import Path

from lmforge.config import Params
from lmforge.evaluate.harness import harness_markdown, headline, log_to_mlflow, run_harness
from lmforge.io import write_json, write_text
from lmforge.stage import run_stage


def main(params: Params) -> None:
    cfg = params.harness
    started = time.perf_counter()
    models = {label: Path(path) for label, path in cfg.models.items()}
    result = run_harness(models, Path(cfg.task_dir), list(cfg.tasks), cfg.batch_size,
                         cfg.limit, cfg.device)
    markdown = harness_markdown(result)
    write_json("metrics/harness.json", headline(result))
    write_text("metrics/harness.md", markdown)
    log_to_mlflow(result, markdown)
    print(markdown, end="")
    print(f"harness: {len(result['models'])} models x {len(result['tasks'])} tasks in "
          f"{time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    run_stage(main)
