"""The headline figures a user compares runs by: one small metrics file, and a table.

``dvc metrics show`` prints one row per metrics file and one column per key, and ``dvc
exp show`` one row per experiment with every metric, param and dependency as a column.
The stages' detail files (hundreds of per-domain, per-rule, per-task keys) made both
thousands of characters wide, so they are plain DVC outputs; this module reads them and
writes

- ``metrics/headline.json``, the only file declared as ``metrics:``: ten figures
  nested by model (``base.bpb``, ``sft.tok_acc``, ``dpo.reward_acc``...; see SCREEN).
  The keys are unique across models, so ``dvc exp show`` names a column ``dpo.bpb``
  rather than by file and key, and one row of them fits a 200-column terminal;
- ``metrics/headline.md``: every headline column for every model, models as rows.

A missing detail file (a stage not run yet) leaves its columns out rather than failing.

Columns: ``loss``, ``bpb`` (val loss and bits per byte, mixture-weighted, with ``_se``
standard errors: the base model's from metrics/eval.json, a fine-tuned model's as
evaluate_post measured it for forgetting, metrics/post_detail.json, on the same shards);
``tok_s`` (training tokens/s of the stage that made the model); ``resp_loss``,
``tok_acc``, ``pref_acc``, ``reward_acc`` (held-out task scores,
metrics/post.json); one column per lm-evaluation-harness task, its ``acc``
(metrics/harness.json, the task names' shared prefix dropped); and ``lm_eval``, those
accuracies' unweighted mean over the tasks.
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
HEADLINE_JSON = "metrics/headline.json"
HEADLINE_MD = "metrics/headline.md"
# The figures in metrics/headline.json, by model: what each stage is compared by (val
# bits/byte for all three, since fine-tuning can forget). Ten, so that one row of them
# (dvc metrics show), or one row per experiment beside the param it changed when every
# figure changed (dvc exp show --only-changed after train.max_lr), fits a 200-column
# terminal; every other column is in headline.md. Val loss is left to it: with one
# tokenizer it is bits/byte times a constant, and bits/byte also compares across
# tokenizers; so are resp_loss (tok_acc is the bounded one) and pref_acc (reward_acc is
# what DPO optimises).
SCREEN = {"base": ("bpb", "bpb_se", "tok_s", "lm_eval"),
          "sft": ("bpb", "tok_acc", "lm_eval"),
          "dpo": ("bpb", "reward_acc", "lm_eval")}
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
    prefix, and ``lm_eval``: their unweighted mean over the tasks."""
    tasks = harness.get(model, {})
    cut = len(_task_prefix(sorted(harness.get("chance", tasks))))
    accs = {task[cut:]: scores["acc"] for task, scores in sorted(tasks.items())
            if "acc" in scores}
    return {**accs, "lm_eval": sum(accs.values()) / len(accs)} if accs else {}


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


def screen(rows: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """The SCREEN figures of ``rows`` (those present), models in pipeline order."""
    return {model: {k: rows[model][k] for k in keys if k in rows.get(model, {})}
            for model, keys in SCREEN.items()}


def headline_markdown(rows: dict[str, dict[str, float]]) -> str:
    """Every headline column as a markdown table: models as rows, ``tok_s`` whole."""
    cols = sorted({k for r in rows.values() for k in r})
    lines = ["| model | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
    for model in MODELS:
        r = rows.get(model, {})
        cells = [("" if k not in r else f"{r[k]:,}" if k == "tok_s" else f"{r[k]:.3f}")
                 for k in cols]
        lines.append(f"| {model} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_headline(metrics_dir: str | Path = "metrics", json_path: str | Path = HEADLINE_JSON,
                   md_path: str | Path = HEADLINE_MD) -> list[Path]:
    """Write the SCREEN figures to ``json_path`` (nested by model, in pipeline order, so
    ``dvc exp show`` lists base, sft, dpo) and every column to ``md_path``; the paths."""
    from lmforge.io import write_json, write_text

    rows = headline(metrics_dir)
    json_path, md_path = Path(json_path), Path(md_path)
    for path in (json_path, md_path):
        path.parent.mkdir(parents=True, exist_ok=True)
    write_json(json_path, screen(rows), sort_keys=False)
    write_text(md_path, headline_markdown(rows))
    return [json_path, md_path]
