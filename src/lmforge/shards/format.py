"""Binary token shard format: ``shard-NNNNN.bin`` + ``shard-NNNNN.idx`` + ``manifest.json``.

``.bin``: a 128-byte little-endian header, then the token ids of every document back to
back (uint16 when the vocabulary fits, uint32 otherwise)::

    0   8s   magic b"LMFSHARD"
    8   u32  format version
    12  u32  dtype code (1 = uint16, 2 = uint32)
    16  u64  token count
    24  u64  document count
    32  u64  vocab size
    40  32s  sha256 of the tokenizer model file (raw digest)
    72  ...  zero padding up to 128 (room for later fields without a new layout)

``.idx``: a 32-byte header (magic b"LMFSIDX\\0", u32 version, u32 zero, u64 document
count, u64 token count) then three per-document arrays: end offset in tokens (u64,
cumulative within the shard), UTF-8 byte length of the document's text (u64), domain
code (u16). The end offsets let a loader find document boundaries; the byte lengths and
domains let the evaluator turn a loss into bits per byte per domain.

Every check that fails raises :class:`InputError` with one line naming the file.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lmforge.errors import InputError

FORMAT_VERSION = 1
MAGIC = b"LMFSHARD"
IDX_MAGIC = b"LMFSIDX\x00"
HEADER_SIZE = 128
IDX_HEADER_SIZE = 32
MANIFEST = "manifest.json"

_HEADER = struct.Struct("<8sIIQQQ32s")
_IDX_HEADER = struct.Struct("<8sIIQQ")
DTYPE_CODES: dict[int, np.dtype] = {1: np.dtype("<u2"), 2: np.dtype("<u4")}
_CODE_OF = {dt.name: code for code, dt in DTYPE_CODES.items()}
# Per-document bytes in .idx: end (u64) + text bytes (u64) + domain (u16).
_IDX_DOC_BYTES = 8 + 8 + 2


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest token dtype that holds every id below ``vocab_size``."""
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


def dtype_code(dtype: np.dtype) -> int:
    """The header code of a token dtype."""
    return _CODE_OF[np.dtype(dtype).name]


@dataclass(frozen=True)
class ShardHeader:
    """The fixed header of a ``.bin`` file."""

    version: int
    dtype: np.dtype
    num_tokens: int
    num_docs: int
    vocab_size: int
    tokenizer_sha256: str

    def pack(self) -> bytes:
        """The header as exactly HEADER_SIZE bytes."""
        raw = _HEADER.pack(MAGIC, self.version, dtype_code(self.dtype), self.num_tokens,
                           self.num_docs, self.vocab_size, bytes.fromhex(self.tokenizer_sha256))
        return raw.ljust(HEADER_SIZE, b"\0")


@dataclass(frozen=True)
class DocIndex:
    """Per-document arrays of one shard (see the module docstring)."""

    ends: np.ndarray  # uint64, cumulative token end offset within the shard
    nbytes: np.ndarray  # uint64, UTF-8 bytes of the document text
    domains: np.ndarray  # uint16 domain code

    def pack(self, num_tokens: int) -> bytes:
        """The whole ``.idx`` file content."""
        n = len(self.ends)
        head = _IDX_HEADER.pack(IDX_MAGIC, FORMAT_VERSION, 0, n, num_tokens)
        return b"".join([
            head,
            np.ascontiguousarray(self.ends, dtype="<u8").tobytes(),
            np.ascontiguousarray(self.nbytes, dtype="<u8").tobytes(),
            np.ascontiguousarray(self.domains, dtype="<u2").tobytes(),
        ])


def file_sha256(path: str | Path, chunk: int = 8 << 20) -> str:
    """Hex sha256 of a file, read in chunks so memory stays flat."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def read_header(path: str | Path) -> ShardHeader:
    """Read and check a ``.bin`` header: magic, version, dtype code, size vs file size."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(HEADER_SIZE)
    except OSError as e:
        raise InputError(f"{path}: cannot read shard ({e.strerror})") from None
    if len(raw) < HEADER_SIZE:
        raise InputError(f"{path}: truncated shard header ({len(raw)} of {HEADER_SIZE} bytes)")
    magic, version, code, ntok, ndocs, vocab, sha = _HEADER.unpack_from(raw)
    if magic != MAGIC:
        raise InputError(f"{path}: not an lmforge shard (magic {magic!r}, expected {MAGIC!r})")
    if version != FORMAT_VERSION:
        raise InputError(f"{path}: shard format version {version}; this lmforge reads "
                         f"version {FORMAT_VERSION}")
    if code not in DTYPE_CODES:
        raise InputError(f"{path}: unknown token dtype code {code}")
    dtype = DTYPE_CODES[code]
    expected = HEADER_SIZE + ntok * dtype.itemsize
    if size != expected:
        raise InputError(f"{path}: file is {size} bytes but its header declares {ntok} "
                         f"{dtype.name} tokens ({expected} bytes); truncated or corrupt")
    if vocab > np.iinfo(dtype).max + 1:
        raise InputError(f"{path}: vocab size {vocab} does not fit dtype {dtype.name}")
    return ShardHeader(version, dtype, ntok, ndocs, vocab, sha.hex())


def open_tokens(path: str | Path, header: ShardHeader) -> np.ndarray:
    """Memory-map the token array of a checked shard (read-only)."""
    if header.num_tokens == 0:
        return np.zeros(0, dtype=header.dtype)
    return np.memmap(path, dtype=header.dtype, mode="r", offset=HEADER_SIZE,
                     shape=(header.num_tokens,))


def read_index(path: str | Path, num_docs: int, num_tokens: int, num_domains: int) -> DocIndex:
    """Read and check a ``.idx`` file against its shard's document and token counts."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise InputError(f"{path}: cannot read shard index ({e.strerror})") from None
    if len(raw) < IDX_HEADER_SIZE:
        raise InputError(f"{path}: truncated index header ({len(raw)} bytes)")
    magic, version, _, n, ntok = _IDX_HEADER.unpack_from(raw)
    if magic != IDX_MAGIC:
        raise InputError(f"{path}: not an lmforge shard index (magic {magic!r})")
    if version != FORMAT_VERSION:
        raise InputError(f"{path}: index format version {version}, expected {FORMAT_VERSION}")
    if n != num_docs or ntok != num_tokens:
        raise InputError(f"{path}: index describes {n} documents / {ntok} tokens but the "
                         f"shard holds {num_docs} / {num_tokens}")
    expected = IDX_HEADER_SIZE + n * _IDX_DOC_BYTES
    if len(raw) != expected:
        raise InputError(f"{path}: file is {len(raw)} bytes, expected {expected} for {n} "
                         "documents; truncated or corrupt")
    off = IDX_HEADER_SIZE
    ends = np.frombuffer(raw, dtype="<u8", count=n, offset=off)
    nbytes = np.frombuffer(raw, dtype="<u8", count=n, offset=off + 8 * n)
    domains = np.frombuffer(raw, dtype="<u2", count=n, offset=off + 16 * n)
    if n and (ends[-1] != num_tokens or np.any(np.diff(ends.astype(np.int64)) < 0)):
        raise InputError(f"{path}: document end offsets are not increasing up to "
                         f"{num_tokens}")
    if n and int(domains.max()) >= num_domains:
        raise InputError(f"{path}: domain code {int(domains.max())} is not in the manifest "
                         f"({num_domains} domains)")
    return DocIndex(ends, nbytes, domains)


def read_manifest(shard_dir: str | Path) -> dict[str, Any]:
    """Load ``manifest.json`` of a shards directory and check its shape."""
    path = Path(shard_dir) / MANIFEST
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(f"{path}: no shard manifest (run the shards stage)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(f"{path}: unreadable manifest ({e})") from None
    for key in ("format_version", "dtype", "vocab_size", "tokenizer_sha256", "domains",
                "shards"):
        if key not in manifest:
            raise InputError(f"{path}: manifest lacks '{key}'")
    if manifest["format_version"] != FORMAT_VERSION:
        raise InputError(f"{path}: manifest format version {manifest['format_version']}, "
                         f"expected {FORMAT_VERSION}")
    return manifest


def check_shard(header: ShardHeader, path: Path, manifest: dict[str, Any],
                entry: dict[str, Any]) -> None:
    """Compare a shard's header with the manifest that lists it."""
    if header.tokenizer_sha256 != manifest["tokenizer_sha256"]:
        raise InputError(f"{path}: tokenized with tokenizer {header.tokenizer_sha256[:12]}… "
                         f"but the manifest names {manifest['tokenizer_sha256'][:12]}…")
    if header.dtype.name != np.dtype(manifest["dtype"]).name:
        raise InputError(f"{path}: dtype {header.dtype.name}, manifest says {manifest['dtype']}")
    if header.vocab_size != manifest["vocab_size"]:
        raise InputError(f"{path}: vocab size {header.vocab_size}, manifest says "
                         f"{manifest['vocab_size']}")
    if header.num_tokens != entry["tokens"] or header.num_docs != entry["docs"]:
        raise InputError(f"{path}: holds {header.num_tokens} tokens / {header.num_docs} docs, "
                         f"manifest says {entry['tokens']} / {entry['docs']}")


def verify_checksums(path: Path, idx_path: Path, entry: dict[str, Any], tokens: np.ndarray,
                     vocab_size: int) -> None:
    """Full read: sha256 of ``.bin`` and ``.idx`` against the manifest, ids below vocab."""
    if file_sha256(path) != entry["sha256"]:
        raise InputError(f"{path}: sha256 does not match the manifest; the shard is corrupt")
    if "idx_sha256" in entry and file_sha256(idx_path) != entry["idx_sha256"]:
        raise InputError(f"{idx_path}: sha256 does not match the manifest; the index is corrupt")
    if len(tokens) and int(tokens.max()) >= vocab_size:
        raise InputError(f"{path}: token id {int(tokens.max())} >= vocab size {vocab_size}")
