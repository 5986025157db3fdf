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
    micro-batch losses, computed as ``loss / accum`` exactly as before. An objective whose
    loss has parts (DPO with replay) gets each part's mean over the step, summed
    (``micro_share``).

    A non-finite loss or grad norm skips the update. The host reads loss and grad norm
    once per optimizer step (one sync; logging costs nothing more). Where the optimizer
    can skip on the device (:func:`skips_on_device`: a fused AdamW on CUDA) the update is
    queued first, with the guard's verdict as a device flag, and the host reads after:
    the GPU then never idles while the host decides (issue 44: 4.4 ms of a 36 ms step).
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
    figures = torch.cat([stats, stat_sums.float()])  # the host reads them all at once
    queued = skips_on_device(optimizer, scaler, env.device)
    if queued:
        # The copy is queued before the update, and the host waits for it alone: the
        # GPU still has the update to run while the host readies the next step.
        reading = HostRead(figures)
        step_unless_non_finite(optimizer, stats)
        values = reading.values()
    else:
        values = figures.tolist()
    loss_val, norm_val, *stat_values = values
    if not queued and math.isfinite(loss_val) and (math.isfinite(norm_val)
                                                   or scaler.is_enabled()):
        scaler.step(optimizer)  # with fp16, skips by itself when the grads overflowed
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return loss_val, norm_val, dict(zip(objective.stats, stat_values, strict=True))


class HostRead:
    """A small CUDA tensor's values for the host, without waiting for the whole stream:
    a non-blocking copy into pinned memory and an event recorded after it, so
    :meth:`values` waits for that copy alone, not for the work queued behind it
    (``tensor.tolist()`` waits for everything queued before it returns)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.done: torch.cuda.Event | None = None
        if tensor.device.type != "cuda":  # nothing runs ahead of the host: a copy
            self.host = tensor.detach().clone()
            return
        self.host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        self.host.copy_(tensor, non_blocking=True)
        self.done = torch.cuda.Event()
        self.done.record()

    def values(self) -> list[float]:
        """The values, once the copy has landed."""
        if self.done is not None:
            self.done.synchronize()
        return self.host.tolist()


def skips_on_device(optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
                    device: torch.device) -> bool:
    """Whether the non-finite guard can skip the update on ``device`` without the host:
    on CUDA, without a GradScaler (bf16/fp32), with an optimizer whose every group runs
    torch's fused kernel, which takes GradScaler's ``found_inf`` flag and then changes
    nothing, step counts included. (On a CPU the host reads the figures first, as
    before: nothing runs ahead of the host there.)"""
    return (device.type == "cuda" and not scaler.is_enabled()
            and getattr(optimizer, "_step_supports_amp_scaling", False)
            and all(group.get("fused") for group in optimizer.param_groups))


def step_unless_non_finite(optimizer: torch.optim.Optimizer, stats: torch.Tensor) -> None:
    """Queue ``optimizer.step()``, skipped by the fused kernel itself when any of
    ``stats`` (the step's loss and grad norm) is not finite: no host sync."""
    optimizer.found_inf = (~torch.isfinite(stats).all()).float()  # type: ignore[attr-defined]
    try:
        optimizer.step()
    finally:
        del optimizer.found_inf  # type: ignore[attr-defined]


def _accumulate(step_model: torch.nn.Module, ddp: DistributedDataParallel | None,
                scaler: torch.amp.GradScaler, precision: Precision, loader: Any, accum: int,
                env: DistEnv, objective: Objective) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward and backward over the step's micro-batches, each weighed by its share of
    the step's count -> (the step's weighted loss, the objective's stat sums) on this rank."""
    # (inputs, targets) or, with document masking, (inputs, targets, positions).
    batches = [[torch.as_tensor(t) for t in loader.next_batch()] for _ in range(accum)]
    counts = [objective.count(b) for b in batches]
    if isinstance(counts[0], tuple):  # a loss of parts, each a mean over its own items
        total: int | tuple[int, ...] = step_target_count(
            tuple(sum(part) for part in zip(*counts, strict=True)), env)
    else:
        # Pretraining windows (no loss mask) are all targets on every rank: the step's
        # count is known without asking the other ranks.
        masked = getattr(getattr(loader, "shards", None), "has_loss_mask", True)
        total = (step_target_count(sum(counts), env) if masked
                 else sum(counts) * env.world_size)
    loss_sum = torch.zeros((), device=env.device)
    stat_sums = torch.zeros(len(objective.stats), device=env.device)
    for micro, (host, count) in enumerate(zip(batches, counts, strict=True)):
        batch = [to_device(t, env.device) for t in host]
        # Gradients are all-reduced only on the last micro-batch.
        sync = (ddp.no_sync() if ddp is not None and micro < accum - 1
                else contextlib.nullcontext())
        with sync:
            with precision.autocast():
                loss, stats = objective.loss(step_model, batch)
            if stats is not None:
                stat_sums += stats.detach().float()
            weighted = micro_share(loss, count, total, env.world_size)
            if weighted is not None:
                loss_sum += weighted.detach().float()
            else:  # its loss is NaN (no targets), its gradient zero: weigh it zero
                weighted = loss.sum() * 0.0 if isinstance(count, tuple) else loss * 0.0
            scaler.scale(weighted).backward()
    return loss_sum, stat_sums


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``; to CUDA through pinned memory, so the copy is queued on the
    stream instead of waiting for it to drain (a copy from pageable memory waits for
    every kernel queued before it: the GPU would idle until the host caught up)."""
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def micro_share(loss: torch.Tensor, count: int | tuple[int, ...],
                total: int | tuple[int, ...], world_size: int) -> torch.Tensor | None:
    """A micro-batch's term of the step's loss: its mean loss times its share of the
    step's items (``count`` of ``total``); None when it has none.

    DDP averages over ranks, hence the world size in the share. A loss of parts
    (``count`` a tuple, ``loss`` the parts' means, e.g. DPO's pairs and its replay
    tokens) weighs each part by its own share, so the step's loss is the sum of each
    part's mean over the whole step; a part with no items here adds nothing.
    """
    if not isinstance(count, tuple):
        return loss / (total / (count * world_size)) if count else None
    assert isinstance(total, tuple)
    terms = [loss[k] / (t / (c * world_size))
             for k, (c, t) in enumerate(zip(count, total, strict=True)) if c]
    return torch.stack(terms).sum() if terms else None


def step_target_count(local: int | tuple[int, ...], env: DistEnv) -> int | tuple[int, ...]:
    """Target tokens (or whatever the objective counts) of this optimizer step over all
    ranks, at least 1; a tuple of counts (a loss of parts) gives one total per part."""
    parts = local if isinstance(local, tuple) else (local,)
    if env.distributed:
        t = torch.tensor(parts, dtype=torch.int64, device=env.device)
        dist.all_reduce(t)
        parts = tuple(int(x) for x in t.tolist())
    totals = tuple(max(x, 1) for x in parts)
    return totals if isinstance(local, tuple) else totals[0]
