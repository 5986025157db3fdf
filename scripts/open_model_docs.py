"""Regenerate the figures of docs/open-models.md's walkthrough from the run's record.

The walkthrough (SmolLM2-135M-Instruct through continued pretraining, LoRA SFT, LoRA DPO,
evaluate_post and lm-eval on the demo corpus) ran once with the params in
``docs/runs/smollm2-135m-instruct/params.yaml``; its stages' metrics files and the wall
times were kept beside them (``record.json``). This script writes the table between
``<!-- walkthrough -->`` and ``<!-- /walkthrough -->`` from those files, so the page never
types a figure twice; tests/test_open_model_docs.py fails when the page and the record
disagree. Usage: ``python scripts/open_model_docs.py``.

It also writes the LoRA base-precision table (``lora_precision.json`` there, from
``bench/bench_lora_precision.py``) between ``<!-- lora-precision -->`` and
``<!-- /lora-precision -->`` in the page and in bench/RESULTS.md.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "open-models.md"
RESULTS = REPO / "bench" / "RESULTS.md"
RUN = REPO / "docs" / "runs" / "smollm2-135m-instruct"
REGION = re.compile(r"(<!-- walkthrough -->\n).*?(<!-- /walkthrough -->)", re.S)
PRECISION = re.compile(r"(<!-- lora-precision -->\n).*?(<!-- /lora-precision -->)", re.S)
PARAMS = re.compile(r"(<!-- walkthrough-params -->\n).*?(<!-- /walkthrough-params -->)", re.S)


def load(name: str) -> dict:
    return json.loads((RUN / name).read_text(encoding="utf-8"))


def pm(d: dict, key: str, digits: int = 3) -> str:
    """``value ± stderr`` of a metrics entry."""
    err = d.get(f"{key}_stderr")
    return f"{d[key]:.{digits}f}" + (f" ± {err:.{digits}f}" if err is not None else "")


def reward_accuracy(dpo: dict) -> float:
    """DPO training's val share of pairs with a positive reward margin (the record was
    written when training still called it ``val_pref_accuracy``)."""
    return dpo.get("val_reward_accuracy", dpo.get("val_pref_accuracy"))


def seconds(record: dict, stage: str, steps: int | None = None) -> str:
    """A stage's wall time (and per step), or a dash where the record has none."""
    s = record["stage_seconds"].get(stage)
    if s is None:
        return "-"
    return f"{s:,.0f} s" + (f" ({s / steps:.1f} s/step)" if steps else "")


def replay_note(dpo: dict) -> str:
    """``, replay 0.25 of the rows`` where the run mixed pretraining rows in."""
    share = dpo.get("replay_row_share")
    return f", {share:.2f} of the rows pretraining text (replay)" if share else ""


def no_replay_rows(rec: dict) -> list[tuple[str, str, str]]:
    """The same DPO without replay (``dpo_replay0.json``, ``post_replay0.json``), where
    the record has it: the recipe's effect on the open model, in the same run."""
    if not (RUN / "post_replay0.json").is_file():
        return []
    dpo, post = load("dpo_replay0.json"), load("post_replay0.json")
    forgot = post["forgetting_bits_per_byte"]["dpo"]["mix_weighted"]
    return [("dpo, replay 0", f"`-S dpo.replay=0`, otherwise the same: val reward accuracy "
             f"{reward_accuracy(dpo):.3f}, KL {dpo['val_kl_per_token']:.4f}/token; forgetting "
             f"against the base {forgot:+.3f}, held-out preference accuracy "
             f"{pm(post['dpo'], 'pref_accuracy')}",
             seconds(rec, "dpo_replay0", dpo["steps"]))]


def table() -> str:
    """The walkthrough's figures, stage by stage, as a Markdown table."""
    rec, tok, train = load("record.json"), load("tokenizer.json"), load("train.json")
    ev, sft, dpo = load("eval.json"), load("sft.json"), load("dpo.json")
    post, harness = load("post.json"), load("harness.json")
    before, after = rec["base_val_mix_weighted"], ev["val"]["mix_weighted"]
    rows = [
        ("tokenizer", f"the model's own `tokenizer.json` ({tok['backend']}, vocab "
         f"{tok['vocab_size']:,}): {tok['chars_per_token']['all']} chars/token on the val "
         f"split, lossless={tok['lossless']}", seconds(rec, "tokenizer")),
        ("train", f"continued pretraining of {train['params']:,} params, {train['steps']} "
         f"steps, {train['tokens']:,} tokens", seconds(rec, "train", train["steps"])),
        ("evaluate", f"val bits/byte {pm(before, 'bits_per_byte')} (SmolLM2 as imported) -> "
         f"{pm(after, 'bits_per_byte')} (continued), mixture-weighted, "
         f"{after.get('tokens', ev['val']['token_weighted']['tokens']):,} tokens; samples",
         seconds(rec, "evaluate")),
        ("sft", f"LoRA {sft['trainable_params']:,} trained params "
         f"({100 * sft['trainable_params'] / sft['params']:.1f} %), {sft['steps']} steps: "
         f"held-out token accuracy {pm(post['base'], 'token_accuracy')} -> "
         f"{pm(post['sft'], 'token_accuracy')}, response loss "
         f"{pm(post['base'], 'response_loss')} -> {pm(post['sft'], 'response_loss')}",
         seconds(rec, "sft", sft["steps"])),
        ("dpo", f"LoRA, beta {dpo['beta']}, {dpo['steps']} steps on {dpo['train_pairs']:,} "
         f"pairs{replay_note(dpo)}: val reward accuracy {reward_accuracy(dpo):.3f}, KL to the "
         f"reference {dpo['val_kl_per_token']:.4f}/token", seconds(rec, "dpo", dpo["steps"])),
        ("evaluate_post", "forgetting, val bits/byte against the base: sft "
         f"{post['forgetting_bits_per_byte']['sft']['mix_weighted']:+.3f}, dpo "
         f"{post['forgetting_bits_per_byte']['dpo']['mix_weighted']:+.3f} (mixture-weighted); "
         f"held-out preference accuracy {pm(post['base'], 'pref_accuracy')} / "
         f"{pm(post['sft'], 'pref_accuracy')} / {pm(post['dpo'], 'pref_accuracy')} "
         "(base / sft / dpo)", seconds(rec, "evaluate_post")),
    ]
    rows += no_replay_rows(rec)
    tasks = sorted(harness["base"])
    accs = "; ".join(f"{t.removeprefix('demo_')} " + " / ".join(
        f"{harness[m][t]['acc']:.3f}" for m in ("base", "sft", "dpo")) for t in tasks)
    rows.append(("harness", f"lm-eval accuracy base / sft / dpo: {accs}",
                 seconds(rec, "harness")))
    lines = ["| stage | what it did, and the figures | wall time |", "|---|---|---|"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    lines.append("")
    lines.append(f"Measured {rec['date']} on {rec['machine']} at lmforge {rec['commit']}; "
                 f"{rec['conditions']}.")
    return "\n".join(lines) + "\n"


def precision_label(side: str) -> str:
    """``bf16:eager`` -> ``bf16, eager``; a plain dtype ran as the stage's default
    (``sft.compile: auto``, compiled on this CPU)."""
    dtype, _, mode = side.partition(":")
    return f"{dtype}, {mode or 'compiled'}"


def precision_table() -> str:
    """The same LoRA SFT run with the frozen base held in fp32, bf16 and NF4."""
    rec = load("lora_precision.json")
    runs, meta = rec["runs"], rec["meta"]
    lines = ["| frozen base | peak RSS (vs fp32) | s/step: median logged / whole run | val loss | "
             "held-out token accuracy | response loss | merged vs unmerged, max abs logit |",
             "|---|---|---|---|---|---|---|"]
    for side, r in runs.items():
        mode = side.partition(":")[2]
        fp32 = runs["fp32:" + mode if mode else "fp32"]
        lines.append(
            f"| {precision_label(side)} | {r['peak_rss_mib']:,} MiB "
            f"({r['peak_rss_mib'] / fp32['peak_rss_mib']:.2f}x) | {r['median_step_s']:.1f} / "
            f"{r['s_per_step']:.1f} | {r['val_loss']:.4f} | {pm(r, 'token_accuracy')} | "
            f"{pm(r, 'response_loss')} | {r['merged_vs_unmerged_max_abs_logit']:.1e} |")
    first = next(iter(runs.values()))
    before = rec.get("before_fix")
    if before:
        lines += ["", "Before the fix: " + ", ".join(
            f"{precision_label(side)} {r['peak_rss_mib']:,} MiB, {r['median_step_s']:.1f} s/step"
            for side, r in before["runs"].items()) + f" ({before['conditions']})."]
    lines += ["", f"{first['steps']} steps of the walkthrough's LoRA SFT each; held-out "
              f"figures on the first {first['records']} test conversations. Measured "
              f"{meta['date']} on {meta['machine']} at lmforge {meta['commit']}; "
              f"{meta['conditions']}. Command:", "", f"    {meta['command']}"]
    return "\n".join(lines) + "\n"


def params_block() -> str:
    """The run's params overlay, as a fenced YAML block."""
    body = (RUN / "params.yaml").read_text(encoding="utf-8")
    body = "\n".join(line for line in body.splitlines() if not line.startswith("#"))
    return f"```yaml\n{body.strip()}\n```\n"


def render(page: str) -> str:
    """The page with the walkthrough's params and table recomputed."""
    page = PARAMS.sub(lambda m: m.group(1) + params_block() + m.group(2), page)
    page = PRECISION.sub(lambda m: m.group(1) + precision_table() + m.group(2), page)
    return REGION.sub(lambda m: m.group(1) + table() + m.group(2), page)


def main() -> int:
    for page in (PAGE, RESULTS):
        text = render(page.read_text(encoding="utf-8"))
        tmp = page.with_suffix(".md.tmp")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(page)  # atomic: a reader sees the old page or the new one
        print(f"wrote {page.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
