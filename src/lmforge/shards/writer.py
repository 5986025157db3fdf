"""Write token shards: documents in, ``shard-NNNNN.{bin,idx}`` + ``manifest.json`` out.

With ``loss_mask=True`` every shard also gets ``shard-NNNNN.mask``: one byte per token,
1 where the token is a training target (an assistant's answer in fine-tuning data), 0
where it is context only (a prompt); the loader turns 0 into an ignored target.

The writer streams: tokens go straight to the open ``.bin``; only the per-document index
of the current shard is held in memory. A document is never split across shards: a shard
holds at most ``shard_tokens`` tokens, except one holding a single longer document. Write into a temporary directory
(``lmforge.io.atomic_dir``) so a killed run leaves no half-written shard set.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from lmforge.errors import InputError
from lmforge.io import write_json
from lmforge.shards.format import (
    FORMAT_VERSION,
    HEADER_SIZE,
    MANIFEST,
    DocIndex,
    ShardHeader,
    file_sha256,
    token_dtype,
)


class ShardCuts:
    """Where documents fall into shards, from their token counts alone: whole documents,
    at most ``shard_tokens`` tokens a shard, a longer document alone in one. The writer
    cuts by it, and so does a planner that has only the counts (the shards stage, whose
    tasks write the shards), so both give the same shard set."""

    def __init__(self, shard_tokens: int) -> None:
        self.shard_tokens = shard_tokens
        self.open = False  # a shard has documents and is not finished
        self.ntok = 0

    def add(self, doc_lengths: np.ndarray) -> Iterator[tuple[int, int, int, int] | None]:
        """For the next documents (their token counts): ``(start, stop, first token, end
        token)`` for each run of them that goes into the open shard, and ``None`` each time
        the open shard is finished."""
        ends = np.cumsum(doc_lengths)
        start = 0
        while start < len(doc_lengths):
            # Whole documents that still fit; an empty shard takes at least one.
            base = int(ends[start - 1]) if start else 0
            stop = int(np.searchsorted(ends, base + self.shard_tokens - self.ntok, "right"))
            if self.ntok == 0:
                stop = max(stop, start + 1)
            if stop == start:  # the next document does not fit: start a new shard
                yield self._finish()
                continue
            end = int(ends[stop - 1])
            self.open, self.ntok = True, self.ntok + end - base
            yield start, stop, base, end
            start = stop
            if self.ntok >= self.shard_tokens:
                yield self._finish()

    def _finish(self) -> None:
        self.open, self.ntok = False, 0


class ShardWriter:
    """Append documents (as one flat token array + per-document lengths) to shards.

    ``first_shard``: the number of the first shard it writes (a task writing shard ``k``
    of a set planned elsewhere)."""

    def __init__(self, out_dir: str | Path, vocab_size: int, tokenizer_sha256: str,
                 domain_names: list[str], shard_tokens: int, loss_mask: bool = False,
                 first_shard: int = 0) -> None:
        self.out_dir = Path(out_dir)
        self.loss_mask = loss_mask
        self._mask_file: BinaryIO | None = None
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.vocab_size = vocab_size
        self.dtype = token_dtype(vocab_size)
        # Ids are checked against this before writing: a wider id must fail, never wrap.
        self._max_id = min(vocab_size - 1, int(np.iinfo(self.dtype).max))
        self.tokenizer_sha256 = tokenizer_sha256
        self.domain_names = list(domain_names)
        self.shard_tokens = shard_tokens
        self.first_shard = first_shard
        self.shards: list[dict[str, Any]] = []
        self.totals = {name: {"docs": 0, "tokens": 0, "bytes": 0} for name in domain_names}
        self._cuts = ShardCuts(shard_tokens)
        self._file: BinaryIO | None = None
        self._ntok = 0
        self._lens: list[np.ndarray] = []
        self._nbytes: list[np.ndarray] = []
        self._domains: list[np.ndarray] = []

    def add(self, tokens: np.ndarray, doc_lengths: np.ndarray, doc_bytes: np.ndarray,
            doc_domains: np.ndarray, mask: np.ndarray | None = None) -> None:
        """Append documents: ``tokens`` is their ids back to back, split by ``doc_lengths``;
        ``mask`` (with ``loss_mask``) is 1 per token that is a training target, else 0."""
        if self.loss_mask != (mask is not None):
            raise ValueError("give a mask exactly when the writer was made with loss_mask")
        if mask is not None:
            mask = np.asarray(mask, dtype=np.uint8)
            if len(mask) != len(tokens) or (len(mask) and int(mask.max()) > 1):
                raise ValueError("mask must hold one 0/1 value per token")
        doc_lengths = np.asarray(doc_lengths, dtype=np.int64)
        doc_bytes = np.asarray(doc_bytes, dtype=np.uint64)
        doc_domains = np.asarray(doc_domains, dtype=np.uint16)
        if len(doc_domains) and int(doc_domains.max()) >= len(self.domain_names):
            raise ValueError(f"domain code {int(doc_domains.max())} has no name")
        if int(doc_lengths.sum()) != len(tokens):
            raise ValueError("doc_lengths do not add up to the token count")
        if len(tokens) and (int(tokens.min()) < 0 or int(tokens.max()) > self._max_id):
            bad = int(tokens.max()) if int(tokens.max()) > self._max_id else int(tokens.min())
            raise InputError(f"token id {bad} outside [0, {self._max_id}] for vocab size "
                             f"{self.vocab_size} ({self.dtype.name}); refusing to truncate")
        for cut in self._cuts.add(doc_lengths):
            if cut is None:
                self._finish()
                continue
            start, stop, base, end = cut
            if self._file is None:
                self._open()
            self._write(tokens[base:end], doc_lengths[start:stop], doc_bytes[start:stop],
                        doc_domains[start:stop], None if mask is None else mask[base:end])

    def flush(self) -> None:
        """Finish the open shard, if any (what :meth:`close` does before the manifest)."""
        if self._file is not None:
            self._finish()

    def adopt(self, entry: dict[str, Any], totals: dict[str, dict[str, int]]) -> None:
        """Count a shard another writer wrote (its manifest entry and per-domain totals)
        as the next of this set."""
        self.shards.append(entry)
        for name, t in totals.items():
            for key, value in t.items():
                self.totals[name][key] += value

    def close(self, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """Finish the last shard and write ``manifest.json`` (plus ``extra`` keys)."""
        self.flush()
        manifest = {
            "format_version": FORMAT_VERSION,
            "dtype": self.dtype.name,
            "vocab_size": self.vocab_size,
            "tokenizer_sha256": self.tokenizer_sha256,
            "domains": {str(code): name for code, name in enumerate(self.domain_names)},
            "shards": self.shards,
            "num_tokens": sum(s["tokens"] for s in self.shards),
            "num_docs": sum(s["docs"] for s in self.shards),
            "totals": self.totals,
            **({"loss_mask": True} if self.loss_mask else {}),
            **(extra or {}),
        }
        write_json(self.out_dir / MANIFEST, manifest)
        return manifest

    # ---------------------------------------------------------------- one shard

    def _open(self) -> None:
        path = self.out_dir / f"shard-{self.first_shard + len(self.shards):05d}.bin"
        self._file = open(path, "wb")  # noqa: SIM115 -- held open across add() calls
        self._file.write(b"\0" * HEADER_SIZE)  # the real header is written on _finish
        if self.loss_mask:
            self._mask_file = open(path.with_suffix(".mask"), "wb")  # noqa: SIM115
        self._ntok = 0

    def _write(self, tokens: np.ndarray, lens: np.ndarray, nbytes: np.ndarray,
               domains: np.ndarray, mask: np.ndarray | None) -> None:
        assert self._file is not None
        self._file.write(np.ascontiguousarray(tokens, dtype=self.dtype).tobytes())
        if mask is not None:
            self._mask_file.write(np.ascontiguousarray(mask, dtype=np.uint8).tobytes())
        self._ntok += len(tokens)
        self._lens.append(lens)
        self._nbytes.append(nbytes)
        self._domains.append(domains)
        for code in np.unique(domains):
            sel = domains == code
            t = self.totals[self.domain_names[int(code)]]
            t["docs"] += int(sel.sum())
            t["tokens"] += int(lens[sel].sum())
            t["bytes"] += int(nbytes[sel].sum())

    def _finish(self) -> None:
        assert self._file is not None
        lens = np.concatenate(self._lens) if self._lens else np.zeros(0, np.int64)
        index = DocIndex(
            ends=np.cumsum(lens).astype(np.uint64),
            nbytes=np.concatenate(self._nbytes) if self._nbytes else np.zeros(0, np.uint64),
            domains=np.concatenate(self._domains) if self._domains else np.zeros(0, np.uint16),
        )
        header = ShardHeader(FORMAT_VERSION, self.dtype, self._ntok, len(lens),
                             self.vocab_size, self.tokenizer_sha256)
        self._file.seek(0)
        self._file.write(header.pack())
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self._file = None
        bin_path = self.out_dir / f"shard-{self.first_shard + len(self.shards):05d}.bin"
        idx_path = bin_path.with_suffix(".idx")
        idx_path.write_bytes(index.pack(self._ntok))
        entry = {
            "file": bin_path.name,
            "index": idx_path.name,
            "tokens": self._ntok,
            "docs": len(lens),
            "bytes": bin_path.stat().st_size,
            "sha256": file_sha256(bin_path),
            "idx_sha256": file_sha256(idx_path),
        }
        if self._mask_file is not None:
            self._mask_file.flush()
            os.fsync(self._mask_file.fileno())
            self._mask_file.close()
            self._mask_file = None
            mask_path = bin_path.with_suffix(".mask")
            entry.update(mask=mask_path.name, mask_sha256=file_sha256(mask_path))
        self.shards.append(entry)
        self._lens, self._nbytes, self._domains = [], [], []
        self._ntok = 0


def write_shards(out_dir: str | Path, docs: list, vocab_size: int,
                 domains: list[int] | None = None, domain_names: list[str] | None = None,
                 doc_bytes: list[int] | None = None, tokenizer_sha256: str = "0" * 64,
                 shard_tokens: int = 1 << 30, masks: list | None = None) -> dict[str, Any]:
    """Write already-tokenized documents (lists of ids) as a shard set; return the manifest.

    A convenience for tests and tools: domains default to 0 (``"domain0"``), byte lengths
    to the token counts; ``masks`` (one 0/1 list per document) writes loss masks.
    """
    lens = np.array([len(d) for d in docs], dtype=np.int64)
    flat = (np.concatenate([np.asarray(d, dtype=np.int64) for d in docs])
            if docs else np.zeros(0, np.int64))
    domains = domains if domains is not None else [0] * len(docs)
    names = domain_names or [f"domain{i}" for i in range(max(domains, default=0) + 1)]
    writer = ShardWriter(out_dir, vocab_size, tokenizer_sha256, names, shard_tokens,
                         loss_mask=masks is not None)
    flat_mask = None
    if masks is not None:
        flat_mask = (np.concatenate([np.asarray(m, dtype=np.uint8) for m in masks])
                     if masks else np.zeros(0, np.uint8))
    writer.add(flat, lens, doc_bytes if doc_bytes is not None else lens, np.asarray(domains),
               flat_mask)
    return writer.close()
