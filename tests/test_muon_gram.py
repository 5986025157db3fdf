"""Gram Newton-Schulz: Muon's float32 orthogonalisation of a wide matrix on its Gram
matrix (issue 43: fewer multiply-adds on a CPU without bf16 units).

The Gram form is the same polynomial of the same matrix, so it is checked against the
standard iteration computed in float64, on random and ill-conditioned matrices in both
orientations; the paths that must not change (bfloat16 everywhere, float32 on square and
near-square matrices) are checked to the bit against torch.optim.Muon and the standard
iteration; and a float32 Muon run that takes the Gram form still resumes bit-identical.
"""

from __future__ import annotations

import pytest
import torch
from test_train_loop import inputs, run, tiny_params
from test_train_muon import NS, known_matrix, ns_reference, resumes_from_step_4_bit_identical

from lmforge.train import muon as muon_module
from lmforge.train.muon import (
    GRAM_MIN_ASPECT,
    Muon,
    gram_is_cheaper,
    gram_newton_schulz,
    newton_schulz,
    orthogonalize,
    use_gram_form,
)

__all__ = ["inputs"]  # the module fixture, shared with test_train_loop


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


def standard_float32(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """The pre-Gram float32 path, written out: normalise, then three matmuls a step."""
    a, b, c = NS
    x = g.float()
    tall = x.size(0) > x.size(1)
    x = x.T if tall else x
    x = x / x.norm().clamp(min=1e-7)
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    return x.T if tall else x


SHAPES = [(64, 176), (176, 64), (256, 704), (704, 256)]  # the demo's MLP, both ways


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", ["random", "singular values 1e-6..1"])
def test_the_gram_form_is_the_standard_iteration_to_float32_rounding(shape, kind):
    """Against the standard iteration in float64: max entry error below 1e-5 (entries
    ~0.1) and spectral error below 5e-5, and within 3x the error of the standard
    iteration run in float32 itself -- the accuracy lmforge's float32 path had."""
    assert use_gram_form(min(shape), max(shape), torch.float32, 5)
    make = random_matrix if kind == "random" else spread_matrix
    for seed in range(2):
        g = make(*shape, seed=seed)
        ref = standard_float64(g)
        gram = orthogonalize(g.float(), torch.float32).double()
        plain = standard_float32(g).double()
        err, err_plain = (gram - ref).abs().max(), (plain - ref).abs().max()
        assert err < 1e-5 and err < 3 * err_plain + 1e-6, (err, err_plain)
        spectral = torch.linalg.matrix_norm(gram - ref, ord=2)
        assert spectral < 5e-5, spectral
        assert not torch.equal(gram, plain)  # the other form really ran


@pytest.mark.parametrize("steps", [1, 2, 3, 5, 7])
@pytest.mark.parametrize("restart_every", [1, 2, 3, 10])
def test_in_float64_the_gram_form_is_the_same_polynomial(steps, restart_every):
    """The identity itself, rounding aside: any steps, any rebuild schedule (float64
    rounding: ~1e-14, ~1e-12 for seven iterations on one Gram matrix)."""
    x = spread_matrix(48, 130, seed=3, low=1e-3)
    x = x / x.norm()
    ours = gram_newton_schulz(x, NS, steps, restart_every)
    assert torch.allclose(ours, newton_schulz(x, NS, steps), rtol=0, atol=1e-10)


def test_the_svd_polynomial_agrees_on_a_known_matrix():
    """And with the independent reference (the scalar polynomial on the singular values)."""
    g = known_matrix(48, 130)
    err = (orthogonalize(g, torch.float32).double() - ns_reference(g)).abs().max()
    assert err < 1e-5


def test_without_the_rebuild_float32_errors_grow_on_ill_conditioned_matrices():
    """Why gram_newton_schulz rebuilds X after three iterations: iterated on one Gram
    matrix for all five, float32 rounding on its small eigenvalues grows ~12x an
    iteration, to tens of times the standard iteration's error."""
    g = spread_matrix(64, 176, seed=0)
    x = (g / g.norm()).float()
    ref = standard_float64(g)
    err = {every: torch.linalg.matrix_norm(gram_newton_schulz(x, NS, 5, every).double()
                                           - ref, ord=2) for every in (3, 5)}
    assert err[5] > 10 * err[3]


def test_the_cost_model_breaks_even_at_one_and_a_half():
    """Multiply-adds: cheaper exactly above cols = 1.5 rows for any steps and rebuild
    schedule; the choice asks for GRAM_MIN_ASPECT; one iteration a segment never."""
    for steps, every in ((5, 3), (5, 2), (7, 3), (5, 10)):
        base = {r: gram_is_cheaper(r, 3 * r // 2, steps, every) for r in (64, 256)}
        assert not any(base.values())
        assert gram_is_cheaper(256, 512, steps, every)
    assert GRAM_MIN_ASPECT >= 1.5
    assert not gram_is_cheaper(256, int(256 * GRAM_MIN_ASPECT) - 1, 5)
    assert gram_is_cheaper(256, 704, 5) and not gram_is_cheaper(256, 256, 5)
    assert not gram_is_cheaper(64, 704, 5, restart_every=1)
    assert not gram_is_cheaper(64, 704, 1)  # one iteration: same three matmuls


@pytest.mark.parametrize("shape", [(256, 256), (32, 32), (256, 384), (384, 256)])
def test_float32_on_square_and_near_square_matrices_is_unchanged_to_the_bit(shape):
    g = spread_matrix(*shape, seed=1, low=1e-2).float()
    assert torch.equal(orthogonalize(g, torch.float32), standard_float32(g))


@pytest.mark.parametrize("shape", SHAPES + [(256, 256)])
def test_bf16_is_torchs_to_the_bit_at_the_demos_shapes(shape):
    """bf16 never takes the Gram form (unstable there; and torch's Muon to the bit)."""
    from torch.optim._muon import _zeropower_via_newtonschulz

    g = random_matrix(*shape).float()
    assert not use_gram_form(min(shape), max(shape), torch.bfloat16, 5)
    assert torch.equal(orthogonalize(g, torch.bfloat16, NS, 5, 1e-7),
                       _zeropower_via_newtonschulz(g, NS, 5, 1e-7))


def test_a_bf16_muon_step_on_a_wide_matrix_is_torchs_to_the_bit():
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


def test_a_float32_muon_run_takes_the_gram_form_and_resumes_bit_identical(
        inputs, tmp_path, monkeypatch):
    """As on a CPU without bf16 units: float32, the MLP's 64 x 176 matrices by the Gram
    form; a run resumed from its step-4 checkpoint ends on the same bytes."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    calls = []
    real = muon_module.gram_newton_schulz
    monkeypatch.setattr(muon_module, "gram_newton_schulz",
                        lambda x, *a, **k: calls.append(tuple(x.shape)) or real(x, *a, **k))
    params = tiny_params(max_steps=8, eval_every=0, ckpt_every=4, optimizer="muon",
                         muon_lr=0.02)
    logs: list[str] = []
    first = run(params, inputs, tmp_path / "c", logs)
    assert any("Muon orthogonalises in float32" in line for line in logs)
    assert calls and all(cols >= GRAM_MIN_ASPECT * rows for rows, cols in calls)
    state = resumes_from_step_4_bit_identical(first, params, inputs, tmp_path / "c", logs)
    assert state["optimizer"]["muon"]["param_groups"][0]["ns_dtype"] == "float32"
