"""The dedup stage: exact duplicates by normalised-text hash, near duplicates by MinHash-LSH.

Pass 1 (parallel over parts) turns each document into an exact key, a length and a
MinHash signature; texts are never all held. The main process groups exact keys,
indexes one signature per exact group in ``datasketch.MinHashLSH``, confirms each LSH
candidate by its estimated Jaccard, and joins duplicates with union-find. Pass 2
(parallel) rewrites each part without the dropped documents.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from datasketch import LeanMinHash, MinHashLSH

from lmforge.config import DedupConfig
from lmforge.data import minhash
from lmforge.data.counts import Counts
from lmforge.data.quality import quality_score
from lmforge.data.records import list_parts, read_table, write_table
from lmforge.io import atomic_dir, atomic_path
from lmforge.parallel import imap_ordered

EXACT_DUP = "exact_dup"
NEAR_DUP = "near_dup"
CLUSTERS_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("domain", pa.string()),
        ("cluster", pa.string()),  # the id of the document the cluster keeps
        ("kept", pa.bool_()),
        ("similarity", pa.float64()),  # estimated Jaccard to the kept document
    ]
)


@dataclass(frozen=True)
class SketchTask:
    path: str
    cfg: DedupConfig


@dataclass
class PartSketch:
    """What dedup needs to know about one part's documents, without their texts."""

    ids: list[str]
    domains: list[str]
    keys: list[bytes]
    chars: np.ndarray  # int64 [n]
    quality: np.ndarray  # float64 [n]; zeros unless keep == "quality"
    signatures: np.ndarray  # uint32 [n, num_perm]


def sketch_part(task: SketchTask) -> PartSketch:
    """Exact keys, lengths and MinHash signatures for one part (worker)."""
    cfg = task.cfg
    table = read_table(task.path, columns=["id", "text", "domain"])
    texts = table.column("text").to_pylist()
    norms = [minhash.normalize(t) for t in texts]
    keys = [minhash.exact_key(t) for t in norms]
    if cfg.near:
        # The whole part at once: shingling and sketching are vectorised across texts.
        sigs = minhash.signatures(norms, cfg.num_perm, cfg.seed, cfg.scheme, cfg.shingle,
                                  cfg.word_ngram, cfg.char_ngram)
    else:
        sigs = np.empty((len(texts), 0), dtype=np.uint32)
    del norms
    chars = pc.utf8_length(table.column("text")).to_numpy().astype(np.int64)
    quality = np.zeros(len(texts))
    if cfg.keep == "quality":
        quality = np.array([quality_score(t) for t in texts], dtype=np.float64)
    return PartSketch(table.column("id").to_pylist(), table.column("domain").to_pylist(),
                      keys, chars, quality, sigs)


class UnionFind:
    """Disjoint sets over 0..n-1 with path halving; the root is the smallest member."""

    def __init__(self, n: int):
        self.parent = list(range(n))

    def find(self, x: int) -> int:
        parent = self.parent
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def union(self, x: int, y: int) -> None:
        rx, ry = self.find(x), self.find(y)
        if rx != ry:
            self.parent[max(rx, ry)] = min(rx, ry)


def lsh_threshold(bands: int, rows: int) -> float:
    """The similarity where the LSH S-curve ``1 - (1 - s^rows)^bands`` turns: (1/b)^(1/r)."""
    return (1.0 / bands) ** (1.0 / rows)


def link_exact(keys: list[bytes], uf: UnionFind) -> list[int]:
    """Join documents with equal keys; return the first index of each exact group."""
    first: dict[bytes, int] = {}
    reps = []
    for i, key in enumerate(keys):
        j = first.setdefault(key, i)
        if j == i:
            reps.append(i)
        else:
            uf.union(i, j)
    return reps


def link_near(sigs: np.ndarray, candidates: list[int], cfg: DedupConfig, uf: UnionFind) -> None:
    """Join documents whose LSH buckets collide and whose estimated Jaccard passes.

    Each document queries the index before it is inserted, so every pair is seen once.
    A candidate below the S-curve threshold is an LSH false positive and is ignored.
    """
    lsh = MinHashLSH(num_perm=cfg.num_perm, params=(cfg.bands, cfg.rows))
    threshold = lsh_threshold(cfg.bands, cfg.rows)
    for i in candidates:
        m = LeanMinHash(seed=cfg.seed, hashvalues=sigs[i], scheme=minhash.LSH_SCHEME)
        found = lsh.query(m)
        if found:
            found = np.array(sorted(found))
            sims = minhash.jaccard(sigs[found], sigs[i])
            for j in found[sims >= threshold]:
                uf.union(i, int(j))
        lsh.insert(i, m, check_duplication=False)


def choose_kept(roots: np.ndarray, chars: np.ndarray, keep: str,
                quality: np.ndarray | None = None) -> np.ndarray:
    """For every document, the index of the document its cluster keeps.

    ``first``: the earliest; ``longest``: most characters; ``quality``: best quality
    score, then most characters. Ties go to the earliest, so the choice is stable.
    """
    n = len(roots)
    if keep == "first":
        return roots.copy()  # the union-find root is the cluster's first member
    keys = [np.arange(n), -chars]  # lexsort: the last key is the primary one
    if keep == "quality":
        assert quality is not None
        keys.append(-quality)
    order = np.lexsort((*keys, roots))
    best = np.empty(n, dtype=np.int64)
    first_of_root = order[np.r_[True, roots[order][1:] != roots[order][:-1]]]
    best[roots[first_of_root]] = first_of_root
    return best[roots]


@dataclass(frozen=True)
class WriteTask:
    src: str
    out: str
    keep: np.ndarray  # bool per row


def write_part(task: WriteTask) -> int:
    """Rewrite one part with only its kept rows (worker)."""
    table = read_table(task.src)
    write_table(table.filter(pa.array(task.keep)), task.out)
    return int(task.keep.sum())


def run_dedup(cfg: DedupConfig, in_dir: str | Path, out_dir: str | Path) -> dict[str, Any]:
    """Deduplicate ``in_dir`` into ``out_dir`` (+ clusters.parquet); return metrics."""
    parts = list_parts(in_dir)
    sketches = list(imap_ordered(sketch_part, [SketchTask(str(p), cfg) for p in parts],
                                 cfg.num_workers, desc="dedup: sketch"))
    ids = [i for s in sketches for i in s.ids]
    domains = [d for s in sketches for d in s.domains]
    keys = [k for s in sketches for k in s.keys]
    chars = np.concatenate([s.chars for s in sketches]) if sketches else np.zeros(0, np.int64)
    quality = np.concatenate([s.quality for s in sketches]) if sketches else np.zeros(0)
    sigs = np.concatenate([s.signatures for s in sketches]) if sketches else np.zeros((0, 0))
    n = len(ids)

    uf = UnionFind(n)
    reps = link_exact(keys, uf) if cfg.exact else list(range(n))
    if cfg.near:
        link_near(sigs, reps, cfg, uf)
    roots = np.array([uf.find(i) for i in range(n)], dtype=np.int64)
    kept_of = choose_kept(roots, chars, cfg.keep, quality)

    exact = np.array([keys[i] == keys[k] for i, k in enumerate(kept_of)], dtype=bool)
    similarity = exact.astype(np.float64)
    near = ~exact
    if near.any():
        similarity[near] = minhash.jaccard(sigs[near], sigs[kept_of[near]])
    is_kept = kept_of == np.arange(n)

    counts = Counts()
    for i in range(n):
        c = counts[domains[i]]
        c.n_in += 1
        if is_kept[i]:
            c.kept += 1
        else:
            c.rejected[EXACT_DUP if exact[i] else NEAR_DUP] += 1

    with atomic_dir(out_dir) as tmp:
        offsets = np.cumsum([0] + [len(s.ids) for s in sketches])
        tasks = [WriteTask(str(p), str(tmp / p.name), is_kept[offsets[k]:offsets[k + 1]])
                 for k, p in enumerate(parts)]
        written = sum(imap_ordered(write_part, tasks, cfg.num_workers, desc="dedup: write"))
        assert written == int(is_kept.sum())
        clusters = pa.table(
            {"id": ids, "domain": domains, "cluster": [ids[k] for k in kept_of],
             "kept": is_kept, "similarity": similarity},
            schema=CLUSTERS_SCHEMA,
        )
        with atomic_path(tmp / "clusters.parquet") as path:
            write_table(clusters, path)

    sizes = np.bincount(roots, minlength=n)
    metrics = counts.as_dict()
    metrics.update(
        parts=len(parts),
        exact_dups=int((~is_kept & exact).sum()),
        near_dups=int((~is_kept & near).sum()),
        clusters=int((sizes > 1).sum()),
        docs_in_clusters=int(sizes[sizes > 1].sum()),
        lsh_threshold=round(lsh_threshold(cfg.bands, cfg.rows), 4),
    )
    return metrics
