"""Which loss a training run computes: ``train.fused_loss`` resolved for its device.

``true`` is the chunked loss (:func:`lmforge.model.loss.linear_cross_entropy`, a custom
op: one node of a compiled graph), ``false`` the plain logits and ``cross_entropy``.
``auto`` (the default) is the chunked loss on a CPU, where it is both faster and a
fraction of the memory (bench/RESULTS.md), and on CUDA the fastest path that fits,
measured once by a short timed probe: forward + backward of a head of the model's shape
(its dtype, trained or frozen as the model's) over the run's micro-batch of tokens,
under the run's autocast and compiled where its step is, for

- ``chunked``: the custom op;
- ``whole``: the custom op in one chunk of the whole micro-batch, where its Triton kernel
  runs (CUDA) and the micro-batch is more than one default chunk, on the plain loss's
  condition below (it holds as many logits, in 16 bits);
- ``plain``: the whole logits and ``cross_entropy``, fused by Inductor inside the compiled
  graph; a candidate only where one eager forward + backward of the model itself with
  it fits at the micro-batch while stand-ins for AdamW's moments are held (as
  ``probe_micro_batch`` checks a size; eager keeps more than compiled), since the head
  alone fitting says nothing of the step. Not under FSDP over several ranks, where that
  forward would be a collective that one rank running out of memory would hang;
- ``liger``: Liger-Kernel's fused linear cross-entropy, only where ``liger_kernel`` is
  importable (an optional dependency lmforge does not install).

A path whose probe runs out of memory does not fit. Rank 0 probes and every rank takes
its choice, logged in one line; the run's first line names the path with its precision
and compilation. The choice is not part of the run's identity (the paths agree up to
float rounding), so a resumed run on CUDA may probe its way to another one.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lmforge.config import ModelConfig, TrainConfig
from lmforge.model import loss_kernel
from lmforge.model.compiling import before_compile
from lmforge.model.loss import (
    LIGER,
    WHOLE,
    cross_entropy,
    default_chunk_tokens,
    liger_available,
    liger_linear_cross_entropy,
    linear_cross_entropy,
)
from lmforge.train.distributed import DistEnv
from lmforge.train.precision import Precision
from lmforge.train.probe import oom_free

AUTO = "auto"
# Llama.fused_loss for each path, in the order ties go.
PATHS: dict[str, bool | str] = {"chunked": True, WHOLE: WHOLE, "plain": False, LIGER: LIGER}
PROBE_WARMUP = 2  # calls before timing: compilation, allocator and autotuning warm-up
PROBE_REPEATS = 5  # timed calls; the median counts

LossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class HeadProbe:
    """What the probe times: the head's shape and dtypes, the tokens of a micro-batch,
    and how the step runs (its precision, compiled or not, the loss's options)."""

    vocab: int
    width: int
    tokens: int
    head_dtype: torch.dtype
    head_trains: bool
    hidden_dtype: torch.dtype
    device: torch.device
    precision: Precision
    compiled: bool
    label_smoothing: float = 0.0
    z_loss: float = 0.0


def path_name(fused_loss: bool | str) -> str:
    """The name of a ``Llama.fused_loss`` value: chunked, whole, plain or liger."""
    if fused_loss in (LIGER, WHOLE):
        return str(fused_loss)
    return "chunked" if fused_loss else "plain"


def static_fused_loss(requested: bool | str) -> bool | str:
    """``Llama.fused_loss`` for ``train.fused_loss`` without a probe: ``auto`` is the
    chunked loss (what it is on a CPU, and until a CUDA run has probed)."""
    return PATHS["chunked"] if requested == AUTO else requested


def describe(fused_loss: bool | str, requested: bool | str) -> str:
    """The loss as the run's first log line names it: "chunked loss (auto)"."""
    return f"{path_name(fused_loss)} loss" + (" (auto)" if requested == AUTO else "")


def choose(seconds: dict[str, float | None]) -> tuple[str, str]:
    """(the fastest path that ran, the timings as the log line says them); None is a
    path that did not run (out of memory; Liger's kernel failing). The chunked path when
    none ran, and on a tie."""
    ran = {name: s for name, s in seconds.items() if s is not None}
    order = list(PATHS)
    best = (min(ran, key=lambda name: (ran[name], order.index(name))) if ran
            else "chunked")
    why = ", ".join(f"{name} {s * 1e3:.2f} ms" if s is not None else f"{name} did not run"
                    for name, s in seconds.items())
    return best, why


def loss_fn(name: str, label_smoothing: float, z_loss: float) -> LossFn:
    """``(x, weight, targets) -> loss`` of the path ``name``, as the model computes it."""
    if name == "plain":  # Llama.forward: lm_head, then Llama.loss
        return lambda x, w, t: cross_entropy(F.linear(x, w), t, label_smoothing, z_loss)
    if name == WHOLE:  # Llama.output: one chunk of all the tokens
        return lambda x, w, t: linear_cross_entropy(x, w, t, label_smoothing, z_loss,
                                                    chunk_tokens=max(1, t.numel()))
    fused = liger_linear_cross_entropy if name == LIGER else linear_cross_entropy
    return lambda x, w, t: fused(x, w, t, label_smoothing, z_loss)


def time_path(name: str, probe: HeadProbe) -> float | None:
    """Median seconds of forward + backward of path ``name`` on ``probe``; None when it
    runs out of device memory (or, for the optional Liger kernel, fails at all)."""
    gen = torch.Generator(device=probe.device).manual_seed(0)  # the run's RNG untouched
    fn = loss_fn(name, probe.label_smoothing, probe.z_loss)
    if probe.compiled:
        before_compile()
        fn = torch.compile(fn)
    try:
        return _median_seconds(fn, probe, gen)
    except Exception as e:
        if not isinstance(e, torch.cuda.OutOfMemoryError) and name != LIGER:
            raise
        gc.collect()  # the error's frames hold the failed call's tensors in a cycle
        return None
    finally:
        if probe.device.type == "cuda":
            torch.cuda.empty_cache()


def _median_seconds(fn: LossFn, probe: HeadProbe, gen: torch.Generator) -> float:
    """Median seconds of PROBE_REPEATS calls of forward + backward after the warm-up."""
    p = probe
    x = torch.randn(p.tokens, p.width, device=p.device, generator=gen).to(p.hidden_dtype)
    w = (torch.randn(p.vocab, p.width, device=p.device, generator=gen) * 0.02
         ).to(p.head_dtype).requires_grad_(p.head_trains)
    x.requires_grad_()
    t = torch.randint(p.vocab, (p.tokens,), device=p.device, generator=gen)

    def once() -> None:
        x.grad = w.grad = None
        with p.precision.autocast():
            loss = fn(x, w, t)
        loss.backward()

    times = []
    for i in range(PROBE_WARMUP + PROBE_REPEATS):
        _sync(p.device)
        t0 = time.perf_counter()
        once()
        _sync(p.device)
        if i >= PROBE_WARMUP:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def probe_seconds(names: list[str], probe: HeadProbe) -> dict[str, float | None]:
    """``{path: median seconds or None (out of memory)}`` for each of ``names``."""
    return {name: time_path(name, probe) for name in names}


def plain_step_fits(model: torch.nn.Module, precision: Precision, seq_len: int,
                    micro_batch: int, device: torch.device) -> bool:
    """Whether one eager forward + backward of ``model`` with the plain loss fits at
    ``micro_batch`` while stand-ins for AdamW's two moments of each trained parameter
    are held (AdamW allocates them at its first step). Leaves no gradient behind."""
    gen = torch.Generator(device=device).manual_seed(0)  # the run's RNG untouched
    vocab, before = model.lm_head.weight.shape[0], model.fused_loss

    def step(size: int) -> None:
        reserve = [torch.empty_like(p) for p in model.parameters() if p.requires_grad
                   for _ in range(2)]
        x = torch.randint(vocab, (size, seq_len), device=device, generator=gen)
        model.fused_loss = PATHS["plain"]
        try:
            with precision.autocast():
                _, loss = model(x, x)
            loss.backward()
        finally:
            model.fused_loss = before
            model.zero_grad(set_to_none=True)
            del reserve

    return oom_free(step)(micro_batch)


def candidates(fits: bool, whole: bool = False) -> list[str]:
    """The paths a CUDA probe times: chunked; whole (where ``whole``: see
    :func:`whole_differs`) and plain where the plain step fits; liger where importable."""
    return (["chunked"] + ([WHOLE] if fits and whole else []) + (["plain"] if fits else [])
            + ([LIGER] if liger_available() else []))


def whole_differs(probe: HeadProbe) -> bool:
    """Whether one chunk of the micro-batch is another path than the chunked loss: the
    Triton kernel runs for the probe's head (one chunk of fp32 logits would be the eager
    path's memory at no gain) and the default chunk is smaller than the micro-batch."""
    dtype = probe.precision.autocast_dtype or probe.hidden_dtype
    kernel = loss_kernel.available(probe.device, dtype)
    most = default_chunk_tokens(probe.vocab, probe.device.type, kernel)
    return kernel and probe.tokens > most


def head_probe(cfg: TrainConfig, model: torch.nn.Module, precision: Precision,
               device: torch.device, compiled: bool, tokens: int) -> HeadProbe:
    """The probe of ``model``'s head as the run's step computes its loss: the hidden
    states and the head in the stored dtype (fp32 with autocast; a 16-bit frozen base's
    own), or in bf16 where FSDP gathers the weights in bf16."""
    head = model.lm_head.weight  # under FSDP a DTensor: its shape is the whole head's
    dtype = (torch.bfloat16 if cfg.strategy == "fsdp" and precision.name == "bf16"
             else head.dtype)
    return HeadProbe(int(head.shape[0]), int(head.shape[1]), tokens, dtype, head.requires_grad,
                     dtype, device, precision, compiled, cfg.label_smoothing, cfg.z_loss)


def fused_loss_for_run(cfg: TrainConfig, mcfg: ModelConfig, model: torch.nn.Module,
                       precision: Precision, env: DistEnv, compiled: bool, micro_batch: int,
                       log: Callable[[str], None]) -> bool | str:
    """``Llama.fused_loss`` for this run: ``train.fused_loss`` as given, or ``auto``
    resolved (the chunked loss off CUDA; on CUDA rank 0's probe, logged, and broadcast).
    ``compiled``: whether the step's loss runs inside a compiled graph."""
    device = env.device
    if cfg.fused_loss != AUTO or device.type != "cuda":
        return static_fused_loss(cfg.fused_loss)
    chosen = "chunked"
    if env.is_main:
        probe = head_probe(cfg, model, precision, device, compiled, micro_batch * mcfg.seq_len)
        fits = (not (cfg.strategy == "fsdp" and env.distributed)
                and plain_step_fits(model, precision, mcfg.seq_len, micro_batch, device))
        chosen, why = choose(probe_seconds(candidates(fits, whole_differs(probe)), probe))
        log(f"train: fused_loss auto: {chosen} loss (forward + backward of the head at "
            f"{probe.tokens:,} tokens: {why}"
            + ("" if fits else "; the plain loss does not fit this step") + ")")
    if env.distributed:  # every rank computes its loss alike
        index = torch.tensor([list(PATHS).index(chosen)], device=device)
        dist.broadcast(index, src=0)
        chosen = list(PATHS)[int(index.item())]
    return PATHS[chosen]
