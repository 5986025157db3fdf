"""Learning-rate schedules, weight-decay groups and precision resolution."""

from __future__ import annotations

import pytest
import torch

from lmforge.config import ModelConfig, TrainConfig
from lmforge.errors import ConfigError
from lmforge.model import Llama
from lmforge.train.optim import build_optimizer, param_groups
from lmforge.train.precision import resolve_precision
from lmforge.train.schedule import lr_at


def lrs(**kw) -> list[float]:
    cfg = TrainConfig(**kw)
    return [lr_at(s, cfg) for s in range(cfg.max_steps)]


@pytest.mark.parametrize("schedule", ["cosine", "linear", "wsd"])
def test_warmup_peak_and_floor(schedule):
    cfg = dict(max_steps=200, warmup=20, max_lr=3e-3, min_lr_ratio=0.1, schedule=schedule)
    curve = lrs(**cfg)
    warm = curve[:20]
    assert all(b > a for a, b in zip(warm, warm[1:], strict=False))  # strictly rising
    assert warm[0] == pytest.approx(3e-3 / 20)
    assert max(curve) == pytest.approx(3e-3) and curve[19] == pytest.approx(3e-3)
    decay = curve[20:]
    assert all(b <= a + 1e-15 for a, b in zip(decay, decay[1:], strict=False))  # never rises
    assert curve[-1] == pytest.approx(3e-4)  # the floor, reached on the last step
    assert min(decay) >= 3e-4 - 1e-12


def test_cosine_midpoint_and_wsd_plateau():
    cos = lrs(max_steps=101, warmup=0, max_lr=1.0, min_lr_ratio=0.0)
    assert cos[50] == pytest.approx(0.5)  # halfway down the cosine
    wsd = lrs(max_steps=100, warmup=10, max_lr=1.0, min_lr_ratio=0.0, schedule="wsd",
              decay_fraction=0.2)
    assert all(v == 1.0 for v in wsd[9:79]) and wsd[85] < 1.0


def test_warmup_as_fraction():
    cfg = TrainConfig(max_steps=400, warmup=0.05)
    assert cfg.warmup_steps() == 20
    assert lr_at(19, cfg) == pytest.approx(cfg.max_lr) and lr_at(9, cfg) < cfg.max_lr


def test_weight_decay_only_on_matrices_not_embeddings():
    cfg = ModelConfig(n_layer=2, n_head=2, n_embd=16, seq_len=8, tie_embeddings=False)
    model = Llama(cfg, 50)
    decay, no_decay = param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    plain = {names[id(p)] for p in no_decay["params"]}
    assert "tok_embeddings.weight" in plain and "lm_head.weight" in decayed
    assert all(n.endswith("norm.weight") or n == "tok_embeddings.weight" for n in plain)
    assert all(p.dim() >= 2 for p in decay["params"]) and decay["weight_decay"] == 0.1
    assert no_decay["weight_decay"] == 0.0
    assert len(decayed | plain) == len(list(model.parameters()))
    with_emb, _ = param_groups(model, 0.1, decay_embeddings=True)
    assert any(p is model.tok_embeddings.weight for p in with_emb["params"])
    opt = build_optimizer(model, TrainConfig(weight_decay=0.05), torch.device("cpu"))
    assert [g["weight_decay"] for g in opt.param_groups] == [0.05, 0.0]


def test_tied_head_follows_the_embedding():
    model = Llama(ModelConfig(n_layer=1, n_head=2, n_embd=16, seq_len=8), 50)
    decay, no_decay = param_groups(model, 0.1)
    assert any(p is model.tok_embeddings.weight for p in no_decay["params"])
    assert sum(len(g["params"]) for g in (decay, no_decay)) == len(list(model.parameters()))


def test_precision_resolution_on_cpu():
    cpu = torch.device("cpu")
    assert resolve_precision("auto", cpu).name == "fp32"
    bf16 = resolve_precision("bf16", cpu)
    assert bf16.autocast_dtype == torch.bfloat16
    with bf16.autocast():
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16
    assert not resolve_precision("fp32", cpu).grad_scaler().is_enabled()
    with pytest.raises(ConfigError, match="fp16 needs a CUDA"):
        resolve_precision("fp16", cpu)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_precision_auto_on_gpu():
    p = resolve_precision("auto", torch.device("cuda"))
    assert p.name == ("bf16" if torch.cuda.is_bf16_supported() else "fp16")
    assert p.grad_scaler().is_enabled() == (p.name == "fp16")


@pytest.mark.parametrize("schedule", ["cosine", "linear", "wsd"])
@pytest.mark.parametrize("warmup", [0, 0.05, 1])
def test_a_one_step_run_trains_at_the_peak(schedule, warmup):
    cfg = TrainConfig(max_steps=1, warmup=warmup, max_lr=3e-3, schedule=schedule)
    cfg.validate()
    assert lr_at(0, cfg) == pytest.approx(3e-3)


@pytest.mark.parametrize("schedule", ["cosine", "linear", "wsd"])
def test_the_longest_warmup_allowed_still_decays_on_the_last_step(schedule):
    cfg = TrainConfig(max_steps=10, warmup=9, max_lr=0.5, min_lr_ratio=0.1, schedule=schedule)
    cfg.validate()
    curve = [lr_at(s, cfg) for s in range(10)]
    assert curve[8] == pytest.approx(0.5) and curve[9] == pytest.approx(0.05)


@pytest.mark.parametrize("section", ["train", "sft"])
@pytest.mark.parametrize("warmup", [0.96, 10, 12])
def test_a_warmup_that_leaves_no_decay_step_is_refused(section, warmup):
    from lmforge.config import SftConfig

    cls = TrainConfig if section == "train" else SftConfig
    with pytest.raises(ConfigError, match=rf"^{section}\.warmup: .*leaves no step of "
                                          rf"{section}\.max_steps=10 to decay; .*at most 9"):
        cls(max_steps=10, warmup=warmup).validate()
    cls(max_steps=10, warmup=0.94).validate()  # rounds to 9: one decay step is left


def test_a_wsd_decay_too_short_to_round_to_a_step_still_ends_at_the_floor():
    cfg = TrainConfig(max_steps=10, warmup=2, max_lr=0.5, schedule="wsd", decay_fraction=0.01)
    curve = [lr_at(s, cfg) for s in range(10)]
    assert curve[8] == pytest.approx(0.5) and curve[9] == pytest.approx(0.05)
