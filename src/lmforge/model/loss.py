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

# Most logits in one chunk, per device, and fewest tokens. It is memory that chunks
# save; time depends on both ends. Each chunk reads the whole (V, d) head again and a
# thin matmul is slow, so a chunk holds at least 512 tokens; past that, a CPU's
# elementwise passes (max, exp, sum, scale) over a chunk that no cache holds cost more
# than they save. Forward + backward on a 2-core CPU, frozen / trained head
# (bench/bench_loss.py; bench/RESULTS.md): SmolLM2's 49k vocabulary, 1024 tokens,
# 2.62 / 3.00 s in the 21-token chunks of the L2-sized 2^20 budget this replaced,
# 0.84 / 1.39 s in 2 x 512 tokens, 1.23 / 1.48 s for the plain logits; the demo's 8k,
# 4096 tokens, 0.43 / 0.44 s in 128-token chunks, 0.36 / 0.41 s in 512-token ones. On a
# GPU large chunks keep the kernel count low.
CHUNK_ELEMENTS = {"cpu": 1 << 22, "cuda": 1 << 26}
MIN_CHUNK_TOKENS = 512


def default_chunk_tokens(vocab: int, device: str) -> int:
    """Most tokens in one chunk of the fused loss over a ``vocab``-sized head on
    ``device`` ("cpu", "cuda", ...; any other takes CUDA's budget)."""
    budget = CHUNK_ELEMENTS.get(device, CHUNK_ELEMENTS["cuda"])
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


class _LinearCrossEntropy(torch.autograd.Function):
    """Loss of ``x @ weight.T`` against ``targets``; gradients made in the forward pass."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                label_smoothing: float, z_loss: float, chunk: int,
                grads: tuple[bool, bool]) -> torch.Tensor:
        dtype = _compute_dtype(x)
        xd, wd = x.detach().to(dtype), weight.detach().to(dtype)
        want_x, want_w = grads
        grad_x = torch.empty_like(xd) if want_x else None
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if want_w else None
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
        smooth = label_smoothing
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
            if not (want_x or want_w):
                continue
            # d(row loss)/d(logits) = softmax (1 + 2 z lse) - (1 - eps) onehot - eps / V.
            coef = kept / norm.squeeze(1)
            if z_loss > 0:
                coef = coef * (1 + 2 * z_loss * lse)
            grad = probs.mul_(coef.unsqueeze(1))
            if smooth > 0:
                grad.sub_((smooth / vocab) * kept.unsqueeze(1))
            grad.scatter_add_(1, tc, (-(1 - smooth) * kept).unsqueeze(1))
            low = grad if dtype == torch.float32 else grad.to(dtype)
            if want_x:
                torch.mm(low, wd, out=grad_x[rows])
            if want_w:
                if dtype == torch.float32:
                    grad_w.addmm_(grad.t(), xc)
                elif dtype == torch.float16:
                    # A frequent target over a whole chunk can sum past fp16's 65504
                    # before any loss scale applies: this product is taken in fp32.
                    grad_w.addmm_(grad.t(), xc.float())
                else:  # bf16 has fp32's range
                    grad_w += torch.mm(low.t(), xc).float()
        # With no valid target the loss is NaN, as in F.cross_entropy.
        nan = torch.full_like(total, float("nan"))
        loss = torch.where((count > 0) & ~invalid.any(), total * inv_count, nan)
        ctx.save_for_backward(grad_x, grad_w, inv_count)
        ctx.dtypes = (x.dtype, weight.dtype)
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable  # the gradients are constants here
    def backward(ctx, grad_loss: torch.Tensor):  # noqa: ANN205 (autograd's signature)
        grad_x, grad_w, inv_count = ctx.saved_tensors
        x_dtype, w_dtype = ctx.dtypes
        factor = grad_loss.float() * inv_count
        # Scaled in fp32, then cast: one rounding, no half-precision overflow.
        gx = (grad_x.float() * factor).to(x_dtype) if grad_x is not None else None
        gw = (grad_w * factor).to(w_dtype) if grad_w is not None else None
        return gx, gw, None, None, None, None, None


def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         label_smoothing: float = 0.0, z_loss: float = 0.0,
                         chunk_tokens: int | None = None) -> torch.Tensor:
    """``cross_entropy(x @ weight.T, targets, ...)`` without materialising the logits.

    ``x`` (..., C) hidden states, ``weight`` (V, C), ``targets`` (...) with -100 ignored.
    Equal to :func:`cross_entropy` of the full logits up to float rounding, gradients
    included. ``chunk_tokens`` defaults to :func:`default_chunk_tokens`, balanced.
    Under ``torch.compile`` it runs eagerly once :func:`keep_out_of_compiled_graphs` ran.
    """
    return _chunked(x, weight, targets, label_smoothing, z_loss, chunk_tokens)


def keep_out_of_compiled_graphs() -> None:
    """Run :func:`linear_cross_entropy` eagerly inside models that ``torch.compile``
    traces: its Python loop over chunks would be unrolled into the graph. Every compile
    site calls this first (``compile_step_model``, the benches).

    Not a ``@torch.compiler.disable`` on the function: that imports ``torch._dynamo``
    (1.4 s) in every process that imports the model, and most (evaluation, eager
    training, the CLI) never compile. Traced code reads ``_chunked`` when it is traced.
    """
    global _chunked
    if _chunked is _linear_cross_entropy:
        _chunked = torch.compiler.disable(_linear_cross_entropy)


def _linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                          label_smoothing: float, z_loss: float,
                          chunk_tokens: int | None) -> torch.Tensor:
    flat_x = x.reshape(-1, x.size(-1))
    flat_t = targets.reshape(-1)
    if chunk_tokens is None:
        most = default_chunk_tokens(weight.size(0), x.device.type)
        chunk_tokens = balanced_chunk(flat_x.size(0), most)
    # Under no_grad / inference_mode the Function still sees requires_grad inputs:
    # decide here, so evaluation pays for the loss only.
    grad_on = torch.is_grad_enabled()
    grads = (grad_on and x.requires_grad, grad_on and weight.requires_grad)
    return _LinearCrossEntropy.apply(flat_x, weight, flat_t, float(label_smoothing),
                                     float(z_loss), int(chunk_tokens), grads)


_chunked = _linear_cross_entropy  # keep_out_of_compiled_graphs swaps in a disabled copy
