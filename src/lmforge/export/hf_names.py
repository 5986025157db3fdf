"""Parameter names: lmforge's ``Llama`` <-> Hugging Face's Llama, Mistral, Qwen2 and Qwen3
(the same names in all four).

No q/k permutation is needed: our RoPE uses the rotate-half layout (dimension i pairs
with i + d/2), the same as Hugging Face's ``rotate_half``. (Meta's original checkpoints
pair 2i with 2i+1 and need the permutation; ours never did.)
"""

from __future__ import annotations

import re

import torch

# Per-layer suffixes: ours -> theirs (under "model.layers.N.").
_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.wq.weight": "self_attn.q_proj.weight",
    "attn.wk.weight": "self_attn.k_proj.weight",
    "attn.wv.weight": "self_attn.v_proj.weight",
    "attn.wo.weight": "self_attn.o_proj.weight",
    # Qwen2's q/k/v biases, Qwen3's per-head q/k norms.
    "attn.wq.bias": "self_attn.q_proj.bias",
    "attn.wk.bias": "self_attn.k_proj.bias",
    "attn.wv.bias": "self_attn.v_proj.bias",
    "attn.q_norm.weight": "self_attn.q_norm.weight",
    "attn.k_norm.weight": "self_attn.k_norm.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.w1.weight": "mlp.gate_proj.weight",
    "mlp.w3.weight": "mlp.up_proj.weight",
    "mlp.w2.weight": "mlp.down_proj.weight",
}
_TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}
_LAYER_BACK = {v: k for k, v in _LAYER.items()}
_TOP_BACK = {v: k for k, v in _TOP.items()}
_OURS = re.compile(r"layers\.(\d+)\.(.+)")
_THEIRS = re.compile(r"model\.layers\.(\d+)\.(.+)")
# Buffers some older checkpoints saved; derived from the config, safe to drop.
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


def hf_name(name: str) -> str:
    """Hugging Face name of one of our parameters (``KeyError`` if it has none)."""
    if name in _TOP:
        return _TOP[name]
    m = _OURS.fullmatch(name)
    if m is None or m.group(2) not in _LAYER:
        raise KeyError(name)
    return f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}"


def our_name(name: str) -> str | None:
    """Our name of a Hugging Face parameter; None for a buffer we rebuild; KeyError if unknown."""
    if name in _TOP_BACK:
        return _TOP_BACK[name]
    if _IGNORED.fullmatch(name):
        return None
    m = _THEIRS.fullmatch(name)
    if m is None or m.group(2) not in _LAYER_BACK:
        raise KeyError(name)
    return f"layers.{m.group(1)}.{_LAYER_BACK[m.group(2)]}"


def to_hf_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename a state dict of ours to Hugging Face names."""
    return {hf_name(k): v for k, v in state.items()}
