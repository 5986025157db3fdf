"""What a training step holds per rank, row by row, under DDP and FSDP2, and what fits.

Model states follow the ZeRO paper's accounting (Rajbhandari et al. 2020, "ZeRO: Memory
Optimizations Toward Training Trillion Parameter Models", arXiv:1910.02054, sec. 3.1):
mixed-precision Adam holds 2P + 2P + 12P = 16 bytes per parameter, unsharded; ZeRO-3,
which FSDP implements, divides all of it by the data-parallel degree N: 16P/N. Our split
differs, the total does not: fp32 weights (4) + fp32 gradients (4) + AdamW's two fp32
moments (8) = 16 bytes per parameter, and the 16-bit copies are working memory (below).

Activations follow Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models" (arXiv:2205.05198, sec. 4.1): a GPT layer keeps sbh(34 + 5as/h)
bytes in 16-bit (s sequence, b micro-batch, h hidden, a heads). Our block differs, so the
count is redone tensor by tensor for :class:`lmforge.model.llama.Block` as autograd saves
it in eager mode (checked against ``saved_tensors_hooks`` in tests/test_plan.py):
RMSNorm instead of LayerNorm, a SwiGLU MLP (three matrices, hidden F ~ 8/3 h), one fused
q/k/v GEMM, grouped-query heads repeated for attention, no biases, no dropout masks at
dropout 0, and SDPA's flash / memory-efficient kernels, which keep the output and a
log-sum-exp per head instead of the s x s scores: **this plan assumes such a kernel**, so
the 5as/h term is gone (it comes back as a*s^2 per layer with ``doc_mask``, whose boolean
mask SDPA turns into an additive one it keeps for backward).

What each strategy keeps (``a`` = bytes of the compute dtype, 2 for bf16/fp16, 4 for fp32):

* DDP (our loop): fp32 parameters with autocast. Gradients are fp32; DDP adds
  communication buckets as large as the gradients; autocast's 16-bit copies of every
  weight matrix are kept for backward; the residual stream stays fp32 (an fp32 embedding
  plus 16-bit sublayer outputs).
* FSDP2 (``fully_shard`` per block and on the root, ``MixedPrecisionPolicy(param_dtype=
  bf16, reduce_dtype=fp32)``): fp32 parameters, gradients and moments sharded 1/N (dim 0
  of each tensor, padded to a multiple of N); the root's parameters (embedding, final norm,
  head) stay unsharded in bf16 for the whole step (FSDP2 does not reshard the root after
  forward); two blocks are unsharded at a time (the one computing and the one prefetched);
  one block's bf16 gradients and their fp32 reduce-scatter buffer; the residual stream is
  bf16. With fp16, lmforge.train.fsdp sets no policy: fp32 gathers under autocast. On
  one rank the root is the only unit: every weight gathered all step, every gradient
  reduced at the end of backward.

Not modelled: torch.compile (Inductor recomputes pointwise ops and usually keeps less)
but for the plain loss, which it fuses (``Setup.compiled``, the plan's compiled total),
the activation gradients alive during a block's backward, LoRA (:mod:`lmforge.plan.finetune`
plans it), and gradient liveness: after the first step ``zero_grad(set_to_none=True)``
frees the gradients between steps, so counting them resident over-states the forward's
peak by at most the grads row. The reserve (CUDA context, cuBLAS/NCCL workspaces, the
caching allocator's fragmentation) covers the rest.
"""

from __future__ import annotations

from collections.abc import Callable

from lmforge.config import ModelConfig
from lmforge.model.llama import ffn_hidden_size
from lmforge.model.loss import balanced_chunk, default_chunk_tokens
from lmforge.plan.shapes import (
    GIB,
    Setup,
    autocast,
    block_params,
    cached_weight_params,
    compute_bytes,
    fused_weight_params,
    muon_matrix_params,
    num_params,
    param_dtype_bytes,
    residual_bytes,
    root_params,
    sharded_params,
)

# Reserve: a fixed part (CUDA context, cuBLAS and NCCL workspaces) plus a share of the
# device for the caching allocator's fragmentation.
RESERVE_GIB = 1.0
FRAGMENTATION = 0.10


# --------------------------------------------------------------------------- model states


def _per_rank(s: Setup, strategy: str) -> int:
    """Parameters held per rank: P (DDP) or the FSDP2 shard, ~P/N."""
    if strategy == "ddp":
        return num_params(s.model, s.vocab)
    return sharded_params(s.model, s.vocab, s.world)


def params_bytes(s: Setup, strategy: str) -> int:
    """4 * P (fp32 weights); FSDP: 4 * P/N."""
    return 4 * _per_rank(s, strategy)


def grads_bytes(s: Setup, strategy: str) -> int:
    """4 * P (fp32 gradients); FSDP: 4 * P/N (reduce-scattered in fp32)."""
    return 4 * _per_rank(s, strategy)


def optimizer_bytes(s: Setup, strategy: str) -> int:
    """8 * P (AdamW's exp_avg and exp_avg_sq in fp32); FSDP: 8 * P/N. With Muon, which
    keeps one fp32 momentum buffer, the blocks' matrices take 4 bytes instead of 8; Muon
    is refused under FSDP (config/train.py), so the FSDP column plans AdamW."""
    if s.optimizer == "muon" and strategy == "ddp":
        return 8 * _per_rank(s, strategy) - 4 * muon_matrix_params(s.model)
    return 8 * _per_rank(s, strategy)


def bucket_bytes(s: Setup, strategy: str) -> int:
    """DDP: 4 * P of gradient buckets (a second copy of the grads) when N > 1; FSDP: 0."""
    if strategy != "ddp" or s.world == 1:  # one process: the loop does not wrap DDP
        return 0
    return 4 * num_params(s.model, s.vocab)


def unsharded_params_bytes(s: Setup, strategy: str) -> int:
    """FSDP: p * (root + 2 * block), p the gathered dtype's bytes: the root all step, a
    block and the prefetched next. On one rank the root is the only FSDP unit
    (lmforge.train.fsdp): p * P, every weight gathered for the whole step."""
    if strategy != "fsdp":
        return 0
    p = param_dtype_bytes(strategy, s.precision)
    if s.world == 1:
        return p * num_params(s.model, s.vocab)
    return p * (root_params(s.model, s.vocab) + 2 * block_params(s.model))


def unsharded_grads_bytes(s: Setup, strategy: str) -> int:
    """FSDP: p * root + (p + 4) * block: the root's grads through backward, one block's
    grads and their fp32 reduce-scatter input; on one rank (one unit) (p + 4) * P, the
    whole model's at the end of backward."""
    if strategy != "fsdp":
        return 0
    p = param_dtype_bytes(strategy, s.precision)
    if s.world == 1:
        return (p + 4) * num_params(s.model, s.vocab)
    return p * root_params(s.model, s.vocab) + (p + 4) * block_params(s.model)


def weight_copy_bytes(s: Setup, strategy: str) -> int:
    """Weight copies autograd keeps for backward, per rank.

    ``fused_linear`` concatenates q|k|v and gate|up each forward (cat, then autocast's
    cast): a * L * fused, not freed by FSDP's reshard. Under autocast the cached 16-bit
    casts of wo and w2 add 2 * L * cached, and of the head without the fused loss
    2 * V * d. Activation checkpointing keeps one block's concatenations (the one being
    recomputed); autocast still caches every wo/w2 cast until the forward ends.
    """
    cfg, a = s.model, compute_bytes(s.precision)
    layers = 1 if s.activation_checkpointing else cfg.n_layer
    fused = a * layers * fused_weight_params(cfg)
    if not autocast(strategy, s.precision):
        return fused
    cached = 2 * cfg.n_layer * cached_weight_params(cfg)
    if s.activation_checkpointing:  # forward end (all casts) vs one block's recompute
        copies = max(cached, 2 * (fused_weight_params(cfg) + cached_weight_params(cfg)))
    else:
        copies = fused + cached
    return copies + (0 if s.fused_loss else 2 * s.vocab * cfg.n_embd)


def loss_chunk_tokens(s: Setup, micro_batch: int, device: str = "cuda") -> int:
    """Tokens in one chunk of the fused loss (loss.py's, balanced over b*s tokens)."""
    most = default_chunk_tokens(s.vocab, device)
    return balanced_chunk(micro_batch * s.model.seq_len, most)


def loss_buffer_bytes(s: Setup, strategy: str, micro_batch: int, device: str = "cuda") -> int:
    """The fused loss's buffers (0 without it: its logits are per sequence then).

    4 * V*d: the head's fp32 gradient, made in the forward and kept for backward;
    in bf16, 6 * V*d: each chunk's bf16 weight-gradient product and its fp32 copy; under
    autocast, 2 * V*d: the fp32 head cast to 16 bits; one chunk of fp32 logits
    (+ its 16-bit copy): (4 [+ 2]) * V * chunk, loss.py's chunk (about
    min(b*s, max(512, 2^26 // V)) tokens on a GPU, max(512, 2^22 // V) on a CPU).
    """
    if not s.fused_loss:
        return 0
    vd = s.vocab * s.model.n_embd
    total = 4 * vd + (6 * vd if s.precision == "bf16" else 0)
    if autocast(strategy, s.precision):
        total += 2 * vd
    chunk = loss_chunk_tokens(s, micro_batch, device)
    return total + chunk * s.vocab * (4 + (2 if s.precision != "fp32" else 0))


# --------------------------------------------------------------------------- activations


def layer_activation_bytes(cfg: ModelConfig, r: int, a: int) -> int:
    """Bytes one block keeps per token: 2rd + 8 + 4H + a(3d + kv + 4F) [+ 2d with dropout].

    2rd: the block input and the mid-block residual (the RMSNorms' inputs); 8: their fp32
    rstd; a*d each: the q/k/v GEMM input, the attention output (wo's input), the MLP GEMM
    input; kv: the roped q|k ((H+KV) hd) plus either the whole q|k|v output (v is a view
    of it, (H+2KV) hd) or, with KV < H, k and v repeated to H heads (2 H hd); 4H: flash
    attention's fp32 log-sum-exp; 4F: gate|up, silu(gate) and silu(gate)*up; dropout > 0
    adds two 1-byte masks. (Korthikanti et al.'s GPT layer: 34 h + 5 a s.)
    """
    d, heads = cfg.n_embd, cfg.n_head
    kv_heads, hd, f = cfg.n_kv_head or heads, d // heads, ffn_hidden_size(cfg)
    kv = (heads + kv_heads) * hd + ((heads + 2 * kv_heads) * hd if kv_heads == heads
                                    else 2 * heads * hd)
    extra = 2 * d if cfg.dropout > 0 else 0
    return 2 * r * d + 8 + 4 * heads + a * (3 * d + kv + 4 * f) + extra


def loss_activation_bytes(s: Setup, strategy: str) -> int:
    """Bytes the loss keeps per token.

    Fused: r*d (the final norm's output) + a*d (the hidden states' gradient, made in the
    forward) [+ a*d: their cast, when r != a]. Plain: a*d (the head's input) + 12 V: fp32
    log-probabilities kept for backward, their gradient and the logits' gradient, alive
    together when backward starts (the 4 V of the fp32 logits is one third of it).
    Plain and compiled (``s.compiled``): Inductor fuses log-softmax, the loss and their
    backward, so a*d + 2a V + 4: the a-byte logits, their gradient, and an fp32
    log-sum-exp (on an H200, GPT-2 small at 16 x 1024 tokens: planned 11.6 GiB, measured
    11.97; bench/RESULTS.md "GPU MFU").
    """
    d = s.model.n_embd
    r, a = residual_bytes(strategy, s.precision), compute_bytes(s.precision)
    if s.fused_loss:
        return r * d + a * d + (a * d if r != a else 0)
    if s.compiled:
        return a * d + 2 * a * s.vocab + 4
    return a * d + 12 * s.vocab


def activation_bytes_per_seq(s: Setup, strategy: str) -> int:
    """Bytes per micro-batch sequence of seq_len tokens.

    s * (L * layer + r*d + 4 (final norm) + 8 (token ids) + loss); with activation
    checkpointing L * layer becomes L * r*d (the blocks' inputs) + one layer (the block
    being recomputed). ``doc_mask`` adds s^2 (the boolean mask), 8 hd s (per-sequence
    cos/sin) and a s^2 per kept layer (SDPA's additive mask).
    """
    cfg, seq = s.model, s.model.seq_len
    r, a = residual_bytes(strategy, s.precision), compute_bytes(s.precision)
    layer = layer_activation_bytes(cfg, r, a)
    if s.activation_checkpointing:
        blocks, mask_layers = cfg.n_layer * r * cfg.n_embd + layer, 1
    else:
        blocks, mask_layers = cfg.n_layer * layer, cfg.n_layer
    per_token = blocks + r * cfg.n_embd + 4 + 8 + loss_activation_bytes(s, strategy)
    total = seq * per_token
    if cfg.doc_mask:
        total += seq * seq + 8 * cfg.head_size() * seq + mask_layers * a * seq * seq
    return total


# --------------------------------------------------------------------------- totals


def rows_bytes(s: Setup, strategy: str, micro_batch: int) -> dict[str, int]:
    """The table's rows other than activations, keyed as in
    :data:`lmforge.plan.pretrain.ROWS`."""
    return {"params": params_bytes(s, strategy), "grads": grads_bytes(s, strategy),
            "optimizer": optimizer_bytes(s, strategy), "buckets": bucket_bytes(s, strategy),
            "unsharded_params": unsharded_params_bytes(s, strategy),
            "unsharded_grads": unsharded_grads_bytes(s, strategy),
            "weight_copies": weight_copy_bytes(s, strategy),
            "loss_buffers": loss_buffer_bytes(s, strategy, micro_batch)}


def total_bytes(s: Setup, strategy: str, micro_batch: int) -> int:
    """The rows + micro_batch * activations per sequence."""
    return (sum(rows_bytes(s, strategy, micro_batch).values())
            + micro_batch * activation_bytes_per_seq(s, strategy))


def reserve_bytes(device_bytes: int, reserve_gib: float = RESERVE_GIB) -> int:
    """reserve_gib GiB (CUDA context, workspaces) + 10% of the device (fragmentation)."""
    return int(reserve_gib * GIB + FRAGMENTATION * device_bytes)


def largest_fitting(total: Callable[[int], int], per_seq: int, budget: int) -> int:
    """Largest micro-batch b with total(b) <= budget (bisection; total grows with b by at
    least per_seq a sequence); 0 = none."""
    ok, bad = 0, budget // per_seq + 1  # total(bad) > budget
    while bad - ok > 1:
        mid = (ok + bad) // 2
        if total(mid) <= budget:
            ok = mid
        else:
            bad = mid
    return ok

