"""Laws from mixture to per-domain validation bits-per-byte, and the search for the best mixture.

Proxies: n tiny models, each trained on a mixture r (a row of R, n x D) and evaluated
on K domains (a row of L, n x K, bits per byte). Two laws map r to L:

- LinearLaw, RegMix (Liu et al. 2024): L_i(r) = sum_j w_ij r_j.
- MixingLaw, Data Mixing Laws (Ye et al. 2024): L_i(r) = c_i + k_i exp(sum_j t_ij r_j).

Each law is scored by how well its leave-one-out predictions RANK the proxies on the
user's objective (what the search needs is the order, not the absolute loss); the best
one predicts the objective over many candidate mixtures, and the mean of the top few
feasible candidates is the recommendation.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import numpy as np
from scipy.optimize import least_squares
from scipy.stats import spearmanr

from lmforge.errors import ConfigError


class Law(Protocol):
    name: str

    def fit(self, R: np.ndarray, L: np.ndarray) -> Law: ...

    def predict(self, R: np.ndarray) -> np.ndarray: ...


def _check_xy(R: np.ndarray, L: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    R, L = np.asarray(R, dtype=np.float64), np.asarray(L, dtype=np.float64)
    if R.ndim != 2 or L.ndim != 2 or len(R) != len(L):
        raise ValueError(f"fit: R {R.shape} and L {L.shape} must be (n, D) and (n, K)")
    if not np.all(np.isfinite(R)):
        raise ValueError("fit: mixtures R must be finite")
    return R, L


# --------------------------------------------------------------------------- laws


class LinearLaw:
    """RegMix's linear law, per target domain i: L_i(r) = sum_j w_ij r_j (no separate intercept).

    Because every row of R sums to 1, an intercept b_i is exactly w_ij -> w_ij + b_i:
    a model with both is not identifiable. Dropping the intercept loses nothing (the same
    functions of r are expressible) and, unlike ridge, adds no shrinkage bias, so the
    fit is plain least squares (the minimum-norm solution when there are fewer proxies
    than domains). Only differences w_ij - w_ik mean anything on their own.
    """

    name = "linear"

    def fit(self, R: np.ndarray, L: np.ndarray) -> LinearLaw:
        """Fit coef_ (K x D); proxies with a non-finite loss are left out of that domain's fit."""
        R, L = _check_xy(R, L)
        self.coef_ = np.zeros((L.shape[1], R.shape[1]))
        for i in range(L.shape[1]):
            ok = np.isfinite(L[:, i])
            if not ok.any():
                raise ValueError(f"LinearLaw: eval domain {i} has no finite loss")
            self.coef_[i] = np.linalg.lstsq(R[ok], L[ok, i], rcond=None)[0]
        return self

    def predict(self, R: np.ndarray) -> np.ndarray:
        """Predicted losses (m x K) for mixtures R (m x D)."""
        return np.asarray(R, dtype=np.float64) @ self.coef_.T


class MixingLaw:
    """The Data Mixing Law, per target domain i: L_i(r) = c_i + k_i exp(sum_j t_ij r_j).

    c_i is the loss no mixture removes (>= 0), k_i > 0 scales the reducible part. As rows
    of R sum to 1, k_i exp(t_i . r) = exp(u_i . r) with u_i = t_i + log k_i, so the fit
    is over (c_i, u_i) only (D + 1 numbers; k > 0 holds by construction) and the reported
    t_i is put in a fixed gauge, sum_j t_ij = 0, with log k_i = mean_j u_ij.
    """

    name = "mixing_law"

    def fit(self, R: np.ndarray, L: np.ndarray) -> MixingLaw:
        """Fit c_ (K,), k_ (K,), t_ (K x D), one bounded least-squares problem per domain."""
        R, L = _check_xy(R, L)
        D, K = R.shape[1], L.shape[1]
        self.c_, self.k_, self.t_ = np.zeros(K), np.zeros(K), np.zeros((K, D))
        for i in range(K):
            ok = np.isfinite(L[:, i])
            if ok.sum() < D + 2:
                raise ValueError(f"MixingLaw: eval domain {i} has {int(ok.sum())} proxies with a "
                                 f"finite loss; the law needs at least D + 2 = {D + 2}")
            c, u = self._fit_one(R[ok], L[ok, i])
            self.c_[i], self.k_[i], self.t_[i] = c, math.exp(u.mean()), u - u.mean()
        return self

    @staticmethod
    def _fit_one(R: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray]:
        if np.any(y <= 0):
            raise ValueError("MixingLaw: losses must be > 0")
        floor = float(y.min())
        # Start: for a guessed c, log(y - c) = u . r is linear, solved exactly by least
        # squares; try a few c below the smallest loss and start from the best of them.
        # This lands near the optimum, so one local solve suffices (and LOO stays cheap).
        best = None
        for frac in (0.0, 0.5, 0.8, 0.9, 0.95):
            c0 = frac * floor
            u0 = np.linalg.lstsq(R, np.log(y - c0), rcond=None)[0]
            sse = float(np.sum((c0 + np.exp(R @ u0) - y) ** 2))
            if best is None or sse < best[0]:
                best = (sse, c0, u0)
        _, c0, u0 = best
        # c in [0, min loss]: the law puts every loss above c. |u| <= 50 keeps exp finite
        # while leaving any plausible loss (exp(50) bits/byte) far inside the box.
        D = R.shape[1]
        lb = np.r_[0.0, np.full(D, -50.0)]
        ub = np.r_[floor, np.full(D, 50.0)]
        x0 = np.clip(np.r_[c0, u0], lb + 1e-12, ub - 1e-12)

        def residual(x: np.ndarray) -> np.ndarray:
            return x[0] + np.exp(R @ x[1:]) - y

        def jacobian(x: np.ndarray) -> np.ndarray:
            e = np.exp(R @ x[1:])
            return np.column_stack([np.ones_like(e), e[:, None] * R])

        sol = least_squares(residual, x0, jac=jacobian, bounds=(lb, ub), method="trf")
        return float(sol.x[0]), sol.x[1:]

    def predict(self, R: np.ndarray) -> np.ndarray:
        """Predicted losses (m x K) for mixtures R (m x D)."""
        R = np.asarray(R, dtype=np.float64)
        return self.c_ + self.k_ * np.exp(R @ self.t_.T)


LAWS: tuple[Callable[[], Law], ...] = (LinearLaw, MixingLaw)


# --------------------------------------------------------------------------- objective


@dataclass(frozen=True)
class Objective:
    """What "best mixture" means, over the K eval domains' bits per byte.

    weighted: sum_i w_i L_i with FIXED weights (None: equal over the eval domains), so
    proxies trained on different mixtures are scored alike (weighting by each proxy's own
    mixture would reward mixtures for what they trained on).
    target: L of one domain, subject to every other domain staying within
    (1 + max_increase) x its prediction at a reference mixture (usually today's mix.weights).
    """

    kind: str
    weights: dict[str, float] | None = None
    domain: str | None = None
    max_increase: float = 0.0

    @classmethod
    def from_dict(cls, spec: Mapping[str, Any]) -> Objective:
        """{"kind": "weighted", "weights": {domain: w} | None} or
        {"kind": "target", "domain": name, "max_increase": x}."""
        if not isinstance(spec, Mapping):
            raise ConfigError(f"objective: {spec!r} must be a mapping with a 'kind'")
        kind = spec.get("kind")
        allowed = {"weighted": {"kind", "weights"},
                   "target": {"kind", "domain", "max_increase"}}
        if kind not in allowed:
            raise ConfigError(f"objective.kind: {kind!r} is unknown; choose weighted or target")
        extra = sorted(set(spec) - allowed[kind])
        if extra:
            raise ConfigError(f"objective: unknown key(s) {', '.join(extra)} for kind {kind}; "
                              f"allowed: {', '.join(sorted(allowed[kind]))}")
        if kind == "weighted":
            weights = spec.get("weights")
            if weights is not None:
                if not isinstance(weights, Mapping) or not weights:
                    raise ConfigError(f"objective.weights: {weights!r} must be a non-empty "
                                      f"mapping of domain -> weight, or null")
                try:
                    weights = {str(k): float(v) for k, v in weights.items()}
                except (TypeError, ValueError):
                    raise ConfigError(f"objective.weights: {weights!r} must map domains to "
                                      f"numbers") from None
                if any(not (v >= 0 and math.isfinite(v)) for v in weights.values()) or \
                        sum(weights.values()) <= 0:
                    raise ConfigError(f"objective.weights: {weights!r} must be >= 0 and not "
                                      f"all zero")
            return cls(kind, weights=weights)
        domain = spec.get("domain")
        if not isinstance(domain, str) or not domain:
            raise ConfigError(f"objective.domain: {domain!r} must name an eval domain")
        try:
            max_increase = float(spec.get("max_increase", 0.0))
        except (TypeError, ValueError):
            max_increase = float("nan")
        if not (max_increase >= 0 and math.isfinite(max_increase)):
            raise ConfigError(f"objective.max_increase: {spec.get('max_increase')!r} must be a "
                              f"number >= 0")
        return cls(kind, domain=domain, max_increase=max_increase)

    def check(self, eval_domains: Sequence[str]) -> None:
        """Raise ConfigError when the objective names a domain that is not evaluated."""
        named = list(self.weights or {}) if self.kind == "weighted" else [self.domain]
        unknown = [d for d in named if d not in eval_domains]
        if unknown:
            raise ConfigError(f"objective: unknown domain(s) {', '.join(map(str, unknown))}; "
                              f"eval domains are {', '.join(eval_domains)}")

    def weight_vector(self, eval_domains: Sequence[str]) -> np.ndarray:
        """The fixed weights over the eval domains, summing to 1 (weighted kind only)."""
        self.check(eval_domains)
        if self.weights is None:
            return np.full(len(eval_domains), 1.0 / len(eval_domains))
        w = np.array([self.weights.get(d, 0.0) for d in eval_domains])
        return w / w.sum()

    def value(self, L: np.ndarray, eval_domains: Sequence[str]) -> np.ndarray:
        """The objective (lower is better) for each row of L (m x K)."""
        L = np.atleast_2d(np.asarray(L, dtype=np.float64))
        if L.shape[1] != len(eval_domains):
            raise ValueError(f"objective: L has {L.shape[1]} columns for "
                             f"{len(eval_domains)} eval domains")
        if self.kind == "weighted":
            return L @ self.weight_vector(eval_domains)
        self.check(eval_domains)
        return L[:, list(eval_domains).index(self.domain)]

    def allowed(self, L: np.ndarray, reference_L: np.ndarray,
                eval_domains: Sequence[str]) -> np.ndarray:
        """Rows of L whose non-target domains stay within (1 + max_increase) x reference_L.

        Always all True for the weighted kind, which has no cap.
        """
        L = np.atleast_2d(np.asarray(L, dtype=np.float64))
        if self.kind != "target":
            return np.ones(len(L), dtype=bool)
        self.check(eval_domains)
        cap = (1.0 + self.max_increase) * np.asarray(reference_L, dtype=np.float64).reshape(-1)
        others = np.arange(L.shape[1]) != list(eval_domains).index(self.domain)
        return np.all(L[:, others] <= cap[others], axis=1)

    def to_dict(self) -> dict[str, Any]:
        if self.kind == "weighted":
            return {"kind": self.kind, "weights": self.weights}
        return {"kind": self.kind, "domain": self.domain, "max_increase": self.max_increase}


# --------------------------------------------------------------------------- validation


def loo_predictions(make_law: Callable[[], Law], R: np.ndarray, L: np.ndarray) -> np.ndarray:
    """Leave-one-out predictions (n x K): row i predicted by a law fitted on the other rows."""
    R, L = _check_xy(R, L)
    out = np.empty(L.shape)
    keep = np.ones(len(R), dtype=bool)
    for i in range(len(R)):
        keep[i] = False
        out[i] = make_law().fit(R[keep], L[keep]).predict(R[i : i + 1])[0]
        keep[i] = True
    return out


def rank_correlation(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman's rho over the pairs where both are finite; nan if either side is constant."""
    a, b = np.asarray(a, dtype=np.float64).ravel(), np.asarray(b, dtype=np.float64).ravel()
    ok = np.isfinite(a) & np.isfinite(b)
    a, b = a[ok], b[ok]
    # spearmanr warns and returns nan on constant input; say nan without the warning.
    if len(a) < 2 or np.all(a == a[0]) or np.all(b == b[0]):
        return float("nan")
    return float(spearmanr(a, b).statistic)


def _mean_abs(a: np.ndarray, b: np.ndarray) -> float:
    d = np.abs(a - b)
    d = d[np.isfinite(d)]
    return float(d.mean()) if len(d) else float("nan")


# --------------------------------------------------------------------------- search


@dataclass
class LawFigures:
    """How well one law predicts held-out proxies."""

    name: str
    rank_corr: float  # Spearman, LOO predicted vs measured objective over the proxies
    objective_mae: float
    domain_rank_corr: dict[str, float] = field(default_factory=dict)
    domain_mae: dict[str, float] = field(default_factory=dict)
    error: str | None = None  # why the law could not be fitted (then the figures are nan)


@dataclass
class FitReport:
    """What fit_and_search found; recommendation is None unless the fit is trusted."""

    law: str | None
    rank_corr: float
    min_rank_corr: float
    trusted: bool
    reason: str | None
    laws: list[LawFigures]
    objective: dict[str, Any]
    recommendation: dict[str, float] | None
    predicted_objective: float | None
    predicted_bpb: dict[str, float] | None
    reference: dict[str, float] | None
    reference_objective: float | None
    reference_bpb: dict[str, float] | None
    measured_objective: list[float]  # per proxy, in the order of R
    loo_objective: list[float]  # the chosen law's leave-one-out prediction per proxy
    candidates: int
    feasible: int
    eligible: int  # feasible and, for the target kind, within the cap
    top_k: int
    used_top_k_mean: bool

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict (nan and inf become None, as strict JSON has neither)."""
        return _json_safe(asdict(self))


def _json_safe(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    if isinstance(x, (np.floating, float)):
        return float(x) if math.isfinite(x) else None
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, np.bool_):
        return bool(x)
    return x


def _mixture_vector(mix: Mapping[str, float] | np.ndarray, domains: list[str]) -> np.ndarray:
    if isinstance(mix, Mapping):
        unknown = sorted(set(mix) - set(domains))
        if unknown:
            raise ConfigError(f"reference mixture: unknown domain(s) {', '.join(unknown)}; "
                              f"domains are {', '.join(domains)}")
        v = np.array([float(mix.get(d, 0.0)) for d in domains])
    else:
        v = np.asarray(mix, dtype=np.float64).reshape(-1)
    if v.shape != (len(domains),) or np.any(v < 0) or not v.sum() > 0:
        raise ConfigError(f"reference mixture: {mix!r} must give {len(domains)} weights >= 0, "
                          f"not all zero")
    return v / v.sum()


def _as_dict(names: Sequence[str], values: np.ndarray) -> dict[str, float]:
    return {n: float(v) for n, v in zip(names, values, strict=True)}


def fit_and_search(R: np.ndarray, L: np.ndarray, domains: list[str], eval_domains: list[str],
                   objective: Objective | Mapping[str, Any], candidates: np.ndarray,
                   feasible: Callable[[np.ndarray], np.ndarray] | np.ndarray | None,
                   reference: Mapping[str, float] | np.ndarray | None, top_k: int,
                   min_rank_corr: float, *,
                   laws: Sequence[Callable[[], Law]] = LAWS) -> FitReport:
    """Fit each law to the proxies (R, L), keep the one that best ranks held-out proxies,
    and recommend the mean of the top_k eligible candidates under it.

    ``feasible`` is a rule mapping mixtures (m x D) to a boolean mask, e.g.
    ``lambda r: epoch_feasible(r, available, train_chars, max_epochs)``, or that mask
    precomputed over the candidates, or None (all feasible). Only a rule can re-check the
    top-k mean; with a mask the mean is taken as feasible, which is exact for convex rules
    (epoch caps, bounds: a mean of feasible mixtures is feasible).
    ``reference`` (today's mix.weights) is required by the target objective.
    """
    R, L = _check_xy(R, L)
    candidates = np.asarray(candidates, dtype=np.float64)
    if R.shape[1] != len(domains) or candidates.ndim != 2 or candidates.shape[1] != len(domains):
        raise ValueError(f"fit_and_search: R {R.shape} and candidates {candidates.shape} need "
                         f"one column per domain ({len(domains)})")
    if L.shape[1] != len(eval_domains):
        raise ValueError(f"fit_and_search: L {L.shape} needs one column per eval domain "
                         f"({len(eval_domains)})")
    obj = objective if isinstance(objective, Objective) else Objective.from_dict(objective)
    obj.check(eval_domains)
    if top_k < 1:
        raise ConfigError(f"top_k: {top_k} must be >= 1")
    rule = feasible if callable(feasible) else None
    if rule is None:
        given = np.ones(len(candidates), dtype=bool) if feasible is None else np.asarray(feasible)
        if given.dtype != bool or given.shape != (len(candidates),):
            raise ValueError(f"fit_and_search: feasible must be a rule or a boolean mask over "
                             f"the {len(candidates)} candidates, not {given.dtype} {given.shape}")
    ref = None if reference is None else _mixture_vector(reference, domains)
    if obj.kind == "target" and ref is None:
        raise ConfigError("objective kind target needs a reference mixture (mix.weights) "
                          "to cap the other domains against")

    measured = obj.value(L, eval_domains)
    figures, fitted = [], {}
    for make in laws:
        name = getattr(make, "name", getattr(make, "__name__", str(make)))
        try:
            loo = loo_predictions(make, R, L)
        except ValueError as e:  # e.g. too few proxies for the law's parameters
            nan = float("nan")
            figures.append(LawFigures(name, nan, nan, error=str(e)))
            continue
        loo_obj = obj.value(loo, eval_domains)
        figures.append(LawFigures(
            name, rank_correlation(loo_obj, measured), _mean_abs(loo_obj, measured),
            {d: rank_correlation(loo[:, i], L[:, i]) for i, d in enumerate(eval_domains)},
            {d: _mean_abs(loo[:, i], L[:, i]) for i, d in enumerate(eval_domains)}))
        fitted[name] = (make, loo_obj)
    if not fitted:
        raise ValueError("fit_and_search: no law could be fitted: "
                         + "; ".join(f"{f.name}: {f.error}" for f in figures))

    # The best held-out ranking wins (nan counts as worst; ties keep the earlier, simpler law).
    best = max((f for f in figures if f.name in fitted),
               key=lambda f: f.rank_corr if math.isfinite(f.rank_corr) else -math.inf)
    make, loo_obj = fitted[best.name]
    law = make().fit(R, L)
    trusted = bool(math.isfinite(best.rank_corr) and best.rank_corr >= min_rank_corr)
    reason = None if trusted else (
        f"held-out rank correlation {best.rank_corr:.2f} < {min_rank_corr:g}: the proxies do "
        f"not rank mixtures reliably; run more proxies or a larger token budget")

    ref_L = None if ref is None else law.predict(ref[None])[0]

    def rule_allows(mixtures: np.ndarray) -> np.ndarray:
        if rule is None:  # no rule, or only a mask over the candidates: see the docstring
            return np.ones(len(mixtures), dtype=bool)
        return np.asarray(rule(mixtures), dtype=bool).reshape(len(mixtures))

    def capped_mask(predicted: np.ndarray) -> np.ndarray:
        # Only the target kind caps anything; weighted leaves eligible == feasible.
        if ref_L is None:
            return np.ones(len(predicted), dtype=bool)
        return obj.allowed(predicted, ref_L, eval_domains)

    pred = law.predict(candidates)
    feas = given if rule is None else rule_allows(candidates)
    eligible = feas & capped_mask(pred)
    n_feasible, n_eligible = int(feas.sum()), int(eligible.sum())

    rec = rec_L = None
    used_mean = False
    if trusted and n_eligible == 0:
        reason = (f"none of the {len(candidates):,} candidate mixtures is feasible"
                  + (f" within the {obj.max_increase:g} cap on the other domains"
                     if obj.kind == "target" else "")
                  + ": sample more candidates, or allow more epochs per domain")
    elif trusted:
        idx = np.flatnonzero(eligible)
        values = obj.value(pred[idx], eval_domains)
        top = idx[np.argsort(values, kind="stable")[:top_k]]
        # RegMix's trick: the single argmin of a fitted law sits where fit noise happens to
        # dip lowest; the mean of the top few averages that noise out and lands in the
        # region the law agrees is good, which transfers better to the real run.
        mean = candidates[top].mean(axis=0)
        mean /= mean.sum()
        mean_L = law.predict(mean[None])
        # Feasible and capped sets are convex for epoch limits and both laws, so the mean
        # nearly always passes; a user-supplied feasibility test need not be convex.
        if rule_allows(mean[None])[0] and capped_mask(mean_L)[0]:
            rec, rec_L, used_mean = mean, mean_L[0], True
        else:
            rec, rec_L = candidates[top[0]], pred[top[0]]
        if ref_L is not None:
            # Never recommend what the law predicts worse than today's weights: the mean
            # of few eligible candidates (a tight target cap) can be; then the single
            # best, and if even that is no better, keep today's weights.
            ref_value = float(obj.value(ref_L[None], eval_domains)[0])
            if used_mean and float(obj.value(rec_L[None], eval_domains)[0]) >= ref_value:
                rec, rec_L, used_mean = candidates[top[0]], pred[top[0]], False
            if float(obj.value(rec_L[None], eval_domains)[0]) >= ref_value:
                reason = (f"no sampled mixture is predicted to beat today's mix.weights "
                          f"(predicted objective {ref_value:.4f}); keep them")
                rec = rec_L = None

    return FitReport(
        law=best.name, rank_corr=best.rank_corr, min_rank_corr=float(min_rank_corr),
        trusted=trusted, reason=reason, laws=figures, objective=obj.to_dict(),
        recommendation=None if rec is None else _as_dict(domains, rec),
        predicted_objective=None if rec_L is None else float(obj.value(rec_L, eval_domains)[0]),
        predicted_bpb=None if rec_L is None else _as_dict(eval_domains, rec_L),
        reference=None if ref is None else _as_dict(domains, ref),
        reference_objective=None if ref_L is None else float(obj.value(ref_L, eval_domains)[0]),
        reference_bpb=None if ref_L is None else _as_dict(eval_domains, ref_L),
        measured_objective=[float(v) for v in measured],
        loo_objective=[float(v) for v in loo_obj],
        candidates=len(candidates), feasible=n_feasible, eligible=n_eligible, top_k=int(top_k),
        used_top_k_mean=used_mean)
