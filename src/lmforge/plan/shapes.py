"""What a memory plan is about: the model's shapes, its parameter counts, bytes per dtype.

The pieces every plan shares: :class:`Setup` (the model and the run's memory-relevant
knobs), the preset shapes of ``lmforge plan --shape``, the parameter shapes and counts of
:class:`lmforge.model.llama.Llama` (the root, one block, an FSDP2 shard, a block's
Linears), the bytes per element of the dtypes a run holds, and sizes as the tables print
them. :mod:`lmforge.plan.memory` builds the per-strategy rows on these.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from lmforge.config import ModelConfig
from lmforge.model.llama import ffn_hidden_size

GIB = 1 << 30

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
    # Under torch.compile, where Inductor fuses the plain loss (see memory.py).
    compiled: bool = False


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


def linear_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out, in) of each block Linear, by name."""
    d, hd = cfg.n_embd, cfg.head_size()
    q, kv, f = cfg.n_head * hd, (cfg.n_kv_head or cfg.n_head) * hd, ffn_hidden_size(cfg)
    return {"wq": (q, d), "wk": (kv, d), "wv": (kv, d), "wo": (d, q),
            "w1": (f, d), "w3": (f, d), "w2": (d, f)}


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


def muon_matrix_params(cfg: ModelConfig) -> int:
    """The elements Muon takes (lmforge.train.optim.muon_parameters): every block's 2-D
    weights (wq wk wv wo w1 w2 w3), not norms, biases, the embedding or the head."""
    return cfg.n_layer * _numel([s for s in param_shapes(cfg, 0)[1] if len(s) == 2])


# --------------------------------------------------------------------------- dtypes


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


# --------------------------------------------------------------------------- printing


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
