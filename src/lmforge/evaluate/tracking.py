"""The evaluation in MLflow: results, samples and the data stages' counts.

The first evaluation of a training run goes into that run, so an ordinary train+evaluate
experiment shows its eval metrics beside its curves. A later evaluation of the same model
(an experiment that reruns only ``evaluate``) gets a run of its own, nested under the
training run, so it never overwrites another experiment's results.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lmforge.config import Params, load_params
from lmforge.stage import repo_root
from lmforge.tracking import (
    EVAL_DOMAIN_FIGURES,
    EVAL_DOMAIN_PREFIX,
    EVALUATED_TAG,
    PARENT_TAG,
    TRAIN_RUN_TAG,
    Run,
    find_run,
    recorded_run_id,
    resume_run,
    start_run,
    tracking_off,
    ui_path,
)

DATA_METRICS = ("ingest", "filter", "dedup", "decontam", "mix", "tokenizer", "shards")
# Bookkeeping, not results: a chart each would only push the figures down. They stay in
# the eval/eval.json artifact.
NOT_METRICS = frozenset({"seconds", "tokens", "docs"})


def log_to_mlflow(results: dict, samples: str, final: Path,
                  params: Params | None = None) -> None:
    """Log the evaluation (and the data stages' counts) to MLflow (``log_evaluation``)."""
    def log(run: Run) -> None:
        run.log_metrics(eval_metrics(results), step=0)
        log_data_counts(run, Path("metrics"))
        run.log_dict(results, "eval/eval.json")
        run.log_text(samples, "eval/samples.md")

    log_evaluation("evaluate", final, log, params)


def log_evaluation(stage: str, model_dir: Path, log: Callable[[Run], None],
                   params: Params | None = None) -> None:
    """A stage's results about the model in ``model_dir``, logged by ``log(run)``.

    Into the training run named in ``model_dir/run.json`` the first time the model is
    evaluated; into a new run nested under it after that (``open_eval_run``). The run is
    tagged evaluated only once ``log`` has succeeded; an error while logging ends the
    run FAILED and is re-raised. ``params`` default to ./params.yaml.
    """
    if tracking_off(stage):
        return
    run_id = recorded_run_id(model_dir)
    if not run_id:
        print(f"{stage}: no MLflow run recorded for {model_dir}; not logging")
        return
    with open_eval_run(run_id, params) as run:
        log(run)
        if run.run_id == run_id:  # last: a failed first evaluation is not "evaluated"
            run.set_tags({EVALUATED_TAG: "1"})
    where = "training run" if run.run_id == run_id else f"evaluation run under {run_id}"
    print(f"{stage}: logged to MLflow {where} {run.run_id}; "
          f"in `mlflow ui` open {ui_path(run.experiment_id())}")


def open_eval_run(train_run_id: str, params: Params | None = None) -> Run:
    """The training run, reopened, if it has no evaluation yet; else a new nested run."""
    root = repo_root()
    train = find_run(train_run_id, root)
    if train is not None and train.tags().get(EVALUATED_TAG) != "1":
        return resume_run(train_run_id, root)
    name = os.environ.get("DVC_EXP_NAME") or f"evaluate-{time.strftime('%Y%m%d-%H%M%S')}"
    tags = {TRAIN_RUN_TAG: train_run_id, "lmforge.stage": "evaluate"}
    if train is not None:  # a parent the store lacks (it was reset) would hide the run
        tags[PARENT_TAG] = train_run_id
    return start_run(params or load_params("params.yaml"), run_name=name, root=root,
                     tags=tags)


def eval_metrics(results: dict[str, Any]) -> dict[str, float]:
    """metrics/eval.json as flat MLflow metrics, whichever of its shapes it has.

    Top-level numbers become ``eval/<key>``; a split's numbers ``eval/<split>_<key>``, its
    summaries ``eval/<split>_<key>_<summary>`` (``eval/val_loss_mix_weighted``), its
    domains ``eval_domain/<figure>/<domain>`` for the figures in EVAL_DOMAIN_FIGURES.
    Counts and timings (NOT_METRICS) and the rest stay in the eval.json artifact.
    """
    metrics: dict[str, float] = {}
    for key, value in results.items():
        if _number(value) and key not in NOT_METRICS:
            metrics[f"eval/{key}"] = float(value)
    for split in ("val", "train"):
        section = results.get(split)
        if not isinstance(section, dict):
            continue
        for key, value in section.items():
            if key in NOT_METRICS:
                continue
            if _number(value):
                metrics[f"eval/{split}_{key}"] = float(value)
            elif key == "domains" and isinstance(value, dict):
                metrics.update(_domain_metrics(value))
            elif isinstance(value, dict):  # a summary: mix_weighted, token_weighted
                metrics.update({f"eval/{split}_{k}_{key}": float(v) for k, v in value.items()
                                if _number(v) and k not in NOT_METRICS})
    return metrics


def _domain_metrics(domains: dict[str, Any]) -> dict[str, float]:
    # By figure, then domain: the UI makes a chart section per figure, one chart per domain.
    return {f"{EVAL_DOMAIN_PREFIX}/{k}/{name}": float(d[k])
            for name, d in sorted(domains.items()) if isinstance(d, dict)
            for k in EVAL_DOMAIN_FIGURES if _number(d.get(k))}


def _number(value: Any) -> bool:
    # bool is an int; NaN/inf would be rejected by some stores and chart as gaps anyway.
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


def data_counts(metrics_dir: Path) -> dict[str, list[Any]]:
    """Documents in and kept per data stage and domain, as table columns."""
    table: dict[str, list[Any]] = {"stage": [], "domain": [], "in": [], "kept": []}
    for stage in DATA_METRICS:
        path = metrics_dir / f"{stage}.json"
        domains = json.loads(path.read_text(encoding="utf-8")).get("domains") \
            if path.is_file() else None
        for domain, m in sorted(domains.items() if isinstance(domains, dict) else ()):
            if isinstance(m, dict) and "kept" in m:
                table["stage"].append(stage)
                table["domain"].append(domain)
                table["in"].append(m.get("in"))
                table["kept"].append(m["kept"])
    return table


def log_data_counts(run: Run, metrics_dir: Path) -> None:
    """Each data stage's metrics as a JSON artifact, and their counts as one table.

    A table, not metrics: dozens of one-point charts would push the training curves off
    the first screen of the MLflow UI.
    """
    for stage in DATA_METRICS:
        path = metrics_dir / f"{stage}.json"
        if path.is_file():
            run.log_dict(json.loads(path.read_text(encoding="utf-8")), f"data/{stage}.json")
    table = data_counts(metrics_dir)
    if table["stage"]:
        run.log_table(table, "data/kept.json")
    for name in ("filter_report.md", "decontam_report.md"):  # why rejected; what overlaps
        report = metrics_dir / name
        if report.is_file():
            run.log_text(report.read_text(encoding="utf-8"), f"data/{name}")
    figures = decontam_metrics(metrics_dir)
    if figures:
        run.log_metrics(figures, step=0)


def decontam_metrics(metrics_dir: Path) -> dict[str, float]:
    """``decontam/<set>`` = the share of a set's checked items found in the training text."""
    path = metrics_dir / "decontam.json"
    sets = json.loads(path.read_text(encoding="utf-8")).get("sets") if path.is_file() else None
    return {f"decontam/{name}": float(s["contaminated_share"])
            for name, s in sorted((sets or {}).items()) if isinstance(s, dict)
            and _number(s.get("contaminated_share"))}
