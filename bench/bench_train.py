"""Training tokens/s and model FLOP/s on CPU: lmforge's loop vs nanoGPT's train.py step.

Both train the same size (4 layers, width 256, 4 heads, vocab 8192, context 256, no
dropout, no biases) on the same random tokens, with the same batch (``--micro`` windows x
``--accum`` micro-steps per optimizer step) and threads, in interleaved rounds:

* lmforge: ``Llama`` + ``build_optimizer`` + ``lr_at`` + ``optimizer_step`` (the real
  loop's step: accumulation, fp32 loss, grad-norm before clipping, the non-finite guard),
  fed by the real ``WindowLoader`` over a temporary shard set.
* nanoGPT: its own ``model.py``, from a nanoGPT checkout the user points at with
  ``--nanogpt DIR`` or ``NANOGPT_DIR`` (not vendored here), with train.py's step:
  ``configure_optimizers`` (fused AdamW where available), ``get_batch`` from an
  ``np.memmap``, loss / accum, clipping at 1.0, ``zero_grad(set_to_none=True)``.

FLOP/s use each model's own formula (6 N + 12 L d T per token, PaLM appendix B); ours is
~1-2 % higher at this size (SwiGLU 3 x 256 x 704 vs GELU 2 x 256 x 1024 per layer).
The headline is the tokens/s ratio ours / nanoGPT, measured in the same run.

Each side runs eager and under ``torch.compile`` (``--modes``); the headline compares
lmforge as it trains by default (``train.compile: auto``: compiled where Inductor can
build) with nanoGPT's faster mode on this machine.

    git clone https://github.com/karpathy/nanoGPT /tmp/nanoGPT
    .venv/bin/python bench/bench_train.py --nanogpt /tmp/nanoGPT [--steps 2] [--rounds 8]
        [--threads 2] [--micro 8] [--accum 2] [--modes eager,compile] [--bf16] [--plain-loss]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
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
from lmforge.train.loop import make_reproducible
from lmforge.train.optim import build_optimizer
from lmforge.train.precision import Precision
from lmforge.train.schedule import lr_at
from lmforge.train.step import optimizer_step

VOCAB, LAYERS, HEADS, WIDTH, CONTEXT = 8192, 4, 4, 256, 256
CPU = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def make_data(root: Path, tokens: int) -> tuple[ShardSet, np.memmap]:
    """The same random tokens as a shard set (ours) and a flat uint16 train.bin (nanoGPT)."""
    rng = np.random.default_rng(0)
    flat = rng.integers(0, VOCAB, tokens, dtype=np.int64)
    docs = np.split(flat, np.arange(1000, tokens, 1000))
    write_shards(root / "shards", [d.tolist() for d in docs], VOCAB, shard_tokens=1 << 20)
    flat.astype(np.uint16).tofile(root / "train.bin")
    return ShardSet(root / "shards"), np.memmap(root / "train.bin", dtype=np.uint16, mode="r")


class Ours:
    """lmforge's training step at the benchmark size."""

    def __init__(self, shards: ShardSet, micro: int, accum: int, precision: str,
                 compile_: bool, fused_loss: bool = True, optimizer: str = "adamw") -> None:
        torch.manual_seed(0)
        self.cfg = TrainConfig(max_steps=10_000, micro_batch_size=micro, grad_accum_steps=accum,
                               warmup=100, optimizer=optimizer)
        mcfg = ModelConfig(n_layer=LAYERS, n_head=HEADS, n_embd=WIDTH, seq_len=CONTEXT)
        self.model = Llama(mcfg, VOCAB)
        self.model.fused_loss = fused_loss
        if compile_:
            before_compile()  # as compile_step_model does
        self.step_model = torch.compile(self.model) if compile_ else self.model
        self.opt = build_optimizer(self.model, self.cfg, CPU.device)
        self.precision = Precision(precision, "cpu")
        self.scaler = self.precision.grad_scaler()
        self.loader = WindowLoader(shards, CONTEXT, micro, seed=0)
        self.step = 0
        self.flops_per_token = self.model.flops_per_token()

    def train_step(self) -> float:
        make_reproducible(CPU.device)  # as the loop runs (nanoGPT's step switches it off)
        lr = lr_at(self.step, self.cfg)
        for group in self.opt.param_groups:
            group["lr"] = lr
        loss, _, _ = optimizer_step(self.step_model, None, self.model, self.opt, self.scaler,
                                    self.precision, self.loader, self.cfg.grad_accum_steps,
                                    self.cfg.grad_clip, CPU)
        self.step += 1
        return loss


class NanoGPT:
    """nanoGPT train.py's step (cosine get_lr, accumulation, clipping) at the same size."""

    def __init__(self, nanogpt: object, data: np.memmap, micro: int, accum: int,
                 precision: str, compile_: bool) -> None:
        torch.manual_seed(0)
        GPT, GPTConfig = nanogpt.GPT, nanogpt.GPTConfig  # noqa: N806 (nanoGPT's names)
        conf = GPTConfig(n_layer=LAYERS, n_head=HEADS, n_embd=WIDTH, block_size=CONTEXT,
                         vocab_size=VOCAB, bias=False, dropout=0.0)
        self.model = GPT(conf)
        self.step_model = torch.compile(self.model) if compile_ else self.model
        self.opt = self.model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), "cpu")
        self.data, self.micro, self.accum = data, micro, accum
        self.ctx = (torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16"
                    else torch.autocast("cpu", enabled=False))
        self.iter = 0
        n = self.model.get_num_params()
        self.flops_per_token = 6 * n + 12 * LAYERS * HEADS * (WIDTH // HEADS) * CONTEXT
        self.X, self.Y = self.get_batch()

    def get_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """train.py's get_batch (CPU branch)."""
        data = self.data
        ix = torch.randint(len(data) - CONTEXT, (self.micro,))
        x = torch.stack([torch.from_numpy((data[i:i + CONTEXT]).astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy((data[i + 1:i + 1 + CONTEXT]).astype(np.int64))
                         for i in ix])
        return x, y

    def get_lr(self, it: int) -> float:
        """train.py's get_lr: linear warmup, cosine to min_lr."""
        warmup, decay, lr, min_lr = 100, 10_000, 1e-3, 1e-4
        if it < warmup:
            return lr * (it + 1) / (warmup + 1)
        ratio = (it - warmup) / (decay - warmup)
        return min_lr + 0.5 * (1.0 + np.cos(np.pi * ratio)) * (lr - min_lr)

    def train_step(self) -> float:
        torch.use_deterministic_algorithms(False)  # PyTorch's default, as train.py runs
        for group in self.opt.param_groups:
            group["lr"] = self.get_lr(self.iter)
        for _ in range(self.accum):
            with self.ctx:
                _, loss = self.step_model(self.X, self.Y)
                loss = loss / self.accum
            self.X, self.Y = self.get_batch()
            loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.iter += 1
        return loss.item() * self.accum


def timed(trainer: Ours | NanoGPT, steps: int) -> float:
    """Seconds per optimizer step over ``steps`` steps."""
    t0 = time.perf_counter()
    for _ in range(steps):
        trainer.train_step()
    return (time.perf_counter() - t0) / steps


def load_nanogpt(directory: str | None) -> object:
    """nanoGPT's own model.py from a checkout (it is not vendored in this repository)."""
    if not directory or not (Path(directory) / "model.py").is_file():
        sys.exit("bench_train: needs a nanoGPT checkout: --nanogpt DIR or NANOGPT_DIR "
                 "(git clone https://github.com/karpathy/nanoGPT)")
    spec = importlib.util.spec_from_file_location("nanogpt_model", Path(directory) / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nanogpt", default=os.environ.get("NANOGPT_DIR"),
                    help="a nanoGPT checkout (its model.py is the baseline)")
    ap.add_argument("--steps", type=int, default=2, help="optimizer steps per round")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--modes", default="eager,compile",
                    help="comma-separated: eager, compile (both sides run each)")
    ap.add_argument("--bf16", action="store_true", help="bf16 autocast for both (CPU)")
    ap.add_argument("--plain-loss", action="store_true",
                    help="also time lmforge with train.fused_loss off (eager)")
    args = ap.parse_args()
    nanogpt = load_nanogpt(args.nanogpt)
    torch.set_num_threads(args.threads)
    precision = "bf16" if args.bf16 else "fp32"
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    tokens_per_step = args.micro * args.accum * CONTEXT
    default_compiled, how = resolve_compile("auto", torch.device("cpu"))
    with tempfile.TemporaryDirectory() as tmp:
        shards, memmap = make_data(Path(tmp), 2_000_000)
        trainers: dict[str, Ours | NanoGPT] = {}
        for mode in modes:
            trainers[f"lmforge {mode}"] = Ours(shards, args.micro, args.accum, precision,
                                               mode == "compile")
            trainers[f"nanoGPT {mode}"] = NanoGPT(nanogpt, memmap, args.micro, args.accum,
                                                  precision, mode == "compile")
        if args.plain_loss:
            trainers["lmforge plain-loss"] = Ours(shards, args.micro, args.accum, precision,
                                                  False, fused_loss=False)
        for t in trainers.values():  # compiles, then settles
            timed(t, args.warmup)
        secs: dict[str, list[float]] = {name: [] for name in trainers}
        for r in range(args.rounds):  # interleaved (alternating order): load hits all alike
            order = list(trainers.items()) if r % 2 == 0 else list(trainers.items())[::-1]
            for name, t in order:
                secs[name].append(timed(t, args.steps))
    print(f"threads={args.threads} batch={args.micro}x{args.accum}x{CONTEXT} "
          f"precision={precision} rounds={args.rounds}x{args.steps} steps; "
          f"lmforge's default here: {how}")
    # The cores are shared: the best round of each is the least disturbed one, and the
    # per-round ratio compares measurements taken within seconds of each other.
    best = {name: tokens_per_step / min(s) for name, s in secs.items()}
    for name, t in trainers.items():
        print(f"{name:16s} {best[name]:9,.0f} tokens/s  "
              f"{best[name] * t.flops_per_token / 1e9:7.1f} GFLOP/s "
              f"({t.flops_per_token / 1e6:.2f} MFLOP/token by its own formula)  rounds: "
              f"{', '.join(f'{tokens_per_step / x:,.0f}' for x in secs[name])}")
    flop_ratio = (trainers[f"lmforge {modes[0]}"].flops_per_token
                  / trainers[f"nanoGPT {modes[0]}"].flops_per_token)

    def compare(ours: str, theirs: str) -> None:
        ratios = [n / o for o, n in zip(secs[ours], secs[theirs], strict=True)]
        print(f"ratio {ours} / {theirs} tokens/s: best {best[ours] / best[theirs]:.2f}x, "
              f"median of rounds {statistics.median(ratios):.2f}x; FLOP/s "
              f"{best[ours] / best[theirs] * flop_ratio:.2f}x")

    for mode in modes:
        compare(f"lmforge {mode}", f"nanoGPT {mode}")
    if args.plain_loss and "eager" in modes:
        compare("lmforge eager", "lmforge plain-loss")
    ours = f"lmforge {'compile' if default_compiled else 'eager'}"
    theirs = max((n for n in best if n.startswith("nanoGPT")), key=best.get)
    if ours in best:
        print("headline (lmforge as it trains by default vs nanoGPT's faster mode):")
        compare(ours, theirs)


if __name__ == "__main__":
    main()
