"""On CUDA: find the largest micro-batch that fits, and keep the global batch with accumulation.

The probe runs real forward + backward passes at growing micro-batch sizes (doubling,
then bisecting between the last size that fitted and the first that ran out of memory),
while buffers the size of AdamW's two moment tensors are held, so the optimizer state
that training adds later is accounted for. Then the micro-batch becomes the largest
divisor of the per-rank batch (``micro_batch_size * grad_accum_steps``) that fits, and
accumulation makes up the rest: the optimizer sees the same batch either way.
"""

from __future__ import annotations

import gc
from collections.abc import Callable

import torch

from lmforge.config import ModelConfig, TrainConfig
from lmforge.errors import LmforgeError
from lmforge.train.precision import Precision


def largest_fitting(fits: Callable[[int], bool], start: int, limit: int) -> int:
    """Largest size in [1, ``limit``] for which ``fits`` is True (0 if even 1 fails).

    Starts at ``start``, halves until a size fits, doubles until one fails or ``limit``
    is reached, then bisects between the two. Assumes fitting is monotone in size.
    """
    size = max(1, min(start, limit))
    ok, bad = 0, None
    while size >= 1:
        if fits(size):
            ok = size
            break
        bad, size = size, size // 2
    if not ok:
        return 0
    while bad is None and ok < limit:
        size = min(2 * ok, limit)
        if fits(size):
            ok = size
        else:
            bad = size
    while bad is not None and bad - ok > 1:
        mid = (ok + bad) // 2
        if fits(mid):
            ok = mid
        else:
            bad = mid
    return ok


def split_batch(per_rank: int, max_micro: int) -> tuple[int, int]:
    """``(micro, accum)`` with ``micro * accum == per_rank`` and the largest micro <= max."""
    micro = max(d for d in range(1, min(per_rank, max_micro) + 1) if per_rank % d == 0)
    return micro, per_rank // micro


def oom_free(step: Callable[[int], None]) -> Callable[[int], bool]:
    """Wrap a forward+backward at a given size as ``size -> fitted?`` (False on CUDA OOM)."""
    def fits(size: int) -> bool:
        try:
            step(size)
            fitted = True
        except torch.cuda.OutOfMemoryError:
            fitted = False
        if not fitted:
            # The error's traceback held the failed step's frames and their tensors in a
            # cycle only the collector frees (a step that fits frees its own on return;
            # a full collection costs ~0.5 s in a big process, so only here).
            gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return fitted
    return fits


def probe_micro_batch(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                      precision: Precision, mcfg: ModelConfig, cfg: TrainConfig, vocab: int,
                      device: torch.device, log: Callable[[str], None]) -> tuple[int, int]:
    """``(micro_batch, accum)`` for this device; the configured pair off CUDA."""
    configured = (cfg.micro_batch_size, cfg.grad_accum_steps)
    if device.type != "cuda":
        log(f"train: probe_micro_batch only runs on CUDA; keeping micro-batch "
            f"{configured[0]} x {configured[1]} accumulation steps on {device}")
        return configured
    per_rank = cfg.micro_batch_size * cfg.grad_accum_steps
    gen = torch.Generator(device=device).manual_seed(0)  # the training RNG stays untouched
    # Stand-ins for AdamW's exp_avg and exp_avg_sq, allocated on its first step.
    reserve = [torch.empty_like(p) for p in model.parameters() for _ in range(2)]

    def step(size: int) -> None:
        x = torch.randint(vocab, (size, mcfg.seq_len), device=device, generator=gen)
        try:
            with precision.autocast():
                _, loss = model(x, x)
            loss.backward()
        finally:
            model.zero_grad(set_to_none=True)

    best = largest_fitting(oom_free(step), cfg.micro_batch_size, per_rank)
    del reserve
    optimizer.zero_grad(set_to_none=True)
    if best == 0:
        raise LmforgeError(f"train: a micro-batch of 1 x {mcfg.seq_len} tokens does not fit "
                           f"on {device}; use a smaller model or activation_checkpointing")
    micro, accum = split_batch(per_rank, best)
    log(f"train: probe: micro-batch {best} fits on {device}; using {micro} x {accum} "
        f"accumulation steps (configured {configured[0]} x {configured[1]})")
    return micro, accum
