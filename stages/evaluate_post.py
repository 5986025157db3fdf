"""DVC stage ``evaluate_post``: the fine-tuned model vs its base, on what each should do.

- Held-out instruction tasks (``evaluate_post.test``, ``test_mc``): response loss, exact
  match of the greedy reply, multiple-choice accuracy by log-likelihood, base and
  fine-tuned (lmforge.evaluate.tasks).
- Forgetting: the fine-tuned model's pretraining val loss and bits-per-byte per domain
  against the base model's from metrics/eval.json (same shards, same protocol:
  ``evaluate.max_batches`` and ``batch_size``), as a table.
- Chat samples: both models answer ``evaluate_post.prompts`` and one test question per
  task through the chat template.

Writes metrics/post.json (headline figures), metrics/post_detail.json (all of them),
metrics/forgetting.md, metrics/post_tasks.md and metrics/post_samples.md, and logs them
to the sft run in MLflow.
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
from lmforge.evaluate import score_split
from lmforge.evaluate.forgetting import forgetting_markdown, forgetting_rows
from lmforge.evaluate.tasks import read_task_records, score_choices, score_responses, tasks_markdown
from lmforge.evaluate.tracking import open_eval_run
from lmforge.finetune.template import END_MARKER, generation_prompt, marker_ids
from lmforge.io import write_json, write_text
from lmforge.model import load_model
from lmforge.model.generate import generate
from lmforge.model.saved import extend_context
from lmforge.shards.format import file_sha256
from lmforge.shards.loader import ShardSet
from lmforge.stage import run_stage
from lmforge.tokenizer import Tokenizer
from lmforge.tracking import EVALUATED_TAG, ui_path

BASE, TUNED = Path("models/final"), Path("models/sft")
EVAL = Path("metrics/eval.json")


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
    """The greedy reply to one user message, up to ``<|end|>``."""
    ids = generation_prompt([("user", question)], tok)
    end = marker_ids(tok)[END_MARKER]
    out = [t for t in generate(model, ids, max_new_tokens, eos_id=end) if t != end]
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


def main(params: Params) -> None:
    started = time.perf_counter()
    for d in (BASE, TUNED):
        if not (d / "model.safetensors").is_file():
            raise InputError(f"{d}/model.safetensors: no model (run the train / sft stage)")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    amp = torch.bfloat16 if device == "cuda" and torch.cuda.is_bf16_supported() else None
    base, _ = load_model(BASE, device=device)
    tuned, _ = load_model(TUNED, device=device)
    # Forgetting is measured as evaluate measured the base model: its windows.
    base_len = base.config.seq_len
    # Fine-tuning may use a longer context than pretraining: score both on the same text.
    extend_context(base, tuned.config.seq_len)
    tok = Tokenizer.load(TUNED / "tokenizer.model")

    scores = {"base": task_scores(base, tok, params, device),
              "sft": task_scores(tuned, tok, params, device)}
    ev = params.evaluate
    mixture = ShardSet("data/shards/train").domain_shares()
    tuned_val = score_split(tuned, ShardSet("data/shards/val"), base_len,
                            ev.batch_size, ev.max_batches, device, amp).as_dict(mixture)
    base_val = base_val_figures(BASE)
    rows = {fig: forgetting_rows(base_val, tuned_val, fig) for fig in ("bits_per_byte", "loss")}
    forgetting_md = "\n".join(
        [f"# Forgetting: base ({BASE}) vs fine-tuned ({TUNED}) on the pretraining val split",
         ""] + [f"## {fig}\n\n{forgetting_markdown(r, fig)}" for fig, r in rows.items()])
    tasks_md = tasks_markdown(scores["base"], scores["sft"])
    samples = samples_markdown({"base": base, "sft": tuned}, tok, sample_questions(params),
                               params.evaluate_post.max_new_tokens)
    results = {"tasks": scores, "forgetting": rows, "val_sft": tuned_val,
               "seconds": round(time.perf_counter() - started, 2)}
    write_json("metrics/post.json", finite(headline(results)))
    write_json("metrics/post_detail.json", finite(results))
    write_text("metrics/forgetting.md", forgetting_md)
    write_text("metrics/post_tasks.md", tasks_md)
    write_text("metrics/post_samples.md", samples)
    log_to_mlflow(results, {"forgetting.md": forgetting_md, "tasks.md": tasks_md,
                            "samples.md": samples}, params)
    print(tasks_md)
    print(forgetting_md)


def headline(results: dict[str, Any]) -> dict[str, Any]:
    """metrics/post.json: the figures `dvc metrics diff` should show, per model.

    Overall task scores with their standard errors, and the forgetting (fine-tuned minus
    base bits-per-byte) per domain and mixture-weighted; per-task figures and the rest
    are in metrics/post_detail.json.
    """
    out: dict[str, Any] = {}
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
        out[model] = fig
    out["forgetting_bits_per_byte"] = {r["domain"]: r["change"]
                                       for r in results["forgetting"]["bits_per_byte"]}
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
    for fig, rows in results["forgetting"].items():
        for r in rows:
            if math.isfinite(r["change"]):
                out[f"post_forgetting/{fig}_change/{r['domain']}"] = float(r["change"])
    return out


def log_to_mlflow(results: dict[str, Any], texts: dict[str, str], params: Params) -> None:
    """Into the sft run (or a run nested under it when that one was evaluated before)."""
    run_file = TUNED / "run.json"
    run_id = (json.loads(run_file.read_text()).get("mlflow_run_id")
              if run_file.is_file() else None)
    if not run_id:
        print("evaluate_post: no MLflow run recorded by the sft stage; not logging")
        return
    with open_eval_run(run_id, params) as run:
        run.log_metrics(flat_metrics(results), step=0)
        run.log_dict(finite(results), "post/post_detail.json")
        for name, text in texts.items():
            run.log_text(text, f"post/{name}")
        if run.run_id == run_id:  # a later evaluation of this model nests instead
            run.set_tags({EVALUATED_TAG: "1"})
    print(f"evaluate_post: logged to MLflow run {run.run_id}; in `mlflow ui` open "
          f"{ui_path(run.experiment_id())}")


if __name__ == "__main__":
    run_stage(main)
