"""Dedup as sketch / exact / bands / components / write tasks: the clusters of the old
driver (datasketch MinHashLSH queried before each insert, a union-find), exact buckets,
a rerun after an interrupt that skips the finished tasks, and Ray writing local bytes."""

from __future__ import annotations

import gzip
import json
import pickle
import random
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from datasketch import LeanMinHash, MinHashLSH
from files import tree
from test_data_dedup import write_parts

from lmforge.config import DedupConfig, ExecutorConfig
from lmforge.data import dedup, minhash
from lmforge.data.dedup import cluster_roots, lsh_threshold, run_dedup
from lmforge.executor import LocalExecutor

REPO = Path(__file__).resolve().parents[1]
WORDS = [f"w{i}{c}" for i in range(400) for c in "ab"]
HANZI = [chr(0x4E00 + i * 7) for i in range(600)]
STEPS = ("sketch_part", "exact_pairs", "band_edges", "read_names", "write_part")


# --- the old algorithm, for reference ------------------------------------------------


def reference_roots(keys: list[bytes], sigs: np.ndarray, cfg: DedupConfig) -> np.ndarray:
    """The old driver: exact groups by a dict; each representative queries a MinHashLSH
    before it is inserted, and joins the candidates whose estimated Jaccard passes."""
    parent = list(range(len(keys)))

    def find(x: int) -> int:
        while parent[x] != x:
            x = parent[x]
        return x

    def union(a: int, b: int) -> None:
        ra, rb = find(a), find(b)
        parent[max(ra, rb)] = min(ra, rb)

    first: dict[bytes, int] = {}
    reps = []
    for i, key in enumerate(keys):
        j = first.setdefault(key, i)
        if j == i or not cfg.exact:
            reps.append(i)
        else:
            union(i, j)
    if cfg.near:
        lsh = MinHashLSH(num_perm=cfg.num_perm, params=(cfg.bands, cfg.rows))
        threshold = lsh_threshold(cfg.bands, cfg.rows)
        for i in reps:
            m = LeanMinHash(seed=cfg.seed, hashvalues=sigs[i], scheme=minhash.LSH_SCHEME)
            for j in lsh.query(m):
                if minhash.jaccard(sigs[j], sigs[i]) >= threshold:
                    union(i, j)
            lsh.insert(i, m, check_duplication=False)
    return np.array([find(i) for i in range(len(keys))])


def reference_clusters(texts: list[str], ids: list[str], cfg: DedupConfig) -> dict[str, str]:
    norms = [minhash.normalize(t) for t in texts]
    sigs = minhash.signatures(norms, cfg.num_perm, cfg.seed, cfg.scheme, cfg.shingle,
                              cfg.word_ngram, cfg.char_ngram)
    roots = reference_roots([minhash.exact_key(t) for t in norms], sigs, cfg)
    return {i: ids[r] for i, r in zip(ids, roots, strict=True)}


# --- corpora ----------------------------------------------------------------------------


def _mutate(words: list[str], k: int, rng: random.Random) -> list[str]:
    words = list(words)
    for i in rng.sample(range(len(words)), k):
        words[i] = rng.choice(WORDS)
    return words


def near_dup_corpus(seed: int = 3) -> list[tuple[str, str, str]]:
    """Families whose members are 1..12 words from their base (estimated Jaccard on
    both sides of the threshold, so chains and refused candidates), a family of 150
    one-word variants (buckets of dozens in every band), exact copies after
    normalisation, Chinese variants and unrelated texts, shuffled."""
    rng = random.Random(seed)
    docs = []
    for f in range(8):
        base = [rng.choice(WORDS) for _ in range(150)]
        docs += [(f"f{f}-{k}", " ".join(_mutate(base, k, rng)), "en") for k in range(13)]
    big = [rng.choice(WORDS) for _ in range(120)]
    docs += [(f"big-{k}", " ".join(_mutate(big, 1, rng)), "en") for k in range(150)]
    zh = [rng.choice(HANZI) for _ in range(300)]
    docs += [(f"zh-{k}", "".join(_mutate(zh, k, rng)), "zh") for k in range(12)]
    docs += [(f"u-{k}", " ".join(rng.choice(WORDS) for _ in range(100)), "en")
             for k in range(60)]
    for k, (_, text, domain) in enumerate(rng.sample(docs, 40)):
        docs.append((f"copy-{k}", "  " + text.upper().replace(" ", "\n", 3) + " ", domain))
    rng.shuffle(docs)
    return docs


def clusters_of(out: Path) -> dict[str, str]:
    c = pq.read_table(out / "clusters.parquet").to_pydict()
    return dict(zip(c["id"], c["cluster"], strict=True))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, list[tuple[str, str, str]]]:
    docs = near_dup_corpus()
    root = tmp_path_factory.mktemp("corpus")
    write_parts(root / "in", docs, per_part=31)
    return root / "in", docs


@pytest.fixture(scope="module")
def local_out(corpus, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("local") / "out"
    metrics = run_dedup(DedupConfig(num_workers=1), corpus[0], out, LocalExecutor(1))
    return out, metrics


# --- the old algorithm's clusters -----------------------------------------------------


def test_clusters_equal_the_old_algorithm_on_many_near_duplicates(corpus, local_out):
    in_dir, docs = corpus
    cfg = DedupConfig()
    expected = reference_clusters([d[1] for d in docs], [d[0] for d in docs], cfg)
    assert clusters_of(local_out[0]) == expected
    # The corpus tests what it should: a cluster of over 100, exact and near duplicates.
    sizes = np.unique(list(expected.values()), return_counts=True)[1]
    assert sizes.max() >= 100 and local_out[1]["exact_dups"] >= 10
    assert local_out[1]["near_dups"] > 150


def test_without_exact_grouping_clusters_equal_the_old_algorithm(corpus, tmp_path):
    in_dir, docs = corpus
    cfg = DedupConfig(exact=False, bands=32, rows=4, num_workers=1)
    run_dedup(cfg, in_dir, tmp_path / "out", LocalExecutor(1))
    assert clusters_of(tmp_path / "out") == reference_clusters(
        [d[1] for d in docs], [d[0] for d in docs], cfg)


def test_chunks_shards_and_forests_change_no_byte(corpus, local_out, tmp_path, monkeypatch):
    """Tiny pair chunks, signature runs and edge caps, and bands split into shards."""
    monkeypatch.setattr(dedup, "PAIR_CHUNK", 7)
    monkeypatch.setattr(dedup, "GATHER_ROWS", 5)
    monkeypatch.setattr(dedup, "EDGE_CAP", 3)
    monkeypatch.setattr(dedup, "BAND_ROWS_PER_TASK", 60)
    metrics = run_dedup(DedupConfig(num_workers=1), corpus[0], tmp_path / "out",
                        LocalExecutor(1))
    assert metrics == local_out[1]
    assert tree(tmp_path / "out") == tree(local_out[0])


def test_demo_corpus_equals_the_old_algorithm(tmp_path):
    """The demo corpus as shipped (its near duplicates are there) in parts of 400, plus an
    exact copy of 150 of its documents under other ids."""
    docs = []
    for src in sorted((REPO / "data" / "raw" / "demo").glob("*/*.jsonl.gz")):
        with gzip.open(src, "rt", encoding="utf-8") as f:
            docs += [(r["id"], r["text"], src.parent.name) for r in map(json.loads, f)]
    docs += [(f"copy-{i}", text, domain) for i, (_, text, domain) in enumerate(docs[500:650])]
    write_parts(tmp_path / "in", docs, per_part=400)
    cfg = DedupConfig(num_workers=2)
    metrics = run_dedup(cfg, tmp_path / "in", tmp_path / "out")
    expected = reference_clusters([d[1] for d in docs], [d[0] for d in docs], cfg)
    assert clusters_of(tmp_path / "out") == expected
    assert metrics["near_dups"] > 0 and metrics["exact_dups"] >= 150


# --- buckets are exact -----------------------------------------------------------------


def _roots_of(sigs: np.ndarray, keys: list[bytes], cfg: DedupConfig, work: Path,
              per_part: int = 4) -> np.ndarray:
    """cluster_roots on signatures written as sketch files, ``per_part`` rows a file."""
    (work / ".sketch").mkdir(parents=True)
    stems, offsets = [], [0]
    for p, lo in enumerate(range(0, len(sigs), per_part)):
        stems.append(str(work / ".sketch" / f"part-{p:05d}"))
        np.save(stems[-1] + dedup.SIG_SUFFIX, np.ascontiguousarray(sigs[lo : lo + per_part].T))
        offsets.append(min(lo + per_part, len(sigs)))
    key_array = np.frombuffer(b"".join(keys), dtype=np.uint64).reshape(-1, 2)
    first = dedup.exact_groups(key_array)
    return cluster_roots(cfg, stems, np.array(offsets), first, work, LocalExecutor(1))


def _keys(n: int) -> list[bytes]:
    return [minhash.exact_key(f"doc {i}") for i in range(n)]


def test_a_pair_is_joined_only_when_a_band_is_exactly_equal(tmp_path):
    cfg = DedupConfig(num_perm=16, bands=4, rows=4)  # threshold (1/4)^(1/4) = 0.707
    rng = np.random.default_rng(0)
    fresh = lambda: rng.integers(1 << 20, 1 << 31, 16, dtype=np.uint32)  # noqa: E731
    s0 = fresh()
    s1 = s0.copy()
    s1[12:] = fresh()[12:]  # bands 0-2 equal to doc 0: Jaccard 0.75, joined
    s2 = s0.copy()
    s2[::4] += 3  # one slot off in every band: Jaccard 0.75, but no bucket shared
    s3 = fresh()
    s3[4:8] = s2[4:8]  # shares band 1 with doc 2 exactly, Jaccard 0.25: refused
    s4 = s0.copy()
    s4[3] ^= 1  # band 0 one bit off doc 0's, in its last slot
    s4[[5, 9, 13]] += 7  # and no other band equal: Jaccard 0.75, not joined
    s5 = s4.copy()  # all of doc 4's bands: joined to it
    sigs = np.stack([s0, s1, s2, s3, s4, s5])
    assert minhash.jaccard(s0, s2) >= lsh_threshold(4, 4) and minhash.jaccard(s0, s4) >= 0.7
    roots = _roots_of(sigs, _keys(6), cfg, tmp_path, per_part=2)
    assert roots.tolist() == [0, 0, 2, 3, 4, 4]
    assert roots.tolist() == reference_roots(_keys(6), sigs, cfg).tolist()


def test_a_big_bucket_and_exact_groups_equal_the_old_algorithm(tmp_path, monkeypatch):
    """300 signatures share band 0 and agree with a base in a random share of the other
    slots (so Jaccard falls on both sides of the threshold); some are exact copies."""
    cfg = DedupConfig(num_perm=32, bands=4, rows=8)  # threshold 0.84
    rng = np.random.default_rng(1)
    base = rng.integers(0, 1 << 32, 32, dtype=np.uint32)
    n = 400
    sigs = rng.integers(0, 1 << 32, (n, 32), dtype=np.uint32)
    agree = rng.random((n, 32)) < rng.uniform(0.6, 1.0, (n, 1))
    sigs = np.where(agree, base, sigs).astype(np.uint32)
    sigs[:300, :8] = base[:8]
    keys = _keys(n)
    for i, j in zip(rng.choice(n, 30), rng.choice(n, 30), strict=True):
        if i != j:
            keys[j], sigs[j] = keys[i], sigs[i]  # an exact copy has the same signature
    order = rng.permutation(n)
    sigs, keys = sigs[order], [keys[i] for i in order]
    expected = reference_roots(keys, sigs, cfg)
    monkeypatch.setattr(dedup, "PAIR_CHUNK", 1000)  # the bucket's 45k pairs in chunks
    roots = _roots_of(sigs, keys, cfg, tmp_path, per_part=64)
    assert roots.tolist() == expected.tolist()
    assert 10 < len(np.unique(roots)) < n - 100


# --- resuming ----------------------------------------------------------------------------


@pytest.mark.parametrize("step", STEPS)
def test_a_rerun_after_an_interrupt_skips_the_finished_tasks(corpus, local_out, tmp_path,
                                                             monkeypatch, step):
    in_dir = corpus[0]
    out = tmp_path / "out"
    total = {"sketch_part": 12, "exact_pairs": 2, "band_edges": 16, "read_names": 2,
             "write_part": 12}
    assert len(list(in_dir.glob("part-*.parquet"))) == 12
    done_before = 1 if step in ("exact_pairs", "read_names") else 5

    real = {name: getattr(dedup, name) for name in STEPS}
    calls: dict[str, int] = dict.fromkeys(STEPS, 0)

    def counting(name: str, fail_after: int | None = None):
        def run(task):
            if calls[name] == fail_after:
                raise RuntimeError(f"interrupted in {name}")
            calls[name] += 1
            return real[name](task)
        return run

    for name in STEPS:
        monkeypatch.setattr(dedup, name, counting(name, done_before if name == step else None))
    with pytest.raises(RuntimeError, match="interrupted"):
        run_dedup(DedupConfig(num_workers=1), in_dir, out, LocalExecutor(1))
    assert not out.exists() and (tmp_path / ".out.partial").is_dir()

    calls.update(dict.fromkeys(STEPS, 0))
    for name in STEPS:
        monkeypatch.setattr(dedup, name, counting(name))
    metrics = run_dedup(DedupConfig(num_workers=1), in_dir, out, LocalExecutor(1))
    before = STEPS[: STEPS.index(step)]
    assert calls == {name: 0 if name in before else
                     total[name] - done_before if name == step else total[name]
                     for name in STEPS}
    assert metrics == local_out[1]
    assert tree(out) == tree(local_out[0])
    assert not (tmp_path / ".out.partial").exists()


# --- Ray ---------------------------------------------------------------------------------


def test_write_tasks_carry_no_ids_the_names_file_does(corpus, local_out, tmp_path,
                                                     monkeypatch):
    """The driver sends each write task positions in one names file, not the kept
    documents' ids (which it never holds), and the output is the same."""
    sent = []
    plain = LocalExecutor.map

    def recording(self, fn, tasks, desc=None, log=None):
        tasks = list(tasks)
        if fn is dedup.write_part:
            sent.extend(tasks)
        return plain(self, fn, tasks, desc, log)

    monkeypatch.setattr(LocalExecutor, "map", recording)
    run_dedup(DedupConfig(num_workers=1), corpus[0], tmp_path / "out", LocalExecutor(1))
    assert tree(tmp_path / "out") == tree(local_out[0])
    ids = {d[0].encode() for d in corpus[1]}
    named = [t for t in sent if (t.name_at >= 0).any()]
    assert len(named) >= 2 and all(isinstance(t.names, str) for t in sent)
    for task in sent:
        payload = pickle.dumps(task)
        assert not any(i in payload for i in ids)


def test_ray_writes_the_local_bytes(ray_cluster, corpus, local_out, tmp_path, monkeypatch):
    from lmforge.executor import RayExecutor

    monkeypatch.setattr(dedup, "BAND_ROWS_PER_TASK", 150)  # bands in shards too (driver side)
    metrics = run_dedup(DedupConfig(), corpus[0], tmp_path / "out",
                        RayExecutor(ExecutorConfig("ray")))
    assert metrics == local_out[1]
    assert tree(tmp_path / "out") == tree(local_out[0])


# --- the driver's pieces at scale ------------------------------------------------------


@pytest.mark.parametrize("workers", [1, 3])
def test_exact_tasks_group_as_all_the_keys_at_once(tmp_path, workers):
    """Keys spread over parts (some in every slot, copies across parts): the slot tasks'
    forest is exact_groups of every key, and the pairs are its non-first documents."""
    rng = np.random.default_rng(5)
    n = 3000
    keys = rng.integers(0, np.iinfo(np.uint64).max, (n, 2), dtype=np.uint64, endpoint=True)
    src = rng.integers(0, n, 600)
    keys[rng.integers(0, n, 600)] = keys[src]  # copies, in other parts too
    keys[::7, 1] = keys[0, 1]  # equal second halves: only whole keys are equal
    stems, offsets = [], [0]
    for p, lo in enumerate(range(0, n, 700)):
        stems.append(str(tmp_path / f"part-{p}"))
        dedup.save_slot_keys(stems[-1], keys[lo : lo + 700])
        offsets.append(min(lo + 700, n))
    parent, pairs = dedup.exact_parents(stems, np.array(offsets), tmp_path / ".exact",
                                        LocalExecutor(workers), None)
    first = dedup.exact_groups(keys)
    assert np.array_equal(parent, first)
    moved = np.flatnonzero(first != np.arange(n))
    assert np.array_equal(pairs, np.stack([moved, first[moved]], axis=1))
    assert len(moved) > 300 and len(np.unique(dedup.key_slots(keys))) > 200


@pytest.mark.parametrize("chunks", [None, (7, 5)])
@pytest.mark.parametrize("keep", ["first", "longest", "quality"])
def test_members_keep_what_the_whole_arrays_would(tmp_path, keep, chunks, monkeypatch):
    """cluster_members reads lengths and quality for the members alone: the kept
    documents are choose_kept's over every document, and exact means the kept one's
    exact group; cut into small chunks of members, the same."""
    if chunks:
        monkeypatch.setattr(dedup, "SIMILARITY_ROWS", chunks[0])
        monkeypatch.setattr(dedup, "MEMBER_CHUNK", chunks[1])
    rng = np.random.default_rng(6)
    n, per = 500, 120
    roots = np.arange(n)
    for r in rng.choice(n // 2, 40, replace=False):
        members = rng.choice(np.arange(r + 1, n), rng.integers(1, 6), replace=False)
        roots[members] = r
    roots = dedup.compress(np.minimum(roots, roots[roots]))  # a forest of roots
    chars = rng.integers(1, 5, n)  # ties, so the earliest must win them
    quality = rng.integers(0, 3, n).astype(float)
    sigs = rng.integers(0, 8, (n, 16), dtype=np.uint32)  # similarities all over (0, 1)
    stems, offsets = [], [0]
    for p, lo in enumerate(range(0, n, per)):
        stems.append(str(tmp_path / f"part-{p}"))
        hi = min(lo + per, n)
        np.savez(stems[-1] + dedup.META_SUFFIX, keys=np.zeros((hi - lo, 2), np.uint64),
                 chars=chars[lo:hi], quality=quality[lo:hi])
        np.save(stems[-1] + dedup.SIG_SUFFIX, np.ascontiguousarray(sigs[lo:hi].T))
        offsets.append(hi)
    first = np.arange(n)
    dups = np.flatnonzero(roots != np.arange(n))[::2]
    first[dups] = roots[dups]  # half the members exact copies of their root
    pairs = np.stack([dups, roots[dups]], axis=1)
    cfg = DedupConfig(keep=keep, near=False)
    got = dedup.cluster_members(cfg, roots, pairs, stems, np.array(offsets))
    kept_of = dedup.choose_kept(roots, chars, keep, quality)
    sizes = np.bincount(roots, minlength=n)
    in_cluster = sizes[roots] > 1
    assert np.array_equal(got.docs, np.flatnonzero(in_cluster))
    assert np.array_equal(got.kept, kept_of[in_cluster])
    exact = (first == first[kept_of])[in_cluster]
    assert np.array_equal(got.exact, exact) and 0 < exact.sum() < len(exact)
    want = np.array([1.0 if e else minhash.jaccard(sigs[d], sigs[k])
                     for d, k, e in zip(got.docs, got.kept, exact, strict=True)])
    assert np.array_equal(got.similarity, want)
    assert got.clusters == int((sizes > 1).sum())
    assert (keep == "first") == np.array_equal(got.kept, roots[in_cluster])


@pytest.mark.parametrize("sizes", [[5, 0, 7, 3], [4, 4], [], [0], [9]])
def test_clusters_file_is_streamed_as_one_table_writes(tmp_path, sizes):
    """Rows from several parts, row groups cut across them: the bytes of write_table of
    the whole table in one chunk (with that row group size; an empty one too)."""
    import pyarrow as pa

    tables = [pa.table({"id": [f"d{k}-{i}" for i in range(size)], "domain": ["en"] * size,
                        "cluster": [f"d{k}-0"] * size, "kept": [i == 0 for i in range(size)],
                        "similarity": [1.0] * size}, schema=dedup.CLUSTERS_SCHEMA)
              for k, size in enumerate(sizes)]
    with dedup.ClustersWriter(tmp_path / "streamed.parquet", rows=4) as writer:
        for t in tables:
            writer.add(t)
        assert not (tmp_path / "streamed.parquet").exists()  # written whole or not at all
    with pytest.raises(RuntimeError), dedup.ClustersWriter(tmp_path / "failed.parquet") as w:
        w.add(tables[0] if tables else dedup.CLUSTERS_SCHEMA.empty_table())
        raise RuntimeError("a write task failed")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["streamed.parquet"]
    whole = (pa.concat_tables(tables) if tables else dedup.CLUSTERS_SCHEMA.empty_table())
    pq.write_table(whole.combine_chunks(), tmp_path / "whole.parquet", compression="zstd",
                   row_group_size=4)
    assert (tmp_path / "streamed.parquet").read_bytes() == (tmp_path / "whole.parquet").read_bytes()
    assert pq.ParquetFile(tmp_path / "streamed.parquet").metadata.num_rows == sum(sizes)
