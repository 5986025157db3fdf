"""train.optimizer: muon -- torch.optim.Muon on the blocks' matrices, AdamW on the rest.

The Muon step is checked against an independent computation: Newton-Schulz is a
polynomial in G G^T, so on G = U diag(s) V^T it is U diag(p(s / |G|_F)) V^T with p the
scalar quintic iterated five times; the update, momentum and shape scaling are written
out here from the papers' formulas, not from torch's code.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
import yaml
from test_train_loop import inputs, run, stage_repo, start_ranks, tiny_params, wait_ranks

from lmforge.config import ModelConfig, TrainConfig
from lmforge.errors import ConfigError
from lmforge.model import Llama
from lmforge.model import llama as llama_module
from lmforge.model.lora import apply_lora
from lmforge.shards import ShardSet, WindowLoader
from lmforge.train import checkpoint as ckpt
from lmforge.train import runs
from lmforge.train.distributed import DistEnv
from lmforge.train.optim import (
    CompositeOptimizer,
    build_optimizer,
    muon_parameters,
    set_learning_rates,
)
from lmforge.train.pipeline import TrainPaths
from lmforge.train.precision import resolve_precision
from lmforge.train.schedule import lr_at
from lmforge.train.step import optimizer_step

__all__ = ["inputs"]  # the module fixture, shared with test_train_loop

NS = (3.4445, -4.7750, 2.0315)  # Keller Jordan's quintic coefficients
CPU = torch.device("cpu")


def ns_reference(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Newton-Schulz of ``g`` through its SVD, in float64: U diag(p^steps(s/|g|)) V^T."""
    u, s, vh = torch.linalg.svd(g.double(), full_matrices=False)
    x = s / s.norm()
    a, b, c = NS
    for _ in range(steps):
        x = a * x + b * x**3 + c * x**5
    return u @ torch.diag(x) @ vh


def known_matrix(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """A matrix with chosen singular values spanning two decades."""
    gen = torch.Generator().manual_seed(seed)
    k = min(rows, cols)
    u, _ = torch.linalg.qr(torch.randn(rows, k, generator=gen, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(cols, k, generator=gen, dtype=torch.float64))
    s = torch.logspace(0, -2, k, dtype=torch.float64)
    return (u @ torch.diag(s) @ v.T).float()


@pytest.mark.parametrize("shape", [(48, 16), (16, 48), (32, 32)])
def test_newton_schulz_of_a_known_matrix_is_its_polynomial_on_the_singular_values(shape):
    from torch.optim._muon import _zeropower_via_newtonschulz

    g = known_matrix(*shape)
    ours = _zeropower_via_newtonschulz(g, NS, 5, 1e-7).double()
    ref = ns_reference(g)
    # bf16 arithmetic (torch's): agreement to a few bf16 ulps of entries ~ 1/sqrt(k).
    assert (ours - ref).abs().max() < 0.03
    # And it is near-orthogonal: singular values pulled from [0.01, 1] to about 1.
    sv = torch.linalg.svdvals(ours)
    assert sv.min() > 0.5 and sv.max() < 1.3


def tiny_model(**model_kw) -> Llama:
    torch.manual_seed(0)
    cfg = ModelConfig(n_layer=2, n_head=4, n_embd=64, seq_len=32, **model_kw)
    return Llama(cfg, 300)


def muon_cfg(**kw) -> TrainConfig:
    base = dict(max_steps=10, warmup=2, max_lr=3e-3, muon_lr=0.05, optimizer="muon",
                weight_decay=0.1, muon_weight_decay=0.2)
    base.update(kw)
    return TrainConfig(**base)


@pytest.mark.parametrize("adjust", ["original", "match_rms_adamw"])
def test_a_muon_step_equals_the_direct_computation(adjust):
    """Two steps (so momentum counts) on every group; Muon's matrices and AdamW's
    embedding compared with the formulas at each group's own scheduled rate."""
    model = tiny_model(tie_embeddings=False)
    cfg = muon_cfg(muon_adjust_lr=adjust)
    opt = build_optimizer(model, cfg, CPU)
    assert isinstance(opt, CompositeOptimizer)
    w = model.layers[0].mlp.w1.weight  # 192 x 64: tall, so the two scalings differ
    emb = model.tok_embeddings.weight
    w0, emb0 = w.detach().clone().double(), emb.detach().clone()
    gen = torch.Generator().manual_seed(3)
    grads = [torch.randn(w.shape, generator=gen) for _ in range(2)]
    mu, buf, expected = cfg.muon_momentum, torch.zeros_like(w0), w0.clone()
    for step, g in enumerate(grads):
        rates = set_learning_rates(opt, step, cfg)
        assert rates == {"lr": lr_at(step, cfg), "lr_muon": lr_at(step, cfg, cfg.muon_lr)}
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen)
        w.grad = grads[step].clone()
        emb_grad = emb.grad.clone()
        opt.step()
        # Muon: momentum as an EMA, Nesterov look-ahead, orthogonalise, decay, scale.
        lr = lr_at(step, cfg, cfg.muon_lr)
        buf = mu * buf + (1 - mu) * g.double()
        update = ns_reference((1 - mu) * g.double() + mu * buf)
        rows, cols = w.shape
        scale = (math.sqrt(max(1, rows / cols)) if adjust == "original"
                 else 0.2 * math.sqrt(max(rows, cols)))
        expected = expected * (1 - lr * cfg.muon_weight_decay) - lr * scale * update
        if step == 0:  # AdamW's first step is lr * g / |g| (bias-corrected), no decay
            adam_lr = lr_at(0, cfg)
            want = emb0 - adam_lr * emb_grad / (emb_grad.abs() + cfg.eps)
            assert torch.allclose(emb.detach(), want, atol=1e-7)
    err = (w.detach().double() - expected).abs().max()
    move = (expected - w0).abs().max()
    assert err < 0.03 * move, (err, move)


def test_only_the_blocks_matrices_go_to_muon():
    for kw in ({}, {"tie_embeddings": False},
               {"family": "qwen3", "qk_norm": True}, {"family": "qwen2", "qkv_bias": True}):
        model = tiny_model(**kw)
        names = {n for n, _ in muon_parameters(model)}
        assert names == {f"layers.{i}.{m}.weight" for i in range(2)
                         for m in ("attn.wq", "attn.wk", "attn.wv", "attn.wo",
                                   "mlp.w1", "mlp.w2", "mlp.w3")}, kw
        opt = build_optimizer(model, muon_cfg(), CPU)
        muon_ids = {id(p) for g in opt.parts["muon"].param_groups for p in g["params"]}
        adamw_ids = {id(p) for g in opt.parts["adamw"].param_groups for p in g["params"]}
        assert not muon_ids & adamw_ids
        # Every trainable tensor in exactly one optimizer: embedding, head, norms, biases
        # on AdamW.
        assert muon_ids | adamw_ids == {id(p) for p in model.parameters()}
        assert id(model.tok_embeddings.weight) in adamw_ids
        assert id(model.lm_head.weight) in adamw_ids
        assert len(opt.peak_lrs) == len(opt.param_groups)


def test_lora_adapters_stay_on_adamw():
    model = tiny_model()
    for p in model.parameters():
        p.requires_grad_(False)
    apply_lora(model, 4, 8.0, 0.0, ["attn", "mlp"])
    logs: list[str] = []
    opt = build_optimizer(model, muon_cfg(), CPU, logs.append)
    assert isinstance(opt, torch.optim.AdamW) and "LoRA adapters stay on AdamW" in logs[0]
    assert muon_parameters(model) == []


def test_adamw_is_unchanged_and_defaults_keep_the_run_identity():
    model = tiny_model()
    cfg = TrainConfig()
    opt = build_optimizer(model, cfg, CPU)
    assert type(opt) is torch.optim.AdamW
    set_learning_rates(opt, 3, dataclasses.replace(cfg, max_steps=10, warmup=5))
    assert all(g["lr"] == cfg.max_lr * 4 / 5 for g in opt.param_groups)
    ident = ckpt.run_identity(ModelConfig(), cfg, 1, {}, {}, "t")
    for key in ("optimizer", "muon_lr", "batch_sampling"):
        assert key not in ident["train"]
    assert "zero_init_proj" not in ident["model"]
    # Muon's knobs change nothing under adamw, so they name no other run ...
    same = ckpt.run_identity(ModelConfig(), dataclasses.replace(cfg, muon_lr=0.5), 1, {}, {},
                             "t")
    assert ckpt.fingerprint_of(same) == ckpt.fingerprint_of(ident)
    # ... and each new option, set, is another run.
    for changed in (dataclasses.replace(cfg, optimizer="muon"),
                    dataclasses.replace(cfg, batch_sampling="stratified")):
        other = ckpt.run_identity(ModelConfig(), changed, 1, {}, {}, "t")
        assert ckpt.fingerprint_of(other) != ckpt.fingerprint_of(ident)
    zero = ckpt.run_identity(ModelConfig(zero_init_proj=True), cfg, 1, {}, {}, "t")
    assert zero["model"]["zero_init_proj"] is True


def test_muon_under_fsdp_is_refused_in_one_line():
    with pytest.raises(ConfigError) as e:
        TrainConfig(optimizer="muon", strategy="fsdp", nproc=2).validate()
    msg = str(e.value)
    assert "\n" not in msg and "train.optimizer" in msg and "train.strategy" in msg
    TrainConfig(optimizer="muon", strategy="ddp", nproc=2).validate()


def test_a_muon_run_trains_checkpoints_both_optimizers_and_resumes_bit_identical(inputs,
                                                                               tmp_path):
    params = tiny_params(max_steps=8, eval_every=0, ckpt_every=4, optimizer="muon",
                         muon_lr=0.02)
    logs: list[str] = []
    first = run(params, inputs, tmp_path / "c", logs)
    assert first.history[-1]["loss"] < first.history[0]["loss"]
    rows = [r for r in first.history if "lr_muon" in r]
    assert rows and all(r["lr_muon"] / r["lr"] == pytest.approx(0.02 / 3e-3) for r in rows)
    state = resumes_from_step_4_bit_identical(first, params, inputs, tmp_path / "c", logs)
    assert set(state["optimizer"]) == {"adamw", "muon"}
    assert all("momentum_buffer" in s for s in state["optimizer"]["muon"]["state"].values())


def resumes_from_step_4_bit_identical(first, params, inputs, root, logs) -> dict:
    """Rerun ``first`` (8 steps, checkpoints every 4, under ``root``) with its last
    checkpoint gone: it resumes at step 4 and ends with the very same weights and val
    loss. Returns the step-4 checkpoint's state for the caller's own checks."""
    run_dir = root / runs.run_id(first.fingerprint)
    state = ckpt.read_checkpoint(run_dir / "step-000004.pt")
    (run_dir / "step-000008.pt").unlink()
    resumed = run(params, inputs, root, logs)
    assert any("resuming from" in line and "step-000004" in line for line in logs)
    for name, tensor in first.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[name], tensor), name
    assert resumed.metrics["val_loss"] == first.metrics["val_loss"]
    return state


def test_a_checkpoint_of_the_other_optimizer_is_refused():
    model = tiny_model()
    opt = build_optimizer(model, muon_cfg(), CPU)
    with pytest.raises(ValueError, match="train.optimizer changed"):
        opt.load_state_dict({"adamw": {}})


def initial_weights(params) -> dict[str, torch.Tensor]:
    """The weights a run of ``params`` starts from (the loop seeds with train.seed)."""
    torch.manual_seed(params.train.seed)
    return Llama(params.model, 300).state_dict()


def assert_same_steps(ours: dict, theirs: dict, start: dict, share: float = 0.05) -> None:
    """Every tensor moved from ``start`` the same way, to ``share`` of its move.

    Not to the bit: torch's Newton-Schulz runs in bf16, where a float32 rounding
    difference in the summed gradient (other micro-batch or rank splits) can move an
    entry by one bf16 ulp; measured ~3 % of a step's size, against none for AdamW."""
    for name in theirs:  # a saved model holds a tied head once, as the embedding
        tensor = ours[name]
        move = (tensor - start[name]).abs().max()
        assert move > 0, name
        assert (theirs[name] - tensor).abs().max() < share * move, name


def test_gradient_accumulation_gives_muon_the_same_step(inputs, tmp_path):
    """2 micro-batches of 4 = 1 of 8: the same windows, the same Muon update."""
    params = tiny_params(max_steps=3, eval_every=0, micro_batch_size=8, optimizer="muon")
    whole = run(params, inputs, tmp_path / "a")
    split = run(tiny_params(max_steps=3, eval_every=0, micro_batch_size=4,
                            grad_accum_steps=2, optimizer="muon"), inputs, tmp_path / "b")
    assert_same_steps(whole.model.state_dict(), split.model.state_dict(),
                      initial_weights(params))


@pytest.mark.slow
def test_two_process_ddp_with_muon_matches_one_process_with_the_same_global_batch(tmp_path):
    """2 gloo ranks x 4 windows = 1 process x 8: each rank applies the same Muon update."""
    from safetensors.torch import load_file

    root = stage_repo(tmp_path / "ddp")
    params = yaml.safe_load((root / "params.yaml").read_text(encoding="utf-8"))
    params["train"].update(nproc=2, micro_batch_size=4, max_steps=6, eval_every=0,
                           compile=False, optimizer="muon")
    (root / "params.yaml").write_text(yaml.safe_dump(params), encoding="utf-8")
    procs = start_ranks(root, ["-m", "stages.train"])
    outs = wait_ranks(procs)
    assert "x2 (ddp)" in outs[0]
    metrics = json.loads((root / "metrics" / "train.json").read_text())
    assert metrics["world_size"] == 2
    ddp = load_file(root / "models" / "final" / "model.safetensors")
    params = tiny_params(max_steps=6, micro_batch_size=8, eval_every=0, optimizer="muon")
    single = run(params, TrainPaths().under(root), tmp_path / "single").model.state_dict()
    assert_same_steps(single, ddp, initial_weights(params))


def test_zero_init_projections_make_every_block_the_identity_at_start():
    model = tiny_model(zero_init_proj=True)
    for name, p in model.named_parameters():
        if name.endswith(("attn.wo.weight", "mlp.w2.weight")):
            assert not p.any(), name
        elif name.endswith(".weight") and "norm" not in name:
            assert p.std() > 0.01, name
    ids = torch.randint(0, 300, (2, 16))
    with torch.no_grad():
        direct = model.lm_head(model.norm(model.tok_embeddings(ids)))
        assert torch.allclose(model.eval()(ids), direct, atol=1e-6)



def test_a_non_finite_step_leaves_muon_and_adamw_untouched(inputs, tmp_path, monkeypatch):
    """The guard skips the composite's step: no weight and no momentum buffer moves."""

    original = llama_module.linear_cross_entropy
    params = tiny_params(optimizer="muon")
    model = Llama(params.model, 300)
    opt = build_optimizer(model, params.train, CPU)
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=CPU)
    precision = resolve_precision("fp32", CPU)
    loader = WindowLoader(ShardSet(inputs.train_shards), 32, 4, seed=0)
    step = (model, None, model, opt, precision.grad_scaler(), precision, loader, 1, 1.0, env)
    optimizer_step(*step)  # one good step: momentum buffers exist
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    bufs = {id(p): s["momentum_buffer"].clone() for p, s in opt.parts["muon"].state.items()}
    monkeypatch.setattr(llama_module, "linear_cross_entropy",
                        lambda *a, **k: original(*a, **k) * float("nan"))
    loss, _, _ = optimizer_step(*step)
    assert math.isnan(loss)
    for k, v in model.state_dict().items():
        assert torch.equal(v, weights[k]), k
    for p, s in opt.parts["muon"].state.items():
        assert torch.equal(s["momentum_buffer"], bufs[id(p)])
