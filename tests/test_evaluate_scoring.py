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


def _tiny_set(tmp_path):
    from lmforge.shards.loader import ShardSet
    from lmforge.shards.writer import write_shards

    gen = torch.Generator().manual_seed(0)
    docs = [torch.randint(4, 64, (n,), generator=gen).tolist() for n in (40, 75, 23, 90)]
    write_shards(tmp_path, docs, vocab_size=64, domains=[0, 1, 0, 1],
                 domain_names=["a", "b"], doc_bytes=[3 * len(d) for d in docs])
    return ShardSet(tmp_path), sum(len(d) for d in docs)


@pytest.mark.parametrize("doc_mask", [False, True])
def test_full_pass_scores_every_target_once(tmp_path, doc_mask):
    from lmforge.config import ModelConfig
    from lmforge.evaluate.scoring import score_split
    from lmforge.model import Llama

    shards, n_tokens = _tiny_set(tmp_path)
    torch.manual_seed(0)
    model = Llama(ModelConfig(n_layer=1, n_head=2, n_embd=16, seq_len=16, doc_mask=doc_mask),
                  vocab_size=64)
    out = score_split(model, shards, seq_len=16, batch_size=3).as_dict()
    assert out["tokens"] == n_tokens - 1  # every token but the very first is a target
    assert set(out["domains"]) == {"a", "b"}
    # Random weights: loss near ln(vocab); 3 bytes per token in this set.
    assert abs(out["loss"] - math.log(64)) < 0.5
    assert out["bits_per_byte"] == pytest.approx(out["loss"] / math.log(2) / 3.0)
