"""Bits-per-byte and per-domain aggregation of the evaluator."""

from __future__ import annotations

import math

import numpy as np
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
    pooled = out["token_weighted"]
    assert pooled["tokens"] == 5
    assert pooled["bits_per_byte"] == pytest.approx(8.0 / math.log(2) / (12.0 + 6.0))


def test_bits_per_byte_is_tokenizer_independent():
    """Same text, same total information: twice the tokens at half the loss each."""
    coarse = SplitScore(["d"], bytes_per_token=[4.0])
    coarse.add(torch.full((10,), 2.0), torch.zeros(10, dtype=torch.long))
    fine = SplitScore(["d"], bytes_per_token=[2.0])
    fine.add(torch.full((20,), 1.0), torch.zeros(20, dtype=torch.long))
    c, f = coarse.as_dict()["token_weighted"], fine.as_dict()["token_weighted"]
    assert c["bits_per_byte"] == pytest.approx(f["bits_per_byte"])
    assert c["loss"] != pytest.approx(f["loss"])


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
    pooled = out["token_weighted"]
    assert pooled["tokens"] == n_tokens - 1  # every token but the very first is a target
    assert set(out["domains"]) == {"a", "b"}
    assert out["domains"]["a"]["docs"] == 2 and out["domains"]["b"]["docs"] == 2
    # Random weights: loss near ln(vocab); 3 bytes per token in this set.
    assert abs(pooled["loss"] - math.log(64)) < 0.5
    assert pooled["bits_per_byte"] == pytest.approx(pooled["loss"] / math.log(2) / 3.0)


def test_mixture_weighting_follows_the_training_shares_not_the_val_shares():
    """Val holds 9x more 'b' tokens than 'a'; training saw them 1:1. The headline
    weighs them 1:1, the token-weighted figure 1:9."""
    score = SplitScore(["a", "b"], bytes_per_token=[4.0, 2.0])
    score.add(torch.full((10,), 1.0), torch.zeros(10, dtype=torch.long),
              torch.arange(10) // 5)
    score.add(torch.full((90,), 3.0), torch.ones(90, dtype=torch.long),
              10 + torch.arange(90) // 10)
    mixture = {"a": {"tokens": 0.5, "bytes": 0.75}, "b": {"tokens": 0.5, "bytes": 0.25}}
    out = score.as_dict(mixture)
    assert out["token_weighted"]["loss"] == pytest.approx((10 * 1 + 90 * 3) / 100)
    assert out["mix_weighted"]["loss"] == pytest.approx(0.5 * 1 + 0.5 * 3)
    bpb_a, bpb_b = 1 / math.log(2) / 4, 3 / math.log(2) / 2
    assert out["mix_weighted"]["bits_per_byte"] == pytest.approx(0.75 * bpb_a + 0.25 * bpb_b)
    assert out["mix_weighted"]["perplexity"] == pytest.approx(math.exp(2.0))
    # A domain the model was not trained on does not enter the mixture.
    only_a = score.as_dict({"a": {"tokens": 1.0, "bytes": 1.0}})
    assert only_a["mix_weighted"]["loss"] == pytest.approx(1.0)


def test_bootstrap_stderr_matches_the_spread_of_documents():
    """Documents of equal length with iid losses: the stderr of the mean is sd/sqrt(n)."""
    from lmforge.evaluate.scoring import bootstrap_stderr

    rng = np.random.default_rng(0)
    per_doc = rng.normal(3.0, 0.5, size=400)
    tokens = np.full(400, 100.0)
    se = bootstrap_stderr(per_doc * tokens, tokens, seed=1, samples=4000)
    assert se == pytest.approx(0.5 / math.sqrt(400), rel=0.1)
    assert math.isnan(bootstrap_stderr(np.array([1.0]), np.array([1.0])))
    # Identical documents: no spread, whatever their number.
    assert bootstrap_stderr(np.full(5, 20.0), np.full(5, 10.0)) == pytest.approx(0.0)


def test_per_domain_stderr_and_the_mixture_stderr():
    score = SplitScore(["a", "b"], bytes_per_token=[2.0, 2.0])
    gen = torch.Generator().manual_seed(0)
    docs = torch.arange(200) // 10  # 20 documents of 10 tokens
    score.add(torch.rand(200, generator=gen) * 4, (docs >= 10).long(), docs)
    out = score.as_dict({"a": {"tokens": 0.5, "bytes": 0.5}, "b": {"tokens": 0.5, "bytes": 0.5}})
    a, b = out["domains"]["a"], out["domains"]["b"]
    assert 0 < a["loss_stderr"] < 0.5 and a["docs"] == 10
    assert a["bits_per_byte_stderr"] == pytest.approx(a["loss_stderr"] / math.log(2) / 2.0)
    mix = out["mix_weighted"]
    assert mix["loss_stderr"] == pytest.approx(
        math.sqrt((0.5 * a["loss_stderr"]) ** 2 + (0.5 * b["loss_stderr"]) ** 2))


def test_mixture_mean_renormalises_over_the_domains_it_has():
    from lmforge.shards.loader import mixture_mean

    weights = {"a": 0.2, "b": 0.6, "c": 0.2}
    assert mixture_mean({"a": 1.5, "b": 4.0}, weights) == pytest.approx(0.25 * 1.5 + 0.75 * 4)
    assert math.isnan(mixture_mean({"x": 1.0}, weights))  # nothing trained on was scored


def test_domain_shares_are_the_train_splits_token_and_byte_shares(tmp_path):
    shards, _ = _tiny_set(tmp_path)
    shares = shards.domain_shares()
    assert shares["a"]["tokens"] == pytest.approx((40 + 23) / (40 + 75 + 23 + 90))
    assert shares["b"]["bytes"] == pytest.approx((75 + 90) / (40 + 75 + 23 + 90))
