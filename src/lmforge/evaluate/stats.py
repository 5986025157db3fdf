"""The statistics of held-out scores: standard errors, per-task groups, one z-test.

Records (documents, test items, preference pairs), not tokens, are the independent
units. A change between two models is judged by one z-test (``z_score``): the change
over the two figures' standard errors combined as independent. Both models answer the
same records, so this overstates the noise: the test is conservative, and a change it
flags is real.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

# A change beyond this many standard errors of the difference is reported as real.
SIGNIFICANT_Z = 2.0


def ratio_stderr(num: np.ndarray, den: np.ndarray) -> float:
    """Standard error of ``sum(num) / sum(den)`` over records (delta method).

    The linearised ratio estimator: ``sqrt(sum((num_i - R den_i)^2) / (n (n - 1))) /
    mean(den)``. Records, not tokens, are the independent units. NaN below 2 records.
    """
    n = len(num)
    if n < 2 or not den.sum():
        return float("nan")
    ratio = num.sum() / den.sum()
    resid = num - ratio * den
    return float(math.sqrt((resid ** 2).sum() / (n * (n - 1))) / den.mean())


def proportion(hits: np.ndarray) -> tuple[float, float]:
    """(p, sqrt(p (1 - p) / n)) of a boolean array; NaN for an empty one."""
    n = len(hits)
    if not n:
        return float("nan"), float("nan")
    p = float(hits.mean())
    return p, math.sqrt(p * (1 - p) / n)


def by_task(tasks: Sequence[str], figures: Callable[[np.ndarray], dict[str, Any]]
            ) -> dict[str, Any]:
    """``{"overall": figures(all), "tasks": {task: figures(its records)}}``: ``figures``
    gets a boolean mask over the records."""
    names = np.asarray(tasks)
    return {"overall": figures(np.ones(len(names), dtype=bool)),
            "tasks": {t: figures(names == t) for t in sorted(set(tasks))}}


def z_score(delta: float, se_a: float, se_b: float) -> float:
    """``delta`` in standard errors of the difference of two figures with errors ``se_a``
    and ``se_b`` (combined as independent).

    NaN when ``delta`` or an error is unknown; with two zero errors (0 or 100 % on both
    sides) any change is certain: +-inf, and no change is 0.
    """
    se = math.hypot(se_a, se_b)
    if not (math.isfinite(se) and math.isfinite(delta)):
        return float("nan")
    if se == 0:
        return math.copysign(math.inf, delta) if delta else 0.0
    return delta / se


def significant(z: float) -> bool:
    """Whether a z-score is beyond ``SIGNIFICANT_Z`` either way (NaN is not)."""
    return abs(z) > SIGNIFICANT_Z
