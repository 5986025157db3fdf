"""The space of mixtures: Dirichlet samples around a center, and which ones the data allows.

A mixture is a row r of D non-negative weights summing to 1 (one per training domain),
the same shares as ``mix.weights``. RegMix samples proxy mixtures (and search candidates)
from a Dirichlet centred on the natural token shares, so most samples are plausible
mixes and a few stray towards the corners.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from lmforge.errors import ConfigError

# Rejection sampling gives up below this acceptance rate: at 1 in 1,000 a million
# candidates already need a billion draws, and the bounds are almost surely a mistake.
MIN_ACCEPTANCE = 1e-3
# Draws made before the acceptance rate is judged (enough to see a 1e-3 rate ~16 times).
_JUDGE_AFTER = 16_384
_MAX_BATCH = 1 << 20


def _bounds_arrays(domains: list[str], bounds: Mapping[str, Sequence[float]] | None
                   ) -> tuple[np.ndarray, np.ndarray]:
    """Per-domain lower and upper weight limits, validated; unnamed domains get [0, 1]."""
    lo, hi = np.zeros(len(domains)), np.ones(len(domains))
    for name, pair in (bounds or {}).items():
        if name not in domains:
            raise ConfigError(f"mixture bounds: unknown domain {name!r}; domains are "
                              f"{', '.join(domains)}")
        try:
            a, b = (float(x) for x in pair)
        except (TypeError, ValueError):
            raise ConfigError(f"mixture bounds.{name}: {pair!r} must be a pair [lo, hi]") from None
        if not 0.0 <= a <= b <= 1.0:
            raise ConfigError(f"mixture bounds.{name}: [{a:g}, {b:g}] must satisfy "
                              f"0 <= lo <= hi <= 1")
        i = domains.index(name)
        lo[i], hi[i] = a, b
    if lo.sum() > 1.0 or hi.sum() < 1.0:
        raise ConfigError(f"mixture bounds: no mixture fits them (sum of lo {lo.sum():g} must be "
                          f"<= 1 <= sum of hi {hi.sum():g})")
    return lo, hi


def _format_bounds(domains: list[str], lo: np.ndarray, hi: np.ndarray) -> str:
    return ", ".join(f"{d} [{a:g}, {b:g}]" for d, a, b in zip(domains, lo, hi, strict=True)
                     if a > 0.0 or b < 1.0)


def sample_mixtures(n: int, domains: list[str], center: Mapping[str, float],
                    concentration: float, bounds: Mapping[str, Sequence[float]] | None,
                    rng: np.random.Generator) -> np.ndarray:
    """n mixtures (n x D, rows sum to 1) from Dirichlet(concentration * center), within bounds.

    ``center`` is normalised, so raw token counts work as well as shares; a domain it
    omits or gives 0 is always 0. Larger ``concentration`` keeps samples closer to the
    center. Rows outside ``bounds``
    ({domain: (lo, hi)}, unnamed domains unbounded) are rejected, never clipped:
    clipping piles mass onto the bound and breaks the sum to 1.
    """
    if len(set(domains)) != len(domains) or not domains:
        raise ConfigError(f"mixture domains: {domains!r} must be a non-empty list of distinct names")
    unknown = sorted(set(center) - set(domains))
    if unknown:
        raise ConfigError(f"mixture center: unknown domain(s) {', '.join(unknown)}; domains are "
                          f"{', '.join(domains)}")
    c = np.array([float(center.get(d, 0.0)) for d in domains])
    if not np.all(np.isfinite(c)) or np.any(c < 0) or not c.sum() > 0:
        raise ConfigError(f"mixture center: {dict(center)!r} must give shares >= 0, not all zero")
    if not concentration > 0 or not np.isfinite(concentration):
        raise ConfigError(f"mixture concentration: {concentration!r} must be a number > 0")
    if n < 0:
        raise ConfigError(f"mixture samples: n={n} must be >= 0")
    lo, hi = _bounds_arrays(domains, bounds)
    # A domain with no share in the center (e.g. no text) stays at exactly 0: the
    # Dirichlet runs over the others, as a zero alpha is not allowed.
    active = c > 0
    for i, d in enumerate(domains):
        if lo[i] > 0 and not active[i]:
            raise ConfigError(f"mixture bounds.{d}: lo {lo[i]:g} > 0, but its center share is "
                              f"0, so no sample gives it any weight")
    alpha = concentration * c[active] / c.sum()

    kept: list[np.ndarray] = []
    have = drawn = 0
    while have < n:
        # Size each batch for what is still missing at the rate seen so far, so a
        # low-but-acceptable rate does not take thousands of tiny rounds.
        rate = max(have / drawn, MIN_ACCEPTANCE) if drawn else 1.0
        batch = int(min(max(2 * (n - have) / rate, 4096), _MAX_BATCH))
        x = np.zeros((batch, len(domains)))
        x[:, active] = rng.dirichlet(alpha, size=batch)
        # Dirichlet rows sum to 1 up to rounding; make it exact so bounds and sums agree.
        x /= x.sum(axis=1, keepdims=True)
        ok = x[np.all((x >= lo) & (x <= hi), axis=1)]
        kept.append(ok)
        have += len(ok)
        drawn += batch
        if drawn >= _JUDGE_AFTER and have / drawn < MIN_ACCEPTANCE:
            raise ConfigError(
                f"mixture bounds {_format_bounds(domains, lo, hi)} accept only "
                f"{have:,} of {drawn:,} Dirichlet draws around the center (concentration "
                f"{concentration:g}): widen the bounds, move the center inside them, or lower "
                f"the concentration")
    if not kept:
        return np.empty((0, len(domains)))
    return np.concatenate(kept)[:n]


def epoch_feasible(mixtures: np.ndarray, available: np.ndarray, train_chars: float,
                   max_epochs: float) -> np.ndarray:
    """Which mixtures (rows) the data can supply without repeating a domain > max_epochs times.

    Domain d is read r_d * train_chars characters from available_d unique ones, i.e.
    r_d * train_chars / available_d epochs. A domain with nothing available is
    infeasible at any share above zero.
    """
    r = np.asarray(mixtures, dtype=np.float64)
    avail = np.asarray(available, dtype=np.float64)
    if r.ndim != 2 or avail.shape != (r.shape[1],):
        raise ValueError(f"epoch_feasible: mixtures {r.shape} and available {avail.shape} "
                         f"must be (m, D) and (D,)")
    if np.any(avail < 0) or not train_chars >= 0 or not max_epochs > 0:
        raise ValueError("epoch_feasible: available and train_chars must be >= 0, "
                         "max_epochs > 0")
    need = r * float(train_chars)
    with np.errstate(divide="ignore", invalid="ignore"):
        epochs = np.where(need > 0, need / avail, 0.0)  # x / 0 -> inf: infeasible
    # A hair of relative slack so a mixture exactly at the limit is not lost to rounding.
    return np.all(epochs <= max_epochs * (1 + 1e-9), axis=1)
