"""The non-finite guard decided on the device (train/step.py, issue 44): on CUDA a fused
AdamW step is queued with the guard's verdict as GradScaler's ``found_inf`` flag, before
the host reads loss and grad norm. Its logic runs here on a CPU (torch's fused CPU AdamW
takes the same flag): a finite step equals the host-decided one bit for bit, a
non-finite one changes nothing, moments and step counts included."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from lmforge.config import ModelConfig
from lmforge.model import Llama
from lmforge.train import step as step_module
from lmforge.train.distributed import DistEnv
from lmforge.train.precision import resolve_precision
from lmforge.train.step import optimizer_step, skips_on_device

CPU = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


class ListLoader:
    def __init__(self, batches):
        self.batches = list(batches)

    def next_batch(self):
        return self.batches.pop(0)


def two_steps(model: Llama, batches: list, on_device: bool, monkeypatch) -> tuple:
    """Two optimizer steps of a fused AdamW, the guard on the device or on the host."""
    monkeypatch.setattr(step_module, "skips_on_device", lambda *a: on_device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    prec = resolve_precision("fp32", CPU.device)
    figures = [optimizer_step(model, None, model, opt, prec.grad_scaler(), prec,
                              ListLoader([b]), 1, 1.0, CPU)[:2] for b in batches]
    return figures, opt


def state_of(model: Llama, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        st = opt.state.get(p, {})
        out += [st[k].clone() for k in ("exp_avg", "exp_avg_sq", "step") if k in st]
    return out


def test_a_finite_step_on_the_device_equals_the_host_decided_one(monkeypatch):
    torch.manual_seed(0)
    base = Llama(ModelConfig(n_layer=2, n_head=2, n_embd=32, seq_len=16), 64)
    batches = [tuple(torch.randint(0, 64, (2, 4, 16))) for _ in range(2)]
    runs = {}
    for on_device in (False, True):
        model = copy.deepcopy(base)
        figures, opt = two_steps(model, batches, on_device, monkeypatch)
        runs[on_device] = figures, state_of(model, opt)
    assert runs[True][0] == runs[False][0]  # the same loss and grad norm, read after
    for a, b in zip(runs[True][1], runs[False][1], strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(runs[True][1][0], base.tok_embeddings.weight)  # it trained


@pytest.mark.parametrize("on_device", [False, True])
def test_a_non_finite_step_changes_nothing_on_either_path(monkeypatch, on_device):
    torch.manual_seed(0)
    model = Llama(ModelConfig(n_layer=1, n_head=2, n_embd=16, seq_len=8), 32)
    good = tuple(torch.randint(0, 32, (2, 2, 8)))
    _, opt = two_steps(model, [good], on_device, monkeypatch)  # moments exist
    before = state_of(model, opt)
    with torch.no_grad():
        model.tok_embeddings.weight[5] = float("nan")
    x = torch.full((2, 8), 5)
    prec = resolve_precision("fp32", CPU.device)
    loss, norm, _ = optimizer_step(model, None, model, opt, prec.grad_scaler(), prec,
                                   ListLoader([(x, x)]), 1, 1.0, CPU)
    assert not math.isfinite(loss)
    after = state_of(model, opt)
    with torch.no_grad():  # the poisoned row aside, every value and count as before
        after[0][5] = before[0][5]
    for a, b in zip(after, before, strict=True):
        assert torch.equal(a, b)
    assert not hasattr(opt, "found_inf")  # the flag does not outlive the step


def test_only_a_fused_optimizer_on_cuda_without_a_scaler_skips_on_the_device():
    p = torch.nn.Parameter(torch.ones(2))
    fused = torch.optim.AdamW([p], fused=True)
    plain = torch.optim.AdamW([p], foreach=False)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    off = resolve_precision("fp32", cpu).grad_scaler()
    assert not off.is_enabled()
    assert skips_on_device(fused, off, cuda)
    assert not skips_on_device(fused, off, cpu)  # nothing runs ahead of a CPU's host
    assert not skips_on_device(plain, off, cuda)
    assert not skips_on_device(torch.optim.SGD([p], lr=0.1), off, cuda)
    fp16 = torch.amp.GradScaler("cpu", enabled=True)  # fp16 keeps GradScaler's own skip
    assert not skips_on_device(fused, fp16, cuda)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_a_non_finite_step_is_skipped_by_the_kernel():
    cuda = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cuda"))
    torch.manual_seed(0)
    model = Llama(ModelConfig(n_layer=1, n_head=2, n_embd=16, seq_len=8), 32).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    prec = resolve_precision("bf16", cuda.device)
    assert skips_on_device(opt, prec.grad_scaler(), cuda.device)
    good = tuple(torch.randint(0, 32, (2, 2, 8), device="cuda"))
    optimizer_step(model, None, model, opt, prec.grad_scaler(), prec, ListLoader([good]), 1,
                   1.0, cuda)
    before = state_of(model, opt)
    with torch.no_grad():
        model.tok_embeddings.weight[5] = float("nan")
    x = torch.full((2, 8), 5, device="cuda")
    loss, _, _ = optimizer_step(model, None, model, opt, prec.grad_scaler(), prec,
                                ListLoader([(x, x)]), 1, 1.0, cuda)
    assert not math.isfinite(loss)
    after = state_of(model, opt)
    with torch.no_grad():
        after[0][5] = before[0][5]
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
def test_a_host_read_holds_the_values_when_it_was_queued(device):
    from lmforge.train.step import HostRead, to_device

    t = torch.tensor([1.5, float("nan"), 3.0], device=device)
    reading = HostRead(t)
    t.add_(10.0)  # work queued after the read does not reach it
    got = reading.values()
    assert got[0] == 1.5 and math.isnan(got[1]) and got[2] == 3.0
    batch = torch.arange(6).view(2, 3)
    moved = to_device(batch, torch.device(device))
    assert moved.device.type == device and torch.equal(moved.cpu(), batch)
