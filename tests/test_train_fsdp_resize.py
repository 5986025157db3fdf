"""train.strategy: fsdp resumed on more processes than it was saved by (1 -> 2): DCP
reshards, the loader goes on at the same window, and a rank the checkpoint did not have
gets an RNG stream of its own."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from test_train_fsdp import REPO, final_weights, fsdp_repo, kill_after_checkpoint, losses
from test_train_loop import start_ranks, wait_ranks

from lmforge.shards import ShardSet, WindowLoader
from lmforge.shards.writer import write_shards
from lmforge.train import checkpoint as ckpt
from lmforge.train.resume import apply_rng, rank_state

pytestmark = pytest.mark.slow

CPU = torch.device("cpu")


def one_process(root: Path) -> subprocess.Popen:
    """``python -m stages.train`` in one process (no torchrun variables)."""
    env = dict(os.environ, PYTHONPATH=str(REPO), DVC_ROOT=str(root))
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        env.pop(name, None)
    return subprocess.Popen([sys.executable, "-m", "stages.train"], cwd=root, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def set_train(root: Path, **train: object) -> None:
    params = yaml.safe_load((root / "params.yaml").read_text(encoding="utf-8"))
    params["train"].update(**train)
    (root / "params.yaml").write_text(yaml.safe_dump(params), encoding="utf-8")


def last_checkpoint(root: Path) -> dict:
    path = next((root / "models" / "checkpoints").glob("*/step-000010.pt"))
    return torch.load(path, weights_only=True)


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> Path:
    """An unbroken one-process FSDP run with the global batch of two ranks x 4."""
    root = fsdp_repo(tmp_path_factory.mktemp("single"), "fsdp", ckpt_every=4)
    set_train(root, nproc=1, micro_batch_size=8)
    wait_ranks([one_process(root)])
    return root


def test_a_one_process_fsdp_run_resumes_on_two_ranks(single, tmp_path):
    """1 -> 2: DCP reshards; two ranks with half the micro batch keep the global batch,
    and the loader goes on at the same window, none skipped or repeated."""
    root = fsdp_repo(tmp_path / "resized", "fsdp", ckpt_every=4)
    set_train(root, nproc=1, micro_batch_size=8)
    kill_after_checkpoint(root, [one_process(root)], 4)
    set_train(root, nproc=2, micro_batch_size=4)
    outs = wait_ranks(start_ranks(root, ["-m", "stages.train"]))
    assert "saved by 1 process, this run has 2" in outs[0], outs[0]
    assert "resuming from" in outs[0] and "x2 (fsdp)" in outs[0], outs[0]
    metrics = json.loads((root / "metrics" / "train.json").read_text())
    assert metrics["steps"] == 10 and metrics["world_size"] == 2
    assert metrics["tokens"] == 10 * 8 * 32

    # The loader's position counts windows over all ranks: the same as the unbroken run's.
    resized, unbroken = last_checkpoint(root), last_checkpoint(single)
    assert len(resized["ranks"]) == 2 and len(unbroken["ranks"]) == 1
    assert resized["ranks"][0]["loader"] == unbroken["ranks"][0]["loader"]
    assert resized["ranks"][1]["loader"] == unbroken["ranks"][0]["loader"]
    # Rank 1 drew a stream of its own, not a copy of rank 0's (nothing in this model
    # draws from it, so the two states are still the ones the resume set).
    assert not torch.equal(resized["ranks"][0]["rng"]["torch"],
                           resized["ranks"][1]["rng"]["torch"])
    # The same windows in every step: the losses agree to float rounding.
    a, b = losses(single), losses(root)
    assert len(a) == len(b) == 10
    assert a[:4] == b[:4]
    assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-4, (a, b)
    wa, wb = final_weights(single), final_weights(root)
    assert wa.keys() == wb.keys()
    for name in wa:
        assert torch.allclose(wa[name], wb[name], atol=1e-4), name


# --------------------------------------------------------------------------- in one process


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> ShardSet:
    """A small stream whose token ids are their positions: a window names itself."""
    rng = np.random.default_rng(0)
    lens = rng.integers(1, 90, size=120)
    ends = np.cumsum(lens)
    docs = [list(range(e - n, e)) for n, e in zip(lens, ends, strict=True)]
    path = tmp_path_factory.mktemp("shards")
    write_shards(path, docs, 1 << 17, domains=[0] * len(docs), domain_names=["a"],
                 shard_tokens=700)
    return ShardSet(path)


def test_the_loader_state_of_one_process_serves_two_ranks_the_same_windows(shards):
    """Every step after a 1 -> 2 resume serves, over both ranks, exactly the windows the
    unbroken process serves in that step: none skipped, none repeated."""
    unbroken = WindowLoader(shards, 32, 8, seed=3)
    served = []
    for _ in range(10):
        unbroken.next_batch()
        served.append(unbroken.last_starts.tolist())
    one = WindowLoader(shards, 32, 8, seed=3)
    for _ in range(4):
        one.next_batch()
    ranks = [WindowLoader(shards, 32, 4, seed=3, rank=r, world_size=2) for r in range(2)]
    for loader in ranks:
        loader.load_state_dict(one.state_dict())
    for step in range(4, 10):
        got = []
        for loader in ranks:
            loader.next_batch()
            got.append(loader.last_starts.tolist())
        # Rank r takes every other window from the cursor on: interleaved, they are the
        # single process's batch, in its order.
        assert [w for pair in zip(*got, strict=True) for w in pair] == served[step], step
    assert all(r.state_dict() == unbroken.state_dict() for r in ranks)


def _draws(rng: dict) -> tuple:
    apply_rng(rng, CPU)
    return torch.rand(4).tolist(), np.random.rand(2).tolist(), random.random()


def test_ranks_a_checkpoint_did_not_have_get_streams_of_their_own():
    torch.manual_seed(11)
    saved = [{"loader": {"position": 40}, "rng": ckpt.capture_rng(CPU)}]
    expected_rank0 = _draws(saved[0]["rng"])

    # 1 -> 2 (and -> 3): rank 0 keeps the saved stream; the others a fresh one each.
    states = [rank_state(saved, r, 3, seed=1337, step=4) for r in range(3)]
    assert states[0]["rng"] is saved[0]["rng"]
    assert all(s["loader"] == saved[0]["loader"] for s in states)
    draws = [_draws(s["rng"]) for s in states]
    assert draws[0] == expected_rank0
    assert len({repr(d) for d in draws}) == 3, draws  # three different streams
    assert rank_state(saved, 1, 2, seed=1337, step=4) == states[1]  # 1 -> 2: the same
    # Deterministic: a second resume of the same checkpoint draws the same; another
    # step or seed draws otherwise.
    assert _draws(rank_state(saved, 1, 2, seed=1337, step=4)["rng"]) == draws[1]
    assert _draws(rank_state(saved, 1, 2, seed=1337, step=8)["rng"]) != draws[1]
    assert _draws(rank_state(saved, 1, 2, seed=7, step=4)["rng"]) != draws[1]
    # Not the seed + rank stream a fresh run starts rank 1 with.
    torch.manual_seed(1337 + 1)
    assert torch.rand(4).tolist() != draws[1][0]


def test_the_same_or_fewer_ranks_take_their_saved_states():
    torch.manual_seed(0)
    saved = [{"loader": {"position": 16}, "rng": ckpt.capture_rng(CPU), "objective": {"k": r}}
             for r in range(2)]
    assert [rank_state(saved, r, 2, seed=0, step=4) for r in range(2)] == saved
    # 2 -> 1: rank 0's loader position (the same on every rank) and its stream.
    assert rank_state(saved, 0, 1, seed=0, step=4) == {
        "loader": saved[0]["loader"], "rng": saved[0]["rng"],
        "objective_parts": [{"k": 0}, {"k": 1}]}


def test_dpo_reference_caches_of_every_saved_rank_merge_on_another_world_size():
    """2 -> 1: the one rank gets both ranks' scored pairs, none recomputed or lost."""
    from lmforge.train.preference import DpoObjective

    nan = float("nan")
    a = {"train": torch.tensor([1.0, nan, nan, 4.0], dtype=torch.float64),
         "val": torch.tensor([nan, nan], dtype=torch.float64)}
    b = {"train": torch.tensor([nan, 2.0, nan, 4.5], dtype=torch.float64),
         "val": torch.tensor([nan, 7.0], dtype=torch.float64)}
    merged = DpoObjective.merge_state_dicts([a, b])
    assert torch.equal(merged["train"].nan_to_num(-1), torch.tensor([1.0, 2.0, -1, 4.0],
                                                                    dtype=torch.float64))
    assert torch.equal(merged["val"].nan_to_num(-1), torch.tensor([-1, 7.0],
                                                                  dtype=torch.float64))
    assert torch.isnan(a["train"][1])  # the saved states are left as they were
