"""``lmforge plan --mode full|lora|qlora``: the fine-tuning plan against published parameter
counts, the bytes real modules hold (meta device and CPU), what autograd saves with LoRA
adapters on a bf16 frozen base, torchao's NF4 tensors (when installed), and the docs page
generated from the command."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import weakref
from pathlib import Path

import pytest
import torch

from lmforge.cli import main
from lmforge.config import ModelConfig
from lmforge.model.llama import Llama
from lmforge.model.lora import apply_lora, lora_modules, trainable_parameters
from lmforge.plan import finetune as ft
from lmforge.plan import pretrain as pre
from lmforge.plan import shapes as sh

REPO = Path(__file__).resolve().parents[1]
GIB = 1 << 30
# Published totals (the models' safetensors indexes / model cards).
PUBLISHED = {"1b": 1_235_814_400, "3b": 3_212_749_824, "7b": 6_738_415_616,
             "mistral-7b": 7_241_732_096, "8b": 8_030_261_248, "qwen2.5-7b": 7_615_616_512}


def preset(key: str) -> tuple[ModelConfig, int]:
    shape = sh.SHAPES[key]
    cfg = ModelConfig(**{k: v for k, v in shape.items() if k not in ("vocab", "name")})
    return cfg, shape["vocab"]


def tune(key: str, mode: str = "lora", rank: int = 8, targets=ft.BLOCK_TARGETS,
         precision: str = "bf16", ac: bool = False, device: str = "cuda") -> ft.Tune:
    cfg, vocab = preset(key)
    return ft.Tune(sh.Setup(cfg, vocab, precision, activation_checkpointing=ac), mode,
                   rank, tuple(targets), device)


# --------------------------------------------------------------------------- weights


@pytest.mark.parametrize("key", list(PUBLISHED))
def test_presets_count_like_the_module_and_the_published_models(key):
    cfg, vocab = preset(key)
    assert sh.num_params(cfg, vocab) == PUBLISHED[key]
    with torch.device("meta"):
        assert Llama(cfg, vocab).num_params() == PUBLISHED[key]


@pytest.mark.parametrize("key", ["8b", "qwen2.5-7b"])
def test_frozen_base_and_adapters_of_a_real_module_on_meta(key):
    cfg, vocab = preset(key)
    t = tune(key, rank=16)
    with torch.device("meta"):
        model = Llama(cfg, vocab)
        apply_lora(model, 16, 32.0, 0.0, ["attn", "mlp"])
    frozen = [p for p in model.parameters() if not p.requires_grad]
    assert trainable_parameters(model) == ft.adapter_params(t)
    assert ft.weight_rows(t)["weights"] == 2 * sum(p.numel() for p in frozen)
    # QLoRA: the block Linears' weights in NF4, the rest (embedding, norms, biases, head) bf16.
    linears = [m.base.weight for m in lora_modules(model).values()]
    assert len(linears) == 7 * cfg.n_layer
    q = ft.weight_rows(dataclasses.replace(t, mode="qlora"))
    assert q["weights"] == sum(ft.nf4_bytes(w.numel()) for w in linears)
    assert q["weights_16"] == 2 * (sum(p.numel() for p in frozen)
                                   - sum(w.numel() for w in linears))


def test_8b_lora_rows_by_hand():
    d, V, L, F, kv, r = 4096, 128256, 32, 14336, 1024, 8
    P = 8_030_261_248
    n = L * r * ((d + d) + 2 * (d + kv) + (d + d) + 3 * (d + F))  # wq wk wv wo w1 w3 w2
    assert n == 20_971_520
    rows = ft.rows_bytes(tune("8b"), 1)
    assert (rows["weights"], rows["adapters"], rows["grads"], rows["optimizer"],
            rows["adapter_casts"]) == (2 * P, 4 * n, 4 * n, 8 * n, 2 * n)
    assert "weight_copies" not in rows  # frozen q|k|v and gate|up run as separate GEMMs
    # The head is frozen: one chunk of fp32 logits and its bf16 copy; 2048 tokens in
    # chunks of at most 2**26 // V = 523 tokens go as 4 of 512.
    chunk = 512
    assert rows["loss_buffers"] == 6 * chunk * V
    # NF4: 4.127 bits a weight; per matrix N/2 + N/64 + 2N/16384 + 2 + 32 bytes.
    linear = L * (d * d + 2 * d * kv + d * d + 3 * d * F)
    q = ft.rows_bytes(tune("8b", "qlora"), 1)
    assert q["weights"] == linear // 2 + linear // 64 + 2 * linear // 16384 + 7 * L * 34
    assert q["weights_16"] == 2 * (P - linear)
    assert "weight_copies" not in q and q["dequant"] == 14 * d * F


def _tiny_lora(cfg: ModelConfig, vocab: int, targets, rank: int = 4,
               precision: str = "bf16") -> Llama:
    """A Llama with adapters on ``targets`` and its frozen parameters cast to bf16 (kept
    fp32 for ``precision="fp32"``)."""
    torch.manual_seed(0)
    model = Llama(cfg, vocab)
    apply_lora(model, rank, 8.0, 0.0, list(targets))
    for p in model.parameters():
        if not p.requires_grad and precision == "bf16":
            p.data = p.data.to(torch.bfloat16)
    return model.train()


def test_lora_states_of_a_real_cpu_module():
    """One AdamW step: gradients and moments for the adapters only, in fp32."""
    cfg = ModelConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=128, seq_len=32,
                      tie_embeddings=False)
    vocab = 512
    model = _tiny_lora(cfg, vocab, ["attn", "mlp"])
    t = ft.Tune(sh.Setup(cfg, vocab, "bf16"), "lora", 4, ft.BLOCK_TARGETS)
    rows = ft.rows_bytes(t, 1)
    frozen = [p for p in model.parameters() if not p.requires_grad]
    adapters = [p for p in model.parameters() if p.requires_grad]
    assert {p.dtype for p in frozen} == {torch.bfloat16}
    assert {p.dtype for p in adapters} == {torch.float32}
    assert sum(p.untyped_storage().nbytes() for p in frozen) == rows["weights"]
    assert sum(p.untyped_storage().nbytes() for p in adapters) == rows["adapters"]
    opt = torch.optim.AdamW(adapters, lr=1e-3)
    idx = torch.randint(0, vocab, (2, cfg.seq_len))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, loss = model(idx, idx)
    loss.backward()
    opt.step()
    assert all(p.grad is None for p in frozen)
    assert sum(p.grad.untyped_storage().nbytes() for p in adapters) == rows["grads"]
    moments = sum(s[k].untyped_storage().nbytes() for s in opt.state.values()
                  for k in ("exp_avg", "exp_avg_sq"))
    assert len(opt.state) == len(adapters) and moments == rows["optimizer"]


def _nf4_module():
    for name in ("torchao.quantization.quantize_.workflows.nf4.nf4_tensor",
                 "torchao.dtypes.nf4tensor"):
        try:
            if importlib.util.find_spec(name) is not None:
                return importlib.import_module(name)
        except ModuleNotFoundError:
            continue
    pytest.skip("torchao is not installed (pip install torchao)")


@pytest.mark.parametrize("shape", [(512, 256), (1024, 128), (128, 128)])
def test_nf4_bytes_equal_torchaos_tensor(shape):
    nf4 = _nf4_module()
    t = nf4.to_nf4(torch.randn(*shape, dtype=torch.bfloat16))
    names, _ = t.__tensor_flatten__()
    held = sum(getattr(t, n).untyped_storage().nbytes() for n in names)
    assert held == ft.nf4_bytes(shape[0] * shape[1])


def test_nf4_dequantization_peak_is_planned():
    """torchao's eager get_original_weight: live bytes peak at ~14 per element."""
    nf4 = _nf4_module()
    from torch.utils._python_dispatch import TorchDispatchMode

    class Live(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.live: dict[int, int] = {}
            self.peak = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for o in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() not in self.live:
                    key = o.untyped_storage().data_ptr()
                    self.live[key] = o.untyped_storage().nbytes()
                    weakref.finalize(o, self.live.pop, key, None)
            self.peak = max(self.peak, sum(self.live.values()))
            return out

    weight = nf4.to_nf4(torch.randn(1024, 512, dtype=torch.bfloat16))
    with Live() as live:
        weight.get_original_weight()
    assert ft.NF4_DEQUANT_BYTES <= live.peak / weight.numel() < ft.NF4_DEQUANT_BYTES + 0.1


def test_nf4_needs_a_scaler_block_that_divides():
    assert ft.nf4_bytes(64 * 100) == 64 * 100 // 2 + 100 + 2 * (100 + 1 + 16)
    with pytest.raises(Exception, match="no NF4 scaler block"):
        ft.nf4_bytes(64 * 257)


# --------------------------------------------------------------------------- vs autograd


def _saved_bytes(model: Llama, vocab: int, batch: int, precision: str = "bf16") -> int:
    """Bytes of the distinct non-parameter storages autograd saves in one forward (under
    bf16 autocast unless ``precision="fp32"``)."""
    own = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in own:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    torch.manual_seed(1)
    idx = torch.randint(0, vocab, (batch, model.config.seq_len))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        model(idx, idx)
    return sum(seen.values())


def _unsaved_first_casts(cfg: ModelConfig, rank: int, targets: tuple[str, ...]) -> int:
    """Autocast's bf16 casts of the first block's A matrices whose input needs no gradient
    (alive in autocast's cache through the forward, which the plan counts, not saved)."""
    qkv = any(t in targets for t in ("wq", "wk", "wv"))
    attn = qkv or "wo" in targets
    gate = "w1" in targets or "w3" in targets
    idle = {"wq", "wk", "wv"} | ({"wo"} if not qkv else set()) | (
        {"w1", "w3"} if not attn else set()) | ({"w2"} if not (attn or gate) else set())
    shapes = sh.linear_shapes(cfg)
    return sum(2 * rank * shapes[t][1] for t in targets if t in idle)


@pytest.mark.parametrize("kv", [None, 2])
@pytest.mark.parametrize("targets", [ft.BLOCK_TARGETS, ("wq", "wk", "wv", "wo"),
                                     ("w1", "w2", "w3"), ("wo",), ("wv", "w2")])
def test_lora_activations_match_what_autograd_saves(kv, targets):
    """A bf16 frozen base with fp32 adapters under bf16 autocast, as the LoRA run holds it."""
    _check_saved(ModelConfig(n_layer=3, n_head=4, n_kv_head=kv, n_embd=128, seq_len=64),
                 targets, "bf16")


def test_lora_activations_on_an_fp32_base():
    _check_saved(ModelConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=128, seq_len=64),
                 ("wq", "wv", "w1", "w2"), "fp32")


def _check_saved(cfg: ModelConfig, targets, precision: str) -> None:
    vocab, seq, d, rank = 512, cfg.seq_len, cfg.n_embd, 4
    model = _tiny_lora(cfg, vocab, targets, rank, precision)
    t = ft.Tune(sh.Setup(cfg, vocab, precision), "lora", rank, tuple(targets))
    a = ft.base_bytes(precision)
    one, two = (_saved_bytes(model, vocab, b, precision) for b in (1, 2))
    # Alive but not saved per token: the token ids (the embedding is frozen) and the final
    # norm's output (the fused loss keeps its gradient instead).
    assert two - one == ft.lora_activation_bytes_per_seq(t) - seq * (8 + a * d)
    rows = ft.rows_bytes(t, 1)
    # Saved once: the adapters' bf16 casts and the loss's 1/count; no joined copy of the
    # frozen q|k|v or gate|up weights (fused_linear runs frozen groups as separate GEMMs).
    unsaved = _unsaved_first_casts(cfg, rank, tuple(targets)) if precision == "bf16" else 0
    assert "weight_copies" not in rows
    assert 2 * one - two == rows["adapter_casts"] - unsaved + 4


def test_lora_keeps_less_than_pretraining_and_checkpointing_keeps_least():
    t = tune("8b")
    full = ft.activation_bytes_per_seq(dataclasses.replace(t, mode="full"))
    lora = ft.activation_bytes_per_seq(t)
    ac = ft.activation_bytes_per_seq(dataclasses.replace(
        t, setup=dataclasses.replace(t.setup, activation_checkpointing=True)))
    assert ac < lora < full
    # QLoRA keeps the same activations; only its weights differ.
    assert ft.activation_bytes_per_seq(dataclasses.replace(t, mode="qlora")) == lora


# --------------------------------------------------------------------------- plans


def test_full_mode_is_the_pretraining_plan_on_one_device():
    t = tune("3b", "full")
    p = ft.finetune_plan(t, 80, 2)
    setup = dataclasses.replace(t.setup, world=1)
    ref = pre.plan(setup, 80, 2)["ddp"]
    assert p["no_ac"]["total"] == ref["total"] and p["no_ac"]["max_micro_batch"] == ref[
        "max_micro_batch"]
    assert p["no_ac"]["weights"] + p["no_ac"]["grads"] + p["no_ac"]["optimizer"] == 16 * (
        PUBLISHED["3b"])


@pytest.mark.parametrize("mode", ft.MODES)
@pytest.mark.parametrize("device", ft.DEVICES)
def test_fitted_micro_batch_is_the_largest_within_budget(mode, device):
    for key in ("1b", "8b"):
        for gib in (24, 48, 80, 256):
            p = ft.finetune_plan(tune(key, mode, device=device), gib, 1)
            for col, ac in (("no_ac", False), ("ac", True)):
                t = tune(key, mode, ac=ac, device=device)
                mb = p[col]["max_micro_batch"]
                if mb:
                    assert ft.total_bytes(t, mb) <= p["budget_bytes"]
                assert ft.total_bytes(t, mb + 1) > p["budget_bytes"]


def test_modes_order_and_verdicts_name_the_largest_row():
    fits = {m: ft.finetune_plan(tune("8b", m), 24, 1) for m in ft.MODES}
    assert fits["full"]["verdict"].startswith("does not fit: before any activation")
    assert "AdamW moments (fp32)" in fits["full"]["verdict"]
    assert (fits["qlora"]["ac"]["total"] < fits["lora"]["ac"]["total"]
            < fits["full"]["ac"]["total"])
    for p in fits.values():
        col = "no_ac" if p["no_ac"]["fits"] else "ac"
        label, size = ft.largest_part(p, col)
        assert label in p["verdict"] and sh.format_size(size) in p["verdict"]


# --------------------------------------------------------------------------- command line


def test_cli_mode_prints_both_columns_and_a_verdict(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    main(["plan", "--mode", "lora", "--shape", "7b", "--device-gb", "24"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("lmforge plan: LoRA r=8 on wq,wk,wv,wo,w1,w2,w3 of 6.74B")
    assert lines[1].split() == ["no", "AC", "AC"]
    p = ft.finetune_plan(tune("7b"), 24, 1)
    fits = next(line for line in lines if line.startswith("fits micro-batch")).split()[-2:]
    assert [int(f) for f in fits] == [p["no_ac"]["max_micro_batch"], p["ac"]["max_micro_batch"]]
    assert lines[-1] == f"verdict: {p['verdict']}"


def test_cli_json_takes_rank_targets_and_cpu(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    main(["plan", "--mode", "qlora", "--shape", "qwen2.5-7b", "--rank", "16", "--targets",
          "attn", "--device", "cpu", "--device-gb", "64", "--micro-batch", "2", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert doc["rank"] == 16 and doc["targets"] == ["wq", "wk", "wv", "wo"]
    assert doc["device"] == "cpu" and doc["micro_batch"] == 2
    t = tune("qwen2.5-7b", "qlora", 16, ("wq", "wk", "wv", "wo"), device="cpu")
    assert doc["no_ac"]["total"] == ft.total_bytes(t, 2)
    # 2 x 2048 tokens in CPU chunks of max(512, 2**22 // 152064 = 27) tokens: 8 of 512.
    assert doc["no_ac"]["loss_buffers"] == 6 * 512 * 152064


@pytest.mark.parametrize("argv", [["--world", "2"], ["--targets", "lm_head"],
                                  ["--targets", "wx"], ["--rank", "0"]])
def test_cli_mode_errors_are_one_line(argv, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    with pytest.raises(SystemExit) as e:
        main(["plan", "--mode", "lora", "--shape", "8b", "--no-tie-embeddings", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1


# --------------------------------------------------------------------------- docs


def test_docs_page_is_the_commands_output():
    spec = importlib.util.spec_from_file_location("plan_docs", REPO / "scripts/plan_docs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    page = (REPO / mod.PAGE).read_text()
    assert page == mod.render(page), "docs/fine-tuning-memory.md is stale: run " \
        "python scripts/plan_docs.py"
    # The matrix's cells come from the function the command calls; one against the command.
    doc = json.loads(mod.run("lmforge plan --mode qlora --shape 8b --device cpu "
                             "--device-gb 64 --json"))
    want = mod.cell("8b", "qlora", "cpu", 64)
    for d in (doc, want):  # params.yaml's init choice: no bytes depend on it
        d["model"].pop("zero_init_proj")
    assert {k: doc[k] for k in want} == want


def test_auto_loss_in_a_fine_tuning_plan_is_chunked_on_cpu_and_plain_where_it_fits():
    t = tune("1b")
    plain = dataclasses.replace(t, setup=dataclasses.replace(t.setup, fused_loss=False))
    need = ft.total_bytes(plain, 2)
    assert ft.auto_fused_loss(t, 2, need) is False
    assert ft.auto_fused_loss(t, 2, need - 1) is True
    assert ft.auto_fused_loss(dataclasses.replace(t, device="cpu"), 2, 10 * need) is True
