"""WindowLoader and eval_batches over a synthetic shard set whose tokens are positions."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from lmforge.errors import ConfigError
from lmforge.shards import IGNORE_INDEX, ShardSet, WindowLoader, eval_batches
from lmforge.shards.writer import write_shards

VOCAB = 1 << 17  # > 65536: uint32 shards, so token value == stream position fits


@pytest.fixture(scope="module")
def stream(tmp_path_factory):
    """Documents of random lengths; token id = position in the concatenated stream."""
    rng = np.random.default_rng(0)
    lens = rng.integers(1, 90, size=120)
    ends = np.cumsum(lens)
    docs = [list(range(e - n, e)) for n, e in zip(lens, ends, strict=True)]
    domains = [int(d) for d in rng.integers(0, 3, size=len(docs))]
    path = tmp_path_factory.mktemp("shards")
    # Small shards, so windows straddle shard boundaries.
    write_shards(path, docs, VOCAB, domains=domains, domain_names=["a", "b", "c"],
                 shard_tokens=700)
    return ShardSet(path), lens, domains


def test_shardset_reads_the_concatenated_stream(stream):
    shards, lens, _ = stream
    assert len(shards.manifest["shards"]) > 3
    assert shards.num_tokens == int(lens.sum())
    assert shards.dtype == np.dtype("uint32")
    np.testing.assert_array_equal(shards.read(0, shards.num_tokens), np.arange(shards.num_tokens))


def test_batches_are_windows_and_targets_are_shifted(stream):
    shards, _, _ = stream
    loader = WindowLoader(shards, seq_len=32, batch_size=5, seed=3)
    for _ in range(4):
        x, y = loader.next_batch()
        assert x.shape == y.shape == (5, 32) and x.dtype == torch.int64
        assert torch.equal(x[:, 1:], y[:, :-1])
        starts = torch.from_numpy(loader.last_starts)
        assert torch.all(starts % 32 == 0)
        assert torch.equal(x, starts[:, None] + torch.arange(32))


def _collect(loader: WindowLoader, steps: int) -> list[torch.Tensor]:
    return [torch.cat(loader.next_batch()) for _ in range(steps)]


def test_restore_then_continue_equals_uninterrupted(stream):
    shards, _, _ = stream
    # Enough steps to cross an epoch boundary (num_windows is ~150 at seq_len 32).
    straight = WindowLoader(shards, seq_len=32, batch_size=7, seed=11)
    expected = _collect(straight, 40)
    first = WindowLoader(shards, seq_len=32, batch_size=7, seed=11)
    _collect(first, 17)
    buf = io.BytesIO()
    torch.save({"loader": first.state_dict()}, buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)["loader"]
    resumed = WindowLoader(shards, seq_len=32, batch_size=7, seed=11)
    resumed.load_state_dict(state)
    got = _collect(resumed, 23)
    assert all(torch.equal(a, b) for a, b in zip(got, expected[17:], strict=True))
    assert resumed.epoch == straight.epoch >= 1


def test_restore_refuses_a_different_layout(stream):
    shards, _, _ = stream
    state = WindowLoader(shards, seq_len=32, batch_size=2, seed=1).state_dict()
    other = WindowLoader(shards, seq_len=16, batch_size=2, seed=1)
    with pytest.raises(ConfigError, match="seq_len"):
        other.load_state_dict(state)


@pytest.mark.parametrize("batch_size", [3, 4])
def test_two_ranks_are_disjoint_and_complete_over_an_epoch(stream, batch_size):
    shards, _, _ = stream
    ranks = [WindowLoader(shards, seq_len=32, batch_size=batch_size, seed=5, rank=r,
                          world_size=2) for r in range(2)]
    n = ranks[0].num_windows
    seen: list[list[int]] = [[], []]
    while ranks[0].epoch == 0:
        for r, loader in enumerate(ranks):
            loader.next_batch()
            seen[r] += loader.last_starts.tolist()
    # Cursor order: rank r's i-th window is global window 2*i + r; keep those of epoch 0.
    per_rank = [[s for i, s in enumerate(seen[r]) if 2 * i + r < n] for r in range(2)]
    assert not set(per_rank[0]) & set(per_rank[1])
    assert sorted(per_rank[0] + per_rank[1]) == list(range(0, n * 32, 32))
    # The next epoch is a different order of the same windows.
    nxt = WindowLoader(shards, seq_len=32, batch_size=n, seed=5)
    nxt.next_batch()
    order0 = nxt.last_starts.copy()
    nxt.next_batch()
    assert sorted(nxt.last_starts) == sorted(order0) and not np.array_equal(nxt.last_starts,
                                                                             order0)


def test_seed_changes_the_order(stream):
    shards, _, _ = stream
    a = WindowLoader(shards, seq_len=32, batch_size=8, seed=1)
    b = WindowLoader(shards, seq_len=32, batch_size=8, seed=2)
    a.next_batch()
    b.next_batch()
    assert not np.array_equal(a.last_starts, b.last_starts)


def test_doc_aligned_windows_start_every_document(stream):
    shards, lens, _ = stream
    loader = WindowLoader(shards, seq_len=64, batch_size=loader_batch(shards), seed=0,
                          align_to_docs=True)
    loader.next_batch()
    starts = set(loader.last_starts.tolist())
    assert len(starts) == loader.num_windows  # one epoch, no repeats
    doc_starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
    fits = doc_starts[doc_starts + 65 <= shards.num_tokens]
    assert set(fits.tolist()) <= starts


def loader_batch(shards: ShardSet) -> int:
    return len(WindowLoader(shards, 64, 1, 0, align_to_docs=True)._starts)


@pytest.mark.parametrize("seq_len,batch_size", [(32, 4), (50, 3)])
def test_eval_batches_cover_every_target_once(stream, seq_len, batch_size):
    shards, lens, domains = stream
    targets, doms = [], []
    for batch in eval_batches(shards, seq_len, batch_size):
        assert batch["input"].shape == batch["target"].shape == batch["domain"].shape
        assert batch["input"].shape[0] <= batch_size
        keep = batch["target"] != IGNORE_INDEX
        targets.append(batch["target"][keep])
        doms.append(batch["domain"][keep])
        assert torch.equal(batch["input"][:, 1:][keep[:, 1:]], batch["target"][:, :-1][keep[:, 1:]])
    t = torch.cat(targets)
    assert torch.equal(torch.sort(t).values, torch.arange(1, shards.num_tokens))
    doc_of = np.repeat(np.arange(len(lens)), lens)
    expected_dom = np.asarray(domains)[doc_of[t.numpy()]]
    np.testing.assert_array_equal(torch.cat(doms).numpy(), expected_dom)


def test_eval_batches_max_batches_limits_and_spreads(stream):
    shards, _, _ = stream
    batches = list(eval_batches(shards, 16, 4, max_batches=3))
    assert len(batches) == 3
    firsts = torch.cat([b["input"][:, 0] for b in batches])
    assert firsts.max() > shards.num_tokens // 2  # not just the start of the stream


def _pos_in_doc(lens: np.ndarray) -> np.ndarray:
    """Reference: offset within its document of every stream position."""
    return np.concatenate([np.arange(n) for n in lens])


@pytest.mark.parametrize("align", [False, True])
def test_doc_info_gives_positions_within_documents(stream, align):
    shards, lens, _ = stream
    ref = torch.from_numpy(_pos_in_doc(lens))
    plain = WindowLoader(shards, seq_len=32, batch_size=6, seed=4, align_to_docs=align)
    info = WindowLoader(shards, seq_len=32, batch_size=6, seed=4, align_to_docs=align,
                        return_doc_info=True)
    for _ in range(5):
        x, y = plain.next_batch()
        x2, y2, pos = info.next_batch()
        # Same batches as without doc info: the flag only adds.
        assert torch.equal(x, x2) and torch.equal(y, y2)
        assert pos.shape == x.shape and pos.dtype == torch.int64
        assert torch.equal(pos, ref[x2])  # token value == stream position here
        assert bool((pos == 0).any())  # windows of 32 over docs of < 90 tokens cross starts
    assert info.state_dict() == plain.state_dict()


def test_eval_batches_doc_info(stream):
    shards, lens, _ = stream
    ref = torch.from_numpy(_pos_in_doc(lens))
    batches = list(eval_batches(shards, 50, 4, return_doc_info=True))
    assert "positions" not in next(eval_batches(shards, 50, 4))
    for b in batches:
        keep = b["target"] != IGNORE_INDEX
        assert torch.equal(b["positions"][keep], ref[b["input"][keep]])
    assert bool((~keep).any())  # the last window is a padded tail
    assert torch.equal(batches[-1]["positions"][~keep], torch.zeros(int((~keep).sum()),
                                                                     dtype=torch.int64))
