"""Reading the mixed corpus (``data/mixed/{train,val}/part-*.parquet``) in bounded batches."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from lmforge.data.records import list_parts
from lmforge.errors import InputError

__all__ = ["TextBatch", "iter_text_batches", "list_parts", "read_domains"]


@dataclass
class TextBatch:
    """Consecutive rows of one part: ``first_row`` is the row number of ``texts[0]``."""

    path: Path
    first_row: int
    ids: list[str]
    texts: list[str]
    domains: list[str]
    text_bytes: pa.Array  # UTF-8 byte length per document (int64)


def open_columns(path: Path, columns: list[str]) -> pq.ParquetFile:
    """A parquet part, checked to have ``columns``; an unreadable file or a missing
    column is one InputError naming the file."""
    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise InputError(f"{path}: unreadable Parquet part ({str(e).splitlines()[0]})") from None
    missing = [c for c in columns if c not in pf.schema_arrow.names]
    if missing:
        raise InputError(f"{path}: no column(s) {', '.join(missing)} "
                         f"(has {', '.join(pf.schema_arrow.names)})")
    return pf


def check_strings(path: Path, first_row: int, name: str, col: pa.Array) -> None:
    """Column ``name`` of a batch starting at row ``first_row`` holds strings, none null;
    else one InputError naming the file and row."""
    if not (pa.types.is_string(col.type) or pa.types.is_large_string(col.type)):
        raise InputError(f"{path}: column '{name}' is {col.type}, expected string")
    if col.null_count:
        row = first_row + pc.index(pc.is_null(col), True).as_py()
        raise InputError(f"{path}: row {row}: '{name}' is null")


def iter_text_batches(path: str | Path, batch_rows: int = 1024) -> Iterator[TextBatch]:
    """Rows of one part as :class:`TextBatch` es; a null or non-string cell is an InputError."""
    path = Path(path)
    pf = open_columns(path, ["id", "text", "domain"])
    row = 0
    try:
        for rb in pf.iter_batches(batch_size=batch_rows, columns=["id", "text", "domain"]):
            for name in ("id", "text", "domain"):
                check_strings(path, row, name, rb.column(name))
            text = rb.column("text")
            yield TextBatch(path, row, rb.column("id").to_pylist(), text.to_pylist(),
                            rb.column("domain").to_pylist(), pc.binary_length(text))
            row += rb.num_rows
    except (pa.ArrowInvalid, OSError) as e:
        raise InputError(f"{path}: row {row}: unreadable ({str(e).splitlines()[0]})") from None


def read_domains(parts: list[Path]) -> list[str]:
    """The sorted distinct domains of ``parts`` (reads only the domain column)."""
    found: set[str] = set()
    for path in parts:
        pf = open_columns(path, ["domain"])
        try:
            col = pf.read(columns=["domain"]).column("domain").combine_chunks()
        except (pa.ArrowInvalid, OSError) as e:
            raise InputError(f"{path}: unreadable ({str(e).splitlines()[0]})") from None
        check_strings(path, 0, "domain", col)
        found.update(pc.unique(col).to_pylist())
    return sorted(found)
