"""The practice notes' forgetting experiment: replay share x full fine-tuning / LoRA.

Queues one DVC experiment per setting (``dvc exp run --queue -S sft.replay=... -S
sft.lora=...``), runs the queue one at a time (each reruns ``sft`` and
``evaluate_post`` only: the data stages, the base model and its evaluation come from the
cache), then prints a markdown table from ``dvc exp show --json``: task scores,
forgetting per pretraining domain (fine-tuned minus base bits-per-byte), trainable
parameters, AdamW state bytes and wall time.

    python bench/forgetting_sweep.py                # queue, run, report
    python bench/forgetting_sweep.py --report-only  # the table of experiments already run
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from lmforge.experiments import (
    dvc,
    experiments,
    queue_experiment,
    start_queue,
    wait_for_queue,
)

REPLAYS = (0.0, 0.1, 0.3)
# Hydra's override grammar, which `dvc exp run -S` parses.
LORA = "{rank:8,alpha:16,dropout:0.0,targets:[attn,mlp]}"
# LoRA trains ~3% of the weights and, as usual, takes a larger learning rate.
# 90 steps (the table in the README); the demo default is shorter, for its time budget.
STEPS = ["sft.max_steps=90"]
MODES = {"full": ["sft.lora=null", "sft.lr=3e-4", *STEPS],
         "lora": [f"sft.lora={LORA}", "sft.lr=1e-3", *STEPS]}
PREFIX = "forget"


def name(mode: str, replay: float) -> str:
    return f"{PREFIX}-{mode}-r{int(round(replay * 100)):02d}"


def queue() -> None:
    for mode, sets in MODES.items():
        for replay in REPLAYS:
            queue_experiment(name(mode, replay), [f"sft.replay={replay}", *sets])
    start_queue(1)
    wait_for_queue(poll=20.0)
    print(dvc("queue", "status"))


def finished(metrics: dict[str, Any] | None) -> bool:
    """Whether an experiment has its results (one still running lists empty metrics)."""
    return bool(metrics and metrics.get("metrics/post.json", {}).get("sft")
                and metrics.get("metrics/sft.json"))


def row(metrics: dict[str, Any]) -> dict[str, Any]:
    sft, post = metrics["metrics/sft.json"], metrics["metrics/post.json"]
    tuned = post["sft"]
    return {"token_acc": tuned["token_accuracy"], "loss": tuned["response_loss"],
            "mc": tuned.get("mc_acc"), "forgetting": post["forgetting_bits_per_byte"],
            "trainable": sft["trainable_params"],
            "state_mb": sft["optimizer_state_bytes"] / 2**20,
            "seconds": sft["wall_seconds"]}


def report() -> str:
    exps = {n: e["metrics"] for n, e in experiments().items() if e["state"] == "success"}
    rows = [(mode, replay, row(exps[name(mode, replay)])) for mode in MODES
            for replay in REPLAYS if finished(exps.get(name(mode, replay)))]
    if not rows:
        return "no forgetting-sweep experiments found (run without --report-only)"
    domains = [d for d in rows[0][2]["forgetting"] if d != "token_weighted"]
    head = ("| mode | replay | token acc | response loss | MC acc | "
            + " | ".join(f"Δ bpb {d}" for d in domains)
            + " | trainable params | AdamW state | sft wall |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for mode, replay, r in rows:
        mc = f"{r['mc']:.3f}" if r["mc"] is not None else "n/a"
        lines.append(
            f"| {mode} | {replay:g} | {r['token_acc']:.3f} | {r['loss']:.3f} | {mc} | "
            + " | ".join(f"{r['forgetting'][d]:+.3f}" for d in domains)
            + f" | {r['trainable']:,} | {r['state_mb']:.1f} MiB | {r['seconds']:.0f} s |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--report-only", action="store_true")
    args = ap.parse_args()
    if not args.report_only:
        queue()
    print(report())


if __name__ == "__main__":
    sys.exit(main())
