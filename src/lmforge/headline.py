"""The headline figures a user compares runs by, one small file per model.

``dvc metrics show`` prints one row per metrics file and one column per key, so the
stages' detail files (hundreds of per-domain, per-rule, per-task keys) made a table
thousands of characters wide. The stages still write them, as plain DVC outputs; this
module reads them and writes ``metrics/headline/{base,sft,dpo}.json`` with the same keys
in each, the only files declared as ``metrics:``: the table is the models as rows and a
few dozen figures as columns, narrow enough for a 200-column terminal. A missing detail
file (a stage not run yet) leaves its columns out rather than failing.

Columns: ``loss``, ``bpb`` (val loss and bits per byte, mixture-weighted, with ``_se``
standard errors: the base model's from metrics/eval.json, a fine-tuned model's as
evaluate_post measured it for forgetting, metrics/post_detail.json, on the same shards);
``tok_s`` (training tokens/s of the stage that made the model); ``resp_loss``,
``tok_acc``, ``pref_acc``, ``reward_acc`` (held-out task scores, metrics/post.json); and
one column per lm-evaluation-harness task, its ``acc`` (metrics/harness.json, the task
names' shared prefix dropped).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

MODELS = ("base", "sft", "dpo")
# The training stage whose run produced each model: its metrics file holds tokens/s.
TRAINING = {"base": "train", "sft": "sft", "dpo": "dpo"}
# Held-out task scores (metrics/post.json) under their short column names.
# (Its multiple-choice accuracy, mc_acc, is left out: the harness's instruct_mc task
# scores the same items, and both are in their detail files.)
TASKS = {"response_loss": "resp_loss", "token_accuracy": "tok_acc",
         "pref_accuracy": "pref_acc", "reward_accuracy": "reward_acc"}
HEADLINE_DIR = "metrics/headline"
# Val figures, mixture-weighted, under their short column names.
VAL = {"loss": "loss", "loss_stderr": "loss_se", "bits_per_byte": "bpb",
       "bits_per_byte_stderr": "bpb_se"}


def _load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _task_prefix(names: list[str]) -> str:
    """The prefix every harness task name shares up to an underscore (``demo_``), dropped
    from the column names to keep them short; '' when the names share none."""
    prefix = os.path.commonprefix(names) if len(names) > 1 else ""
    return prefix[:prefix.rfind("_") + 1]


def val_figures(ev: dict[str, Any]) -> dict[str, float]:
    """The base model's mixture-weighted val loss and bits/byte with standard errors
    (eval.json)."""
    mix = ev.get("val", {}).get("mix_weighted", {})
    return {short: mix[key] for key, short in VAL.items() if key in mix}


def tuned_val_figures(detail: dict[str, Any], model: str) -> dict[str, float]:
    """A fine-tuned model's mixture-weighted val loss and bits/byte with standard errors,
    as evaluate_post measured them for forgetting (post_detail.json: same shards and
    protocol as eval.json)."""
    row = {}
    for measure, rows in detail.get("forgetting", {}).get(model, {}).items():
        for r in rows:
            if r.get("domain") == "mix_weighted" and f"{measure}_stderr" in VAL:
                row[VAL[measure]] = r["tuned"]
                row[VAL[f"{measure}_stderr"]] = r["tuned_stderr"]
    return row


def harness_figures(harness: dict[str, Any], model: str) -> dict[str, float]:
    """Each harness task's ``acc`` for ``model``, keyed by the task name less the shared
    prefix."""
    tasks = harness.get(model, {})
    cut = len(_task_prefix(sorted(harness.get("chance", tasks))))
    return {task[cut:]: scores["acc"] for task, scores in sorted(tasks.items())
            if "acc" in scores}


def headline(metrics_dir: str | Path = "metrics") -> dict[str, dict[str, float]]:
    """``{model: {column: value}}`` for base, sft and dpo from the detail files."""
    m = Path(metrics_dir)
    ev, post, detail, harness = (_load(m / f"{name}.json") for name in
                                 ("eval", "post", "post_detail", "harness"))
    rows: dict[str, dict[str, float]] = {}
    for model in MODELS:
        row: dict[str, float] = {}
        row.update(val_figures(ev) if model == "base" else tuned_val_figures(detail, model))
        run = _load(m / f"{TRAINING[model]}.json")
        if "tokens_per_sec" in run:
            row["tok_s"] = round(run["tokens_per_sec"])  # whole tokens: noise is larger
        scores = post.get(model, {})
        row.update({short: scores[key] for key, short in TASKS.items() if key in scores})
        row.update(harness_figures(harness, model))
        rows[model] = row
    return rows


def write_headline(metrics_dir: str | Path = "metrics",
                   out_dir: str | Path = HEADLINE_DIR) -> list[Path]:
    """Write ``{out_dir}/{model}.json`` for every model; the paths written."""
    from lmforge.io import write_json

    written = []
    for model, row in headline(metrics_dir).items():
        path = Path(out_dir) / f"{model}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, row)
        written.append(path)
    return written
