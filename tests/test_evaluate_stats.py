"""The one z-test and the shared figures of held-out scores (lmforge.evaluate.stats), and
the run a model's run.json names (lmforge.tracking.recorded_run_id)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from lmforge.evaluate.report import fig, verdict
from lmforge.evaluate.stats import by_task, proportion, significant, z_score
from lmforge.tracking import recorded_run_id


@pytest.mark.parametrize(("delta", "se_a", "se_b", "z"), [
    (0.5, 0.3, 0.4, 1.0),            # the errors combine as independent: hypot = 0.5
    (-1.5, 0.3, 0.4, -3.0),
    (0.1, 0.0, 0.0, math.inf),       # no error at all: any change is certain
    (0.0, 0.0, 0.0, 0.0),
])
def test_z_score(delta, se_a, se_b, z):
    assert z_score(delta, se_a, se_b) == pytest.approx(z)


def test_z_score_is_nan_when_an_error_is_unknown():
    assert math.isnan(z_score(0.3, math.nan, 0.1))
    assert math.isnan(z_score(math.nan, 0.1, 0.1))


def test_significant_is_two_sided_and_nan_is_not():
    assert significant(-2.5) and significant(2.5) and not significant(1.9)
    assert not significant(math.nan)
    assert [verdict(0.5, 0.1, 0.1), verdict(0.1, 0.1, 0.1), verdict(0.1, math.nan, 0.1)] \
        == ["yes", "no", "n/a"]


def test_proportion_and_by_task():
    p, se = proportion(np.array([True, False, True, True]))
    assert (p, se) == (0.75, pytest.approx(math.sqrt(0.75 * 0.25 / 4)))
    assert all(math.isnan(v) for v in proportion(np.array([], dtype=bool)))
    hits = np.array([True, False, True])
    out = by_task(["b", "a", "b"], lambda m: {"n": int(m.sum()), "p": proportion(hits[m])[0]})
    assert out == {"overall": {"n": 3, "p": pytest.approx(2 / 3)},
                   "tasks": {"a": {"n": 1, "p": 0.0}, "b": {"n": 2, "p": 1.0}}}


def test_fig_cells():
    assert [fig(0.51234, 0.01), fig(0.5, math.nan, 2), fig(math.nan, 0.1)] \
        == ["0.512 ± 0.010", "0.50", "n/a"]


@pytest.mark.parametrize(("text", "run_id"), [
    ('{"mlflow_run_id": "abc"}', "abc"),
    ('{"mlflow_run_id": ""}', None),
    ("{}", None),
    ("not json", None),
    ("[1, 2]", None),
    (None, None),
])
def test_recorded_run_id(tmp_path, text, run_id):
    if text is not None:
        (tmp_path / "run.json").write_text(text, encoding="utf-8")
    assert recorded_run_id(tmp_path) == run_id
