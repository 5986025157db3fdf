"""QK-norm (model.qk_norm, the Qwen3 layout) from scratch: logits against a forward pass
written out by hand, and a model trained here (with Muon and zero-initialised output
projections) exported as a Qwen3ForCausalLM that computes the same logits."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from lmforge.config import ModelConfig
from lmforge.model import Llama

VOCAB = 300


def rms(x: torch.Tensor, gain: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * gain


def rotate(x: torch.Tensor, pos: torch.Tensor, base: float) -> torch.Tensor:
    """RoPE on (B, T, heads, D), halves paired (the Llama / Hugging Face layout)."""
    d = x.shape[-1]
    inv = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = (pos[:, None].double() * inv[None]).float()  # (T, D/2)
    cos, sin = ang.cos()[None, :, None], ang.sin()[None, :, None]
    x1, x2 = x[..., :d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def reference_logits(model: Llama, ids: torch.Tensor) -> torch.Tensor:
    """One pre-norm block with per-head RMSNorm on q and k before RoPE, by hand."""
    cfg = model.config
    eps, H, KV, D = cfg.norm_eps, cfg.n_head, cfg.n_kv_head or cfg.n_head, cfg.head_size()
    (layer,) = model.layers
    a, m = layer.attn, layer.mlp
    B, T = ids.shape
    x = model.tok_embeddings.weight[ids]
    h = rms(x, layer.attn_norm.weight, eps)
    q = (h @ a.wq.weight.T).view(B, T, H, D)
    k = (h @ a.wk.weight.T).view(B, T, KV, D)
    v = (h @ a.wv.weight.T).view(B, T, KV, D)
    q, k = rms(q, a.q_norm.weight, eps), rms(k, a.k_norm.weight, eps)
    pos = torch.arange(T)
    q, k = rotate(q, pos, cfg.rope_base), rotate(k, pos, cfg.rope_base)
    k, v = k.repeat_interleave(H // KV, dim=2), v.repeat_interleave(H // KV, dim=2)
    scores = torch.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(D)
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    y = torch.einsum("bhij,bjhd->bihd", scores.softmax(-1), v).reshape(B, T, H * D)
    x = x + y @ a.wo.weight.T
    h = rms(x, layer.mlp_norm.weight, eps)
    x = x + (F.silu(h @ m.w1.weight.T) * (h @ m.w3.weight.T)) @ m.w2.weight.T
    return rms(x, model.norm.weight, eps) @ model.lm_head.weight.T


def test_qk_norm_logits_equal_a_hand_computed_reference():
    torch.manual_seed(0)
    cfg = ModelConfig(n_layer=1, n_head=4, n_kv_head=2, n_embd=64, seq_len=32,
                      family="qwen3", qk_norm=True, head_dim=32)
    model = Llama(cfg, VOCAB).eval()
    with torch.no_grad():  # every gain away from 1, so a missing or misplaced norm shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.5 * torch.randn_like(p))
    ids = torch.randint(0, VOCAB, (2, 20))
    with torch.no_grad():
        ours, ref = model(ids), reference_logits(model, ids)
        assert (ours - ref).abs().max() < 1e-4
        # The q/k norms bear on the logits: scaling q's gains changes them.
        model.layers[0].attn.q_norm.weight.mul_(2.0)
        assert (model(ids) - ours).abs().max() > 1e-3


def test_a_qk_norm_model_trained_from_scratch_exports_as_qwen3(tmp_path):
    transformers = pytest.importorskip("transformers")
    from test_train_loop import make_inputs, run, tiny_params

    from lmforge.export.hf import export_hf
    from lmforge.model.saved import save_model
    from lmforge.tokenizer.files import tokenizer_sha256

    paths = make_inputs(tmp_path / "repo")
    params = tiny_params(max_steps=4, eval_every=0, optimizer="muon")
    params.model.family, params.model.qk_norm, params.model.zero_init_proj = "qwen3", True, True
    result = run(params, paths, tmp_path / "ck")
    model = result.model.eval()
    assert model.layers[0].attn.wo.weight.abs().sum() > 0  # trained off its zero init
    save_model(model, tmp_path / "final", paths.tokenizer / "tokenizer.model",
               tokenizer_sha256=tokenizer_sha256(paths.tokenizer))
    export_hf(tmp_path / "final", tmp_path / "hf")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(theirs).__name__ == "Qwen3ForCausalLM"
    ids = torch.randint(0, VOCAB, (2, 24))
    with torch.no_grad():
        assert (theirs(ids).logits - model(ids)).abs().max() < 1e-4
