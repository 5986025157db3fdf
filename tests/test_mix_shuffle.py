"""Mix's two-level shuffle: bounded tasks, few intermediate files, the same bytes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_data_mix import cfg, make_corpus

from lmforge.data import mix_measure, mix_shuffle
from lmforge.data.mix import run_mix
from lmforge.data.mix_shuffle import cut_runs
from lmforge.executor import LocalExecutor


def tree_bytes(root: Path) -> dict[str, bytes]:
    """Every output file under ``root`` by its relative path."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("seed", range(6))
def test_runs_cover_every_item_in_order_within_the_budget(seed):
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 100, size=int(rng.integers(1, 60))).astype(float)
    budget, min_runs = float(rng.integers(50, 400)), int(rng.integers(1, 20))
    runs = cut_runs(sizes, budget, min_runs)
    assert [lo for lo, _ in runs] == [0] + [hi for _, hi in runs[:-1]]  # contiguous
    assert runs[-1][1] == len(sizes) and all(lo < hi for lo, hi in runs)
    limit = min(budget, sizes.sum() / min_runs)
    for lo, hi in runs:  # a run passes the limit only when one item alone does
        assert sizes[lo:hi].sum() <= limit or hi - lo == 1
    # Greedy: no run could have taken the next item too.
    for (lo, hi), (nxt, _) in zip(runs, runs[1:], strict=False):
        assert sizes[lo:hi + 1].sum() > limit and hi == nxt


def test_equal_items_give_at_least_min_runs():
    assert len(cut_runs(np.ones(40), 1e9, 16)) >= 16
    assert len(cut_runs(np.ones(5), 1e9, 16)) == 5
    assert cut_runs(np.zeros(0), 1e9, 16) == []


@pytest.mark.parametrize(("budget", "min_tasks", "part_docs"),
                         [(2_000, 1, 100), (30_000, 1, 7), (1e12, 1, 7), (1e12, 3, 50)])
def test_the_bytes_do_not_depend_on_how_the_shuffle_is_cut(tmp_path, monkeypatch, budget,
                                                          min_tasks, part_docs):
    """Scatter runs of one or many input parts, groups of one or many output parts: the
    output is the same file for file, byte for byte."""
    make_corpus(tmp_path / "in")
    run_mix(cfg(part_docs=part_docs), tmp_path / "in", tmp_path / "ref")
    monkeypatch.setattr(mix_shuffle, "SHUFFLE_CHARS", budget)
    monkeypatch.setattr(mix_shuffle, "MIN_SHUFFLE_TASKS", min_tasks)
    monkeypatch.setattr(mix_measure, "MIN_SHUFFLE_TASKS", min_tasks)
    monkeypatch.setattr(mix_measure, "RUN_BYTES", budget / 4)  # several parts a run, or one
    run_mix(cfg(part_docs=part_docs), tmp_path / "in", tmp_path / "cut")
    ref = tree_bytes(tmp_path / "ref")
    assert len(ref) > 3 and tree_bytes(tmp_path / "cut") == ref


class StopAtGather(LocalExecutor):
    """The local pool, stopped once the scatter tasks are done: their files stay behind."""

    def __init__(self) -> None:
        super().__init__(1)
        self.scatter_tasks = 0

    def _run(self, fn, tasks):
        if fn.__name__ == "gather_group":
            raise KeyboardInterrupt
        if fn.__name__ == "scatter_batch":
            self.scatter_tasks = len(tasks)
            for task in tasks:  # each task reads no more than the budget, unless one part does
                assert len(task.srcs) == 1 or sum(
                    mix_measure.measure_part((s, "chars")).chars.sum() for s in task.srcs
                ) <= mix_shuffle.SHUFFLE_CHARS
        return super()._run(fn, tasks)


def test_intermediate_files_follow_scatter_tasks_not_output_parts(tmp_path, monkeypatch):
    """One file per scatter task and split, however many output parts: the per-pair
    bucket files (input parts x output parts) grew with the documents."""
    make_corpus(tmp_path / "in", per_part=20)  # 24 input parts
    monkeypatch.setattr(mix_shuffle, "SHUFFLE_CHARS", 60_000)  # several input parts per task
    monkeypatch.setattr(mix_shuffle, "MIN_SHUFFLE_TASKS", 1)
    executor = StopAtGather()
    with pytest.raises(KeyboardInterrupt):
        run_mix(cfg(part_docs=3), tmp_path / "in", tmp_path / "out", executor)
    files = [p for p in (tmp_path / ".out.partial" / ".buckets").rglob("*") if p.is_file()]
    assert 1 < executor.scatter_tasks < 24
    assert len(files) <= 2 * executor.scatter_tasks  # train and val, one file each
    metrics = run_mix(cfg(part_docs=3), tmp_path / "in", tmp_path / "out")
    out_parts = -(-metrics["train_docs"] // 3) + -(-metrics["val_docs"] // 3)
    assert out_parts > 100 > len(files)
