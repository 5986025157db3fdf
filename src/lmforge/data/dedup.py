"""The dedup stage: exact duplicates by normalised-text hash, near duplicates by MinHash-LSH.

A driver and per-item tasks, run on an :class:`~lmforge.executor.Executor` (the local
pool or a Ray cluster; the bytes written are the same either way):

1. **sketch** (a task per part): each document's exact key, length, quality and MinHash
   signature, written to ``.sketch/`` in the work directory, the keys once more ordered
   by slot (their top bits); only the row count comes back.
2. **exact** (a task per run of slots): documents with equal keys form an exact group,
   represented by its first document (one sort of the 128-bit keys of the slots; equal
   keys share a slot, so a group is never split). The pairs (document, first) of the
   non-first documents go to ``.exact/``.
3. **bands** (a task per LSH band, or per band and bucket shard when there are few bands
   for the workers or too many documents for one task): the band's values of every
   representative, read from the memory-mapped signature files; buckets of *exactly*
   equal band values (a sort, no lossy hash); every pair in a bucket confirmed by its
   estimated Jaccard on the full signatures against :func:`lsh_threshold`. The confirmed
   pairs, reduced to a spanning forest, go to ``.edges/``.
4. **components** (driver): the exact groups and the confirmed pairs joined by a
   vectorised union-find; a cluster's root is its smallest document index.
5. **members** (driver): the documents in clusters of two or more, the one each cluster
   keeps (lengths and quality read for the members alone), exact or near, similarity.
6. **names** (tasks over runs of the parts holding a kept document of a cluster): those
   ids, which the driver streams into one Arrow file, ``.names.arrow``.
7. **write** (a task per part): the part without its dropped documents, its members'
   cluster names taken by position from the names file; back come its counts and its
   rows of clusters.parquet, which the driver writes as they come, in row groups as one
   ``write_table`` of the whole table makes them (the same bytes).

Two representatives are joined iff they share a bucket in at least one band and their
estimated Jaccard reaches the threshold: the pairs ``datasketch.MinHashLSH`` returns and
the old driver confirmed, so the clusters are the same. A bucket of k documents costs
k(k-1)/2 Jaccard checks (as querying an LSH index does), done in bounded chunks.

The work directory survives a kill: a rerun skips the tasks already done (their markers
in ``.done/``) and writes the same bytes.

The driver never holds an id or a domain: per document, the union-find's forest (8
bytes) and, while it is joined or compressed, as much again; the exact pairs (16 bytes
per exact duplicate); per member of a cluster, the member, its kept document, flags and
similarity (~25 bytes; the lookups between run on chunks of members); besides, one block
of signatures, one names task's ids and up to a row group of clusters.parquet, whatever
the corpus. bench/bench_dedup_driver.py measures it at x1, x10 and x30 of the demo
corpus (bench/RESULTS.md, block ``dedup_driver``).
"""


from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from lmforge.config import DedupConfig
from lmforge.data import minhash
from lmforge.data.counts import Counts
from lmforge.data.quality import quality_score
from lmforge.data.records import COMPRESSION, list_parts, read_table, write_table
from lmforge.executor import Executor, LocalExecutor, PartLog, output_settings
from lmforge.io import atomic_path, files_fingerprint, resumable_dir

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
SIG_SUFFIX = ".sig.npy"  # uint32 [num_perm, n]: slot-major, so a band is contiguous
META_SUFFIX = ".meta.npz"  # keys uint64 [n, 2], chars int64 [n], quality float64 [n]
# The exact keys again, ordered by slot: keys uint64 [n, 2], their rows int64 [n], and
# where each of the SLOTS slots starts (int64 [SLOTS + 1]).
XKEYS_SUFFIX, XROWS_SUFFIX, XOFF_SUFFIX = ".xkeys.npy", ".xrows.npy", ".xoff.npy"
SLOT_BITS = 8
SLOTS = 1 << SLOT_BITS  # an exact task takes a run of slots: at most this many tasks
EXACT_ROWS_PER_TASK = 1 << 23  # documents an exact task groups (~0.4 GB)
BAND_ROWS_PER_TASK = 1 << 23  # representatives one band task sorts (~0.5 GB at 8 rows)
PAIR_CHUNK = 1 << 16  # bucket pairs checked at once (two signatures each)
GATHER_ROWS = 1 << 16  # signatures read at once for a run of buckets
EDGE_CAP = 1 << 22  # confirmed pairs a band task holds before reducing them to a forest
# Members whose similarity the driver computes at once for clusters.parquet: two 1 MiB
# blocks of signatures at 128 slots (65,536 rows made 64 MiB, the driver's largest
# allocation; 8,192 made 8 MiB, a fixed block that at x30 of the demo still looked
# like ~100 B a document; the time is the same).
SIMILARITY_ROWS = 1 << 11
MEMBER_CHUNK = 1 << 16  # members looked up at once in the exact pairs
NAMES_FILE = ".names.arrow"  # the kept documents' ids, for the write tasks (kept_names)
CLUSTER_ROW_GROUP = 1 << 20  # clusters.parquet's rows a row group (write_table's default)


def lsh_threshold(bands: int, rows: int) -> float:
    """The similarity where the LSH S-curve ``1 - (1 - s^rows)^bands`` turns: (1/b)^(1/r)."""
    return (1.0 / bands) ** (1.0 / rows)


# --- 1. sketch (task per part) -------------------------------------------------------


@dataclass(frozen=True)
class SketchTask:
    path: str
    cfg: DedupConfig
    out: str  # file stem: <out>.sig.npy, <out>.meta.npz


def _save(path: str | Path, save: Any, *args: Any, **kwargs: Any) -> None:
    """``np.save``/``np.savez`` to exactly ``path``, atomically."""
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        save(f, *args, **kwargs)


def key_slots(keys: np.ndarray) -> np.ndarray:
    """Each exact key's slot (its first half's top bits: the key is a hash, so uniform)."""
    return (keys[:, 0] >> np.uint64(64 - SLOT_BITS)).astype(np.int64)


def sketch_part(task: SketchTask) -> int:
    """Exact keys, lengths, quality and MinHash signatures of one part, to files; the
    keys also ordered by slot (``.xkeys.npy``, ``.xrows.npy``, ``.xoff.npy``) so an
    exact task reads its slots' rows alone (worker). Returns the part's row count."""
    cfg = task.cfg
    table = read_table(task.path, columns=["text"])
    texts = table.column("text").to_pylist()
    norms = [minhash.normalize(t) for t in texts]
    keys = np.frombuffer(b"".join(minhash.exact_key(t) for t in norms),
                         dtype=np.uint64).reshape(-1, 2)
    if cfg.near:
        # The whole part at once: shingling and sketching are vectorised across texts.
        sigs = minhash.signatures(norms, cfg.num_perm, cfg.seed, cfg.scheme, cfg.shingle,
                                  cfg.word_ngram, cfg.char_ngram)
        _save(task.out + SIG_SUFFIX, np.save, np.ascontiguousarray(sigs.T))
    del norms
    chars = pc.utf8_length(table.column("text")).to_numpy().astype(np.int64)
    quality = np.zeros(len(texts))
    if cfg.keep == "quality":
        quality = np.array([quality_score(t) for t in texts], dtype=np.float64)
    _save(task.out + META_SUFFIX, np.savez, keys=keys, chars=chars, quality=quality)
    save_slot_keys(task.out, keys)
    return len(texts)


def save_slot_keys(stem: str, keys: np.ndarray) -> None:
    """A part's exact keys (uint64 [n, 2]) ordered by slot, with their rows and where
    each slot starts: what :func:`exact_pairs` reads."""
    slots = key_slots(keys)
    order = np.argsort(slots, kind="stable")
    _save(stem + XKEYS_SUFFIX, np.save, np.ascontiguousarray(keys[order]))
    _save(stem + XROWS_SUFFIX, np.save, order.astype(np.int64))
    _save(stem + XOFF_SUFFIX, np.save,
          np.searchsorted(slots[order], np.arange(SLOTS + 1)).astype(np.int64))


class Signatures:
    """Every part's signature file, memory-mapped, addressed by global document index."""

    MAX_OPEN = 64  # each map holds a file descriptor

    def __init__(self, stems: list[str], offsets: np.ndarray) -> None:
        self.stems = stems
        self.offsets = np.asarray(offsets, dtype=np.int64)
        self._maps: dict[int, np.ndarray] = {}

    def part(self, p: int) -> np.ndarray:
        """Part ``p``'s signatures, slot-major: uint32 [num_perm, n_p]."""
        if p not in self._maps:
            if len(self._maps) >= self.MAX_OPEN:
                self._maps.clear()
            self._maps[p] = np.load(self.stems[p] + SIG_SUFFIX, mmap_mode="r")
        return self._maps[p]

    def rows(self, idx: np.ndarray) -> np.ndarray:
        """The signatures of the documents ``idx``: uint32 [len(idx), num_perm]."""
        idx = np.asarray(idx, dtype=np.int64)
        part = np.searchsorted(self.offsets, idx, side="right") - 1
        order = np.argsort(part, kind="stable")
        cuts = np.searchsorted(part[order], np.arange(len(self.stems) + 1))
        out = None
        for p in np.flatnonzero(np.diff(cuts)):
            sel = order[cuts[p] : cuts[p + 1]]
            m = self.part(int(p))
            block = m[:, idx[sel] - self.offsets[p]].T
            if out is None:
                out = np.empty((len(idx), block.shape[1]), dtype=np.uint32)
            out[sel] = block
        return out if out is not None else np.empty((len(idx), 0), dtype=np.uint32)


# --- 2. exact groups (task per run of slots) ----------------------------------------


def exact_groups(keys: np.ndarray) -> np.ndarray:
    """For each document, the index of the first document with its key (uint64 [n, 2])."""
    n = len(keys)
    # Sorting by the first half is enough unless two different keys share it (about never):
    # then by both. Stable either way, so a run lists its documents in order.
    order = np.argsort(keys[:, 0], kind="stable")
    col = keys[order, 0]
    same = col[1:] == col[:-1]
    col = keys[order, 1]
    split = col[1:] != col[:-1]
    del col
    if (same & split).any():
        order = np.lexsort((keys[:, 1], keys[:, 0]))
        same = (keys[order[1:]] == keys[order[:-1]]).all(axis=1)
    else:
        same &= ~split
    del split
    new = np.r_[True, ~same] if n else np.zeros(0, dtype=bool)
    del same
    heads = order[new]  # the first document of each run
    run = np.cumsum(new, dtype=np.int64)
    del new
    run -= 1
    np.take(heads, run, out=run)  # in place: the head of each sorted position's run
    del heads
    first = np.empty(n, dtype=np.int64)
    first[order] = run
    return first


@dataclass(frozen=True)
class ExactTask:
    stems: tuple[str, ...]  # the parts' sketch files
    offsets: tuple[int, ...]  # each part's first global index, then the total
    slots: tuple[int, int]  # [first, last) slot of the exact keys grouped here
    out: str  # .npy of int64 [k, 2]: (document, its group's first) where they differ


def exact_pairs(task: ExactTask) -> int:
    """Exact groups among the documents whose keys fall in the task's slots: every
    document that is not the first of its group, with that first (worker). Equal keys
    share a slot, so each group is whole in one task."""
    lo, hi = task.slots
    docs, keys = [], []
    for stem, offset in zip(task.stems, task.offsets, strict=True):
        cut = np.load(stem + XOFF_SUFFIX)
        a, b = int(cut[lo]), int(cut[hi])
        if a == b:
            continue
        keys.append(np.load(stem + XKEYS_SUFFIX, mmap_mode="r")[a:b])
        docs.append(np.load(stem + XROWS_SUFFIX, mmap_mode="r")[a:b] + offset)
    pairs = np.zeros((0, 2), dtype=np.int64)
    if docs:
        doc = np.concatenate(docs)
        order = np.argsort(doc)  # document order, as exact_groups' ties need
        doc = doc[order]
        first = doc[exact_groups(np.concatenate(keys)[order])]
        dup = first != doc
        pairs = np.stack([doc[dup], first[dup]], axis=1)
    _save(task.out, np.save, pairs)
    return len(pairs)


def _exact_tasks(stems: list[str], offsets: np.ndarray, work: Path,
                 workers: int) -> list[ExactTask]:
    """Runs of slots: two tasks a worker, each within ``EXACT_ROWS_PER_TASK`` documents
    on average, at most one a slot."""
    n = int(offsets[-1])
    count = min(SLOTS, max(1, 2 * workers, math.ceil(n / EXACT_ROWS_PER_TASK)))
    bounds = np.linspace(0, SLOTS, count + 1).round().astype(int)
    return [ExactTask(tuple(stems), tuple(int(o) for o in offsets[:-1]), (int(a), int(b)),
                      str(work / f"s{a:03d}-{b:03d}.npy"))
            for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def exact_parents(stems: list[str], offsets: np.ndarray, work: Path, executor: Executor,
                  log: PartLog) -> tuple[np.ndarray, np.ndarray]:
    """Step 2: the forest of exact groups (each document pointing at its group's first,
    as :func:`exact_groups` of all the keys would) and the exact pairs, ``(document,
    first)`` for every document that is not its group's first, sorted by document."""
    parent = np.arange(int(offsets[-1]), dtype=np.int64)
    work.mkdir(exist_ok=True)
    tasks = _exact_tasks(stems, offsets, work, executor.workers)
    for _ in executor.map(exact_pairs, tasks, "dedup: exact", log):
        pass
    pairs = [np.load(t.out) for t in tasks]
    pairs = np.concatenate(pairs) if pairs else np.zeros((0, 2), dtype=np.int64)
    pairs = pairs[np.argsort(pairs[:, 0])]
    parent[pairs[:, 0]] = pairs[:, 1]
    return parent, pairs


# --- 4. components (driver) -----------------------------------------------------------


def compress(parent: np.ndarray) -> np.ndarray:
    """Point every node of the forest ``parent`` at its root, in place."""
    while True:
        grand = parent[parent]
        if np.array_equal(grand, parent):
            return parent
        parent[:] = grand


def _find(parent: np.ndarray, x: np.ndarray) -> np.ndarray:
    r = parent[x]
    while True:
        up = parent[r]
        if np.array_equal(up, r):
            return r
        r = up


def union(parent: np.ndarray, u: np.ndarray, v: np.ndarray) -> None:
    """Join ``u[k]`` and ``v[k]`` for every k in the forest ``parent``, in place.

    The forest keeps ``parent[x] <= x``, so every root is its tree's smallest node: a
    round hooks the larger root of each still-split pair under the smaller one.
    """
    u, v = np.asarray(u, dtype=np.int64), np.asarray(v, dtype=np.int64)
    while len(u):
        ru, rv = _find(parent, u), _find(parent, v)
        parent[u], parent[v] = ru, rv  # shortcut the endpoints: later finds are short
        split = ru != rv
        u, v, ru, rv = u[split], v[split], ru[split], rv[split]
        np.minimum.at(parent, np.maximum(ru, rv), np.minimum(ru, rv))


def forest(u: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Edges with the same connected components as ``(u, v)``, at most one per node."""
    nodes, inv = np.unique(np.concatenate([u, v]), return_inverse=True)
    parent = np.arange(len(nodes), dtype=np.int64)
    union(parent, inv[: len(u)], inv[len(u) :])
    compress(parent)
    child = np.flatnonzero(parent != np.arange(len(nodes)))
    return nodes[parent[child]], nodes[child]


# --- 3. bands (task per band and shard) ----------------------------------------------


@dataclass(frozen=True)
class BandTask:
    stems: tuple[str, ...]  # the parts' sketch files
    offsets: tuple[int, ...]  # each part's first global index, then the total
    reps: str  # .npy of the representatives' global indices, ascending
    band: int
    rows: int
    shard: int
    shards: int
    threshold: float
    out: str  # .npy of int64 [k, 2] edges


def _pack(block: np.ndarray) -> list[np.ndarray]:
    """The rows of uint32 [r, m] as ceil(r/2) uint64 keys: equal columns, equal keys."""
    wide = block.astype(np.uint64)
    keys = [(wide[i] << np.uint64(32)) | wide[i + 1] for i in range(0, len(wide) - 1, 2)]
    if len(wide) % 2:
        keys.append(wide[-1])
    return keys


def _shard_of(keys: list[np.ndarray], shards: int) -> np.ndarray:
    """A shard per column, the same for equal columns (a partition, never a bucket)."""
    h = np.zeros(len(keys[0]), dtype=np.uint64)
    with np.errstate(over="ignore"):
        for k in keys:
            h = (h ^ k) * np.uint64(0x9E3779B97F4A7C15)
            h ^= h >> np.uint64(29)
    return (h % np.uint64(shards)).astype(np.int64)


def _ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """``concatenate([arange(s, s + c) for s, c in zip(starts, counts)])``."""
    offsets = np.cumsum(counts) - counts
    return np.repeat(starts - offsets, counts) + np.arange(int(counts.sum()), dtype=np.int64)


def _band_column(task: BandTask, sigs: Signatures) -> tuple[np.ndarray, list[np.ndarray]]:
    """The shard's representatives (ascending) and their band values, as uint64 keys."""
    reps = np.load(task.reps, mmap_mode="r")
    offsets = np.asarray(task.offsets, dtype=np.int64)
    cut = np.searchsorted(reps, offsets)
    lo, hi = task.band * task.rows, (task.band + 1) * task.rows
    docs, keys = [], []
    for p in range(len(task.stems)):
        if cut[p] == cut[p + 1]:
            continue
        local = np.asarray(reps[cut[p] : cut[p + 1]]) - offsets[p]
        block = sigs.part(p)[lo:hi]
        block = np.asarray(block if len(local) == block.shape[1] else block[:, local])
        k = _pack(block)
        if task.shards > 1:
            mine = _shard_of(k, task.shards) == task.shard
            local, k = local[mine], [c[mine] for c in k]
        docs.append(local + offsets[p])
        keys.append(k)
    if not docs:
        return np.zeros(0, np.int64), []
    return np.concatenate(docs), [np.concatenate(c) for c in zip(*keys, strict=True)]


def band_edges(task: BandTask) -> int:
    """Confirmed near-duplicate pairs among the representatives sharing a bucket of one
    band (and shard), written as a spanning forest (worker)."""
    sigs = Signatures(list(task.stems), np.asarray(task.offsets))
    docs, keys = _band_column(task, sigs)
    us, vs = [], []
    held = buckets = 0
    cap = EDGE_CAP
    if len(docs) > 1:
        order = np.lexsort(keys[::-1])  # stable: a bucket lists its docs in order
        same = np.ones(len(docs) - 1, dtype=bool)  # as the previous one, in every slot
        for k in keys:
            s = k[order]
            same &= s[1:] == s[:-1]
        del keys, s
        new = np.r_[True, ~same]
        starts = np.flatnonzero(new)
        sizes = np.diff(np.append(starts, len(docs)))
        multi = sizes > 1
        # The buckets of two or more, one after another, each in document order.
        members = docs[order[_ranges(starts[multi], sizes[multi])]]
        sizes = sizes[multi]
        starts = np.cumsum(sizes) - sizes
        buckets = len(starts)
        cum_pairs = np.cumsum(sizes * (sizes - 1) // 2)
        cum_rows = np.cumsum(sizes)
        b0 = 0
        while b0 < buckets:  # a run of buckets at a time: bounded pairs and signatures
            done_pairs = cum_pairs[b0 - 1] if b0 else 0
            done_rows = cum_rows[b0 - 1] if b0 else 0
            b1 = min(np.searchsorted(cum_pairs, done_pairs + PAIR_CHUNK, side="right"),
                     np.searchsorted(cum_rows, done_rows + GATHER_ROWS, side="right"))
            b1 = max(int(b1), b0 + 1)
            lo, hi = int(starts[b0]), int(starts[b1 - 1] + sizes[b1 - 1])
            run = members[lo:hi]
            full = sigs.rows(run)
            # Member k of a bucket is paired with every later member of it.
            ends = np.repeat(starts[b0:b1] + sizes[b0:b1] - lo, sizes[b0:b1])
            pos = np.arange(hi - lo, dtype=np.int64)
            later = ends - pos - 1
            cum_later = np.cumsum(later)
            m0 = 0
            while m0 < len(pos):
                before = cum_later[m0 - 1] if m0 else 0
                m1 = max(int(np.searchsorted(cum_later, before + PAIR_CHUNK, side="right")),
                         m0 + 1)
                first = np.repeat(pos[m0:m1], later[m0:m1])
                second = _ranges(pos[m0:m1] + 1, later[m0:m1])
                ok = minhash.jaccard(full[first], full[second]) >= task.threshold
                us.append(run[first[ok]])
                vs.append(run[second[ok]])
                held += int(ok.sum())
                if held > cap:
                    u, v = forest(np.concatenate(us), np.concatenate(vs))
                    us, vs, held = [u], [v], len(u)
                    cap = max(EDGE_CAP, 2 * held)  # a forest already at the cap: grow it
                m0 = m1
            b0 = b1
    u, v = (forest(np.concatenate(us), np.concatenate(vs)) if held
            else (np.zeros(0, np.int64), np.zeros(0, np.int64)))
    _save(task.out, np.save, np.stack([u, v], axis=1))
    return len(u)  # edges written: a spanning forest of the confirmed pairs


# --- 5. clusters (driver, members only) ------------------------------------------------


def choose_kept(roots: np.ndarray, chars: np.ndarray | None, keep: str,
                quality: np.ndarray | None = None) -> np.ndarray:
    """For every document, the index of the document its cluster keeps.

    ``first``: the earliest; ``longest``: most characters; ``quality``: best quality
    score, then most characters. Ties go to the earliest, so the choice is stable.
    """
    n = len(roots)
    if keep == "first" or not n:
        return roots.copy()  # the union-find root is the cluster's first member
    assert chars is not None
    keys = [np.arange(n), -chars]  # lexsort: the last key is the primary one
    if keep == "quality":
        assert quality is not None
        keys.append(-quality)
    order = np.lexsort((*keys, roots))
    best = np.empty(n, dtype=np.int64)
    first_of_root = order[np.r_[True, roots[order][1:] != roots[order][:-1]]]
    best[roots[first_of_root]] = first_of_root
    return best[roots]


def _points(parent: np.ndarray, fixed: bool, chunk: int = 1 << 20) -> np.ndarray:
    """The documents ``x`` with ``parent[x] == x`` (``fixed``) or not, ascending, a chunk
    at a time (no index array of every document)."""
    out = [np.flatnonzero((parent[lo : lo + chunk] == np.arange(lo, min(lo + chunk,
                                                                         len(parent))))
                          == fixed) + lo for lo in range(0, len(parent), chunk)]
    return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)


def _first_of(docs: np.ndarray, pairs: np.ndarray) -> np.ndarray:
    """Each document's exact group's first (``pairs``: :func:`exact_parents`'s)."""
    at = np.searchsorted(pairs[:, 0], docs)
    hit = at < len(pairs)
    hit[hit] = pairs[at[hit], 0] == docs[hit]
    out = docs.copy()
    out[hit] = pairs[at[hit], 1]
    return out


def _member_meta(stems: list[str], offsets: np.ndarray, docs: np.ndarray,
                 ) -> tuple[np.ndarray, np.ndarray]:
    """The lengths and quality scores of ``docs`` (ascending), one part's file at a time."""
    chars = np.empty(len(docs), dtype=np.int64)
    quality = np.empty(len(docs), dtype=np.float64)
    cut = np.searchsorted(docs, offsets)
    for p in np.flatnonzero(np.diff(cut)):
        lo, hi = cut[p], cut[p + 1]
        with np.load(stems[p] + META_SUFFIX) as f:
            local = docs[lo:hi] - offsets[p]
            chars[lo:hi], quality[lo:hi] = f["chars"][local], f["quality"][local]
    return chars, quality


def _exact(docs: np.ndarray, kept: np.ndarray, pairs: np.ndarray) -> np.ndarray:
    """Whether each member is in its kept document's exact group, ``MEMBER_CHUNK``
    members at a time (the lookups' index arrays stay that small)."""
    out = np.empty(len(docs), dtype=bool)
    for lo in range(0, len(docs), MEMBER_CHUNK):
        hi = lo + MEMBER_CHUNK
        out[lo:hi] = _first_of(docs[lo:hi], pairs) == _first_of(kept[lo:hi], pairs)
    return out


def _similarity(sigs: Signatures, docs: np.ndarray, kept: np.ndarray,
                exact: np.ndarray) -> np.ndarray:
    """Each member's estimated Jaccard to its kept document (1 in its exact group),
    the near ones of ``SIMILARITY_ROWS`` members at a time."""
    out = np.ones(len(docs))
    for lo in range(0, len(docs), SIMILARITY_ROWS):
        near = np.flatnonzero(~exact[lo : lo + SIMILARITY_ROWS]) + lo
        if len(near):
            out[near] = minhash.jaccard(sigs.rows(docs[near]), sigs.rows(kept[near]))
    return out


@dataclass
class Members:
    """The documents in clusters of two or more, ascending, and what clusters.parquet
    says of each; every other document is its own cluster, kept, similarity 1."""

    docs: np.ndarray  # int64
    kept: np.ndarray  # int64: the document its cluster keeps
    exact: np.ndarray  # bool: in the kept document's exact group
    similarity: np.ndarray  # float64: estimated Jaccard to the kept document
    clusters: int


def cluster_members(cfg: DedupConfig, roots: np.ndarray, pairs: np.ndarray,
                    stems: list[str], offsets: np.ndarray) -> Members:
    """The clusters' members, the documents they keep (lengths and quality read for
    the members alone), exact or near, and their similarity."""
    # What it holds a member is the point: each array is let go as soon as it is used.
    moved = _points(roots, fixed=False)
    heads = np.unique(roots[moved])
    docs, clusters = np.union1d(moved, heads), len(heads)
    del moved, heads
    root_at = np.searchsorted(docs, roots[docs])  # each member's root, as a member index
    chars, quality = (_member_meta(stems, offsets, docs) if cfg.keep != "first"
                      else (None, None))
    kept = docs[choose_kept(root_at, chars, cfg.keep, quality)]
    del root_at, chars, quality
    exact = _exact(docs, kept, pairs)
    similarity = _similarity(Signatures(stems, offsets), docs, kept, exact)
    return Members(docs, kept, exact, similarity, clusters)


# --- 6. names and write (tasks per part) ------------------------------------------------


@dataclass(frozen=True)
class NameTask:
    srcs: tuple[str, ...]  # a run of parts
    rows: tuple[np.ndarray, ...]  # int64: each part's rows whose ids are asked for


def read_names(task: NameTask) -> pa.Array:
    """The ids of some rows of a run of parts (worker): the documents clusters keep."""
    return pa.concat_arrays([read_table(src, columns=["id"]).column("id").take(
        pa.array(rows)).combine_chunks() for src, rows in zip(task.srcs, task.rows,
                                                               strict=True)])


@dataclass(frozen=True)
class WriteTask:
    src: str
    out: str
    rows: np.ndarray  # int64: the part's rows in clusters of two or more
    kept: np.ndarray  # bool per member row
    exact: np.ndarray  # bool per member row
    similarity: np.ndarray  # float64 per member row
    names: str  # the Arrow file of the kept documents' ids (kept_names)
    name_at: np.ndarray  # int64 per member row: its kept document's id's row there (-1: itself)


def _names_of(task: WriteTask) -> tuple[np.ndarray, pa.Array]:
    """Which member rows name another document as kept, and those ids in row order,
    taken from the memory-mapped names file (no copy of the rest)."""
    other = task.name_at >= 0
    if not other.any():
        return other, pa.array([], pa.string())
    with pa.memory_map(task.names) as source:
        column = pa.ipc.open_file(source).read_all().column("id")
        return other, column.take(pa.array(task.name_at[other])).combine_chunks()


def write_part(task: WriteTask) -> tuple[int, Counts, pa.Table]:
    """Rewrite one part with only its kept rows (worker) -> (rows kept, the part's
    counts, its rows of clusters.parquet)."""
    table = read_table(task.src)
    n = table.num_rows
    is_kept = np.ones(n, dtype=bool)
    is_kept[task.rows] = task.kept
    exact = np.ones(n, dtype=bool)
    exact[task.rows] = task.exact
    similarity = np.ones(n)
    similarity[task.rows] = task.similarity
    write_table(table.filter(pa.array(is_kept)), task.out)
    ids = table.column("id").combine_chunks()
    named = np.zeros(n, dtype=bool)
    named[task.rows], names = _names_of(task)
    cluster = pc.replace_with_mask(ids, pa.array(named), names)
    domains = table.column("domain").combine_chunks()
    rows = pa.table({"id": ids, "domain": domains, "cluster": cluster, "kept": is_kept,
                     "similarity": similarity}, schema=CLUSTERS_SCHEMA)
    return int(is_kept.sum()), _counts(domains, is_kept, exact), rows


def _counts(domains: pa.Array, is_kept: np.ndarray, exact: np.ndarray) -> Counts:
    encoded = domains.dictionary_encode()
    codes = encoded.indices.to_numpy(zero_copy_only=False).astype(np.int64)
    names = encoded.dictionary.to_pylist()
    per = {what: np.bincount(codes[mask], minlength=len(names)) for what, mask in
           (("in", slice(None)), ("kept", is_kept), (EXACT_DUP, ~is_kept & exact),
            (NEAR_DUP, ~is_kept & ~exact))}
    counts = Counts()
    for d, name in enumerate(names):
        c = counts[name]
        c.n_in, c.kept = int(per["in"][d]), int(per["kept"][d])
        for reason in (EXACT_DUP, NEAR_DUP):
            if per[reason][d]:
                c.rejected[reason] = int(per[reason][d])
    return counts


def kept_names(members: Members, parts: list[Path], offsets: np.ndarray,
               executor: Executor, log: PartLog, path: Path) -> np.ndarray:
    """The documents other members are kept for, ascending; their ids, in that order,
    go to the Arrow file ``path`` (read by two tasks a worker, each a run of the parts
    that hold some: a few rows a part). The driver holds one task's ids at a time, and
    each write task takes its few from the file."""
    wanted = np.unique(members.kept[members.kept != members.docs])
    cut = np.searchsorted(wanted, offsets)
    holders = np.flatnonzero(np.diff(cut))
    runs = np.array_split(holders, min(len(holders), max(1, 2 * executor.workers)))
    tasks = [NameTask(tuple(str(parts[p]) for p in run),
                      tuple(wanted[cut[p] : cut[p + 1]] - offsets[p] for p in run))
             for run in runs]
    schema = pa.schema([("id", pa.string())])
    with atomic_path(path) as tmp, pa.OSFile(str(tmp), "wb") as sink, \
            pa.ipc.new_file(sink, schema) as names:
        for ids in executor.map(read_names, tasks, "dedup: names", log):
            names.write_batch(pa.record_batch([ids], schema=schema))
    return wanted


def write_tasks(members: Members, parts: list[Path], offsets: np.ndarray, wanted: np.ndarray,
                names: Path, tmp: Path) -> list[WriteTask]:
    """A task per part, with its members' rows and where their kept documents' ids are
    in the names file (:func:`kept_names`)."""
    cut = np.searchsorted(members.docs, offsets)
    tasks = []
    for k, part in enumerate(parts):
        sel = slice(cut[k], cut[k + 1])
        docs, kept = members.docs[sel], members.kept[sel]
        other = kept != docs  # a kept document names itself: no id sent
        tasks.append(WriteTask(str(part), str(tmp / part.name), docs - offsets[k],
                               ~other, members.exact[sel], members.similarity[sel],
                               str(names), np.where(other, np.searchsorted(wanted, kept), -1)))
    return tasks


class ClustersWriter:
    """clusters.parquet from the parts' rows as they come, in row groups of ``rows``,
    each one chunk, as ``write_table`` of the whole table writes them (the same bytes: a
    row group of several chunks is written otherwise). It holds one row group's rows
    (1Mi rows, ~100 MB) and its one-chunk copy at most, however many documents."""

    def __init__(self, path: Path, rows: int = CLUSTER_ROW_GROUP) -> None:
        self.rows = rows
        self.held: list[pa.Table] = []
        self.count = self.written = 0
        self._atomic = atomic_path(path)
        self._writer = pq.ParquetWriter(self._atomic.__enter__(), CLUSTERS_SCHEMA,
                                        compression=COMPRESSION)

    def add(self, table: pa.Table) -> None:
        """Append a part's rows; write every row group they complete."""
        self.held.append(table)
        self.count += table.num_rows
        while self.count >= self.rows:
            whole = pa.concat_tables(self.held)
            self._writer.write_table(whole.slice(0, self.rows).combine_chunks())
            self.held, self.count = [whole.slice(self.rows)], self.count - self.rows
            self.written += self.rows

    def close(self) -> None:
        """Write the last rows (an empty table still writes its schema) and the file."""
        if self.count or not self.written:
            self._writer.write_table(pa.concat_tables(self.held).combine_chunks()
                                     if self.held else CLUSTERS_SCHEMA.empty_table())
        self._writer.close()
        self._atomic.__exit__(None, None, None)

    def __enter__(self) -> ClustersWriter:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: Any) -> None:
        if kind is None:
            self.close()
            return
        self._writer.close()  # a failed stage leaves no clusters.parquet, nor its temporary
        self._atomic.__exit__(kind, error, trace)


# --- the driver -----------------------------------------------------------------------


def _band_tasks(cfg: DedupConfig, stems: list[str], offsets: np.ndarray, reps: str,
                n_reps: int, edges: Path, workers: int) -> list[BandTask]:
    """One task per band, or per band and shard: shards give the workers two tasks each
    and keep one task's sort within ``BAND_ROWS_PER_TASK`` representatives."""
    shards = max(1, math.ceil(2 * workers / cfg.bands), math.ceil(n_reps / BAND_ROWS_PER_TASK))
    threshold = lsh_threshold(cfg.bands, cfg.rows)
    return [BandTask(tuple(stems), tuple(int(o) for o in offsets), reps, b, cfg.rows, s,
                     shards, threshold, str(edges / f"b{b:04d}-s{s:04d}-of{shards:04d}.npy"))
            for b in range(cfg.bands) for s in range(shards)]


def cluster_roots(cfg: DedupConfig, stems: list[str], offsets: np.ndarray, first: np.ndarray,
                  work: Path, executor: Executor) -> np.ndarray:
    """Steps 3 and 4: every document's cluster root, its smallest member.

    ``stems``: the parts' sketch files, ``offsets``: each part's first global index and
    the total, ``first``: each document's exact group (:func:`exact_parents`), joined in
    place with ``cfg.exact``; ``work``: where the band tasks leave their edges and
    ``.done`` markers."""
    n = int(offsets[-1])
    parent = first if cfg.exact else np.arange(n, dtype=np.int64)
    if cfg.near and n:
        reps_path = work / ".reps.npy"
        _save(reps_path, np.save, _points(parent, fixed=True))
        (work / ".edges").mkdir(exist_ok=True)
        n_reps = len(np.load(reps_path, mmap_mode="r"))
        tasks = _band_tasks(cfg, stems, offsets, str(reps_path), n_reps, work / ".edges",
                            executor.workers)
        for _ in executor.map(band_edges, tasks, "dedup: bands",
                              PartLog(work / ".done" / "bands")):
            pass
        for t in tasks:  # one band file at a time: the driver holds one file's edges
            e = np.load(t.out)
            union(parent, e[:, 0], e[:, 1])
    return compress(parent)


def run_dedup(cfg: DedupConfig, in_dir: str | Path, out_dir: str | Path,
              executor: Executor | None = None) -> dict[str, Any]:
    """Deduplicate ``in_dir`` into ``out_dir`` (+ clusters.parquet); return metrics.

    Tasks run on ``executor`` (default: the local pool); a rerun after a kill skips
    the tasks already done. The driver holds a few arrays of one entry a document (the
    union-find's forest) and what it keeps of the clusters' members, never the ids."""
    executor = executor or LocalExecutor(cfg.num_workers)
    cfg = output_settings(cfg)
    parts = list_parts(in_dir)
    with resumable_dir(out_dir, files_fingerprint(parts, "dedup", cfg)) as tmp:
        done = tmp / ".done"
        stems = [str(tmp / ".sketch" / p.stem) for p in parts]
        sizes = list(executor.map(sketch_part, [SketchTask(str(p), cfg, s)
                                                for p, s in zip(parts, stems, strict=True)],
                                  "dedup: sketch", PartLog(done / "sketch")))
        offsets = np.cumsum([0] + sizes)
        first, pairs = exact_parents(stems, offsets, tmp / ".exact", executor,
                                     PartLog(done / "exact"))
        roots = cluster_roots(cfg, stems, offsets, first, tmp, executor)
        members = cluster_members(cfg, roots, pairs, stems, offsets)
        del roots, first, pairs
        names = tmp / NAMES_FILE
        wanted = kept_names(members, parts, offsets, executor, PartLog(done / "names"), names)
        tasks = write_tasks(members, parts, offsets, wanted, names, tmp)
        counts, written = Counts(), 0
        # In task order, as they finish: the rows go straight into clusters.parquet.
        with ClustersWriter(tmp / "clusters.parquet", CLUSTER_ROW_GROUP) as clusters:
            for kept, part_counts, rows in executor.map(write_part, tasks, "dedup: write",
                                                        PartLog(done / "write")):
                written += kept
                counts.merge(part_counts)
                clusters.add(rows)
        dropped = members.kept != members.docs
        assert written == int(offsets[-1]) - int(dropped.sum())

    metrics = counts.as_dict()
    metrics.update(
        parts=len(parts),
        exact_dups=int((dropped & members.exact).sum()),
        near_dups=int((dropped & ~members.exact).sum()),
        clusters=members.clusters,
        docs_in_clusters=len(members.docs),
        lsh_threshold=round(lsh_threshold(cfg.bands, cfg.rows), 4),
    )
    return metrics
