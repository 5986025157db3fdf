"""Mixture search: sampler bounds, epoch feasibility, law recovery, LOO trust, constrained search."""

from __future__ import annotations

import json

import numpy as np
import pytest
from scipy.stats import spearmanr

from lmforge.errors import ConfigError
from lmforge.mixture.fit import (
    LinearLaw,
    MixingLaw,
    Objective,
    fit_and_search,
    loo_predictions,
    rank_correlation,
)
from lmforge.mixture.space import epoch_feasible, sample_mixtures

DOMAINS = ["web", "code", "math"]
CENTER = {"web": 0.6, "code": 0.3, "math": 0.1}
# A linear truth in which each domain's data helps its own eval domain most:
# L_i(r) = sum_j W[i, j] r_j (bits per byte).
W = np.array([[0.9, 1.3, 1.4],
              [1.6, 0.8, 1.5],
              [1.9, 1.7, 0.9]])


def proxies(n: int, seed: int, noise: float = 0.003, law=None) -> tuple[np.ndarray, np.ndarray]:
    """n proxy mixtures around CENTER and their (noisy) per-domain BPB under ``law``."""
    rng = np.random.default_rng(seed)
    R = sample_mixtures(n, DOMAINS, CENTER, 3.0, None, rng)
    clean = R @ W.T if law is None else law(R)
    return R, clean + rng.normal(0.0, noise, clean.shape)


# --------------------------------------------------------------------------- space


def test_sampler_respects_bounds_and_rows_sum_to_one():
    bounds = {"web": (0.3, 0.8), "math": [0.0, 0.15]}
    R = sample_mixtures(2000, DOMAINS, CENTER, 5.0, bounds, np.random.default_rng(0))
    assert R.shape == (2000, 3)
    np.testing.assert_allclose(R.sum(axis=1), 1.0, atol=1e-12)
    assert np.all((R[:, 0] >= 0.3) & (R[:, 0] <= 0.8))
    assert np.all(R[:, 2] <= 0.15)
    # The bounds really bind: the same Dirichlet without them strays outside often.
    free = sample_mixtures(2000, DOMAINS, CENTER, 5.0, None, np.random.default_rng(0))
    assert np.mean((free[:, 0] < 0.3) | (free[:, 0] > 0.8) | (free[:, 2] > 0.15)) > 0.1


def test_sampler_mean_near_center_for_large_concentration():
    counts = {"web": 6_000, "code": 3_000, "math": 1_000}  # raw counts: normalised
    R = sample_mixtures(4000, DOMAINS, counts, 5_000.0, None, np.random.default_rng(1))
    np.testing.assert_allclose(R.mean(axis=0), [0.6, 0.3, 0.1], atol=2e-3)
    assert R.std(axis=0).max() < 0.01


def test_sampler_is_seeded():
    a = sample_mixtures(50, DOMAINS, CENTER, 2.0, {"math": (0.05, 0.5)}, np.random.default_rng(7))
    b = sample_mixtures(50, DOMAINS, CENTER, 2.0, {"math": (0.05, 0.5)}, np.random.default_rng(7))
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("bounds, match", [
    ({"web": (0.6, 0.4)}, "lo <= hi"),
    ({"web": (0.1, 1.2)}, "lo <= hi"),
    ({"web": (0.5, 1.0), "code": (0.4, 1.0), "math": (0.2, 1.0)}, "sum of lo"),
    ({"web": (0.0, 0.3), "code": (0.0, 0.3), "math": (0.0, 0.3)}, "sum of hi"),
    ({"wiki": (0.0, 0.5)}, "unknown domain 'wiki'"),
    ({"web": 0.5}, "pair"),
])
def test_bad_bounds_raise_one_line_config_error(bounds, match):
    with pytest.raises(ConfigError, match=match) as e:
        sample_mixtures(10, DOMAINS, CENTER, 2.0, bounds, np.random.default_rng(0))
    assert "\n" not in str(e.value)


def test_zero_center_share_keeps_a_domain_at_zero():
    R = sample_mixtures(200, DOMAINS, {"web": 0.7, "code": 0.3}, 2.0, {"web": (0.1, 0.9)},
                        np.random.default_rng(0))
    assert np.all(R[:, 2] == 0.0) and np.all(R[:, 1] > 0)
    np.testing.assert_allclose(R.sum(axis=1), 1.0, atol=1e-12)
    with pytest.raises(ConfigError, match="bounds.math: lo 0.1 > 0, but its center share is 0"):
        sample_mixtures(10, DOMAINS, {"web": 0.7, "code": 0.3}, 2.0, {"math": (0.1, 0.5)},
                        np.random.default_rng(0))


@pytest.mark.parametrize("center", [{"web": 1.0, "code": -0.5}, {"web": 0.0}, {"wiki": 1.0}])
def test_bad_center_raises_config_error(center):
    with pytest.raises(ConfigError, match="mixture center"):
        sample_mixtures(10, DOMAINS, center, 2.0, None, np.random.default_rng(0))


def test_unsatisfiable_bounds_fail_clearly_instead_of_looping():
    # Valid on paper (sums allow a mixture), but a Dirichlet concentrated near 10% math
    # essentially never draws >= 90% math.
    with pytest.raises(ConfigError, match=r"math \[0.9, 1\].*accept only") as e:
        sample_mixtures(100, DOMAINS, CENTER, 1_000.0, {"math": (0.9, 1.0)},
                        np.random.default_rng(0))
    assert "\n" not in str(e.value)


def test_epoch_feasible_hand_computed():
    available = np.array([100.0, 50.0, 0.0])
    mixtures = np.array([
        [1.0, 0.0, 0.0],    # web 200/100 = 2 epochs: exactly at the limit
        [0.5, 0.5, 0.0],    # web 1, code 100/50 = 2
        [0.4, 0.6, 0.0],    # code 120/50 = 2.4 > 2
        [0.9, 0.09, 0.01],  # math has no data at all
    ])
    got = epoch_feasible(mixtures, available, train_chars=200.0, max_epochs=2.0)
    assert got.dtype == bool
    assert got.tolist() == [True, True, False, False]
    # More epochs allowed: the third becomes feasible, the fourth never does.
    assert epoch_feasible(mixtures, available, 200.0, 2.5).tolist() == [True, True, True, False]


# --------------------------------------------------------------------------- laws


def test_linear_law_recovers_coefficients_up_to_sum_to_one():
    b = np.array([0.2, -0.1, 0.3])  # an intercept: invisible once rows sum to 1
    R, L = proxies(80, seed=2, noise=0.002, law=lambda R: b + R @ W.T)
    law = LinearLaw().fit(R, L)
    fresh = sample_mixtures(500, DOMAINS, CENTER, 3.0, None, np.random.default_rng(3))
    np.testing.assert_allclose(law.predict(fresh), b + fresh @ W.T, atol=0.01)
    # Only differences between a row's weights are identifiable.
    np.testing.assert_allclose(law.coef_ - law.coef_[:, :1], W - W[:, :1], atol=0.05)


def test_mixing_law_recovers_parameters():
    c = np.array([0.6, 0.4])
    k = np.array([0.5, 0.8])
    t = np.array([[-1.5, 0.5, 0.3], [0.4, -2.0, 0.6]])

    def truth(R):
        return c + k * np.exp(R @ t.T)

    R, L = proxies(60, seed=4, noise=0.003, law=truth)
    law = MixingLaw().fit(R, L)
    fresh = sample_mixtures(500, DOMAINS, CENTER, 3.0, None, np.random.default_rng(5))
    np.testing.assert_allclose(law.predict(fresh), truth(fresh), atol=0.01)
    assert np.all(law.k_ > 0) and np.all(law.c_ >= 0)
    np.testing.assert_allclose(law.c_, c, atol=0.03)
    # k exp(t . r) only fixes t up to a shift (rows sum to 1); the law reports the gauge
    # sum_j t_ij = 0, with k absorbing the shift.
    np.testing.assert_allclose(law.t_, t - t.mean(axis=1, keepdims=True), atol=0.15)
    np.testing.assert_allclose(law.k_, k * np.exp(t.mean(axis=1)), rtol=0.1)


def test_mixing_law_needs_d_plus_two_points():
    R, L = proxies(4, seed=6)  # D = 3 needs 5
    with pytest.raises(ValueError, match="at least D \\+ 2 = 5"):
        MixingLaw().fit(R, L)
    # A non-finite loss drops that proxy from its domain's fit, and counts against it.
    R, L = proxies(5, seed=6)
    MixingLaw().fit(R, L)
    L[0, 1] = np.nan
    with pytest.raises(ValueError, match="eval domain 1 has 4"):
        MixingLaw().fit(R, L)


def test_loo_predictions_refit_without_the_row():
    R, L = proxies(12, seed=7, noise=0.05)
    loo = loo_predictions(LinearLaw, R, L)
    others = np.arange(12) != 5
    np.testing.assert_allclose(loo[5], LinearLaw().fit(R[others], L[others]).predict(R[5:6])[0])
    # Held out, the row is predicted worse than when the law saw it.
    in_sample = LinearLaw().fit(R, L).predict(R)
    assert np.abs(loo - L).mean() > np.abs(in_sample - L).mean()


def test_rank_correlation_is_nan_safe():
    a = np.array([1.0, 2.0, np.nan, 4.0, 3.0])
    b = np.array([2.0, 1.0, 5.0, 9.0, np.inf])
    keep = np.isfinite(a) & np.isfinite(b)
    assert rank_correlation(a, b) == pytest.approx(spearmanr(a[keep], b[keep]).statistic)
    assert np.isnan(rank_correlation([1.0, 1.0, 1.0], [1.0, 2.0, 3.0]))
    assert np.isnan(rank_correlation([1.0, np.nan], [2.0, 3.0]))
    assert rank_correlation([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)


# --------------------------------------------------------------------------- objective


def test_objective_weighted_and_target_values():
    L = np.array([[1.0, 2.0, 3.0], [3.0, 1.0, 1.0]])
    equal = Objective.from_dict({"kind": "weighted", "weights": None})
    np.testing.assert_allclose(equal.value(L, DOMAINS), L.mean(axis=1))
    weighted = Objective.from_dict({"kind": "weighted", "weights": {"web": 3, "code": 1}})
    np.testing.assert_allclose(weighted.value(L, DOMAINS), 0.75 * L[:, 0] + 0.25 * L[:, 1])
    target = Objective.from_dict({"kind": "target", "domain": "math", "max_increase": 0.1})
    np.testing.assert_allclose(target.value(L, DOMAINS), L[:, 2])
    # The cap is on the other domains only: row 0 is within 1.1 x web and code (its math is
    # far above the reference's, which is what the target is for); row 1's web is not.
    assert target.allowed(L, np.array([1.0, 2.0, 0.5]), DOMAINS).tolist() == [True, False]
    assert equal.allowed(L, np.array([0.0, 0.0, 0.0]), DOMAINS).tolist() == [True, True]


@pytest.mark.parametrize("spec, match", [
    ({"kind": "best"}, "objective.kind"),
    ({"kind": "weighted", "domain": "math"}, "unknown key"),
    ({"kind": "weighted", "weights": {"web": -1.0}}, ">= 0"),
    ({"kind": "target"}, "objective.domain"),
    ({"kind": "target", "domain": "math", "max_increase": -0.1}, "max_increase"),
    ({"kind": "target", "domain": "math", "max_increase": "lots"}, "max_increase"),
])
def test_objective_rejects_bad_specs(spec, match):
    with pytest.raises(ConfigError, match=match) as e:
        Objective.from_dict(spec)
    assert "\n" not in str(e.value)


def test_objective_rejects_unknown_eval_domains():
    L = np.ones((2, 3))
    with pytest.raises(ConfigError, match="unknown domain.*wiki"):
        Objective.from_dict({"kind": "weighted", "weights": {"wiki": 1.0}}).value(L, DOMAINS)
    with pytest.raises(ConfigError, match="unknown domain.*wiki"):
        Objective.from_dict({"kind": "target", "domain": "wiki"}).value(L, DOMAINS)


# --------------------------------------------------------------------------- search


def candidates(n: int = 20_000, seed: int = 11) -> np.ndarray:
    return sample_mixtures(n, DOMAINS, CENTER, 1.0, None, np.random.default_rng(seed))


def search(R, L, objective=None, feasible=None, reference=None, top_k=20, cands=None):
    objective = objective or {"kind": "weighted", "weights": None}
    cands = candidates() if cands is None else cands
    return fit_and_search(R, L, DOMAINS, DOMAINS, objective, cands, feasible, reference,
                          top_k, 0.6)


def test_good_proxies_are_trusted_and_recommend_a_mixture():
    R, L = proxies(40, seed=8)
    report = search(R, L)
    assert report.trusted and report.reason is None
    assert report.rank_corr > 0.9
    assert {f.name for f in report.laws} == {"linear", "mixing_law"}
    chosen = next(f for f in report.laws if f.name == report.law)
    assert chosen.rank_corr == max(f.rank_corr for f in report.laws)
    assert all(v > 0.9 for v in chosen.domain_rank_corr.values())
    assert sum(report.recommendation.values()) == pytest.approx(1.0)
    # The recommendation beats every proxy on the true objective (the search found
    # something, rather than echoing a sampled mixture).
    rec = np.array([report.recommendation[d] for d in DOMAINS])
    assert (rec @ W.T).mean() < (R @ W.T).mean(axis=1).min()
    assert len(report.loo_objective) == len(report.measured_objective) == 40


def test_noise_proxies_are_not_trusted():
    rng = np.random.default_rng(9)
    R = sample_mixtures(40, DOMAINS, CENTER, 3.0, None, rng)
    L = 1.0 + rng.normal(0.0, 0.05, (40, 3))  # BPB that ignores the mixture
    report = search(R, L)
    assert not report.trusted
    assert report.rank_corr < 0.6
    assert report.recommendation is None and report.predicted_objective is None
    assert report.reason.startswith(f"held-out rank correlation {report.rank_corr:.2f} < 0.6")


def test_search_never_recommends_an_infeasible_mixture():
    R, L = proxies(40, seed=10)
    # Math is the best data for the equal-weight objective (lowest column sum of W)...
    free = search(R, L)
    free_mix = np.array([free.recommendation[d] for d in DOMAINS])
    # ...but there is little of it: at most 2 epochs of 10k chars in a 100k-char run
    # caps its share at 0.2.
    available = np.array([1e6, 1e6, 1e4])

    def feasible(r):
        return epoch_feasible(r, available, 1e5, 2.0)

    assert not feasible(free_mix[None])[0]
    capped = search(R, L, feasible=feasible)
    mix = np.array([capped.recommendation[d] for d in DOMAINS])
    assert feasible(mix[None])[0]
    assert mix[2] <= 0.2 + 1e-9 and np.abs(mix - free_mix).max() > 0.1
    assert 0 < capped.eligible == capped.feasible < capped.candidates
    # The same rule given as a mask over the candidates finds the same mixture.
    masked = search(R, L, feasible=feasible(candidates()))
    assert masked.recommendation == capped.recommendation
    with pytest.raises(ValueError, match="boolean mask"):
        search(R, L, feasible=np.ones(3, dtype=bool))


def test_search_falls_back_to_best_candidate_when_top_k_mean_is_infeasible():
    # Loss depends only on the math share; feasibility is non-convex: web or code must
    # dominate the other by 0.5. The best candidates sit at both ends of the web-code
    # edge, so their mean lands in the infeasible middle.
    rng = np.random.default_rng(12)
    R = sample_mixtures(30, DOMAINS, CENTER, 3.0, None, rng)
    L = 1.0 + R[:, 2:3] * np.array([1.0, 2.0, 3.0])
    cands = candidates(5_000, seed=13)

    def feasible(r):
        return np.abs(r[:, 0] - r[:, 1]) > 0.5

    report = search(R, L, feasible=feasible, top_k=40, cands=cands)
    assert report.trusted and not report.used_top_k_mean
    mix = np.array([report.recommendation[d] for d in DOMAINS])
    assert feasible(mix[None])[0]
    # It is the single best feasible candidate under the chosen law.
    law = {"linear": LinearLaw, "mixing_law": MixingLaw}[report.law]().fit(R, L)
    ok = cands[feasible(cands)]
    np.testing.assert_array_equal(mix, ok[np.argmin(law.predict(ok).mean(axis=1))])
    assert mix[2] < 1e-6
    # Without the constraint the mean is used; with only a precomputed mask it cannot be
    # re-checked, so it is used too (fine for convex rules such as epoch caps).
    assert search(R, L, top_k=40, cands=cands).used_top_k_mean
    masked = search(R, L, feasible=feasible(cands), top_k=40, cands=cands)
    assert masked.used_top_k_mean and masked.feasible == int(feasible(cands).sum())


def test_target_objective_respects_the_cap():
    R, L = proxies(40, seed=14)
    reference = {"web": 0.6, "code": 0.3, "math": 0.1}
    spec = {"kind": "target", "domain": "math", "max_increase": 0.02}
    report = search(R, L, objective=spec, reference=reference)
    assert report.trusted
    for d in ("web", "code"):
        assert report.predicted_bpb[d] <= 1.02 * report.reference_bpb[d] + 1e-12
    assert report.predicted_bpb["math"] < report.reference_bpb["math"]
    assert report.predicted_objective == report.predicted_bpb["math"]
    assert report.eligible < report.feasible == report.candidates
    # The cap binds: allowed to lose 100%, the search moves much further towards math.
    loose = search(R, L, objective={**spec, "max_increase": 1.0}, reference=reference)
    assert loose.recommendation["math"] > report.recommendation["math"] + 0.1
    assert any(loose.predicted_bpb[d] > 1.02 * report.reference_bpb[d] for d in ("web", "code"))


def test_target_objective_needs_a_reference():
    R, L = proxies(10, seed=15)
    with pytest.raises(ConfigError, match="reference"):
        search(R, L, objective={"kind": "target", "domain": "math"})


def test_report_to_dict_is_strict_json():
    R, L = proxies(40, seed=16)
    trusted = search(R, L, reference=CENTER).to_dict()
    back = json.loads(json.dumps(trusted, allow_nan=False))
    assert sum(back["recommendation"].values()) == pytest.approx(1.0)
    assert back["law"] in {"linear", "mixing_law"} and back["trusted"] is True
    assert back["reference"] == pytest.approx(CENTER)
    # Too few proxies for the mixing law (LOO leaves D + 1): its figures are nan, written
    # as null, with the reason.
    R, L = proxies(5, seed=16)
    small = json.loads(json.dumps(search(R, L).to_dict(), allow_nan=False))
    mixing = next(f for f in small["laws"] if f["name"] == "mixing_law")
    assert mixing["rank_corr"] is None and "D + 2" in mixing["error"]
    assert small["law"] == "linear"


def test_todays_weights_are_kept_when_no_candidate_is_predicted_to_beat_them():
    """Never a recommendation the law itself predicts worse than the reference."""
    R, L = proxies(40, seed=8)
    # Under W, equal weights favour code and math: no web at all is the optimum. The
    # candidates all hold a lot of web, so none beats it.
    optimum = {"web": 0.0, "code": 0.5, "math": 0.5}
    cands = sample_mixtures(2000, DOMAINS, CENTER, 50.0, None, np.random.default_rng(3))
    assert cands[:, 0].min() > 0.3
    kept = search(R, L, reference=optimum, cands=cands)
    assert kept.trusted and kept.recommendation is None
    assert "keep them" in kept.reason
    # Against today's CENTER the same candidates do hold better mixtures.
    moved = search(R, L, reference=CENTER, cands=cands)
    assert moved.recommendation is not None
    assert moved.predicted_objective < moved.reference_objective
