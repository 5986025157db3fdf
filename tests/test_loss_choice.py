"""``train.fused_loss``: auto resolved per device (the CUDA probe's choice with its timings
and out-of-memory monkeypatched, so no GPU is needed), the paths it picks between equal
to each other, and Liger-Kernel's path behind the same guards (a stand-in module)."""

from __future__ import annotations

import math
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from lmforge.config import ModelConfig, TrainConfig
from lmforge.config.loader import from_dict
from lmforge.errors import ConfigError
from lmforge.model import loss_kernel
from lmforge.model.llama import Llama
from lmforge.model.loss import (
    LIGER,
    WHOLE,
    cross_entropy,
    liger_linear_cross_entropy,
    linear_cross_entropy,
)
from lmforge.train import loss_choice as lc
from lmforge.train.compiler import compile_support
from lmforge.train.distributed import DistEnv
from lmforge.train.precision import Precision

VOCAB = 97
MCFG = ModelConfig(n_layer=2, n_head=4, n_embd=32, seq_len=48, ffn_multiple_of=16)
CPU = DistEnv(0, 1, 0, torch.device("cpu"))
CUDA = DistEnv(0, 1, 0, torch.device("cuda"))  # only named: nothing runs on it here
FP32 = Precision("fp32", "cpu")


def make(seed: int = 0) -> Llama:
    torch.manual_seed(seed)
    return Llama(MCFG, VOCAB)


def resolve(requested, env=CPU, log=None, model=None):
    cfg = TrainConfig(fused_loss=requested, micro_batch_size=2)
    return lc.fused_loss_for_run(cfg, MCFG, model or make(), FP32, env, True, 2,
                                 log if log is not None else (lambda _: None))


# --------------------------------------------------------------------------- the config


def test_the_config_takes_auto_true_false_and_names_a_bad_value_in_one_line():
    assert TrainConfig().fused_loss == "auto"  # the library default
    for value in ("auto", True, False):
        assert from_dict(TrainConfig, {"fused_loss": value}, "train.").fused_loss == value
    with pytest.raises(ConfigError) as e:
        from_dict(TrainConfig, {"fused_loss": "fast"}, "train.")
    assert str(e.value) == "train.fused_loss: 'fast' is not one of auto, True, False"


# --------------------------------------------------------------------------- resolution


def test_auto_on_a_cpu_is_the_chunked_loss_without_a_probe(monkeypatch):
    def no_probe(*_):
        raise AssertionError("a CPU run does not probe")

    monkeypatch.setattr(lc, "probe_seconds", no_probe)
    monkeypatch.setattr(lc, "plain_step_fits", no_probe)
    assert resolve("auto") is True
    assert lc.describe(True, "auto") == "chunked loss (auto)"


@pytest.mark.parametrize("env", [CPU, CUDA])
def test_true_and_false_are_taken_as_given_on_any_device(monkeypatch, env):
    monkeypatch.setattr(lc, "probe_seconds", lambda *_: pytest.fail("probed"))
    assert resolve(True, env) is True and resolve(False, env) is False
    assert lc.describe(False, False) == "plain loss"


@pytest.mark.parametrize(("fits", "liger", "seconds", "want"), [
    (True, False, {"chunked": 0.020, "plain": 0.008}, False),
    (True, False, {"chunked": 0.008, "plain": 0.020}, True),
    (True, True, {"chunked": 0.020, "plain": 0.010, LIGER: 0.006}, LIGER),
    (True, False, {"chunked": 0.020, "plain": None}, True),  # plain ran out of memory
    (False, False, {"chunked": 0.020}, True),  # plain does not fit the step: not timed
    (True, True, {"chunked": 0.010, "plain": 0.010, LIGER: 0.010}, True),  # a tie
    (True, False, {"chunked": 0.020, WHOLE: 0.006, "plain": 0.008}, WHOLE),
    (True, False, {"chunked": 0.020, WHOLE: 0.009, "plain": 0.008}, False),
    (True, False, {"chunked": 0.009, WHOLE: 0.009, "plain": 0.009}, True),  # a tie
    (True, False, {"chunked": 0.020, WHOLE: None, "plain": 0.010}, False),  # out of memory
])
def test_auto_on_cuda_takes_the_fastest_path_that_ran(monkeypatch, fits, liger, seconds, want):
    timed: list[list[str]] = []

    def fake_probe(names, probe):
        timed.append(list(names))
        assert (probe.vocab, probe.width, probe.tokens) == (VOCAB, 32, 2 * MCFG.seq_len)
        assert probe.compiled and probe.head_trains and probe.hidden_dtype == torch.float32
        return {name: seconds[name] for name in names}

    monkeypatch.setattr(lc, "plain_step_fits", lambda *_: fits)
    monkeypatch.setattr(lc, "liger_available", lambda: liger)
    monkeypatch.setattr(lc, "whole_differs", lambda _probe: WHOLE in seconds)
    monkeypatch.setattr(lc, "probe_seconds", fake_probe)
    lines: list[str] = []
    got = resolve("auto", CUDA, lines.append)
    assert got == want and type(got) is type(want)
    assert timed == [[n for n in seconds if n not in ("plain", WHOLE) or fits]]
    assert len(lines) == 1 and lines[0].startswith(
        f"train: fused_loss auto: {lc.path_name(want)} loss (")
    if not fits:
        assert "the plain loss does not fit this step" in lines[0]
    if seconds.get("plain", 0) is None:
        assert "plain did not run" in lines[0]


def test_whole_is_timed_only_where_one_chunk_is_another_path(monkeypatch):
    """One chunk of the micro-batch differs from the chunked loss where the Triton kernel
    runs (CUDA) and the micro-batch is more than one default chunk; the plain loss's fit
    decides for it too (it holds as many logits)."""
    def probe(tokens: int, device: str = "cuda", vocab: int = 50304) -> lc.HeadProbe:
        return lc.HeadProbe(vocab, 768, tokens, torch.float32, True, torch.float32,
                            torch.device(device), Precision("bf16", device), True)

    monkeypatch.setattr(loss_kernel, "available",
                        lambda device, dtype: device.type == "cuda" and dtype == torch.bfloat16)
    most = (1 << 28) // 50304  # the kernel's default chunk: 5,336 tokens
    assert lc.whole_differs(probe(16 * 1024)) and lc.whole_differs(probe(most + 1))
    assert not lc.whole_differs(probe(most))  # the default chunk is already all of it
    assert not lc.whole_differs(probe(16 * 1024, "cpu"))  # no kernel: fp32 logits, no gain
    assert lc.candidates(True, True) == ["chunked", WHOLE, "plain"]
    assert lc.candidates(False, True) == ["chunked"]
    assert lc.candidates(True, False) == ["chunked", "plain"]
    assert lc.path_name(WHOLE) == "whole" and lc.describe(WHOLE, "auto") == "whole loss (auto)"


def test_choose_names_every_timing_and_falls_back_to_chunked():
    assert lc.choose({"chunked": 0.0021, "plain": 0.0012}) == (
        "plain", "chunked 2.10 ms, plain 1.20 ms")
    assert lc.choose({"chunked": None, "plain": None})[0] == "chunked"


# --------------------------------------------------------------------------- the probe


def _probe(compiled: bool = False) -> lc.HeadProbe:
    return lc.HeadProbe(VOCAB, 32, 64, torch.float32, True, torch.float32,
                        torch.device("cpu"), FP32, compiled, 0.1, 1e-3)


def test_the_probe_times_each_path_it_is_given():
    seconds = lc.probe_seconds(["chunked", "plain"], _probe())
    assert set(seconds) == {"chunked", "plain"}
    assert all(s is not None and 0 < s < 10 for s in seconds.values())


@pytest.mark.skipif(compile_support(torch.device("cpu")) is not None,
                    reason="torch.compile cannot build here")
def test_the_probe_compiles_the_plain_path_as_the_step_does():
    torch._dynamo.reset()
    seconds = lc.probe_seconds(["plain"], _probe(compiled=True))
    assert seconds["plain"] is not None and seconds["plain"] > 0


def test_out_of_memory_is_does_not_fit_and_only_liger_may_fail_otherwise(monkeypatch):
    def failing(error):
        def fn(x, w, t):
            raise error
        return lambda *_: fn

    monkeypatch.setattr(lc, "loss_fn", failing(torch.cuda.OutOfMemoryError("oom")))
    assert lc.time_path("plain", _probe()) is None
    monkeypatch.setattr(lc, "loss_fn", failing(RuntimeError("triton")))
    assert lc.time_path(LIGER, _probe()) is None  # an optional kernel failing: not chosen
    with pytest.raises(RuntimeError):
        lc.time_path("chunked", _probe())  # lmforge's own path failing is a bug: raised


def test_the_fit_check_runs_the_model_with_the_plain_loss_and_leaves_it_as_it_was(
        monkeypatch):
    model = make()
    seen = []
    forward = Llama.forward

    def spy(self, idx, targets=None, **kw):
        seen.append((self.fused_loss, tuple(idx.shape)))
        return forward(self, idx, targets, **kw)

    monkeypatch.setattr(Llama, "forward", spy)
    assert lc.plain_step_fits(model, FP32, MCFG.seq_len, 3, torch.device("cpu")) is True
    assert seen == [(False, (3, MCFG.seq_len))]
    assert model.fused_loss is True and all(p.grad is None for p in model.parameters())

    def oom(self, *a, **kw):
        raise torch.cuda.OutOfMemoryError("oom")

    monkeypatch.setattr(Llama, "forward", oom)
    assert lc.plain_step_fits(model, FP32, MCFG.seq_len, 3, torch.device("cpu")) is False
    assert model.fused_loss is True


# --------------------------------------------------------------------------- the paths


def _model_loss_and_grads(fused_loss, idx, targets):
    model = make(7).train()
    model.fused_loss, model.z_loss, model.label_smoothing = fused_loss, 1e-3, 0.05
    logits, loss = model(idx, targets)
    loss.backward()
    return logits, (loss.detach(), model.layers[0].attn.wq.weight.grad.clone(),
                    model.lm_head.weight.grad.clone())


def test_auto_on_cpu_trains_the_chunked_path_and_it_equals_the_plain_one():
    idx = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    targets = idx.roll(-1, 1)
    targets[:, -3:] = -100
    logits, auto = _model_loss_and_grads(resolve("auto"), idx, targets)
    assert logits is None  # the chunked op: no logits built
    logits, plain = _model_loss_and_grads(resolve(False), idx, targets)
    assert logits is not None
    for a, b in zip(auto, plain, strict=True):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)


class _FakeLigerLoss:
    """Liger-Kernel's class as lmforge calls it, computed with the plain loss; it
    refuses a target its kernel would read out of bounds."""

    def __init__(self, ignore_index, label_smoothing, lse_square_scale, reduction):
        assert (ignore_index, reduction) == (-100, "mean")
        self.smoothing, self.z = label_smoothing, lse_square_scale

    def __call__(self, weight, x, targets):
        kept = targets[targets != -100]
        assert bool(((kept >= 0) & (kept < weight.size(0))).all()), "out-of-range target"
        return cross_entropy(F.linear(x, weight), targets, self.smoothing, self.z)


@pytest.fixture
def fake_liger(monkeypatch):
    package = types.ModuleType("liger_kernel")
    transformers = types.ModuleType("liger_kernel.transformers")
    transformers.LigerFusedLinearCrossEntropyLoss = _FakeLigerLoss
    package.transformers = transformers
    monkeypatch.setitem(sys.modules, "liger_kernel", package)
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", transformers)


def test_liger_path_keeps_the_guards_and_the_options(fake_liger):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 10, 16, generator=g, requires_grad=True)
    w = torch.randn(50, 16, generator=g, requires_grad=True)
    t = torch.randint(0, 50, (3, 10), generator=g)
    t[:, ::4] = -100
    got = liger_linear_cross_entropy(x, w, t, 0.1, 1e-3)
    want = linear_cross_entropy(x, w, t, 0.1, 1e-3)
    assert torch.allclose(got, want, rtol=1e-5) and got.dtype == torch.float32
    got.backward()
    assert x.grad is not None and w.grad is not None
    for bad in (-1, 50):  # never read by the kernel; the non-finite guard sees NaN
        u = t.clone()
        u[1, 1] = bad
        assert math.isnan(liger_linear_cross_entropy(x, w, u).item())
    assert math.isnan(liger_linear_cross_entropy(x, w, torch.full_like(t, -100)).item())


def test_the_whole_path_is_the_chunked_op_in_one_chunk_and_equals_the_plain_one(
        monkeypatch):
    chunks: list[int] = []
    op = torch.ops.lmforge.linear_cross_entropy

    def spy(*args):
        chunks.append(args[5])
        return op(*args)

    monkeypatch.setattr(torch.ops.lmforge, "linear_cross_entropy", spy)
    idx = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(3))
    targets = idx.roll(-1, 1)
    targets[1, :5] = -100
    logits, whole = _model_loss_and_grads(WHOLE, idx, targets)
    assert logits is None and chunks == [2 * 24]
    _, plain = _model_loss_and_grads(False, idx, targets)
    for a, b in zip(whole, plain, strict=True):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)
    x, w = torch.randn(0, 8), torch.randn(5, 8)  # no tokens at all: NaN, not a zero chunk
    assert math.isnan(lc.loss_fn(WHOLE, 0.0, 0.0)(x, w, torch.zeros(0, dtype=torch.long)))


def test_the_model_computes_the_liger_path_when_it_is_chosen(fake_liger):
    idx = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(2))
    logits, liger = _model_loss_and_grads(LIGER, idx, idx.roll(-1, 1))
    assert logits is None
    _, chunked = _model_loss_and_grads(True, idx, idx.roll(-1, 1))
    for a, b in zip(liger, chunked, strict=True):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_whole_path_in_bf16_equals_the_plain_one():
    """On CUDA the whole path runs the Triton kernel over one chunk of 16-bit logits."""
    cfg = ModelConfig(n_layer=2, n_head=4, n_embd=64, seq_len=256)
    idx = torch.randint(0, 5000, (4, 256), generator=torch.Generator().manual_seed(4)).cuda()
    targets = idx.roll(-1, 1)
    targets[0, :7] = -100
    grads = {}
    for path in (WHOLE, False):
        torch.manual_seed(0)
        model = Llama(cfg, 5000).cuda()
        model.fused_loss = path
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = model(idx, targets)
        loss.backward()
        grads[path] = (loss.detach(), model.lm_head.weight.grad, model.layers[0].attn.wq.weight.grad)
    for a, b in zip(grads[WHOLE], grads[False], strict=True):  # bf16 rounding apart
        a, b = a.float(), b.float()
        assert (a - b).norm() <= 2e-2 * b.norm() and b.norm() > 0
