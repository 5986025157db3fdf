"""The eager RMSNorm and RoPE against autograd's own derivatives of the plain formulas."""

import pytest
import torch

from lmforge.model import ops
from lmforge.model.llama import rope_tables


def plain_rms_norm(x, w, eps):
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * w


def plain_rope(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def test_rms_norm_gradients_are_exact():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 16, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(16, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: ops.rms_norm(a, b, 1e-5), (x, w))
    assert torch.allclose(ops.rms_norm(x, w, 1e-5), plain_rms_norm(x, w, 1e-5))


@pytest.mark.parametrize("doc_positions", [False, True])
def test_rope_matches_the_rotate_half_formula_and_its_gradient(doc_positions):
    g = torch.Generator().manual_seed(1)
    B, T, H, D = 2, 6, 3, 8
    cos, sin = (t.double() for t in rope_tables(T, D, 10000.0))
    if doc_positions:  # per-token tables, (B, T, 1, D), as with document masks
        ids = torch.tensor([[0, 1, 2, 0, 1, 2], [0, 1, 2, 3, 4, 5]])
        cos, sin = cos[ids].unsqueeze(2), sin[ids].unsqueeze(2)
    else:  # (T, 1, D)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    x = torch.randn(B, T, H, D, generator=g, dtype=torch.float64, requires_grad=True)
    half = D // 2
    got = ops.rope(x, cos[..., :half], sin[..., :half])
    assert torch.allclose(got, plain_rope(x, cos, sin))
    assert torch.autograd.gradcheck(lambda a: ops.rope(a, cos[..., :half], sin[..., :half]),
                                    (x,))


def test_model_norm_module_matches_torch_rmsnorm_forward_and_backward():
    from lmforge.model.llama import RMSNorm

    torch.manual_seed(2)
    ours, ref = RMSNorm(32, eps=1e-5), torch.nn.RMSNorm(32, eps=1e-5)
    with torch.no_grad():
        ours.weight.normal_()
        ref.weight.copy_(ours.weight)
    x = torch.randn(4, 7, 32, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    a, b = ours(x), ref(x2)
    assert torch.allclose(a, b, atol=1e-6)
    a.square().sum().backward()
    b.square().sum().backward()
    assert torch.allclose(x.grad, x2.grad, atol=1e-5)
    assert torch.allclose(ours.weight.grad, ref.weight.grad, atol=1e-4)
