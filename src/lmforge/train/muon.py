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

In float32 a wide-enough matrix (cols >= 1.6 rows, after turning it wide) is orthogonalised
by the Gram form of the same iteration (:func:`gram_newton_schulz`): it iterates on the
small square X X^T instead of the wide X, fewer multiply-adds for the same polynomial.
bfloat16 keeps torch's form everywhere: the Gram form is unstable there.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Iterable

import torch
from torch import Tensor

# Keller Jordan's quintic coefficients and step count, as torch.optim.Muon's defaults.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
LEGACY_NS_DTYPE = "bfloat16"  # what torch.optim.Muon always used
PROBE_MAX_SIDE = 1024  # the probe's matrix is the model's, capped to this per side
PROBE_ROUNDS = 7  # each dtype's fastest round counts
BF16_MARGIN = 0.8  # bf16 only when its probe takes at most this share of float32's
_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
# Gram Newton-Schulz (float32 only): rebuild X and its Gram matrix after this many
# iterations (accuracy, see gram_newton_schulz), and use the Gram form only on matrices
# at least this much wider than tall (it breaks even at 1.5 in multiply-adds).
GRAM_RESTART_EVERY = 3
GRAM_MIN_ASPECT = 1.6


def orthogonalize(update: Tensor, dtype: torch.dtype, coefficients: tuple[float, ...]
                  = NS_COEFFICIENTS, steps: int = NS_STEPS, eps: float = 1e-7) -> Tensor:
    """The quintic Newton-Schulz iteration (Keller Jordan's Muon) of a 2-D ``update``,
    computed in ``dtype``: roughly U V^T of its SVD, singular values pulled towards 1.

    Works on the wide orientation (rows <= cols), so the Gram matrix is the small one,
    and scales by the Frobenius norm first so the spectral norm is at most 1. In
    bfloat16 it is operation for operation torch.optim.Muon's. In float32, a matrix
    wide enough for the Gram form to take fewer multiply-adds (:func:`use_gram_form`)
    takes it: the same polynomial of the same matrix, rounded differently.
    """
    x = update.to(dtype)
    tall = update.size(0) > update.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    if use_gram_form(x.size(0), x.size(1), dtype, steps):
        x = gram_newton_schulz(x, coefficients, steps)
    else:
        x = newton_schulz(x, coefficients, steps)
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


def gram_newton_schulz(x: Tensor, coefficients: tuple[float, ...], steps: int,
                       restart_every: int = GRAM_RESTART_EVERY) -> Tensor:
    """The same iterations as :func:`newton_schulz` on the wide, normalised ``x``
    (m x n, m <= n), computed on its m x m Gram matrix ("Gram Newton-Schulz": Zhang,
    Amsel, Chen and Dao, 2026, who rebuild after two iterations in half precision).

    Each iteration is X_{k+1} = p(G_k) X_k with G_k = X_k X_k^T and p(G) = a I + b G +
    c G^2, so X_k = Q_k X_0 with Q_k = p(G_{k-1}) ... p(G_0); and as p(G_k) commutes with
    G_k, G_{k+1} = p(G_k) G_k p(G_k). Iterating on G and Q (m x m) and multiplying by the
    m x n X once at the end replaces the two m x m x n matmuls of each iteration by three
    m x m x m ones (:func:`gram_is_cheaper`). Rounding errors in G grow by ~a^2 (~12x) per
    iteration on its small eigenvalues, which X X^T recomputed each time does not
    suffer: every ``restart_every`` iterations X is rebuilt (X <- Q X) and G recomputed
    from it. In float32 with 5 iterations, one rebuild after the third (measured with
    Keller Jordan's coefficients: a rebuild after the second errs 4x more) keeps the result
    within a few times the standard iteration's own float32 error, even for singular
    values down to 1e-6 (tests/test_muon_gram.py); bf16 has no such margin.
    """
    a, b, c = coefficients
    gram, q = x @ x.T, None
    for i in range(steps):
        if q is not None and i % restart_every == 0:  # a rebuild: X <- Q X, G <- X X^T
            x = q @ x
            gram, q = x @ x.T, None
        z = torch.addmm(gram, gram, gram, beta=b, alpha=c)  # b G + c G^2 = p(G) - a I
        if q is None:
            q = z.clone()
            q.diagonal().add_(a)  # Q = p(G)
        else:
            q = torch.addmm(q, q, z, beta=a)  # Q p(G): polynomials of one G commute
        if i + 1 < steps and (i + 1) % restart_every != 0:  # G is needed next
            gp = torch.addmm(gram, gram, z, beta=a)  # G p(G)
            gram = torch.addmm(gp, z, gp, beta=a)  # p(G) G p(G)
    return q @ x


def gram_is_cheaper(rows: int, cols: int, steps: int,
                    restart_every: int = GRAM_RESTART_EVERY) -> bool:
    """Whether :func:`gram_newton_schulz` takes fewer multiply-adds than
    :func:`newton_schulz` on a wide ``rows`` x ``cols`` matrix.

    Standard: per iteration X X^T and p(A) X (2 m^2 n) and A^2 (m^3). Gram, per segment
    of L iterations between rebuilds: G = X X^T and Q X (2 m^2 n), L products G^2,
    L - 1 updates of Q and 2 (L - 1) of G ((4 L - 3) m^3). With k segments the Gram form
    saves 2 (steps - k) m^2 n and costs 3 (steps - k) m^3 more: cheaper exactly when
    n > 1.5 m, whatever the steps and rebuilds (and never with one iteration a
    segment). :data:`GRAM_MIN_ASPECT` asks a little more: timed one by one under the AVX2
    cap, the square matmuls run a little slower per multiply-add (break-even ~1.55).
    """
    segments = -(-steps // restart_every)
    standard = steps * (2 * rows * rows * cols + rows ** 3)
    gram = 2 * segments * rows * rows * cols + (4 * steps - 3 * segments) * rows ** 3
    return gram < standard and cols >= GRAM_MIN_ASPECT * rows


def use_gram_form(rows: int, cols: int, dtype: torch.dtype, steps: int) -> bool:
    """The Gram form for a wide ``rows`` x ``cols`` matrix: float32 only (bf16 is
    torch.optim.Muon's to the bit, and the Gram form is unstable there), and only
    where it is cheaper."""
    return dtype == torch.float32 and gram_is_cheaper(rows, cols, steps)


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
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, group, dtype)
        return loss

    def _update(self, p: Tensor, group: dict, dtype: torch.dtype) -> None:
        """Muon's update of one matrix ``p`` from its gradient and momentum buffer."""
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p.grad)
        buf, momentum = state["momentum_buffer"], group["momentum"]
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
