"""Post-training evaluation: the base, SFT and DPO models on what each should do.

- Held-out instruction tasks (``evaluate_post.test``, ``test_mc``): response loss, exact
  match of the greedy reply, multiple-choice accuracy by log-likelihood, for every model
  (lmforge.evaluate.tasks).
- Held-out preference pairs (``evaluate_post.test_pref``): how often each model finds
  the chosen response more likely, and the DPO model's reward accuracy against its
  reference, the SFT model (lmforge.evaluate.preferences).
- Forgetting: each fine-tuned model's pretraining val loss and bits-per-byte per domain
  against the base model's from metrics/eval.json (same shards, same protocol:
  ``evaluate.max_batches`` and ``batch_size``), as a table (lmforge.evaluate.forgetting).
- Chat samples: every model answers ``evaluate_post.prompts`` and one test question per
  task through the chat template.

``run_post_evaluation`` writes metrics/post.json (headline figures),
metrics/post_detail.json (all of them), metrics/forgetting.md, metrics/post_tasks.md (with
the preference table) and metrics/post_samples.md, and logs them to the sft and dpo runs
in MLflow.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import torch

from lmforge.config import Params
from lmforge.errors import InputError
from lmforge.evaluate.forgetting import forgetting_markdown, forgetting_rows
from lmforge.evaluate.preferences import (
    pair_logps,
    preference_scores,
    preferences_markdown,
    read_pairs,
)
from lmforge.evaluate.report import tasks_markdown
from lmforge.evaluate.scoring import score_split
from lmforge.evaluate.tasks import read_task_records, score_choices, score_responses
from lmforge.evaluate.tracking import log_evaluation
from lmforge.finetune.template import chat_format
from lmforge.io import write_json, write_text
from lmforge.model import load_model
from lmforge.model.generate import generate
from lmforge.model.saved import extend_context
from lmforge.shards.format import file_sha256
from lmforge.shards.loader import ShardSet
from lmforge.tokenizer import Tokenizer
from lmforge.tracking import Run

BASE = Path("models/final")
# The fine-tuned models, each with the model its preference reward is measured against.
TUNED = {"sft": Path("models/sft"), "dpo": Path("models/dpo")}
REFERENCES = {"dpo": "sft"}
EVAL = Path("metrics/eval.json")
# The task tables: each tuned model against the model it was tuned from.
COMPARISONS = (("base", "sft"), ("sft", "dpo"))


def run_post_evaluation(params: Params) -> None:
    """The evaluate_post stage: score every model, write the metrics, log to MLflow."""
    started = time.perf_counter()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    models, base_len = load_models(device)
    tok = Tokenizer.load(TUNED["sft"])
    cfg = params.evaluate_post
    scores = {name: task_scores(m, tok, params, device) for name, m in models.items()}
    tuned_val, rows = forgetting(models, base_len, params, device)
    tasks_md = "\n".join(
        f"## {tuned} against {before} (the table's base is {before}, tuned is {tuned})\n\n"
        + tasks_markdown(scores[before], scores[tuned]) for before, tuned in COMPARISONS)
    preferences = None
    if cfg.test_pref:
        pairs, tasks = read_pairs(cfg.test_pref)
        logps = {name: pair_logps(m, tok, pairs, cfg.batch_size, device)
                 for name, m in models.items()}
        preferences = preference_scores(logps, tasks, REFERENCES)
        tasks_md += ("\n## Held-out preference pairs\n\n"
                     + preferences_markdown(preferences))
    samples = samples_markdown(models, tok, sample_questions(params), cfg.max_new_tokens)
    results = {"tasks": scores, "preferences": preferences, "forgetting": rows,
               "val": tuned_val, "seconds": round(time.perf_counter() - started, 2)}
    texts = {"forgetting.md": forgetting_report(rows), "tasks.md": tasks_md,
             "samples.md": samples}
    write_outputs(results, texts)
    for model_dir in TUNED.values():
        log_evaluation("evaluate_post", model_dir,
                       lambda run: log_results(run, results, texts), params)
    print(tasks_md)
    print(texts["forgetting.md"])


def load_models(device: str) -> tuple[dict[str, torch.nn.Module], int]:
    """The base and fine-tuned models, all extended to the longest one's context, and
    the base model's own context (``seq_len``).

    Fine-tuning may use a longer context than pretraining: scoring all of them at the
    same length scores them on the same text.
    """
    for d in (BASE, *TUNED.values()):
        if not (d / "model.safetensors").is_file():
            raise InputError(f"{d}/model.safetensors: no model (run the train / sft / dpo "
                             "stage)")
    models = {"base": load_model(BASE, device=device)[0]}
    models.update({name: load_model(d, device=device)[0] for name, d in TUNED.items()})
    base_len = models["base"].config.seq_len
    longest = max(m.config.seq_len for m in models.values())
    for m in models.values():
        extend_context(m, longest)
    return models, base_len


def forgetting(models: dict[str, torch.nn.Module], base_len: int, params: Params,
               device: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Each tuned model's val figures, and its forgetting rows per figure against the
    base model's from metrics/eval.json: measured as evaluate measured the base model,
    on its windows (``base_len`` tokens)."""
    ev = params.evaluate
    amp = torch.bfloat16 if device == "cuda" and torch.cuda.is_bf16_supported() else None
    mixture = ShardSet("data/shards/train").domain_shares()
    base_val = base_val_figures(BASE)
    tuned_val, rows = {}, {}
    for name in TUNED:
        tuned_val[name] = score_split(models[name], ShardSet("data/shards/val"), base_len,
                                      ev.batch_size, ev.max_batches, device,
                                      amp).as_dict(mixture)
        rows[name] = {fig: forgetting_rows(base_val, tuned_val[name], fig)
                      for fig in ("bits_per_byte", "loss")}
    return tuned_val, rows


def forgetting_report(rows: dict[str, Any]) -> str:
    """metrics/forgetting.md: per tuned model, a table per figure."""
    return "\n".join(
        f"# Forgetting: base ({BASE}) vs {name} ({TUNED[name]}) on the pretraining val "
        "split\n\n" + "\n".join(f"## {fig}\n\n{forgetting_markdown(r, fig)}"
                                  for fig, r in rows[name].items())
        for name in TUNED)


def base_val_figures(base_dir: Path) -> dict[str, Any]:
    """The base model's val figures from metrics/eval.json, checked to be this model's."""
    if not EVAL.is_file():
        raise InputError(f"{EVAL}: missing (run the evaluate stage)")
    results = json.loads(EVAL.read_text(encoding="utf-8"))
    sha = file_sha256(base_dir / "model.safetensors")
    if results.get("model_sha256") != sha:
        raise InputError(f"{EVAL}: scores another model than {base_dir} (rerun evaluate)")
    return results["val"]


def task_scores(model: torch.nn.Module, tok: Tokenizer, params: Params, device: str
                ) -> dict[str, Any]:
    """Response loss and exact match on the test split; MC accuracy on test_mc."""
    cfg = params.evaluate_post
    out = score_responses(model, tok, read_task_records(cfg.test), cfg.batch_size, device)
    if cfg.test_mc:
        out.update(score_choices(model, tok, read_task_records(cfg.test_mc), cfg.batch_size,
                                 device))
    return out


def chat_reply(model: torch.nn.Module, tok: Tokenizer, question: str,
               max_new_tokens: int) -> str:
    """The greedy reply to one user message, up to its end of turn (or EOS)."""
    fmt = chat_format(tok)
    ids = fmt.generation_prompt([("user", question)])
    out = []
    for token in generate(model, ids, max_new_tokens):
        if token in fmt.stop_ids or token == tok.eos_id:
            break
        out.append(token)
    return tok.decode(out)


def samples_markdown(models: dict[str, torch.nn.Module], tok: Tokenizer,
                     questions: list[tuple[str, str]], max_new_tokens: int) -> str:
    """Each question with each model's greedy reply (and the reference, where known)."""
    lines = ["# Chat samples (greedy, through the chat template)", ""]
    for question, reference in questions:
        lines += [f"## {question}", ""]
        if reference:
            lines += [f"*reference:* {reference}", ""]
        for name, model in models.items():
            lines += [f"**{name}**", "", "````text",
                      chat_reply(model, tok, question, max_new_tokens), "````", ""]
    return "\n".join(lines)


def sample_questions(params: Params) -> list[tuple[str, str]]:
    """``evaluate_post.prompts``, then the first test question of each task."""
    questions = [(p, "") for p in params.evaluate_post.prompts]
    seen: set[str] = set()
    for rec in read_task_records(params.evaluate_post.test):
        if rec.task not in seen:
            seen.add(rec.task)
            questions.append((rec.turns[-2][1], rec.turns[-1][1]))
    return questions


def write_outputs(results: dict[str, Any], texts: dict[str, str]) -> None:
    """metrics/post.json, post_detail.json and the three markdown reports."""
    write_json("metrics/post.json", finite(headline(results)))
    write_json("metrics/post_detail.json", finite(results))
    write_text("metrics/forgetting.md", texts["forgetting.md"])
    write_text("metrics/post_tasks.md", texts["tasks.md"])
    write_text("metrics/post_samples.md", texts["samples.md"])


def headline(results: dict[str, Any]) -> dict[str, Any]:
    """metrics/post.json: the figures `dvc metrics diff` should show, per model.

    Overall task scores with their standard errors, and the forgetting (fine-tuned minus
    base bits-per-byte) per domain and mixture-weighted; per-task figures and the rest
    are in metrics/post_detail.json.
    """
    out: dict[str, Any] = {}
    prefs = results.get("preferences") or {}
    for model, s in results["tasks"].items():
        r, e = s["response"]["overall"], s["exact_match"]["overall"]
        fig = {"response_loss": r["loss"], "response_loss_stderr": r["loss_stderr"],
               "token_accuracy": r["token_accuracy"],
               "token_accuracy_stderr": r["token_accuracy_stderr"],
               "exact_match": e.get("exact_match"),
               "exact_match_stderr": e.get("exact_match_stderr")}
        if "multiple_choice" in s:
            m = s["multiple_choice"]["overall"]
            fig.update(mc_acc=m["acc"], mc_acc_stderr=m["acc_stderr"], mc_chance=m["chance"])
        if model in prefs:
            p = prefs[model]["overall"]
            fig.update({k: p[k] for k in ("pref_accuracy", "pref_accuracy_stderr",
                                          "reward_accuracy", "reward_accuracy_stderr")
                        if k in p})
        out[model] = fig
    out["forgetting_bits_per_byte"] = {
        name: {r["domain"]: r["change"] for r in rows["bits_per_byte"]}
        for name, rows in results["forgetting"].items()}
    out["seconds"] = results["seconds"]
    return out


def finite(obj: Any) -> Any:
    """NaN and infinities as null: JSON has no NaN, and strict readers refuse it."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [finite(v) for v in obj]
    return obj


def flat_metrics(results: dict[str, Any]) -> dict[str, float]:
    """The headline figures as MLflow metrics, named by model and what they average."""
    out: dict[str, float] = {}
    for model, s in results["tasks"].items():
        for part, section in s.items():
            for key, value in section.get("overall", {}).items():
                if (isinstance(value, (int, float)) and not isinstance(value, bool)
                        and math.isfinite(value)):
                    out[f"post/{model}_{part}_{key}"] = float(value)
    for model, s in (results.get("preferences") or {}).items():
        for key, value in s["overall"].items():
            if isinstance(value, float) and math.isfinite(value):
                out[f"post/{model}_preference_{key}"] = value
    for name, figures in results["forgetting"].items():
        for fig, rows in figures.items():
            for r in rows:
                if math.isfinite(r["change"]):
                    out[f"post_forgetting/{name}/{fig}_change/{r['domain']}"] = float(r["change"])
    return out


def log_results(run: Run, results: dict[str, Any], texts: dict[str, str]) -> None:
    """The figures as metrics, post_detail.json and the reports as artifacts."""
    run.log_metrics(flat_metrics(results), step=0)
    run.log_dict(finite(results), "post/post_detail.json")
    for name, text in texts.items():
        run.log_text(text, f"post/{name}")
