"""Packing fine-tuning examples into rows, the train/val split, and replay batches."""

from __future__ import annotations

import numpy as np
import torch

from lmforge.finetune.pack import bins_best_fit, pack, split_by_hash
from lmforge.finetune.template import Rendered
from lmforge.model.loss import IGNORE_INDEX
from lmforge.shards.loader import ShardSet, WindowLoader
from lmforge.shards.writer import ShardWriter
from lmforge.train.replay import ReplayLoader

PAD = 7


def example(i: int, n: int) -> Rendered:
    """BOS(1), then n - 1 tokens; the second half is the 'answer' (mask 1)."""
    ids = [1] + [100 + i] * (n - 1)
    mask = [0] * (1 + (n - 1) // 2) + [1] * (n - 1 - (n - 1) // 2)
    return Rendered("f", i + 1, ids, mask)


def test_best_fit_places_every_item_once_within_capacity():
    rng = np.random.default_rng(0)
    lengths = [int(x) for x in rng.integers(1, 40, size=300)]
    bins = bins_best_fit(lengths, 64)
    placed = sorted(i for b in bins for i in b)
    assert placed == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 64 for b in bins)
    # Close to the bound: best-fit decreasing wastes little on small items.
    assert len(bins) <= -(-sum(lengths) // 64) * 1.1 + 1
    assert bins == bins_best_fit(lengths, 64)  # deterministic


def write(tmp_path, packed, name="sft"):
    w = ShardWriter(tmp_path / name, 1000, "0" * 64, ["instructions"], 1 << 20, loss_mask=True)
    w.add(packed.tokens, packed.doc_lengths, packed.doc_bytes,
          np.zeros(len(packed.doc_lengths), np.int64), packed.mask)
    w.close()
    return ShardSet(tmp_path / name)


def test_rows_are_the_loader_windows_and_only_answers_are_targets(tmp_path):
    items = [example(i, n) for i, n in enumerate([10, 30, 5, 17, 12, 9, 31, 2])]
    seq = 32
    packed = pack(items, seq, PAD, [n for n in range(len(items))])
    assert len(packed.tokens) == packed.rows * seq + 1
    assert packed.doc_lengths.sum() == len(packed.tokens)
    shards = write(tmp_path, packed)
    loader = WindowLoader(shards, seq, packed.rows, seed=0, return_doc_info=True)
    assert loader.num_windows == packed.rows
    inputs, targets, positions = loader.next_batch()
    rows = {tuple(r) for r in packed.tokens[:-1].reshape(packed.rows, seq).tolist()}
    assert {tuple(r) for r in inputs.tolist()} == rows  # each window is one whole row
    # Every answer token is a target exactly once over the epoch; nothing else is.
    assert int((targets != IGNORE_INDEX).sum()) == sum(sum(it.mask) for it in items)
    kept = targets[targets != IGNORE_INDEX]
    assert set(kept.tolist()) <= {100 + i for i in range(len(items))}
    # Each row starts a conversation (BOS at position 0): none is split across rows.
    assert (inputs[:, 0] == 1).all() and (positions[:, 0] == 0).all()
    assert int((inputs == 1).sum()) == len(items)


def test_split_is_by_content_stable_and_disjoint():
    items = [example(i, 5 + i % 7) for i in range(400)]
    train, val = split_by_hash(items, 0.1, seed=3)
    assert sorted(train + val) == list(range(400)) and not set(train) & set(val)
    assert 20 <= len(val) <= 60
    shuffled = items[::-1]
    _, val2 = split_by_hash(shuffled, 0.1, seed=3)
    assert {items[i].ids[1] for i in val} == {shuffled[i].ids[1] for i in val2}
    assert split_by_hash(items, 0.1, seed=4)[1] != val


class Rows:
    """A row loader yielding one recognisable row per call."""

    def __init__(self, tag: int, shards=None) -> None:
        self.tag, self.n, self.shards = tag, 0, shards

    def next_batch(self):
        self.n += 1
        row = torch.full((1, 4), self.tag * 1000 + self.n)
        return row, row

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, s):
        self.n = s["n"]


def test_replay_share_is_exact_and_resumes():
    loader = ReplayLoader(Rows(1), Rows(2), 0.3, batch_size=10)
    tags = [int(x) // 1000 for _ in range(5) for x in loader.next_batch()[0][:, 0]]
    assert tags.count(2) == 15  # 30 % of 50 rows, to the row
    for start in range(0, 50, 10):  # spread evenly: every batch holds its share
        assert tags[start:start + 10].count(2) == 3
    state = loader.state_dict()
    expected = loader.next_batch()[0]
    fresh = ReplayLoader(Rows(1), Rows(2), 0.3, batch_size=10)
    fresh.load_state_dict(state)
    assert torch.equal(fresh.next_batch()[0], expected)
    none = ReplayLoader(Rows(1), Rows(2), 0.0, batch_size=8)
    assert (none.next_batch()[0] // 1000 == 1).all()
