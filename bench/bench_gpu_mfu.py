"""MFU of lmforge's training step on one GPU: a GPT-2-small-sized (124M) Llama in bf16.

The prepared script for a lent GPU (issue 5 aims for >= 50 % MFU on an H100/H200): it
runs the real step (``Llama`` + ``build_optimizer`` + the loop's ``optimizer_step``: fused
loss, accumulation, clipping, the non-finite guard), compiled as ``train.compile: auto``
does, fed by the real ``WindowLoader`` over a temporary shard set of random tokens.

Figures, all measured in the same run:

* tokens/s and achieved model TFLOP/s (6 N + 12 L d T per token, PaLM appendix B);
* MFU against the device's dense bf16 peak from its spec sheet (``telemetry.PEAK_FLOPS``);
* the same against a large bf16 matmul timed here first, the practical ceiling, so the
  ratio is meaningful on any GPU, even one whose spec peak is unknown;
* each for the plain module (what DDP wraps) and for FSDP2 (``train.strategy: fsdp``,
  on a one-process mesh: its gather/reshard hooks, per-block compile, bf16 parameters
  with fp32 reduction), and their ratio.

    .venv/bin/python bench/bench_gpu_mfu.py                      # 124M, bf16, ddp + fsdp
    .venv/bin/python bench/bench_gpu_mfu.py --micro 32 --steps 40
    .venv/bin/python bench/bench_gpu_mfu.py --tiny --device cpu  # smoke test of the script
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from lmforge.config import ModelConfig, TrainConfig
from lmforge.model.compiling import before_compile
from lmforge.model.llama import Llama
from lmforge.shards.loader import ShardSet, WindowLoader
from lmforge.shards.writer import write_shards
from lmforge.train.compiler import resolve_compile
from lmforge.train.distributed import DistEnv
from lmforge.train.fsdp import build_sharded, ensure_process_group
from lmforge.train.optim import build_optimizer
from lmforge.train.precision import resolve_precision
from lmforge.train.step import optimizer_step
from lmforge.train.telemetry import memory_mb, peak_flops

# GPT-2 small's shape (12 x 768, 12 heads, 1024 context, 50,304 = 50,257 padded to 64).
GPT2_SMALL = {"n_layer": 12, "n_head": 12, "n_embd": 768, "seq_len": 1024, "vocab": 50304}
TINY = {"n_layer": 2, "n_head": 4, "n_embd": 64, "seq_len": 64, "vocab": 512}


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


def measure(strategy: str, args: argparse.Namespace, device: torch.device, shape: dict,
            micro: int) -> dict:
    """Time the training step of ``strategy`` (``ddp``: the plain module, as one process
    trains; ``fsdp``: FSDP2 over a one-process mesh, built on meta, blocks compiled)."""
    mcfg = ModelConfig(n_layer=shape["n_layer"], n_head=shape["n_head"],
                       n_embd=shape["n_embd"], seq_len=shape["seq_len"])
    cfg = TrainConfig(max_steps=10_000, micro_batch_size=micro, grad_accum_steps=args.accum,
                      precision=args.precision, warmup=0)
    precision = resolve_precision(cfg.precision, device)
    requested = {"auto": "auto", "true": True, "false": False}[args.compile]
    compiled, how = resolve_compile(requested, device)
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=device)
    tokens_per_step = micro * args.accum * mcfg.seq_len
    torch.manual_seed(0)
    if strategy == "fsdp":
        ensure_process_group(env)
        model = build_sharded(mcfg, shape["vocab"], env, precision.name == "bf16",
                              compile_blocks=compiled)
        step_model = model
        how += " per block" if compiled else ""
    else:
        model = Llama(mcfg, shape["vocab"]).to(device)
        if compiled:
            before_compile()
        step_model = torch.compile(model) if compiled else model
    optimizer = build_optimizer(model, cfg, device)
    for group in optimizer.param_groups:
        group["lr"] = 3e-4
    scaler = precision.grad_scaler()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with tempfile.TemporaryDirectory() as tmp:
        shards = random_shards(Path(tmp), shape["vocab"],
                               tokens_per_step * (args.warmup + args.steps + 2))
        loader = WindowLoader(shards, mcfg.seq_len, micro, seed=0)
        t0 = time.perf_counter()
        for _ in range(args.warmup):
            optimizer_step(step_model, None, model, optimizer, scaler, precision, loader,
                           args.accum, cfg.grad_clip, env)
        warmup_s = time.perf_counter() - t0
        times, losses = [], []
        for _ in range(args.steps):
            _sync(device)
            t0 = time.perf_counter()
            loss, _, _ = optimizer_step(step_model, None, model, optimizer, scaler, precision,
                                        loader, args.accum, cfg.grad_clip, env)
            _sync(device)
            times.append(time.perf_counter() - t0)
            losses.append(loss)
    tok_s = tokens_per_step / statistics.median(times)
    return {"strategy": strategy, "precision": precision.name, "how": how,
            "params": model.num_params(), "flops_per_token": model.flops_per_token(),
            "tokens_per_step": tokens_per_step, "warmup_s": warmup_s, "tok_s": tok_s,
            "losses": losses, "memory_mb": memory_mb(device), "seq_len": mcfg.seq_len}


def report(r: dict, args: argparse.Namespace, device: torch.device, micro: int,
           ceiling: float, matmul_dtype: torch.dtype) -> None:
    flops = r["flops_per_token"] * r["tok_s"]
    peak = peak_flops(device, r["precision"])
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"[{r['strategy']}] device: {name}; {r['precision']}; {r['how']}; "
          f"{r['params'] / 1e6:.1f}M params; batch {micro}x{args.accum}x{r['seq_len']} = "
          f"{r['tokens_per_step']:,} tokens/step; warm-up {args.warmup} steps in "
          f"{r['warmup_s']:.1f} s")
    print(f"[{r['strategy']}] tokens/s (median of {args.steps} steps): {r['tok_s']:,.0f}; "
          f"model {flops / 1e12:.2f} TFLOP/s ({r['flops_per_token'] / 1e6:.1f} MFLOP/token)")
    print(f"[{r['strategy']}] MFU vs spec peak: {flops / peak:.1%} of {peak / 1e12:.0f} TFLOP/s"
          if peak else f"[{r['strategy']}] MFU vs spec peak: n/a (no known {r['precision']} "
          f"peak for {name})")
    print(f"[{r['strategy']}] vs a {matmul_dtype} matmul measured here: {flops / ceiling:.1%} "
          f"of {ceiling / 1e12:.2f} TFLOP/s")
    print(f"[{r['strategy']}] peak memory {r['memory_mb']:,.0f} MB; loss "
          f"{r['losses'][0]:.3f} -> {r['losses'][-1]:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--precision", default="auto", choices=["auto", "bf16", "fp16", "fp32"])
    ap.add_argument("--compile", default="auto", choices=["auto", "true", "false"])
    ap.add_argument("--strategy", default="both", choices=["ddp", "fsdp", "both"],
                    help="ddp: the plain module one process trains; fsdp: FSDP2")
    ap.add_argument("--micro", type=int, default=None, help="windows per micro-batch")
    ap.add_argument("--accum", type=int, default=1)
    ap.add_argument("--steps", type=int, default=30, help="timed optimizer steps")
    ap.add_argument("--warmup", type=int, default=8, help="untimed steps first (compiles)")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer model: smoke test")
    args = ap.parse_args()

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
    results = {}
    for strategy in (("ddp", "fsdp") if args.strategy == "both" else (args.strategy,)):
        results[strategy] = measure(strategy, args, device, shape, micro)
        report(results[strategy], args, device, micro, ceiling, matmul_dtype)
    if len(results) == 2:
        print(f"fsdp / ddp tokens/s: {results['fsdp']['tok_s'] / results['ddp']['tok_s']:.3f}")


if __name__ == "__main__":
    main()
