"""Document records between data stages: zstd Parquet parts, one row per document."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from lmforge.errors import InputError
from lmforge.io import atomic_path

COMPRESSION = "zstd"

# Columns every stage reads and writes; ingest adds where each record came from.
SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("text", pa.string()),
        ("domain", pa.string()),
        ("source", pa.string()),
        ("file", pa.string()),
        ("line", pa.int64()),
    ]
)


# mix up-samples a domain by repeating documents; copy r >= 1 of document ``id`` is
# ``id#r<r>`` (copy 0 keeps the plain id), so every copy is traceable to its original.
_REPEAT = re.compile(r"#r[1-9][0-9]*$")


def repeat_id(doc_id: str, copy: int) -> str:
    """The id of the ``copy``-th repeat of ``doc_id`` (the id itself for copy 0)."""
    return doc_id if copy == 0 else f"{doc_id}#r{copy}"


def is_repeat(doc_id: str) -> bool:
    """True for the id of an up-sampled copy (``id#rN``, N >= 1)."""
    return _REPEAT.search(doc_id) is not None


def part_name(index: int) -> str:
    """``part-00007.parquet``: the name of part ``index`` of a record directory."""
    return f"part-{index:05d}.parquet"


def list_parts(directory: str | Path) -> list[Path]:
    """The sorted record parts of ``directory``; an InputError when there are none."""
    directory = Path(directory)
    parts = sorted(directory.glob("part-*.parquet"))
    if not parts:
        raise InputError(
            f"{directory}: no part-*.parquet files (run the stage that writes it first)"
        )
    return parts


def read_table(path: str | Path, columns: list[str] | None = None) -> pa.Table:
    """Read one part, turning a corrupt file into a one-line InputError."""
    try:
        return pq.read_table(path, columns=columns)
    except (pa.ArrowInvalid, OSError) as e:
        raise InputError(f"{path}: unreadable Parquet part ({str(e).splitlines()[0]})") from None


def write_table(table: pa.Table, path: str | Path) -> None:
    """Write ``table`` as one zstd Parquet file, atomically: a task killed mid-write
    (and retried, or rerun) never leaves a truncated part under the part's name."""
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp, compression=COMPRESSION)


def empty_like(schema: pa.Schema) -> pa.Table:
    """A zero-row table, so an emptied part keeps its schema."""
    return schema.empty_table()


class PartWriter:
    """Append tables; write ``part-NNNNN.parquet`` files of exactly ``part_docs`` rows.

    Only one part is buffered, so memory stays flat however large the output grows.
    """

    def __init__(self, directory: str | Path, part_docs: int, schema: pa.Schema = SCHEMA):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.part_docs = part_docs
        self.schema = schema
        self._buffer: list[pa.Table] = []
        self._buffered = 0
        self.parts_written = 0
        self.rows_written = 0

    def add(self, table: pa.Table) -> None:
        """Buffer ``table`` (rows in order), flushing every full part."""
        table = table.select(self.schema.names).cast(self.schema)
        while table.num_rows:
            take = min(self.part_docs - self._buffered, table.num_rows)
            self._buffer.append(table.slice(0, take))
            self._buffered += take
            table = table.slice(take)
            if self._buffered == self.part_docs:
                self._flush()

    def close(self) -> None:
        """Write the last, partial part (or one empty part when nothing was added)."""
        if self._buffered or self.parts_written == 0:
            self._flush()

    def _flush(self) -> None:
        table = pa.concat_tables(self._buffer) if self._buffer else empty_like(self.schema)
        write_table(table.combine_chunks(), self.directory / part_name(self.parts_written))
        self.parts_written += 1
        self.rows_written += table.num_rows
        self._buffer, self._buffered = [], 0


def iter_batches(path: str | Path, batch_rows: int = 4096) -> Iterator[pa.RecordBatch]:
    """Stream a Parquet file in record batches."""
    yield from pq.ParquetFile(path).iter_batches(batch_size=batch_rows)
