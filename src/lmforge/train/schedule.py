"""Learning-rate schedules: linear warmup, then cosine / linear / warmup-stable-decay.

A schedule is a pure function of the optimizer step, so resuming only needs the step.
"""

from __future__ import annotations

import math

from lmforge.config import TrainConfig


def lr_at(step: int, cfg: TrainConfig, peak: float | None = None) -> float:
    """Learning rate for optimizer step ``step`` (0-based) of ``cfg.max_steps``.

    ``peak``: the peak rate of this schedule (default ``cfg.max_lr``; Muon's groups pass
    ``cfg.muon_lr``); the floor is ``min_lr_ratio`` of it.

    Warmup rises linearly to ``max_lr`` over ``cfg.warmup_steps()`` steps; the decay
    then reaches ``min_lr_ratio * max_lr`` exactly on the last step (the config leaves it
    at least one step). A run of one step trains at the peak: it has nothing to warm up
    from or decay to, and its last step at the floor would be a run at a tenth of the
    rate it was given.
    """
    peak = cfg.max_lr if peak is None else peak
    floor = peak * cfg.min_lr_ratio
    if cfg.max_steps == 1:
        return peak
    warmup = cfg.warmup_steps()
    if step < warmup:
        return peak * (step + 1) / warmup
    last = cfg.max_steps - 1
    if cfg.schedule == "wsd":
        # The last step at the peak; at most the one before the last, so the decay
        # reaches the floor on the last step however short decay_fraction makes it.
        decay_start = min(max(warmup, last - int(round(cfg.decay_fraction * cfg.max_steps))),
                          last - 1)
        if step <= decay_start:
            return peak
        return peak + (floor - peak) * _progress(step, decay_start, last)
    progress = _progress(step, warmup, last)
    if cfg.schedule == "linear":
        return peak + (floor - peak) * progress
    return floor + 0.5 * (1.0 + math.cos(math.pi * progress)) * (peak - floor)


def _progress(step: int, start: int, end: int) -> float:
    """Share of the way from ``start`` to ``end``, clamped to [0, 1]."""
    if end <= start:
        return 1.0
    return min(1.0, max(0.0, (step - start) / (end - start)))
