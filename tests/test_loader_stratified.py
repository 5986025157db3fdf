"""train.batch_sampling: stratified -- every batch's domain shares follow the mixture."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lmforge.errors import ConfigError
from lmforge.shards import ShardSet, WindowLoader
from lmforge.shards.loader import stratified_order
from lmforge.shards.writer import write_shards

SEQ = 16
SHARES = (0.6, 0.3, 0.1)


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> ShardSet:
    """Three domains holding 60 / 30 / 10 % of the tokens, documents of random lengths in
    random order; token id = stream position, so a window names its start."""
    rng = np.random.default_rng(0)
    domains = list(rng.choice(3, size=600, p=SHARES))
    lens = rng.integers(20, 60, size=len(domains))
    ends = np.cumsum(lens)
    docs = [list(range(e - n, e)) for n, e in zip(lens, ends, strict=True)]
    path = tmp_path_factory.mktemp("strat")
    write_shards(path, docs, 1 << 17, domains=[int(d) for d in domains],
                 domain_names=["a", "b", "c"], shard_tokens=5000)
    return ShardSet(path)


def batch_domains(loader: WindowLoader, shards: ShardSet) -> np.ndarray:
    loader.next_batch()
    return shards.domain_of(loader.last_starts + 1)


def worst_deviation(loader: WindowLoader, shards: ShardSet, steps: int) -> float:
    """The largest |count - expected| of any domain in any of ``steps`` batches."""
    shares = np.bincount(loader.window_domains(), minlength=3) / loader.num_windows
    worst = 0.0
    for _ in range(steps):
        counts = np.bincount(batch_domains(loader, shards), minlength=3)
        worst = max(worst, float(np.abs(counts - shares * loader.batch_size).max()))
    return worst


def test_every_batch_follows_the_mixture_where_shuffled_batches_wander(shards):
    stratified = WindowLoader(shards, SEQ, 20, seed=5, stratified=True)
    shuffled = WindowLoader(shards, SEQ, 20, seed=5)
    steps = stratified.num_windows // 20
    assert worst_deviation(stratified, shards, steps) < 2
    assert worst_deviation(shuffled, shards, steps) >= 4  # binomial noise, sd ~2 at 20 rows


def test_the_order_is_a_permutation_of_every_window_once_per_epoch(shards):
    loader = WindowLoader(shards, SEQ, 8, seed=1, stratified=True)
    seen = []
    while len(seen) < loader.num_windows:
        loader.next_batch()
        seen.extend(loader.last_starts.tolist())
    seen = seen[:loader.num_windows]
    assert sorted(seen) == list(range(0, loader.num_windows * SEQ, SEQ))
    # Another epoch, another order (seed + epoch), still stratified.
    other = stratified_order(loader.window_domains(), np.random.default_rng(2))
    assert not np.array_equal(other, loader._permutation(0))


def test_ranks_together_draw_the_stratified_global_batch(shards):
    one = WindowLoader(shards, SEQ, 12, seed=3, stratified=True)
    ranks = [WindowLoader(shards, SEQ, 6, seed=3, rank=r, world_size=2, stratified=True)
             for r in range(2)]
    for _ in range(10):
        one.next_batch()
        for r in ranks:
            r.next_batch()
        merged = np.stack([r.last_starts for r in ranks], axis=1).reshape(-1)
        np.testing.assert_array_equal(merged, one.last_starts)


def test_resume_continues_the_same_batches_and_refuses_another_order(shards):
    straight = WindowLoader(shards, SEQ, 7, seed=9, stratified=True)
    steps = straight.num_windows // 7 + 5  # across an epoch boundary
    expected = [torch.cat(straight.next_batch()) for _ in range(steps)]
    first = WindowLoader(shards, SEQ, 7, seed=9, stratified=True)
    for _ in range(steps - 8):
        first.next_batch()
    state = first.state_dict()
    assert state["stratified"] == 1
    resumed = WindowLoader(shards, SEQ, 7, seed=9, stratified=True)
    resumed.load_state_dict(state)
    for want in expected[steps - 8:]:
        assert torch.equal(torch.cat(resumed.next_batch()), want)
    with pytest.raises(ConfigError, match="stratified"):
        WindowLoader(shards, SEQ, 7, seed=9).load_state_dict(state)
    assert "stratified" not in WindowLoader(shards, SEQ, 7, seed=9).state_dict()


@pytest.mark.parametrize("sizes", [(500, 300, 7), (1, 1000), (40, 40, 40, 41)])
def test_any_run_of_the_order_holds_each_domain_in_its_share(sizes):
    domains = np.repeat(np.arange(len(sizes)), sizes)
    np.random.default_rng(4).shuffle(domains)
    order = stratified_order(domains, np.random.default_rng(0))
    assert sorted(order.tolist()) == list(range(len(domains)))
    shares = np.array(sizes) / len(domains)
    for width in (7, 32, 100):
        for lo in range(0, len(order) - width, 13):
            counts = np.bincount(domains[order[lo:lo + width]], minlength=len(sizes))
            assert np.abs(counts - shares * width).max() < 2, (width, lo)


def test_a_stratified_run_keeps_its_order_in_the_checkpoint(tmp_path):
    from test_train_loop import make_inputs, run, tiny_params

    from lmforge.train import checkpoint as ckpt
    from lmforge.train import runs

    paths = make_inputs(tmp_path / "repo")
    result = run(tiny_params(max_steps=2, eval_every=0, ckpt_every=2,
                             batch_sampling="stratified"), paths, tmp_path / "c")
    state = ckpt.read_checkpoint(tmp_path / "c" / runs.run_id(result.fingerprint)
                                 / "step-000002.pt")
    assert state["ranks"][0]["loader"]["stratified"] == 1
