"""The dedup stage: exact duplicates by normalised-text hash, near duplicates by MinHash-LSH.

A driver and per-item tasks, run on an :class:`~lmforge.executor.Executor` (the local
pool or a Ray cluster; the bytes written are the same either way):

1. **sketch** (a task per part): each document's exact key, length, quality and MinHash
   signature, written to ``.sketch/`` in the work directory; only ids, domains and the
   row count come back, so signatures never pass through the driver.
2. **exact** (driver): documents with equal keys form an exact group, represented by
   its first document (one sort of the 128-bit keys).
3. **bands** (a task per LSH band, or per band and bucket shard when there are few bands
   for the workers or too many documents for one task): the band's values of every
   representative, read from the memory-mapped signature files; buckets of *exactly*
   equal band values (a sort, no lossy hash); every pair in a bucket confirmed by its
   estimated Jaccard on the full signatures against :func:`lsh_threshold`. The confirmed
   pairs, reduced to a spanning forest, go to ``.edges/``.
4. **components** (driver): the exact groups and the confirmed pairs joined by a
   vectorised union-find; a cluster's root is its smallest document index.
5. **write** (a task per part): the part without its dropped documents.

Two representatives are joined iff they share a bucket in at least one band and their
estimated Jaccard reaches the threshold: the pairs ``datasketch.MinHashLSH`` returns and
the old driver confirmed, so the clusters are the same. A bucket of k documents costs
k(k-1)/2 Jaccard checks (as querying an LSH index does), done in bounded chunks.

The work directory survives a kill: a rerun skips the tasks already done (their markers
in ``.done/``) and writes the same bytes.

Driver memory for steps 2 and 4, measured on 4 M documents (20% exact duplicates,
0.1 edges per document) with the command below: the exact grouping peaks at 31 bytes
per document over the 16 of the keys, 47 in all; the joining peaks at 32 (the groups,
the forest, a compression temporary, a round's temporaries) plus the band file being
joined, 16 bytes per edge (one file at a time). So ~48 bytes per document: one driver
handles ~20 million documents per GB. The driver also holds the lengths and quality scores (16 bytes per
document) and the ids and domains for clusters.parquet (their characters + 8)::

    python -c "import numpy as np, tracemalloc as t; from lmforge.data import dedup as d;
    n=4_000_000; r=np.random.default_rng(0); k=r.integers(0,2**63,(n,2),dtype=np.uint64);
    k[1::5]=k[::5][:len(k[1::5])]; t.start(); f=d.exact_groups(k); _,a=t.get_traced_memory();
    del k; e=r.integers(0,n,(n//10,2)); t.reset_peak(); b0,_=t.get_traced_memory();
    p=f.copy(); d.union(p,e[:,0],e[:,1]); d.compress(p); _,b=t.get_traced_memory();
    print((a+16*n)/n, (b-b0+f.nbytes)/n)"
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from lmforge.config import DedupConfig
from lmforge.data import minhash
from lmforge.data.counts import Counts
from lmforge.data.quality import quality_score
from lmforge.data.records import list_parts, read_table, write_table
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
BAND_ROWS_PER_TASK = 1 << 23  # representatives one band task sorts (~0.5 GB at 8 rows)
PAIR_CHUNK = 1 << 16  # bucket pairs checked at once (two signatures each)
GATHER_ROWS = 1 << 16  # signatures read at once for a run of buckets
EDGE_CAP = 1 << 22  # confirmed pairs a band task holds before reducing them to a forest


def lsh_threshold(bands: int, rows: int) -> float:
    """The similarity where the LSH S-curve ``1 - (1 - s^rows)^bands`` turns: (1/b)^(1/r)."""
    return (1.0 / bands) ** (1.0 / rows)


# --- 1. sketch (task per part) -------------------------------------------------------


@dataclass(frozen=True)
class SketchTask:
    path: str
    cfg: DedupConfig
    out: str  # file stem: <out>.sig.npy, <out>.meta.npz


@dataclass
class PartMeta:
    """What the driver keeps of one part: everything else is in the sketch files."""

    ids: pa.Array
    domains: pa.Array
    n: int


def _save(path: str | Path, save: Any, *args: Any, **kwargs: Any) -> None:
    """``np.save``/``np.savez`` to exactly ``path``, atomically."""
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        save(f, *args, **kwargs)


def sketch_part(task: SketchTask) -> PartMeta:
    """Exact keys, lengths, quality and MinHash signatures of one part, to files (worker)."""
    cfg = task.cfg
    table = read_table(task.path, columns=["id", "text", "domain"])
    texts = table.column("text").to_pylist()
    norms = [minhash.normalize(t) for t in texts]
    keys = np.frombuffer(b"".join(minhash.exact_key(t) for t in norms), dtype=np.uint64)
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
    _save(task.out + META_SUFFIX, np.savez, keys=keys.reshape(-1, 2), chars=chars,
          quality=quality)
    return PartMeta(table.column("id").combine_chunks(),
                    table.column("domain").combine_chunks(), len(texts))


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


# --- 2 and 4. exact groups and components (driver) -----------------------------------


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


# --- 5. write (task per part) --------------------------------------------------------


def choose_kept(roots: np.ndarray, chars: np.ndarray, keep: str,
                quality: np.ndarray | None = None) -> np.ndarray:
    """For every document, the index of the document its cluster keeps.

    ``first``: the earliest; ``longest``: most characters; ``quality``: best quality
    score, then most characters. Ties go to the earliest, so the choice is stable.
    """
    n = len(roots)
    if keep == "first" or not n:
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
    the total, ``first``: each document's exact group (:func:`exact_groups`), ``work``:
    where the band tasks leave their edges and ``.done`` markers."""
    n = int(offsets[-1])
    parent = first.copy() if cfg.exact else np.arange(n, dtype=np.int64)
    if cfg.near and n:
        reps = np.flatnonzero(first == np.arange(n)) if cfg.exact else np.arange(n)
        reps_path = work / ".reps.npy"
        _save(reps_path, np.save, reps)
        (work / ".edges").mkdir(exist_ok=True)
        tasks = _band_tasks(cfg, stems, offsets, str(reps_path), len(reps), work / ".edges",
                            executor.workers)
        for _ in executor.map(band_edges, tasks, "dedup: bands",
                              PartLog(work / ".done" / "bands")):
            pass
        for t in tasks:  # one band file at a time: the driver holds one file's edges
            e = np.load(t.out)
            union(parent, e[:, 0], e[:, 1])
    return compress(parent)


def _load_meta(stems: list[str], offsets: np.ndarray) -> tuple[np.ndarray, ...]:
    """Every part's keys, lengths and quality scores, one file open at a time."""
    n = int(offsets[-1])
    keys = np.empty((n, 2), dtype=np.uint64)
    chars = np.empty(n, dtype=np.int64)
    quality = np.empty(n, dtype=np.float64)
    for p, stem in enumerate(stems):
        lo, hi = offsets[p], offsets[p + 1]
        with np.load(stem + META_SUFFIX) as f:
            keys[lo:hi], chars[lo:hi], quality[lo:hi] = f["keys"], f["chars"], f["quality"]
    return keys, chars, quality


def _similarity(sigs: Signatures, docs: np.ndarray, kept: np.ndarray) -> np.ndarray:
    out = np.empty(len(docs))
    for lo in range(0, len(docs), PAIR_CHUNK):
        hi = lo + PAIR_CHUNK
        out[lo:hi] = minhash.jaccard(sigs.rows(docs[lo:hi]), sigs.rows(kept[lo:hi]))
    return out


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


def run_dedup(cfg: DedupConfig, in_dir: str | Path, out_dir: str | Path,
              executor: Executor | None = None) -> dict[str, Any]:
    """Deduplicate ``in_dir`` into ``out_dir`` (+ clusters.parquet); return metrics.

    Tasks run on ``executor`` (default: the local pool); a rerun after a kill skips
    the tasks already done."""
    executor = executor or LocalExecutor(cfg.num_workers)
    cfg = output_settings(cfg)
    parts = list_parts(in_dir)
    with resumable_dir(out_dir, files_fingerprint(parts, "dedup", cfg)) as tmp:
        done = tmp / ".done"
        stems = [str(tmp / ".sketch" / p.stem) for p in parts]
        metas = list(executor.map(sketch_part, [SketchTask(str(p), cfg, s)
                                                for p, s in zip(parts, stems, strict=True)],
                                  "dedup: sketch", PartLog(done / "sketch")))
        offsets = np.cumsum([0] + [m.n for m in metas])
        n = int(offsets[-1])
        ids = pa.concat_arrays([m.ids for m in metas]) if metas else pa.array([], pa.string())
        domains = (pa.concat_arrays([m.domains for m in metas]) if metas
                   else pa.array([], pa.string()))
        del metas
        keys, chars, quality = _load_meta(stems, offsets)
        first = exact_groups(keys)
        del keys

        roots = cluster_roots(cfg, stems, offsets, first, tmp, executor)
        kept_of = choose_kept(roots, chars, cfg.keep, quality)
        sigs = Signatures(stems, offsets)

        exact = first == first[kept_of]
        similarity = exact.astype(np.float64)
        near = np.flatnonzero(~exact)
        if len(near):
            similarity[near] = _similarity(sigs, near, kept_of[near])
        is_kept = kept_of == np.arange(n)
        counts = _counts(domains, is_kept, exact)

        tasks = [WriteTask(str(p), str(tmp / p.name), is_kept[offsets[k] : offsets[k + 1]])
                 for k, p in enumerate(parts)]
        written = sum(executor.map(write_part, tasks, "dedup: write", PartLog(done / "write")))
        assert written == int(is_kept.sum())
        clusters = pa.table(
            {"id": ids, "domain": domains, "cluster": ids.take(pa.array(kept_of)),
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
        near_dups=int((~is_kept & ~exact).sum()),
        clusters=int((sizes > 1).sum()),
        docs_in_clusters=int(sizes[sizes > 1].sum()),
        lsh_threshold=round(lsh_threshold(cfg.bands, cfg.rows), 4),
    )
    return metrics
