"""Mix's shuffle: every row of a split to its place, in two levels of bounded tasks.

A scatter task reads a run of input parts (up to SHUFFLE_CHARS characters) and writes,
per split, ONE file of its rows ordered by output group (a Parquet row group per group);
a gather task reads its group's row group from every scatter file, orders the rows by
their shuffled rank and writes the group's output parts (up to SHUFFLE_CHARS characters).
Intermediate files: one per scatter task and split, O(input characters / SHUFFLE_CHARS),
where one file per (input part, output part) pair grew with the documents (~10^8 at 1 TB).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from lmforge.data.records import COMPRESSION, part_name, read_table, repeat_id, write_table
from lmforge.io import atomic_path

# Characters of text a scatter task reads or a gather task holds, at most (about 1 GB of
# ASCII text in memory): at 1 TB, ~1,000 scatter files and ~1,000 groups a split.
SHUFFLE_CHARS = 1 << 30
# Tasks a level at least, where there are parts enough: small inputs still use the cores.
MIN_SHUFFLE_TASKS = 16


def cut_runs(sizes: np.ndarray, budget: float, min_runs: int) -> list[tuple[int, int]]:
    """Consecutive runs ``[lo, hi)`` of items, each run's sizes summing to at most
    ``budget`` and to at most a ``min_runs``-th of the whole (one item alone may pass):
    so there are at least ``min(min_runs, len(sizes))`` runs when the items allow."""
    limit = min(budget, float(sizes.sum()) / max(1, min_runs))
    runs, lo, held = [], 0, 0.0
    for i, size in enumerate(sizes.tolist()):
        if i > lo and held + size > limit:
            runs.append((lo, i))
            lo, held = i, 0.0
        held += size
    if len(sizes):
        runs.append((lo, len(sizes)))
    return runs


# Rows a planning step expands at once (its temporaries stay a few MB whatever the size).
CHUNK_ROWS = 1 << 16


def doc_chunks(copies: np.ndarray, rows: int) -> list[tuple[int, int, int, int]]:
    """Runs of documents ``[d0, d1)`` and their rows ``[r0, r1)``, about ``rows`` rows
    a run (documents are whole), without a cumulative array over every document."""
    chunks, d0, r0 = [], 0, 0
    step = max(1, rows)
    while d0 < len(copies):
        d1 = min(len(copies), d0 + step)
        r1 = r0 + int(copies[d0:d1].sum())
        chunks.append((d0, d1, r0, r1))
        d0, r0 = d1, r1
    return chunks


@dataclass(frozen=True)
class Placement:
    """A split's rows: document ``d`` gives ``copies[d]`` rows (repeats 0, 1, ...), rows
    numbered in document order; ``rank[j]`` is row ``j``'s place in the shuffled split
    (output part ``rank // part_docs``, row ``rank % part_docs`` there)."""

    copies: np.ndarray  # per document
    rank: np.ndarray  # per row

    @property
    def rows(self) -> int:
        return len(self.rank)


def place(copies: np.ndarray, rng: np.random.Generator) -> Placement:
    """Shuffle a split's rows globally: row ``perm[k]`` of ``rng.permutation`` goes to
    rank ``k`` (shuffled in place in 32 bits where they suffice: the same permutation)."""
    n = int(copies.sum())
    dtype = np.int32 if n < 2**31 else np.int64
    perm = np.arange(n, dtype=dtype)
    rng.shuffle(perm)
    rank = np.empty(n, dtype=dtype)
    for lo in range(0, n, CHUNK_ROWS):  # in chunks: no third array of n rows at once
        rank[perm[lo:lo + CHUNK_ROWS]] = np.arange(lo, min(n, lo + CHUNK_ROWS), dtype=dtype)
    return Placement(copies, rank)


@dataclass(frozen=True)
class Groups:
    """One split's output parts cut into gather groups: group ``g`` holds parts
    ``[first_part[g], first_part[g + 1])``."""

    first_part: np.ndarray

    @classmethod
    def of(cls, pl: Placement, chars: np.ndarray, part_docs: int) -> Groups:
        """Groups of consecutive output parts by the characters their rows hold."""
        n_parts = -(-pl.rows // part_docs)
        part_chars = np.zeros(n_parts)
        for d0, d1, r0, r1 in doc_chunks(pl.copies, CHUNK_ROWS):  # memory: one chunk's rows
            row_chars = np.repeat(chars[d0:d1], pl.copies[d0:d1])
            part_chars += np.bincount(pl.rank[r0:r1] // part_docs, weights=row_chars,
                                      minlength=n_parts)
        runs = cut_runs(part_chars, SHUFFLE_CHARS, MIN_SHUFFLE_TASKS)
        return cls(np.array([lo for lo, _ in runs] + [n_parts], dtype=np.int64))


@dataclass(frozen=True)
class Rows:
    """The rows of a split one scatter task provides: ``copies`` of each of its
    documents in order (views of the plan's arrays), their ranks, and the first rank of
    each group (``group_ranks``, from which the task finds each row's group)."""

    copies: np.ndarray
    rank: np.ndarray
    group_ranks: np.ndarray

    def expand(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per row: document (from 0 in the task), repeat, group."""
        n = len(self.copies)
        doc = np.repeat(np.arange(n), self.copies)
        first_row = np.cumsum(self.copies) - self.copies
        repeat = np.arange(len(doc)) - np.repeat(first_row, self.copies)
        group = np.searchsorted(self.group_ranks, self.rank, side="right") - 1
        return doc, repeat, group


@dataclass(frozen=True)
class ScatterTask:
    srcs: list[str]
    rows: dict[str, Rows]  # per split
    paths: dict[str, str]  # per split: the one file this task writes


def scatter_batch(task: ScatterTask) -> dict[str, list[int]]:
    """Write this run of input parts' rows of each split to one file, a row group per
    output group in group order; return the groups each file holds, in that order."""
    table = pa.concat_tables(read_table(src) for src in task.srcs)
    held: dict[str, list[int]] = {}
    for split, mine in task.rows.items():
        doc, repeat, group = mine.expand()
        if not len(doc):
            held[split] = []
            continue
        order = np.argsort(group, kind="stable")
        rows = table.take(pa.array(doc[order]))
        ids = [repeat_id(rid, int(r))
               for rid, r in zip(rows.column("id").to_pylist(), repeat[order], strict=True)]
        rows = rows.set_column(rows.schema.get_field_index("id"), "id", pa.array(ids))
        rows = rows.append_column("_rank", pa.array(mine.rank[order].astype(np.int64)))
        groups, starts = np.unique(group[order], return_index=True)
        bounds = [*starts.tolist(), len(order)]
        with atomic_path(task.paths[split]) as tmp, \
                pq.ParquetWriter(tmp, rows.schema, compression=COMPRESSION) as writer:
            for lo, hi in zip(bounds, bounds[1:], strict=False):
                writer.write_table(rows.slice(lo, hi - lo), row_group_size=hi - lo)
        held[split] = groups.tolist()
    return held


@dataclass(frozen=True)
class GatherTask:
    pieces: list[tuple[str, int]]  # (scatter file, row group) holding this group's rows
    first_rank: int  # rank of the group's first row
    outs: list[str]  # the group's output parts, in order
    part_docs: int


def gather_group(task: GatherTask) -> int:
    """Order one group's rows by their shuffled rank and write its output parts."""
    table = pa.concat_tables(pq.ParquetFile(path).read_row_group(rg) for path, rg in task.pieces)
    table = table.take(pc.sort_indices(table.column("_rank")))
    ranks = table.column("_rank").to_numpy()
    expected = np.arange(task.first_rank, task.first_rank + len(ranks))
    assert np.array_equal(ranks, expected), f"{task.outs[0]}: the group's rows are not whole"
    table = table.drop_columns(["_rank"])
    for k, out in enumerate(task.outs):
        write_table(table.slice(k * task.part_docs, task.part_docs), out)
    return table.num_rows


def scatter_tasks(placements: dict[str, Placement], groups: dict[str, Groups],
                  parts: list[Path], part_docs: list[int], part_chars: np.ndarray,
                  bucket_dir: Path, rows_per_part: int) -> list[ScatterTask]:
    """One task per run of input parts holding up to SHUFFLE_CHARS characters.
    ``part_docs``: documents per input part; ``rows_per_part``: the output parts' size."""
    first_doc = np.concatenate([[0], np.cumsum(part_docs)]).astype(np.int64)
    row = dict.fromkeys(placements, 0)  # each split's first row of the run
    tasks = []
    for b, (lo, hi) in enumerate(cut_runs(part_chars, SHUFFLE_CHARS, MIN_SHUFFLE_TASKS)):
        d0, d1 = first_doc[lo], first_doc[hi]
        rows = {}
        for s, pl in placements.items():
            r1 = row[s] + int(pl.copies[d0:d1].sum())
            rows[s] = Rows(pl.copies[d0:d1], pl.rank[row[s]:r1],
                           groups[s].first_part[:-1] * rows_per_part)
            row[s] = r1
        tasks.append(ScatterTask([str(p) for p in parts[lo:hi]], rows,
                                 {s: str(bucket_dir / s / part_name(b)) for s in rows}))
    return tasks


def gather_tasks(split: str, groups: Groups, held: list[dict[str, list[int]]],
                 scatter: list[ScatterTask], out_dir: Path, part_docs: int) -> list[GatherTask]:
    """One task per group: the row group it has in each scatter file, the parts it writes."""
    pieces: list[list[tuple[str, int]]] = [[] for _ in range(len(groups.first_part) - 1)]
    for task, has in zip(scatter, held, strict=True):
        for rg, g in enumerate(has[split]):
            pieces[g].append((task.paths[split], rg))
    bounds = groups.first_part.tolist()
    return [GatherTask(pieces[g], lo * part_docs,
                       [str(out_dir / part_name(k)) for k in range(lo, hi)], part_docs)
            for g, (lo, hi) in enumerate(zip(bounds, bounds[1:], strict=False))]
