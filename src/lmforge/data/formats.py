"""Any raw input file's records: the reader for its format (``auto`` = from its name).

A module of its own so the stages that read JSON lines alone (tasks, SFT records) do
not depend on the table and array readers.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from lmforge.data import readers, readers_csv, readers_json
from lmforge.data.readers import Doc, Reject
from lmforge.errors import InputError


def iter_records(path: str | Path, fmt: str, text_field: str, id_field: str | None,
                 txt_split: str, max_bytes: int) -> Iterator[Doc | Reject]:
    """Dispatch to the reader for ``fmt`` (``auto`` = from the file name). ``json`` is a
    JSON array of records, or JSON lines when the file does not start with ``[``."""
    if fmt == "auto":
        fmt = readers.detect_format(path)
    if fmt == "json":
        if readers_json.is_array(path):
            return readers_json.iter_json_array(path, text_field, id_field, max_bytes)
        fmt = "jsonl"
    if fmt in ("csv", "tsv"):
        return readers_csv.iter_csv(path, text_field, id_field, max_bytes,
                                    delimiter="," if fmt == "csv" else "\t")
    if fmt == "jsonl":
        return readers.iter_jsonl(path, text_field, id_field, max_bytes)
    if fmt == "parquet":
        return readers.iter_parquet(path, text_field, id_field, max_bytes)
    if fmt == "txt":
        return readers.iter_txt(path, txt_split, max_bytes)
    raise InputError(f"{path}: unknown format '{fmt}' (use auto, {readers.FORMAT_NAMES})")
