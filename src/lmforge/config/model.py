"""The model section (architecture, RoPE scaling) and LoRA adapters."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from lmforge.config.checks import below_one, check_child, key, positive, section_name
from lmforge.errors import ConfigError


@dataclass
class RopeScalingConfig:
    """Llama 3.1's RoPE frequency scaling (``rope_scaling: {rope_type: llama3, ...}``):
    wavelengths longer than ``original_max_position_embeddings / low_freq_factor`` are
    stretched by ``factor``, shorter than ``... / high_freq_factor`` kept, and those
    between interpolated (transformers' ``_compute_llama3_parameters``)."""

    kind: Literal["llama3"] = "llama3"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def validate(self) -> None:
        if not (self.factor >= 1 and 0 < self.low_freq_factor < self.high_freq_factor):
            raise ConfigError(f"{section_name(self)}: needs factor >= 1 and 0 < low_freq_factor "
                              "< high_freq_factor")
        positive(self, "original_max_position_embeddings")


# The open families the decoder computes exactly: each is the Llama block with options.
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass
class ModelConfig:
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: int | None = None  # grouped-query attention; None = n_head
    n_embd: int = 256
    seq_len: int = 256
    # SwiGLU hidden size: 8/3 * n_embd rounded up to a multiple of this.
    ffn_multiple_of: int = 64
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    dropout: float = 0.0
    # Stop attention at document boundaries (needs the shard document index).
    doc_mask: bool = False
    # Which Hugging Face class the model exports as (an imported model keeps its own).
    family: Literal["llama", "mistral", "qwen2", "qwen3"] = "llama"
    # Width of one attention head; null = n_embd / n_head (Qwen3 sets its own).
    head_dim: int | None = None
    # Biases on the query, key and value projections (Qwen2).
    qkv_bias: bool = False
    # RMSNorm over each query and key head before RoPE (Qwen3).
    qk_norm: bool = False
    # Llama 3.1 RoPE scaling; null = plain RoPE.
    rope_scaling: RopeScalingConfig | None = None
    # Attention and MLP output projections (wo, w2) start at zero, so each block starts
    # as the identity on the residual stream (the modded-nanogpt speedrun's init). An
    # init only: the model exports as before.
    zero_init_proj: bool = False

    def head_size(self) -> int:
        """Width of one attention head (``head_dim``, or n_embd / n_head)."""
        return self.head_dim or self.n_embd // self.n_head

    def validate(self) -> None:
        positive(self, "n_layer", "n_head", "n_embd", "seq_len", "ffn_multiple_of")
        if self.head_dim is None and self.n_embd % self.n_head:
            raise ConfigError(
                f"{key(self, 'n_embd')}: {self.n_embd} is not divisible by "
                f"{key(self, 'n_head')}={self.n_head}"
            )
        head_dim = self.head_size()
        if head_dim % 2 or head_dim < 2:
            given = (key(self, "head_dim") if self.head_dim
                     else f"{key(self, 'n_embd')}/{key(self, 'n_head')}")
            raise ConfigError(
                f"{given}: head_dim {head_dim} is odd; RoPE rotates pairs of dimensions, so "
                "it must be even"
            )
        check_child(self, "rope_scaling")
        kv = self.n_kv_head or self.n_head
        if self.n_head % kv:
            raise ConfigError(
                f"{key(self, 'n_kv_head')}: {kv} must divide {key(self, 'n_head')}={self.n_head}"
            )
        below_one(self, "dropout")
        if not self.rope_base > 1:
            raise ConfigError(f"{key(self, 'rope_base')}: {self.rope_base} must be > 1")
        positive(self, "norm_eps")


@dataclass
class LoraConfig:
    """Low-rank adapters (lmforge.model.lora): the base is frozen, only adapters train."""

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    # Layer names (wq wk wv wo w1 w2 w3 lm_head) or groups (attn, mlp).
    targets: list[str] = field(default_factory=lambda: ["attn", "mlp"])
    # The dtype the frozen base is held in (model/frozen.py): auto = bf16 on a GPU (fp16
    # without bf16), fp32 on a CPU; adapters and their optimizer state stay fp32.
    # nf4 (QLoRA): the blocks' Linear weights in torchao NF4, the rest as auto holds it
    # (pip install 'lmforge[qlora]'; not with strategy: fsdp).
    base_dtype: Literal["auto", "fp32", "bf16", "fp16", "nf4"] = "auto"

    def validate(self) -> None:
        positive(self, "rank", "alpha")
        below_one(self, "dropout")
        if not self.targets:
            raise ConfigError(f"{key(self, 'targets')}: name at least one layer or group")
