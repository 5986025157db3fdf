"""The evaluation in MLflow: results, samples and the data stages' counts."""

from __future__ import annotations

import json
from pathlib import Path

from lmforge.stage import repo_root
from lmforge.tracking import resume_run

DATA_METRICS = ("ingest", "filter", "dedup", "mix", "tokenizer", "shards")


def log_to_mlflow(results: dict, samples: str, final: Path) -> None:
    """Attach the evaluation (and the data stages' counts) to the training run."""
    run_file = final / "run.json"
    run_id = json.loads(run_file.read_text()).get("mlflow_run_id") if run_file.is_file() else None
    if not run_id:
        print("evaluate: no MLflow run recorded by the train stage; not logging")
        return
    run = resume_run(run_id, repo_root())
    metrics = {f"eval/val_{k}": v for k, v in results["val"].items() if k != "domains"}
    for domain, d in results["val"]["domains"].items():
        metrics[f"eval/val_bits_per_byte/{domain}"] = d["bits_per_byte"]
        metrics[f"eval/val_loss/{domain}"] = d["loss"]
    if "train" in results:
        metrics["eval/train_loss"] = results["train"]["loss"]
        metrics["eval/train_val_gap"] = results["train_val_gap"]
    for stage in DATA_METRICS:
        path = Path("metrics") / f"{stage}.json"
        if path.is_file():
            data = json.loads(path.read_text(encoding="utf-8"))
            run.log_dict(data, f"data/{stage}.json")
            domains = data.get("domains")
            for domain, m in (domains.items() if isinstance(domains, dict) else ()):
                if isinstance(m, dict) and "kept" in m:
                    metrics[f"data/{stage}_kept/{domain}"] = m["kept"]
    run.log_metrics(metrics, step=0)
    run.log_dict(results, "eval/eval.json")
    run.log_text(samples, "eval/samples.md")
    run.finish("FINISHED")
