"""Time to quality: each speedrun change alone and the chosen set, on the demo shards.

Variants, each alone on top of the baseline (params.yaml's model and train sections with
AdamW and none of these changes, ``BASELINE``, whatever params.yaml's defaults are):

* ``muon``        ``train.optimizer: muon`` (torch.optim.Muon on the blocks' matrices)
* ``zero_init``   ``model.zero_init_proj: true`` (wo, w2 start at zero)
* ``qk_norm``     ``model.family: qwen3, qk_norm: true`` (exports as Qwen3ForCausalLM)
* ``untied``      ``model.tie_embeddings: false``
* ``stratified``  ``train.batch_sampling: stratified``
* ``wsd``         ``train.schedule: wsd, max_lr: 6e-3`` (the sweep's schedule and AdamW rate)
* ``chosen``      the set named by ``--chosen`` together

Two comparisons (``--modes``):

* ``tokens``: every variant trains ``--steps`` optimizer steps (the same tokens).
* ``wall``: every variant trains for the baseline's wall time: its step count is the
  baseline's wall seconds times its own tokens/s (from its ``tokens`` run) over the tokens
  per step, so each run still completes its whole schedule.

Each run goes through the real loop (``lmforge.train.loop.train``: compile as
``train.compile`` says, checkpoints, the non-finite guard) and is scored by the evaluate
stage's own code (``lmforge.evaluate.scoring``): val bits/byte weighted by the training
mixture with its bootstrap stderr, per domain (on the evaluate stage's windows:
``evaluate.max_batches`` batches; ``--set evaluate.max_batches=0`` scores the whole val
split), plus the median tokens/s of the run. The
baseline runs in the same invocation; ratios are against it. Runs alternate order by
seed (``--seeds``), so slow drift of a shared machine hits all variants alike; still,
wall-time figures want a quiet machine (say what else ran).

``--shape 8x512`` trains a larger model (8 layers, width 512, 8 heads) to see whether
the gains hold as the model grows.

``--nanogpt DIR`` also runs the real upstream nanoGPT ``train.py`` (from a checkout the
user gives; nothing of it is vendored here) side by side on the same train tokens: the
shard streams are written as its ``train.bin``/``val.bin`` (uint16) with a ``meta.pkl``,
it trains the same shape, batch and steps with the baseline's AdamW peak rate, warmup and
cosine (to ``min_lr`` 0, as the demo's ``min_lr_ratio`` 0: nanoGPT's own schedule shape), fp32 on CPU, ``--nanogpt-compile`` as asked; its
final model is scored on the same val windows by the same code as ours, and its training
time (the sum of its own per-iteration times: compile included, process start-up not,
as lmforge's clock starts at ``train()`` with the model build and compile; the whole
process's seconds are reported too) is compared with the time lmforge's chosen set takes
to reach nanoGPT's final val loss (from val losses measured every ``--curve-every`` steps
during lmforge's run, the same mixture-weighted figure on the same val windows for both;
those evals are inside lmforge's clock, so the figure is conservative).

    .venv/bin/python bench/bench_time_to_quality.py [--steps 500] [--modes tokens,wall]
        [--variants baseline,muon,zero_init,qk_norm,untied,stratified,chosen]
        [--chosen muon,zero_init,stratified,wsd] [--shape demo|8x512] [--seeds 1337]
        [--set train.muon_lr=0.03 ...] [--nanogpt /tmp/nanoGPT [--nanogpt-compile]]
        [--threads 2] [--device cpu] [--out results.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pickle
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lmforge.config import Params, load_params
from lmforge.evaluate.scoring import score_split
from lmforge.shards.loader import ShardSet
from lmforge.train.distributed import DistEnv
from lmforge.train.loop import TrainData, evaluate_loss, open_shard_data, train
from lmforge.train.precision import resolve_precision

VARIANTS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "baseline": ({}, {}),
    "muon": ({}, {"optimizer": "muon"}),
    "zero_init": ({"zero_init_proj": True}, {}),
    "qk_norm": ({"family": "qwen3", "qk_norm": True}, {}),
    "untied": ({"tie_embeddings": False}, {}),
    "stratified": ({}, {"batch_sampling": "stratified"}),
    "wsd": ({}, {"schedule": "wsd", "max_lr": 6e-3}),
}
# The baseline every variant starts from, whatever params.yaml's defaults are now: the
# demo's model with AdamW at the rate and cosine schedule it was tuned with before issue
# 24, no speedrun changes.
BASELINE = ({"zero_init_proj": False, "qk_norm": False, "tie_embeddings": True},
            {"optimizer": "adamw", "batch_sampling": "shuffled", "max_lr": 3e-3,
             "schedule": "cosine"})
SHAPES = {"demo": {}, "8x512": {"n_layer": 8, "n_embd": 512, "n_head": 8}}


def variant_params(base: Params, name: str, chosen: list[str], steps: int,
                   curve_every: int, shape: str) -> Params:
    """``base`` reset to the ``BASELINE``, with the variant's (or, for ``chosen``, every
    chosen variant's) changes, the shape, and the bench's cadence (no samples, one
    checkpoint at the end)."""
    parts = chosen if name == "chosen" else [name]
    model_kw: dict[str, Any] = {**BASELINE[0], **SHAPES[shape]}
    train_kw: dict[str, Any] = dict(BASELINE[1])
    for part in parts:
        model_kw.update(VARIANTS[part][0])
        train_kw.update(VARIANTS[part][1])
    train_kw.update(max_steps=steps, eval_every=curve_every, sample_every=0, ckpt_every=steps,
                    light_every=0, keep_last=1, probe_micro_batch=False)
    params = dataclasses.replace(base, model=dataclasses.replace(base.model, **model_kw),
                                 train=dataclasses.replace(base.train, **train_kw))
    params.validate()
    return params


def apply_sets(params: Params, sets: list[str]) -> Params:
    """``--set section.key=value`` overrides (YAML values) on every variant."""
    import yaml

    for item in sets:
        key, _, value = item.partition("=")
        section, _, field = key.partition(".")
        sub = getattr(params, section)
        params = dataclasses.replace(params, **{section: dataclasses.replace(
            sub, **{field: yaml.safe_load(value)})})
    return params


def score(model: torch.nn.Module, data: TrainData, params: Params, device: str) -> dict:
    """Val bits/byte (mixture-weighted, with stderr) and per domain, as the evaluate stage
    computes them (its ``evaluate.max_batches`` x ``batch_size`` windows; 0 = all)."""
    cfg = params.evaluate
    figures = score_split(model, data.val, params.model.seq_len, cfg.batch_size,
                          cfg.max_batches, device=device).as_dict(data.train.domain_shares())
    mix = figures["mix_weighted"]
    return {"bpb": mix["bits_per_byte"], "bpb_stderr": mix["bits_per_byte_stderr"],
            "loss": mix["loss"],
            "domains": {d: f["bits_per_byte"] for d, f in figures["domains"].items()}}


def run_variant(params: Params, data: TrainData, root: Path, env: DistEnv,
                verbose: bool = False) -> dict:
    """Train one variant from scratch; its scores, speed and val curve over wall time
    (``verbose``: the loop's own log lines too)."""
    curve: list[tuple[float, int, float]] = []
    t0 = time.perf_counter()

    def log(line: str) -> None:  # "train: step N: val_loss X" -> (seconds, step, loss)
        if verbose:
            print(line, flush=True)
        m = re.match(r"train: step (\d+): val_loss ([0-9.]+)", line)
        if m:
            curve.append((time.perf_counter() - t0, int(m.group(1)), float(m.group(2))))

    result = train(params, data, root, data.train.tokenizer_sha256, env, track=False, log=log)
    seconds = time.perf_counter() - t0
    curve.append((seconds, result.metrics["steps"], result.metrics["val_loss"]))
    out = score(result.model, data, params, str(env.device))
    out.update(steps=result.metrics["steps"], tokens=result.metrics["tokens"],
               tokens_per_sec=result.metrics["tokens_per_sec"], seconds=round(seconds, 2),
               params=result.metrics["params"], curve=curve)
    return out


def wall_steps(baseline: dict, variant: dict, tokens_per_step: int) -> int:
    """Steps that fit in the baseline's wall time at the variant's own speed."""
    return max(2, int(baseline["seconds"] * variant["tokens"] / variant["seconds"]
                      / tokens_per_step))


# --------------------------------------------------------------------------- nanoGPT

def nanogpt_data(shards_dir: Path, out: Path) -> int:
    """The train and val token streams as nanoGPT's ``train.bin`` / ``val.bin`` (uint16,
    in shard order: the same tokens ours trains on) and its ``meta.pkl``; the vocab."""
    out.mkdir(parents=True, exist_ok=True)
    vocab = 0
    for split in ("train", "val"):
        shards = ShardSet(shards_dir / split)
        if shards.vocab_size > 65536:
            sys.exit("bench_time_to_quality: nanoGPT reads uint16 tokens; vocab too large")
        vocab = shards.vocab_size
        shards.read(0, shards.num_tokens).astype(np.uint16).tofile(out / f"{split}.bin")
    with open(out / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": vocab}, f)
    return vocab


def run_nanogpt(checkout: Path, shards_dir: Path, params: Params, work: Path,
                compile_: bool, threads: int) -> tuple[Path, float, float]:
    """Upstream train.py, unmodified, from a work dir that holds its data and a link to
    its configurator.py (train.py reads both relative to the working directory).

    Returns (its checkpoint after ``max_steps`` steps, the whole process's seconds, and
    its training loop's seconds: the sum of its own per-iteration times over those steps,
    which include its compile (first iteration) but not its start-up, as lmforge's clock
    starts at ``train()``)."""
    nanogpt_data(shards_dir, work / "data" / "lmforge")
    link = work / "configurator.py"
    if not link.exists():
        link.symlink_to(checkout / "configurator.py")
    m, t = params.model, params.train
    steps = t.max_steps
    args = {
        "dataset": "lmforge", "out_dir": str(work / "out"), "device": "cpu",
        "dtype": "float32", "compile": compile_, "n_layer": m.n_layer, "n_head": m.n_head,
        "n_embd": m.n_embd, "block_size": m.seq_len, "bias": False, "dropout": 0.0,
        "batch_size": t.micro_batch_size, "gradient_accumulation_steps": t.grad_accum_steps,
        "learning_rate": float(t.max_lr), "min_lr": float(t.max_lr * t.min_lr_ratio),
        "warmup_iters": t.warmup_steps(), "lr_decay_iters": steps, "max_iters": steps,
        "weight_decay": float(t.weight_decay), "beta1": float(t.beta1),
        "beta2": float(t.beta2), "grad_clip": float(t.grad_clip),
        # One eval (and save) at max_iters: the model after exactly `steps` steps.
        "eval_interval": steps, "eval_iters": 1, "always_save_checkpoint": True,
        "log_interval": 1, "wandb_log": False,
    }
    argv = [f"--{k}={v}" for k, v in args.items()]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, str(checkout / "train.py"), *argv], cwd=work,
                          env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if proc.returncode:
        sys.exit(f"bench_time_to_quality: nanoGPT train.py failed:\n{proc.stderr[-2000:]}")
    loop = sum(float(ms) for it, ms in re.findall(r"iter (\d+): loss \S+, time ([0-9.]+)ms",
                                                   proc.stdout) if int(it) < steps) / 1000
    return work / "out" / "ckpt.pt", seconds, loop


class NanoLogits(torch.nn.Module):
    """nanoGPT's GPT as a logits function of ``(idx)``: given targets it returns logits
    for every position (without, only the last), so dummy targets are passed."""

    def __init__(self, gpt: torch.nn.Module) -> None:
        super().__init__()
        self.gpt = gpt

    def forward(self, idx: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        return self.gpt(idx, torch.zeros_like(idx))[0]


def load_nanogpt_model(checkout: Path, ckpt: Path) -> torch.nn.Module:
    sys.path.insert(0, str(checkout))
    try:
        from model import GPT, GPTConfig  # nanoGPT's model.py
    finally:
        sys.path.pop(0)
    state = torch.load(ckpt, map_location="cpu", weights_only=False)
    gpt = GPT(GPTConfig(**state["model_args"]))
    gpt.load_state_dict({k.removeprefix("_orig_mod."): v for k, v in state["model"].items()})
    return NanoLogits(gpt.eval())


def side_by_side(args: argparse.Namespace, params: Params, ours: dict, data: TrainData,
                 env: DistEnv, work: Path) -> dict:
    """nanoGPT on the same tokens; its score and lmforge's time to reach its val loss."""
    checkout = Path(args.nanogpt)
    ckpt, process_seconds, seconds = run_nanogpt(checkout, Path(args.shards), params, work,
                                                 args.nanogpt_compile, args.threads)
    model = load_nanogpt_model(checkout, ckpt)
    theirs = score(model, data, params, "cpu")
    theirs["seconds"] = round(seconds, 2)  # its training loop, compile included
    theirs["process_seconds"] = round(process_seconds, 2)
    theirs["params"] = sum(p.numel() for p in model.parameters())
    # The same val figure as lmforge's curve (mixture-weighted, the same windows).
    precision = resolve_precision("fp32", env.device)
    target = evaluate_loss(model, data, params, precision, env)
    reached = next((s for s, _, loss in ours["curve"] if loss <= target), None)
    return {"nanogpt": theirs, "nanogpt_val_loss": target,
            "lmforge_seconds_to_nanogpt_loss": reached,
            "time_ratio": reached / seconds if reached else None,
            "bpb_ratio": ours["bpb"] / theirs["bpb"]}


# --------------------------------------------------------------------------- main

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--shards", default="data/shards", help="holds train/ and val/")
    ap.add_argument("--steps", type=int, default=0, help="0 = params.yaml train.max_steps")
    ap.add_argument("--modes", default="tokens,wall")
    ap.add_argument("--variants", default=",".join([*VARIANTS, "chosen"]))
    ap.add_argument("--chosen", default="muon,zero_init,stratified,wsd")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="demo")
    ap.add_argument("--seeds", default="", help="comma-separated; default train.seed")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    ap.add_argument("--curve-every", type=int, default=0,
                    help="val loss every N steps (default: steps/10 with --nanogpt, else 0)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--nanogpt", default=os.environ.get("NANOGPT_DIR"),
                    help="a nanoGPT checkout: run its train.py side by side")
    ap.add_argument("--nanogpt-compile", action="store_true")
    ap.add_argument("--out", default="", help="write every figure as JSON here")
    ap.add_argument("--reuse", default="", metavar="JSON",
                    help="an earlier --out of the same steps and shape: its runs are not "
                         "trained again (e.g. --modes tokens,wall after a tokens-only run)")
    ap.add_argument("--verbose", action="store_true", help="print the loop's log lines")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    base = apply_sets(load_params(args.params), args.set)
    steps = args.steps or base.train.max_steps
    curve_every = args.curve_every or (max(1, steps // 10) if args.nanogpt else 0)
    names = [v for v in args.variants.split(",") if v]
    chosen = [v for v in args.chosen.split(",") if v]
    seeds = [int(s) for s in args.seeds.split(",") if s] or [base.train.seed]
    modes = [m for m in args.modes.split(",") if m]
    if args.nanogpt and ("chosen" not in names or "tokens" not in modes):
        sys.exit("bench_time_to_quality: --nanogpt compares with the chosen set's tokens run; "
                 "keep chosen in --variants and tokens in --modes")
    if "wall" in modes and ("tokens" not in modes or "baseline" not in names):
        sys.exit("bench_time_to_quality: --modes wall needs the tokens runs (and the "
                 "baseline's) for the speeds and the time budget")
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device(args.device))
    data = open_shard_data(Path(args.shards) / "train", Path(args.shards) / "val")
    results: dict[str, Any] = {"steps": steps, "shape": args.shape, "chosen": chosen,
                               "seeds": seeds, "sets": args.set, "runs": {}}
    if args.reuse:
        results["runs"] = reused_runs(Path(args.reuse), results)
    with tempfile.TemporaryDirectory() as tmp:
        for i, seed in enumerate(seeds):
            order = names if i % 2 == 0 else names[::-1]
            for mode in modes:
                for name in order:
                    key = f"{name}/{mode}/seed{seed}"
                    n = steps
                    if key in results["runs"]:
                        report(key, results["runs"][key], results["runs"].get(
                            f"baseline/{mode}/seed{seed}"))
                        continue
                    if mode == "wall":
                        base_run = results["runs"][f"baseline/tokens/seed{seed}"]
                        own = results["runs"][f"{name}/tokens/seed{seed}"]
                        p = variant_params(base, name, chosen, steps, 0, args.shape)
                        tps = (p.train.micro_batch_size * p.train.grad_accum_steps
                               * p.model.seq_len)
                        n = wall_steps(base_run, own, tps)
                        if n == own["steps"]:  # the same run as the tokens one: reuse it
                            results["runs"][key] = own
                            report(key, own, results["runs"].get(f"baseline/{mode}/seed{seed}"))
                            continue
                    p = variant_params(base, name, chosen, n,
                                       curve_every if mode == "tokens" else 0, args.shape)
                    p = dataclasses.replace(p, train=dataclasses.replace(p.train, seed=seed))
                    results["runs"][key] = run_variant(p, data, Path(tmp) / key, env,
                                                       args.verbose)
                    report(key, results["runs"][key], results["runs"].get(
                        f"baseline/{mode}/seed{seed}"))
        if args.nanogpt:
            ours = results["runs"][f"chosen/tokens/seed{seeds[0]}"]
            # nanoGPT gets the baseline's AdamW rate and cosine schedule (its own shape).
            p = variant_params(base, "baseline", chosen, steps, 0, args.shape)
            results["side_by_side"] = side_by_side(args, p, ours, data, env,
                                                   Path(tmp) / "nanogpt")
            print(json.dumps(results["side_by_side"], indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1), encoding="utf-8")


def reused_runs(path: Path, results: dict[str, Any]) -> dict[str, Any]:
    """The runs of an earlier ``--out`` file made with the same steps, shape and ``--set``
    overrides (else its figures would answer another question); its ``chosen`` runs only
    if it chose the same set."""
    earlier = json.loads(path.read_text(encoding="utf-8"))
    for k in ("steps", "shape", "sets"):
        if earlier.get(k) != results[k]:
            sys.exit(f"bench_time_to_quality: {path}: {k} {earlier.get(k)!r} differs from "
                     f"this run's {results[k]!r}")
    runs = {k: v for k, v in earlier["runs"].items()
            if earlier["chosen"] == results["chosen"] or not k.startswith("chosen/")}
    print(f"reused from {path}: {', '.join(runs)}", flush=True)
    return runs


def report(key: str, run: dict, baseline: dict | None) -> None:
    """One line per run: bits/byte +- stderr, per domain, speed, against the baseline."""
    ratio = ""
    if baseline is not None and baseline is not run:
        ratio = (f" | vs baseline: bpb {run['bpb'] - baseline['bpb']:+.4f}, tok/s "
                 f"{run['tokens_per_sec'] / baseline['tokens_per_sec']:.2f}x")
    domains = " ".join(f"{d} {v:.3f}" for d, v in run["domains"].items())
    print(f"{key:28s} steps {run['steps']:5d} | val bpb {run['bpb']:.4f} "
          f"+- {run['bpb_stderr']:.4f} | {run['tokens_per_sec'] or math.nan:,.0f} tok/s | "
          f"{run['seconds']:.0f} s | {domains}{ratio}", flush=True)


if __name__ == "__main__":
    main()
