"""One optimizer step: accumulation over micro-batches, clipping, the non-finite guard."""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from lmforge.model.llama import Llama
from lmforge.train.distributed import DistEnv
from lmforge.train.objectives import NextToken, Objective
from lmforge.train.precision import Precision


def optimizer_step(step_model: torch.nn.Module, ddp: DistributedDataParallel | None,
                   model: Llama, optimizer: torch.optim.Optimizer,
                   scaler: torch.amp.GradScaler, precision: Precision, loader: Any,
                   accum: int, clip: float, env: DistEnv, objective: Objective | None = None
                   ) -> tuple[float, float, dict[str, float]]:
    """One optimizer step over ``accum`` micro-batches -> (mean loss, grad norm pre-clip,
    the objective's stat sums over the step's micro-batches and ranks).

    The loss is the mean over every target token of the step (all micro-batches, all
    ranks): each micro-batch weighs by its share of those tokens, so one with few targets
    (a short prompt-masked fine-tuning example) counts little and one with none counts
    zero, never NaN. With equal counts, as in pretraining, that is the plain mean of the
    micro-batch losses, computed as ``loss / accum`` exactly as before.

    A non-finite loss or grad norm skips the update. That test needs one host sync per
    optimizer step; loss and grad norm travel in it, so logging costs nothing more.
    """
    objective = objective or NextToken()
    loss_sum, stat_sums = _accumulate(step_model, ddp, scaler, precision, loader, accum,
                                      env, objective)
    scaler.unscale_(optimizer)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else math.inf)
    if hasattr(norm, "full_tensor"):  # FSDP: a DTensor of partial norms; the global one
        norm = norm.full_tensor()
    stats = torch.stack([loss_sum, norm.float()])
    if env.distributed:
        dist.all_reduce(stats, op=dist.ReduceOp.AVG if env.device.type == "cuda"
                        else dist.ReduceOp.SUM)
        if env.device.type != "cuda":  # gloo has no AVG
            stats /= env.world_size
        if len(objective.stats):
            dist.all_reduce(stat_sums)  # sums over ranks
    loss_val, norm_val = stats.tolist()
    if math.isfinite(loss_val) and (math.isfinite(norm_val) or scaler.is_enabled()):
        scaler.step(optimizer)  # with fp16, skips by itself when the grads overflowed
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return loss_val, norm_val, dict(zip(objective.stats, stat_sums.tolist(), strict=True))


def _accumulate(step_model: torch.nn.Module, ddp: DistributedDataParallel | None,
                scaler: torch.amp.GradScaler, precision: Precision, loader: Any, accum: int,
                env: DistEnv, objective: Objective) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward and backward over the step's micro-batches, each weighed by its share of
    the step's count -> (the step's weighted loss, the objective's stat sums) on this rank."""
    # (inputs, targets) or, with document masking, (inputs, targets, positions).
    batches = [[torch.as_tensor(t) for t in loader.next_batch()] for _ in range(accum)]
    counts = [objective.count(b) for b in batches]
    # Pretraining windows (no loss mask) are all targets on every rank: the step's count
    # is known without asking the other ranks.
    masked = getattr(getattr(loader, "shards", None), "has_loss_mask", True)
    total = step_target_count(sum(counts), env) if masked else sum(counts) * env.world_size
    loss_sum = torch.zeros((), device=env.device)
    stat_sums = torch.zeros(len(objective.stats), device=env.device)
    for micro, (host, count) in enumerate(zip(batches, counts, strict=True)):
        batch = [t.to(env.device, non_blocking=True) for t in host]
        # Gradients are all-reduced only on the last micro-batch.
        sync = (ddp.no_sync() if ddp is not None and micro < accum - 1
                else contextlib.nullcontext())
        with sync:
            with precision.autocast():
                loss, stats = objective.loss(step_model, batch)
            if stats is not None:
                stat_sums += stats.detach().float()
            if count:
                # DDP averages over ranks, hence the world size in the share.
                weighted = loss / (total / (count * env.world_size))
                loss_sum += weighted.detach().float()
            else:  # its loss is NaN (no targets), its gradient zero: weigh it zero
                weighted = loss * 0.0
            scaler.scale(weighted).backward()
    return loss_sum, stat_sums


def step_target_count(local: int, env: DistEnv) -> int:
    """Target tokens of this optimizer step over all ranks (at least 1)."""
    if env.distributed:
        t = torch.tensor([local], dtype=torch.int64, device=env.device)
        dist.all_reduce(t)
        local = int(t.item())
    return max(local, 1)
