"""Loss masks in shards: fine-tuning data marks which tokens are training targets."""

from __future__ import annotations

import numpy as np
import pytest

from lmforge.errors import InputError
from lmforge.shards.loader import IGNORE_INDEX, ShardSet, WindowLoader, eval_batches
from lmforge.shards.writer import write_shards


def make_set(tmp_path, shard_tokens=120):
    """Prompt/answer documents: mask 0 on the prompt, 1 on the answer."""
    rng = np.random.default_rng(0)
    docs, masks = [], []
    for _ in range(20):
        prompt = rng.integers(4, 100, int(rng.integers(3, 15))).tolist()
        answer = rng.integers(4, 100, int(rng.integers(2, 10))).tolist() + [2]
        docs.append(prompt + answer)
        masks.append([0] * len(prompt) + [1] * len(answer))
    manifest = write_shards(tmp_path, docs, vocab_size=100, masks=masks,
                            shard_tokens=shard_tokens)
    flat = np.concatenate([np.array(d) for d in docs])
    mask = np.concatenate([np.array(m) for m in masks]).astype(bool)
    return ShardSet(tmp_path), manifest, flat, mask


def test_training_windows_ignore_the_prompt_tokens(tmp_path):
    shards, manifest, flat, mask = make_set(tmp_path)
    assert manifest["loss_mask"] and len(manifest["shards"]) > 1  # masks cross shards
    assert shards.has_loss_mask
    loader = WindowLoader(shards, seq_len=16, batch_size=4, seed=0)
    for _ in range(10):
        inputs, targets = loader.next_batch()
        for row, start in enumerate(loader.last_starts):
            pos = start + 1 + np.arange(16)
            want = np.where(mask[pos], flat[pos], IGNORE_INDEX)
            assert targets[row].tolist() == want.tolist()
            assert inputs[row].tolist() == flat[start:start + 16].tolist()


def test_a_full_eval_pass_scores_exactly_the_masked_in_tokens(tmp_path):
    shards, _, flat, mask = make_set(tmp_path)
    scored = sum(int((b["target"] != IGNORE_INDEX).sum())
                 for b in eval_batches(shards, seq_len=16, batch_size=3))
    assert scored == int(mask[1:].sum())


def test_a_set_without_masks_keeps_every_target(tmp_path):
    write_shards(tmp_path, [[5, 6, 7, 8, 9] * 10], vocab_size=100)
    shards = ShardSet(tmp_path)
    assert not shards.has_loss_mask
    _, targets = WindowLoader(shards, seq_len=8, batch_size=2, seed=0).next_batch()
    assert (targets != IGNORE_INDEX).all()


def test_a_missing_or_corrupt_mask_is_one_line_naming_the_file(tmp_path):
    make_set(tmp_path)
    mask_file = tmp_path / "shard-00001.mask"
    data = mask_file.read_bytes()
    mask_file.write_bytes(data[:-3])
    with pytest.raises(InputError, match=r"shard-00001.mask: loss mask of \d+ bytes"):
        ShardSet(tmp_path)
    mask_file.write_bytes(bytes([1 - data[0]]) + data[1:])  # same size, one bit flipped
    ShardSet(tmp_path)  # sizes match: opens
    with pytest.raises(InputError, match="shard-00001.mask: sha256 does not match"):
        ShardSet(tmp_path, verify_checksums=True)


def test_the_writer_refuses_a_mask_it_was_not_made_for(tmp_path):
    with pytest.raises(ValueError, match="exactly when"):
        from lmforge.shards.writer import ShardWriter

        w = ShardWriter(tmp_path, 100, "0" * 64, ["d"], 1000)
        w.add(np.array([5, 6]), np.array([2]), np.array([2]), np.array([0]), np.array([1, 1]))
    with pytest.raises(ValueError, match="one 0/1 value per token"):
        write_shards(tmp_path / "b", [[5, 6, 7]], vocab_size=100, masks=[[1, 2, 0]])
