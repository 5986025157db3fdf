"""Regenerate the figures of docs/open-models.md's walkthrough from the run's record.

The walkthrough (SmolLM2-135M-Instruct through continued pretraining, LoRA SFT, LoRA DPO,
evaluate_post and lm-eval on the demo corpus) ran once with the params in
``docs/runs/smollm2-135m-instruct/params.yaml``; its stages' metrics files and the wall
times were kept beside them (``record.json``). This script writes the table between
``<!-- walkthrough -->`` and ``<!-- /walkthrough -->`` from those files, so the page never
types a figure twice; tests/test_open_model_docs.py fails when the page and the record
disagree. Usage: ``python scripts/open_model_docs.py``.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "open-models.md"
RUN = REPO / "docs" / "runs" / "smollm2-135m-instruct"
REGION = re.compile(r"(<!-- walkthrough -->\n).*?(<!-- /walkthrough -->)", re.S)
PARAMS = re.compile(r"(<!-- walkthrough-params -->\n).*?(<!-- /walkthrough-params -->)", re.S)


def load(name: str) -> dict:
    return json.loads((RUN / name).read_text(encoding="utf-8"))


def pm(d: dict, key: str, digits: int = 3) -> str:
    """``value ± stderr`` of a metrics entry."""
    err = d.get(f"{key}_stderr")
    return f"{d[key]:.{digits}f}" + (f" ± {err:.{digits}f}" if err is not None else "")


def seconds(record: dict, stage: str, steps: int | None = None) -> str:
    """A stage's wall time (and per step), or a dash where the record has none."""
    s = record["stage_seconds"].get(stage)
    if s is None:
        return "-"
    return f"{s:,.0f} s" + (f" ({s / steps:.1f} s/step)" if steps else "")


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
         f"pairs: val preference accuracy {dpo['val_pref_accuracy']:.3f}, KL to the reference "
         f"{dpo['val_kl_per_token']:.4f}/token", seconds(rec, "dpo", dpo["steps"])),
        ("evaluate_post", "forgetting, val bits/byte against the base: sft "
         f"{post['forgetting_bits_per_byte']['sft']['mix_weighted']:+.3f}, dpo "
         f"{post['forgetting_bits_per_byte']['dpo']['mix_weighted']:+.3f} (mixture-weighted); "
         f"held-out preference accuracy {pm(post['base'], 'pref_accuracy')} / "
         f"{pm(post['sft'], 'pref_accuracy')} / {pm(post['dpo'], 'pref_accuracy')} "
         "(base / sft / dpo)", seconds(rec, "evaluate_post")),
    ]
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


def params_block() -> str:
    """The run's params overlay, as a fenced YAML block."""
    body = (RUN / "params.yaml").read_text(encoding="utf-8")
    body = "\n".join(line for line in body.splitlines() if not line.startswith("#"))
    return f"```yaml\n{body.strip()}\n```\n"


def render(page: str) -> str:
    """The page with the walkthrough's params and table recomputed."""
    page = PARAMS.sub(lambda m: m.group(1) + params_block() + m.group(2), page)
    return REGION.sub(lambda m: m.group(1) + table() + m.group(2), page)


def main() -> int:
    text = render(PAGE.read_text(encoding="utf-8"))
    tmp = PAGE.with_suffix(".md.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(PAGE)  # atomic: a reader sees the old page or the new one
    print(f"wrote {PAGE.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
