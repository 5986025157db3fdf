"""Spectral Newton-Schulz: Muon's float32 orthogonalisation on a CPU through one
eigendecomposition of the Gram matrix (issue 43: a CPU without bf16 units).

The spectral form evaluates the same polynomial of the same matrix, so it is checked
against the standard iteration computed in float64 (random, ill-conditioned and the
demo's shapes, both orientations) and against bfloat16's error; the paths that must not
change (bfloat16 everywhere: torch.optim.Muon to the bit) are checked to the bit; the
step's side-by-side workers are checked to give the same bytes at any thread count; and a
float32 Muon run that takes the spectral form still resumes bit-identical.
"""

from __future__ import annotations

import functools
import threading

import pytest
import torch
from test_train_loop import inputs, run, tiny_params
from test_train_muon import NS, known_matrix, ns_reference, resumes_from_step_4_bit_identical

from lmforge.train import muon as muon_module
from lmforge.train.muon import (
    Muon,
    newton_schulz,
    newton_schulz_gains,
    orthogonalize,
    orthogonalize_all,
    spectral_orthogonalize,
    use_spectral_form,
)

__all__ = ["inputs"]  # the module fixture, shared with test_train_loop

CPU = torch.device("cpu")
SHAPES = [(64, 176), (176, 64), (64, 64), (256, 704), (704, 256), (256, 256)]


def spread_matrix(rows: int, cols: int, seed: int = 0, low: float = 1e-6) -> torch.Tensor:
    """A float64 matrix with singular values log-spaced from 1 down to ``low``."""
    gen = torch.Generator().manual_seed(seed)
    k = min(rows, cols)
    u, _ = torch.linalg.qr(torch.randn(rows, k, generator=gen, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(cols, k, generator=gen, dtype=torch.float64))
    return u @ torch.diag(torch.logspace(0, torch.log10(torch.tensor(low)).item(), k,
                                         dtype=torch.float64)) @ v.T


def random_matrix(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed),
                       dtype=torch.float64)


def standard_float64(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """The standard iteration in float64, wide orientation, as orthogonalize takes it."""
    x = g.double()
    tall = x.size(0) > x.size(1)
    x = x.T if tall else x
    x = newton_schulz(x / x.norm(), NS, steps)
    return x.T if tall else x


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float(torch.linalg.matrix_norm(out.double() - ref) / torch.linalg.matrix_norm(ref))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", ["random", "singular values 1e-6..1"])
def test_the_spectral_form_is_the_iteration_within_float32_rounding(shape, kind):
    """Against the standard iteration in float64: within 2e-3 (relative, Frobenius),
    and ten times nearer than torch's bfloat16 iteration, the one Muon runs on GPUs."""
    assert use_spectral_form(CPU, torch.float32)
    make = random_matrix if kind == "random" else spread_matrix
    for seed in range(2):
        g = make(*shape, seed=seed)
        ref = standard_float64(g)
        err = relative_error(orthogonalize(g.float(), torch.float32), ref)
        err16 = relative_error(orthogonalize(g.float(), torch.bfloat16), ref)
        assert err < 2e-3 and 10 * err < err16, (err, err16)


def test_it_really_is_the_spectral_form_that_ran(monkeypatch):
    calls = []
    real = torch.linalg.eigh
    monkeypatch.setattr(torch.linalg, "eigh", lambda g: calls.append(g.shape) or real(g))
    orthogonalize(random_matrix(176, 64).float(), torch.float32)
    assert calls == [torch.Size([64, 64])]  # the small Gram matrix, once


@pytest.mark.parametrize("steps", [1, 2, 5, 7])
def test_in_float64_the_spectral_form_is_the_same_polynomial(steps):
    """The identity itself, rounding aside (float64: ~1e-12 after seven iterations)."""
    x = spread_matrix(48, 130, seed=3, low=1e-3)
    x = x / x.norm()
    for g in (x, x.T):
        assert torch.allclose(spectral_orthogonalize(g, NS, steps), standard_float64(g, steps),
                              rtol=0, atol=1e-10)


def test_the_gains_are_the_iteration_on_each_singular_value():
    """h(sigma^2) sigma is the scalar quintic applied ``steps`` times; an eigenvalue a hair
    below zero counts as zero (gain a^steps, the iteration's slope there)."""
    sigma = torch.tensor([0.0, 1e-4, 0.01, 0.3, 1.0], dtype=torch.float64)
    want = sigma.clone()
    a, b, c = NS
    for _ in range(5):
        want = a * want + b * want**3 + c * want**5
    gains = newton_schulz_gains(sigma**2, NS, 5)
    assert torch.allclose(gains * sigma, want, rtol=1e-12, atol=0)
    assert newton_schulz_gains(torch.tensor([-1e-9]), NS, 5).item() == pytest.approx(a**5)


def test_the_svd_polynomial_agrees_on_a_known_matrix():
    """And with the independent reference (the scalar polynomial on the singular values)."""
    g = known_matrix(48, 130)
    assert (orthogonalize(g, torch.float32).double() - ns_reference(g)).abs().max() < 1e-4


def test_a_zero_update_stays_zero_and_a_nan_reaches_the_step_guard():
    assert torch.equal(orthogonalize(torch.zeros(32, 80), torch.float32), torch.zeros(32, 80))
    bad = random_matrix(32, 80).float()
    bad[3, 5] = float("nan")
    assert torch.isnan(orthogonalize(bad, torch.float32)).any()


def test_an_eigendecomposition_that_fails_falls_back_to_the_iteration(monkeypatch):
    def fail(g):
        raise torch.linalg.LinAlgError("did not converge")

    x = random_matrix(32, 80).float()
    monkeypatch.setattr(torch.linalg, "eigh", fail)
    assert torch.equal(spectral_orthogonalize(x, NS, 5), newton_schulz(x / x.norm(), NS, 5))
    assert torch.equal(spectral_orthogonalize(x.T, NS, 5), newton_schulz(x / x.norm(), NS, 5).T)


def test_only_float32_on_a_cpu_takes_the_spectral_form():
    assert use_spectral_form(CPU, torch.float32)
    assert not use_spectral_form(CPU, torch.bfloat16)
    assert not use_spectral_form(torch.device("cuda"), torch.float32)
    assert not use_spectral_form(torch.device("meta"), torch.float32)


@pytest.mark.parametrize("shape", [(64, 176), (176, 64), (256, 256)])
def test_bf16_is_torchs_to_the_bit(shape):
    from torch.optim._muon import _zeropower_via_newtonschulz

    g = random_matrix(*shape).float()
    assert torch.equal(orthogonalize(g, torch.bfloat16, NS, 5, 1e-7),
                       _zeropower_via_newtonschulz(g, NS, 5, 1e-7))
    assert torch.equal(orthogonalize_all([g], torch.bfloat16)[0],
                       _zeropower_via_newtonschulz(g, NS, 5, 1e-7))


def test_a_bf16_muon_step_is_torchs_to_the_bit():
    kw = dict(lr=0.05, weight_decay=0.2, momentum=0.9, nesterov=True)
    ours = [torch.nn.Parameter(random_matrix(64, 176, seed=s).float()) for s in range(2)]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    a, b = Muon(ours, ns_dtype="bfloat16", **kw), torch.optim.Muon(theirs, **kw)
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        for p, q in zip(ours, theirs, strict=True):
            p.grad = torch.randn(p.shape, generator=gen)
            q.grad = p.grad.clone()
        a.step()
        b.step()
    for p, q in zip(ours, theirs, strict=True):
        assert torch.equal(p, q)


def test_side_by_side_workers_give_the_same_bytes_at_any_thread_count():
    """Each matrix on one thread, in order, whatever the workers: the same bytes with 1,
    2 or 3 threads as one by one on one thread; the caller's thread count is restored."""
    updates = [random_matrix(r, c, seed=i).float()
               for i, (r, c) in enumerate([(64, 176), (176, 64), (64, 64), (96, 64), (64, 64)])]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = [orthogonalize(u, torch.float32) for u in updates]
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            out = orthogonalize_all(updates, torch.float32)
            assert torch.get_num_threads() == threads
            assert all(torch.equal(a, b) for a, b in zip(alone, out, strict=True))
    finally:
        torch.set_num_threads(before)


def test_a_float32_muon_step_is_the_same_at_any_thread_count():
    """The whole step (momentum, orthogonalisation, decay, rate) in the workers: the
    same weights after three steps with 1 or 2 threads, and grad mode left off."""
    before = torch.get_num_threads()
    shapes = [(64, 176), (176, 64), (64, 64)]
    moved = {}
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            params = [torch.nn.Parameter(random_matrix(*s, seed=i).float())
                      for i, s in enumerate(shapes)]
            opt = Muon(params, ns_dtype="float32", lr=0.05, weight_decay=0.1,
                       momentum=0.9, nesterov=True)
            gen = torch.Generator().manual_seed(2)
            for _ in range(3):
                for p in params:
                    p.grad = torch.randn(p.shape, generator=gen)
                opt.step()
            assert not any(p.grad_fn for p in params)
            moved[threads] = [p.detach().clone() for p in params]
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(moved[1], moved[2], strict=True))
    assert not torch.equal(moved[1][0], random_matrix(*shapes[0]).float())


def test_a_failing_job_still_gives_back_the_thread_count():
    before = torch.get_num_threads()

    def boom():
        raise RuntimeError("job failed")

    try:
        torch.set_num_threads(2)
        with pytest.raises(RuntimeError, match="job failed"):
            muon_module.side_by_side([boom, boom], [torch.Size((4, 4))] * 2,
                                     torch.float32, CPU)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_workers_run_one_thread_each_and_leave_the_callers_count_alone():
    """Jobs see one intra-op thread; the caller keeps its count, and a thread started
    afterwards gets the caller's too (PyTorch's process default is put back)."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        seen = muon_module.side_by_side([torch.get_num_threads] * 4,
                                        [torch.Size((8, 8))] * 4, torch.float32, CPU)
        later: list[int] = []
        thread = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
        thread.start()
        thread.join()
        assert seen == [1, 1, 1, 1] and torch.get_num_threads() == 2 and later == [2]
    finally:
        torch.set_num_threads(before)


def test_the_workers_take_the_largest_matrices_first_and_each_once():
    """Longest first, each worker taking the next when free: the two largest start
    first; every job runs once; results come back in the jobs' order."""
    shapes = [torch.Size(s) for s in [(64, 64), (256, 704), (64, 176), (704, 256), (32, 32)]]
    started: list[int] = []

    def job(i: int) -> int:
        started.append(i)
        return i * i

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        out = muon_module.side_by_side([functools.partial(job, i) for i in range(5)],
                                       shapes, torch.float32, CPU)
    finally:
        torch.set_num_threads(before)
    assert out == [0, 1, 4, 9, 16]
    assert sorted(started) == list(range(5)) and set(started[:2]) == {1, 3}
    costs = [muon_module._spectral_cost(s) for s in shapes]
    assert costs[1] == costs[3] > costs[2] > costs[0] > costs[4]


def test_a_float32_muon_run_takes_the_spectral_form_and_resumes_bit_identical(
        inputs, tmp_path, monkeypatch):
    """As on a CPU without bf16 units: float32, every matrix by the spectral form; a run
    resumed from its step-4 checkpoint ends on the same bytes."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    calls = []
    real = muon_module.spectral_orthogonalize
    monkeypatch.setattr(muon_module, "spectral_orthogonalize",
                        lambda x, *a, **k: calls.append(tuple(x.shape)) or real(x, *a, **k))
    params = tiny_params(max_steps=8, eval_every=0, ckpt_every=4, optimizer="muon",
                         muon_lr=0.02)
    logs: list[str] = []
    first = run(params, inputs, tmp_path / "c", logs)
    assert any("Muon orthogonalises in float32" in line for line in logs)
    assert len(calls) >= 8 * 4  # every matrix of the tiny model, every step
    state = resumes_from_step_4_bit_identical(first, params, inputs, tmp_path / "c", logs)
    assert state["optimizer"]["muon"]["param_groups"][0]["ns_dtype"] == "float32"
