"""Readers for raw inputs: JSON lines (plain, .gz, .zst), Parquet and plain text; CSV and
TSV tables (``readers_csv``) and JSON arrays (``readers_json``) have modules of their own.

Each reader yields, in file order, a ``Doc`` for every good record and a ``Reject``
(position, reason, detail) for every bad one, so a broken record is counted and
reported but never stops the stage. Positions are 1-based line numbers for JSON
lines and text, 0-based row numbers for Parquet.

A UTF-8 byte-order mark at the very start of a JSON-lines or text file (Windows tools
write one) is dropped, as Python's 'utf-8-sig' codec would; U+FEFF anywhere else is data.
"""

from __future__ import annotations

import gzip
import io
import json
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import pyarrow as pa
import pyarrow.parquet as pq

from lmforge.errors import InputError

# Reasons a record is rejected; they key the rejects table and the metrics.
INVALID_JSON = "invalid_json"
NOT_AN_OBJECT = "not_an_object"
INVALID_UTF8 = "invalid_utf8"
MISSING_TEXT = "missing_text"
NON_STRING_TEXT = "non_string_text"
NUL_BYTES = "nul_bytes"
EMPTY_TEXT = "empty_text"
TOO_LARGE = "record_too_large"
TRUNCATED = "truncated_file"
CORRUPT = "corrupt_file"
DUPLICATE_ID = "duplicate_id"
EMPTY_FILE = "empty_file"

_COMPRESSIONS = (".gz", ".zst")
_BOM = b"\xef\xbb\xbf"  # U+FEFF in UTF-8
_FORMATS = {".jsonl": "jsonl", ".json": "json", ".ndjson": "jsonl", ".parquet": "parquet",
            ".txt": "txt", ".text": "txt", ".md": "txt", ".csv": "csv", ".tsv": "tsv"}
FORMAT_NAMES = "jsonl, json, csv, tsv, parquet or txt"


@dataclass(frozen=True)
class Doc:
    pos: int
    text: str
    id: str | None
    source: str | None


@dataclass(frozen=True)
class Reject:
    pos: int
    reason: str
    detail: str


def detect_format(path: str | Path) -> str:
    """``jsonl``, ``json``, ``csv``, ``tsv``, ``parquet`` or ``txt`` from the file name
    (compression suffix ignored)."""
    name = Path(path).name.lower()
    for comp in _COMPRESSIONS:
        if name.endswith(comp):
            name = name[: -len(comp)]
    suffix = Path(name).suffix
    if suffix not in _FORMATS:
        raise InputError(
            f"{path}: cannot tell the format from '{suffix or name}'; set the source's "
            f"format to {FORMAT_NAMES}"
        )
    return _FORMATS[suffix]


def zstd_available() -> bool:
    try:
        import zstandard  # noqa: F401
    except ImportError:
        return False
    return True


def open_binary(path: str | Path) -> IO[bytes]:
    """Open ``path`` for reading bytes, decompressing ``.gz`` and ``.zst`` on the fly."""
    name = str(path).lower()
    if name.endswith(".gz"):
        return gzip.open(path, "rb")
    if name.endswith(".zst"):
        try:
            import zstandard
        except ImportError:
            raise InputError(
                f"{path}: reading .zst needs the 'zstandard' package (pip install zstandard)"
            ) from None
        return io.BufferedReader(_ZstdReader(path, zstandard), buffer_size=1 << 20)
    return open(path, "rb")  # noqa: SIM115 - the caller closes it


class _ZstdReader(io.RawIOBase):
    """Decompress a (multi-frame) .zst file, raising EOFError when it ends mid-frame.

    zstandard's own ``stream_reader`` returns a truncated file's bytes as if it had
    ended normally; a reject must say the file was cut short instead.
    """

    def __init__(self, path: str | Path, zstandard: Any):
        self._zstd = zstandard
        self._raw = open(path, "rb")  # noqa: SIM115 - closed in close()
        self._dobj = zstandard.ZstdDecompressor().decompressobj()
        self._pending = b""
        self._in_frame = False

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while not self._pending:
            chunk = self._raw.read(1 << 20)
            if not chunk:
                if self._in_frame:
                    raise EOFError("zstd stream ended before the end of its frame")
                return 0
            while chunk:
                self._in_frame = True
                self._pending += self._dobj.decompress(chunk)
                chunk = b""
                if self._dobj.eof:  # a frame ended; what follows starts the next one
                    chunk = self._dobj.unused_data
                    self._dobj = self._zstd.ZstdDecompressor().decompressobj()
                    self._in_frame = False
        n = min(len(buffer), len(self._pending))
        buffer[:n] = self._pending[:n]
        self._pending = self._pending[n:]
        return n

    def close(self) -> None:
        self._raw.close()
        super().close()


def check_text(value: Any, max_bytes: int) -> Reject | None:
    """Why ``value`` is not a usable document text, or None when it is."""
    if value is None:
        return Reject(0, MISSING_TEXT, "text is missing or null")
    if not isinstance(value, str):
        return Reject(0, NON_STRING_TEXT, f"text is a {type(value).__name__}, not a string")
    if "\x00" in value:
        return Reject(0, NUL_BYTES, f"NUL character at offset {value.index(chr(0))}")
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError as e:  # lone surrogates from a "\ud800" escape
        return Reject(0, INVALID_UTF8, f"unpaired surrogate at offset {e.start}")
    if size > max_bytes:
        return Reject(0, TOO_LARGE, f"{size} bytes > max_record_bytes={max_bytes}")
    if not value.strip():
        return Reject(0, EMPTY_TEXT, "text is empty or whitespace")
    return None


def _as_id(value: Any) -> str | None:
    """A record id as a string; ints are accepted, anything else means 'none given'."""
    if isinstance(value, str) and value:
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return None


def _doc_or_reject(pos: int, text: Any, rid: Any, source: Any, max_bytes: int) -> Doc | Reject:
    bad = check_text(text, max_bytes)
    if bad is not None:
        return Reject(pos, bad.reason, bad.detail)
    return Doc(pos, text, _as_id(rid), source if isinstance(source, str) else None)


def _read_lines(stream: IO[bytes], max_bytes: int) -> Iterator[tuple[int, bytes | None]]:
    """Yield (line number, line); an over-long line is skipped unread and yields None."""
    lineno = 0
    while True:
        line = stream.readline(max_bytes + 1)
        if not line:
            return
        lineno += 1
        if len(line) > max_bytes and not line.endswith(b"\n"):
            # Drain the rest of the line without holding it in memory.
            while line and not line.endswith(b"\n"):
                line = stream.readline(1 << 20)
            yield lineno, None
        else:
            yield lineno, line


def _stream_error(pos: int, e: Exception) -> Reject:
    reason = TRUNCATED if isinstance(e, EOFError) else CORRUPT
    return Reject(pos, reason, str(e).splitlines()[0] if str(e) else type(e).__name__)


def iter_jsonl(path: str | Path, text_field: str, id_field: str | None,
               max_bytes: int) -> Iterator[Doc | Reject]:
    """JSON lines, one object per line; blank lines are not records and are skipped."""
    lineno = 0
    try:
        with open_binary(path) as stream:
            for lineno, raw in _read_lines(stream, max_bytes):
                if raw is None:
                    yield Reject(lineno, TOO_LARGE, f"line longer than max_record_bytes={max_bytes}")
                    continue
                if lineno == 1:  # a BOM marks the file's encoding; json.loads refuses it
                    raw = raw.removeprefix(_BOM)
                if not raw.strip():
                    continue
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    yield Reject(lineno, INVALID_UTF8, f"{e.reason} at byte {e.start}")
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    yield Reject(lineno, INVALID_JSON, f"{e.msg} at column {e.colno}")
                    continue
                except RecursionError:
                    yield Reject(lineno, INVALID_JSON, "nested too deeply")
                    continue
                if not isinstance(obj, dict):
                    yield Reject(lineno, NOT_AN_OBJECT, f"a JSON {type(obj).__name__}, not an object")
                    continue
                rid = obj.get(id_field) if id_field else None
                yield _doc_or_reject(lineno, obj.get(text_field), rid, obj.get("source"), max_bytes)
    except (EOFError, OSError, zlib.error) as e:
        yield _stream_error(lineno + 1, e)
    except Exception as e:  # zstandard.ZstdError and friends: a broken file, not a bug
        if type(e).__module__.startswith("zstandard"):
            yield _stream_error(lineno + 1, e)
        else:
            raise


def iter_parquet(path: str | Path, text_field: str, id_field: str | None,
                 max_bytes: int) -> Iterator[Doc | Reject]:
    """Parquet rows (any layout, including Hugging Face datasets' parquet exports)."""
    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowInvalid, OSError) as e:
        yield Reject(0, CORRUPT, str(e).splitlines()[0])
        return
    names = pf.schema_arrow.names
    if text_field not in names:
        raise InputError(
            f"{path}: no column '{text_field}' (columns: {', '.join(names)}); "
            f"set the source's text_field"
        )
    columns = [text_field] + [c for c in (id_field, "source") if c and c in names and c != text_field]
    row = 0
    try:
        for batch in pf.iter_batches(batch_size=2048, columns=columns):
            cols = batch.to_pydict()
            texts = cols[text_field]
            ids = cols.get(id_field) if id_field else None
            sources = cols.get("source")
            for i, text in enumerate(texts):
                if isinstance(text, bytes):
                    try:
                        text = text.decode("utf-8")
                    except UnicodeDecodeError as e:
                        yield Reject(row, INVALID_UTF8, f"{e.reason} at byte {e.start}")
                        row += 1
                        continue
                yield _doc_or_reject(row, text, ids[i] if ids else None,
                                     sources[i] if sources else None, max_bytes)
                row += 1
    except (pa.ArrowInvalid, OSError) as e:
        yield Reject(row, CORRUPT, str(e).splitlines()[0])


def iter_txt(path: str | Path, split: str, max_bytes: int) -> Iterator[Doc | Reject]:
    """Plain text: the whole file is one document, or each blank-line-separated block is."""
    try:
        with open_binary(path) as stream:
            data = stream.read().removeprefix(_BOM)  # the encoding's mark, not the text's
    except (EOFError, OSError, zlib.error) as e:
        yield _stream_error(1, e)
        return
    if split == "file":
        yield _decode_block(1, data, max_bytes)
        return
    block: list[bytes] = []
    start = 1
    for lineno, line in enumerate(data.split(b"\n"), start=1):
        if line.strip():
            if not block:
                start = lineno
            block.append(line)
        elif block:
            yield _decode_block(start, b"\n".join(block), max_bytes)
            block = []
    if block:
        yield _decode_block(start, b"\n".join(block), max_bytes)


def _decode_block(pos: int, data: bytes, max_bytes: int) -> Doc | Reject:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        return Reject(pos, INVALID_UTF8, f"{e.reason} at byte {e.start}")
    return _doc_or_reject(pos, text, None, None, max_bytes)
