"""RMSNorm and RoPE with hand-written backward passes, for eager mode.

Autograd records every elementwise op of a composite RMSNorm or rotate-half RoPE and
replays a backward op for each: on a CPU that is a dozen full passes over the
activations per norm and a ``cat`` + ``neg`` per rotation. These versions make the fewest
passes the maths allows (RoPE's backward is RoPE by the negated angle) and save only
what the backward needs. Under ``torch.compile`` the model uses the plain formulas
instead: Inductor fuses those into single loops by itself.
"""

from __future__ import annotations

import torch


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # fp32 statistics whatever the input dtype, as torch's RMSNorm computes them.
        xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        # One read pass: the norm, not square() then mean().
        norm = torch.linalg.vector_norm(xf, dim=-1, keepdim=True)
        rstd = torch.rsqrt(norm.square() / x.size(-1) + eps)
        y = (xf * rstd).mul_(weight).to(x.dtype)  # the input's dtype, as nn.RMSNorm
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN205 (autograd's signature)
        x, weight, rstd = ctx.saved_tensors
        xhat = (x.float() if x.dtype in (torch.float16, torch.bfloat16) else x) * rstd
        g = grad.float() if grad.dtype in (torch.float16, torch.bfloat16) else grad
        gw = g * weight
        # d/dx of x * rstd: rstd * (gw - xhat * mean(gw * xhat)).
        dot = torch.linalg.vecdot(gw, xhat).unsqueeze(-1) / x.size(-1)
        grad_x = gw.sub_(xhat * dot).mul_(rstd).to(x.dtype)
        grad_w = (g * xhat).reshape(-1, x.size(-1)).sum(0).to(weight.dtype)
        return grad_x, grad_w, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dimension."""
    return _RMSNorm.apply(x, weight, eps)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # Rotate-half pairs (x1, x2) = the two halves: (x1 c - x2 s, x2 c + x1 s), written
    # straight into the two halves of the output (no cat, no negated copy).
    if x.dtype in (torch.float16, torch.bfloat16):  # one rounding, as the plain formula
        return _rotate(x.float(), cos, sin).to(x.dtype)
    half = x.size(-1) // 2
    x1, x2 = x[..., :half], x[..., half:]
    out = torch.empty(torch.broadcast_shapes(x.shape, cos.shape[:-1] + (x.size(-1),)),
                      dtype=x.dtype, device=x.device)
    o1, o2 = out[..., :half], out[..., half:]
    torch.mul(x1, cos, out=o1)
    o1.addcmul_(x2, sin, value=-1)
    torch.mul(x2, cos, out=o2)
    o2.addcmul_(x1, sin)
    return out


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN205 (autograd's signature)
        cos, sin = ctx.saved_tensors
        return _rotate(grad, cos, -sin), None, None  # a rotation's inverse: the angle negated


def rope(x: torch.Tensor, cos_half: torch.Tensor, sin_half: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of ``x`` (..., D) by tables of the first D/2 angles (broadcast)."""
    return _Rope.apply(x, cos_half, sin_half)
