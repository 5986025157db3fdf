"""Mix's cluster ranks by tasks: the same order and groups as sorting the names."""

from __future__ import annotations

import math
import random
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lmforge.config import MixConfig
from lmforge.data import mix_measure, mix_ranks
from lmforge.data.dedup import CLUSTERS_SCHEMA
from lmforge.data.mix import measure_docs, split_val
from lmforge.data.records import SCHEMA
from lmforge.errors import InputError
from lmforge.executor import LocalExecutor

DOMAINS = ["code", "en", "zh"]
# Ids and names that sort differently by bytes, case and script: é, 文, emoji, digits.
STEMS = ["a", "B", "é", "文", "b10", "b9", "😀", "a/b", "a b"]


def make_input(root: Path, n: int, seed: int,
               row_group: int = 37) -> tuple[dict[str, str], list[tuple[str, str]]]:
    """Parts of random documents and a clusters.parquet covering some of them (in
    several row groups, names shared within and across domains, some not an id);
    returns each document's cluster name as mix reads it, and (id, domain) in order."""
    rng = random.Random(seed)
    root.mkdir(parents=True)
    docs = [(f"{rng.choice(STEMS)}-{i}", rng.choice(DOMAINS)) for i in range(n)]
    names = {}
    for doc_id, _ in docs:
        roll = rng.random()
        if roll < 0.3:
            names[doc_id] = rng.choice(docs[: max(1, n // 4)])[0]  # a shared cluster
        elif roll < 0.4:
            names[doc_id] = f"{rng.choice(STEMS)}cluster-{rng.randrange(9)}"  # not an id
    for k in range(0, n, 23):
        chunk = docs[k:k + 23]
        pq.write_table(pa.table({"id": [d for d, _ in chunk], "text": ["x" * 50] * len(chunk),
                                 "domain": [m for _, m in chunk], "source": ["s"] * len(chunk),
                                 "file": ["f"] * len(chunk), "line": list(range(len(chunk)))},
                                schema=SCHEMA), root / f"part-{k // 23:05d}.parquet")
    listed = sorted(names, key=lambda _: rng.random())
    pq.write_table(pa.table({"id": listed, "domain": ["?"] * len(listed),
                             "cluster": [names[i] for i in listed], "kept": [True] * len(listed),
                             "similarity": [1.0] * len(listed)}, schema=CLUSTERS_SCHEMA),
                   root / "clusters.parquet", row_group_size=row_group)
    return {doc_id: names.get(doc_id, doc_id) for doc_id, _ in docs}, docs


def expected_ranks(docs: list[tuple[str, str]], cluster_of: dict[str, str]) -> np.ndarray:
    """Each document's cluster name's index among its domain's sorted names."""
    out = np.zeros(len(docs), dtype=np.int64)
    for domain in DOMAINS:
        names = sorted({cluster_of[d] for d, m in docs if m == domain})
        index = {c: k for k, c in enumerate(names)}
        for k, (d, m) in enumerate(docs):
            if m == domain:
                out[k] = index[cluster_of[d]]
    return out


@pytest.mark.parametrize(("seed", "min_tasks"), [(0, 16), (1, 3), (2, 1), (3, 40)])
def test_ranks_order_and_group_the_clusters_as_their_sorted_names(tmp_path, monkeypatch,
                                                                  seed, min_tasks):
    """One or many key runs, buckets and ranges: every document gets the rank of its
    cluster's name (its own id when it is in none) among its domain's names."""
    cluster_of, docs = make_input(tmp_path / "in", 300, seed)
    monkeypatch.setattr(mix_measure, "MIN_SHUFFLE_TASKS", min_tasks)
    parts = sorted((tmp_path / "in").glob("part-*.parquet"))
    got = measure_docs(LocalExecutor(1), parts, "chars", tmp_path / "in", tmp_path / "work")
    assert np.array_equal(got.cluster_rank, expected_ranks(docs, cluster_of))
    assert [got.domains[c] for c in got.codes] == [m for _, m in docs]
    runs = len(list((tmp_path / "work").glob("keys-*")))
    assert runs >= min(min_tasks, len(parts))
    assert len(list((tmp_path / "work").glob("join-*"))) == runs  # a bucket a run


def test_without_a_clusters_file_each_document_is_its_own_cluster(tmp_path):
    cluster_of, docs = make_input(tmp_path / "in", 120, 5)
    (tmp_path / "in" / "clusters.parquet").unlink()
    parts = sorted((tmp_path / "in").glob("part-*.parquet"))
    got = measure_docs(LocalExecutor(1), parts, "chars", tmp_path / "in", tmp_path / "work")
    assert np.array_equal(got.cluster_rank, expected_ranks(docs, {d: d for d, _ in docs}))


def test_an_id_listed_twice_in_clusters_is_one_clear_error(tmp_path):
    make_input(tmp_path / "in", 60, 6)
    path = tmp_path / "in" / "clusters.parquet"
    table = pq.read_table(path)
    pq.write_table(pa.concat_tables([table, table.slice(0, 1)]), path)
    parts = sorted((tmp_path / "in").glob("part-*.parquet"))
    with pytest.raises(InputError, match="clusters.parquet: an id is listed in more than one"):
        measure_docs(LocalExecutor(1), parts, "chars", tmp_path / "in", tmp_path / "work")


def split_by_names(doc_idx, clusters: list[str], chars, cfg, rng) -> np.ndarray:
    """The val split as it was written over cluster names (the reference)."""
    n = len(doc_idx)
    want_docs = max(cfg.min_val_docs, math.ceil(cfg.val_fraction * n))
    cap = max(1, math.floor(cfg.max_val_fraction * n))
    members: dict[str, list[int]] = {}
    for pos, i in enumerate(doc_idx):
        members.setdefault(clusters[i], []).append(pos)
    order = sorted(members)
    rng.shuffle(order)
    val = np.zeros(n, dtype=bool)
    docs = taken = 0
    for cluster in order[:-1]:
        if docs >= want_docs and taken >= cfg.min_val_chars:
            break
        pos = members[cluster]
        if docs + len(pos) > cap:
            continue
        val[pos] = True
        docs += len(pos)
        taken += int(chars[doc_idx[pos]].sum())
    return val


@pytest.mark.parametrize("seed", range(5))
def test_the_val_split_over_ranks_equals_the_split_over_names(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(5, 500))
    pick = random.Random(seed)
    names = [f"{pick.choice(STEMS)}{k}" for k in rng.integers(0, n, n)]
    ranks = {c: k for k, c in enumerate(sorted(set(names)))}
    chars = rng.integers(10, 3000, n).astype(np.int64)
    cfg = MixConfig(weights={"a": 1.0}, val_fraction=float(rng.uniform(0, 0.3)),
                    min_val_docs=int(rng.integers(0, 30)), min_val_chars=int(rng.integers(0, 9e4)),
                    max_val_fraction=float(rng.uniform(0.05, 0.5)))
    idx = np.arange(n)
    want = split_by_names(idx, names, chars, cfg, np.random.default_rng([seed, 9]))
    got = split_val(idx, np.array([ranks[c] for c in names]), chars, cfg,
                    np.random.default_rng([seed, 9]))
    assert np.array_equal(got, want)


def test_splitters_cut_the_samples_into_even_ranges():
    samples = [f"k{i:04d}" for i in range(1000)]
    cut = mix_ranks.splitters_of(samples, 4)
    assert cut == ["k0250", "k0500", "k0750"]
    assert mix_ranks.splitters_of(samples, 1) == [] and mix_ranks.splitters_of([], 5) == []
    assert mix_ranks.splitters_of(["a"] * 50, 8) == ["a"]  # equal samples: one cut


def test_each_join_and_rank_task_carries_its_own_pieces_only(tmp_path, monkeypatch):
    """Every row group of every key and join file goes to exactly one task, so what the
    tasks carry adds up to the files' row groups, not files x buckets per task."""
    cluster_of, docs = make_input(tmp_path / "in", 300, 7)
    monkeypatch.setattr(mix_measure, "MIN_SHUFFLE_TASKS", 12)
    seen: dict[str, list] = {}

    class Recording(LocalExecutor):
        def _run(self, fn, tasks):
            seen.setdefault(fn.__name__, []).extend(tasks)
            return super()._run(fn, tasks)

    parts = sorted((tmp_path / "in").glob("part-*.parquet"))
    got = measure_docs(Recording(1), parts, "chars", tmp_path / "in", tmp_path / "work")
    assert np.array_equal(got.cluster_rank, expected_ranks(docs, cluster_of))
    for fn, field, files in (("join_names", "keys", "keys-*"), ("rank_range", "pieces", "join-*")):
        groups = sum(pq.ParquetFile(f).num_row_groups for f in (tmp_path / "work").glob(files))
        carried = [piece for task in seen[fn] for piece in getattr(task, field)]
        assert len(seen[fn]) > 1 and len(carried) == len(set(carried)) == groups
