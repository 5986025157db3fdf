"""The forgetting table: base vs fine-tuned val figures, a change counted only beyond noise."""

from __future__ import annotations

import math

import pytest
import torch

from lmforge.evaluate.forgetting import forgetting_markdown, forgetting_rows
from lmforge.evaluate.scoring import SplitScore


def scored(shift_b: float) -> dict:
    """Two domains of 20 documents; domain b's losses raised by ``shift_b``."""
    gen = torch.Generator().manual_seed(0)
    score = SplitScore(["a", "b"], bytes_per_token=[2.0, 2.0])
    docs = torch.arange(400) // 10
    nats = 3.0 + 0.3 * torch.randn(400, generator=gen)
    nats[200:] += shift_b
    score.add(nats, (docs >= 20).long(), docs)
    return score.as_dict({"a": {"tokens": 0.5, "bytes": 0.5},
                          "b": {"tokens": 0.5, "bytes": 0.5}})


def test_a_real_loss_is_flagged_and_an_unchanged_domain_is_not():
    rows = {r["domain"]: r for r in forgetting_rows(scored(0.0), scored(0.5))}
    assert set(rows) == {"a", "b", "mix_weighted", "token_weighted"}
    assert rows["a"]["change"] == pytest.approx(0.0) and not rows["a"]["forgot"]
    b = rows["b"]
    assert b["change"] == pytest.approx(0.5 / math.log(2) / 2.0, rel=1e-6)
    assert b["forgot"] and b["z"] > 2
    assert rows["mix_weighted"]["change"] == pytest.approx(b["change"] / 2, rel=1e-6)


def test_a_change_within_the_noise_is_not_called_forgetting():
    rows = {r["domain"]: r for r in forgetting_rows(scored(0.0), scored(0.01))}
    assert rows["b"]["change"] > 0 and not rows["b"]["forgot"]
    table = forgetting_markdown(list(rows.values()))
    assert table.splitlines()[0].startswith("| domain | base bits_per_byte")
    assert "| b | " in table and table.count("\n") == 2 + len(rows)
    # The token-weighted row has no error bars: no verdict rather than a false "no".
    assert table.splitlines()[-1].startswith("| token_weighted |")
    assert table.splitlines()[-1].endswith("| n/a | n/a |")
