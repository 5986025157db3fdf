"""A LoRA SFT run per frozen-base precision (fp32, bf16, nf4) on a real open model.

The sft stage itself (``run_sft_stage``: its data, loop, checkpoints and merged save) runs
once per ``sft.lora.base_dtype`` in a DVC workspace that holds what the stage reads
(data/sft, data/shards/train for replay, ``sft.init_from``, models/tokenizer), such as
the SmolLM2-135M-Instruct walkthrough's (docs/open-models.md). Each run is its own
process, so its peak RSS is its own; outputs go under ``--out/<dtype>/``, never over the
workspace's models/sft. Then, for each run:

* **held-out token accuracy and response loss** of the merged model on the first
  ``--records`` conversations of ``evaluate_post.test`` (what evaluate_post scores), after
  the same number of steps for every precision;
* **merged vs unmerged**: the saved merged fp32 model against the base held as the run
  held it (bf16 / NF4) with the saved adapter on top, on the same records: the largest
  absolute logit difference;
* step time (the run's ``wall_seconds / steps``, which includes its evals and
  checkpoints, and the median logged step) and the process's peak RSS (VmHWM, with a
  fixed glibc mmap threshold so that freed tensors leave RSS).

    .venv/bin/python bench/bench_lora_precision.py --workdir /work/smolrun \\
        --out /tmp/lora-precision [--dtypes fp32,bf16,nf4,fp32:eager,...] [--steps 24]
        [--records 120]

``fp32:eager`` (any dtype with ``:eager``) runs with ``sft.compile: false``: Inductor's
compile holds memory of its own in the process (and less when its cache already holds
the graphs), so the eager runs are the like-for-like comparison of what each base holds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from lmforge.config import Params, load_params
from lmforge.evaluate.tasks import read_task_records, score_responses
from lmforge.model.frozen import hold_frozen_in
from lmforge.model.lora import load_adapter
from lmforge.model.saved import load_model
from lmforge.tokenizer import Tokenizer
from lmforge.train.sft import SftPaths, run_sft_stage


def run_params(workdir: Path, side: str, steps: int) -> Params:
    """The workspace's params with ``sft.lora.base_dtype`` and ``sft.max_steps`` set;
    ``side`` is a base dtype, ``:eager`` after it also sets ``sft.compile: false``."""
    params = load_params(workdir / "params.yaml")
    dtype, _, mode = side.partition(":")
    sft = params.sft
    lora = dataclasses.replace(sft.lora, base_dtype=dtype)
    sft = dataclasses.replace(sft, lora=lora, max_steps=steps or sft.max_steps,
                              compile=False if mode == "eager" else sft.compile)
    return dataclasses.replace(params, sft=sft)


def paths_for(out: Path) -> SftPaths:
    """The stage's inputs as the workspace has them, its outputs under ``out``."""
    return SftPaths(checkpoints=out / "checkpoints", final=out / "sft",
                    metrics=out / "sft.json", plots=out / "sft.tsv",
                    val_plots=out / "sft_val.tsv")


def train_one(workdir: Path, out: Path, dtype: str, steps: int) -> None:
    """The child: one sft run, then its peak RSS and wall time to ``out/run.json``."""
    os.chdir(workdir)
    started = time.perf_counter()
    run_sft_stage(run_params(workdir, dtype, steps), paths_for(out))
    (out / "run.json").write_text(json.dumps(
        {"peak_rss_mib": round(vm_hwm_mib()), "wall_s": round(time.perf_counter() - started, 1)}))


def vm_hwm_mib() -> float:
    """This process's peak RSS (VmHWM: unlike ``ru_maxrss`` it starts afresh at exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def median_step_seconds(out: Path, tokens_per_step: float) -> float:
    """Seconds per step at the median of the logged steps' tokens/s (plots/sft.tsv):
    without the evals and checkpoints that ``wall_seconds`` includes."""
    rows = [r.split("\t") for r in (out / "sft.tsv").read_text(encoding="utf-8").splitlines()]
    col = rows[0].index("tokens_per_sec")
    return round(tokens_per_step / statistics.median(float(r[col]) for r in rows[1:] if r[col]), 2)


def scores(workdir: Path, out: Path, dtype: str, records: int, batch: int
           ) -> dict[str, Any]:
    """Held-out figures of the merged model, and its logits against the unmerged one's."""
    params = load_params(workdir / "params.yaml")
    test = read_task_records(workdir / params.evaluate_post.test)[:records]
    merged, _ = load_model(out / "sft")
    tok = Tokenizer.load(out / "sft")
    figures = score_responses(merged, tok, test, batch)["response"]["overall"]
    unmerged, _ = load_model(workdir / params.sft.init_from)
    load_adapter(unmerged, out / "sft" / "adapter")
    hold_frozen_in(unmerged, dtype.partition(":")[0])
    diff = 0.0
    with torch.no_grad():
        for rec in test[:16]:
            ids = torch.tensor([tok.encode(" ".join(t for _, t in rec.turns))[:256]])
            diff = max(diff, (merged(ids) - unmerged.eval()(ids)).abs().max().item())
    return {"token_accuracy": figures["token_accuracy"],
            "token_accuracy_stderr": figures["token_accuracy_stderr"],
            "response_loss": figures["loss"], "response_loss_stderr": figures["loss_stderr"],
            "records": figures["n"], "merged_vs_unmerged_max_abs_logit": diff}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, required=True, help="a DVC workspace")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--dtypes", default="fp32,bf16,nf4")
    ap.add_argument("--steps", type=int, default=0, help="sft.max_steps (0: the params')")
    ap.add_argument("--records", type=int, default=120)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    workdir, out = args.workdir.resolve(), args.out.resolve()
    if args.child:
        return train_one(workdir, out / args.child.replace(":", "-"), args.child, args.steps)
    results = out / "results.json"  # a later call adds its sides to an earlier call's
    table = json.loads(results.read_text()) if results.is_file() else {}
    for dtype in args.dtypes.split(","):
        run_dir = out / dtype.replace(":", "-")
        if not (run_dir / "run.json").is_file():  # a rerun keeps finished runs
            run_dir.mkdir(parents=True, exist_ok=True)
            # A fixed mmap threshold returns freed tensors to the OS, so RSS shows what
            # the run holds rather than glibc's retained heap (bench/RESULTS.md, QLoRA).
            env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
            subprocess.run([sys.executable, __file__, "--workdir", str(workdir), "--out",
                            str(out), "--steps", str(args.steps), "--child", dtype],
                           check=True, env=env)
        run = json.loads((run_dir / "run.json").read_text())
        metrics = json.loads((run_dir / "sft.json").read_text())
        table[dtype] = {**run, "steps": metrics["steps"], "val_loss": metrics["val_loss"],
                        "s_per_step": round(metrics["wall_seconds"] / metrics["steps"], 2),
                        "median_step_s": median_step_seconds(
                            run_dir, metrics["tokens"] / metrics["steps"]),
                        **scores(workdir, run_dir, dtype, args.records, args.batch)}
        print(dtype, json.dumps(table[dtype]), flush=True)
    results.write_text(json.dumps(table, indent=1))
    print(json.dumps(table, indent=1))


if __name__ == "__main__":
    main()
