"""Muon whose Newton-Schulz runs in the dtype that is fast on the device.

``torch.optim.Muon`` orthogonalises every update in bfloat16. That is right on a GPU
and on CPUs with bf16 units (AVX-512 BF16, AMX), where a bf16 matmul is faster than a
float32 one, and ruinous on a CPU without them: there PyTorch's bf16 matmul skips oneDNN
for a slow reference kernel, 15-70x slower than float32 at the demo's shapes, and a Muon
step took 9.6 s against 1.1 s for the forward and backward of its batch (issue 43).

:class:`Muon` is ``torch.optim.Muon`` (same constructor, groups, state and checkpoint
format) with the Newton-Schulz dtype as a per-group option, ``ns_dtype``.
:func:`newton_schulz_dtype` picks it per device, by capability: bfloat16 on CUDA where
supported and on x86 CPUs with bf16 units (AVX-512 BF16, AMX), float32 on other x86 CPUs;
elsewhere a one-off timed probe at the model's matrix shape. The choice is a group option so that it is saved in the optimizer's state dict
and a resumed run continues in the dtype it started with (bit-identical resume), even on
a machine that would choose otherwise; a checkpoint from before the option carries none
and resumes in bfloat16, the dtype it was written with.

On a CPU, float32 evaluates the same polynomial by the spectral form
(:func:`spectral_newton_schulz`): one symmetric eigendecomposition of the small Gram
matrix X X^T and the iteration's scalar recurrence on its eigenvalues, instead of fifteen
matmuls; and the step orthogonalises its matrices side by side, one core each
(:func:`orthogonalize_all`). bfloat16 keeps torch's iteration everywhere.
"""

from __future__ import annotations

import concurrent.futures
import functools
import math
import threading
import time
from collections.abc import Callable, Iterable
from typing import TypeVar

import torch
from torch import Tensor

# Keller Jordan's quintic coefficients and step count, as torch.optim.Muon's defaults.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
LEGACY_NS_DTYPE = "bfloat16"  # what torch.optim.Muon always used
PROBE_MAX_SIDE = 1024  # the probe's matrix is the model's, capped to this per side
PROBE_ROUNDS = 7  # each dtype's fastest round counts
BF16_MARGIN = 0.8  # bf16 only when its probe takes at most this share of float32's
_T = TypeVar("_T")
_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def orthogonalize(update: Tensor, dtype: torch.dtype, coefficients: tuple[float, ...]
                  = NS_COEFFICIENTS, steps: int = NS_STEPS, eps: float = 1e-7) -> Tensor:
    """The quintic Newton-Schulz iteration (Keller Jordan's Muon) of a 2-D ``update``,
    computed in ``dtype``: roughly U V^T of its SVD, singular values pulled towards 1.

    Works on the wide orientation (rows <= cols), so the Gram matrix is the small one,
    and scales by the Frobenius norm first so the spectral norm is at most 1. In
    bfloat16 it is operation for operation torch.optim.Muon's. In float32 on a CPU it
    takes the spectral form (:func:`spectral_orthogonalize`): the same polynomial of
    the same matrix, evaluated another way.
    """
    if use_spectral_form(update.device, dtype):
        return spectral_orthogonalize(update.to(dtype), coefficients, steps, eps)
    return iterated_orthogonalize(update.to(dtype), coefficients, steps, eps)


def iterated_orthogonalize(update: Tensor, coefficients: tuple[float, ...] = NS_COEFFICIENTS,
                           steps: int = NS_STEPS, eps: float = 1e-7) -> Tensor:
    """:func:`newton_schulz` of ``update`` in its own dtype, as torch.optim.Muon takes
    it: turned wide, scaled by its Frobenius norm, iterated, turned back."""
    tall = update.size(0) > update.size(1)
    x = update.T if tall else update
    x = newton_schulz(x / x.norm().clamp(min=eps), coefficients, steps)
    return x.T if tall else x


def newton_schulz(x: Tensor, coefficients: tuple[float, ...], steps: int) -> Tensor:
    """``steps`` quintic iterations on the wide, normalised ``x`` as torch.optim.Muon
    takes them: X <- a X + (b A + c A^2) X with A = X X^T, three matmuls each."""
    a, b, c = coefficients
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)  # b A + c A^2
        x = torch.addmm(x, poly, x, beta=a)  # a X + (b A + c A^2) X
    return x


def spectral_orthogonalize(update: Tensor, coefficients: tuple[float, ...] = NS_COEFFICIENTS,
                           steps: int = NS_STEPS, eps: float = 1e-7) -> Tensor:
    """What :func:`orthogonalize` computes by :func:`newton_schulz` (normalise by the
    Frobenius norm, iterate on the wide orientation), through one eigendecomposition.

    Each iteration multiplies X by a polynomial of G = X X^T, and every such polynomial
    shares G's eigenvectors: with G = V diag(lambda) V^T, ``steps`` iterations make
    X -> V diag(h(lambda)) V^T X, where h is the iteration's gain on a singular value
    sqrt(lambda) (:func:`newton_schulz_gains`). So the fifteen matmuls of five
    iterations become G, one symmetric eigendecomposition (LAPACK's syevd) and two
    matmuls: on two cores of an AVX2 CPU 3.4 against 3.3 ms for 256 x 256 (no gain
    there; on one core each, side by side, it is), 4.1 against 6.7 for 256 x 704, 42
    against 67 for 768 x 768, 70 against 208 for 768 x 3072 (bench/RESULTS.md
    "Spectral Newton-Schulz"). The Frobenius norm is G's trace:
    the normalisation is folded into the eigenvalues and the gains, no pass over X.

    Rounding: G squares the condition number, so a singular value far below the
    largest is resolved worse than by the iteration on X in float32 (5e-3 relative
    error against float64 on the demo's real updates, against 4e-6), yet ten times
    better than torch's bfloat16 iteration that Muon runs on GPUs (5e-2). An
    eigendecomposition that does not converge (a non-finite update) falls back to the
    iteration, which carries the NaN on to the step's guard as before.
    """
    tall = update.size(0) > update.size(1)
    x = update.T if tall else update
    gram = x @ x.T
    try:
        eigenvalues, vectors = torch.linalg.eigh(gram)
    except torch.linalg.LinAlgError:
        return iterated_orthogonalize(update, coefficients, steps, eps)
    eigenvalues = eigenvalues.double()
    norm2 = eigenvalues.sum().clamp(min=eps * eps)  # ||X||_F^2 = trace(G)
    gains = newton_schulz_gains(eigenvalues / norm2, coefficients, steps) / norm2.sqrt()
    q = (vectors * gains.to(x.dtype)) @ vectors.T
    return update @ q if tall else q @ x  # a tall update's X^T Q: already upright


def newton_schulz_gains(eigenvalues: Tensor, coefficients: tuple[float, ...],
                        steps: int) -> Tensor:
    """h(lambda): the factor ``steps`` iterations multiply a singular value
    sigma = sqrt(lambda) by, one per eigenvalue lambda of X X^T (float64).

    One iteration maps sigma to sigma (a + b sigma^2 + c sigma^4), so with s = sigma^2
    the gain is m = a + b s + c s^2, and the next iteration sees s m^2. A polynomial in
    s: the eigenvalues rounding puts a hair below zero are clamped to the zero they
    stand for.
    """
    a, b, c = coefficients
    s = eigenvalues.double().clamp(min=0)
    gain = torch.ones_like(s)
    for _ in range(steps):
        m = a + s * (b + c * s)
        gain *= m
        s *= m * m
    return gain


def use_spectral_form(device: torch.device, dtype: torch.dtype) -> bool:
    """The spectral form in float32 on a CPU, where LAPACK's eigendecomposition is
    cheaper than the iteration's matmuls. bfloat16 stays torch's iteration (to the bit);
    a GPU's eigendecomposition is slow next to its matmuls."""
    return dtype == torch.float32 and device.type == "cpu"


def orthogonalize_all(updates: list[Tensor], dtype: torch.dtype,
                      coefficients: tuple[float, ...] = NS_COEFFICIENTS,
                      steps: int = NS_STEPS, eps: float = 1e-7) -> list[Tensor]:
    """:func:`orthogonalize` of each update, in order; side by side where
    :func:`side_by_side` says."""
    jobs = [functools.partial(orthogonalize, u, dtype, coefficients, steps, eps)
            for u in updates]
    return side_by_side(jobs, [u.shape for u in updates], dtype,
                        updates[0].device if updates else torch.device("cpu"))


def side_by_side(jobs: list[Callable[[], _T]], shapes: list[torch.Size], dtype: torch.dtype,
                 device: torch.device) -> list[_T]:
    """Each job's result, in order: one job per matrix of ``shapes``.

    In the spectral form (float32 on a CPU) each job runs on one thread and the jobs are
    spread over ``torch.get_num_threads()`` workers, the largest first, each worker
    taking the next when it is free: an eigendecomposition gains little from a second
    core (3.1 -> 2.1 ms at 256), a small matmul not all of it, while two at once each
    keep a core busy. One thread a job also makes the result independent of the thread
    count and of which worker ran it, bit for bit. Otherwise the jobs run here, one
    after another.
    """
    if not use_spectral_form(device, dtype):
        return [job() for job in jobs]
    workers = min(torch.get_num_threads(), len(jobs))
    if workers <= 1:  # one thread: here, in order
        return [job() for job in jobs]
    order = sorted(range(len(jobs)), key=lambda i: -_spectral_cost(shapes[i]))
    results = _worker_pool(workers).map(lambda i: jobs[i](), order)  # largest first
    out = dict(zip(order, results, strict=True))
    return [out[i] for i in range(len(jobs))]


def _spectral_cost(shape: torch.Size) -> int:
    """The spectral form's cost for an m x n matrix (m <= n) in multiply-adds of an
    m x m x m matmul: ~9 for the eigendecomposition of the m x m Gram matrix (timed at
    m = 256 on one core: 3.1 ms against 0.33), 1 for Q, 2 n / m for G and Q X."""
    m, n = sorted(int(d) for d in shape[:2])
    return 10 * m ** 3 + 2 * m * m * n


@functools.lru_cache(maxsize=4)
def _worker_pool(workers: int) -> concurrent.futures.ThreadPoolExecutor:
    """A process-wide pool of ``workers`` threads for :func:`side_by_side`, each set to
    one intra-op thread once, as it starts. The setting is the thread's own (its OpenMP
    ICV, MKL's thread-local count), so the caller's stays; setting it around every step
    instead would also clear oneDNN's kernel cache each time (PyTorch's
    ``set_num_threads`` does). PyTorch also keeps the last count set as the default for
    threads started later: once every worker has started, the caller's is set again."""
    threads = torch.get_num_threads()
    pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="muon-ns",
                                                 initializer=_one_thread)
    started = threading.Barrier(workers)
    list(pool.map(lambda _: started.wait(), range(workers)))  # one task each: all start
    torch.set_num_threads(threads)
    return pool


def _one_thread() -> None:
    """This thread's intra-op threads: one. PyTorch sets a thread's count from the
    process default at its first parallel call; asking the count first makes that
    happen now, so that the one set here is not overwritten then."""
    torch.get_num_threads()
    torch.set_num_threads(1)


def adjusted_lr(lr: float, adjust: str | None, shape: torch.Size) -> float:
    """The per-matrix rate: ``original`` x sqrt(max(1, rows / cols)) (Keller Jordan),
    ``match_rms_adamw`` x 0.2 sqrt(max(rows, cols)) (Moonshot), else ``lr``."""
    rows, cols = shape[:2]
    if adjust is None or adjust == "original":
        return lr * math.sqrt(max(1.0, rows / cols))
    if adjust == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr


class Muon(torch.optim.Muon):
    """``torch.optim.Muon`` with the Newton-Schulz dtype a group option (``ns_dtype``:
    ``"bfloat16"`` or ``"float32"``), so it follows the device and is checkpointed."""

    def __init__(self, params: Iterable[Tensor], ns_dtype: str = LEGACY_NS_DTYPE,
                 **kwargs) -> None:
        if ns_dtype not in _DTYPES:
            raise ValueError(f"ns_dtype {ns_dtype!r}: expected one of {sorted(_DTYPES)}")
        super().__init__(params, **kwargs)
        for group in self.param_groups:
            group["ns_dtype"] = ns_dtype

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001, ANN201 - torch.optim's signature
        """One Muon step: momentum as an EMA, Nesterov look-ahead, orthogonalise in the
        group's dtype, decoupled weight decay, the shape-adjusted rate."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            dtype = _DTYPES[group.get("ns_dtype", LEGACY_NS_DTYPE)]
            params = [p for p in group["params"] if p.grad is not None]
            for p in params:  # every state entry made here, not from the workers
                if "momentum_buffer" not in self.state[p]:
                    self.state[p]["momentum_buffer"] = torch.zeros_like(p.grad)
            side_by_side([functools.partial(self._update, p, group, dtype) for p in params],
                         [p.shape for p in params], dtype,
                         params[0].device if params else torch.device("cpu"))
        return loss

    @torch.no_grad()  # grad mode is per thread: a worker's is not the step's
    def _update(self, p: Tensor, group: dict, dtype: torch.dtype) -> None:
        """Muon's update of one matrix ``p`` from its gradient and momentum buffer:
        the buffer as an EMA, Nesterov's look-ahead, orthogonalised, then decoupled
        weight decay and the shape-adjusted rate."""
        buf, momentum = self.state[p]["momentum_buffer"], group["momentum"]
        buf.lerp_(p.grad, 1 - momentum)
        update = p.grad.lerp(buf, momentum) if group["nesterov"] else buf
        update = orthogonalize(update, dtype, group["ns_coefficients"], group["ns_steps"],
                               group["eps"])
        lr = float(group["lr"])
        p.mul_(1 - lr * group["weight_decay"])
        p.add_(update, alpha=-adjusted_lr(lr, group["adjust_lr_fn"], p.shape))


def newton_schulz_dtype(device: torch.device, shape: tuple[int, int]) -> tuple[str, str]:
    """(dtype name, why) for orthogonalising ``shape``-sized matrices on ``device``.

    By capability wherever it is known, so that a machine always makes the same choice
    (a run's outputs must not depend on how busy the machine was): CUDA takes bfloat16
    where the GPU supports it. An x86 CPU takes bfloat16 only with bf16 units (AVX-512
    BF16 or AMX, the units PyTorch's oneDNN bf16 matmul runs on) and kernels allowed to
    use them, float32 otherwise: below AVX-512 (or capped there by
    ``ATEN_CPU_CAPABILITY``) a bf16 matmul is a slow reference kernel, 15-70x float32's;
    on AVX-512 without bf16 units it is emulated, no faster. Other CPUs (ARM's SVE...):
    a timed probe. Other devices: torch's bf16.
    """
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return "bfloat16", "CUDA with bf16"
        return "float32", "CUDA without bf16"
    if device.type != "cpu":
        return LEGACY_NS_DTYPE, f"{device.type}: torch's default"
    capability = torch.backends.cpu.get_cpu_capability()
    units = _x86_bf16_units()
    if capability in ("DEFAULT", "NO AVX", "AVX2") or (capability == "AVX512" and not units):
        return "float32", f"PyTorch's CPU kernels are {capability}, without bf16 units"
    if capability == "AVX512":
        return "bfloat16", f"PyTorch's CPU kernels are AVX512, with {units}"
    side = tuple(min(int(n), PROBE_MAX_SIDE) for n in sorted(shape))
    bf16, fp32 = probe_seconds(side, torch.get_num_threads())
    ratio = bf16 / fp32
    # A wrong bf16 costs 15-70x, a wrong float32 about 2x: bf16 must clearly win.
    name = "bfloat16" if ratio <= BF16_MARGIN else "float32"
    return name, f"a bf16 matmul takes {ratio:.2f}x float32's on this CPU"


def _x86_bf16_units() -> str:
    """The x86 bf16 units this CPU has ("AVX-512 BF16", "AMX", both), or "" (none, not
    x86, or a torch that cannot say)."""
    found = [name for name, check in (("AVX-512 BF16", "_is_avx512_bf16_supported"),
                                      ("AMX", "_is_amx_tile_supported"))
             if getattr(torch.cpu, check, lambda: False)()]
    return " and ".join(found)


@functools.lru_cache(maxsize=8)
def probe_seconds(side: tuple[int, int], threads: int) -> tuple[float, float]:
    """Seconds of one Newton-Schulz iteration (three matmuls) on a ``side`` matrix in
    bf16 and in float32: the fastest of ``PROBE_ROUNDS`` rounds, the two dtypes taking
    turns, so that a busy machine (a run slice taken by another process turns a 1 ms
    matmul into 40 ms) slows both alike and the least disturbed round of each counts.
    Cached per shape and thread count: the answer holds for the process."""
    x = torch.randn(*side, generator=torch.Generator().manual_seed(0))
    inputs = {dtype: x.to(dtype) for dtype in (torch.bfloat16, torch.float32)}
    best = dict.fromkeys(inputs, math.inf)
    for dtype, m in inputs.items():
        orthogonalize(m, dtype, steps=1)  # warm-up: oneDNN builds its kernels once
    for _ in range(PROBE_ROUNDS):
        for dtype, m in inputs.items():
            t0 = time.perf_counter()
            orthogonalize(m, dtype, steps=1)
            best[dtype] = min(best[dtype], time.perf_counter() - t0)
    return best[torch.bfloat16], best[torch.float32]
