"""Bits-per-byte and per-domain aggregation of the evaluator."""

from __future__ import annotations

import math

import pytest
import torch

from lmforge.evaluate.scoring import SplitScore


def test_per_domain_sums_and_bits_per_byte():
    score = SplitScore(["en", "zh", "unused"], bytes_per_token=[4.0, 3.0, 1.0])
    nats = torch.tensor([1.0, 2.0, 3.0, 0.5])
    domains = torch.tensor([0, 1, 1, 0])
    score.add(nats, domains)
    score.add(torch.tensor([1.5]), torch.tensor([0]))
    out = score.as_dict()
    en, zh = out["domains"]["en"], out["domains"]["zh"]
    assert en["tokens"] == 3 and zh["tokens"] == 2
    assert en["loss"] == pytest.approx(3.0 / 3)
    assert zh["loss"] == pytest.approx(5.0 / 2)
    assert en["bits_per_byte"] == pytest.approx(3.0 / math.log(2) / (3 * 4.0))
    assert zh["perplexity"] == pytest.approx(math.exp(2.5))
    assert "unused" not in out["domains"]  # no tokens scored, no entry
    assert out["tokens"] == 5
    assert out["bits_per_byte"] == pytest.approx(8.0 / math.log(2) / (12.0 + 6.0))


def test_bits_per_byte_is_tokenizer_independent():
    """Same text, same total information: twice the tokens at half the loss each."""
    coarse = SplitScore(["d"], bytes_per_token=[4.0])
    coarse.add(torch.full((10,), 2.0), torch.zeros(10, dtype=torch.long))
    fine = SplitScore(["d"], bytes_per_token=[2.0])
    fine.add(torch.full((20,), 1.0), torch.zeros(20, dtype=torch.long))
    assert coarse.as_dict()["bits_per_byte"] == pytest.approx(fine.as_dict()["bits_per_byte"])
    assert coarse.as_dict()["loss"] != pytest.approx(fine.as_dict()["loss"])
