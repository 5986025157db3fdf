"""Muon's Newton-Schulz dtype follows the device (issue 43).

torch.optim.Muon orthogonalises in bf16 always, which costs 15-70x a float32 matmul on
a CPU without bf16 units. lmforge's Muon takes the dtype as a group option chosen per
device (a timed probe on CPUs), keeps it in checkpoints, and in bf16 is torch's Muon to
the bit.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch
from test_train_loop import REPO
from test_train_muon import NS, known_matrix, muon_cfg, ns_reference, tiny_model

from lmforge.train import muon as muon_module
from lmforge.train.muon import Muon, newton_schulz_dtype, orthogonalize
from lmforge.train.optim import build_optimizer, muon_parameters

CPU = torch.device("cpu")
# PyTorch's own kernels capped to AVX2 and oneDNN to AVX2: a bf16 matmul then takes
# the slow reference path of a CPU without bf16 units (checked in the test below).
AVX2_ONLY = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


@pytest.mark.parametrize("shape", [(48, 16), (16, 48), (32, 32)])
def test_bf16_orthogonalisation_is_torchs_to_the_bit(shape):
    from torch.optim._muon import _zeropower_via_newtonschulz

    g = known_matrix(*shape)
    ours = orthogonalize(g, torch.bfloat16, NS, 5, 1e-7)
    assert ours.dtype == torch.bfloat16
    assert torch.equal(ours, _zeropower_via_newtonschulz(g, NS, 5, 1e-7))


@pytest.mark.parametrize("shape", [(48, 16), (16, 48), (32, 32)])
def test_float32_orthogonalisation_is_nearer_the_exact_polynomial(shape):
    g = known_matrix(*shape)
    ref = ns_reference(g)
    err32 = (orthogonalize(g, torch.float32).double() - ref).abs().max()
    err16 = (orthogonalize(g, torch.bfloat16).double() - ref).abs().max()
    assert err32 < 1e-4 < err16  # float32 rounding, against bf16's few ulps


def two_steps(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> None:
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()


@pytest.mark.parametrize("adjust", ["original", "match_rms_adamw"])
def test_a_bf16_step_is_torch_optim_muons_step_to_the_bit(adjust):
    """Same weights, same buffers after two steps (momentum, Nesterov, decay, scaling)."""
    kw = dict(lr=0.05, weight_decay=0.2, momentum=0.9, nesterov=True, adjust_lr_fn=adjust)
    ours = [torch.nn.Parameter(known_matrix(48, 16, seed=s)) for s in range(2)]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    a, b = Muon(ours, ns_dtype="bfloat16", **kw), torch.optim.Muon(theirs, **kw)
    two_steps(a, ours)
    two_steps(b, theirs)
    for p, q in zip(ours, theirs, strict=True):
        assert torch.equal(p, q)
        assert torch.equal(a.state[p]["momentum_buffer"], b.state[q]["momentum_buffer"])


def test_float32_steps_follow_bf16_steps_closely_but_not_to_the_bit():
    start = [known_matrix(48, 16, seed=s) for s in range(2)]
    moved = {}
    for dtype in ("bfloat16", "float32"):
        params = [torch.nn.Parameter(t.clone()) for t in start]
        two_steps(Muon(params, ns_dtype=dtype, lr=0.05), params)
        moved[dtype] = [p.detach() - t for p, t in zip(params, start, strict=True)]
    for m16, m32 in zip(moved["bfloat16"], moved["float32"], strict=True):
        assert not torch.equal(m16, m32)
        assert (m16 - m32).abs().max() < 0.03 * m32.abs().max()


def test_an_unknown_dtype_is_refused():
    with pytest.raises(ValueError, match="ns_dtype 'float16'"):
        Muon([torch.nn.Parameter(torch.zeros(4, 4))], ns_dtype="float16")


def no_probe(*args):
    raise AssertionError("probed: this choice is by capability")


@pytest.mark.parametrize("capability, units, want", [
    ("AVX2", (True, True), "float32"),  # capped below AVX-512: the units are unusable
    ("DEFAULT", (False, False), "float32"), ("NO AVX", (False, False), "float32"),
    ("AVX512", (False, False), "float32"),  # Skylake, Ice Lake: bf16 only emulated
    ("AVX512", (True, False), "bfloat16"), ("AVX512", (False, True), "bfloat16")])
def test_an_x86_cpu_chooses_by_its_capability_never_by_timing(monkeypatch, capability,
                                                              units, want):
    """The same machine always chooses the same: a run's bytes must not depend on how
    busy the machine was when it started."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: units[0])
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: units[1])
    monkeypatch.setattr(muon_module, "probe_seconds", no_probe)
    name, why = newton_schulz_dtype(CPU, (704, 256))
    assert name == want and capability in why
    assert ("AMX" in why) == (want == "bfloat16" and units[1])


@pytest.mark.parametrize("bf16, fp32, want", [(0.4, 1.0, "bfloat16"), (30.0, 1.0, "float32"),
                                               (0.9, 1.0, "float32")])
def test_another_cpu_follows_the_timed_probe_with_a_margin(monkeypatch, bf16, fp32, want):
    """ARM's SVE and the rest: bf16 only when clearly faster (a wrong bf16 costs
    15-70x, a wrong float32 ~2x)."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "SVE256")
    monkeypatch.setattr(muon_module, "probe_seconds", lambda side, threads: (bf16, fp32))
    name, why = newton_schulz_dtype(CPU, (704, 256))
    assert name == want and f"{bf16 / fp32:.2f}x" in why


def test_the_probe_keeps_each_dtypes_least_disturbed_round(monkeypatch):
    """A busy machine: one slice stolen from each dtype's rounds leaves the minimum."""
    clock = iter([0.0, 0.050, 1.0, 1.001] + [2.0, 2.0004, 3.0, 3.040] * 6)
    monkeypatch.setattr(muon_module.time, "perf_counter", lambda: next(clock))
    muon_module.probe_seconds.cache_clear()
    try:
        bf16, fp32 = muon_module.probe_seconds((8, 16), 1)
    finally:
        muon_module.probe_seconds.cache_clear()
    assert bf16 == pytest.approx(0.0004) and fp32 == pytest.approx(0.001)


def test_cuda_takes_bf16_by_capability_without_a_probe(monkeypatch):
    monkeypatch.setattr(muon_module, "probe_seconds", no_probe)
    for supported, want in ((True, "bfloat16"), (False, "float32")):
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda s=supported: s)
        assert newton_schulz_dtype(torch.device("cuda"), (768, 768))[0] == want


def test_the_optimizer_records_the_dtype_and_says_why(monkeypatch):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "SVE256")
    monkeypatch.setattr(muon_module, "probe_seconds", lambda side, threads: (9.0, 1.0))
    logs: list[str] = []
    opt = build_optimizer(tiny_model(), muon_cfg(), CPU, logs.append)
    assert all(g["ns_dtype"] == "float32" for g in opt.parts["muon"].param_groups)
    assert any("Muon orthogonalises in float32" in line and "9.00x" in line
               for line in logs)


def test_a_checkpoint_keeps_its_dtype_on_a_machine_that_would_choose_another(monkeypatch):
    """Resume continues the run as it started; a checkpoint from before the option
    (no ns_dtype in its groups) resumes in bf16, what torch's Muon wrote it with."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    model = tiny_model()
    first = build_optimizer(model, muon_cfg(), CPU)
    matrices = [p for _, p in muon_parameters(model)]
    two_steps(first, matrices)
    state = first.state_dict()
    state["muon"]["param_groups"][0]["ns_dtype"] = "bfloat16"
    second = build_optimizer(model, muon_cfg(), CPU)  # would choose float32 here
    second.load_state_dict(state)
    assert second.parts["muon"].param_groups[0]["ns_dtype"] == "bfloat16"
    del state["muon"]["param_groups"][0]["ns_dtype"]
    legacy = build_optimizer(model, muon_cfg(), CPU)
    legacy.load_state_dict(copy.deepcopy(state))  # a load may share the buffers
    assert "ns_dtype" not in legacy.parts["muon"].param_groups[0]
    # ... and steps exactly as torch's Muon from the same state.
    reference = torch.optim.Muon(matrices, lr=0.05)
    reference.load_state_dict(state["muon"])
    weights = [p.detach().clone() for p in matrices]
    for p in matrices:
        p.grad = torch.ones_like(p)
    legacy.parts["muon"].step()
    ours = [p.detach().clone() for p in matrices]
    for p, w in zip(matrices, weights, strict=True):
        p.data.copy_(w)
    reference.step()
    for p, o in zip(matrices, ours, strict=True):
        assert torch.equal(p.detach(), o)


def test_a_process_capped_to_avx2_orthogonalises_in_float32():
    """A real process whose PyTorch and oneDNN kernels are capped to AVX2 (as on a CPU
    without bf16 units, where a bf16 matmul is 15-70x float32's): float32, said why."""
    env = {**os.environ, **AVX2_ONLY, "PYTHONPATH": str(REPO / "src"),
           "OMP_NUM_THREADS": "1"}
    code = ("import torch; from lmforge.train.muon import newton_schulz_dtype; "
            "print(*newton_schulz_dtype(torch.device('cpu'), (704, 256)), sep='|')")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, check=True).stdout.strip()
    assert out == "float32|PyTorch's CPU kernels are AVX2, without bf16 units", out
