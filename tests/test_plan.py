"""``lmforge plan``: per-rank memory under DDP and FSDP against hand calculations, the
model's real parameter count, and the tensors autograd really keeps."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from lmforge.cli import main
from lmforge.config import ModelConfig, load_params
from lmforge.model.llama import Llama, ffn_hidden_size, param_count_formula
from lmforge.plan import cli as plan_cli
from lmforge.plan import memory as mem
from lmforge.plan import pretrain as pre
from lmforge.plan import shapes as sh

REPO = Path(__file__).resolve().parents[1]
GIB = 1 << 30
DEMO_VOCAB = 8192  # tokenizer.vocab_size in params.yaml (the built tokenizer has as many)
ONE_B = ModelConfig(**{k: v for k, v in sh.SHAPES["1b"].items() if k not in ("vocab", "name")})


def demo_model() -> ModelConfig:
    model = load_params(REPO / "params.yaml").model
    # The hand calculations below are for this shape; update them with params.yaml.
    assert (model.n_layer, model.n_head, model.n_kv_head, model.n_embd, model.seq_len,
            model.ffn_multiple_of, model.tie_embeddings) == (4, 4, None, 256, 256, 64, True)
    return model


# --------------------------------------------------------------------------- parameters


def test_demo_parameter_count_from_first_principles():
    cfg = demo_model()
    d, V, L = 256, 8192, 4
    F = 704  # 8/3 * 256 = 682.7, up to a multiple of 64
    attn = 4 * d * d  # wq, wk, wv, wo (4 KV heads = 4 heads)
    mlp = 3 * d * F
    per_layer = attn + mlp + 2 * d  # + two RMSNorm gains
    hand = V * d + L * per_layer + d  # tied head: no second V x d
    assert hand == 5_310_720
    assert ffn_hidden_size(cfg) == F
    assert sh.num_params(cfg, V) == hand == param_count_formula(cfg, V)
    assert Llama(cfg, V).num_params() == hand


def test_1b_parameter_count_from_first_principles():
    d, V, L, H, KV, hd, F = 2048, 128256, 16, 32, 8, 64, 8192
    attn = d * H * hd + 2 * d * KV * hd + H * hd * d  # 10,485,760
    per_layer = attn + 3 * d * F + 2 * d  # 60,821,504
    hand = V * d + L * per_layer + d
    assert hand == 1_235_814_400  # Llama-3.2-1B's published count
    assert ffn_hidden_size(ONE_B) == F
    assert sh.num_params(ONE_B, V) == hand
    with torch.device("meta"):
        assert Llama(ONE_B, V).num_params() == hand


def test_untied_gqa_shape_counts_like_the_module():
    cfg = ModelConfig(n_layer=3, n_head=8, n_kv_head=2, n_embd=128, seq_len=64,
                      tie_embeddings=False)
    with torch.device("meta"):
        assert sh.num_params(cfg, 1000) == Llama(cfg, 1000).num_params()
    assert sh.sharded_params(cfg, 1000, 1) == sh.num_params(cfg, 1000)


# --------------------------------------------------------------------------- figures


def test_demo_figures_by_hand():
    s = sh.Setup(demo_model(), DEMO_VOCAB, "bf16", world=8)
    P, d, V, seq, L, F = 5_310_720, 256, 8192, 256, 4, 704
    mb = 8
    # DDP: fp32 weights, grads, two AdamW moments, and buckets as large as the grads.
    ddp = mem.rows_bytes(s, "ddp", mb)
    assert (ddp["params"], ddp["grads"], ddp["optimizer"], ddp["buckets"]) == (
        4 * P, 4 * P, 8 * P, 4 * P)
    fused = d * 3 * d + 2 * d * F  # q|k|v and gate|up, concatenated per forward
    cached = d * d + d * F  # wo and w2, cast once by autocast
    assert ddp["weight_copies"] == 2 * L * (fused + cached) == 6_422_528
    chunk = min(mb * seq, 2**26 // V)  # 2048 tokens in the loss's one chunk
    # head grad fp32 (4) + bf16 product and fp32 copy (6) + the head's bf16 cast (2)
    assert ddp["loss_buffers"] == 12 * V * d + chunk * V * 6 == 125_829_120
    # Per token and layer (fp32 residual r=4, bf16 a=2): 2rd + 8 + 4H + a(3d + 5d + 4F)
    layer = 2 * 4 * d + 8 + 4 * 4 + 2 * (3 * d + 5 * d + 4 * F)
    assert layer == 11_800
    loss = 4 * d + 2 * d + 2 * d  # norm output fp32, hidden-state grad, its bf16 cast
    per_seq = seq * (L * layer + 4 * d + 4 + 8 + loss)
    assert mem.activation_bytes_per_seq(s, "ddp") == per_seq == 12_872_704

    # FSDP over 8: every dim 0 divides by 8, so the shard is exactly P / 8.
    fsdp = mem.rows_bytes(s, "fsdp", mb)
    assert P % 8 == 0 and sh.sharded_params(s.model, V, 8) == P // 8
    assert (fsdp["params"], fsdp["grads"], fsdp["optimizer"], fsdp["buckets"]) == (
        4 * P // 8, 4 * P // 8, 8 * P // 8, 0)
    root, block = V * d + d, 4 * d * d + 3 * d * F + 2 * d
    assert fsdp["unsharded_params"] == 2 * (root + 2 * block) == 7_408_128
    assert fsdp["unsharded_grads"] == 2 * root + (2 + 4) * block == 9_014_784
    assert fsdp["weight_copies"] == 2 * L * fused
    assert fsdp["loss_buffers"] == 10 * V * d + chunk * V * 6
    layer16 = 2 * 2 * d + 8 + 4 * 4 + 2 * (3 * d + 5 * d + 4 * F)  # bf16 residual
    assert mem.activation_bytes_per_seq(s, "fsdp") == seq * (
        L * layer16 + 2 * d + 4 + 8 + 2 * d + 2 * d) == 11_430_912


def test_1b_figures_on_80gb_world_8_by_hand():
    s = sh.Setup(ONE_B, 128256, "bf16", world=8)
    P, d, V, seq, L, F = 1_235_814_400, 2048, 128256, 2048, 16, 8192
    H, KV, hd = 32, 8, 64
    device = 80 * GIB
    budget = device - (GIB + device // 10)  # 1 GiB + 10% reserve = 71 GiB
    out = pre.plan(s, 80, 8)
    assert out["budget_bytes"] == budget == 71 * GIB

    fused = d * (H + 2 * KV) * hd + 2 * d * F  # 39,845,888
    cached = d * d + d * F  # 20,971,520
    chunk = 512  # 8 x 2048 tokens in chunks of at most 2**26 // V = 523: 32 of 512
    ddp_fixed = (4 + 4 + 8 + 4) * P + 2 * L * (fused + cached) + 12 * V * d + chunk * V * 6
    # GQA: roped q|k ((H+KV) hd) and k, v repeated to H heads (2 H hd), not the qkv output.
    kv = (H + KV) * hd + 2 * H * hd
    layer = 2 * 4 * d + 8 + 4 * H + 2 * (3 * d + kv + 4 * F)
    assert layer == 107_656
    ddp_seq = seq * (L * layer + 4 * d + 12 + 4 * d + 2 * d + 2 * d)
    assert out["ddp"]["activations_per_seq"] == ddp_seq == 3_578_028_032
    assert out["ddp"]["total"] == ddp_fixed + 8 * ddp_seq
    assert out["ddp"]["max_micro_batch"] == (budget - ddp_fixed) // ddp_seq == 12

    shard = P // 8  # 128256, 2048, 512 and 8192 all divide by 8
    root, block = V * d + d, 60_821_504
    fsdp_fixed = (16 * shard + 2 * (root + 2 * block) + 2 * root + 6 * block
                  + 2 * L * fused + 10 * V * d + chunk * V * 6)
    layer16 = 2 * 2 * d + 8 + 4 * H + 2 * (3 * d + kv + 4 * F)
    fsdp_seq = seq * (L * layer16 + 2 * d + 12 + 2 * d + 2 * d)
    assert out["fsdp"]["activations_per_seq"] == fsdp_seq
    assert out["fsdp"]["total"] == fsdp_fixed + 8 * fsdp_seq
    assert out["fsdp"]["max_micro_batch"] == (budget - fsdp_fixed) // fsdp_seq == 20


def test_fsdp_in_fp16_gathers_fp32_under_autocast():
    """lmforge.train.fsdp gives FSDP a bf16 MixedPrecisionPolicy only."""
    s = sh.Setup(ONE_B, 128256, "fp16", world=8)
    root, block = 128256 * 2048 + 2048, 60_821_504
    assert mem.unsharded_params_bytes(s, "fsdp") == 4 * (root + 2 * block)
    assert sh.residual_bytes("fsdp", "fp16") == 4 == sh.residual_bytes("ddp", "bf16")
    assert mem.weight_copy_bytes(s, "fsdp") == mem.weight_copy_bytes(s, "ddp")
    assert mem.activation_bytes_per_seq(s, "fsdp") == mem.activation_bytes_per_seq(s, "ddp")


@pytest.mark.parametrize("world", [2, 8, 64])
def test_fsdp_model_states_are_a_world_share_of_ddps(world):
    s = sh.Setup(ONE_B, 128256, "bf16", world=world)

    def states(strategy: str) -> int:
        return sum(f(s, strategy) for f in (mem.params_bytes, mem.grads_bytes,
                                            mem.optimizer_bytes))

    assert states("ddp") == 16 * sh.num_params(ONE_B, 128256)  # ZeRO's 16 bytes/param
    assert states("fsdp") == pytest.approx(states("ddp") / world, rel=1e-3)
    assert states("fsdp") >= states("ddp") / world  # padding only adds


@pytest.mark.parametrize("strategy", pre.STRATEGIES)
@pytest.mark.parametrize("ac", [False, True])
@pytest.mark.parametrize("fused", [False, True])
def test_fitted_micro_batch_is_the_largest_within_budget(strategy, ac, fused):
    s = sh.Setup(ONE_B, 128256, "bf16", world=8, activation_checkpointing=ac,
                 fused_loss=fused)
    for device_gib in (24, 40, 80, 141):
        budget = device_gib * GIB - mem.reserve_bytes(device_gib * GIB)
        mb = pre.fit_micro_batch(s, strategy, budget)
        if mb:
            assert mem.total_bytes(s, strategy, mb) <= budget
        assert mem.total_bytes(s, strategy, mb + 1) > budget


def test_fit_grows_with_device_memory_and_checkpointing_helps():
    s = sh.Setup(ONE_B, 128256, "bf16", world=8)
    ac = dataclasses.replace(s, activation_checkpointing=True)
    for strategy in pre.STRATEGIES:
        fits = [pre.plan(s, g, 1)[strategy]["max_micro_batch"] for g in range(8, 200, 8)]
        assert fits == sorted(fits) and fits[0] == 0 and fits[-1] > 0
        assert pre.plan(ac, 80, 1)[strategy]["max_micro_batch"] > fits[9]  # 80 GiB
    out = pre.plan(s, 80, 1)
    assert out["fsdp"]["max_micro_batch"] > out["ddp"]["max_micro_batch"]


# --------------------------------------------------------------------------- vs autograd


def _saved_bytes(cfg: ModelConfig, vocab: int, batch: int, mode: str,
                 positions: bool = False) -> int:
    """Bytes of the distinct non-parameter storages autograd saves in one forward."""
    torch.manual_seed(0)
    model = Llama(cfg, vocab)
    if mode == "fsdp":  # what MixedPrecisionPolicy computes with: bf16 parameters
        model = model.to(torch.bfloat16)
    model.train()
    own = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in own:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    idx = torch.randint(0, vocab, (batch, cfg.seq_len))
    pos = torch.arange(cfg.seq_len).repeat(batch, 1) % 40 if positions else None
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "ddp-bf16")
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
        model(idx, idx, positions=pos)
    return sum(seen.values())


@pytest.mark.parametrize("kv", [None, 2])
@pytest.mark.parametrize("mode", ["ddp-fp32", "ddp-bf16", "fsdp"])
def test_layer_and_weight_copies_match_what_autograd_saves(kv, mode):
    """CPU SDPA uses its flash kernel here (no mask, no dropout): the plan's assumption."""
    cfg = ModelConfig(n_layer=2, n_head=4, n_kv_head=kv, n_embd=128, seq_len=64)
    vocab, seq, d = 512, 64, 128
    strategy = "fsdp" if mode == "fsdp" else "ddp"
    s = sh.Setup(cfg, vocab, "fp32" if mode == "ddp-fp32" else "bf16")
    r, a = sh.residual_bytes(strategy, s.precision), sh.compute_bytes(s.precision)
    one, two = (_saved_bytes(cfg, vocab, b, mode) for b in (1, 2))
    # Saved per token: the layers, the final norm's input and rstd, the token ids and the
    # loss's hidden-state gradient (not the norm output or its cast: alive, not saved).
    per_token = cfg.n_layer * mem.layer_activation_bytes(cfg, r, a) + r * d + 4 + 8 + a * d
    assert two - one == seq * per_token
    # Saved once: the weight copies, the head's fp32 gradient, and the loss's 1/count.
    assert 2 * one - two == mem.weight_copy_bytes(s, strategy) + 4 * vocab * d + 4


@pytest.mark.parametrize("mode", ["ddp-fp32", "ddp-bf16"])
def test_document_mask_costs_an_additive_mask_per_layer(mode):
    cfg = ModelConfig(n_layer=2, n_head=4, n_embd=128, seq_len=64)
    masked = dataclasses.replace(cfg, doc_mask=True)
    s = sh.Setup(cfg, 512, "fp32" if mode == "ddp-fp32" else "bf16")
    extra = (mem.activation_bytes_per_seq(dataclasses.replace(s, model=masked), "ddp")
             - mem.activation_bytes_per_seq(s, "ddp"))
    seq = cfg.seq_len
    saved = (_saved_bytes(cfg, 512, 2, mode, positions=True)
             - _saved_bytes(cfg, 512, 2, mode)) // 2
    assert extra - seq * seq == saved  # the boolean mask is alive in forward, not saved


# --------------------------------------------------------------------------- command line


def test_cli_prints_the_table(capsys):
    main(["plan", "--params", str(REPO / "params.yaml"), "--vocab", str(DEMO_VOCAB),
          "--world", "8", "--device-gb", "80"])
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith("lmforge plan: 5.3M parameters")
    assert "vocab 8192" in lines[0] and "8 x 80 GiB" in lines[0]
    assert lines[1].split() == ["ddp", "fsdp"]
    labels = [label for _, label in pre.ROWS] + ["activations/seq", "total @ micro-batch 8",
                                                "fits micro-batch"]
    for label in labels:
        assert any(line.startswith(label) for line in lines), label
    fits = next(line for line in lines if line.startswith("fits micro-batch")).split()[-2:]
    # params.yaml's fused_loss: auto plans the plain loss where the step fits with it,
    # as it does on an 80 GiB GPU at micro-batch 8.
    s = sh.Setup(demo_model(), DEMO_VOCAB, "bf16", world=8,
                 optimizer=load_params(REPO / "params.yaml").train.optimizer,
                 fused_loss=False)
    budget = 71 * GIB
    assert [int(f) for f in fits] == [pre.fit_micro_batch(s, st, budget)
                                      for st in pre.STRATEGIES]


def test_cli_json_for_the_1b_shape(capsys):
    main(["plan", "--params", str(REPO / "params.yaml"), "--shape", "1b", "--world", "8",
          "--device-gb", "80", "--micro-batch", "16", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert doc["params"] == 1_235_814_400 and doc["vocab"] == 128256
    assert doc["model"]["n_kv_head"] == 8 and doc["micro_batch"] == 16
    # params.yaml's optimizer: Muon (13 micro-batches fit under DDP; AdamW's 12).
    optimizer = load_params(REPO / "params.yaml").train.optimizer
    assert doc["optimizer"] == optimizer
    s = sh.Setup(ONE_B, 128256, world=8, optimizer=optimizer)
    assert doc["ddp"]["max_micro_batch"] == {"muon": 13, "adamw": 12}[optimizer]
    assert doc["ddp"]["fits"] is False
    assert doc["fsdp"]["max_micro_batch"] == 20 and doc["fsdp"]["fits"] is True
    assert doc["ddp"]["total"] == mem.total_bytes(s, "ddp", 16)
    adamw = dataclasses.replace(s, optimizer="adamw")
    assert pre.fit_micro_batch(adamw, "ddp", 71 * GIB) == 12


def test_cli_overrides_and_vocab_fallback(tmp_path, capsys, monkeypatch):
    # No tokenizer beside this params.yaml: the vocabulary is tokenizer.vocab_size.
    shutil.copy(REPO / "params.yaml", tmp_path / "params.yaml")
    monkeypatch.chdir(tmp_path)
    main(["plan", "--n-layer", "8", "--n-kv-head", "2", "--json"])
    doc = json.loads(capsys.readouterr().out)
    cfg = dataclasses.replace(demo_model(), n_layer=8, n_kv_head=2)
    assert doc["vocab"] == DEMO_VOCAB and doc["source"]["vocab"] == "tokenizer.vocab_size"
    with torch.device("meta"):  # the overridden shape, counted on the real module
        assert doc["params"] == Llama(cfg, DEMO_VOCAB).num_params()
    assert doc["world"] == 1 and doc["ddp"]["buckets"] == 0  # nproc 1: no DDP wrapper


@pytest.mark.parametrize("argv", [["--world", "0"], ["--n-head", "3"], ["--device-gb", "0"],
                                  ["--params", "missing.yaml"]])
def test_cli_errors_are_one_line(argv, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    with pytest.raises(SystemExit) as e:
        main(["plan", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1


@pytest.mark.parametrize("qk_norm", [False, True])
def test_muon_optimizer_row_counts_the_tensors_muon_takes(qk_norm):
    """Muon keeps one fp32 buffer for what ``muon_parameters`` hands it, AdamW two for
    the rest; FSDP refuses Muon, so its column stays AdamW's."""
    from lmforge.train.optim import muon_parameters

    cfg = ModelConfig(n_layer=3, n_head=4, n_kv_head=2, n_embd=64, seq_len=32,
                      qk_norm=qk_norm, family="qwen3" if qk_norm else "llama")
    vocab = 500
    model = Llama(cfg, vocab)
    matrices = sum(p.numel() for _, p in muon_parameters(model))
    total = model.num_params()
    assert sh.muon_matrix_params(cfg) == matrices
    muon = sh.Setup(cfg, vocab, "bf16", world=2, optimizer="muon")
    adamw = dataclasses.replace(muon, optimizer="adamw")
    assert mem.optimizer_bytes(muon, "ddp") == 4 * matrices + 8 * (total - matrices)
    assert mem.optimizer_bytes(adamw, "ddp") == 8 * total
    assert mem.optimizer_bytes(muon, "fsdp") == mem.optimizer_bytes(adamw, "fsdp")
    assert "optimizer (Muon/AdamW)" in plan_cli.format_table(pre.plan(muon, 80, 8), "test")
    assert "optimizer (AdamW)" in plan_cli.format_table(pre.plan(adamw, 80, 8), "test")


# --------------------------------------------------------------------------- fused_loss: auto


def test_auto_loss_is_planned_plain_exactly_where_the_plain_step_fits():
    s = sh.Setup(ONE_B, 128256, "bf16", world=8)
    plain = dataclasses.replace(s, fused_loss=False)
    for strategy in pre.STRATEGIES:
        need = mem.total_bytes(plain, strategy, 4)
        assert pre.auto_fused_loss(s, strategy, 4, need) is False  # fits: plain
        assert pre.auto_fused_loss(s, strategy, 4, need - 1) is True  # does not: chunked
    # The plain loss's logits cost memory: it fits fewer sequences than the chunked one.
    assert mem.total_bytes(plain, "ddp", 4) > mem.total_bytes(s, "ddp", 4)


def _auto_params(tmp_path: Path) -> Path:
    text = (REPO / "params.yaml").read_text(encoding="utf-8")
    out = tmp_path / "params.yaml"
    out.write_text(text.replace("  fused_loss: true ", "  fused_loss: auto ", 1),
                   encoding="utf-8")
    assert load_params(out).train.fused_loss == "auto"
    return out


@pytest.mark.parametrize(("device_gb", "fused"), [(80, False), (0.5, True)])
def test_cli_plans_auto_as_plain_where_it_fits_else_chunked(tmp_path, capsys, device_gb,
                                                            fused):
    params = _auto_params(tmp_path)
    argv = ["plan", "--params", str(params), "--vocab", str(DEMO_VOCAB), "--device-gb",
            str(device_gb)]
    main(argv + ["--json"])
    doc = json.loads(capsys.readouterr().out)
    assert doc["source"]["fused_loss"] == "auto" and doc["fused_loss"] is fused
    assert (doc["ddp"]["loss_buffers"] > 0) is fused  # the chunked loss's buffers, or none
    main(argv)
    first = capsys.readouterr().out.splitlines()[0]
    assert f"fused_loss auto: {'chunked' if fused else 'plain'} loss" in first
    main(argv + ["--no-fused-loss"])  # given on the command line, it is not auto
    first = capsys.readouterr().out.splitlines()[0]
    assert "fused_loss auto" not in first and "plain loss" in first
