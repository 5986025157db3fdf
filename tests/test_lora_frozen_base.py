"""A LoRA run's frozen base held in 16 bits (model/frozen.py): what it holds in which
dtype, that it computes as its rounded weights do, merging back to fp32, checkpoints of
adapters only, bit-identical resume, activation checkpointing with adapters."""

from __future__ import annotations

import copy
import dataclasses
import importlib.util

import pytest
import torch
from test_train_loop import make_inputs, run, tiny_params

from lmforge.config import LoraConfig, ModelConfig
from lmforge.errors import ConfigError
from lmforge.model.frozen import (
    compile_step_model,
    frozen_dtype,
    hold_frozen_in,
    is_nf4,
    resolve_base_dtype,
    restore_fp32,
)
from lmforge.model.llama import Llama
from lmforge.model.lora import apply_lora, lora_modules, merge_lora
from lmforge.model.saved import load_checkpoint_model, save_model
from lmforge.train import checkpoint as ckpt
from lmforge.train import runs
from lmforge.train.compiler import compile_support

CFG = ModelConfig(n_layer=2, n_head=4, n_embd=64, seq_len=32)


def adapted(targets=("attn",), seed: int = 0) -> Llama:
    """A tiny model with adapters whose B is not zero (so the adapters matter)."""
    torch.manual_seed(seed)
    model = Llama(CFG, 300)
    apply_lora(model, 4, 8.0, 0.0, targets)
    with torch.no_grad():
        for m in lora_modules(model).values():
            m.lora_b.normal_(0, 0.05)
    return model


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return make_inputs(tmp_path_factory.mktemp("repo"))


@pytest.fixture(scope="module")
def base_dir(inputs, tmp_path_factory):
    root = tmp_path_factory.mktemp("base")
    base = run(tiny_params(max_steps=4, eval_every=0), inputs, root / "ck")
    save_model(base.model, root / "base", tokenizer_sha256="t" * 64)
    return root / "base"


def test_only_frozen_matrices_go_to_16_bits():
    model = adapted(targets=("attn",))
    frozen = {id(p): p for p in model.parameters() if not p.requires_grad and p.dim() >= 2}
    expected = sum(p.numel() * 2 for p in frozen.values())
    assert hold_frozen_in(model, "bf16") == expected
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert p.dtype == torch.float32 and "lora_" in name, name
        elif p.dim() >= 2:  # frozen matrices: attention bases, the MLP, the tied table
            assert p.dtype == torch.bfloat16, name
        else:  # norm gains stay fp32
            assert p.dtype == torch.float32, name
    assert model.lm_head.weight is model.tok_embeddings.weight  # still tied
    assert frozen_dtype(model) == "bf16"
    assert hold_frozen_in(adapted(), "fp32") == 0


@pytest.mark.parametrize("fused_loss", [True, False])
def test_a_16_bit_base_computes_in_fp32_as_its_rounded_weights_do(fused_loss):
    model = adapted(targets=("attn", "mlp"))
    reference = copy.deepcopy(model)
    with torch.no_grad():  # the same weights, rounded to bf16 and kept in fp32
        for p in reference.parameters():
            if not p.requires_grad and p.dim() >= 2:
                p.copy_(p.bfloat16().float())
    hold_frozen_in(model, "bf16")
    x, y = torch.randint(0, 300, (2, 2, 16))
    for m in (model, reference):
        m.fused_loss = fused_loss
    out = model(x, y)[1]
    ref = reference(x, y)[1]
    assert torch.equal(out, ref)  # the same fp32 arithmetic, to the bit
    out.backward()
    ref.backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        if p.requires_grad:
            assert torch.equal(p.grad, q.grad), name
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))


def test_merging_a_16_bit_base_gives_an_fp32_model_equal_to_the_unmerged():
    model = adapted(targets=("attn", "mlp"))
    hold_frozen_in(model, "bf16")
    merged = restore_fp32(merge_lora(copy.deepcopy(model)))
    assert all(p.dtype == torch.float32 for p in merged.parameters())
    assert type(merged.layers[0].mlp.w2) is torch.nn.Linear  # plain layers again
    assert not lora_modules(merged)
    x = torch.randint(0, 300, (2, 16))
    with torch.no_grad():
        diff = (merged.eval()(x) - model.eval()(x)).abs().max().item()
    assert diff < 1e-5  # fp32 rounding of W + BA against W x + B A x


def test_auto_is_fp32_on_a_cpu_and_fsdp_refuses_a_16_bit_base():
    assert resolve_base_dtype("auto", torch.device("cpu")) == "fp32"
    assert resolve_base_dtype("bf16", torch.device("cpu")) == "bf16"
    assert resolve_base_dtype("auto", torch.device("cpu"), "fsdp") == "fp32"
    with pytest.raises(ConfigError, match=r"^dpo\.lora\.base_dtype: bf16 with strategy: fsdp"):
        resolve_base_dtype("bf16", torch.device("cpu"), "fsdp", "dpo.lora.base_dtype")


def test_activation_checkpointing_with_adapters_equals_without():
    model = adapted(targets=("attn", "mlp"))
    hold_frozen_in(model, "bf16")
    other = copy.deepcopy(model)
    other.activation_checkpointing = True
    x, y = torch.randint(0, 300, (2, 2, 16))
    losses = []
    for m in (model, other):
        m.train()
        loss = m(x, y)[1]
        loss.backward()
        losses.append(loss)
    assert torch.equal(losses[0], losses[1])
    for (name, p), q in zip(model.named_parameters(), other.parameters(), strict=True):
        if p.requires_grad:
            assert torch.allclose(p.grad, q.grad, atol=1e-7), name


def test_a_bf16_base_lora_run_checkpoints_adapters_only_and_resumes_bit_identically(
        inputs, base_dir, tmp_path):
    lora = LoraConfig(rank=4, alpha=8.0, targets=["attn", "mlp"], base_dtype="bf16")
    params = tiny_params(max_steps=6, eval_every=0, ckpt_every=3, init_from=str(base_dir),
                         lora=lora, max_lr=1e-2)
    tuned = run(params, inputs, tmp_path / "ck")
    assert frozen_dtype(tuned.model) == "bf16"
    run_dir = tmp_path / "ck" / runs.run_id(tuned.fingerprint)
    state = ckpt.read_checkpoint(run_dir / "step-000006.pt")
    trained = {n for n, p in tuned.model.named_parameters() if p.requires_grad}
    assert set(state["model"]) == trained  # no copy of the base
    assert len(state["optimizer"]["state"]) == len(trained)  # no state for frozen weights
    assert state["base"] == str(base_dir) and state["lora"]["rank"] == 4
    # A checkpoint file is still a model `lmforge generate --model` reads: base + adapters.
    merged = restore_fp32(merge_lora(copy.deepcopy(tuned.model)))
    loaded, _ = load_checkpoint_model(run_dir / "step-000006.pt")
    x = torch.randint(0, 300, (1, 16))
    with torch.no_grad():
        assert (loaded(x) - merged.eval()(x)).abs().max() < 1e-5
    # Killed after step 3: the resumed run's adapters equal the unbroken run's, to the bit.
    (run_dir / "step-000006.pt").unlink()
    logs: list[str] = []
    resumed = run(params, inputs, tmp_path / "ck", logs)
    assert any("resuming from" in line and "step-000003" in line for line in logs)
    for name, tensor in tuned.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[name], tensor), name


def test_the_base_dtype_enters_a_run_identity_only_when_not_fp32():
    def identity(dtype):
        cfg = tiny_params(lora=LoraConfig(rank=4, base_dtype=dtype)).train
        return ckpt.run_identity(CFG, cfg, 1, {}, {}, "t" * 64)

    assert "base_dtype" not in identity("fp32")["train"]["lora"]  # as runs before the key
    assert identity("bf16")["train"]["lora"]["base_dtype"] == "bf16"
    assert ckpt.fingerprint_of(identity("bf16")) != ckpt.fingerprint_of(identity("fp32"))


def test_a_lora_dpo_reference_is_held_as_the_policy_base(base_dir):
    from types import SimpleNamespace

    from test_train_loop import CPU

    from lmforge.config import DpoConfig, Params
    from lmforge.train.dpo import make_objective

    data = SimpleNamespace(train=SimpleNamespace(doc_ends=[2, 4]),
                           val=SimpleNamespace(doc_ends=[2]))
    for dtype, want in (("bf16", "bf16"), ("fp32", "fp32")):
        params = Params(dpo=DpoConfig(init_from=str(base_dir),
                                      lora=LoraConfig(rank=4, base_dtype=dtype)))
        objective = make_objective(params, Params(model=CFG), data, CPU)
        assert frozen_dtype(objective.reference) == want


# --------------------------------------------------------------------------- compiled


def _compiled_saved_bytes(dtype: str) -> int:
    """Bytes the compiled training forward saves for backward that are not the model's
    own tensors (the pack hook sees what AOTAutograd's compiled function saves), on one
    block with adapters on attention and MLP. Dynamo starts afresh, as in a training
    process: after another compile of the same code it would recompile with dynamic
    shapes, a different graph to partition."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Llama(dataclasses.replace(CFG, n_layer=1), 300)
    apply_lora(model, 4, 8.0, 0.0, ("attn", "mlp"))
    hold_frozen_in(model, dtype)
    step_model = compile_step_model(model, model, None)  # fp32 compute, as on a CPU
    own = {p.untyped_storage().data_ptr() for p in model.parameters() if not is_nf4(p)}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not is_nf4(t) and t.untyped_storage().data_ptr() not in own:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    x, y = torch.randint(0, 300, (2, 2, 32), generator=torch.Generator().manual_seed(1))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = step_model(x, y)[1]
    loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    return sum(seen.values())


@pytest.fixture(scope="module")
def fp32_saved_bytes() -> int:
    return _compiled_saved_bytes("fp32")


@pytest.mark.skipif(compile_support(torch.device("cpu")) is not None,
                    reason="torch.compile cannot build here")
@pytest.mark.parametrize("dtype", ["bf16", pytest.param("nf4", marks=pytest.mark.skipif(
    importlib.util.find_spec("torchao") is None, reason="torchao is not installed"))])
def test_compiled_step_keeps_no_cast_copy_of_a_16_bit_or_nf4_base(dtype, fp32_saved_bytes):
    """Inductor's partitioner would save the fp32 (dequantised) copy of every frozen
    matrix for backward (it did: their bytes on top of an fp32 base's); compile_step_model
    makes backward recompute it, so a 16-bit or NF4 base saves no more than fp32 does."""
    assert _compiled_saved_bytes(dtype) <= fp32_saved_bytes


@pytest.mark.parametrize("dtype", ["fp32", "bf16", pytest.param("nf4", marks=pytest.mark.skipif(
    importlib.util.find_spec("torchao") is None, reason="torchao is not installed"))])
def test_a_lora_model_traces_as_one_graph(dtype):
    """Dynamo traces the adapted model, whatever its base is held in, as one graph, the
    chunked loss included (one custom-op node). A check Dynamo cannot trace in the
    frozen Linear (is_nf4 once walked the type's MRO) split it at every layer: ~5 graphs
    a layer."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Llama(dataclasses.replace(CFG, n_kv_head=2), 300)  # GQA, as SmolLM2
    apply_lora(model, 4, 8.0, 0.0, ("attn", "mlp"))
    hold_frozen_in(model, dtype)
    x = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(1))
    for args in ((x,), (x, x.roll(-1, 1))):  # logits; the training loss
        torch._dynamo.reset()
        explained = torch._dynamo.explain(model)(*args)
        assert (explained.graph_count, explained.graph_break_count) == (1, 0)
        assert explained.break_reasons == []
