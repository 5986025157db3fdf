"""Encode documents to flat token arrays on all cores, in input order.

sentencepiece's batched encode holds the GIL while it turns ids into Python lists, and the
shards stage also reads Parquet, flattens and writes; on threads all of that is serial.
Here each worker *process* encodes a chunk of about ``CHUNK_CHARS`` characters with one
sentencepiece thread and sends back a compact numpy array, so encoding, list conversion
and flattening all run in parallel while the main process only reads and writes. Chunks
are small enough to balance uneven documents and few enough in flight to keep memory
flat; results come back in input order, so the output does not depend on the worker count.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import sentencepiece as spm

from lmforge.parallel import resolve_workers
from lmforge.shards.format import token_dtype
from lmforge.tokenizer import Tokenizer
from lmforge.tokenizer.corpus import iter_text_batches

# ~0.2 s of encoding on one core: enough to hide the hand-off cost, small enough that
# a few chunks per worker keep every core busy to the end.
CHUNK_CHARS = 1 << 20
# Rows read per Parquet batch; chunks are built from whole batches.
READ_ROWS = 64
# Chunks in flight per worker: one encoding, one queued, one being collected.
IN_FLIGHT_PER_WORKER = 3


@dataclass
class TextChunk:
    """Consecutive documents to encode, with what the shard index needs of them."""

    texts: list[str]
    nbytes: np.ndarray  # uint64 UTF-8 bytes per document
    domains: np.ndarray  # uint16 domain code per document


@dataclass
class EncodedChunk:
    """The documents of a :class:`TextChunk` as token ids back to back."""

    tokens: np.ndarray  # the shard dtype (uint16 / uint32)
    lengths: np.ndarray  # int64 tokens per document
    nbytes: np.ndarray
    domains: np.ndarray


def iter_chunks(parts: Iterable[Path], domain_codes: dict[str, int],
                chunk_chars: int = CHUNK_CHARS) -> Iterator[TextChunk]:
    """Documents of ``parts`` in order, grouped into chunks of about ``chunk_chars``."""
    texts: list[str] = []
    nbytes: list[np.ndarray] = []
    domains: list[int] = []
    chars = 0
    for path in parts:
        for batch in iter_text_batches(path, batch_rows=READ_ROWS):
            texts += batch.texts
            nbytes.append(batch.text_bytes.to_numpy(zero_copy_only=False))
            domains += [domain_codes[d] for d in batch.domains]
            chars += sum(map(len, batch.texts))
            if chars >= chunk_chars:
                yield TextChunk(texts, np.concatenate(nbytes).astype(np.uint64),
                                np.array(domains, dtype=np.uint16))
                texts, nbytes, domains, chars = [], [], [], 0
    if texts:
        yield TextChunk(texts, np.concatenate(nbytes).astype(np.uint64),
                        np.array(domains, dtype=np.uint16))


def encode_texts(sp: spm.SentencePieceProcessor, texts: list[str], add_bos: bool,
                 add_eos: bool, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """Flat ids (``dtype``) and per-document lengths of ``texts``, on one thread."""
    # num_threads=1: left unset, sentencepiece uses every core for each batch.
    kw = dict(add_bos=add_bos, add_eos=add_eos, num_threads=1)
    try:
        # sentencepiece >= 0.2.1 hands back int32 buffers: no Python int per token.
        arrays = sp.encode(texts, return_type="numpy", **kw)
    except TypeError:
        ids = sp.encode(texts, **kw)
        lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int64,
                           count=int(lengths.sum()))
        return flat.astype(dtype), lengths
    lengths = np.fromiter(map(len, arrays), dtype=np.int64, count=len(arrays))
    if not arrays:
        return np.zeros(0, dtype), lengths
    # Ids are below vocab_size, which the dtype was chosen to hold: the cast is exact.
    return np.concatenate(arrays).astype(dtype), lengths


_worker_sp: spm.SentencePieceProcessor | None = None


def _init_worker(model: bytes) -> None:
    global _worker_sp
    _worker_sp = spm.SentencePieceProcessor()
    _worker_sp.LoadFromSerializedProto(model)


def _encode_in_worker(texts: list[str], add_bos: bool, add_eos: bool,
                      dtype: str) -> tuple[np.ndarray, np.ndarray]:
    assert _worker_sp is not None, "worker not initialised"
    return encode_texts(_worker_sp, texts, add_bos, add_eos, np.dtype(dtype))


class ChunkEncoder:
    """Encode :class:`TextChunk` s on ``num_workers`` processes (0 = all cores), in order.

    A context manager: the worker processes live until ``__exit__``, so one encoder can
    serve several splits. With one worker it encodes in this process.
    """

    def __init__(self, tok: Tokenizer, num_workers: int = 0, add_bos: bool = False,
                 add_eos: bool = True) -> None:
        self.tok = tok
        self.workers = resolve_workers(num_workers)
        self.add_bos = add_bos
        self.add_eos = add_eos
        self.dtype = token_dtype(tok.vocab_size)
        self._pool: ProcessPoolExecutor | None = None

    def __enter__(self) -> ChunkEncoder:
        if self.workers > 1:
            # fork where there is one, as the rest of lmforge does: a worker is ready in
            # milliseconds (spawn/forkserver re-import numpy and friends for ~0.5 s). The
            # workers only run sentencepiece and numpy, never Arrow, whose threads are
            # the usual fork hazard; enter the encoder before reading Parquet to be sure.
            method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
            self._pool = ProcessPoolExecutor(
                self.workers, mp_context=mp.get_context(method), initializer=_init_worker,
                initargs=(self.tok.sp.serialized_model_proto(),))
            self._pool.submit(int).result()  # start the workers now, not at first use
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def map(self, chunks: Iterable[TextChunk]) -> Iterator[EncodedChunk]:
        """Encoded chunks in the order of ``chunks``; at most a few per worker in flight."""
        if self._pool is None:
            for chunk in chunks:
                tokens, lengths = encode_texts(self.tok.sp, chunk.texts, self.add_bos,
                                               self.add_eos, self.dtype)
                yield EncodedChunk(tokens, lengths, chunk.nbytes, chunk.domains)
            return
        # Only the index arrays wait here; the texts are gone once handed to a worker.
        pending: deque[tuple[Future, np.ndarray, np.ndarray]] = deque()
        limit = IN_FLIGHT_PER_WORKER * self.workers
        for chunk in chunks:
            future = self._pool.submit(_encode_in_worker, chunk.texts, self.add_bos,
                                       self.add_eos, self.dtype.str)
            pending.append((future, chunk.nbytes, chunk.domains))
            if len(pending) >= limit:
                yield _collect(*pending.popleft())
        while pending:
            yield _collect(*pending.popleft())


def _collect(future: Future, nbytes: np.ndarray, domains: np.ndarray) -> EncodedChunk:
    tokens, lengths = future.result()
    return EncodedChunk(tokens, lengths, nbytes, domains)
