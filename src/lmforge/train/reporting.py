"""What a run reports as it trains: each log interval's line and MLflow metrics, the
fixed-prompt samples, and metrics/train.json's figures at the end."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from lmforge.model.generate import generate
from lmforge.model.llama import Llama
from lmforge.train.distributed import DistEnv
from lmforge.train.precision import Precision
from lmforge.train.resume import Progress
from lmforge.train.telemetry import format_duration, memory_mb


@dataclass
class Interval:
    """Running sums between two log lines."""

    start_time: float = field(default_factory=time.perf_counter)
    start_step: int = 0
    excluded: float = 0.0  # seconds spent in eval / checkpoints, not training
    loss_sum: float = 0.0
    loss_n: int = 0
    stats: dict[str, float] = field(default_factory=dict)  # the objective's step sums


def log_interval(step: int, rates: dict[str, float], grad_norm: float, interval: Interval,
                 skipped: int, tokens_per_step: int, flops_per_step: float, peak: float | None,
                 device: torch.device, max_steps: int, run: Any,
                 log: Callable[[str], None],
                 denominators: dict[str, str] | None = None) -> dict[str, Any]:
    """Report the interval since the last log line; return its plots/train.tsv row.

    ``rates``: ``lr`` and, with Muon, ``lr_muon`` (each group's current rate);
    ``denominators``: the objective's ``stat_denominators`` (``_stat_means``)."""
    now = time.perf_counter()
    steps = step - interval.start_step
    seconds = max(now - interval.start_time - interval.excluded, 1e-9)
    loss = interval.loss_sum / interval.loss_n if interval.loss_n else float("nan")
    tps = steps * tokens_per_step / seconds
    lr = rates["lr"]
    metrics = {"loss": loss, **rates, "grad_norm": grad_norm, "tokens_per_sec": tps,
               "skipped_steps": skipped, "memory_mb": memory_mb(device),
               "tflops": steps * flops_per_step / seconds / 1e12}
    averaged = _stat_means(interval.stats, denominators or {})
    metrics.update(averaged)
    if peak:
        metrics["mfu"] = metrics["tflops"] * 1e12 / peak
    run.log_metrics(metrics, step)
    eta = (max_steps - step) * seconds / max(steps, 1)
    log(f"step {step:>6}/{max_steps} | loss {loss:.4f} | lr {lr:.2e} | "
        f"grad_norm {grad_norm:.3f} | {tps:,.0f} tok/s | eta {format_duration(eta)}"
        + "".join(f" | {k} {v:.3f}" for k, v in averaged.items()))
    interval.start_time, interval.start_step, interval.excluded = now, step, 0.0
    interval.loss_sum, interval.loss_n, interval.stats = 0.0, 0, {}
    return {"step": step, "loss": loss, **rates, "grad_norm": grad_norm,
            "tokens_per_sec": tps, **averaged}


def _stat_means(sums: dict[str, float], denominators: dict[str, str]) -> dict[str, float]:
    """An objective's interval sums as means over the items the first stat counts, or
    over the stat ``denominators`` names for them (not logged themselves).

    Objectives return sums (e.g. ``pairs``, then per-pair figures summed), so a mean
    over micro-batches, ranks and steps weighs every item once.
    """
    if not sums:
        return {}
    names = list(sums)
    means = {}
    for name in names[1:]:
        if name in denominators.values():
            continue
        n = sums[denominators.get(name, names[0])]
        means[name] = sums[name] / n if n else float("nan")
    return means


def log_samples(model: Llama, prompts: list[tuple[str, list[int]]],
                decode: Callable[[list[int]], str] | None, seed: int, step: int,
                run: Any, max_new_tokens: int = 64) -> str | None:
    """Continue each fixed prompt; attach them as ``samples/step-NNNNNN.txt``; return the text.

    Each prompt gets its own generator seeded with ``seed``, so a prompt's samples differ
    between steps only because the weights did, and the training RNG is untouched.
    """
    if not prompts or decode is None:
        return None
    parts = []
    for text, ids in prompts:
        gen = torch.Generator().manual_seed(seed)
        out = list(generate(model, ids, max_new_tokens, temperature=0.8, top_k=50,
                            generator=gen))
        parts.append(f"### {text or '(unconditional)'}\n{text}{decode(out)}\n")
    body = f"step {step}\n\n" + "\n".join(parts)
    run.log_text(body, f"samples/step-{step:06d}.txt")
    return body


def final_metrics(rows: list[dict], val: float, step: int, tokens: int, skipped: int,
                   model: Llama, precision: Precision, env: DistEnv, progress: Progress,
                   wall_seconds: float) -> dict[str, Any]:
    """metrics/train.json."""
    train_losses = [r["loss"] for r in rows if r.get("loss") is not None]
    speeds = sorted(r["tokens_per_sec"] for r in rows if r.get("tokens_per_sec"))
    return {
        "train_loss": train_losses[-1] if train_losses else None,
        "val_loss": val,
        "steps": step,
        "tokens": tokens,
        # The median log interval: robust to the first (warm-up) one and to load spikes.
        "tokens_per_sec": speeds[len(speeds) // 2] if speeds else None,
        "params": model.num_params(),
        "wall_seconds": round(wall_seconds, 3),
        "resumed_from": progress.resumed_from,
        "skipped_steps": skipped,
        "precision": precision.name,
        "world_size": env.world_size,
    }
