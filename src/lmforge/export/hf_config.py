"""Our model config <-> a Hugging Face ``config.json`` (Llama, Mistral, Qwen2, Qwen3),
refusing what we cannot compute exactly.

Every family is our Llama block with options: Qwen2 adds q/k/v biases, Qwen3 an RMSNorm
on each query and key head (and a head width of its own), Llama 3.1 scales RoPE's
frequencies; Mistral is the Llama block whose sliding window does not matter while the
context is no longer than it. ``ModelConfig.family`` records which class a model exports
as, so a fine-tuned Qwen2 goes back out as ``Qwen2ForCausalLM``. A checkpoint with a
feature we do not implement is refused in one line naming the ``config.json`` key.
"""

from __future__ import annotations

import math
from typing import Any

from lmforge.config import FAMILIES, ModelConfig, RopeScalingConfig
from lmforge.errors import ConfigError, InputError
from lmforge.model.llama import ffn_hidden_size

# Preferred SwiGLU rounding multiples, tried before falling back to the width itself.
_MULTIPLES = (256, 128, 64, 32, 16, 8)
CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
           "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# (q/k/v biases, q/k norm): what each family's attention has, always.
OPTIONS = {"llama": (False, False), "mistral": (False, False), "qwen2": (True, False),
           "qwen3": (False, True)}
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor",
                "original_max_position_embeddings")


def to_hf_config(cfg: ModelConfig, vocab_size: int, special: dict[str, int],
                 dtype: str = "float32") -> dict[str, Any]:
    """The ``config.json`` of the ``cfg.family`` class equivalent to ``cfg``.

    Writes both the transformers 4 keys (``rope_theta``, ``rope_scaling``,
    ``torch_dtype``) and the 5 ones (``rope_parameters``, ``dtype``), so either major
    version reads it. A model whose options its family lacks is refused (no class
    would compute it).
    """
    _check_family_options(cfg)
    rope, legacy_scaling = _rope_keys(cfg)
    config = {
        "architectures": [CLASSES[cfg.family]],
        "model_type": cfg.family,
        "vocab_size": vocab_size,
        "hidden_size": cfg.n_embd,
        "intermediate_size": ffn_hidden_size(cfg),
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.n_kv_head or cfg.n_head,
        "head_dim": cfg.head_size(),
        "hidden_act": "silu",
        "max_position_embeddings": cfg.seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_base,
        "rope_scaling": legacy_scaling,
        "rope_parameters": rope,
        "attention_dropout": 0.0,
        "tie_word_embeddings": cfg.tie_embeddings,
        "bos_token_id": _token_id(special.get("bos")),
        "eos_token_id": _token_id(special.get("eos")),
        "pad_token_id": _token_id(special.get("pad")),
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": dtype,
        "dtype": dtype,
    }
    config.update(_family_keys(cfg))
    return config


def _check_family_options(cfg: ModelConfig) -> None:
    bias, norm = OPTIONS[cfg.family]
    if cfg.qkv_bias != bias:
        raise InputError(f"model.qkv_bias: {cfg.qkv_bias} has no place in "
                         f"{CLASSES[cfg.family]} (q/k/v biases are Qwen2's: model.family qwen2)")
    if cfg.qk_norm != norm:
        raise InputError(f"model.qk_norm: {cfg.qk_norm} has no place in "
                         f"{CLASSES[cfg.family]} (q/k norms are Qwen3's: model.family qwen3)")


def _rope_keys(cfg: ModelConfig) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(``rope_parameters``, the legacy ``rope_scaling``) for ``cfg``."""
    if cfg.rope_scaling is None:
        return {"rope_type": "default", "rope_theta": cfg.rope_base}, None
    s = cfg.rope_scaling
    scaling = {"rope_type": s.kind, **{k: getattr(s, k) for k in _LLAMA3_KEYS}}
    return {**scaling, "rope_theta": cfg.rope_base}, scaling


def _family_keys(cfg: ModelConfig) -> dict[str, Any]:
    """The keys one family's config class reads besides the shared ones: sliding windows
    off (we attend to the whole context), biases as the family has them."""
    if cfg.family == "llama":
        return {"attention_bias": False, "mlp_bias": False}
    if cfg.family == "mistral":
        return {"sliding_window": None}
    keys = {"use_sliding_window": False, "sliding_window": None,
            "max_window_layers": cfg.n_layer, "layer_types": ["full_attention"] * cfg.n_layer}
    if cfg.family == "qwen3":
        keys["attention_bias"] = False
    return keys


def _token_id(value: int | None) -> int | None:
    """sentencepiece says -1 for "none"; Hugging Face says null."""
    return value if value is not None and value >= 0 else None


def from_hf_config(hf: dict[str, Any], where: str, seq_len: int | None = None
                   ) -> tuple[ModelConfig, int]:
    """(ModelConfig, vocab_size) for a ``config.json``; ``InputError`` for what we lack.

    ``seq_len`` overrides ``max_position_embeddings`` (RoPE needs no retraining to run
    shorter, and the tables of a 128k-context model are large).
    """
    def need(key: str) -> Any:
        if key not in hf:
            raise InputError(f"{where}: missing '{key}'")
        return hf[key]

    family = _family(hf, where)
    n_embd, n_head = int(need("hidden_size")), int(need("num_attention_heads"))
    n_kv = int(hf.get("num_key_value_heads") or n_head)
    head_dim = hf.get("head_dim")
    context = int(seq_len or need("max_position_embeddings"))
    _refuse_unsupported(hf, family, where, context)
    bias, norm = OPTIONS[family]
    cfg = ModelConfig(
        n_layer=int(need("num_hidden_layers")),
        n_head=n_head,
        n_kv_head=None if n_kv == n_head else n_kv,
        n_embd=n_embd,
        seq_len=context,
        ffn_multiple_of=ffn_multiple_for(n_embd, int(need("intermediate_size")), where),
        rope_base=_rope_theta(hf),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        family=family,
        head_dim=(int(head_dim) if head_dim is not None and int(head_dim) * n_head != n_embd
                  else None),
        qkv_bias=bias,
        qk_norm=norm,
        rope_scaling=_rope_scaling(hf, where),
    )
    try:
        cfg.validate()
    except ConfigError as e:
        raise InputError(f"{where}: {e}") from None
    return cfg, int(need("vocab_size"))


def _family(hf: dict[str, Any], where: str) -> str:
    model_type = hf.get("model_type", "llama")
    if model_type not in FAMILIES:
        raise InputError(f"{where}: model_type '{model_type}' is not supported (lmforge "
                         f"computes {', '.join(FAMILIES)})")
    return model_type


def _rope(hf: dict[str, Any]) -> dict[str, Any]:
    """The RoPE settings in either layout: transformers 5's ``rope_parameters``, or 4's
    ``rope_scaling`` beside ``rope_theta`` (a file with both: the scaling it names)."""
    rope = {"rope_theta": hf.get("rope_theta", 10000.0)}
    if isinstance(hf.get("rope_parameters"), dict):
        rope.update(hf["rope_parameters"])
    if isinstance(hf.get("rope_scaling"), dict):
        rope.update(hf["rope_scaling"])
    return rope


def _rope_theta(hf: dict[str, Any]) -> float:
    return float(_rope(hf).get("rope_theta", hf.get("rope_theta", 10000.0)))


def _rope_scaling(hf: dict[str, Any], where: str) -> RopeScalingConfig | None:
    """Llama 3.1 scaling as our config; None for plain RoPE; refused otherwise."""
    rope = _rope(hf)
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return None
    if kind != "llama3":
        raise InputError(f"{where}: rope_scaling.rope_type '{kind}' is not supported "
                         "(plain RoPE and llama3 are)")
    missing = [k for k in _LLAMA3_KEYS if k not in rope]
    if missing:
        raise InputError(f"{where}: rope_scaling (llama3) lacks {', '.join(missing)}")
    return RopeScalingConfig(
        factor=float(rope["factor"]), low_freq_factor=float(rope["low_freq_factor"]),
        high_freq_factor=float(rope["high_freq_factor"]),
        original_max_position_embeddings=int(rope["original_max_position_embeddings"]))


def _refuse_unsupported(hf: dict[str, Any], family: str, where: str, context: int) -> None:
    """One clear line for each feature of the checkpoint our decoder does not implement."""
    if hf.get("attention_bias"):
        raise InputError(f"{where}: attention_bias=true is not supported (a bias on the "
                         "output projection too; lmforge has q/k/v biases only, as Qwen2)")
    if hf.get("mlp_bias"):
        raise InputError(f"{where}: mlp_bias=true is not supported (lmforge's MLP has no "
                         "biases)")
    act = hf.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise InputError(f"{where}: hidden_act '{act}' is not supported (only silu)")
    partial = _rope(hf).get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if float(partial) != 1.0:
        raise InputError(f"{where}: partial_rotary_factor is not supported (RoPE on the "
                         "whole head)")
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        if hf.get(key):
            raise InputError(f"{where}: {key}={hf[key]}: mixture-of-experts models are not "
                             "supported")
    _refuse_short_window(hf, family, where, context)


def _refuse_short_window(hf: dict[str, Any], family: str, where: str, context: int) -> None:
    """A sliding window shorter than the context changes what attention sees: refused
    (a window at least as long as the context is full attention, which we compute)."""
    window = hf.get("sliding_window")
    if hf.get("layer_types"):  # transformers 5 names each layer's attention
        used = "sliding_attention" in hf["layer_types"]
    elif family in ("qwen2", "qwen3"):
        used = bool(hf.get("use_sliding_window", False))
    else:
        used = family == "mistral"
    if used and window is not None and int(window) < context:
        raise InputError(f"{where}: sliding_window {window} is shorter than the context "
                         f"({context}); lmforge attends to the whole context: import with "
                         f"--seq-len {window} or less")


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
