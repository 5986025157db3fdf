"""Cross-entropy for training, plain and fused with the output projection.

The output layer of a small model is where a training step spends its memory traffic:
``B*T x vocab`` logits (134 MB for 16 x 256 x 8k in fp32), written by the matmul, read
by log-softmax, written again, then a same-sized zero-filled gradient, its log-softmax
backward, and the two matmuls that read it. :func:`linear_cross_entropy` never builds
those tensors: it walks the tokens in chunks whose logits fit in cache, and for each
chunk computes the loss *and* the gradients of the hidden states and of the weight
straight away (softmax minus the target, the way Liger-Kernel's fused linear
cross-entropy does), so the backward pass only scales what is already there. Same
FLOPs as the plain path, a fraction of the memory and time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100

# Elements of one chunk of logits: ~4 MB of fp32 stays in a CPU core's L2; on a GPU
# larger chunks keep the kernel count low (it is memory, not bandwidth, that they save).
CHUNK_ELEMENTS = {"cpu": 1 << 20, "cuda": 1 << 26}


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, label_smoothing: float = 0.0,
                  z_loss: float = 0.0) -> torch.Tensor:
    """Mean fp32 cross-entropy over targets != -100, plus the optional z-loss.

    The reference the fused path is tested against, and the path for callers that have
    the logits anyway.
    """
    flat = logits.float().view(-1, logits.size(-1))
    tgt = targets.reshape(-1)
    loss = F.cross_entropy(flat, tgt, ignore_index=IGNORE_INDEX,
                           label_smoothing=label_smoothing)
    if z_loss > 0:
        # PaLM's z-loss keeps log Z near 0 so the softmax stays well conditioned.
        keep = (tgt != IGNORE_INDEX).float()
        lse = torch.logsumexp(flat, dim=-1)
        loss = loss + z_loss * (lse.square() * keep).sum() / keep.sum().clamp(min=1)
    return loss


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The matmul dtype autocast would use for ``x`` here (x's own dtype without it)."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype


class _LinearCrossEntropy(torch.autograd.Function):
    """Loss of ``x @ weight.T`` against ``targets``; gradients made in the forward pass."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                label_smoothing: float, z_loss: float, chunk: int) -> torch.Tensor:
        dtype = _compute_dtype(x)
        xd, wd = x.detach().to(dtype), weight.detach().to(dtype)
        need_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        grad_x = torch.empty_like(xd) if need_grad else None
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if need_grad else None
        valid = targets != IGNORE_INDEX
        count = valid.sum()
        # Gradients are kept per token (not yet divided by the count) so they stay well
        # inside fp16/bf16 range; backward applies 1/count with the incoming gradient.
        keep = valid.float()
        inv_count = 1.0 / count.clamp(min=1).float()
        safe_targets = targets.clamp(min=0).unsqueeze(1)
        smooth, vocab = label_smoothing, weight.size(0)
        total = torch.zeros((), dtype=torch.float32, device=x.device)
        for start in range(0, x.size(0), chunk):
            rows = slice(start, start + chunk)
            xc, tc, kept = xd[rows], safe_targets[rows], keep[rows]
            logits = torch.mm(xc, wd.t()).float()
            target_logit = logits.gather(1, tc).squeeze(1)
            mean_logit = logits.mean(1) if smooth > 0 else None
            peak = logits.amax(1, keepdim=True)
            probs = logits.sub_(peak).exp_()  # in place: the logits are not needed again
            norm = probs.sum(1, keepdim=True)
            lse = (peak + norm.log()).squeeze(1)
            row_loss = (1 - smooth) * (lse - target_logit)
            if smooth > 0:
                row_loss = row_loss + smooth * (lse - mean_logit)
            if z_loss > 0:
                row_loss = row_loss + z_loss * lse.square()
            total += (row_loss * kept).sum()
            if not need_grad:
                continue
            # d(row loss)/d(logits) = softmax (1 + 2 z lse) - (1 - eps) onehot - eps / V.
            coef = kept / norm.squeeze(1)
            if z_loss > 0:
                coef = coef * (1 + 2 * z_loss * lse)
            grad = probs.mul_(coef.unsqueeze(1))
            if smooth > 0:
                grad.sub_((smooth / vocab) * kept.unsqueeze(1))
            grad.scatter_add_(1, tc, (-(1 - smooth) * kept).unsqueeze(1))
            grad = grad.to(dtype)
            torch.mm(grad, wd, out=grad_x[rows])
            if dtype == torch.float32:
                grad_w.addmm_(grad.t(), xc)
            else:
                grad_w += torch.mm(grad.t(), xc).float()
        # With no valid target the loss is NaN, as in F.cross_entropy.
        loss = torch.where(count > 0, total * inv_count, torch.full_like(total, float("nan")))
        ctx.save_for_backward(grad_x, grad_w, inv_count)
        ctx.dtypes = (x.dtype, weight.dtype)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):  # noqa: ANN205 (autograd's signature)
        grad_x, grad_w, inv_count = ctx.saved_tensors
        x_dtype, w_dtype = ctx.dtypes
        factor = grad_loss * inv_count
        gx = (grad_x * factor).to(x_dtype) if ctx.needs_input_grad[0] else None
        gw = (grad_w * factor).to(w_dtype) if ctx.needs_input_grad[1] else None
        return gx, gw, None, None, None, None


@torch.compiler.disable  # a Python loop over chunks: keep it out of compiled graphs
def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         label_smoothing: float = 0.0, z_loss: float = 0.0,
                         chunk_tokens: int | None = None) -> torch.Tensor:
    """``cross_entropy(x @ weight.T, targets, ...)`` without materialising the logits.

    ``x`` (..., C) hidden states, ``weight`` (V, C), ``targets`` (...) with -100 ignored.
    Equal to :func:`cross_entropy` of the full logits up to float rounding, gradients
    included. ``chunk_tokens`` defaults to what keeps a chunk's logits cache-sized.
    """
    flat_x = x.reshape(-1, x.size(-1))
    flat_t = targets.reshape(-1)
    if chunk_tokens is None:
        budget = CHUNK_ELEMENTS.get(x.device.type, CHUNK_ELEMENTS["cuda"])
        chunk_tokens = max(1, budget // weight.size(0))
    return _LinearCrossEntropy.apply(flat_x, weight, flat_t, float(label_smoothing),
                                     float(z_loss), int(chunk_tokens))
