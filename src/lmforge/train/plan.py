"""``lmforge plan``: the memory a training run needs per rank, under DDP and FSDP2, before launch.

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
  bf16. With fp16, lmforge.train.fsdp sets no policy: fp32 gathers under autocast.

Not modelled: torch.compile (Inductor recomputes pointwise ops and usually keeps less),
the activation gradients alive during a block's backward, LoRA (planned as full
training), and gradient liveness: after the first step ``zero_grad(set_to_none=True)``
frees the gradients between steps, so counting them resident over-states the forward's
peak by at most the grads row. The reserve (CUDA context, cuBLAS/NCCL workspaces, the
caching allocator's fragmentation) covers the rest.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmforge.config import ModelConfig, Params, load_params
from lmforge.errors import ConfigError
from lmforge.model.llama import ffn_hidden_size
from lmforge.model.loss import balanced_chunk, default_chunk_tokens

GIB = 1 << 30
STRATEGIES = ("ddp", "fsdp")
PRECISIONS = ("bf16", "fp16", "fp32")
# Reserve: a fixed part (CUDA context, cuBLAS and NCCL workspaces) plus a share of the
# device for the caching allocator's fragmentation.
RESERVE_GIB = 1.0
FRAGMENTATION = 0.10
TOKENIZER = Path("models/tokenizer")  # the pipeline's, beside params.yaml (either backend)

# Preset shapes for `--shape`. Llama-3.2-1B: 16 layers, 2048 wide, 32 heads, 8 KV heads,
# MLP 8192 (our rule, 8/3 * n_embd rounded up to ffn_multiple_of, gives 8192 with 4096),
# vocabulary 128256, tied embeddings; planned at a 2048-token context.
#
# The others, from each model's config.json on the Hugging Face Hub (num_hidden_layers,
# num_attention_heads, num_key_value_heads, hidden_size, intermediate_size, vocab_size,
# tie_word_embeddings, rope_theta; attention_bias for Qwen2's q/k/v biases). Our MLP width
# is 8/3 d rounded up to ffn_multiple_of, so ffn_multiple_of is chosen to land on
# intermediate_size. Every preset is planned at a 2048-token context (--seq-len to change).
#
# | key        | model (repo on the Hub)            |  L |  d    | H  | KV | MLP   | vocab  | tied | params        |
# |------------|------------------------------------|----|-------|----|----|-------|--------|------|---------------|
# | 1b         | meta-llama/Llama-3.2-1B            | 16 | 2048  | 32 |  8 |  8192 | 128256 | yes  | 1,235,814,400 |
# | 3b         | meta-llama/Llama-3.2-3B            | 28 | 3072  | 24 |  8 |  8192 | 128256 | yes  | 3,212,749,824 |
# | 7b         | meta-llama/Llama-2-7b-hf           | 32 | 4096  | 32 | 32 | 11008 |  32000 | no   | 6,738,415,616 |
# | mistral-7b | mistralai/Mistral-7B-v0.1          | 32 | 4096  | 32 |  8 | 14336 |  32000 | no   | 7,241,732,096 |
# | 8b         | meta-llama/Llama-3.1-8B            | 32 | 4096  | 32 |  8 | 14336 | 128256 | no   | 8,030,261,248 |
# | qwen2.5-7b | Qwen/Qwen2.5-7B (q/k/v biases)     | 28 | 3584  | 28 |  4 | 18944 | 152064 | no   | 7,615,616,512 |
#
# (params: the published counts, which tests/test_finetune_plan.py checks against the
# module.) RoPE scaling and norm eps do not change memory and are left out.
SHAPES: dict[str, dict[str, Any]] = {
    "1b": {"n_layer": 16, "n_head": 32, "n_kv_head": 8, "n_embd": 2048, "seq_len": 2048,
           "ffn_multiple_of": 4096, "rope_base": 500000.0, "tie_embeddings": True,
           "vocab": 128256, "name": "Llama-3.2-1B shape"},
    "3b": {"n_layer": 28, "n_head": 24, "n_kv_head": 8, "n_embd": 3072, "seq_len": 2048,
           "ffn_multiple_of": 256, "rope_base": 500000.0, "tie_embeddings": True,
           "vocab": 128256, "name": "Llama-3.2-3B shape"},
    "7b": {"n_layer": 32, "n_head": 32, "n_kv_head": 32, "n_embd": 4096, "seq_len": 2048,
           "ffn_multiple_of": 256, "rope_base": 10000.0, "tie_embeddings": False,
           "vocab": 32000, "name": "Llama-2-7B shape"},
    "mistral-7b": {"n_layer": 32, "n_head": 32, "n_kv_head": 8, "n_embd": 4096,
                   "seq_len": 2048, "ffn_multiple_of": 14336, "rope_base": 10000.0,
                   "tie_embeddings": False, "family": "mistral", "vocab": 32000,
                   "name": "Mistral-7B-v0.1 shape"},
    "8b": {"n_layer": 32, "n_head": 32, "n_kv_head": 8, "n_embd": 4096, "seq_len": 2048,
           "ffn_multiple_of": 14336, "rope_base": 500000.0, "tie_embeddings": False,
           "vocab": 128256, "name": "Llama-3.1-8B shape"},
    "qwen2.5-7b": {"n_layer": 28, "n_head": 28, "n_kv_head": 4, "n_embd": 3584,
                   "seq_len": 2048, "ffn_multiple_of": 18944, "rope_base": 1000000.0,
                   "tie_embeddings": False, "qkv_bias": True, "family": "qwen2",
                   "vocab": 152064, "name": "Qwen2.5-7B shape"},
}


@dataclass(frozen=True)
class Setup:
    """What is planned: the model, its vocabulary and the run's memory-relevant knobs."""

    model: ModelConfig
    vocab: int
    precision: str = "bf16"  # bf16 | fp16 | fp32
    world: int = 1
    activation_checkpointing: bool = False
    fused_loss: bool = True
    optimizer: str = "adamw"  # adamw | muon (train.optimizer)


# --------------------------------------------------------------------------- parameters


def param_shapes(cfg: ModelConfig, vocab: int) -> tuple[list[tuple[int, ...]],
                                                        list[tuple[int, ...]]]:
    """Shapes of the root's parameters (embedding, final norm, untied head) and one block's."""
    d, hd = cfg.n_embd, cfg.head_size()
    kv, f = cfg.n_kv_head or cfg.n_head, ffn_hidden_size(cfg)
    root = [(vocab, d), (d,)] + ([] if cfg.tie_embeddings else [(vocab, d)])
    block = [(d,), (cfg.n_head * hd, d), (kv * hd, d), (kv * hd, d), (d, cfg.n_head * hd),
             (d,), (f, d), (f, d), (d, f)]
    if cfg.qkv_bias:
        block += [(cfg.n_head * hd,), (kv * hd,), (kv * hd,)]
    if cfg.qk_norm:
        block += [(hd,), (hd,)]
    return root, block


def _numel(shapes: list[tuple[int, ...]]) -> int:
    return sum(math.prod(s) for s in shapes)


def root_params(cfg: ModelConfig, vocab: int) -> int:
    """V*d (embedding, tied head) + d (final norm) [+ V*d for an untied head]."""
    return _numel(param_shapes(cfg, vocab)[0])


def block_params(cfg: ModelConfig) -> int:
    """2d (norms) + d*(H + 2KV)*hd + H*hd*d (attention) + 3*d*F (SwiGLU)."""
    return _numel(param_shapes(cfg, 0)[1])


def num_params(cfg: ModelConfig, vocab: int) -> int:
    """P = root + L * block; equals ``Llama(cfg, vocab).num_params()``."""
    return root_params(cfg, vocab) + cfg.n_layer * block_params(cfg)


def fused_weight_params(cfg: ModelConfig) -> int:
    """Per block, the weights ``fused_linear`` concatenates: q|k|v and gate|up."""
    d, kv = cfg.n_embd, cfg.n_kv_head or cfg.n_head
    return d * (cfg.n_head + 2 * kv) * cfg.head_size() + 2 * d * ffn_hidden_size(cfg)


def cached_weight_params(cfg: ModelConfig) -> int:
    """Per block, the plain Linears (wo, w2) whose casts autocast caches."""
    return cfg.n_embd * cfg.n_embd + cfg.n_embd * ffn_hidden_size(cfg)


def sharded_params(cfg: ModelConfig, vocab: int, world: int) -> int:
    """Elements per rank under FSDP2: sum over tensors of ceil(dim0 / N) * rest."""
    root, block = param_shapes(cfg, vocab)

    def shard(shapes: list[tuple[int, ...]]) -> int:
        return sum(-(-s[0] // world) * math.prod(s[1:]) for s in shapes)

    return shard(root) + cfg.n_layer * shard(block)


# --------------------------------------------------------------------------- model states


def compute_bytes(precision: str) -> int:
    """a: bytes per element of the compute dtype (2 for bf16/fp16, 4 for fp32)."""
    return 4 if precision == "fp32" else 2


def autocast(strategy: str, precision: str) -> bool:
    """Whether fp32 weights run under autocast: DDP in 16 bits, and FSDP in fp16 (the
    loop gives FSDP a bf16 ``MixedPrecisionPolicy`` only; fp16 keeps fp32 params)."""
    return precision != "fp32" and (strategy == "ddp" or precision == "fp16")


def param_dtype_bytes(strategy: str, precision: str) -> int:
    """Bytes of the weights the forward reads: 2 for FSDP's bf16 gathers, else 4 (fp32)."""
    return 2 if strategy == "fsdp" and precision == "bf16" else 4


def residual_bytes(strategy: str, precision: str) -> int:
    """r: the residual stream's bytes: fp32 under autocast (fp32 embedding + 16-bit
    sublayer outputs), else the weights' dtype."""
    return 4 if autocast(strategy, precision) else param_dtype_bytes(strategy, precision)


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


def muon_matrix_params(cfg: ModelConfig) -> int:
    """The elements Muon takes (lmforge.train.optim.muon_parameters): every block's 2-D
    weights (wq wk wv wo w1 w2 w3), not norms, biases, the embedding or the head."""
    return cfg.n_layer * _numel([s for s in param_shapes(cfg, 0)[1] if len(s) == 2])


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
    block and the prefetched next."""
    if strategy != "fsdp":
        return 0
    p = param_dtype_bytes(strategy, s.precision)
    return p * (root_params(s.model, s.vocab) + 2 * block_params(s.model))


def unsharded_grads_bytes(s: Setup, strategy: str) -> int:
    """FSDP: p * root + (p + 4) * block: the root's grads through backward, one block's
    grads and their fp32 reduce-scatter input."""
    if strategy != "fsdp":
        return 0
    p = param_dtype_bytes(strategy, s.precision)
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
    """
    d = s.model.n_embd
    r, a = residual_bytes(strategy, s.precision), compute_bytes(s.precision)
    if s.fused_loss:
        return r * d + a * d + (a * d if r != a else 0)
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


ROWS: tuple[tuple[str, str], ...] = (
    ("params", "params (fp32)"),
    ("grads", "grads (fp32)"),
    ("optimizer", "optimizer"),
    ("buckets", "DDP grad buckets"),
    ("unsharded_params", "unsharded params"),
    ("unsharded_grads", "unsharded grads"),
    ("weight_copies", "weight copies"),
    ("loss_buffers", "loss buffers"),
)
_NOT_APPLICABLE = {"ddp": {"unsharded_params", "unsharded_grads"}, "fsdp": {"buckets"}}


def rows_bytes(s: Setup, strategy: str, micro_batch: int) -> dict[str, int]:
    """The table's rows other than activations, keyed as in ``ROWS``."""
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


def fit_micro_batch(s: Setup, strategy: str, budget: int) -> int:
    """Largest micro-batch b with total(b) <= budget; 0 = none."""
    return largest_fitting(lambda b: total_bytes(s, strategy, b),
                           activation_bytes_per_seq(s, strategy), budget)


def plan(s: Setup, device_gib: float, micro_batch: int,
         reserve_gib: float = RESERVE_GIB) -> dict[str, Any]:
    """Every figure of the plan, in bytes, for both strategies (the ``--json`` document)."""
    device = int(device_gib * GIB)
    budget = device - reserve_bytes(device, reserve_gib)
    out: dict[str, Any] = {
        "params": num_params(s.model, s.vocab), "vocab": s.vocab,
        "model": dataclasses.asdict(s.model), "precision": s.precision, "world": s.world,
        "activation_checkpointing": s.activation_checkpointing, "fused_loss": s.fused_loss,
        "device_bytes": device, "reserve_bytes": device - budget, "budget_bytes": budget,
        "micro_batch": micro_batch, "optimizer": s.optimizer,
    }
    for strategy in STRATEGIES:
        figures: dict[str, Any] = dict(rows_bytes(s, strategy, micro_batch))
        total = total_bytes(s, strategy, micro_batch)
        figures.update(activations_per_seq=activation_bytes_per_seq(s, strategy),
                       total=total, fits=total <= budget,
                       max_micro_batch=fit_micro_batch(s, strategy, budget))
        out[strategy] = figures
    return out


# --------------------------------------------------------------------------- command line


def format_size(n: int) -> str:
    """Bytes as the tables print them: MiB under a GiB, GiB above."""
    if n == 0:
        return "0"
    if n < GIB:
        return f"{n / (1 << 20):.1f} MiB"
    return f"{n / GIB:.2f} GiB"


def format_count(n: int) -> str:
    """A parameter count in billions or millions."""
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def format_table(p: dict[str, Any], source: str) -> str:
    """The plan as the table ``lmforge plan`` prints."""
    m = p["model"]
    knobs = ([p["precision"]] + (["activation checkpointing"] if p["activation_checkpointing"]
                                 else []) + ([] if p["fused_loss"] else ["plain loss"])
             + (["doc_mask"] if m["doc_mask"] else []))
    lines = [f"lmforge plan: {format_count(p['params'])} parameters ({source}, vocab {p['vocab']}), "
             f"seq_len {m['seq_len']}, {', '.join(knobs)}, {p['world']} x "
             f"{p['device_bytes'] / GIB:g} GiB",
             f"{'':28}{'ddp':>13}{'fsdp':>13}"]

    def row(label: str, cells: list[str]) -> None:
        lines.append(f"{label:28}" + "".join(f"{c:>13}" for c in cells))

    optimizer = "Muon/AdamW" if p["optimizer"] == "muon" else "AdamW"
    for key, label in ROWS:
        label = f"{label} ({optimizer})" if key == "optimizer" else label
        row(label, ["-" if key in _NOT_APPLICABLE[st] else format_size(p[st][key])
                    for st in STRATEGIES])
    row("activations/seq", [format_size(p[st]["activations_per_seq"]) for st in STRATEGIES])
    mb = p["micro_batch"]
    row(f"total @ micro-batch {mb}", [format_size(p[st]["total"]) + ("" if p[st]["fits"] else "!")
                                      for st in STRATEGIES])
    row("fits micro-batch", [str(p[st]["max_micro_batch"]) for st in STRATEGIES])
    lines.append(f"budget {format_size(p['budget_bytes'])} = {p['device_bytes'] / GIB:g} GiB - "
                 f"reserve {format_size(p['reserve_bytes'])} (CUDA context and workspaces + "
                 f"{FRAGMENTATION:.0%} for allocator fragmentation); '!' = over budget")
    lines.append("assumes flash / memory-efficient SDPA (no s x s scores), eager autograd "
                 "(torch.compile keeps less), gradients resident; GiB = 2^30 bytes")
    if p["optimizer"] == "muon":
        lines.append("optimizer: Muon (one fp32 buffer) on the blocks' matrices, AdamW on the "
                     "rest; fsdp plans AdamW, as Muon is refused under FSDP")
    return "\n".join(lines)


def _section_knobs(params: Params, section: str) -> tuple[Any, ModelConfig]:
    """The section's run knobs and the model it trains (fine-tuning's context and mask)."""
    cfg = getattr(params, section)
    model = params.model
    if section == "sft":
        model = dataclasses.replace(model, seq_len=params.sft_data.seq_len,
                                    doc_mask=params.sft.doc_mask)
    elif section == "dpo":
        model = dataclasses.replace(model, seq_len=params.dpo_data.seq_len, doc_mask=True)
    return cfg, model


def _vocab(args: argparse.Namespace, params: Params, preset: dict[str, Any] | None,
           params_path: Path) -> tuple[int, str]:
    """The vocabulary: --vocab, the preset's, the built tokenizer's, or tokenizer.vocab_size."""
    if args.vocab is not None:
        return args.vocab, "--vocab"
    if preset is not None:
        return preset["vocab"], "preset"
    from lmforge.tokenizer.files import find_tokenizer

    for path in (params.tokenizer.init_from, params_path.parent / TOKENIZER):
        if path and find_tokenizer(path) is not None:
            from lmforge.tokenizer import Tokenizer

            return Tokenizer.load(path).vocab_size, str(path)
    return params.tokenizer.vocab_size, "tokenizer.vocab_size"


OVERRIDES = ("n_layer", "n_head", "n_kv_head", "n_embd", "seq_len", "ffn_multiple_of",
             "tie_embeddings", "doc_mask")


def build_setup(args: argparse.Namespace,
                params: Params | None = None) -> tuple[Setup, int, dict[str, str]]:
    """The Setup the command line asks about, the micro-batch to total, and where the
    model and the vocabulary came from (``params``: args.params, already loaded)."""
    for name, low in (("world", 1), ("vocab", 1), ("micro_batch", 1)):
        value = getattr(args, name)
        if value is not None and value < low:
            raise ConfigError(f"plan: --{name.replace('_', '-')} must be >= {low}, got {value}")
    if not args.device_gb > 0 or args.reserve_gb < 0:
        raise ConfigError("plan: --device-gb must be > 0 and --reserve-gb >= 0")
    params = params or load_params(args.params)
    cfg, model = _section_knobs(params, args.section)
    preset = None
    source = f"model from {args.params}" + ("" if args.section == "train"
                                            else f" [{args.section}]")
    if args.shape is not None:
        preset = SHAPES[args.shape]
        model = dataclasses.replace(model, **{k: v for k, v in preset.items()
                                              if k not in ("vocab", "name")})
        source = preset["name"]
    changed = {k: getattr(args, k) for k in OVERRIDES if getattr(args, k) is not None}
    if changed:
        model = dataclasses.replace(model, **changed)
        source += ", " + " ".join(f"{k}={v}" for k, v in changed.items())
    try:
        model.validate()
    except ConfigError as e:
        raise ConfigError(f"plan: {e}") from None
    vocab, vocab_source = _vocab(args, params, preset, Path(args.params))
    precision = args.precision or cfg.precision
    precision = "bf16" if precision == "auto" else precision  # planning for a recent GPU
    fused = cfg.fused_loss if args.fused_loss is None else args.fused_loss
    if args.section == "dpo":
        fused = False  # DPO scores sequences from the full logits (train/preference.py)
    setup = Setup(model=model, vocab=vocab, precision=precision,
                  world=args.world or cfg.nproc,
                  activation_checkpointing=(cfg.activation_checkpointing
                                            if args.activation_checkpointing is None
                                            else args.activation_checkpointing),
                  fused_loss=fused, optimizer=cfg.optimizer)
    micro_batch = args.micro_batch or cfg.micro_batch_size
    return setup, micro_batch, {"model": source, "vocab": vocab_source}


def cmd_plan(args: argparse.Namespace) -> None:
    """``lmforge plan``: print the per-rank memory table (or its JSON); with ``--mode``,
    the fine-tuning table of one device (lmforge.train.finetune_plan)."""
    if args.mode is not None:
        from lmforge.train import finetune_plan as fp

        tune, micro_batch, source = fp.build_tune(args)
        result = fp.finetune_plan(tune, args.device_gb, micro_batch, args.reserve_gb)
        if args.json:
            print(json.dumps({"source": source, **result}, indent=2))
        else:
            print(fp.format_table(result, source["model"]))
        return
    setup, micro_batch, source = build_setup(args)
    result = plan(setup, args.device_gb, micro_batch, args.reserve_gb)
    if args.json:
        print(json.dumps({"source": source, **result}, indent=2))
    else:
        print(format_table(result, source["model"]))


def add_plan_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``plan``: per-rank memory under DDP and FSDP, and the micro-batch that fits."""
    p = subparsers.add_parser(
        "plan", help="per-rank memory of a training run under DDP and FSDP, before launch")
    p.add_argument("--params", default="params.yaml", help="params file (default: params.yaml)")
    p.add_argument("--section", choices=("train", "sft", "dpo"), default="train",
                   help="the section whose knobs (micro-batch, precision, ...) to plan")
    p.add_argument("--device-gb", type=float, default=80.0,
                   help="memory per device in GiB (default: 80)")
    p.add_argument("--world", type=int, default=None,
                   help="ranks (default: the section's nproc)")
    p.add_argument("--vocab", type=int, default=None,
                   help="vocabulary size (default: the tokenizer's)")
    p.add_argument("--precision", choices=PRECISIONS, default=None,
                   help="default: the section's (auto = bf16)")
    p.add_argument("--micro-batch", type=int, default=None,
                   help="micro-batch whose total to print (default: the section's)")
    p.add_argument("--reserve-gb", type=float, default=RESERVE_GIB,
                   help=f"fixed reserve in GiB, plus {FRAGMENTATION:.0%}% of the device for "
                        "fragmentation "
                        f"(default: {RESERVE_GIB:g})")
    p.add_argument("--shape", choices=list(SHAPES), default=None,
                   help="a preset model shape instead of params.yaml's (1b, 3b: Llama-3.2; "
                        "7b: Llama-2-7B; mistral-7b; 8b: Llama-3.1-8B; qwen2.5-7b)")
    for name in OVERRIDES[:6]:
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=None)
    for name in ("tie_embeddings", "doc_mask", "activation_checkpointing", "fused_loss"):
        p.add_argument(f"--{name.replace('_', '-')}", action=argparse.BooleanOptionalAction,
                       default=None)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--mode", choices=("full", "lora", "qlora"), default=None,
                   help="fine-tuning on one device instead of the DDP/FSDP table: full, "
                        "LoRA (bf16 frozen base) or QLoRA (NF4 frozen base); micro-batch "
                        "1 unless --micro-batch")
    p.add_argument("--rank", type=int, default=None,
                   help="with --mode lora/qlora: adapter rank (default: the section's "
                        "lora, else 8)")
    p.add_argument("--targets", default=None,
                   help="with --mode lora/qlora: comma-separated Linears or groups "
                        "(attn, mlp; default: the section's lora, else attn,mlp)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="with --mode: a GPU of --device-gb, or that much CPU RAM")
    p.set_defaults(func=cmd_plan)
    return p
