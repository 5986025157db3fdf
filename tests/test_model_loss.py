"""The fused linear cross-entropy against the plain lm_head + cross_entropy path."""

import math
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from lmforge.config import ModelConfig
from lmforge.model.frozen import compile_step_model
from lmforge.model.llama import Llama
from lmforge.model.loss import (
    CHUNK_ELEMENTS,
    MIN_CHUNK_TOKENS,
    balanced_chunk,
    cross_entropy,
    default_chunk_tokens,
    linear_cross_entropy,
)
from lmforge.train.compiler import compile_support

VOCAB = 97


def make(seed: int) -> Llama:
    torch.manual_seed(seed)
    return Llama(ModelConfig(n_layer=2, n_head=4, n_embd=32, seq_len=48, ffn_multiple_of=16),
                 VOCAB)


def _inputs(n: int = 37, c: int = 16, v: int = 50, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, c, generator=g, requires_grad=True)
    w = torch.randn(v, c, generator=g, requires_grad=True)
    t = torch.randint(0, v, (n,), generator=g)
    t[::5] = -100
    return x, w, t


def _loss_and_grads(fn, x, w):
    x.grad = w.grad = None
    loss = fn()
    (3.0 * loss).backward()  # a non-unit incoming gradient, as loss / accum gives
    return loss.detach(), x.grad.clone(), w.grad.clone()


@pytest.mark.parametrize("smoothing,z", [(0.0, 0.0), (0.1, 0.0), (0.0, 1e-2), (0.2, 1e-3)])
@pytest.mark.parametrize("chunk", [1, 8, 37, 100])
def test_fused_equals_plain_loss_and_gradients(smoothing, z, chunk):
    x, w, t = _inputs()
    ref = _loss_and_grads(lambda: cross_entropy(x @ w.t(), t, smoothing, z), x, w)
    got = _loss_and_grads(lambda: linear_cross_entropy(x, w, t, smoothing, z, chunk), x, w)
    for a, b in zip(ref, got, strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def test_ignored_rows_get_no_gradient_and_all_ignored_is_nan():
    x, w, t = _inputs()
    _, gx, _ = _loss_and_grads(lambda: linear_cross_entropy(x, w, t, chunk_tokens=4), x, w)
    assert torch.count_nonzero(gx[t == -100]) == 0
    assert torch.count_nonzero(gx[t != -100].abs().sum(1)) == int((t != -100).sum())
    loss = linear_cross_entropy(x, w, torch.full_like(t, -100))
    assert math.isnan(loss.item())
    assert math.isnan(torch.nn.functional.cross_entropy(x @ w.t(), torch.full_like(t, -100),
                                                        ignore_index=-100).item())


def test_no_grad_path_computes_the_loss_only():
    from torch.utils.flop_counter import FlopCounterMode

    x, w, t = _inputs()
    one_matmul = 2 * x.size(0) * x.size(1) * w.size(0)
    for mode in (torch.no_grad, torch.inference_mode):
        with mode(), FlopCounterMode(display=False) as counter:
            loss = linear_cross_entropy(x, w, t, chunk_tokens=6)
        assert counter.get_total_flops() == one_matmul  # no gradient matmuls
        assert not loss.requires_grad
        assert torch.allclose(loss, cross_entropy(x @ w.t(), t).detach())
    with FlopCounterMode(display=False) as counter:
        linear_cross_entropy(x, w, t, chunk_tokens=6)
    assert counter.get_total_flops() == 3 * one_matmul  # and those of both gradients
    w.requires_grad_(False)  # a frozen head (LoRA): no weight gradient
    with FlopCounterMode(display=False) as counter:
        linear_cross_entropy(x, w, t, chunk_tokens=6)
    assert counter.get_total_flops() == 2 * one_matmul


@pytest.mark.parametrize("bad", [-1, 50])
def test_a_target_outside_the_vocabulary_gives_a_nan_loss(bad):
    x, w, t = _inputs()  # vocabulary of 50
    t[3] = bad
    assert math.isnan(linear_cross_entropy(x, w, t, chunk_tokens=8).item())


def test_fp16_weight_gradient_does_not_overflow_on_a_frequent_target():
    # Half the targets are one token and one hidden coordinate is 20: summed over an
    # 8192-token chunk that exceeds fp16's 65504 unless taken in fp32.
    n, c, v = 8192, 16, 64
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, c, generator=g)
    x[:, 0] = 20.0
    w = (torch.randn(v, c, generator=g) * 0.02).requires_grad_()
    t = torch.randint(0, v, (n,), generator=g)
    t[::2] = 7
    x.requires_grad_()
    ref = _loss_and_grads(lambda: cross_entropy(x @ w.t(), t), x, w)
    with torch.autocast("cpu", dtype=torch.float16):
        got = _loss_and_grads(lambda: linear_cross_entropy(x, w, t, chunk_tokens=n), x, w)
    assert torch.isfinite(got[2]).all()
    assert (got[2] - ref[2]).abs().max() <= 0.01 * ref[2].abs().max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_autocast_stays_close_and_keeps_dtypes(dtype):
    x, w, t = _inputs(n=64, c=32, v=80)
    x32, w32 = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    ref = _loss_and_grads(lambda: cross_entropy(x32 @ w32.t(), t), x32, w32)
    with torch.autocast("cpu", dtype=dtype):
        got = _loss_and_grads(lambda: linear_cross_entropy(x32, w32, t, chunk_tokens=16),
                              x32, w32)
    assert got[1].dtype == torch.float32 and got[2].dtype == torch.float32
    for a, b in zip(ref, got, strict=True):
        assert (a - b).abs().max() <= 0.03 * a.abs().max()


def test_model_fused_loss_matches_unfused_forward():
    idx = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    targets = idx.roll(-1, 1)
    targets[:, -3:] = -100
    out = []
    for fused in (False, True):
        model = make(seed=7).train()
        model.fused_loss, model.z_loss, model.label_smoothing = fused, 1e-3, 0.05
        logits, loss = model(idx, targets)
        assert (logits is None) == fused
        loss.backward()
        out.append((loss.detach(), model.layers[0].attn.wq.weight.grad.clone(),
                    model.lm_head.weight.grad.clone()))
    for a, b in zip(*out, strict=True):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(("tokens", "most", "want"),
                         [(1024, 682, 512), (1024, 1365, 1024), (2048, 523, 512),
                          (4096, 441, 410), (4096, 512, 512), (1000, 1000, 1000), (7, 3, 3), (0, 5, 1)])
def test_balanced_chunk_splits_evenly_into_fewest_chunks(tokens, most, want):
    got = balanced_chunk(tokens, most)
    assert got == want and got <= max(most, 1)
    assert -(-tokens // got) == -(-tokens // most)  # no more chunks than the cap needs


def test_default_chunk_holds_at_least_min_tokens_and_the_budget():
    assert default_chunk_tokens(8192, "cuda") == CHUNK_ELEMENTS["cuda"] // 8192  # 8192
    assert default_chunk_tokens(1024, "cpu") == CHUNK_ELEMENTS["cpu"] // 1024  # 4096
    assert default_chunk_tokens(49152, "cpu") == MIN_CHUNK_TOKENS  # not 85 thin rows
    assert default_chunk_tokens(1 << 20, "cuda") == MIN_CHUNK_TOKENS  # a huge vocabulary
    assert default_chunk_tokens(8192, "mps") == default_chunk_tokens(8192, "cuda")


def test_a_process_that_never_compiles_never_imports_dynamo():
    """Building the model, a fused-loss forward and backward, and an optimizer-free
    evaluation import no torch._dynamo / torch._inductor (1.4 s a process): evaluation
    stages and the CLI never compile."""
    code = textwrap.dedent("""
        import sys, torch
        from lmforge.config import ModelConfig
        from lmforge.model.llama import Llama
        from lmforge.train.loop import make_reproducible
        make_reproducible(torch.device("cpu"))
        model = Llama(ModelConfig(n_layer=1, n_head=2, n_embd=16, seq_len=8), 50)
        x = torch.randint(0, 50, (2, 8))
        model(x, x)[1].backward()
        assert torch.are_deterministic_algorithms_enabled()
        print(sorted(m for m in ("torch._dynamo", "torch._inductor") if m in sys.modules))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]", out


needs_compile = pytest.mark.skipif(compile_support(torch.device("cpu")) is not None,
                                   reason="torch.compile cannot build here")


@needs_compile
@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("doc_mask", [False, True])
def test_the_compiled_training_forward_has_no_graph_break(autocast, doc_mask):
    """The step's compiled module (compile_step_model, as the loop builds it) traces the
    training forward with targets as one graph: the chunked loss is one node of it (the
    custom op lmforge::linear_cross_entropy), not a break to an eager function."""
    import torch._dynamo

    model = make(3).train()
    x = torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(4))
    extra = {"positions": torch.arange(48).remainder(20).repeat(2, 1)} if doc_mask else {}
    step_model = compile_step_model(model, model, None)
    torch._dynamo.reset()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        explained = torch._dynamo.explain(step_model)(x, x.roll(-1, 1), **extra)
    assert [str(b.reason) for b in explained.break_reasons] == []
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    ops = [n.target for g in explained.graphs for n in g.graph.nodes]
    assert torch.ops.lmforge.linear_cross_entropy in ops


@needs_compile
def test_the_compiled_loss_equals_the_eager_one():
    """Compiled, the op runs the eager arithmetic: the same bits from the same inputs;
    and the compiled model's loss and gradients match the eager model's."""
    torch._dynamo.reset()
    x, w, t = _inputs(n=64, c=32, v=80)
    eager = _loss_and_grads(lambda: linear_cross_entropy(x, w, t, 0.1, 1e-3, 16), x, w)
    compiled_fn = torch.compile(linear_cross_entropy)
    compiled = _loss_and_grads(lambda: compiled_fn(x, w, t, 0.1, 1e-3, 16), x, w)
    for a, b in zip(eager, compiled, strict=True):
        assert torch.equal(a, b)
    model = make(5).train()
    idx = torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(6))
    results = []
    for step_model in (model, compile_step_model(model, model, None)):
        model.zero_grad(set_to_none=True)
        loss = step_model(idx, idx.roll(-1, 1))[1]
        loss.backward()
        results.append((loss.detach(), model.layers[0].attn.wq.weight.grad.clone(),
                        model.lm_head.weight.grad.clone()))
    for a, b in zip(*results, strict=True):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)


def test_every_compile_site_calls_before_compile():
    """A torch.compile without before_compile() would miss the deterministic-kernels
    flag: every file that compiles calls it."""
    root = Path(__file__).resolve().parents[1]
    sites = [p for d in ("src", "bench", "scripts", "stages") for p in (root / d).rglob("*.py")
             if re.search(r"torch\.compile\(|\.compile\(\)", p.read_text(encoding="utf-8"))]
    assert sites  # frozen.py, fsdp.py and the benches compile
    assert [p.name for p in sites if "before_compile()" not in p.read_text(encoding="utf-8")
            ] == []
