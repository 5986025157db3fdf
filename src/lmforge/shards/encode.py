"""The shards stage's tasks: each encodes a row range of one Parquet part, wherever it runs.

The driver only plans and writes. It cuts every part into row ranges of about
``CHUNK_CHARS`` characters (fewer for a small split) from the Parquet metadata alone (no text read), and hands
:class:`RowsTask` s to an executor (:mod:`lmforge.executor`: this machine's process pool
or a Ray cluster). Each task, :func:`encode_rows`, reads its own rows, encodes them on
one thread (either tokenizer backend) and sends back a compact numpy array; results come back in task
order and go to the shard writer, so the output does not depend on where or on how many
workers the tasks ran. No text passes through the driver, which on a cluster would be
the bottleneck.

A worker keeps the tokenizer it loaded (keyed by path and sha256), so the tokenizer
loads once per worker process, not once per task.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from lmforge.errors import InputError
from lmforge.io import atomic_path
from lmforge.tokenizer import Tokenizer
from lmforge.tokenizer.corpus import check_strings, open_columns

# A task's text (~9 s of encoding on one core): a task writes two piece files, so at a
# terabyte ~15,000 tasks and ~30,000 files (1 MiB made ~1.9 million, the most files of
# any stage), enough waves for 512 cores. Measured, as the planner sees it, in
# uncompressed bytes of the text column (UTF-8 plus a 4-byte length per document):
# characters for ASCII text, fewer for CJK. A smaller split is cut finer, so that every
# worker gets TASKS_PER_WORKER tasks (the fast ones make up for the slow at the end).
CHUNK_CHARS = 1 << 26
TASKS_PER_WORKER = 8
# The smallest task the planner makes when it cuts finer to give every worker work.
MIN_CHUNK_CHARS = 1 << 16
# A task encodes its rows in batches of about this much text: the tokenizer's Python
# lists of ids (~36 bytes a token) stay ~10 MB whatever the task's size.
ENCODE_BATCH_CHARS = 1 << 20
# Rows per Parquet read batch inside a task.
READ_ROWS = 128


@dataclass(frozen=True)
class RowsTask:
    """Rows ``[lo, hi)`` of one part, and how to encode them."""

    path: str  # the Parquet part
    lo: int
    hi: int
    model: str  # the tokenizer's defining file (tokenizer.model or tokenizer.json)
    model_sha256: str  # its digest: a worker's cached model is used only if it matches
    add_bos: bool
    add_eos: bool
    dtype: str  # numpy dtype of the token ids (uint16 / uint32)
    domains: tuple[str, ...]  # domain names; a document's code is its domain's position


@dataclass
class EncodedChunk:
    """The documents of one task as token ids back to back, with their index fields."""

    tokens: np.ndarray  # the shard dtype (uint16 / uint32)
    lengths: np.ndarray  # int64 tokens per document
    nbytes: np.ndarray  # uint64 UTF-8 bytes per document
    domains: np.ndarray  # uint16 domain code per document


# ----------------------------------------------------------------------- planning


def text_bytes_per_group(path: str | Path) -> list[tuple[int, int]]:
    """(rows, uncompressed bytes of the text column) per row group, from the metadata."""
    pf = open_columns(Path(path), ["text", "domain"])
    md = pf.metadata
    col = pf.schema_arrow.names.index("text")
    return [(md.row_group(g).num_rows, md.row_group(g).column(col).total_uncompressed_size)
            for g in range(md.num_row_groups)]


def cut_rows(groups: list[tuple[int, int]], chunk_chars: int) -> list[tuple[int, int]]:
    """Row ranges ``[lo, hi)`` covering every row once, in order, of about ``chunk_chars``
    text bytes each (as estimated per row group: its text bytes over its rows), balanced:
    ``ceil(total / chunk_chars)`` ranges cut at equal shares of the estimated bytes (fewer
    where two cuts fall on the same row)."""
    rows = np.array([0] + [r for r, _ in groups], dtype=np.int64).cumsum()
    size = np.array([0] + [b for _, b in groups], dtype=np.float64).cumsum()
    n_rows, total = int(rows[-1]), float(size[-1])
    if n_rows == 0:
        return []
    k = min(n_rows, max(1, math.ceil(total / max(chunk_chars, 1))))
    # Row at each cut: interpolate within the row group holding that byte (its rows taken
    # as equal); a group with no text bytes is never cut, its rows go before the cut.
    at_bytes = np.arange(1, k) * total / k
    g = np.searchsorted(size, at_bytes, side="right") - 1  # size[g] <= x < size[g + 1]
    at = rows[g] + (at_bytes - size[g]) / (size[g + 1] - size[g]) * (rows[g + 1] - rows[g])
    cuts = sorted({int(c) for c in np.rint(at)} - {0, n_rows})
    bounds = [0, *cuts, n_rows]
    return list(itertools.pairwise(bounds))


def split_chunk_chars(total_bytes: int, workers: int) -> int:
    """Task size for a split of ``total_bytes``: ``CHUNK_CHARS``, or smaller (down to
    ``MIN_CHUNK_CHARS``) so that a small split still gives every worker
    ``TASKS_PER_WORKER`` tasks."""
    return int(min(CHUNK_CHARS, max(MIN_CHUNK_CHARS,
                                    total_bytes // max(TASKS_PER_WORKER * workers, 1))))


def plan_tasks(parts: list[Path], model: str | Path, model_sha256: str, add_bos: bool,
               add_eos: bool, dtype: np.dtype | str, domains: list[str],
               workers: int = 1, chunk_chars: int | None = None) -> list[RowsTask]:
    """The tasks that encode ``parts`` (in order), cut from the Parquet metadata alone;
    ``chunk_chars`` defaults to :func:`split_chunk_chars` for ``workers``."""
    groups = {p: text_bytes_per_group(p) for p in parts}
    if chunk_chars is None:
        total = sum(b for g in groups.values() for _, b in g)
        chunk_chars = split_chunk_chars(total, workers)
    dtype_str = np.dtype(dtype).str
    return [RowsTask(str(p), lo, hi, str(model), model_sha256, add_bos, add_eos,
                     dtype_str, tuple(domains))
            for p in parts for lo, hi in cut_rows(groups[p], chunk_chars)]


# ----------------------------------------------------------------------- encoding


# This process's loaded tokenizers, by (path, sha256): one load per worker, not per task.
_MODELS: dict[tuple[str, str], Tokenizer] = {}
_MAX_MODELS = 2


def load_model(path: str, sha256: str) -> Tokenizer:
    """The tokenizer at ``path`` (either backend), loaded once per process and content."""
    key = (path, sha256)
    tok = _MODELS.get(key)
    if tok is not None:
        return tok
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise InputError(f"{path}: cannot read tokenizer model ({e.strerror})") from None
    found = hashlib.sha256(data).hexdigest()
    if found != sha256:
        raise InputError(f"{path}: tokenizer model changed during the run (sha256 {found[:12]}, "
                         f"planned with {sha256[:12]})")
    tok = Tokenizer.from_bytes(Path(path), data)
    if len(_MODELS) >= _MAX_MODELS:
        _MODELS.clear()
    _MODELS[key] = tok
    return tok


COLUMNS = ["text", "domain"]


class _PartReader:
    """One part read front to back, kept between a worker's tasks.

    Parquet cannot seek to a row inside a row group: reaching row ``lo`` means
    decompressing and decoding every page before it. A worker usually gets the part's
    tasks in increasing order (the pool hands them out in order), so it continues from
    where its last task stopped instead of starting over: each worker reads a part
    about once, not once per task. A task before that point opens the part afresh.
    """

    def __init__(self, path: Path, key: tuple) -> None:
        self.path = path
        self.key = key
        self.pf = open_columns(path, COLUMNS)
        self.num_rows = self.pf.metadata.num_rows
        self._batches = self.pf.iter_batches(batch_size=READ_ROWS, columns=COLUMNS,
                                             use_threads=False)
        self._batch: pa.RecordBatch | None = None  # the batch read last
        self.start = 0  # its first row: rows from here on can still be taken

    def take(self, lo: int, hi: int) -> pa.Table:
        """Rows ``[lo, hi)``, ``lo >= self.start``."""
        out = []
        row = lo
        while row < hi:
            if self._batch is None or row >= self.start + self._batch.num_rows:
                if self._batch is not None:
                    self.start += self._batch.num_rows
                self._batch = next(self._batches, None)
                if self._batch is None:
                    raise InputError(f"{self.path}: rows {lo}-{hi} planned, the part has "
                                     f"{self.start} (changed during the run?)")
                continue
            n = min(hi, self.start + self._batch.num_rows) - row
            out.append(self._batch.slice(row - self.start, n))
            row += n
        return pa.Table.from_batches(out)


# This process's open part, continued by its next task on the same part.
_reader: _PartReader | None = None


def read_rows(path: str | Path, lo: int, hi: int) -> tuple[pa.Array, pa.Array]:
    """The text and domain columns of rows ``[lo, hi)`` of one part; a null or
    non-string cell is an InputError naming the file and the row."""
    global _reader
    path = Path(path)
    try:
        st = path.stat()
    except OSError as e:
        raise InputError(f"{path}: unreadable Parquet part ({e.strerror})") from None
    # The same file, unchanged (same place, inode, size and modification time), opened
    # by this process: a reader inherited through fork is not this process's to use.
    key = (os.getpid(), os.path.abspath(path), st.st_ino, st.st_size, st.st_mtime_ns)
    reader, _reader = _reader, None  # dropped if this read fails
    if reader is None or reader.key != key or lo < reader.start:
        reader = _PartReader(path, key)
    try:
        table = reader.take(lo, hi)
    except (pa.ArrowInvalid, OSError) as e:
        raise InputError(f"{path}: row {reader.start}: unreadable "
                         f"({str(e).splitlines()[0]})") from None
    if hi < reader.num_rows:  # more rows to come: keep the reader for the next task
        _reader = reader
    cols = []
    for name in COLUMNS:
        col = table.column(name).combine_chunks()
        check_strings(path, lo, name, col)
        cols.append(col)
    return cols[0], cols[1]


def _ints(arr: pa.Array) -> np.ndarray:
    """A null-free Arrow integer array as numpy, zero-copy. (``Array.to_numpy`` and
    ``pa.array`` import pandas: half a second of CPU in every fresh worker process.)"""
    t = arr.type
    dtype = np.dtype(f"{'i' if pa.types.is_signed_integer(t) else 'u'}{t.bit_width // 8}")
    if len(arr) == 0:
        return np.zeros(0, dtype)
    return np.frombuffer(arr.buffers()[1], dtype=dtype, count=len(arr),
                         offset=arr.offset * dtype.itemsize)


def encode_rows(task: RowsTask) -> EncodedChunk:
    """Read and encode one task's rows (runs on a worker)."""
    text, domain = read_rows(task.path, task.lo, task.hi)
    # Domain codes: each distinct name once through Python, then a table lookup.
    enc = domain.dictionary_encode()
    code = {name: i for i, name in enumerate(task.domains)}
    lut = np.array([code.get(name, -1) for name in enc.dictionary.to_pylist()], np.int64)
    codes = lut[_ints(enc.indices)] if len(lut) else np.zeros(0, np.int64)
    if len(codes) and codes.min() < 0:
        i = int(np.argmax(codes < 0))
        raise InputError(f"{task.path}: row {task.lo + i}: domain {domain[i].as_py()!r} was "
                         "not in the part when the run began (changed during the run?)")
    tok = load_model(task.model, task.model_sha256)
    nbytes = _ints(pc.binary_length(text)).astype(np.uint64)
    tokens, lengths = [], []
    for lo, hi in encode_batches(nbytes, ENCODE_BATCH_CHARS):
        ids, n = tok.encode_arrays(text.slice(lo, hi - lo).to_pylist(), task.add_bos,
                                   task.add_eos, np.dtype(task.dtype))
        tokens.append(ids)
        lengths.append(n)
    return EncodedChunk(np.concatenate(tokens), np.concatenate(lengths), nbytes,
                        codes.astype(np.uint16))


def encode_batches(nbytes: np.ndarray, limit: int) -> list[tuple[int, int]]:
    """Row ranges ``[lo, hi)`` covering every row once, in order, a new one starting at
    each row that takes the running text bytes past a multiple of ``limit`` (so a batch
    holds less than ``limit`` besides its first row); one empty range for no rows."""
    k = np.cumsum(nbytes, dtype=np.int64) // max(limit, 1)
    bounds = [0, *(np.flatnonzero(np.diff(k)) + 1).tolist(), len(nbytes)]
    return list(itertools.pairwise(bounds)) if len(nbytes) else [(0, 0)]


# ----------------------------------------------------------------------- pieces


@dataclass(frozen=True)
class PieceTask:
    """Encode ``rows`` into the piece files ``out``.tok (the token ids back to back) and
    ``out``.npz (per document: tokens, UTF-8 bytes, domain code)."""

    rows: RowsTask
    out: str


def encode_piece(task: PieceTask) -> np.ndarray:
    """Encode one task's rows into its piece files; return the documents' token counts,
    all the driver needs to plan the shards (runs on a worker)."""
    enc = encode_rows(task.rows)
    with atomic_path(task.out + ".tok") as tmp:
        enc.tokens.tofile(tmp)
    with atomic_path(task.out + ".npz") as tmp, open(tmp, "wb") as f:
        np.savez(f, lengths=enc.lengths, nbytes=enc.nbytes, domains=enc.domains)
    return enc.lengths


def read_piece(out: str, dtype: str, start: int, stop: int, first: int,
               end: int) -> EncodedChunk:
    """Documents ``[start, stop)`` of a piece, whose tokens are ``[first, end)``."""
    with np.load(out + ".npz") as doc:
        lengths, nbytes, domains = (doc[k][start:stop] for k in ("lengths", "nbytes", "domains"))
    dt = np.dtype(dtype)
    tokens = np.fromfile(out + ".tok", dt, count=end - first, offset=first * dt.itemsize)
    return EncodedChunk(tokens, lengths, nbytes, domains)
