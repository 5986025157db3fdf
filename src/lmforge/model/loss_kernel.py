"""One Triton kernel for a chunk of the fused loss on CUDA: loss and logit gradient in a
single pass over the logits, written in place of them.

The chunked loss (loss.py) computes, for each chunk of logits, the loss of each row and
the gradient ``softmax (1 + 2 z lse) - (1 - eps) onehot - eps / V`` (per token, not yet
scaled by 1/count). Eagerly that is about eight fp32 passes over the chunk (upcast,
gather, max, subtract, exp, sum, scale, scatter) plus a cast back to 16 bits; on an H200
at GPT-2 small's shape they made the chunked loss 21.5 ms against the plain loss's 7.4
(issue 44). Here one program per row reads the row's 16-bit logits twice (the second
read mostly from L2: ~100 KB a row), computes in fp32, and writes the gradient once in
the logits' dtype: the bytes of one read and one write of the chunk, which is what the
two gradient matmuls read next anyway.

Off CUDA, or without Triton, loss.py keeps its aten path; :func:`available` says which.
"""

from __future__ import annotations

import functools
import importlib.util

import torch
from torch import Tensor

# Columns a program handles per iteration; 8 warps hold 4,096 fp32 values in registers
# with room to spare (16 per thread).
BLOCK = 4096
NUM_WARPS = 8


@functools.cache
def _kernel():  # noqa: ANN202 - a triton.JITFunction, imported only where used
    """The kernel, built on first use (importing Triton costs ~0.5 s; CPU runs never do)."""
    import triton
    import triton.language as tl

    @triton.jit
    def row_loss_and_grad(logits, stride, targets, keep, out_loss, vocab, smooth, z_loss,
                          GRADS: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = logits + row * stride
        target = tl.load(targets + row)
        kept = tl.load(keep + row)
        cols = tl.arange(0, BLOCK)
        # Pass 1: the row's running max and sum of exp (online softmax), and its sum.
        peak = tl.full((), float("-inf"), tl.float32)
        norm = tl.zeros((), tl.float32)
        total = tl.zeros((), tl.float32)
        for start in tl.range(0, vocab, BLOCK):
            mask = start + cols < vocab
            x = tl.load(base + start + cols, mask=mask, other=float("-inf")).to(tl.float32)
            new_peak = tl.maximum(peak, tl.max(x, 0))
            norm = norm * tl.exp(peak - new_peak) + tl.sum(tl.exp(x - new_peak), 0)
            peak = new_peak
            total += tl.sum(tl.where(mask, x, 0.0), 0)
        lse = peak + tl.log(norm)
        target_logit = tl.load(base + target).to(tl.float32)
        loss = (1 - smooth) * (lse - target_logit) + smooth * (lse - total / vocab)
        loss += z_loss * lse * lse
        tl.store(out_loss + row, loss * kept)
        if GRADS:
            # Pass 2: the gradient of the row's loss, in place of its logits.
            coef = kept * (1 + 2 * z_loss * lse)
            for start in tl.range(0, vocab, BLOCK):
                idx = start + cols
                mask = idx < vocab
                x = tl.load(base + idx, mask=mask, other=0.0).to(tl.float32)
                grad = tl.exp(x - lse) * coef - kept * smooth / vocab
                grad -= tl.where(idx == target, kept * (1 - smooth), 0.0)
                tl.store(base + idx, grad.to(base.dtype.element_ty), mask=mask)

    return row_loss_and_grad


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the kernel runs for logits of ``dtype`` on ``device``: CUDA with Triton,
    bf16 or fp32 logits (fp16's gradient stays in fp32 in loss.py, for its range).
    ``LMFORGE_LOSS_KERNEL_INTERPRET`` (tests) also takes a CPU, through Triton's
    interpreter, which must then be on (``TRITON_INTERPRET=1``) before Triton loads."""
    import os

    if dtype not in (torch.bfloat16, torch.float32):
        return False
    if device.type != "cuda" and not os.environ.get("LMFORGE_LOSS_KERNEL_INTERPRET"):
        return False
    return importlib.util.find_spec("triton") is not None


def row_losses_and_grads(logits: Tensor, targets: Tensor, keep: Tensor, smooth: float,
                         z_loss: float, grads: bool) -> Tensor:
    """Each row's loss times ``keep`` (fp32, shape (rows,)); with ``grads`` the logits
    (rows, V), contiguous in their last dim, are overwritten by their gradient.

    ``targets`` (rows,) int64, every one within [0, V) (loss.py makes invalid ones 0 and
    their ``keep`` 0); ``keep`` (rows,) fp32, 1 for a counted row, 0 for an ignored one.
    """
    rows, vocab = logits.shape
    if logits.stride(1) != 1:
        raise ValueError("the logits' last dimension must be contiguous")
    out = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows:
        _kernel()[(rows,)](logits, logits.stride(0), targets.contiguous(), keep.contiguous(),
                           out, vocab, float(smooth), float(z_loss), GRADS=grads,
                           BLOCK=BLOCK, num_warps=NUM_WARPS)
    return out
