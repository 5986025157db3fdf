"""The pretraining plan: per-rank memory under DDP and FSDP2, and the micro-batch that fits.

:func:`plan` gathers, for both strategies, the rows of :mod:`lmforge.plan.memory`, the
activations per sequence, the total at the run's micro-batch and the largest micro-batch
within the device's budget, as the document ``lmforge plan --json`` prints.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from lmforge.plan.memory import (
    RESERVE_GIB,
    activation_bytes_per_seq,
    largest_fitting,
    reserve_bytes,
    rows_bytes,
    total_bytes,
)
from lmforge.plan.shapes import GIB, Setup, num_params

STRATEGIES = ("ddp", "fsdp")

# The table's rows other than activations: (key of rows_bytes, label), in print order.
ROWS: tuple[tuple[str, str], ...] = (
    ("params", "params (fp32)"),
    ("grads", "grads (fp32)"),
    ("optimizer", "optimizer"),
    ("buckets", "DDP grad buckets"),
    ("unsharded_params", "unsharded params"),
    ("unsharded_grads", "unsharded grads"),
    ("weight_copies", "weight copies"),
    ("loss_buffers", "loss buffers"),
)
# The rows a strategy does not have (the table prints "-").
NOT_APPLICABLE = {"ddp": {"unsharded_params", "unsharded_grads"}, "fsdp": {"buckets"}}


def fit_micro_batch(s: Setup, strategy: str, budget: int) -> int:
    """Largest micro-batch b with total(b) <= budget; 0 = none."""
    return largest_fitting(lambda b: total_bytes(s, strategy, b),
                           activation_bytes_per_seq(s, strategy), budget)


def auto_fused_loss(s: Setup, strategy: str, micro_batch: int, budget: int) -> bool:
    """The ``fused_loss`` a ``fused_loss: auto`` run is planned with on a GPU, under
    ``strategy``: False (the plain loss, the whole logits) when the step with it fits
    ``budget`` bytes at ``micro_batch``, else True (the chunked loss).

    A run's ``auto`` takes the fastest path that fits, by a timed probe
    (lmforge.train.loss_choice); a plan times nothing, so it assumes the plain loss,
    the one to beat at sizes where it fits, and plans its memory."""
    plain = dataclasses.replace(s, fused_loss=False)
    return total_bytes(plain, strategy, micro_batch) > budget


def plan(s: Setup, device_gib: float, micro_batch: int,
         reserve_gib: float = RESERVE_GIB) -> dict[str, Any]:
    """Every figure of the plan, in bytes, for both strategies (the ``--json`` document)."""
    device = int(device_gib * GIB)
    budget = device - reserve_bytes(device, reserve_gib)
    out: dict[str, Any] = {
        "params": num_params(s.model, s.vocab), "vocab": s.vocab,
        "model": dataclasses.asdict(s.model), "precision": s.precision, "world": s.world,
        "activation_checkpointing": s.activation_checkpointing, "fused_loss": s.fused_loss,
        "device_bytes": device, "reserve_bytes": device - budget, "budget_bytes": budget,
        "micro_batch": micro_batch, "optimizer": s.optimizer,
    }
    for strategy in STRATEGIES:
        figures: dict[str, Any] = dict(rows_bytes(s, strategy, micro_batch))
        total = total_bytes(s, strategy, micro_batch)
        compiled = total_bytes(dataclasses.replace(s, compiled=True), strategy, micro_batch)
        figures.update(activations_per_seq=activation_bytes_per_seq(s, strategy),
                       total=total, fits=total <= budget, total_compiled=compiled,
                       max_micro_batch=fit_micro_batch(s, strategy, budget))
        out[strategy] = figures
    return out
