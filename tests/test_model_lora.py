"""LoRA adapters: identity at init, frozen base, merge, adapter save/load, errors, counts."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lmforge.config import ModelConfig, TrainConfig
from lmforge.errors import ConfigError, InputError
from lmforge.model import Llama, load_model, save_model
from lmforge.model.lora import (
    ADAPTER_CONFIG,
    LoRALinear,
    adamw_state_bytes,
    apply_lora,
    load_adapter,
    lora_modules,
    lora_param_count_formula,
    lora_state_dict,
    merge_lora,
    save_adapter,
    trainable_parameters,
)
from lmforge.train.optim import build_optimizer

VOCAB = 300
ALL = ["attn", "mlp"]


def cfg(**kw) -> ModelConfig:
    base = dict(n_layer=2, n_head=4, n_kv_head=2, n_embd=64, seq_len=32, ffn_multiple_of=16)
    base.update(kw)
    return ModelConfig(**base)


def base_model(seed: int = 0, **kw) -> Llama:
    torch.manual_seed(seed)
    return Llama(cfg(**kw), VOCAB).eval()


def batch(seed: int = 1, B: int = 2, T: int = 24) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, VOCAB, (B, T), generator=g),
            torch.randint(0, VOCAB, (B, T), generator=g))


def randomize_b(model: nn.Module, seed: int = 5) -> None:
    """Give every adapter a non-zero B so it changes the output."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in lora_modules(model).values():
            m.lora_b.copy_(torch.randn(m.lora_b.shape, generator=g) * 0.05)


def train_steps(model: Llama, steps: int = 3) -> None:
    opt = build_optimizer(model, TrainConfig(max_lr=1e-2), torch.device("cpu"))
    model.train()
    for i in range(steps):
        idx, tgt = batch(seed=10 + i)
        _, loss = model(idx, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    model.eval()


def test_adapted_model_equals_base_at_init():
    model = base_model()
    idx, _ = batch()
    with torch.no_grad():
        before = model(idx)
    names = apply_lora(model, rank=4, alpha=8, dropout=0.0, targets=ALL)
    assert len(names) == 2 * 7 and "layers.0.attn.wq" in names and "layers.1.mlp.w2" in names
    for m in lora_modules(model).values():
        assert torch.count_nonzero(m.lora_b) == 0 and torch.count_nonzero(m.lora_a) > 0
        bound = 1 / m.in_features ** 0.5  # kaiming_uniform(a=sqrt(5)) = U(-1/sqrt(in), ...)
        assert m.lora_a.abs().max() <= bound
    with torch.no_grad():
        assert torch.equal(model(idx), before)


def test_training_moves_only_the_adapters():
    model = base_model()
    apply_lora(model, rank=4, alpha=8, dropout=0.0, targets=ALL)
    lora_params = {n for n, _ in model.named_parameters() if ".lora_" in n}
    frozen = {n: p.detach().clone() for n, p in model.named_parameters()
              if n not in lora_params}
    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if n in lora_params}
    assert frozen and adapters
    train_steps(model)
    params = dict(model.named_parameters())
    for n, before in frozen.items():
        assert not params[n].requires_grad, n
        assert params[n].grad is None, n
        assert torch.equal(params[n], before), n
    for n, before in adapters.items():  # every adapter trained, q/k/v and w1/w3 included
        if n.endswith("lora_b"):
            assert not torch.equal(params[n], before), n
    opt_params = {id(p) for g in build_optimizer(model, TrainConfig(), torch.device("cpu"))
                  .param_groups for p in g["params"]}
    assert opt_params == {id(params[n]) for n in lora_params}


def test_merged_model_matches_adapted_and_is_a_plain_llama():
    model = base_model()
    base_keys = list(model.state_dict())
    apply_lora(model, rank=4, alpha=16, dropout=0.0, targets=ALL)
    train_steps(model, steps=2)
    randomize_b(model)
    idx, _ = batch()
    with torch.no_grad():
        adapted = model(idx)
        base_out = base_model()(idx)
    assert not torch.allclose(adapted, base_out, atol=1e-3)  # the adapters do something
    merged = merge_lora(model)
    assert not lora_modules(merged)
    assert all(type(m) is not LoRALinear for m in merged.modules())
    assert list(merged.state_dict()) == base_keys
    assert merged.lm_head.weight is merged.tok_embeddings.weight  # still tied
    with torch.no_grad():
        torch.testing.assert_close(merged(idx), adapted, atol=1e-5, rtol=0)


def test_merged_model_saves_and_loads_as_plain_model(tmp_path):
    model = base_model()
    apply_lora(model, rank=2, alpha=4, dropout=0.0, targets=["wq", "wv", "w2"])
    randomize_b(model)
    idx, _ = batch()
    with torch.no_grad():
        adapted = model(idx)
    save_model(merge_lora(model), tmp_path / "final")
    loaded, _ = load_model(tmp_path / "final")
    with torch.no_grad():
        torch.testing.assert_close(loaded(idx), adapted, atol=1e-5, rtol=0)


def test_untied_head_target_fused_loss_and_logits_agree():
    model = base_model(tie_embeddings=False)
    apply_lora(model, rank=4, alpha=8, dropout=0.0, targets=["lm_head", "wo"])
    randomize_b(model)
    idx, tgt = batch()
    with torch.no_grad():
        _, fused = model(idx, tgt)  # reads lm_head.weight: the effective weight
        model.fused_loss = False
        logits, plain = model(idx, tgt)  # calls lm_head: base(x) + delta(x)
        model.fused_loss = True
        base_logits = base_model(tie_embeddings=False)(idx)
    assert not torch.allclose(logits, base_logits, atol=1e-3)
    torch.testing.assert_close(fused, plain, atol=1e-5, rtol=1e-5)


def test_adapter_round_trips_into_a_fresh_base(tmp_path):
    model = base_model()
    apply_lora(model, rank=4, alpha=8, dropout=0.0, targets=ALL)
    train_steps(model, steps=2)
    randomize_b(model)
    idx, _ = batch()
    with torch.no_grad():
        adapted = model(idx)
    save_adapter(model, tmp_path / "adapter", {"base_model_sha256": "ab" * 32})
    files = sorted(p.name for p in (tmp_path / "adapter").iterdir())
    assert files == ["adapter.json", "adapter.safetensors"]
    fresh = base_model()  # same seed -> same base weights
    names = load_adapter(fresh, tmp_path / "adapter", base_model_sha256="ab" * 32)
    assert names == sorted(lora_modules(model))
    assert lora_state_dict(fresh).keys() == lora_state_dict(model).keys()
    with torch.no_grad():
        assert torch.equal(fresh(idx), adapted)
    with pytest.raises(InputError, match="trained on base model"):
        load_adapter(base_model(), tmp_path / "adapter", base_model_sha256="cd" * 32)


def test_adapter_json_holds_the_settings(tmp_path):
    import json

    model = base_model()
    apply_lora(model, rank=3, alpha=6, dropout=0.1, targets=["wo", "w2"])
    save_adapter(model, tmp_path / "a")
    meta = json.loads((tmp_path / "a" / ADAPTER_CONFIG).read_text())
    assert (meta["rank"], meta["alpha"], meta["dropout"], meta["targets"]) == \
        (3, 6, 0.1, ["wo", "w2"])
    assert "base_model_sha256" not in meta


@pytest.mark.parametrize("kwargs,match", [
    (dict(targets=["wq", "q_proj"]), "unknown target 'q_proj'"),
    (dict(targets=[]), "at least one"),
    (dict(rank=0), "rank"),
    (dict(alpha=0), "alpha"),
    (dict(targets=["lm_head"]), "tied"),
])
def test_bad_settings_are_one_line_config_errors(kwargs, match):
    model = base_model()
    args = dict(rank=4, alpha=8, dropout=0.0, targets=ALL) | kwargs
    with pytest.raises(ConfigError, match=match) as e:
        apply_lora(model, **args)
    assert "\n" not in str(e.value)
    assert not lora_modules(model) and all(p.requires_grad for p in model.parameters())


def test_target_matching_nothing_and_double_apply_are_errors():
    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.wo = nn.Linear(8, 8, bias=False)

    with pytest.raises(ConfigError, match="wq match no"):
        apply_lora(Tiny(), 2, 4, 0.0, ["wq", "wo"])
    model = base_model()
    apply_lora(model, 2, 4, 0.0, ["wo"])
    with pytest.raises(ConfigError, match="already has LoRA"):
        apply_lora(model, 2, 4, 0.0, ["wq"])


def test_fused_projections_use_the_adapter_path_not_the_effective_weight(monkeypatch):
    """q/k/v and gate/up run one GEMM on the frozen weights plus each adapter's r-wide
    path: no full-size weight product, and adapter dropout applies there too."""
    model = base_model()
    apply_lora(model, rank=4, alpha=8, dropout=0.5, targets=["wq", "wv", "w1", "w3"])
    randomize_b(model)

    def no_weight(self):
        raise AssertionError("the effective weight was built")

    monkeypatch.setattr(LoRALinear, "weight", property(no_weight))
    idx, tgt = batch()
    model.train()
    torch.manual_seed(0)
    a = model(idx)
    torch.manual_seed(1)
    assert not torch.allclose(a, model(idx))  # dropout on the adapter path
    model.eval()
    _, loss = model(idx, tgt)
    loss.backward()
    assert all(m.base.weight.grad is None for m in lora_modules(model).values())


def test_dropout_on_a_head_read_as_a_weight_is_refused():
    model = base_model(tie_embeddings=False)
    with pytest.raises(ConfigError, match="dropout"):
        apply_lora(model, rank=4, alpha=8, dropout=0.1, targets=["lm_head"])


def test_dropout_applies_on_the_adapter_path_only():
    model = base_model()
    apply_lora(model, rank=4, alpha=8, dropout=0.5, targets=["wo", "w2"])
    idx, _ = batch()
    model.train()
    with torch.no_grad():  # B = 0: the adapter adds nothing, dropout or not
        base_train = base_model().train()
        assert torch.equal(model(idx), base_train(idx))
        randomize_b(model)
        torch.manual_seed(0)
        a = model(idx)
        torch.manual_seed(1)
        b = model(idx)
        assert not torch.allclose(a, b)
        model.eval()
        assert torch.equal(model(idx), model(idx))


def test_trainable_count_matches_the_formula():
    c = cfg(tie_embeddings=False)
    model = base_model(tie_embeddings=False)
    full = trainable_parameters(model)
    assert full == model.num_params()
    targets = ["attn", "w2", "lm_head"]
    names = apply_lora(model, rank=8, alpha=16, dropout=0.0, targets=targets)
    by_hand = sum(8 * (model.get_submodule(n).in_features + model.get_submodule(n).out_features)
                  for n in names)
    assert trainable_parameters(model) == by_hand
    assert by_hand == lora_param_count_formula(c, VOCAB, 8, targets)
    assert adamw_state_bytes(by_hand) == 8 * by_hand
    assert adamw_state_bytes(by_hand) < adamw_state_bytes(full)


def test_autocast_bf16_forward_and_backward():
    model = base_model()
    apply_lora(model, rank=4, alpha=8, dropout=0.0, targets=["wq", "wo", "w1", "w2"])
    randomize_b(model)
    idx, tgt = batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, loss = model(idx, tgt)
        out = lora_modules(model)["layers.0.attn.wo"](torch.randn(2, 3, 64))
    assert out.dtype == torch.bfloat16
    loss.backward()
    for m in lora_modules(model).values():
        assert m.lora_a.grad is not None and m.lora_a.grad.dtype == torch.float32
        assert m.base.weight.grad is None


def test_merge_keeps_a_deepcopy_trainable():
    model = base_model()
    apply_lora(model, rank=2, alpha=2, dropout=0.0, targets=["wo"])
    merged = merge_lora(copy.deepcopy(model))
    assert lora_modules(model) and not lora_modules(merged)


def test_lora_linear_matches_the_formula():
    torch.manual_seed(0)
    lin = nn.Linear(12, 10, bias=True)
    lora = LoRALinear(lin, rank=3, alpha=12, dropout=0.5)
    assert lora.scaling == 4.0
    with torch.no_grad():
        lora.lora_b.normal_()
    A, B, W, b = lora.lora_a, lora.lora_b, lin.weight, lin.bias
    x = torch.randn(5, 12)
    with torch.no_grad():
        lora.eval()
        torch.testing.assert_close(lora(x), x @ W.T + b + 4.0 * (x @ A.T @ B.T))
        torch.testing.assert_close(lora.merged_weight(), W + 4.0 * B @ A)
        torch.testing.assert_close(lora.weight, W + 4.0 * B @ A)
        lora.train()  # dropout on x, adapter path only: same mask as dropping a ones tensor
        torch.manual_seed(7)
        out = lora(x)
        torch.manual_seed(7)
        mask = nn.functional.dropout(torch.ones_like(x), 0.5, training=True)
        torch.testing.assert_close(out, x @ W.T + b + 4.0 * ((x * mask) @ A.T @ B.T))
