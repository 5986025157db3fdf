"""Mix's cluster ranks, computed by tasks: where each document's near-duplicate cluster
falls in its domain's sorted list of cluster names.

The val split (``mix.split_val``) takes whole clusters of a domain in a seeded shuffle of
the domain's cluster names, sorted. Holding every id and cluster name in the driver cost
~500 bytes a document (63 GB at a terabyte); here tasks join the documents with dedup's
``clusters.parquet`` and sort the names, and the driver gets one integer per document:
the dense rank of its cluster's name within its domain (one rank, one cluster), which
orders and groups the clusters exactly as the names did.

1. Key files (written by mix's measuring tasks, ``write_keys``): each document's id,
   domain and index, ordered by a hash bucket of the id, a Parquet row group a bucket.
2. Cluster tasks (row groups of clusters.parquet): id and cluster name, bucketed alike.
3. Join tasks (a bucket each): every document's cluster name (its own id when it is in
   no cluster), ordered by the range its (domain, name) key falls in among splitters
   sampled from the ids, a row group a range.
4. Rank tasks (a range each): the range's dense ranks within each domain, from 0, and
   each domain's count of distinct names there. Ranges are in key order, so the driver
   adds to each range's ranks the counts of the ranges before it (``cluster_ranks``).

Intermediate files: one per key run, cluster run and bucket: O(parts).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from lmforge.data.records import COMPRESSION
from lmforge.errors import InputError
from lmforge.executor import Executor, PartLog
from lmforge.io import atomic_path

# Joins and ranges at most: each task then reads one row group of every key file.
MAX_BUCKETS = 256
# Sampled keys per range, for splitters that cut the keys into ranges of similar size.
SAMPLES_PER_RANGE = 64
SEP = "\x00"  # below every character: "domain SEP name" sorts as the pair (domain, name)
# A document's key in the key files: its measuring run in the high bits, its row there below.
ROW_BITS = 40


def bucket_of(ids: Iterable[str], buckets: int) -> np.ndarray:
    """A stable hash bucket per id (CRC-32: the same in every process and run)."""
    return np.array([zlib.crc32(i.encode()) % buckets for i in ids], dtype=np.int64)


def write_bucketed(table: pa.Table, bucket: np.ndarray, path: str) -> list[int]:
    """Write ``table`` ordered by ``bucket``, a row group per bucket; return the buckets
    it holds, in file order (row group ``k`` holds the ``k``-th)."""
    order = np.argsort(bucket, kind="stable")
    table = table.take(pa.array(order))
    held, starts = np.unique(bucket[order], return_index=True)
    bounds = [*starts.tolist(), len(order)]
    with atomic_path(path) as tmp, \
            pq.ParquetWriter(tmp, table.schema, compression=COMPRESSION) as writer:
        for lo, hi in zip(bounds, bounds[1:], strict=False):
            writer.write_table(table.slice(lo, hi - lo), row_group_size=max(1, hi - lo))
    return held.tolist()


def read_pieces(pieces: list[tuple[str, int]], schema: pa.Schema) -> pa.Table:
    """The rows of the row groups ``(path, row group)``, one after another."""
    tables = [pq.ParquetFile(path).read_row_group(rg) for path, rg in pieces]
    return pa.concat_tables(tables) if tables else schema.empty_table()


def pieces_of(files: list[tuple[str, list[int]]], count: int) -> list[list[tuple[str, int]]]:
    """Per bucket (or range) of ``count``, the (path, row group) pairs that hold it, from
    each file's list of the buckets it holds: a task is given its own pieces only, so
    what goes with every task does not grow with the files times the buckets."""
    out: list[list[tuple[str, int]]] = [[] for _ in range(count)]
    for path, held in files:
        for rg, b in enumerate(held):
            out[b].append((path, rg))
    return out


KEYS = pa.schema([("id", pa.string()), ("domain", pa.string()), ("idx", pa.int64())])
NAMES = pa.schema([("id", pa.string()), ("cluster", pa.string())])


def write_keys(ids: pa.Array, domains: pa.Array, first_idx: int, buckets: int,
               path: str, samples: int) -> tuple[list[int], list[str]]:
    """Key file of a run of documents (step 1): the buckets it holds, and ``samples``
    keys spread over the run for the splitters."""
    table = pa.table([ids, domains, pa.array(np.arange(first_idx, first_idx + len(ids)))],
                     schema=KEYS)
    held = write_bucketed(table, bucket_of(ids.to_pylist(), buckets), path)
    step = max(1, len(ids) // max(1, samples))
    keys = [f"{d}{SEP}{i}" for d, i in zip(domains[::step].to_pylist(),
                                           ids[::step].to_pylist(), strict=True)]
    return held, keys


@dataclass(frozen=True)
class NameTask:
    src: str
    row_groups: list[int]
    buckets: int
    path: str


def bucket_names(task: NameTask) -> list[int]:
    """Step 2: a run of clusters.parquet's row groups, bucketed by id."""
    table = pq.ParquetFile(task.src).read_row_groups(task.row_groups, columns=["id", "cluster"])
    table = table.cast(NAMES)
    return write_bucketed(table, bucket_of(table.column("id").to_pylist(), task.buckets),
                          task.path)


@dataclass(frozen=True)
class JoinTask:
    keys: list[tuple[str, int]]  # the bucket's row group in each key file
    names: list[tuple[str, int]]  # ... in each cluster file
    splitters: list[str]
    path: str


def join_names(task: JoinTask) -> list[int]:
    """Step 3: every document of the bucket with its cluster name, by key range."""
    keys = read_pieces(task.keys, KEYS)
    names = read_pieces(task.names, NAMES)
    if names.num_rows and len(pc.unique(names.column("id"))) != names.num_rows:
        raise InputError("clusters.parquet: an id is listed in more than one row")
    joined = keys.join(names, "id", join_type="left outer")
    cluster = pc.coalesce(joined.column("cluster"), joined.column("id"))
    key = pc.binary_join_element_wise(joined.column("domain"), cluster, SEP)
    where = np.searchsorted(np.array(task.splitters, dtype=object),
                            np.array(key.to_pylist(), dtype=object), side="right")
    table = pa.table({"key": key, "domain": joined.column("domain"),
                      "idx": joined.column("idx")})
    return write_bucketed(table, where.astype(np.int64), task.path)


@dataclass(frozen=True)
class RankTask:
    pieces: list[tuple[str, int]]  # the range's row group in each join file
    run_first_doc: np.ndarray  # each measuring run's first document, and then the count
    path: str  # where the range's ranks go (``.npz``)


RANKED = pa.schema([("key", pa.string()), ("domain", pa.string()), ("idx", pa.int64())])


def rank_range(task: RankTask) -> dict[str, int]:
    """Step 4: write, per domain in the range, its documents (input order) and their
    names' dense ranks within the domain and the range (from 0); return how many
    distinct names each domain has there."""
    table = read_pieces(task.pieces, RANKED)
    dense = pc.rank(table.column("key"), tiebreaker="dense").to_numpy().astype(np.int64)
    key = table.column("idx").to_numpy()
    doc = task.run_first_doc[key >> ROW_BITS] + (key & ((1 << ROW_BITS) - 1))
    counts, arrays = {}, {}
    for k, domain in enumerate(sorted(pc.unique(table.column("domain")).to_pylist())):
        mask = pc.equal(table.column("domain"), domain).to_numpy(zero_copy_only=False)
        ranks = dense[mask]
        lo = int(ranks.min())  # the domain's names are one run of the range's sorted keys
        counts[domain] = int(ranks.max()) - lo + 1
        arrays[f"doc{k}"], arrays[f"rank{k}"] = doc[mask], ranks - lo
    with atomic_path(task.path) as tmp, open(tmp, "wb") as f:
        np.savez(f, **arrays)
    return counts


def splitters_of(samples: list[str], ranges: int) -> list[str]:
    """``ranges - 1`` keys cutting the sorted samples into runs of equal size."""
    samples = sorted(set(samples))
    if ranges <= 1 or not samples:
        return []
    cut = [samples[len(samples) * k // ranges] for k in range(1, ranges)]
    return sorted(set(cut))


def cluster_ranks(executor: Executor, key_files: list[tuple[str, list[int]]], samples: list[str],
                  clusters: Path, buckets: int, run_first_doc: np.ndarray, work: Path,
                  done: Path | None = None) -> np.ndarray:
    """Every document's cluster rank within its domain (steps 2-4; the driver adds the
    ranges' offsets). ``key_files``: step 1's files with the buckets each holds;
    ``run_first_doc``: the index of each run's first document, and then the count."""
    names: list[tuple[str, list[int]]] = []
    if clusters.is_file():
        groups = pq.ParquetFile(clusters).num_row_groups
        tasks = [NameTask(str(clusters), [g], buckets, str(work / f"names-{g:05d}.parquet"))
                 for g in range(groups)]
        log = PartLog(done / "names") if done else None
        names = list(zip([t.path for t in tasks],
                         executor.map(bucket_names, tasks, "mix: clusters", log), strict=True))
    splitters = splitters_of(samples, buckets)
    joins = [JoinTask(keys, named, splitters, str(work / f"join-{b:05d}.parquet"))
             for b, (keys, named) in enumerate(zip(pieces_of(key_files, buckets),
                                                   pieces_of(names, buckets), strict=True))]
    log = PartLog(done / "join") if done else None
    joined = list(zip([t.path for t in joins],
                      executor.map(join_names, joins, "mix: join", log), strict=True))
    n_docs = int(run_first_doc[-1])
    rank = np.full(n_docs, -1, dtype=np.int32 if n_docs < 2**31 else np.int64)
    offset: dict[str, int] = {}
    ranges = len(splitters) + 1
    tasks = [RankTask(pieces, run_first_doc, str(work / f"rank-{r:05d}.npz"))
             for r, pieces in enumerate(pieces_of(joined, ranges))]
    log = PartLog(done / "rank") if done else None
    for task, counts in zip(tasks, executor.map(rank_range, tasks, "mix: rank", log), strict=True):
        with np.load(task.path) as found:  # one range at a time in the driver's memory
            for k, domain in enumerate(sorted(counts)):
                rank[found[f"doc{k}"]] = offset.get(domain, 0) + found[f"rank{k}"]
                offset[domain] = offset.get(domain, 0) + counts[domain]
    assert (rank >= 0).all(), "mix: a document got no cluster rank"
    return rank
