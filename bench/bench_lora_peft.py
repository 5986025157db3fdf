"""A LoRA training step on a real open model: lmforge beside PEFT + transformers.

The same model (a Hugging Face folder, e.g. SmolLM2-135M-Instruct from
``scripts/get_smollm2.py``), the same adapters (rank, alpha, no dropout, on q/k/v/o and
gate/up/down), the same batch of tokens, learning rate, clipping and threads, in
interleaved rounds in one process:

* lmforge: the folder imported (``lmforge.export.hf.import_hf``), ``apply_lora`` and the
  frozen base held as the run holds it (``hold_frozen_in``), the loop's AdamW and its
  real step (``optimizer_step``: accumulation, fp32 loss, clipping, the non-finite
  guard), eager and under ``torch.compile`` (what ``sft.compile: auto`` does on a CPU);
* PEFT: ``AutoModelForCausalLM`` + ``get_peft_model(LoraConfig(...))``, fused AdamW over
  the trainable parameters, ``loss.backward()``, ``clip_grad_norm_``, ``step``,
  ``zero_grad(set_to_none=True)``: the loop a PEFT user writes (or TRL's SFTTrainer runs).

``--precision fp32``: both in fp32. ``bf16``: both hold the base in bf16 and compute under
bf16 autocast; adapters fp32 on both sides (PEFT's ``autocast_adapter_dtype``).
``ours-bf16store`` / ``ours-nf4``: lmforge with the base held in bf16 / QLoRA's NF4
(``lora.base_dtype``) and computing in ``--precision``; ratios are against
``peft-eager`` when it runs, else the last side listed. Peak RSS
of each side is measured in its own process (``--side``), building the model and running
``--steps`` steps, since one process cannot tell two models' peaks apart.

    python scripts/get_smollm2.py /tmp/smol-hf
    .venv/bin/python bench/bench_lora_peft.py --hf /tmp/smol-hf [--precision fp32|bf16]
        [--rank 16] [--micro 4] [--seq 256] [--rounds 5] [--steps 2] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from lmforge.config import TrainConfig
from lmforge.model.compiling import before_compile
from lmforge.model.frozen import hold_frozen_in
from lmforge.model.lora import apply_lora, trainable_parameters
from lmforge.model.saved import load_model
from lmforge.train.distributed import DistEnv
from lmforge.train.loop import make_reproducible
from lmforge.train.optim import build_optimizer
from lmforge.train.precision import Precision
from lmforge.train.step import optimizer_step

CPU = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
HF_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LR = 1e-3


class SameBatch:
    """A loader that hands out one fixed batch (both sides train on the same tokens)."""

    def __init__(self, tokens: torch.Tensor) -> None:
        self.x, self.y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x, self.y


class Ours:
    """lmforge's LoRA step on the imported model."""

    def __init__(self, folder: Path, tokens: torch.Tensor, rank: int, precision: str,
                 compile_: bool, base_dtype: str) -> None:
        torch.manual_seed(0)
        self.model, _ = load_model(folder)
        self.model.train()
        # Off the safetensors mmap into the process's own memory, as a run's build_model
        # holds its warm-started weights, so peak RSS compares what each base holds.
        for p in self.model.parameters():
            p.data = p.data.clone()
        apply_lora(self.model, rank, 2.0 * rank, 0.0, ["attn", "mlp"])
        hold_frozen_in(self.model, base_dtype)
        if compile_:
            before_compile()  # as compile_step_model does
        self.step_model = torch.compile(self.model) if compile_ else self.model
        cfg = TrainConfig(max_lr=LR, weight_decay=0.0)
        self.opt = build_optimizer(self.model, cfg, CPU.device)
        self.precision = Precision(precision, "cpu")
        self.scaler = self.precision.grad_scaler()
        self.loader = SameBatch(tokens)
        self.trained = trainable_parameters(self.model)

    def train_step(self) -> float:
        make_reproducible(CPU.device)  # as the loop runs
        loss, _, _ = optimizer_step(self.step_model, None, self.model, self.opt, self.scaler,
                                    self.precision, self.loader, 1, 1.0, CPU)
        return loss


class Peft:
    """PEFT + transformers: the same adapters, a hand-written loop as PEFT's docs show."""

    def __init__(self, hf_dir: Path, tokens: torch.Tensor, rank: int, precision: str,
                 compile_: bool) -> None:
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype)
        self.model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank,
                                                     lora_dropout=0.0,
                                                     target_modules=HF_TARGETS))
        self.model.train()
        self.step_model = torch.compile(self.model) if compile_ else self.model
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.0, betas=(0.9, 0.95),
                                     fused=True)
        self.ctx = (torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16"
                    else torch.autocast("cpu", enabled=False))
        self.input_ids = tokens[:, :-1].contiguous()
        self.trained = sum(p.numel() for p in params)

    def train_step(self) -> float:
        torch.use_deterministic_algorithms(False)  # PyTorch's default, as a PEFT loop runs
        with self.ctx:
            loss = self.step_model(input_ids=self.input_ids, labels=self.input_ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(
            [p for p in self.model.parameters() if p.requires_grad], 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.item()


def timed(trainer: Ours | Peft, steps: int) -> float:
    """Seconds per optimizer step over ``steps`` steps."""
    t0 = time.perf_counter()
    for _ in range(steps):
        trainer.train_step()
    return (time.perf_counter() - t0) / steps


def make_tokens(vocab: int, micro: int, seq: int) -> torch.Tensor:
    return torch.randint(0, vocab, (micro, seq + 1), generator=torch.Generator().manual_seed(0))


def build(side: str, args: argparse.Namespace, ours_dir: Path, tokens: torch.Tensor
          ) -> Ours | Peft:
    """One trainer by name: ours-eager, ours-compile, ours-bf16store (CPU's 16-bit
    storage with fp32 compute), ours-nf4 (QLoRA's NF4 base), peft-eager."""
    base_dtype = "bf16" if args.precision == "bf16" else "fp32"
    if side == "ours-bf16store":
        return Ours(ours_dir, tokens, args.rank, "fp32", False, "bf16")
    if side == "ours-nf4":
        return Ours(ours_dir, tokens, args.rank, args.precision, False, "nf4")
    if side.startswith("ours"):
        return Ours(ours_dir, tokens, args.rank, args.precision, side == "ours-compile",
                    base_dtype)
    return Peft(args.hf, tokens, args.rank, args.precision, side == "peft-compile")


def peak_rss_of(side: str, args: argparse.Namespace, ours_dir: Path) -> dict[str, float]:
    """Peak RSS (MiB) of a fresh process that builds ``side`` and runs ``--steps`` steps:
    ``peak_rss_mib`` over its whole life (loading included), ``steps_rss_mib`` over the
    steps alone (the kernel's high-water mark reset once the model is built)."""
    cmd = [sys.executable, __file__, "--hf", str(args.hf), "--precision", args.precision,
           "--rank", str(args.rank), "--micro", str(args.micro), "--seq", str(args.seq),
           "--steps", str(args.steps), "--threads", str(args.threads), "--side", side,
           "--ours-dir", str(ours_dir)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _high_water_mib() -> float:
    """VmHWM of this process (MiB): the peak RSS of its own memory since exec (or since
    the last reset). ``ru_maxrss`` is no substitute: it carries the forking parent's RSS
    over the exec, so every side would report at least the parent's size."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def run_side(args: argparse.Namespace, ours_dir: Path) -> None:
    """``--side``: build one trainer, run its steps, print its peak RSS as JSON."""
    tokens = make_tokens(args.vocab, args.micro, args.seq)
    trainer = build(args.side, args, ours_dir, tokens)
    built = _high_water_mib()
    # "5" resets the peak RSS (proc(5), clear_refs), so the steps' own peak shows.
    Path("/proc/self/clear_refs").write_text("5")
    for _ in range(args.steps):
        trainer.train_step()
    steps = _high_water_mib()
    print(json.dumps({"side": args.side, "peak_rss_mib": round(max(built, steps), 1),
                      "steps_rss_mib": round(steps, 1)}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hf", type=Path, required=True, help="a Hugging Face model folder")
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=2, help="optimizer steps per round")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sides", default="ours-eager,ours-compile,peft-eager")
    ap.add_argument("--side", help=argparse.SUPPRESS)
    ap.add_argument("--ours-dir", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    args.vocab = json.loads((args.hf / "config.json").read_text())["vocab_size"]
    if args.side:
        return run_side(args, args.ours_dir)
    with tempfile.TemporaryDirectory() as tmp:
        from lmforge.export.hf import import_hf

        ours_dir = Path(tmp) / "ours"
        import_hf(args.hf, ours_dir, seq_len=args.seq)
        compare(args, ours_dir)


def compare(args: argparse.Namespace, ours_dir: Path) -> None:
    """Interleaved timing rounds, then each side's peak RSS; print the table."""
    tokens = make_tokens(args.vocab, args.micro, args.seq)
    sides = args.sides.split(",")
    trainers = {s: build(s, args, ours_dir, tokens) for s in sides}
    trained = {s: t.trained for s, t in trainers.items()}
    for t in trainers.values():  # warm-up: compilation, allocator, first-step costs
        timed(t, 1)
    times: dict[str, list[float]] = {s: [] for s in sides}
    for _ in range(args.rounds):
        for s in sides:
            times[s].append(timed(trainers[s], args.steps))
    del trainers
    rss = {s: peak_rss_of(s, args, ours_dir) for s in sides}
    tok = args.micro * args.seq
    print(f"{args.hf.name}: LoRA r={args.rank} on q/k/v/o/gate/up/down, batch {args.micro} x "
          f"{args.seq} tokens, {args.precision}, {args.threads} threads, {args.rounds} rounds "
          f"of {args.steps} steps (best / median s per step)")
    base = "peft-eager" if "peft-eager" in sides else sides[-1]
    for s in sides:
        best, med = min(times[s]), statistics.median(times[s])
        ratio = (f"  {base}/this {min(times[base]) / best:.2f}x best, "
                 f"{statistics.median(times[base]) / med:.2f}x median" if s != base else "")
        print(f"{s:<15} {best:7.3f} / {med:7.3f} s  {tok / best:7.0f} tok/s  trained "
              f"{trained[s]:,}  peak RSS {rss[s]['peak_rss_mib']:,.0f} MiB (steps "
              f"{rss[s]['steps_rss_mib']:,.0f}){ratio}")


if __name__ == "__main__":
    main()
