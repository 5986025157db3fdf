"""Muon's optimizer step on this CPU: lmforge's (Newton-Schulz in the probed dtype) vs
``torch.optim.Muon`` (always bf16) vs AdamW, against the forward+backward it follows.

At the demo's shape (4 layers x 256, vocab 8192, context 256, micro-batch 8, fp32) in one
process, interleaved rounds, best round of each:

* ``forward+backward``: one micro-batch's forward and backward (eager);
* ``step``: ``optimizer.step()`` alone on those gradients, for AdamW (fused), torch's Muon
  and lmforge's Muon (its Newton-Schulz dtype chosen by :func:`newton_schulz_dtype`);
* ``train``: whole optimizer steps as the train stage takes them (``optimizer_step``,
  compiled where the demo compiles), tokens/s, for AdamW, torch's Muon and lmforge's;
* ``forms`` (``--forms``): float32 Newton-Schulz by the iteration (fifteen matmuls) and
  by the spectral form (one eigendecomposition), at the demo's shapes and larger ones,
  on two threads and (spectral) one;
* ``accuracy``: on the Muon trainer's own updates (Nesterov look-ahead of its last
  gradients), the relative error of float32 spectral, float32 iteration and torch's
  bf16 iteration against the iteration in float64;
* ``newton_schulz``: lmforge's ``orthogonalize`` alone, in the chosen dtype, on one
  matrix of each of the model's Muon shapes (float32 takes the spectral form on a CPU),
  and ``orthogonalize_all`` on one step's worth (every Muon matrix of the model: side by
  side, one thread each, in the spectral form).

Issue 43's targets: on a CPU without bf16 units, lmforge's Muon step <= 0.5x the
forward+backward and its train tokens/s within 15 % of AdamW's. Such a CPU can be
imitated on one with bf16 units by capping the kernels (check the bf16/fp32 ratio it
prints: it must be far above 1 for the cap to mean anything):

    .venv/bin/python bench/bench_muon.py [--rounds 5] [--json out.json]
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 .venv/bin/python bench/bench_muon.py
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import platform
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch
from bench_train import CONTEXT, LAYERS, VOCAB, WIDTH, Ours, make_data, timed

from lmforge.train.compiler import resolve_compile
from lmforge.train.muon import (
    NS_COEFFICIENTS,
    NS_STEPS,
    iterated_orthogonalize,
    newton_schulz,
    newton_schulz_dtype,
    orthogonalize,
    orthogonalize_all,
    probe_seconds,
    spectral_orthogonalize,
)
from lmforge.train.optim import muon_parameters

MICRO = 8  # the demo's micro-batch (params.yaml train.micro_batch_size); --micro sets it


def with_torch_muon(trainer: Ours) -> Ours:
    """The same trainer with its Muon part replaced by ``torch.optim.Muon`` (bf16)."""
    cfg, muon = trainer.cfg, trainer.opt.parts["muon"]
    trainer.opt.parts["muon"] = torch.optim.Muon(
        [p for _, p in muon_parameters(trainer.model)], lr=cfg.muon_lr,
        weight_decay=cfg.muon_weight_decay, momentum=cfg.muon_momentum, nesterov=True,
        adjust_lr_fn=cfg.muon_adjust_lr)
    assert len(trainer.opt.parts["muon"].param_groups) == len(muon.param_groups)
    return trainer


def forward_backward(trainer: Ours) -> float:
    """Seconds of one micro-batch's forward and backward (gradients left in place)."""
    x, y = (torch.as_tensor(t) for t in trainer.loader.next_batch()[:2])
    trainer.model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    _, loss = trainer.model(x, y)
    loss.backward()
    return time.perf_counter() - t0


def step_only(trainer: Ours) -> float:
    """Seconds of ``optimizer.step()`` on the gradients ``forward_backward`` left."""
    t0 = time.perf_counter()
    trainer.opt.step()
    return time.perf_counter() - t0


def newton_schulz_only(matrix: torch.Tensor, dtype: torch.dtype) -> float:
    """Seconds of lmforge's orthogonalisation of one ``matrix`` (5 iterations)."""
    t0 = time.perf_counter()
    orthogonalize(matrix, dtype)
    return time.perf_counter() - t0


def newton_schulz_step(matrices: list[torch.Tensor], dtype: torch.dtype) -> float:
    """Seconds of one step's orthogonalisations, as ``Muon.step`` takes them."""
    t0 = time.perf_counter()
    orthogonalize_all(matrices, dtype)
    return time.perf_counter() - t0


FORM_SHAPES = ((256, 256), (256, 704), (512, 512), (768, 768), (768, 3072), (1024, 1024))


def best_ms(fn, rounds: int) -> float:
    """The fastest of ``rounds`` calls of ``fn`` after one warm-up, in milliseconds."""
    fn()
    best = math.inf
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def compare_forms(shapes: tuple[tuple[int, int], ...], rounds: int, threads: int) -> dict:
    """Milliseconds of float32 Newton-Schulz on one matrix of each shape: the iteration
    and the spectral form on ``threads`` threads, the spectral form on one."""
    out = {}
    for rows, cols in shapes:
        x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(0))
        x = x / x.norm()
        iteration = functools.partial(newton_schulz, x, NS_COEFFICIENTS, NS_STEPS)
        spectral = functools.partial(spectral_orthogonalize, x)
        row = {}
        for name, fn, n in (("iteration", iteration, threads), ("spectral", spectral, threads),
                            ("spectral_1_thread", spectral, 1)):
            torch.set_num_threads(n)
            row[name] = best_ms(fn, rounds)
        torch.set_num_threads(threads)
        out[f"{rows}x{cols}"] = row
    return out


def accuracy(updates: list[torch.Tensor]) -> dict:
    """Largest relative error (Frobenius) over ``updates`` against the iteration in
    float64, of float32 spectral, float32 iteration and bf16 iteration (torch's)."""
    errors: dict[str, float] = {"float32 spectral": 0.0, "float32 iteration": 0.0,
                                "bfloat16 iteration": 0.0}
    for g in updates:
        ref = iterated_orthogonalize(g.double())
        for name, out in (("float32 spectral", spectral_orthogonalize(g.float())),
                          ("float32 iteration", iterated_orthogonalize(g.float())),
                          ("bfloat16 iteration", iterated_orthogonalize(g.bfloat16()))):
            err = float(torch.linalg.matrix_norm(out.double() - ref) /
                        torch.linalg.matrix_norm(ref))
            errors[name] = max(errors[name], err)
    return errors


def look_aheads(trainer: Ours) -> list[torch.Tensor]:
    """The updates the Muon trainer would orthogonalise next (its last gradients moved
    towards its momentum buffers, as Muon's Nesterov step does)."""
    muon = trainer.opt.parts["muon"]
    out = []
    for group in muon.param_groups:
        for p in group["params"]:
            buf = muon.state[p]["momentum_buffer"]
            out.append(p.grad.lerp(buf, group["momentum"]))
    return out


def measure(args: argparse.Namespace) -> dict:
    """Every figure, interleaved over ``args.rounds`` rounds; the best round of each."""
    compiled = resolve_compile("auto", torch.device("cpu"))[0]
    micro = args.micro
    tokens = micro * CONTEXT
    with tempfile.TemporaryDirectory() as tmp:
        shards, _ = make_data(Path(tmp), 1_000_000)
        eager = {"adamw": Ours(shards, micro, 1, "fp32", False),
                 "lmforge muon": Ours(shards, micro, 1, "fp32", False, optimizer="muon")}
        if not args.skip_torch:
            eager["torch muon"] = with_torch_muon(Ours(shards, micro, 1, "fp32", False,
                                                       optimizer="muon"))
        train = {name: Ours(shards, micro, 1, "fp32", compiled,
                            optimizer="adamw" if name == "adamw" else "muon")
                 for name in eager}
        if not args.skip_torch:
            with_torch_muon(train["torch muon"])
        for t in train.values():  # compile, settle, build optimizer state
            timed(t, args.warmup)
        for t in eager.values():
            forward_backward(t)
            step_only(t)
        shapes = sorted({tuple(p.shape) for _, p in muon_parameters(eager["adamw"].model)})
        dtype, why = newton_schulz_dtype(torch.device("cpu"), max(shapes, key=math.prod))
        gen = torch.Generator().manual_seed(0)
        matrices = {f"{r}x{c}": torch.randn(r, c, generator=gen) for r, c in shapes}
        for m in matrices.values():
            newton_schulz_only(m, getattr(torch, dtype))
        every = [torch.randn(p.shape, generator=gen)
                 for _, p in muon_parameters(eager["adamw"].model)]
        newton_schulz_step(every, getattr(torch, dtype))
        fb, step, train_s = [], {n: [] for n in eager}, {n: [] for n in train}
        ns = {k: [] for k in matrices}
        ns_step = []
        for r in range(args.rounds):
            names = list(eager) if r % 2 == 0 else list(eager)[::-1]
            for name in names:
                fb.append(forward_backward(eager[name]))
                step[name].append(step_only(eager[name]))
                train_s[name].append(timed(train[name], args.steps))
            for k, m in matrices.items():
                ns[k].append(newton_schulz_only(m, getattr(torch, dtype)))
            ns_step.append(newton_schulz_step(every, getattr(torch, dtype)))
        forward_backward(eager["lmforge muon"])
        errors = accuracy(look_aheads(eager["lmforge muon"]))
    forms = compare_forms(FORM_SHAPES, args.rounds, torch.get_num_threads()) if args.forms \
        else {}
    shape = max(shapes, key=math.prod)
    bf16, fp32 = probe_seconds(tuple(sorted(int(n) for n in shape)), torch.get_num_threads())
    return {"machine": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(), "compiled": compiled,
            "shape": f"{LAYERS}x{WIDTH}, vocab {VOCAB}, {micro}x{CONTEXT}",
            "ns_dtype": dtype, "why": why, "probe_bf16_over_fp32": bf16 / fp32,
            "forward_backward_s": min(fb),
            "step_s": {n: min(v) for n, v in step.items()},
            "train_tokens_per_s": {n: tokens / min(v) for n, v in train_s.items()},
            "newton_schulz_s": {k: min(v) for k, v in ns.items()},
            "newton_schulz_step_s": min(ns_step),
            "accuracy_vs_float64": errors, "forms_ms": forms,
            "muon_matrices": {f"{r}x{c}": n for (r, c), n in Counter(
                tuple(p.shape) for _, p in muon_parameters(eager["adamw"].model)).items()}}


def report(r: dict) -> None:
    """The figures and the ratios issue 43 asks for."""
    fb = r["forward_backward_s"]
    print(f"{r['machine']} threads={r['threads']} {r['shape']} compiled={r['compiled']}; "
          f"lmforge's Muon orthogonalises in {r['ns_dtype']} ({r['why']})")
    print(f"forward+backward of a micro-batch: {fb:.3f} s")
    for name, s in r["step_s"].items():
        print(f"  step {name:13s} {s:8.4f} s  = {s / fb:6.2f}x forward+backward")
    tps = r["train_tokens_per_s"]
    for name, v in tps.items():
        print(f"  train {name:12s} {v:8,.0f} tokens/s = {v / tps['adamw']:.2f}x AdamW")
    for shape, s in r.get("newton_schulz_s", {}).items():
        print(f"  Newton-Schulz {shape:9s} {s * 1e3:7.2f} ms in {r['ns_dtype']} "
              f"(x{r['muon_matrices'][shape]} matrices)")
    if "newton_schulz_step_s" in r:
        count = sum(r["muon_matrices"].values())
        print(f"  Newton-Schulz of one step's {count} matrices: "
              f"{r['newton_schulz_step_s'] * 1e3:.1f} ms in {r['ns_dtype']}")
    for name, err in r.get("accuracy_vs_float64", {}).items():
        print(f"  {name:19s} relative error against float64: {err:.1e} (largest of the "
              f"trainer's {sum(r['muon_matrices'].values())} updates)")
    for shape, row in r.get("forms_ms", {}).items():
        print(f"  float32 {shape:10s} iteration {row['iteration']:7.2f} ms, spectral "
              f"{row['spectral']:7.2f} ms ({row['spectral'] / row['iteration']:.2f}x), "
              f"spectral on one thread {row['spectral_1_thread']:7.2f} ms")
    if "torch muon" in r["step_s"]:
        print(f"lmforge Muon step / torch Muon step: "
              f"{r['step_s']['lmforge muon'] / r['step_s']['torch muon']:.3f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=2, help="train steps per round")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--micro", type=int, default=MICRO, help="micro-batch (rows of 256)")
    ap.add_argument("--skip-torch", action="store_true",
                    help="leave out torch.optim.Muon (bf16: minutes per round when capped)")
    ap.add_argument("--forms", action="store_true",
                    help="also time the iteration against the spectral form, up to 1024")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    result = measure(args)
    report(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
