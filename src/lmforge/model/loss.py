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

import importlib.util
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from lmforge.model import loss_kernel

IGNORE_INDEX = -100
# Llama.fused_loss names the head's loss path: True, this module's chunked op; False, the
# plain logits and cross_entropy; LIGER, Liger-Kernel's fused linear cross-entropy.
LIGER = "liger"
# ... and WHOLE, the chunked op over all of a micro-batch's tokens in one chunk: on CUDA,
# where the Triton kernel writes the gradient in place of 16-bit logits, one chunk holds
# the plain loss's logits but reads them once (the plain loss's log-softmax reads them
# twice and writes a same-sized gradient), and each head matmul runs once at full size.
WHOLE = "whole"

# Most logits in one chunk, per device, and fewest tokens. It is memory that chunks
# save; time depends on both ends. Each chunk reads the whole (V, d) head again and a
# thin matmul is slow, so a chunk holds at least 512 tokens; past that, a CPU's
# elementwise passes (max, exp, sum, scale) over a chunk that no cache holds cost more
# than they save. Forward + backward on a 2-core CPU, frozen / trained head
# (bench/bench_loss.py; bench/RESULTS.md): SmolLM2's 49k vocabulary, 1024 tokens,
# 2.62 / 3.00 s in the 21-token chunks of the L2-sized 2^20 budget this replaced,
# 0.84 / 1.39 s in 2 x 512 tokens, 1.23 / 1.48 s for the plain logits; the demo's 8k,
# 4096 tokens, 0.43 / 0.44 s in 128-token chunks, 0.36 / 0.41 s in 512-token ones. On a
# GPU large chunks keep the kernel count low. With the Triton kernel (loss_kernel.py)
# a chunk's logits stay 16-bit and are never copied, so it takes 4x the logits: 0.5 GB in
# bf16, about the eager path's fp32 chunk and its copy (what `lmforge plan` counts), in
# four chunks for GPT-2 small's 16 x 1024 tokens at vocab 50,304 (measured on an H200:
# bench/RESULTS.md "GPU MFU", run2). Fewer, larger chunks would save the head
# gradient's fp32 sums (a V x d product each) at the plain loss's memory.
CHUNK_ELEMENTS = {"cpu": 1 << 22, "cuda": 1 << 26}
KERNEL_CHUNK_ELEMENTS = 1 << 28
MIN_CHUNK_TOKENS = 512


def default_chunk_tokens(vocab: int, device: str, kernel: bool = False) -> int:
    """Most tokens in one chunk of the fused loss over a ``vocab``-sized head on
    ``device`` ("cpu", "cuda", ...; any other takes CUDA's budget); ``kernel``: with
    the Triton kernel of loss_kernel.py."""
    budget = (KERNEL_CHUNK_ELEMENTS if kernel
              else CHUNK_ELEMENTS.get(device, CHUNK_ELEMENTS["cuda"]))
    return max(MIN_CHUNK_TOKENS, budget // vocab)


def balanced_chunk(tokens: int, most: int) -> int:
    """The chunk that splits ``tokens`` into as few chunks of at most ``most`` as it can,
    all of one size (but the last): 1024 tokens at most 682 go as 512 + 512, not
    682 + 342, since a thin last matmul costs nearly as much as a full one."""
    count = -(-tokens // max(1, most))
    return -(-tokens // count) if tokens else 1


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


# The chunked loss as a registered operator, so that torch.compile keeps it as one opaque
# node (no graph break, its loop over chunks not unrolled). Defined with torch.library's
# define/impl rather than the @custom_op decorator: that wraps the kernel in a
# dynamo-disable whose first call imports torch._dynamo and torch._inductor (1.4 s) in
# every process that runs the loss, most of which never compile. Registration: ~1 ms.
OP = "lmforge::linear_cross_entropy"
_LIB = torch.library.Library("lmforge", "FRAGMENT")
_LIB.define("linear_cross_entropy(Tensor x, Tensor weight, Tensor targets, "
            "float label_smoothing, float z_loss, int chunk, ScalarType dtype, bool want_x, "
            "bool want_w) -> (Tensor, Tensor, Tensor, Tensor)")


def _linear_cross_entropy_op(x: Tensor, weight: Tensor, targets: Tensor, label_smoothing: float,
                             z_loss: float, chunk: int, dtype: torch.dtype, want_x: bool,
                             want_w: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(loss, grad_x, grad_w, 1/count) of ``x @ weight.T`` against ``targets``, the
    matmuls in ``dtype``; a gradient not wanted is an empty tensor.

    The caller decides ``dtype`` and ``want_x`` / ``want_w`` (autocast, grad mode): the
    op sees neither. Autocast is off inside so the dtypes are exactly the ones cast
    here, compiled or not; the arithmetic is the same either way.
    """
    with torch.autocast(x.device.type, enabled=False):
        return _loss_and_grads(x, weight, targets, label_smoothing, z_loss, chunk, dtype,
                               want_x, want_w)


def _fake(x: Tensor, weight: Tensor, targets: Tensor, label_smoothing: float, z_loss: float,
          chunk: int, dtype: torch.dtype, want_x: bool, want_w: bool,
          ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    # The shapes and dtypes _loss_and_grads returns, for tracing.
    scalar = x.new_empty((), dtype=torch.float32)
    grad_x = x.new_empty(x.shape if want_x else (0,), dtype=dtype)
    grad_w = weight.new_empty(weight.shape if want_w else (0,), dtype=torch.float32)
    return scalar, grad_x, grad_w, x.new_empty((), dtype=torch.float32)


def _loss_and_grads(x: Tensor, weight: Tensor, targets: Tensor, smooth: float, z_loss: float,
                    chunk: int, dtype: torch.dtype, want_x: bool, want_w: bool,
                    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The op's body: the loss summed chunk by chunk, and the per-token gradients."""
    xd, wd = x.detach().to(dtype), weight.detach().to(dtype)
    grad_x = torch.empty(xd.shape, dtype=dtype, device=x.device) if want_x else None
    # Contiguous, as the fake says (Inductor holds the op to its fake's layout).
    grad_w = (torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w
              else None)
    vocab = weight.size(0)
    valid = targets != IGNORE_INDEX
    # A target outside the vocabulary makes the loss NaN (the loop's non-finite
    # guard reports it) instead of an index error deep in a kernel, with no host sync.
    invalid = valid & ((targets < 0) | (targets >= vocab))
    valid = valid & ~invalid
    count = valid.sum()
    # Gradients are kept per token (not yet divided by the count) so they stay well
    # inside fp16/bf16 range; backward applies 1/count with the incoming gradient.
    keep = valid.float()
    inv_count = 1.0 / count.clamp(min=1).float()
    safe_targets = torch.where(valid, targets, 0).unsqueeze(1)
    total = torch.zeros((), dtype=torch.float32, device=x.device)
    # On CUDA one Triton kernel does a chunk's passes (loss_kernel.py); else aten ops.
    one_chunk = _chunk_kernel if loss_kernel.available(x.device, dtype) else _chunk
    for start in range(0, x.size(0), chunk):
        rows = slice(start, start + chunk)
        grad = one_chunk(xd[rows], wd, safe_targets[rows], keep[rows], smooth, z_loss, total,
                         want_x or want_w)
        if grad is not None:
            _accumulate(grad, xd[rows], wd, dtype, grad_x[rows] if want_x else None, grad_w)
    # With no valid target the loss is NaN, as in F.cross_entropy.
    nan = torch.full_like(total, float("nan"))
    loss = torch.where((count > 0) & ~invalid.any(), total * inv_count, nan)
    none = xd.new_empty(0)
    return (loss, grad_x if want_x else none,
            grad_w if want_w else none.new_empty(0, dtype=torch.float32), inv_count)


def _chunk(xc: Tensor, wd: Tensor, tc: Tensor, kept: Tensor, smooth: float, z_loss: float,
           total: Tensor, grads: bool) -> Tensor | None:
    """Add one chunk's loss to ``total``; its fp32 gradient of the logits (per token, not
    yet scaled by 1/count) when ``grads``, made in place of its logits."""
    vocab = wd.size(0)
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
    if not grads:
        return None
    # d(row loss)/d(logits) = softmax (1 + 2 z lse) - (1 - eps) onehot - eps / V.
    coef = kept / norm.squeeze(1)
    if z_loss > 0:
        coef = coef * (1 + 2 * z_loss * lse)
    grad = probs.mul_(coef.unsqueeze(1))
    if smooth > 0:
        grad.sub_((smooth / vocab) * kept.unsqueeze(1))
    grad.scatter_add_(1, tc, (-(1 - smooth) * kept).unsqueeze(1))
    return grad


def _chunk_kernel(xc: Tensor, wd: Tensor, tc: Tensor, kept: Tensor, smooth: float,
                  z_loss: float, total: Tensor, grads: bool) -> Tensor | None:
    """:func:`_chunk` by one Triton kernel: the logits stay in the matmul's dtype and
    their gradient (per token, in that dtype: the rounding ``_accumulate`` applies to
    the fp32 one) is written in place of them."""
    logits = torch.mm(xc, wd.t())
    total += loss_kernel.row_losses_and_grads(logits, tc.squeeze(1), kept, smooth, z_loss,
                                              grads).sum()
    return logits if grads else None


def _accumulate(grad: Tensor, xc: Tensor, wd: Tensor, dtype: torch.dtype,
                grad_x_rows: Tensor | None, grad_w: Tensor | None) -> None:
    """One chunk's share of the gradients: its rows of grad_x, its sum into grad_w."""
    low = grad if dtype == torch.float32 else grad.to(dtype)
    if grad_x_rows is not None:
        torch.mm(low, wd, out=grad_x_rows)
    if grad_w is None:
        return
    if dtype == torch.float32:
        grad_w.addmm_(grad.t(), xc)
    elif dtype == torch.float16:
        # A frequent target over a whole chunk can sum past fp16's 65504
        # before any loss scale applies: this product is taken in fp32.
        grad_w.addmm_(grad.t(), xc.float())
    else:  # bf16 has fp32's range; widened inside the add (exact), no fp32 copy made
        grad_w += torch.mm(low.t(), xc)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, ...]) -> None:
    x, weight = inputs[0], inputs[1]
    _, grad_x, grad_w, inv_count = output
    ctx.mark_non_differentiable(grad_x, grad_w, inv_count)
    ctx.save_for_backward(grad_x, grad_w, inv_count)
    ctx.dtypes = (x.dtype, weight.dtype)
    ctx.wanted = inputs[7], inputs[8]


def _backward(ctx: Any, grad_loss: Tensor, *_: Tensor) -> tuple[Tensor | None, ...]:
    # The gradients were made in the forward: only their scale is left. They are
    # constants here, so a second derivative through them would be wrong; nothing in
    # lmforge takes one.
    grad_x, grad_w, inv_count = ctx.saved_tensors
    x_dtype, w_dtype = ctx.dtypes
    want_x, want_w = ctx.wanted
    factor = grad_loss.float() * inv_count
    # Scaled in fp32, then cast: one rounding, no half-precision overflow.
    gx = (grad_x.float() * factor).to(x_dtype) if want_x else None
    gw = (grad_w * factor).to(w_dtype) if want_w else None
    return gx, gw, None, None, None, None, None, None, None


# The kernel for every device (it is made of aten ops), its shapes for tracing, and the
# backward that scales the gradients made in the forward.
torch.library.impl(OP, "CompositeExplicitAutograd", _linear_cross_entropy_op, lib=_LIB)
torch.library.register_fake(OP, _fake, lib=_LIB)
torch.library.register_autograd(OP, _backward, setup_context=_setup_context, lib=_LIB)


@register_flop_formula(torch.ops.lmforge.linear_cross_entropy)
def _flops(x_shape: tuple[int, int], w_shape: tuple[int, int], *args: Any,
           **kwargs: Any) -> int:
    # FlopCounterMode sees the op, not the matmuls inside it: the logits' matmul, and
    # one more per gradient made (backward then only scales).
    want_x, want_w = args[-2:]
    return 2 * x_shape[0] * x_shape[1] * w_shape[0] * (1 + int(want_x) + int(want_w))


def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         label_smoothing: float = 0.0, z_loss: float = 0.0,
                         chunk_tokens: int | None = None) -> torch.Tensor:
    """``cross_entropy(x @ weight.T, targets, ...)`` without materialising the logits.

    ``x`` (..., C) hidden states, ``weight`` (V, C), ``targets`` (...) with -100 ignored.
    Equal to :func:`cross_entropy` of the full logits up to float rounding, gradients
    included. ``chunk_tokens`` defaults to :func:`default_chunk_tokens`, balanced.
    Under ``torch.compile`` it is one node of the graph (the custom op
    ``lmforge::linear_cross_entropy``), run as it runs eagerly.
    """
    flat_x = x.reshape(-1, x.size(-1))
    flat_t = targets.reshape(-1)
    if chunk_tokens is None:
        kernel = loss_kernel.available(x.device, _compute_dtype(x))
        most = default_chunk_tokens(weight.size(0), x.device.type, kernel)
        chunk_tokens = balanced_chunk(flat_x.size(0), most)
    # Under no_grad / inference_mode the op still sees requires_grad inputs: decide
    # here, so evaluation pays for the loss only.
    grad_on = torch.is_grad_enabled()
    loss, *_ = torch.ops.lmforge.linear_cross_entropy(flat_x, weight, flat_t, float(label_smoothing),
                                        float(z_loss), int(chunk_tokens), _compute_dtype(x),
                                        grad_on and x.requires_grad,
                                        grad_on and weight.requires_grad)
    return loss


def liger_available() -> bool:
    """Whether Liger-Kernel is importable here (an optional CUDA dependency that lmforge
    does not install)."""
    return importlib.util.find_spec("liger_kernel") is not None


def liger_linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                               label_smoothing: float = 0.0, z_loss: float = 0.0,
                               ) -> torch.Tensor:
    """:func:`linear_cross_entropy` by Liger-Kernel's Triton kernel (CUDA only).

    Its label smoothing and ``lse_square_scale`` (z-loss) are this module's; the guards
    are added here: a target outside the vocabulary is never read by the kernel and
    makes the loss NaN, as does a batch with no valid target (the non-finite guard).
    """
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    flat_x, flat_t = x.reshape(-1, x.size(-1)), targets.reshape(-1)
    valid = flat_t != IGNORE_INDEX
    invalid = valid & ((flat_t < 0) | (flat_t >= weight.size(0)))
    safe = torch.where(invalid, IGNORE_INDEX, flat_t)
    loss_fn = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX,
                                               label_smoothing=float(label_smoothing),
                                               lse_square_scale=float(z_loss),
                                               reduction="mean")
    loss = loss_fn(weight, flat_x, safe)
    loss = (loss[0] if isinstance(loss, tuple) else loss).float()
    return torch.where(valid.any() & ~invalid.any(), loss, torch.full_like(loss, float("nan")))
