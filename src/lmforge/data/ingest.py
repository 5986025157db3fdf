"""The ingest stage: raw files in many formats -> uniform Parquet record parts.

Workers do the per-document work and write every output themselves; the driver holds
figures per input file, per id bucket and per output part, never per document (a
terabyte must not pass through one process). Four maps on the executor:

1. read (a task per input file): the worker streams the file's records into a
   temporary Parquet file of rows, its rejects into another, and the ids, hash-
   partitioned by id into ``id_buckets`` record batches (batch ``b`` = bucket ``b``),
   into a third.
2. check ids (a task per bucket): ids must be unique across the corpus. A bucket's task
   reads its batch of every file's ids and finds each id seen before (in source,
   file and record order: the first copy is kept), writes those duplicates to the
   bucket's file and returns how many each input file has.
3. write parts (a task per output part): ``part-NNNNN.parquet`` holds the kept documents
   ``[k * part_docs, (k + 1) * part_docs)`` in source, file and record order; from the
   per-file counts the driver knows which rows of which files each part spans, and the
   task reads them, less their duplicates.
4. one task writes ``rejects.parquet``: each file's readers' rejects, then its
   duplicates, file by file.

The bytes are the same whatever the executor, worker count or bucket count.
"""

from __future__ import annotations

import glob
import math
import os
import zlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from lmforge.config import IngestConfig, SourceConfig
from lmforge.data import formats, readers
from lmforge.data.counts import Counts
from lmforge.data.readers import Doc
from lmforge.data.records import SCHEMA, part_name, read_table, write_table
from lmforge.errors import InputError
from lmforge.executor import Executor, LocalExecutor, PartLog, output_settings
from lmforge.io import atomic_path, files_fingerprint, resumable_dir

REJECTS_SCHEMA = pa.schema(
    [
        ("file", pa.string()),
        ("line", pa.int64()),
        ("domain", pa.string()),
        ("reason", pa.string()),
        ("detail", pa.string()),
    ]
)
_FLUSH_ROWS = 4096
# The read files are scratch, written once and read once: LZ4, whose compression costs a
# fraction of zstd's CPU, for files ~1.3x larger (the parts stay zstd).
SCRATCH_COMPRESSION = "lz4"
# An id bucket per this many bytes of input files (as stored): a bucket's task holds its
# ids, ~100 B each, so 1 GiB of gzipped web text (~1e6 documents) needs ~100 MB.
ID_BUCKET_BYTES = 2**30
MAX_ID_BUCKETS = 4096
# Ids with where they are: the row (kept or not) and line in their file.
IDS_SCHEMA = pa.schema([("id", pa.string()), ("row", pa.int64()), ("line", pa.int64())])
# A duplicate: its file (index in the stage's file order), row, id and line.
DUPS_SCHEMA = pa.schema([("file", pa.int64()), ("row", pa.int64()), ("id", pa.string()),
                         ("line", pa.int64())])


@dataclass(frozen=True)
class FileTask:
    """One input file and how to read it; ``out`` is where the worker writes its rows
    (``ids_path`` and ``rejects_path`` name the ids and rejects beside it)."""

    path: str
    source: SourceConfig
    max_record_bytes: int
    out: str
    id_buckets: int = 1


@dataclass
class FileResult:
    """What a read task tells the driver: its documents and rejects by reason."""

    out: str
    docs: int
    rejected: dict[str, int]


@dataclass(frozen=True)
class IdBucketTask:
    """Check bucket ``bucket`` of the ids of ``files`` read files under ``work``."""

    bucket: int
    work: str
    files: int
    out: str


@dataclass(frozen=True)
class Segment:
    """Kept rows ``[start, stop)`` of read file ``file`` (numbered in the stage's
    order); its duplicates are in the bucket files ``dup_buckets``."""

    file: int
    start: int
    stop: int
    dup_buckets: tuple[int, ...]


@dataclass(frozen=True)
class PartTask:
    """Output part ``out``: the segments, in order, read from ``work``."""

    out: str
    work: str
    segments: tuple[Segment, ...]


@dataclass(frozen=True)
class RejectsTask:
    """``rejects.parquet``: per read file (path, domain, has reader rejects), then the
    duplicates in ``dup_buckets``."""

    out: str
    work: str
    files: tuple[tuple[str, str, bool], ...]
    dup_buckets: tuple[int, ...]


def rows_path(work: str | Path, n: int) -> str:
    """The temporary rows of read file ``n``."""
    return str(Path(work) / f"{n:06d}.parquet")


def ids_path(rows: str) -> str:
    """The ids file beside a rows file."""
    return rows.removesuffix(".parquet") + ".ids.arrow"


def rejects_path(rows: str) -> str:
    """The readers' rejects file beside a rows file."""
    return rows.removesuffix(".parquet") + ".rejects.parquet"


def dups_path(work: str | Path, bucket: int) -> str:
    """The duplicates found in id bucket ``bucket``."""
    return str(Path(work) / f"dups-{bucket:05d}.parquet")


def resolve_files(sources: list[SourceConfig]) -> list[tuple[int, str]]:
    """(source index, path) for every file the sources match, sorted within a source.

    A glob that matches nothing, or a file no reader can handle, is a config error
    and stops the stage before any work starts.
    """
    files: list[tuple[int, str]] = []
    for i, src in enumerate(sources):
        matched = sorted(p for p in glob.glob(src.path, recursive=True) if Path(p).is_file())
        if not matched:
            raise InputError(f"ingest.sources[{i}].path: no file matches '{src.path}'")
        for path in matched:
            fmt = readers.detect_format(path) if src.format == "auto" else src.format
            if path.lower().endswith(".zst") and fmt != "parquet" and not readers.zstd_available():
                raise InputError(
                    f"ingest.sources[{i}].path: {path}: reading .zst needs the 'zstandard' "
                    "package (pip install zstandard)"
                )
            files.append((i, path))
    return files


def id_and_source(rec: readers.Doc, path: str) -> tuple[str, str]:
    """A document's id (its own, else ``path:position``) and source (else the path)."""
    return (rec.id if rec.id is not None else f"{path}:{rec.pos}",
            rec.source if rec.source is not None else path)


def ingest_file(task: FileTask) -> FileResult:
    """Read one raw file into temporary rows, ids (by bucket) and rejects files (worker)."""
    src = task.source
    records = formats.iter_records(task.path, src.format, src.text_field, src.id_field,
                                   src.txt_split, task.max_record_bytes)
    rejects: list[tuple[str, int, str, str, str]] = []
    rows: dict[str, list[Any]] = {name: [] for name in SCHEMA.names}
    ids: list[str] = []
    lines: list[int] = []
    with atomic_path(task.out) as out, \
            pq.ParquetWriter(out, SCHEMA, compression=SCRATCH_COMPRESSION) as writer:
        for rec in records:
            if not isinstance(rec, Doc):
                rejects.append((task.path, rec.pos, src.domain, rec.reason, rec.detail))
                continue
            doc_id, source = id_and_source(rec, task.path)
            rows["id"].append(doc_id)
            rows["text"].append(rec.text)
            rows["domain"].append(src.domain)
            rows["source"].append(source)
            rows["file"].append(task.path)
            rows["line"].append(rec.pos)
            ids.append(doc_id)
            lines.append(rec.pos)
            if len(rows["id"]) >= _FLUSH_ROWS:
                writer.write_table(pa.table(rows, schema=SCHEMA))
                rows = {name: [] for name in SCHEMA.names}
        if rows["id"]:
            writer.write_table(pa.table(rows, schema=SCHEMA))
    if not ids and not rejects:  # nothing at all: say so rather than vanish
        rejects.append((task.path, 0, src.domain, readers.EMPTY_FILE, "the file holds no records"))
    write_ids(ids, lines, task.id_buckets, ids_path(task.out))
    if rejects:
        columns = list(zip(*rejects, strict=True))
        write_table(pa.table(dict(zip(REJECTS_SCHEMA.names, map(list, columns), strict=True)),
                             schema=REJECTS_SCHEMA), rejects_path(task.out))
    return FileResult(task.out, len(ids), dict(Counter(r[3] for r in rejects)))


def id_bucket(ids: list[str], buckets: int) -> np.ndarray:
    """Each id's bucket: CRC-32 of its UTF-8 bytes modulo ``buckets`` (the same on every
    machine and Python, unlike ``hash``)."""
    return np.fromiter((zlib.crc32(i.encode()) % buckets for i in ids), np.int64, len(ids))


def write_ids(ids: list[str], lines: list[int], buckets: int, path: str) -> None:
    """Write a file's ids with their rows and lines, one record batch per bucket (empty
    ones too), so a bucket's task reads its share of every file and nothing else. Arrow's
    IPC format, not Parquet: a scratch file read once, at a thirtieth of the cost."""
    bucket = id_bucket(ids, buckets)
    order = np.argsort(bucket, kind="stable")  # record order within a bucket
    batch = pa.record_batch([pa.array(ids, pa.string()).take(order), pa.array(order),
                             pa.array(lines, pa.int64()).take(order)], schema=IDS_SCHEMA)
    bounds = np.searchsorted(bucket[order], np.arange(buckets + 1))
    with atomic_path(path) as tmp, ipc.new_file(tmp, IDS_SCHEMA) as w:
        for b in range(buckets):
            w.write_batch(batch.slice(bounds[b], bounds[b + 1] - bounds[b]))


def read_id_bucket(path: str, bucket: int) -> pa.Table:
    """Bucket ``bucket`` of an ids file."""
    with pa.memory_map(path) as f:
        return pa.Table.from_batches([ipc.open_file(f).get_batch(bucket)])


def find_duplicate_ids(task: IdBucketTask) -> dict[int, int]:
    """Bucket ``task.bucket``'s duplicate ids, every copy after the first in file and
    row order, written to ``task.out`` when there are any; returns file -> duplicates
    (worker)."""
    tables = []
    for n in range(task.files):
        t = read_id_bucket(ids_path(rows_path(task.work, n)), task.bucket)
        tables.append(t.append_column("file", pa.array(np.full(t.num_rows, n, np.int64))))
    table = pa.concat_tables(tables) if tables else DUPS_SCHEMA.empty_table()
    if table.num_rows < 2:
        return {}
    table = table.take(pc.sort_indices(
        table, [("id", "ascending"), ("file", "ascending"), ("row", "ascending")]))
    ids = table.column("id")
    repeat = pc.equal(ids.slice(1), ids.slice(0, len(ids) - 1))  # same id as the row before
    dups = table.slice(1).filter(repeat).select(DUPS_SCHEMA.names)
    if not dups.num_rows:
        return {}
    dups = dups.sort_by([("file", "ascending"), ("row", "ascending")])
    write_table(dups.combine_chunks(), task.out)
    return {int(f): int(c) for f, c in zip(*np.unique(dups.column("file").to_numpy(),
                                                      return_counts=True), strict=True)}


def duplicate_rows(work: str, file: int, buckets: tuple[int, ...]) -> np.ndarray:
    """The rows of read file ``file`` that are duplicates, from the buckets' files."""
    rows = [pq.read_table(dups_path(work, b), columns=["row"],
                          filters=[("file", "=", file)]).column("row").to_numpy()
            for b in buckets]
    return np.concatenate(rows) if rows else np.zeros(0, np.int64)


def read_kept(work: str, seg: Segment) -> pa.Table:
    """Kept rows ``[seg.start, seg.stop)`` of a read file, reading only the row groups
    (``_FLUSH_ROWS`` rows each) that hold them: a large input file spans many parts."""
    f = pq.ParquetFile(rows_path(work, seg.file))
    keep = np.ones(f.metadata.num_rows, bool)
    if seg.dup_buckets:
        keep[duplicate_rows(work, seg.file, seg.dup_buckets)] = False
    rows = np.flatnonzero(keep)[seg.start:seg.stop]
    groups = np.cumsum([0] + [f.metadata.row_group(g).num_rows for g in range(f.num_row_groups)])
    first, last = np.searchsorted(groups, [rows[0], rows[-1]], side="right") - 1
    table = f.read_row_groups(range(first, last + 1))
    return table.take(pa.array(rows - groups[first]))


def write_part(task: PartTask) -> int:
    """Write one output part from the segments of the read files it spans (worker)."""
    pieces = [read_kept(task.work, seg) for seg in task.segments]
    table = pa.concat_tables(pieces) if pieces else SCHEMA.empty_table()
    write_table(table.select(SCHEMA.names).cast(SCHEMA).combine_chunks(), task.out)
    return table.num_rows


def write_rejects(task: RejectsTask) -> int:
    """Write ``rejects.parquet``: file by file, its readers' rejects then its duplicates
    (in row order), as the stage's order reads them (worker)."""
    pieces = []
    for n, (_, _, has) in enumerate(task.files):
        if has:
            t = read_table(rejects_path(rows_path(task.work, n)))
            pieces.append(with_order(t, n, 0, np.arange(t.num_rows)))
    for b in task.dup_buckets:
        d = read_table(dups_path(task.work, b))
        file = d.column("file").to_numpy()
        t = pa.table({
            "file": [task.files[f][0] for f in file],
            "line": d.column("line"),
            "domain": [task.files[f][1] for f in file],
            "reason": pa.array([readers.DUPLICATE_ID] * d.num_rows, pa.string()),
            "detail": pc.binary_join_element_wise("id '", d.column("id"), "' already seen", ""),
        }, schema=REJECTS_SCHEMA)
        pieces.append(with_order(t, file, 1, d.column("row").to_numpy()))
    if not pieces:
        write_table(REJECTS_SCHEMA.empty_table(), task.out)
        return 0
    table = pa.concat_tables(pieces).sort_by([("_file", "ascending"), ("_kind", "ascending"),
                                              ("_seq", "ascending")])
    write_table(table.select(REJECTS_SCHEMA.names).combine_chunks(), task.out)
    return table.num_rows


def with_order(table: pa.Table, file: Any, kind: int, seq: np.ndarray) -> pa.Table:
    """``table`` with the sort keys of the rejects file: read file, readers' rejects (0)
    before duplicates (1), position."""
    n = table.num_rows
    return (table.append_column("_file", pa.array(np.broadcast_to(file, n).astype(np.int64)))
            .append_column("_kind", pa.array(np.full(n, kind, np.int64)))
            .append_column("_seq", pa.array(seq.astype(np.int64))))


def id_buckets(paths: list[str]) -> int:
    """How many buckets the id check uses: one per ``ID_BUCKET_BYTES`` of input."""
    size = sum(os.path.getsize(p) for p in paths)
    return max(1, min(MAX_ID_BUCKETS, math.ceil(size / ID_BUCKET_BYTES)))


def plan_parts(kept: list[int], dup_buckets: list[tuple[int, ...]], part_docs: int,
               work: str, out_dir: Path) -> list[PartTask]:
    """Cut the kept documents, file by file, into parts of ``part_docs`` (at least one
    part, empty when nothing was kept)."""
    total = sum(kept)
    tasks = []
    file, offset = 0, 0  # the next kept row to place: file ``file``, row ``offset``
    for k in range(max(1, math.ceil(total / part_docs))):
        need, segments = part_docs, []
        while need and file < len(kept):
            take = min(need, kept[file] - offset)
            if take:
                segments.append(Segment(file, offset, offset + take, dup_buckets[file]))
            need, offset = need - take, offset + take
            if offset == kept[file]:
                file, offset = file + 1, 0
        tasks.append(PartTask(str(out_dir / part_name(k)), work, tuple(segments)))
    return tasks


def run_ingest(cfg: IngestConfig, out_dir: str | Path, executor: Executor | None = None,
               buckets: int | None = None) -> dict[str, Any]:
    """Read every source into ``out_dir``/part-*.parquet and ``rejects.parquet``.

    The four maps of the module docstring run on ``executor`` (default: the local pool);
    a rerun after a kill skips the tasks already done. ``buckets``: how many id buckets
    (default :func:`id_buckets`; the bytes do not depend on it). Returns the metrics:
    per-domain in / kept / rejected-by-reason, and file counts.
    """
    executor = executor or LocalExecutor(cfg.num_workers)
    cfg = output_settings(cfg)
    files = resolve_files(cfg.sources)
    buckets = buckets or id_buckets([p for _, p in files])
    fingerprint = files_fingerprint([Path(p) for _, p in files], "ingest", cfg)
    with resumable_dir(out_dir, fingerprint) as tmp:
        work = tmp / ".work"
        work.mkdir(exist_ok=True)
        tasks = [FileTask(path, cfg.sources[i], cfg.max_record_bytes, rows_path(work, n), buckets)
                 for n, (i, path) in enumerate(files)]
        read = list(executor.map(ingest_file, tasks, "ingest", PartLog(tmp / ".done-read")))
        dups = [0] * len(files)
        dup_buckets: list[list[int]] = [[] for _ in files]
        checks = [IdBucketTask(b, str(work), len(files), dups_path(work, b)) for b in range(buckets)]
        for b, found in enumerate(executor.map(find_duplicate_ids, checks, "ingest: ids",
                                               PartLog(tmp / ".done-ids"))):
            for n, count in found.items():
                dups[n] += count
                dup_buckets[n].append(b)
        kept = [r.docs - d for r, d in zip(read, dups, strict=True)]
        parts = plan_parts(kept, [tuple(b) for b in dup_buckets], cfg.part_docs, str(work), tmp)
        for stale in tmp.glob("part-*.parquet"):  # beyond this plan's parts: another run's
            if int(stale.stem.removeprefix("part-")) >= len(parts):
                stale.unlink()
        for _ in executor.map(write_part, parts, "ingest: parts", PartLog(tmp / ".done-parts")):
            pass
        rejects = RejectsTask(str(tmp / "rejects.parquet"), str(work),
                              tuple((t.path, t.source.domain, bool(r.rejected))
                                    for t, r in zip(tasks, read, strict=True)),
                              tuple(sorted({b for bs in dup_buckets for b in bs})))
        for _ in executor.map(write_rejects, [rejects]):
            pass
    metrics = count_domains(tasks, read, dups).as_dict()
    metrics["files"] = len(files)
    metrics["parts"] = len(parts)
    return metrics


def count_domains(tasks: list[FileTask], read: list[FileResult], dups: list[int]) -> Counts:
    """Per domain: documents in, kept, rejected by reason (duplicates included)."""
    counts = Counts()
    for task, result, d in zip(tasks, read, dups, strict=True):
        c = counts[task.source.domain]
        c.n_in += result.docs + sum(result.rejected.values())
        c.kept += result.docs - d
        c.rejected.update(result.rejected)
        if d:
            c.rejected[readers.DUPLICATE_ID] += d
    return counts
