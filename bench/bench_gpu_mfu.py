"""MFU of lmforge's training step on one GPU: a GPT-2-small-sized (124M) Llama in bf16.

The prepared check for a lent GPU (issue 44: >= 1.1x nanoGPT's tokens/s, >= 45 % MFU, FSDP
>= 0.9x the plain step). It runs the real step (``Llama`` + ``build_optimizer`` + the
loop's ``optimizer_step``: loss, accumulation, clipping, the non-finite guard), compiled
as ``train.compile: auto`` does, fed by the real ``WindowLoader`` over a temporary shard
set of random tokens. Figures, all measured in the same run:

* tokens/s and achieved model TFLOP/s (6 N + 12 L d T per token, PaLM appendix B);
* MFU against the device's dense bf16 peak from its spec sheet (``telemetry.PEAK_FLOPS``),
  and against a large bf16 matmul timed here first (the practical ceiling);
* each for the plain module (what DDP wraps) and for FSDP2 (``train.strategy: fsdp``, on
  a one-process mesh: gather/reshard hooks, per-block compile, bf16 parameters with fp32
  reduction), their ratio, each step's peak memory beside ``lmforge plan``'s estimate;
* ``--nanogpt DIR``: upstream nanoGPT's ``train.py`` (a checkout; nothing of it is
  vendored here) run as a subprocess on the same device with the same shape, batch, dtype
  and compile, over random tokens; the median of its iterations 5-40 as tokens/s, and
  lmforge's plain step over it;
* ``--profile FILE``: the top 15 CUDA kernels by self time of lmforge's step (a few steps
  after the timed ones; on a CPU the top CPU ops);
* ``--json FILE``: every figure above in one document, written after each part, so a
  part that fails (recorded under ``errors``) loses none of the others.

The whole GPU check in one line, at most ~7 minutes on one GPU with its compiles (the
nanoGPT checkout in ``.nanogpt/``, as bench/RESULTS.md's "GPU MFU" section sets up):

    PYTHONPATH=src python3 bench/bench_gpu_mfu.py --all --out "$OUT"

Other uses:

    .venv/bin/python bench/bench_gpu_mfu.py                      # 124M, bf16, plain + fsdp
    .venv/bin/python bench/bench_gpu_mfu.py --micro 32 --steps 40 --strategy plain
    .venv/bin/python bench/bench_gpu_mfu.py --tiny --device cpu  # smoke test of the script
"""

from __future__ import annotations

import argparse
import ast
import gc
import gzip
import hashlib
import json
import os
import pickle
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity

from lmforge.config import ModelConfig, TrainConfig
from lmforge.model import loss as loss_module
from lmforge.model.compiling import before_compile
from lmforge.model.llama import Llama
from lmforge.model.loss import LIGER, WHOLE
from lmforge.plan import Setup, plan
from lmforge.shards.loader import ShardSet, WindowLoader
from lmforge.shards.writer import write_shards
from lmforge.train.compiler import resolve_compile
from lmforge.train.distributed import DistEnv
from lmforge.train.fsdp import build_sharded, compiled_scope, ensure_process_group
from lmforge.train.loss_choice import describe, fused_loss_for_run
from lmforge.train.optim import build_optimizer
from lmforge.train.precision import Precision, resolve_precision
from lmforge.train.step import optimizer_step
from lmforge.train.telemetry import memory_mb, peak_flops

REPO = Path(__file__).resolve().parents[1]
# GPT-2 small's shape (12 x 768, 12 heads, 1024 context, 50,304 = 50,257 padded to 64).
GPT2_SMALL = {"n_layer": 12, "n_head": 12, "n_embd": 768, "seq_len": 1024, "vocab": 50304}
TINY = {"n_layer": 2, "n_head": 4, "n_embd": 64, "seq_len": 64, "vocab": 512}
GIB = 1 << 30
MIB = 1 << 20
PROFILE_ROWS = 15
# Issue 44 compared the median of nanoGPT's iterations 5-40: train.py's own log skips the
# first five for its MFU ("let the training loop settle"), iteration 0 holds its compile.
NANOGPT_WINDOW = (5, 40)
NANOGPT_DATASET = "lmforge_random"
# train.py's lines, copied from its print statements (karpathy/nanoGPT, train.py, model.py):
#   print(f"iter {iter_num}: loss {lossf:.4f}, time {dt*1000:.2f}ms, mfu {running_mfu*100:.2f}%")
#   print(f"tokens per iteration will be: {tokens_per_iter:,}")
#   print("number of parameters: %.2fM" % (self.get_num_params()/1e6,))
NANOGPT_ITER = re.compile(
    r"^iter (\d+): loss (\S+), time ([\d.]+)ms, mfu (-?[\d.]+)%\s*$", re.M)
NANOGPT_TOKENS = re.compile(r"^tokens per iteration will be: ([\d,]+)\s*$", re.M)
NANOGPT_PARAMS = re.compile(r"^number of parameters: ([\d.]+)M\s*$", re.M)
NANOGPT_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
# --fused-loss -> train.fused_loss (auto: what a run resolves; liger needs liger_kernel).
FUSED_LOSS: dict[str, bool | str] = {"auto": "auto", "true": True, "false": False}


# --------------------------------------------------------------------------- lmforge's step


def random_shards(root: Path, vocab: int, tokens: int) -> ShardSet:
    """Random tokens in 1,000-token documents: speed does not depend on the text."""
    rng = np.random.default_rng(0)
    flat = rng.integers(3, vocab, tokens, dtype=np.int64)
    docs = np.split(flat, np.arange(1000, tokens, 1000))
    write_shards(root, [d.tolist() for d in docs], vocab, shard_tokens=1 << 22)
    return ShardSet(root)


def matmul_ceiling(device: torch.device, dtype: torch.dtype, n: int, repeats: int = 20) -> float:
    """FLOP/s of an n x n x n matmul in ``dtype``: what the device really reaches."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(repeats):
        a @ b
    _sync(device)
    return 2 * n**3 * repeats / (time.perf_counter() - t0)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Step:
    """One strategy's training step, built and ready to run on a loader."""

    step_model: torch.nn.Module
    model: Any
    optimizer: torch.optim.Optimizer
    precision: Precision
    cfg: TrainConfig
    mcfg: ModelConfig
    env: DistEnv
    how: str

    def __post_init__(self) -> None:
        self.scaler = self.precision.grad_scaler()

    def run(self, loader: WindowLoader) -> float:
        """One optimizer step (the loop's ``optimizer_step``) -> its mean loss."""
        loss, _, _ = optimizer_step(self.step_model, None, self.model, self.optimizer,
                                    self.scaler, self.precision, loader,
                                    self.cfg.grad_accum_steps, self.cfg.grad_clip, self.env)
        return loss


def build_step(strategy: str, args: argparse.Namespace, device: torch.device, shape: dict,
               micro: int) -> Step:
    """The step of ``strategy`` (``plain``: the module one process trains and DDP wraps;
    ``fsdp``: FSDP2 over a one-process mesh, built on meta, blocks compiled)."""
    mcfg = ModelConfig(n_layer=shape["n_layer"], n_head=shape["n_head"],
                       n_embd=shape["n_embd"], seq_len=shape["seq_len"])
    cfg = TrainConfig(max_steps=10_000, micro_batch_size=micro, grad_accum_steps=args.accum,
                      precision=args.precision, warmup=0, fused_loss=FUSED_LOSS.get(args.fused_loss, True),
                      strategy="fsdp" if strategy == "fsdp" else "ddp")
    precision = resolve_precision(cfg.precision, device)
    requested = {"auto": "auto", "true": True, "false": False}[args.compile]
    compiled, how = resolve_compile(requested, device)
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=device)
    torch.manual_seed(0)
    if strategy == "fsdp":
        ensure_process_group(env)
        model = build_sharded(mcfg, shape["vocab"], env, precision.name == "bf16",
                              compile_blocks=compiled)
        step_model = model
        how += f" {compiled_scope(env.world_size)}" if compiled else ""
    else:
        model = Llama(mcfg, shape["vocab"]).to(device)
        if compiled:
            before_compile()
        step_model = (torch.compile(model, mode=args.compile_mode) if compiled else model)
        how += f" ({args.compile_mode})" if compiled and args.compile_mode else ""
    # The loss as a run resolves train.fused_loss (the loop's call): auto probes on CUDA.
    model.fused_loss = (LIGER if args.fused_loss == LIGER else fused_loss_for_run(
        cfg, mcfg, model, precision, env, compiled, micro, print))
    how += f"; {describe(model.fused_loss, cfg.fused_loss)}"
    optimizer = build_optimizer(model, cfg, device)
    for group in optimizer.param_groups:
        group["lr"] = 3e-4
    return Step(step_model, model, optimizer, precision, cfg, mcfg, env, how)


def plan_estimate(step: Step, strategy: str, vocab: int, micro: int,
                  device: torch.device) -> dict[str, Any]:
    """``lmforge plan``'s figures for this step (the same shape, batch and knobs), so the
    estimate stands beside the measured peak; every row comes along, new ones too."""
    # The loss the step runs (auto resolved by the probe), not the key: Setup takes a
    # bool, and the string "auto" would plan the chunked loss whatever the run took.
    setup = Setup(model=step.mcfg, vocab=vocab, precision=step.precision.name, world=1,
                  activation_checkpointing=step.cfg.activation_checkpointing,
                  # The whole path holds the plain loss's logits (16-bit): planned as it.
                  fused_loss=step.model.fused_loss not in (False, WHOLE),
                  optimizer=step.cfg.optimizer)
    # The device's size only decides 'fits'; a CPU gets the command's default of 80 GiB.
    device_gib = (torch.cuda.get_device_properties(device).total_memory / GIB
                  if device.type == "cuda" else 80.0)
    return plan(setup, device_gib, micro)["fsdp" if strategy == "fsdp" else "ddp"]


def time_steps(step: Step, loader: WindowLoader, n: int, device: torch.device,
               synced: bool = True) -> tuple[list[float], list[float]]:
    """Seconds and loss of each of ``n`` steps.

    ``synced``: the device drained before and after each step, so each is timed alone,
    its launch latency included. Otherwise back to back, as the training loop runs them:
    the host waits only for what a step reads back (lmforge's loss and grad norm,
    ``HostRead``, with the update still queued; nanoGPT's ``loss.item()``), and each
    step's time is the host's interval from the previous step's return, the device
    drained once at the end (that wait is the last step's)."""
    times, losses = [], []
    _sync(device)
    last = time.perf_counter()
    for _ in range(n):
        if synced:
            _sync(device)
            last = time.perf_counter()
        loss = step.run(loader)
        if synced:
            _sync(device)
        now = time.perf_counter()
        times.append(now - last)
        losses.append(loss)
        last = now
    if not synced and n:
        _sync(device)
        times[-1] += time.perf_counter() - last
    return times, losses


def measure(strategy: str, args: argparse.Namespace, device: torch.device, shape: dict,
            micro: int, profile_steps: int = 0, trace: Path | None = None) -> dict:
    """Time the training step of ``strategy``; with ``profile_steps``, profile that many
    more steps after the timed ones (the ``profile`` entry: rows and the ops table)."""
    gc.collect()
    before = torch.cuda.memory_allocated(device) / MIB if device.type == "cuda" else 0.0
    step = build_step(strategy, args, device, shape, micro)
    tokens_per_step = micro * args.accum * step.mcfg.seq_len
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with tempfile.TemporaryDirectory() as tmp:
        # The same data for every strategy, profiled or not (the window order depends on
        # the set's size), so their losses compare.
        steps = args.warmup + 2 * args.steps + args.profile_steps + 2
        loader = WindowLoader(random_shards(Path(tmp), shape["vocab"], tokens_per_step * steps),
                              step.mcfg.seq_len, micro, seed=0)
        t0 = time.perf_counter()
        for _ in range(args.warmup):
            step.run(loader)
        warmup_s = time.perf_counter() - t0
        synced, _ = time_steps(step, loader, args.steps, device, synced=True)
        times, losses = time_steps(step, loader, args.steps, device, synced=False)
        memory = memory_mb(device)  # before the profiler's own buffers
        profile = None
        if profile_steps:
            try:
                profile = profile_step(step, loader, profile_steps, device, trace)
            except Exception as e:  # a profiler failure must not lose the step's figures
                traceback.print_exc()
                profile = {"error": f"{type(e).__name__}: {e}"}
    return {"strategy": strategy, "precision": step.precision.name, "how": step.how,
            "params": step.model.num_params(), "flops_per_token": step.model.flops_per_token(),
            "tokens_per_step": tokens_per_step, "warmup_s": warmup_s,
            "step_ms_median": statistics.median(times) * 1000,
            "tok_s": tokens_per_step / statistics.median(times), "losses": losses,
            "step_ms_synced": statistics.median(synced) * 1000,
            "tok_s_synced": tokens_per_step / statistics.median(synced),
            "memory_mb": memory, "allocated_before_mb": before,
            "memory_of": ("CUDA max_memory_allocated since the model was built"
                          if device.type == "cuda" else "the process's peak RSS"), "seq_len": step.mcfg.seq_len,
            "plan": plan_estimate(step, strategy, shape["vocab"], micro, device),
            "profile": profile}


def free_compiled(device: torch.device) -> None:
    """Drop the last step's compiled graphs and cached blocks, so the next strategy's peak
    memory is its own (Dynamo's caches can keep the previous model's weights alive)."""
    gc.collect()
    torch.compiler.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------- profile


def profile_step(step: Step, loader: WindowLoader, n: int, device: torch.device,
                 trace: Path | None = None) -> dict[str, Any]:
    """``n`` steps under ``torch.profiler``: the top kernels (CPU ops on a CPU) by self
    time, and the profiler's own table of ops, as :func:`format_profile` writes them;
    with ``trace``, the timeline too (a gzipped Chrome trace: where the GPU waits for
    the host, and what the host was doing then)."""
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(n):
            step.run(loader)
        _sync(device)
    if trace is not None:
        write_trace(prof, trace)
    events = prof.key_averages()
    sort = "self_device_time_total" if cuda else "self_cpu_time_total"
    busy = (sum(e.self_device_time_total for e in events if is_kernel(e))
            if cuda else sum(e.self_cpu_time_total for e in events))
    return {"kind": "CUDA kernels" if cuda else "CPU ops", "steps": n,
            # The device's busy time a step: against the timed step, the idle share.
            "busy_ms_per_step": busy / 1000 / max(n, 1),
            "top": top_events(events, cuda, n),
            "ops_table": events.table(sort_by=sort, row_limit=PROFILE_ROWS)}


def write_trace(prof: Any, path: Path) -> None:
    """The profiler's Chrome trace, gzipped (a few MB raw for three steps)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(raw))
        with raw.open("rb") as src, gzip.open(path, "wb") as dst:
            shutil.copyfileobj(src, dst)


def is_kernel(event: Any) -> bool:
    """A device event that is work (a kernel, memcpy, memset), not a profiler range such
    as ``Optimizer.step#AdamW.step`` or ``FSDP::pre_forward``, whose device time is that
    of the kernels inside it, counted already."""
    return (event.device_type == DeviceType.CUDA
            and not getattr(event, "is_user_annotation", False))


def top_events(events: Any, cuda: bool, steps: int, k: int = PROFILE_ROWS) -> list[dict]:
    """The ``k`` events with the most self time: on CUDA the kernels (and memcpy/memset)
    the device ran, on a CPU the CPU ops; each with its share of all such time."""
    if cuda:
        chosen = [(e, e.self_device_time_total) for e in events if is_kernel(e)]
    else:
        chosen = [(e, e.self_cpu_time_total) for e in events]
    total = sum(us for _, us in chosen) or 1.0
    chosen.sort(key=lambda pair: -pair[1])
    return [{"name": e.key, "calls": e.count, "self_ms": us / 1000,
             "ms_per_step": us / 1000 / max(steps, 1), "share": us / total}
            for e, us in chosen[:k]]


def format_profile(profile: dict, title: str) -> str:
    """The profile file: the top-k table, then the profiler's own table of ops."""
    lines = [title, f"top {len(profile['top'])} {profile['kind']} by self time over "
                    f"{profile['steps']} steps; busy {profile.get('busy_ms_per_step', 0):.2f} "
                    "ms a step in all", "",
             f"{'#':>3}  {'ms/step':>9}  {'share':>6}  {'calls':>6}  name"]
    for i, row in enumerate(profile["top"], 1):
        name = row["name"] if len(row["name"]) <= 140 else row["name"][:137] + "..."
        lines.append(f"{i:>3}  {row['ms_per_step']:>9.3f}  {row['share']:>6.1%}  "
                     f"{row['calls']:>6}  {name}")
    lines += ["", f"the profiler's table (ops, sorted by self time, {PROFILE_ROWS} rows):",
              profile["ops_table"]]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- nanoGPT


def nanogpt_overrides(shape: dict, micro: int, accum: int, device: torch.device,
                      precision: str, compiled: bool, iters: int, out_dir: Path) -> list[str]:
    """train.py's ``--key=value`` overrides (its configurator.py): lmforge's shape, batch,
    dtype and compile; offline (a random dataset, no wandb) and brief (one eval batch at
    iteration 0, which train.py always runs; no checkpoint; ``iters`` + 1 iterations)."""
    values = {"dataset": NANOGPT_DATASET, "init_from": "scratch", "device": str(device),
              "dtype": NANOGPT_DTYPES[precision], "compile": compiled, "batch_size": micro,
              "gradient_accumulation_steps": accum, "block_size": shape["seq_len"],
              "n_layer": shape["n_layer"], "n_head": shape["n_head"],
              "n_embd": shape["n_embd"], "bias": False, "dropout": 0.0, "max_iters": iters,
              "eval_interval": 1_000_000, "eval_iters": 1, "log_interval": 1,
              "always_save_checkpoint": False, "out_dir": str(out_dir), "wandb_log": False}
    return [f"--{key}={value}" for key, value in values.items()]


def write_nanogpt_data(folder: Path, vocab: int, tokens: int) -> None:
    """Random ``train.bin``/``val.bin`` (uint16, as train.py memory-maps them) and a
    ``meta.pkl`` whose ``vocab_size`` train.py takes for the model."""
    if vocab > 1 << 16:
        raise ValueError(f"nanoGPT reads uint16 tokens; vocab {vocab} does not fit")
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        rng.integers(0, vocab, tokens, dtype=np.uint16).tofile(folder / f"{split}.bin")
    with open(folder / "meta.pkl", "wb") as fh:
        pickle.dump({"vocab_size": vocab}, fh)


def parse_nanogpt_log(text: str) -> dict[str, Any]:
    """train.py's output -> per-iteration ms and loss, tokens per iteration and its
    parameter count (what its own MFU uses: position embeddings excluded)."""
    iters = {int(m[1]): float(m[3]) for m in NANOGPT_ITER.finditer(text)}
    losses = {int(m[1]): float(m[2]) for m in NANOGPT_ITER.finditer(text)}
    tokens = NANOGPT_TOKENS.search(text)
    params = NANOGPT_PARAMS.search(text)
    return {"iter_ms": iters, "losses": losses,
            "tokens_per_iter": int(tokens[1].replace(",", "")) if tokens else None,
            "params": float(params[1]) * 1e6 if params else None}


def window_median(iter_ms: dict[int, float], first: int, last: int) -> tuple[float, int]:
    """Median ms of the iterations ``first``..``last`` (inclusive) and how many there were."""
    window = [ms for it, ms in iter_ms.items() if first <= it <= last]
    if not window:
        raise ValueError(f"nanoGPT logged no iteration in {first}..{last} "
                         f"(logged: {sorted(iter_ms)[:3]}..)")
    return statistics.median(window), len(window)


def nanogpt_figures(log: dict[str, Any], shape: dict, window: tuple[int, int]) -> dict:
    """Tokens/s from the window's median iteration, and model FLOPs per token by the same
    formula as lmforge's (6 N + 12 L d T, N without position embeddings)."""
    ms, used = window_median(log["iter_ms"], *window)
    if not log["tokens_per_iter"]:
        raise ValueError("nanoGPT's log has no 'tokens per iteration will be:' line")
    flops = (6 * log["params"] + 12 * shape["n_layer"] * shape["n_embd"] * shape["seq_len"]
             if log["params"] else None)
    return {"ms_median": ms, "iterations": used, "window": list(window),
            "tokens_per_iter": log["tokens_per_iter"],
            "tok_s": log["tokens_per_iter"] / (ms / 1000), "params": log["params"],
            "flops_per_token": flops, "loss_last": log["losses"][max(log["losses"])]}


def run_nanogpt(directory: Path, overrides: list[str], shape: dict, tokens: int,
                timeout: float, log_path: Path | None) -> tuple[str, int | None, float]:
    """Run ``directory/train.py`` in a temporary folder holding ``data/<dataset>/`` and a
    copy of configurator.py (train.py reads both relative to its working directory) ->
    (its output, return code or None on timeout, wall seconds)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        write_nanogpt_data(work / "data" / NANOGPT_DATASET, shape["vocab"], tokens)
        shutil.copy(directory / "configurator.py", work)
        log = log_path or work / "nanogpt.log"
        cmd = [sys.executable, str(directory / "train.py"), *overrides]
        t0 = time.perf_counter()
        with open(log, "w", encoding="utf-8") as fh:
            fh.write("$ " + " ".join(cmd) + "\n")
            fh.flush()
            try:
                rc = subprocess.run(cmd, cwd=work, stdout=fh, stderr=subprocess.STDOUT,
                                    env=env, timeout=timeout).returncode
            except subprocess.TimeoutExpired:
                rc = None
        return log.read_text(encoding="utf-8"), rc, time.perf_counter() - t0


def measure_nanogpt(args: argparse.Namespace, device: torch.device, shape: dict, micro: int,
                    precision: str, compiled: bool) -> dict:
    """nanoGPT's train.py on the same device and shape -> its figures (tokens/s, ...)."""
    directory = Path(args.nanogpt).resolve()
    with tempfile.TemporaryDirectory() as out_dir:
        overrides = nanogpt_overrides(shape, micro, args.accum, device, precision, compiled,
                                      args.nanogpt_iters, Path(out_dir))
        # Random windows are drawn anywhere in train.bin: a few MB is plenty.
        tokens = max(1 << 20, 4 * shape["seq_len"])
        text, rc, wall = run_nanogpt(directory, overrides, shape, tokens,
                                     args.nanogpt_timeout, args.nanogpt_log)
    if rc != 0:
        tail = "\n".join(text.splitlines()[-15:])
        what = f"timed out after {args.nanogpt_timeout:g} s" if rc is None else f"exited {rc}"
        raise RuntimeError(f"nanoGPT train.py {what}; its last lines:\n{tail}")
    out = nanogpt_figures(parse_nanogpt_log(text), shape, NANOGPT_WINDOW)
    commit = directory / "COMMIT"
    out.update(wall_s=wall, train_py=str(directory / "train.py"),
               overrides=[o for o in overrides if not o.startswith("--out_dir=")],
               commit=commit.read_text().strip() if commit.is_file() else None)
    return out


def profile_nanogpt(args: argparse.Namespace, device: torch.device, shape: dict, micro: int,
                    precision: str, compiled: bool) -> dict[str, Any]:
    """nanoGPT's own model (the checkout's model.py: its GPT, its fused AdamW) stepped as
    its train.py steps it, in this process and profiled as lmforge's step is: where its
    time goes, kernel by kernel, beside lmforge's. Also its median step over ``--steps``
    (a cross-check of the subprocess's figure, not the figure compared)."""
    sys.path.insert(0, str(Path(args.nanogpt).resolve()))
    try:
        import model as nanogpt_model  # the checkout's model.py
    finally:
        sys.path.pop(0)
    torch.manual_seed(0)
    conf = nanogpt_model.GPTConfig(block_size=shape["seq_len"], vocab_size=shape["vocab"],
                                   n_layer=shape["n_layer"], n_head=shape["n_head"],
                                   n_embd=shape["n_embd"], dropout=0.0, bias=False)
    gpt = nanogpt_model.GPT(conf).to(device)
    optimizer = gpt.configure_optimizers(0.1, 6e-4, (0.9, 0.95), device.type)
    step_model = torch.compile(gpt) if compiled else gpt
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    windows = [torch.randint(shape["vocab"], (micro, shape["seq_len"] + 1), device=device)
               for _ in range(4)]
    batches = [(w[:, :-1].contiguous(), w[:, 1:].contiguous()) for w in windows]

    calls = [0]

    def run(_loader: Any) -> float:
        """train.py's iteration (accumulation 1), what profile_step runs."""
        x, y = batches[calls[0] % len(batches)]
        calls[0] += 1
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            _, loss = step_model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(gpt.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()  # train.py's lossf: one sync an iteration

    step = SimpleNamespace(run=run)
    for _ in range(args.warmup):
        step.run(None)
    # Back to back, as train.py runs it (its loss.item() is its one sync a step).
    times, _ = time_steps(step, None, args.steps, device,  # type: ignore[arg-type]
                          synced=False)
    prof = profile_step(step, None, args.profile_steps, device)  # type: ignore[arg-type]
    ms = statistics.median(times) * 1000
    title = (f"nanoGPT model.py in-process profile: {shape}, batch {micro}x{shape['seq_len']}, "
             f"{precision}, {'compiled' if compiled else 'eager'}; timed {ms:.2f} ms a step")
    path = profile_path(args, "profile_nanogpt")
    path.write_text(format_profile(prof, title), encoding="utf-8")
    return {"file": str(path), "step_ms_median": ms,
            "tok_s": micro * shape["seq_len"] / (ms / 1000),
            "busy_ms_per_step": prof["busy_ms_per_step"], "top": prof["top"]}


# --------------------------------------------------------------------------- figures


def strategy_figures(r: dict, peak: float | None, ceiling: float) -> dict:
    """What the JSON keeps of one strategy's measurement."""
    flops = r["flops_per_token"] * r["tok_s"]
    plan_mib = r["plan"]["total"] / MIB
    # The plan's compiled total where the step compiles (the plain loss fused by Inductor).
    planned_mib = (r["plan"]["total_compiled"] if "compiled" in r["how"] else r["plan"]["total"]) / MIB
    return {"tok_s": r["tok_s"], "step_ms_median": r["step_ms_median"],
            "tok_s_synced": r["tok_s_synced"], "step_ms_synced": r["step_ms_synced"],
            "tflops": flops / 1e12, "mfu_spec": flops / peak if peak else None,
            "mfu_matmul": flops / ceiling, "peak_memory_mib": r["memory_mb"],
            "peak_memory_of": r["memory_of"],
            "allocated_before_mib": r["allocated_before_mb"], "plan_total_mib": plan_mib,
            "plan_compiled_mib": r["plan"]["total_compiled"] / MIB,
            "plan_over_measured": planned_mib / r["memory_mb"] if r["memory_mb"] else None,
            "plan": r["plan"], "how": r["how"], "precision": r["precision"],
            "params": r["params"], "flops_per_token": r["flops_per_token"],
            "tokens_per_step": r["tokens_per_step"], "warmup_s": r["warmup_s"],
            "losses": r["losses"]}


def report(r: dict, f: dict, args: argparse.Namespace, name: str, micro: int,
           ceiling: float, peak: float | None) -> None:
    """Print one strategy's figures (``f``: :func:`strategy_figures`)."""
    s = r["strategy"]
    print(f"[{s}] device: {name}; {r['precision']}; {r['how']}; "
          f"{r['params'] / 1e6:.1f}M params; batch {micro}x{args.accum}x{r['seq_len']} = "
          f"{r['tokens_per_step']:,} tokens/step; warm-up {args.warmup} steps in "
          f"{r['warmup_s']:.1f} s")
    print(f"[{s}] tokens/s (median of {args.steps} steps back to back, as the loop runs "
          f"them): {r['tok_s']:,.0f}; model {f['tflops']:.2f} TFLOP/s "
          f"({r['flops_per_token'] / 1e6:.1f} MFLOP/token)")
    print(f"[{s}] each step alone (the device drained around it): {r['tok_s_synced']:,.0f} "
          f"tokens/s, {r['step_ms_synced']:.2f} ms a step")
    print(f"[{s}] MFU vs spec peak: {f['mfu_spec']:.1%} of {peak / 1e12:.0f} TFLOP/s"
          if peak else f"[{s}] MFU vs spec peak: n/a (no known {r['precision']} "
          f"peak for {name})")
    print(f"[{s}] vs the matmul measured here: {f['mfu_matmul']:.1%} "
          f"of {ceiling / 1e12:.2f} TFLOP/s")
    print(f"[{s}] peak memory {r['memory_mb']:,.0f} MB; loss "
          f"{r['losses'][0]:.3f} -> {r['losses'][-1]:.3f}")
    print(f"[{s}] lmforge plan: {f['plan_total_mib'] / 1024:.2f} GiB at micro-batch {micro} "
          f"(compiled {f['plan_compiled_mib'] / 1024:.2f}), measured peak "
          f"{r['memory_mb'] / 1024:.2f} GiB")


def report_nanogpt(n: dict, peak: float | None, ceiling: float) -> None:
    """Print nanoGPT's figures, their MFU by lmforge's FLOP formula."""
    first, last = n["window"]
    print(f"[nanogpt] train.py{' at ' + n['commit'][:10] if n['commit'] else ''}: median of "
          f"iterations {first}-{last} ({n['iterations']}): {n['ms_median']:.2f} ms/iter x "
          f"{n['tokens_per_iter']:,} tokens = {n['tok_s']:,.0f} tokens/s; run {n['wall_s']:.0f} s")
    if n["flops_per_token"]:
        flops = n["flops_per_token"] * n["tok_s"]
        mfu = f"; MFU vs spec peak {flops / peak:.1%}" if peak else ""
        print(f"[nanogpt] model {flops / 1e12:.2f} TFLOP/s ({n['params'] / 1e6:.2f}M params, "
              f"{n['flops_per_token'] / 1e6:.1f} MFLOP/token){mfu}; "
              f"vs the matmul {flops / ceiling:.1%}")


def ratios(doc: dict) -> dict[str, float]:
    """The comparisons the issue asks for, from whatever figures the run has."""
    tok = {k: doc[k]["tok_s"] for k in ("plain", "fsdp", "nanogpt") if doc.get(k)}
    out = {}
    for a, b in (("fsdp", "plain"), ("plain", "nanogpt"), ("fsdp", "nanogpt")):
        if a in tok and b in tok:
            out[f"{a}_over_{b}"] = tok[a] / tok[b]
    return out


def write_json(path: Path, doc: dict) -> None:
    """Write ``doc`` atomically (a temporary name, then rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2, default=str) + "\n", encoding="utf-8")
    os.replace(tmp, path)


# --------------------------------------------------------------------------- command line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; ``--all`` and ``--out`` fill in the rest (:func:`resolve_outputs`)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--precision", default="auto", choices=["auto", "bf16", "fp16", "fp32"])
    ap.add_argument("--compile", default="auto", choices=["auto", "true", "false"])
    ap.add_argument("--strategy", default="both", choices=["plain", "fsdp", "both"],
                    help="plain: the module one process trains (and DDP wraps); fsdp: FSDP2")
    ap.add_argument("--fused-loss", default="auto", choices=[*FUSED_LOSS, LIGER],
                    help="train.fused_loss: auto (a run's probe on CUDA), true (chunked), "
                         "false (plain logits), liger")
    ap.add_argument("--compile-mode", default=None,
                    help="torch.compile's mode for the plain step (e.g. reduce-overhead)")
    ap.add_argument("--inductor", action="append", default=[], metavar="KEY=VALUE",
                    help="set torch._inductor.config.KEY (a Python literal); repeatable")
    ap.add_argument("--loss-chunk-elements", type=int, default=None, metavar="N",
                    help="logits in one chunk of the fused loss's Triton kernel (a variant; "
                         "default loss.KERNEL_CHUNK_ELEMENTS)")
    ap.add_argument("--no-cudnn-attention", action="store_true",
                    help="keep SDPA off cuDNN's attention (flash or memory-efficient)")
    ap.add_argument("--micro", type=int, default=None, help="windows per micro-batch")
    ap.add_argument("--accum", type=int, default=1)
    ap.add_argument("--steps", type=int, default=30, help="timed optimizer steps")
    ap.add_argument("--warmup", type=int, default=8, help="untimed steps first (compiles)")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer model: smoke test")
    ap.add_argument("--nanogpt", default=None, metavar="DIR",
                    help="a nanoGPT checkout: run its train.py with the same shape and compare")
    ap.add_argument("--nanogpt-iters", type=int, default=NANOGPT_WINDOW[1],
                    help="train.py's max_iters (it runs one more)")
    ap.add_argument("--nanogpt-timeout", type=float, default=300.0, help="seconds")
    ap.add_argument("--profile", default=None, metavar="FILE",
                    help="write the top kernels of lmforge's step by self time here")
    ap.add_argument("--profile-steps", type=int, default=3)
    ap.add_argument("--trace", action="store_true",
                    help="with --profile: also the plain step's timeline, "
                         "trace_plain.json.gz beside the profile (Chrome trace format)")
    ap.add_argument("--nanogpt-profile", action="store_true",
                    help="with --nanogpt and --profile: also profile nanoGPT's model.py "
                         "stepped in this process (profile_nanogpt.txt)")
    ap.add_argument("--json", default=None, metavar="FILE", help="every figure, one file")
    ap.add_argument("--out", default=None, metavar="DIR",
                    help="write bench_gpu_mfu.json (and nanogpt.log) here")
    ap.add_argument("--src-sha256", action="store_true",
                    help="print this checkout's src_sha256 (as a run's JSON records it), exit")
    ap.add_argument("--all", action="store_true",
                    help="the whole check: plain, fsdp, nanoGPT (--nanogpt, default "
                         ".nanogpt/) and the profile, all written under --out")
    args = ap.parse_args(argv)
    resolve_outputs(args, ap)
    return args


def resolve_outputs(args: argparse.Namespace, ap: argparse.ArgumentParser) -> None:
    """``--all``: every part on, files under ``--out``; ``--out``: the JSON (and nanoGPT's
    log) there unless named; a ``--nanogpt`` folder must hold train.py."""
    out = Path(args.out) if args.out else None
    if args.all:
        if out is None:
            ap.error("--all needs --out DIR (where the JSON and the profile go)")
        args.strategy = "both"
        args.nanogpt = args.nanogpt or str(REPO / ".nanogpt")
        args.profile = args.profile or str(out / "profile.txt")
        args.nanogpt_profile = True
        args.trace = True
    if out is not None:
        args.json = args.json or str(out / "bench_gpu_mfu.json")
    args.nanogpt_log = out / "nanogpt.log" if out is not None and args.nanogpt else None
    if args.nanogpt:
        for name in ("train.py", "model.py", "configurator.py"):
            if not (Path(args.nanogpt) / name).is_file():
                ap.error(f"--nanogpt {args.nanogpt}: no {name} there (a checkout of "
                         "karpathy/nanoGPT; bench/RESULTS.md, 'GPU MFU', says how to get one)")


def set_variant(args: argparse.Namespace) -> None:
    """The variants' process-wide knobs: the loss kernel's chunk, SDPA's backends."""
    if args.loss_chunk_elements:
        loss_module.KERNEL_CHUNK_ELEMENTS = args.loss_chunk_elements
        print(f"variant: loss kernel chunk {args.loss_chunk_elements:,} logits")
    if args.no_cudnn_attention:
        torch.backends.cuda.enable_cudnn_sdp(False)
        print("variant: cuDNN attention off")


def set_inductor(settings: list[str]) -> None:
    """``--inductor KEY=VALUE``: set ``torch._inductor.config.KEY`` (dotted keys reach
    its sub-configs) to the Python literal VALUE; an unknown key is an error."""
    if not settings:
        return
    import torch._inductor.config as inductor_config

    for item in settings:
        key, _, text = item.partition("=")
        *parents, leaf = key.split(".")
        target = inductor_config
        for part in parents:
            target = getattr(target, part)
        if not hasattr(target, leaf):
            raise SystemExit(f"--inductor {item}: torch._inductor.config has no {key}")
        setattr(target, leaf, ast.literal_eval(text))
        print(f"inductor: {key} = {getattr(target, leaf)!r}")


def run_phase(doc: dict, name: str, fn: Callable[[], Any], save: Callable[[], None]) -> Any:
    """Run one part of the check; a failure is printed and recorded under ``errors`` and
    the others still run (a GPU lease is too short to lose every figure to one)."""
    t0 = time.perf_counter()
    try:
        return fn()
    except Exception as e:  # any failure of one part: keep the others' figures
        traceback.print_exc()
        doc["errors"][name] = f"{type(e).__name__}: {e}"
        print(f"[{name}] FAILED: {type(e).__name__}: {e}", flush=True)
        return None
    finally:
        doc["phases_s"][name] = round(time.perf_counter() - t0, 1)
        save()


def src_digest(root: Path = REPO) -> str:
    """SHA-256 over the paths and bytes of src/**/*.py: which tree ran, where the copy's
    ``.git`` may be older than its files (a device machine's copy carries the session's
    first commit). ``src_sha256`` of a checkout says whether it is the tree that ran."""
    digest = hashlib.sha256()
    for path in sorted((root / "src").rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def header(args: argparse.Namespace, device: torch.device, shape: dict, micro: int,
           precision: str, ceiling: float, peak: float | None) -> dict:
    """The JSON's figures of the run itself."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    try:  # the device's copy of the tree may have no .git, or no git at all
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                                text=True, check=False).stdout.strip() or None
    except OSError:
        commit = None
    return {"command": sys.argv, "lmforge_commit": commit, "src_sha256": src_digest(),
            "device": name,
            "torch": torch.__version__, "cuda": torch.version.cuda, "shape": shape,
            "micro": micro, "accum": args.accum, "tokens_per_step": micro * args.accum *
            shape["seq_len"], "precision": precision, "steps": args.steps,
            "warmup": args.warmup, "matmul_tflops": ceiling / 1e12,
            "spec_peak_tflops": peak / 1e12 if peak else None,
            "fused_loss": args.fused_loss, "compile_mode": args.compile_mode,
            "inductor": args.inductor, "loss_chunk_elements": args.loss_chunk_elements,
            "cudnn_attention": not args.no_cudnn_attention,
            "plain": None, "fsdp": None, "nanogpt": None, "ratios": {}, "profile": None,
            "phases_s": {}, "errors": {}}


@dataclass
class Check:
    """One run of the check: what was asked, the device's ceilings, the JSON document."""

    args: argparse.Namespace
    device: torch.device
    shape: dict
    micro: int
    precision: str
    compiled: bool
    ceiling: float
    peak: float | None
    doc: dict
    save: Callable[[], None]


def main(argv: list[str] | None = None) -> int:
    """Run the parts asked for; exit 1 when one of them failed."""
    args = parse_args(argv)
    if args.src_sha256:
        print(src_digest())
        return 0
    t_start = time.perf_counter()
    set_inductor(args.inductor)
    set_variant(args)
    device = torch.device(args.device)
    shape = TINY if args.tiny else GPT2_SMALL
    micro = args.micro or (4 if args.tiny or device.type == "cpu" else 16)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    precision = resolve_precision(args.precision, device)
    matmul_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision.name,
                                                                       torch.float32)
    ceiling = matmul_ceiling(device, matmul_dtype, 8192 if device.type == "cuda" else 1024)
    peak = peak_flops(device, precision.name)
    doc = header(args, device, shape, micro, precision.name, ceiling, peak)

    def save() -> None:
        doc["ratios"] = ratios(doc)
        doc["total_s"] = round(time.perf_counter() - t_start, 1)
        if args.json:
            write_json(Path(args.json), doc)

    compiled, _ = resolve_compile({"auto": "auto", "true": True, "false": False}[
        args.compile], device)
    check = Check(args, device, shape, micro, precision.name, compiled, ceiling, peak, doc,
                  save)
    run_strategies(check)
    if args.nanogpt:
        run_nanogpt_parts(check)
    save()
    print(f"total {doc['total_s']:.0f} s" + (f"; figures in {args.json}" if args.json else ""))
    return 1 if doc["errors"] else 0


def run_strategies(c: Check) -> None:
    """lmforge's step under each strategy asked for, each profiled with ``--profile``."""
    args, doc = c.args, c.doc
    strategies = ("plain", "fsdp") if args.strategy == "both" else (args.strategy,)
    for strategy in strategies:
        prof = args.profile_steps if args.profile else 0
        # The plain step's timeline only: a device call brings back 8 files at most.
        trace = (Path(args.profile).with_name("trace_plain.json.gz")
                 if args.profile and args.trace and strategy == "plain" else None)
        r = run_phase(doc, strategy, lambda s=strategy, p=prof, t=trace: measure(
            s, args, c.device, c.shape, c.micro, p, t), c.save)
        free_compiled(c.device)
        if r is None:
            continue
        doc[strategy] = strategy_figures(r, c.peak, c.ceiling)
        report(r, doc[strategy], args, doc["device"], c.micro, c.ceiling, c.peak)
        # The first strategy's profile is 'profile' (profile.txt), the next 'profile_fsdp'.
        key = "profile" if strategy == strategies[0] else f"profile_{strategy}"
        if r["profile"] and "error" in r["profile"]:
            doc["errors"][key] = r["profile"]["error"]
        elif r["profile"]:
            write_profile(args, doc, r, c.micro, key)
        c.save()
    if "fsdp_over_plain" in ratios(doc):
        print(f"fsdp / plain tokens/s: {ratios(doc)['fsdp_over_plain']:.3f}")


def run_nanogpt_parts(c: Check) -> None:
    """Upstream nanoGPT's train.py beside the step, then (``--nanogpt-profile``) its
    model.py stepped and profiled in this process."""
    args, doc = c.args, c.doc
    doc["nanogpt"] = run_phase(doc, "nanogpt", lambda: measure_nanogpt(
        args, c.device, c.shape, c.micro, c.precision, c.compiled), c.save)
    if doc["nanogpt"]:
        report_nanogpt(doc["nanogpt"], c.peak, c.ceiling)
        for key, value in ratios(doc).items():
            if key.endswith("_over_nanogpt"):
                print(f"{key.replace('_over_', ' / ')} tokens/s: {value:.3f}")
    if args.profile and args.nanogpt_profile:
        free_compiled(c.device)
        doc["profile_nanogpt"] = run_phase(doc, "profile_nanogpt", lambda: profile_nanogpt(
            args, c.device, c.shape, c.micro, c.precision, c.compiled), c.save)
        if doc["profile_nanogpt"]:
            n = doc["profile_nanogpt"]
            print(f"[nanogpt in-process] {n['tok_s']:,.0f} tokens/s ({n['step_ms_median']:.2f} "
                  f"ms a step, busy {n['busy_ms_per_step']:.2f}); profile: {n['file']}")


def profile_path(args: argparse.Namespace, key: str) -> Path:
    """The file of profile ``key``: ``--profile`` itself for 'profile', else its name with
    the rest of the key added (profile.txt -> profile_fsdp.txt)."""
    first = Path(args.profile)
    return first if key == "profile" else first.with_name(
        first.stem + key.removeprefix("profile") + first.suffix)


def write_profile(args: argparse.Namespace, doc: dict, r: dict, micro: int,
                  key: str = "profile") -> None:
    """Write the profile file and keep its top rows in the JSON under ``key``."""
    prof = r["profile"]
    title = (f"lmforge bench_gpu_mfu profile: {doc['device']}, the {r['strategy']} step "
             f"({r['precision']}, {r['how']}), batch {micro}x{args.accum}x{r['seq_len']}, "
             f"after {args.warmup} warm-up and {args.steps} timed steps; timed "
             f"{r['step_ms_median']:.2f} ms a step")
    path = profile_path(args, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(format_profile(prof, title), encoding="utf-8")
    doc[key] = {"file": str(path), "strategy": r["strategy"], "kind": prof["kind"],
                "steps": prof["steps"], "busy_ms_per_step": prof["busy_ms_per_step"],
                "step_ms_median": r["step_ms_median"], "top": prof["top"]}
    print(f"[{r['strategy']}] profile ({prof['kind']}, {prof['steps']} steps): {path}; busy "
          f"{prof['busy_ms_per_step']:.2f} of {r['step_ms_median']:.2f} ms a step; "
          f"top: {prof['top'][0]['name'][:80] if prof['top'] else '-'}")


if __name__ == "__main__":
    sys.exit(main())
