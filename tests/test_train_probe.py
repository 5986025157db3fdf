"""The CUDA micro-batch probe's search and batch split, with fake steps (runs on CPU)."""

from __future__ import annotations

import pytest
import torch

from lmforge.config import ModelConfig, TrainConfig
from lmforge.model import Llama
from lmforge.train.optim import build_optimizer
from lmforge.train.precision import resolve_precision
from lmforge.train.probe import largest_fitting, oom_free, probe_micro_batch, split_batch


def fake_step(capacity: int, tried: list[int]):
    """A forward+backward that runs out of CUDA memory above ``capacity``."""
    def step(size: int) -> None:
        tried.append(size)
        if size > capacity:
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory at {size}")
    return step


@pytest.mark.parametrize("capacity,start,limit", [
    (37, 4, 256), (37, 64, 256), (1, 16, 64), (500, 8, 96), (96, 96, 96), (5, 1, 6)])
def test_largest_fitting_finds_the_capacity(capacity, start, limit):
    tried: list[int] = []
    got = largest_fitting(oom_free(fake_step(capacity, tried)), start, limit)
    assert got == min(capacity, limit)
    assert max(tried) <= limit
    # Doubling + bisection: logarithmic, not a linear scan.
    assert len(tried) <= 2 * limit.bit_length() + 2


def test_nothing_fits_and_other_errors_propagate():
    assert largest_fitting(oom_free(fake_step(0, [])), 8, 64) == 0

    def broken(size: int) -> None:
        raise ValueError("a bug, not memory")

    with pytest.raises(ValueError, match="a bug"):
        largest_fitting(oom_free(broken), 8, 64)


@pytest.mark.parametrize("per_rank,fits", [(48, 37), (64, 64), (30, 7), (17, 16), (12, 1)])
def test_split_keeps_the_per_rank_batch(per_rank, fits):
    micro, accum = split_batch(per_rank, fits)
    assert micro * accum == per_rank and micro <= fits
    # No larger divisor of per_rank fits.
    assert all(per_rank % d for d in range(micro + 1, fits + 1))


def test_probe_off_cuda_keeps_the_configured_batch():
    cfg = TrainConfig(micro_batch_size=6, grad_accum_steps=3, probe_micro_batch=True)
    mcfg = ModelConfig(n_layer=1, n_head=2, n_embd=16, seq_len=8)
    model = Llama(mcfg, 32)
    device = torch.device("cpu")
    logs: list[str] = []
    got = probe_micro_batch(model, build_optimizer(model, cfg, device),
                            resolve_precision("fp32", device), mcfg, cfg, 32, device,
                            logs.append)
    assert got == (6, 3)
    assert "only runs on CUDA" in logs[0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_probe_on_cuda_keeps_the_global_batch():
    cfg = TrainConfig(micro_batch_size=2, grad_accum_steps=8)
    mcfg = ModelConfig(n_layer=1, n_head=2, n_embd=32, seq_len=16)
    device = torch.device("cuda")
    model = Llama(mcfg, 64).to(device)
    micro, accum = probe_micro_batch(model, build_optimizer(model, cfg, device),
                                     resolve_precision("auto", device), mcfg, cfg, 64,
                                     device, lambda _: None)
    assert micro * accum == 16 and micro == 16  # a tiny model fits the whole batch
    assert all(p.grad is None for p in model.parameters())
