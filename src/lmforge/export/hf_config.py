"""Our model config <-> a Hugging Face ``LlamaConfig`` dict, refusing what we cannot run."""

from __future__ import annotations

import math
from typing import Any

from lmforge.config import ModelConfig
from lmforge.errors import ConfigError, InputError
from lmforge.model.llama import ffn_hidden_size

# Preferred SwiGLU rounding multiples, tried before falling back to the width itself.
_MULTIPLES = (256, 128, 64, 32, 16, 8)


def to_hf_config(cfg: ModelConfig, vocab_size: int, special: dict[str, int],
                 dtype: str = "float32") -> dict[str, Any]:
    """The ``config.json`` of a ``LlamaForCausalLM`` equivalent to ``cfg``.

    Writes both the transformers 4 keys (``rope_theta``, ``torch_dtype``) and the 5 ones
    (``rope_parameters``, ``dtype``), so either major version reads it.
    """
    head_dim = cfg.n_embd // cfg.n_head
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": cfg.n_embd,
        "intermediate_size": ffn_hidden_size(cfg),
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.n_kv_head or cfg.n_head,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_base,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_base},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": cfg.tie_embeddings,
        "bos_token_id": _token_id(special.get("bos")),
        "eos_token_id": _token_id(special.get("eos")),
        "pad_token_id": _token_id(special.get("pad")),
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": dtype,
        "dtype": dtype,
    }


def _token_id(value: int | None) -> int | None:
    """sentencepiece says -1 for "none"; Hugging Face says null."""
    return value if value is not None and value >= 0 else None


def from_hf_config(hf: dict[str, Any], where: str, seq_len: int | None = None
                   ) -> tuple[ModelConfig, int]:
    """(ModelConfig, vocab_size) for a Llama ``config.json``; ``InputError`` for what we lack.

    ``seq_len`` overrides ``max_position_embeddings`` (RoPE needs no retraining to run
    shorter, and the tables of a 128k-context model are large).
    """
    def need(key: str) -> Any:
        if key not in hf:
            raise InputError(f"{where}: missing '{key}'")
        return hf[key]

    _refuse_unsupported(hf, where)
    n_embd, n_head = int(need("hidden_size")), int(need("num_attention_heads"))
    n_kv = int(hf.get("num_key_value_heads") or n_head)
    head_dim = hf.get("head_dim")
    if head_dim is not None and n_head * int(head_dim) != n_embd:
        raise InputError(f"{where}: head_dim {head_dim} x {n_head} heads != hidden_size "
                         f"{n_embd}; lmforge derives head_dim as hidden_size / heads")
    rope = hf.get("rope_parameters") or {}
    cfg = ModelConfig(
        n_layer=int(need("num_hidden_layers")),
        n_head=n_head,
        n_kv_head=None if n_kv == n_head else n_kv,
        n_embd=n_embd,
        seq_len=int(seq_len or need("max_position_embeddings")),
        ffn_multiple_of=ffn_multiple_for(n_embd, int(need("intermediate_size")), where),
        rope_base=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )
    try:
        cfg.validate()
    except ConfigError as e:
        raise InputError(f"{where}: {e}") from None
    return cfg, int(need("vocab_size"))


def _refuse_unsupported(hf: dict[str, Any], where: str) -> None:
    """One clear line for each feature of the checkpoint our Llama does not implement."""
    model_type = hf.get("model_type", "llama")
    if model_type != "llama":
        raise InputError(f"{where}: model_type '{model_type}' is not supported (only 'llama')")
    rope = hf.get("rope_parameters") or {}
    if hf.get("rope_scaling") or rope.get("rope_type", "default") != "default":
        kind = (hf.get("rope_scaling") or rope).get("rope_type") or "rope_scaling"
        raise InputError(f"{where}: RoPE scaling ('{kind}') is not supported")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise InputError(f"{where}: {key}=true is not supported (lmforge has no biases)")
    act = hf.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise InputError(f"{where}: hidden_act '{act}' is not supported (only silu)")
    if hf.get("sliding_window"):
        raise InputError(f"{where}: sliding-window attention is not supported")


def ffn_multiple_for(n_embd: int, intermediate: int, where: str) -> int:
    """An ``ffn_multiple_of`` for which our SwiGLU width equals ``intermediate``.

    Our width is ceil(8/3 d) rounded up to a multiple, so any width >= ceil(8/3 d) is
    reachable (with the width itself as the multiple, if nothing rounder fits).
    """
    base = math.ceil(8 * n_embd / 3)
    if intermediate < base:
        raise InputError(f"{where}: intermediate_size {intermediate} is below 8/3 x hidden_size "
                         f"({base}); lmforge's SwiGLU width cannot be that small")
    for m in (*_MULTIPLES, intermediate):
        if m * math.ceil(base / m) == intermediate:
            return m
    raise AssertionError("unreachable: the width itself always fits")
