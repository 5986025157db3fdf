"""A Llama-style decoder in one file: RMSNorm, RoPE, grouped-query attention, SwiGLU.

Pre-norm blocks, no biases, optional tied embeddings. The open families are options of the
same block (``ModelConfig``): q/k/v biases (Qwen2), an RMSNorm on each query and key head
before RoPE (Qwen3), a head width of its own (Qwen3), and Llama 3.1's RoPE frequency
scaling; Mistral is the Llama block. Attention goes through
``F.scaled_dot_product_attention`` so PyTorch picks the fastest kernel (flash /
memory-efficient on CUDA, a fused kernel on CPU). With ``positions`` (each token's offset
in its document, from the loader) attention stops at document boundaries and RoPE
positions restart at each document, so a packed window trains like separate documents.

RoPE uses the "rotate half" layout (the first and second half of each head dimension
form the pairs), the one Hugging Face's ``LlamaForCausalLM`` uses, so q/k weights export
without a permutation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from lmforge.config import ModelConfig, RopeScalingConfig
from lmforge.model import ops
from lmforge.model.frozen import compute_weight, frozen_linear
from lmforge.model.loss import (
    LIGER,
    WHOLE,
    cross_entropy,
    liger_linear_cross_entropy,
    linear_cross_entropy,
)


def ffn_hidden_size(cfg: ModelConfig) -> int:
    """SwiGLU hidden width: 8/3 * n_embd rounded up to a multiple of ``ffn_multiple_of``."""
    hidden = math.ceil(8 * cfg.n_embd / 3)
    m = cfg.ffn_multiple_of
    return m * math.ceil(hidden / m)


def param_count_formula(cfg: ModelConfig, vocab_size: int) -> int:
    """Parameter count of :class:`Llama` for ``cfg``, from the architecture alone."""
    d, hd = cfg.n_embd, cfg.head_size()
    kv = cfg.n_kv_head or cfg.n_head
    attn = d * cfg.n_head * hd + 2 * d * kv * hd + cfg.n_head * hd * d
    if cfg.qkv_bias:
        attn += (cfg.n_head + 2 * kv) * hd
    if cfg.qk_norm:
        attn += 2 * hd
    mlp = 3 * d * ffn_hidden_size(cfg)
    per_layer = attn + mlp + 2 * d  # two RMSNorm weights
    head = 0 if cfg.tie_embeddings else vocab_size * d
    return vocab_size * d + cfg.n_layer * per_layer + d + head


def rope_frequencies(head_dim: int, base: float,
                     scaling: RopeScalingConfig | None = None) -> torch.Tensor:
    """RoPE's inverse frequencies (head_dim / 2), in float64; with Llama 3.1 scaling,
    long wavelengths stretched by ``factor`` and the middle band interpolated."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is None:
        return inv_freq
    old = scaling.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    low, high = old / scaling.low_freq_factor, old / scaling.high_freq_factor
    scaled = torch.where(wavelen > low, inv_freq / scaling.factor, inv_freq)
    smooth = (old / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    between = (wavelen >= high) & (wavelen <= low)
    return torch.where(between, (1 - smooth) * scaled / scaling.factor + smooth * scaled,
                       scaled)


def rope_tables(seq_len: int, head_dim: int, base: float,
                scaling: RopeScalingConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, each (seq_len, head_dim), for the rotate-half layout."""
    inv_freq = rope_frequencies(head_dim, base, scaling)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


def rope_tables_for(cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The RoPE tables of a model with config ``cfg`` (its context, head width, scaling)."""
    return rope_tables(cfg.seq_len, cfg.head_size(), cfg.rope_base, cfg.rope_scaling)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate queries or keys (last dim = head_dim) by angles; cos/sin broadcast to ``x``."""
    if not torch.compiler.is_compiling():  # eager: fewer passes, see ops.py
        half = x.size(-1) // 2
        return ops.rope(x, cos[..., :half], sin[..., :half])
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


def document_attention(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-document position ids and attention mask from ``positions`` (B, T).

    ``positions`` is each token's offset in its document (0 at a document's first token).
    Returns ``(position_ids, mask)``: ids that restart at 0 at every document start in the
    window (a document continued from the previous window starts at 0 too: RoPE only
    sees relative positions, and this keeps ids below ``seq_len``), and a (B, 1, T, T)
    boolean mask, True where query i may attend to key j: same document and j <= i.
    """
    T = positions.size(-1)
    ar = torch.arange(T, device=positions.device)
    starts = positions == 0
    doc = starts.cumsum(-1)  # document number within the window
    first = torch.where(starts, ar, 0).cummax(-1).values  # index of the document's start
    same_doc = doc.unsqueeze(-1) == doc.unsqueeze(-2)
    causal = ar.unsqueeze(-1) >= ar
    return ar - first, (same_doc & causal).unsqueeze(1)


class RMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` with a hand-written backward in eager mode (ops.py)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return super().forward(x)
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        return ops.rms_norm(x, self.weight, eps)


@dataclass
class KVCache:
    """Per-layer key/value buffers for incremental decoding; ``pos`` = tokens cached."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    pos: int = 0

    @classmethod
    def empty(cls, model: Llama, batch_size: int, device: torch.device,
              dtype: torch.dtype) -> KVCache:
        """Buffers for ``model.config.seq_len`` positions."""
        cfg = model.config
        kv = cfg.n_kv_head or cfg.n_head
        shape = (batch_size, kv, cfg.seq_len, cfg.head_size())
        return cls([torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layer)],
                   [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layer)])


class Attention(nn.Module):
    """Causal self-attention with RoPE and grouped-query key/value heads; optionally
    q/k/v biases (Qwen2) and an RMSNorm on each query and key head before RoPE (Qwen3)."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.n_head = cfg.n_head
        self.n_kv_head = cfg.n_kv_head or cfg.n_head
        self.head_dim = cfg.head_size()
        self.dropout = cfg.dropout
        bias = cfg.qkv_bias
        self.wq = nn.Linear(cfg.n_embd, self.n_head * self.head_dim, bias=bias)
        self.wk = nn.Linear(cfg.n_embd, self.n_kv_head * self.head_dim, bias=bias)
        self.wv = nn.Linear(cfg.n_embd, self.n_kv_head * self.head_dim, bias=bias)
        self.wo = nn.Linear(self.n_head * self.head_dim, cfg.n_embd, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, eps=cfg.norm_eps)
            self.k_norm = RMSNorm(self.head_dim, eps=cfg.norm_eps)
        self.qk_norm = cfg.qk_norm

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: KVCache | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` (B, T, C); cos/sin (T, 1, D) or (B, T, 1, D); ``mask`` (B, 1, T, T) bool."""
        B, T, _ = x.shape
        H, KV, D = self.n_head, self.n_kv_head, self.head_dim
        # One GEMM for q, k and v (a wide matmul beats three narrow ones), and RoPE on q
        # and k together. The weights stay three parameters, so checkpoints, safetensors
        # and the Hugging Face export keep their names.
        qkv = fused_linear(x, (self.wq, self.wk, self.wv)).view(B, T, H + 2 * KV, D)
        qk = qkv[:, :, :H + KV]
        if self.qk_norm:  # per head, before RoPE (Qwen3)
            qk = torch.cat([self.q_norm(qk[:, :, :H]), self.k_norm(qk[:, :, H:])], dim=2)
        qk = apply_rope(qk, cos, sin)
        q, k = qk[:, :, :H].transpose(1, 2), qk[:, :, H:].transpose(1, 2)
        v = qkv[:, :, H + KV:].transpose(1, 2)
        causal = mask is None
        if cache is not None:
            if mask is not None:
                raise ValueError("KVCache: document masks are for training, not generation")
            start = cache.pos
            cache.keys[self.layer][:, :, start:start + T] = k
            cache.values[self.layer][:, :, start:start + T] = v
            k = cache.keys[self.layer][:, :, :start + T]
            v = cache.values[self.layer][:, :, :start + T]
            # Prefill from position 0 is plain causal; a single new token sees the whole
            # cache. (Multi-token chunks after a prefix are not used by generate().)
            causal = start == 0
            if not causal and T != 1:
                raise ValueError("KVCache: after the prefill, feed one token at a time")
        gqa = self.n_kv_head != self.n_head and native_gqa(q, mask)
        if self.n_kv_head != self.n_head and not gqa:
            rep = self.n_head // self.n_kv_head
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal,
            dropout_p=self.dropout if self.training else 0.0, enable_gqa=gqa)
        return self.wo(y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim))


def native_gqa(q: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether SDPA's flash kernel takes grouped k/v as they are (``enable_gqa``) for
    ``q``: on a CPU, or a GPU in 16 bits, without a mask. Elsewhere the kernel SDPA would
    pick (memory-efficient, or math under a document mask) has no GQA path, so k and v are
    repeated to every head first, as before. Native GQA skips writing and reading H/KV
    copies of k and v each way: SmolLM2's LoRA step on a CPU, attention 0.81 -> 0.61 s."""
    if mask is not None:
        return False
    return q.device.type == "cpu" or q.dtype in (torch.float16, torch.bfloat16)


def fused_linear(x: torch.Tensor, layers: tuple[nn.Module, ...]) -> torch.Tensor:
    """``x`` through several Linears as one GEMM, their outputs side by side.

    A layer wrapped by LoRA (lmforge.model.lora) joins the GEMM with its frozen base
    weight and adds its low-rank path ``delta(x)`` on its own slice of the output, so the
    adapter costs r-wide matmuls, its input dropout applies, and the frozen weight gets no
    gradient product. When every weight is frozen (a LoRA run's base, a DPO reference)
    the layers run as separate GEMMs instead (``frozen.frozen_linear``, which also takes a
    16-bit or NF4 base): the joined weight would be one more copy of the base, kept for
    backward (two thirds of a 7B base; docs/fine-tuning-memory.md).
    """
    weights = [getattr(m, "base", m).weight for m in layers]
    biases = [getattr(m, "base", m).bias for m in layers]
    if not any(w.requires_grad for w in weights):
        parts = [frozen_linear(x, w, b) for w, b in zip(weights, biases, strict=True)]
        return torch.cat([p + m.delta(x) if hasattr(m, "delta") else p
                          for p, m in zip(parts, layers, strict=True)], dim=-1)
    bias = (torch.cat([b if b is not None else w.new_zeros(w.shape[0])
                       for b, w in zip(biases, weights, strict=True)])
            if any(b is not None for b in biases) else None)
    out = F.linear(x, torch.cat(weights), bias)
    if not any(hasattr(m, "delta") for m in layers):
        return out
    parts, start = [], 0
    for m, w in zip(layers, weights, strict=True):
        piece = out[..., start:start + w.shape[0]]
        parts.append(piece + m.delta(x) if hasattr(m, "delta") else piece)
        start += w.shape[0]
    return torch.cat(parts, dim=-1)


class SwiGLU(nn.Module):
    """``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hidden = ffn_hidden_size(cfg)
        self.w1 = nn.Linear(cfg.n_embd, hidden, bias=False)
        self.w3 = nn.Linear(cfg.n_embd, hidden, bias=False)
        self.w2 = nn.Linear(hidden, cfg.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Gate and up projections as one GEMM; the weights stay separate parameters.
        gate, up = fused_linear(x, (self.w1, self.w3)).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
        self.attn = Attention(cfg, layer)
        self.mlp_norm = RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
        self.mlp = SwiGLU(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: KVCache | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.drop(self.attn(self.attn_norm(x), cos, sin, cache, mask))
        return x + self.drop(self.mlp(self.mlp_norm(x)))


@torch.no_grad()
def init_parameter(name: str, p: torch.Tensor, n_layer: int, zero_proj: bool = False) -> None:
    """N(0, 0.02), norms at 1, biases at 0, residual output projections at
    0.02/sqrt(2 n_layer), or at 0 with ``zero_proj`` (``model.zero_init_proj``).

    One parameter at a time, so a sharded model can be initialised tensor by tensor
    with the same values (lmforge.train.fsdp.build_sharded)."""
    std = 0.02
    if name.endswith("norm.weight"):
        nn.init.ones_(p)
    elif name.endswith(".bias"):
        nn.init.zeros_(p)
    elif name.endswith(("attn.wo.weight", "mlp.w2.weight")):
        if zero_proj:  # each block starts as the identity on the residual stream
            nn.init.zeros_(p)
            return
        nn.init.normal_(p, mean=0.0, std=std / math.sqrt(2 * n_layer))
    else:
        nn.init.normal_(p, mean=0.0, std=std)


class Llama(nn.Module):
    """The decoder. ``forward(idx)`` -> logits; ``forward(idx, targets)`` -> (logits, loss).

    With ``fused_loss`` (the default; True, WHOLE or LIGER) ``forward(idx, targets)`` returns
    ``(None, loss)``: the loss comes from the hidden states without materialising the
    logits. With it False, the logits and :meth:`loss` of them.
    """

    def __init__(self, cfg: ModelConfig, vocab_size: int) -> None:
        super().__init__()
        self.config = cfg
        self.vocab_size = vocab_size
        # Training-time options the loop sets; they do not change the weights.
        self.activation_checkpointing = False
        self.label_smoothing = 0.0
        self.z_loss = 0.0
        # The loss from the hidden states: True, in cache-sized chunks (loss.py's custom
        # op); WHOLE, that op in one chunk; False, plain logits + cross_entropy; LIGER,
        # Liger-Kernel's (CUDA). The run sets it from train.fused_loss (loss_choice.py).
        self.fused_loss: bool | str = True
        self.tok_embeddings = nn.Embedding(vocab_size, cfg.n_embd)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.n_embd, vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_embeddings.weight
        cos, sin = rope_tables_for(cfg)
        # Non-persistent: derived from the config, so not in checkpoints or safetensors.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Every parameter initialised by :func:`init_parameter`, in order."""
        for name, p in self.named_parameters():
            init_parameter(name, p, self.config.n_layer, self.config.zero_init_proj)

    def num_params(self) -> int:
        """Number of distinct parameters (a tied embedding counts once)."""
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6 N_matmul + 12 L H Q T (PaLM appendix B)."""
        cfg = self.config
        n = self.num_params()
        if not cfg.tie_embeddings:
            n -= self.tok_embeddings.weight.numel()  # a lookup, not a matmul
        return 6 * n + 12 * cfg.n_layer * cfg.n_head * cfg.head_size() * cfg.seq_len

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                cache: KVCache | None = None, positions: torch.Tensor | None = None,
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits (B, T, V), and the loss when ``targets`` are given.

        ``positions`` (B, T): each token's offset in its document (the loader's
        ``return_doc_info``); given, attention stops at document boundaries.
        """
        _, T = idx.shape
        start = cache.pos if cache is not None else 0
        if start + T > self.config.seq_len:
            raise ValueError(f"sequence of {start + T} tokens exceeds seq_len "
                             f"{self.config.seq_len}")
        mask = None
        if positions is not None:
            ids, mask = document_attention(positions)
            cos, sin = self.rope_cos[ids].unsqueeze(2), self.rope_sin[ids].unsqueeze(2)
        else:  # (T, 1, D): broadcast over batch and heads of (B, T, H, D)
            cos = self.rope_cos[start:start + T].unsqueeze(1)
            sin = self.rope_sin[start:start + T].unsqueeze(1)
        x = self.tok_embeddings(idx)
        for block in self.layers:
            if self.activation_checkpointing and self.training and cache is None:
                x = checkpoint(block, x, cos, sin, None, mask, use_reentrant=False)
            else:
                x = block(x, cos, sin, cache, mask)
        if cache is not None:
            cache.pos += T
        return self.output(x, targets)

    def output(self, x: torch.Tensor, targets: torch.Tensor | None = None,
               ) -> torch.Tensor | tuple[torch.Tensor | None, torch.Tensor]:
        """What follows the blocks: the final norm, the head and, given ``targets``, the
        loss (``forward``'s return). A method of its own so that a sharded model, whose
        root runs eager, compiles it alone (lmforge.train.fsdp)."""
        x = self.norm(x)
        if targets is not None and self.fused_loss:  # True (chunked), WHOLE or LIGER
            head = compute_weight(self.lm_head.weight, x)  # a 16-bit frozen head: see frozen.py
            if self.fused_loss == LIGER:
                return None, liger_linear_cross_entropy(x, head, targets, self.label_smoothing,
                                                        self.z_loss)
            whole = max(1, targets.numel()) if self.fused_loss == WHOLE else None
            return None, linear_cross_entropy(x, head, targets, self.label_smoothing,
                                              self.z_loss, chunk_tokens=whole)
        logits = self.lm_head(x)
        if targets is None:
            return logits
        return logits, self.loss(logits, targets)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean fp32 cross-entropy over targets != -100, plus the optional z-loss."""
        return cross_entropy(logits, targets, self.label_smoothing, self.z_loss)
