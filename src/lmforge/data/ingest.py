"""The ingest stage: raw files in many formats -> uniform Parquet record parts.

Files are read in parallel (one task per file); each worker streams its records into
a temporary Parquet file, and the main process concatenates those, in source and file
order, into ``part-NNNNN.parquet`` parts of ``part_docs`` documents. Ids must be
unique across the corpus, so a repeated id is rejected here, where it is cheap to see.
"""

from __future__ import annotations

import glob
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from lmforge.config import IngestConfig, SourceConfig
from lmforge.data import formats, readers
from lmforge.data.counts import Counts
from lmforge.data.readers import Doc
from lmforge.data.records import COMPRESSION, SCHEMA, PartWriter, iter_batches, write_table
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


@dataclass(frozen=True)
class FileTask:
    """One input file and how to read it; ``out`` is where the worker writes its rows."""

    path: str
    source: SourceConfig
    max_record_bytes: int
    out: str


@dataclass
class FileResult:
    out: str
    docs: int
    rejects: list[tuple[str, int, str, str, str]]


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
    """Read one raw file into a temporary Parquet file; collect its rejects (worker)."""
    src = task.source
    records = formats.iter_records(task.path, src.format, src.text_field, src.id_field,
                                   src.txt_split, task.max_record_bytes)
    rejects: list[tuple[str, int, str, str, str]] = []
    rows: dict[str, list[Any]] = {name: [] for name in SCHEMA.names}
    docs = 0
    with atomic_path(task.out) as out, pq.ParquetWriter(out, SCHEMA, compression=COMPRESSION) as writer:
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
            docs += 1
            if len(rows["id"]) >= _FLUSH_ROWS:
                writer.write_table(pa.table(rows, schema=SCHEMA))
                rows = {name: [] for name in SCHEMA.names}
        if rows["id"]:
            writer.write_table(pa.table(rows, schema=SCHEMA))
    if docs == 0 and not rejects:  # nothing at all: say so rather than vanish
        rejects.append((task.path, 0, src.domain, readers.EMPTY_FILE, "the file holds no records"))
    return FileResult(task.out, docs, rejects)


def drop_duplicate_ids(table: pa.Table, seen: set[str]) -> tuple[pa.Table, pa.Table]:
    """Split ``table`` into rows with a new id and rows whose id was already seen."""
    keep = []
    for rid in table.column("id").to_pylist():
        keep.append(rid not in seen)
        seen.add(rid)
    mask = pa.array(keep)
    return table.filter(mask), table.filter(pc.invert(mask))


def run_ingest(cfg: IngestConfig, out_dir: str | Path,
               executor: Executor | None = None) -> dict[str, Any]:
    """Read every source into ``out_dir``/part-*.parquet and ``rejects.parquet``.

    Files are read on ``executor`` (default: the local pool); a rerun after a kill
    skips the files already read. Returns the metrics: per-domain in / kept /
    rejected-by-reason, and file counts.
    """
    executor = executor or LocalExecutor(cfg.num_workers)
    cfg = output_settings(cfg)
    files = resolve_files(cfg.sources)
    counts = Counts()
    rejects: list[tuple[str, int, str, str, str]] = []
    seen: set[str] = set()
    fingerprint = files_fingerprint([Path(p) for _, p in files], "ingest", cfg)
    with resumable_dir(out_dir, fingerprint) as tmp:
        work = tmp / ".work"
        work.mkdir(exist_ok=True)
        for stale in tmp.glob("part-*.parquet"):  # parts of a killed run: rebuilt below
            stale.unlink()
        tasks = [FileTask(path, cfg.sources[i], cfg.max_record_bytes, str(work / f"{n:06d}.parquet"))
                 for n, (i, path) in enumerate(files)]
        parts = PartWriter(tmp, cfg.part_docs)
        # Each file's rows are kept until the end, so a rerun can rebuild the parts
        # from the files already read.
        for result in executor.map(ingest_file, tasks, "ingest", PartLog(tmp / ".done")):
            for row in result.rejects:
                counts[row[2]].n_in += 1
                counts[row[2]].rejected[row[3]] += 1
            rejects.extend(result.rejects)
            for batch in iter_batches(result.out):
                table, dups = drop_duplicate_ids(pa.Table.from_batches([batch]), seen)
                for d in dups.to_pylist():
                    rejects.append((d["file"], d["line"], d["domain"], readers.DUPLICATE_ID,
                                    f"id '{d['id']}' already seen"))
                    counts[d["domain"]].n_in += 1
                    counts[d["domain"]].rejected[readers.DUPLICATE_ID] += 1
                for domain, n in _value_counts(table.column("domain")).items():
                    counts[domain].n_in += n
                    counts[domain].kept += n
                parts.add(table)
        parts.close()
        columns = list(zip(*rejects, strict=True)) if rejects else [[] for _ in REJECTS_SCHEMA.names]
        write_table(pa.table(dict(zip(REJECTS_SCHEMA.names, map(list, columns), strict=True)),
                             schema=REJECTS_SCHEMA), tmp / "rejects.parquet")
    metrics = counts.as_dict()
    metrics["files"] = len(files)
    metrics["parts"] = parts.parts_written
    return metrics


def _value_counts(column: pa.ChunkedArray) -> dict[str, int]:
    vc = pc.value_counts(column)
    return {v["values"]: v["counts"] for v in vc.to_pylist()}
