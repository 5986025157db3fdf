"""QLoRA (``lora.base_dtype: nf4``, model/frozen.py): the blocks' frozen Linear weights held
as torchao NF4 tensors, computed as their dequantised round trip, adapters alone trained,
merged back to fp32, checkpointed as adapters and resumed bit-identically; the bytes the
fine-tuning plan's qlora row counts; no cast or dequantised copy of a base kept for
backward. The NF4 tests need torchao (``pip install 'lmforge[qlora]'``, in ``dev``) and
skip without it; the refusals run everywhere."""

from __future__ import annotations

import copy
import dataclasses
import importlib.util

import pytest
import torch
from test_train_loop import make_inputs, run, tiny_params

from lmforge.config import LoraConfig, ModelConfig
from lmforge.errors import ConfigError
from lmforge.model import frozen
from lmforge.model.frozen import (
    frozen_dtype,
    hold_frozen_in,
    is_nf4,
    nf4_nbytes,
    resolve_base_dtype,
    restore_fp32,
)
from lmforge.model.llama import Llama
from lmforge.model.lora import apply_lora, lora_modules, merge_lora
from lmforge.model.saved import load_checkpoint_model, save_model
from lmforge.plan import finetune as ft
from lmforge.plan import shapes as sh
from lmforge.train import checkpoint as ckpt
from lmforge.train import runs

# n_embd 128: every block matrix (128x128, 384x128) is a whole number of 64*256 weights.
CFG = ModelConfig(n_layer=2, n_head=4, n_embd=128, seq_len=32)
# n_kv_head 2: wk and wv are 64x128 = 8192 weights, 128 blocks: a scaler block of 128.
GQA = dataclasses.replace(CFG, n_kv_head=2)
# SmolLM2-135M's widths: 576 * 576 is 5,184 blocks of 64 (no whole number of 256s).
SMOL = ModelConfig(n_layer=1, n_head=9, n_kv_head=3, n_embd=576, seq_len=16)
VOCAB = 300
needs_torchao = pytest.mark.skipif(importlib.util.find_spec("torchao") is None,
                                   reason="torchao is not installed (lmforge[qlora])")


def adapted(cfg: ModelConfig = CFG, targets=("attn", "mlp"), seed: int = 0) -> Llama:
    """A tiny model with adapters whose B is not zero (so the adapters matter)."""
    torch.manual_seed(seed)
    model = Llama(cfg, VOCAB)
    apply_lora(model, 4, 8.0, 0.0, targets)
    with torch.no_grad():
        for m in lora_modules(model).values():
            m.lora_b.normal_(0, 0.05)
    return model


def round_trip(model: Llama) -> Llama:
    """A copy whose block Linear weights are replaced by their NF4 round trip (quantised
    from bf16, dequantised, kept fp32): what the NF4-held model should compute."""
    to_nf4 = frozen.nf4_module().to_nf4
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for name, m in ref.named_modules():
            if (type(m) is torch.nn.Linear and name.startswith("layers.")
                    and frozen.nf4_fits(m.weight.numel())):
                block = frozen.nf4_scaler_block(m.weight.numel())
                m.weight.copy_(to_nf4(m.weight.bfloat16(), 64, block).get_original_weight())
    return ref


# --------------------------------------------------------------------------- refusals


def test_nf4_resolves_on_a_cpu_and_fsdp_refuses_it_in_one_line():
    with pytest.raises(ConfigError, match=r"^sft\.lora\.base_dtype: nf4 with strategy: fsdp"):
        resolve_base_dtype("nf4", torch.device("cpu"), "fsdp")
    with pytest.raises(ConfigError, match="auto, fp32, bf16, fp16 or nf4"):
        resolve_base_dtype("int4", torch.device("cpu"))


def test_a_missing_torchao_is_one_line_naming_the_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torchao" else real(name, *a))
    with pytest.raises(ConfigError) as e:
        resolve_base_dtype("nf4", torch.device("cpu"), where="dpo.lora.base_dtype")
    msg = str(e.value)
    assert msg.startswith("dpo.lora.base_dtype: nf4 needs torchao")
    assert "lmforge[qlora]" in msg and "\n" not in msg


# --------------------------------------------------------------------------- the model


@needs_torchao
def test_block_linears_are_nf4_the_adapters_fp32_and_the_rest_fp32_on_a_cpu():
    model = adapted(GQA)
    before = {n: p.numel() * 4 for n, p in model.named_parameters()}
    saved = hold_frozen_in(model, "nf4")
    assert resolve_base_dtype("nf4", torch.device("cpu")) == "nf4"
    assert frozen_dtype(model) == "nf4"
    held = 0
    for name, p in model.named_parameters():
        leaf = name.split(".")[-3] if name.endswith("base.weight") else ""
        if p.requires_grad:
            assert "lora_" in name and p.dtype == torch.float32 and not is_nf4(p), name
        elif leaf in ("wq", "wk", "wv", "wo", "w1", "w2", "w3"):
            scaler_block = 128 if leaf in ("wk", "wv") else 256
            assert is_nf4(p) and (p.block_size, p.scaler_block_size) == (64, scaler_block), name
            assert p.quantized_data.dtype == torch.uint8 and not p.requires_grad
            held += nf4_nbytes(p)
        else:  # embeddings (the tied head), norms: fp32 on a CPU
            assert not is_nf4(p) and p.dtype == torch.float32, name
            held += p.numel() * 4
    adapters = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
    assert saved == sum(before.values()) - adapters - held


@pytest.mark.parametrize(("shape", "block"), [
    ((128, 128), 256), ((64, 128), 128), ((576, 576), 216), ((192, 576), 216),
    ((1536, 576), 256), ((65, 64), 65), ((16, 64), 0), ((257, 64), 0), ((10, 10), 0)])
def test_the_nf4_scaler_block_is_the_largest_divisor_from_256_down_to_32(shape, block):
    numel = shape[0] * shape[1]
    assert frozen.nf4_scaler_block(numel) == block
    assert frozen.nf4_fits(numel) == (block > 0)
    if block:
        assert (numel // 64) % block == 0


@needs_torchao
@pytest.mark.parametrize("cfg", [CFG, GQA, SMOL], ids=["mha", "gqa", "smollm2-widths"])
def test_nf4_bytes_equal_the_plans_qlora_row(cfg):
    model = adapted(cfg, targets=("attn",))
    hold_frozen_in(model, "nf4")
    frozen_ps = [p for p in model.parameters() if not p.requires_grad]
    nf4 = sum(nf4_nbytes(p) for p in frozen_ps if is_nf4(p))
    rest = sum(p.numel() * p.element_size() for p in frozen_ps if not is_nf4(p))
    rows = ft.weight_rows(ft.Tune(sh.Setup(cfg, VOCAB, "fp32"), "qlora", 4, ("wq",)))
    assert (nf4, rest) == (rows["weights"], rows["weights_16"])


@needs_torchao
@pytest.mark.parametrize(("cfg", "fused_loss"), [(GQA, True), (GQA, False), (SMOL, True)],
                         ids=["gqa-fused", "gqa", "smollm2-widths"])
def test_nf4_model_computes_as_its_dequantised_round_trip(cfg, fused_loss):
    """fp32 compute on a CPU: the logits, loss and adapter gradients of the NF4-held model
    equal, to the bit, those of an fp32 model holding the dequantised weights (the NF4
    error itself is the round trip's, a few % of a weight: not what this checks)."""
    model = adapted(cfg)
    if cfg is SMOL:  # every block matrix, 576 wide included, is held in NF4
        hold = copy.deepcopy(model)
        hold_frozen_in(hold, "nf4")
        blocks = [(n, p) for n, p in hold.named_parameters()
                  if n.startswith("layers.") and not p.requires_grad and "norm" not in n]
        assert len(blocks) == 7 and all(is_nf4(p) for _, p in blocks), blocks
    reference = round_trip(model)
    hold_frozen_in(model, "nf4")
    x, y = torch.randint(0, VOCAB, (2, 2, 16))
    for m in (model, reference):
        m.fused_loss = fused_loss
    out, ref = model(x, y)[1], reference(x, y)[1]
    assert torch.equal(out, ref)
    out.backward()
    ref.backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        if p.requires_grad:
            assert p.grad is not None and torch.equal(p.grad, q.grad), name
        else:
            assert p.grad is None, name  # the base gets no gradient
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))


@needs_torchao
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
def test_nf4_under_bf16_autocast_matches_its_round_trip_and_trains_the_adapters(device):
    """Under autocast the NF4 weight is dequantised to bf16 per matmul; the rest is held
    as auto holds it (bf16 on a GPU, fp32 on a CPU)."""
    model = adapted(CFG).to(device)
    reference = round_trip(model)
    hold_frozen_in(model, "nf4")
    rest = {p.dtype for p in model.parameters()
            if not p.requires_grad and not is_nf4(p) and p.dim() >= 2}
    assert rest == {torch.bfloat16 if device == "cuda" else torch.float32}
    x, y = torch.randint(0, VOCAB, (2, 2, 16), device=device)
    losses = []
    for m in (model, reference):
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = m(x, y)[1]
        loss.backward()
        losses.append(loss.item())
    # bf16 matmuls of the same bf16-rounded weights (autocast casts the fp32 reference's):
    # equal up to bf16 rounding of the activations and summation order.
    assert abs(losses[0] - losses[1]) < 1e-2 * abs(losses[1])
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert grads and all(g is not None and g.dtype == torch.float32 and g.abs().sum() > 0
                         for g in grads)
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)


@needs_torchao
@pytest.mark.parametrize(("cfg", "targets"), [(GQA, ("attn", "mlp")), (GQA, ("attn",)),
                                              (SMOL, ("attn", "mlp"))])
def test_merging_an_nf4_base_gives_an_fp32_model_equal_to_the_unmerged(cfg, targets):
    model = adapted(cfg, targets)
    hold_frozen_in(model, "nf4")
    merged = restore_fp32(merge_lora(frozen.copy_model(model)))  # sft.py's save path
    assert all(is_nf4(p) for n, p in model.named_parameters() if n.endswith("wq.base.weight"))
    assert all(p.dtype == torch.float32 and not is_nf4(p) for p in merged.parameters())
    assert type(merged.layers[0].mlp.w2) is torch.nn.Linear and not lora_modules(merged)
    x = torch.randint(0, VOCAB, (2, 16))
    with torch.no_grad():
        diff = (merged.eval()(x) - model.eval()(x)).abs().max().item()
    assert diff < 1e-5  # fp32 rounding of dequant(W) + BA against dequant(W) x + B A x


def _saved_bytes(model: Llama) -> int:
    """Bytes of the tensors autograd saves in one forward that are not the model's own."""
    own = {id(p) for p in model.parameters()}
    storages = {p.untyped_storage().data_ptr() for p in model.parameters() if not is_nf4(p)}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in own and not is_nf4(t):
            s = t.untyped_storage()
            if s.data_ptr() not in storages:
                seen[s.data_ptr()] = s.nbytes()
        return t

    x, y = torch.randint(0, VOCAB, (2, 2, 16), generator=torch.Generator().manual_seed(1))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x, y)
    return sum(seen.values())


@needs_torchao
def test_no_cast_or_dequantised_copy_of_the_base_is_kept_for_backward():
    """fp32 compute on a CPU: a bf16 or NF4 base saves what an fp32 base saves (each
    frozen matmul keeps the stored weight, cast again in backward)."""
    saved = {}
    for dtype in ("fp32", "bf16", "nf4"):
        model = adapted(GQA)
        hold_frozen_in(model, dtype)
        saved[dtype] = _saved_bytes(model)
    assert saved["fp32"] > 0 and saved["bf16"] == saved["fp32"] == saved["nf4"]


# --------------------------------------------------------------------------- a run


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return make_inputs(tmp_path_factory.mktemp("repo"))


def wide(**kw):
    """tiny_params with n_embd 128, so the block matrices fit NF4's blocks."""
    p = tiny_params(**kw)
    return dataclasses.replace(p, model=dataclasses.replace(p.model, n_embd=128))


@pytest.fixture(scope="module")
def base_dir(inputs, tmp_path_factory):
    root = tmp_path_factory.mktemp("base")
    base = run(wide(max_steps=2, eval_every=0), inputs, root / "ck")
    save_model(base.model, root / "base", tokenizer_sha256="t" * 64)
    return root / "base"


def _weights(model: Llama) -> dict[str, torch.Tensor]:
    """The model's tensors, NF4 ones as their codes and scalers."""
    out = {}
    for name, p in model.named_parameters():
        if is_nf4(p):
            out[f"{name}.codes"] = p.quantized_data
            out[f"{name}.scalers"] = p.quantized_scalers
        else:
            out[name] = p.detach()
    return out


@needs_torchao
def test_an_nf4_base_lora_run_checkpoints_adapters_only_and_resumes_bit_identically(
        inputs, base_dir, tmp_path):
    lora = LoraConfig(rank=4, alpha=8.0, targets=["attn", "mlp"], base_dtype="nf4")
    params = wide(max_steps=4, eval_every=0, ckpt_every=2, init_from=str(base_dir),
                  lora=lora, max_lr=1e-2)
    tuned = run(params, inputs, tmp_path / "ck")
    assert frozen_dtype(tuned.model) == "nf4"
    run_dir = tmp_path / "ck" / runs.run_id(tuned.fingerprint)
    state = ckpt.read_checkpoint(run_dir / "step-000004.pt")
    trained = {n for n, p in tuned.model.named_parameters() if p.requires_grad}
    assert set(state["model"]) == trained  # no copy of the base
    assert len(state["optimizer"]["state"]) == len(trained)  # no state for frozen weights
    assert state["base_dtype"] == "nf4" and state["base"] == str(base_dir)
    # `lmforge generate --model step-*.pt`: the base held in NF4 again, merged in fp32.
    merged = restore_fp32(merge_lora(copy.deepcopy(tuned.model)))
    loaded, _ = load_checkpoint_model(run_dir / "step-000004.pt")
    x = torch.randint(0, VOCAB, (1, 16))
    with torch.no_grad():
        assert (loaded(x) - merged.eval()(x)).abs().max() < 1e-5
    # Killed after step 2: the resumed run's adapters (and NF4 base) equal the unbroken
    # run's, to the bit.
    (run_dir / "step-000004.pt").unlink()
    logs: list[str] = []
    resumed = run(params, inputs, tmp_path / "ck", logs)
    assert any("resuming from" in line and "step-000002" in line for line in logs)
    want, got = _weights(tuned.model), _weights(resumed.model)
    assert set(want) == set(got)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
