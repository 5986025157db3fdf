"""CSV and TSV tables: one document per row, its text in a named column.

pyarrow's CSV reader does the parsing, each format by its own rules. CSV follows RFC 4180
(header, quoting, doubled quotes, values spanning lines); TSV has no quoting (IANA
text/tab-separated-values), so a ``"`` is data and every line is one row exactly as
written. Both drop a leading byte-order mark and read CRLF line ends. Cells are read as
bytes so a bad UTF-8 cell rejects its row alone; a row with the wrong number of cells is
skipped by pyarrow's invalid-row handler and rejected here. Positions are 1-based line
numbers of a row's first line: pyarrow numbers records, so lines are counted from the
newlines in each record's values (a blank line is a row of empty cells to pyarrow here,
skipped as no record, as is a row whose cells are all empty).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pcsv

from lmforge.data import readers
from lmforge.data.readers import Doc, Reject
from lmforge.errors import InputError

WRONG_COLUMNS = "wrong_column_count"


def _parse_options(delimiter: str, handler) -> pcsv.ParseOptions:
    """RFC 4180 for CSV; for TSV (a tab delimiter) no quote character at all, since a
    quote there would merge the rows up to the next quote into one cell, silently."""
    quoted = delimiter != "\t"
    return pcsv.ParseOptions(delimiter=delimiter, quote_char='"' if quoted else False,
                             double_quote=quoted, escape_char=False,
                             newlines_in_values=quoted, ignore_empty_lines=False,
                             invalid_row_handler=handler)


def _open(path: str | Path, delimiter: str, handler=None,
          names: list[str] | None = None) -> pcsv.CSVStreamingReader:
    read = pcsv.ReadOptions(use_threads=False, block_size=1 << 22)
    parse = _parse_options(delimiter, handler)
    convert = pcsv.ConvertOptions(column_types={n: pa.binary() for n in names or []},
                                  strings_can_be_null=False)
    return pcsv.open_csv(readers.open_binary(path), read_options=read,
                         parse_options=parse, convert_options=convert)


def _header(path: str | Path, delimiter: str) -> list[str]:
    """The column names (pyarrow reads them from the first record)."""
    return _open(path, delimiter, handler=lambda row: "skip").schema.names


class _Skipped:
    """pyarrow's invalid rows, by record number (the header is record 1)."""

    def __init__(self) -> None:
        self.rows: dict[int, tuple[str, int]] = {}

    def __call__(self, row) -> str:
        self.rows[row.number] = (row.text, row.actual_columns)
        return "skip"


def iter_csv(path: str | Path, text_field: str, id_field: str | None, max_bytes: int,
             delimiter: str = ",") -> Iterator[Doc | Reject]:
    """Rows of a CSV (or, with ``delimiter='\\t'``, TSV) file with a header row."""
    try:
        names = _header(path, delimiter)
    except (pa.ArrowInvalid, OSError, EOFError, zlib.error) as e:
        yield readers._stream_error(1, e)
        return
    if text_field not in names:
        raise InputError(f"{path}: no column '{text_field}' (columns: {', '.join(names)}); "
                         f"set the source's text_field")
    skipped = _Skipped()
    line = 1 + sum(n.count("\n") for n in names) + 1  # the first row's line
    record = 2
    try:
        for batch in _open(path, delimiter, skipped, names):
            cols = batch.to_pydict()
            for i in range(batch.num_rows):
                while record in skipped.rows:
                    line, bad = _skipped_row(skipped.rows.pop(record), line, len(names))
                    record += 1
                    if bad is not None:
                        yield bad
                cells = {n: cols[n][i] for n in names}
                pos, line, record = line, line + 1 + sum(c.count(b"\n") for c in cells.values()), record + 1
                if not any(cells.values()):
                    continue  # a blank line (pyarrow gives it empty cells) is no record
                yield _row_doc(pos, cells, text_field, id_field, max_bytes)
    except (pa.ArrowInvalid, OSError, EOFError, zlib.error) as e:
        yield readers._stream_error(line, e)
        return
    for number in sorted(skipped.rows):
        line, bad = _skipped_row(skipped.rows[number], line, len(names))
        if bad is not None:
            yield bad


def _skipped_row(row: tuple[str, int], line: int, width: int) -> tuple[int, Reject | None]:
    """(next row's line, reject) for a row pyarrow skipped; a blank line is no reject."""
    text, actual = row
    nxt = line + 1 + text.count("\n")
    if not text.strip():
        return nxt, None
    return nxt, Reject(line, WRONG_COLUMNS, f"{actual} cells, the header has {width}")


def _row_doc(pos: int, cells: dict[str, bytes], text_field: str, id_field: str | None,
             max_bytes: int) -> Doc | Reject:
    values: dict[str, str] = {}
    for name in (text_field, id_field, "source"):
        if name is None or name not in cells:
            continue
        try:
            value = cells[name].decode("utf-8")
        except UnicodeDecodeError as e:
            return Reject(pos, readers.INVALID_UTF8, f"column '{name}': {e.reason} at byte {e.start}")
        if value or name == text_field:  # an empty id or source cell means "none given"
            values[name] = value
    return readers._doc_or_reject(pos, values[text_field], values.get(id_field or ""),
                                  values.get("source"), max_bytes)
