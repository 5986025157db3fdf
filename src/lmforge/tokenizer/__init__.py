"""The project's tokenizer: a sentencepiece model behind a small, typed interface."""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import sentencepiece as spm

from lmforge.errors import InputError
from lmforge.parallel import resolve_workers

__all__ = ["Tokenizer", "flatten_ids"]


class Tokenizer:
    """A loaded sentencepiece model; ``sha256`` identifies the exact model file."""

    def __init__(self, model: bytes, name: str = "<bytes>") -> None:
        self.sp = spm.SentencePieceProcessor()
        try:
            self.sp.LoadFromSerializedProto(model)
        except (RuntimeError, OSError) as e:
            raise InputError(f"{name}: not a sentencepiece model ({e})") from None
        self.sha256: str = hashlib.sha256(model).hexdigest()
        self.vocab_size: int = self.sp.get_piece_size()
        self.bos_id: int = self.sp.bos_id()
        self.eos_id: int = self.sp.eos_id()
        self.pad_id: int = self.sp.pad_id()
        self.unk_id: int = self.sp.unk_id()

    @classmethod
    def load(cls, path: str | Path) -> Tokenizer:
        """Load ``tokenizer.model`` (or any sentencepiece model file)."""
        path = Path(path)
        try:
            model = path.read_bytes()
        except OSError as e:
            raise InputError(f"{path}: cannot read tokenizer model ({e.strerror})") from None
        return cls(model, str(path))

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """Token ids of one text."""
        return self.sp.encode(text, add_bos=add_bos, add_eos=add_eos)

    def encode_batch(self, texts: Sequence[str], num_threads: int = 0, add_bos: bool = False,
                     add_eos: bool = False) -> list[list[int]]:
        """Token ids of many texts, encoded on ``num_threads`` threads (0 = all cores)."""
        return self.sp.encode(list(texts), add_bos=add_bos, add_eos=add_eos,
                              num_threads=resolve_workers(num_threads))

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``; exact inverse of ``encode`` for a lossless model."""
        return self.sp.decode(list(ids))

    def decode_batch(self, batch: Sequence[Sequence[int]], num_threads: int = 0) -> list[str]:
        """Texts of many id lists, decoded on ``num_threads`` threads (0 = all cores)."""
        return self.sp.decode([list(ids) for ids in batch],
                              num_threads=resolve_workers(num_threads))

    def piece(self, token_id: int) -> str:
        """The vocabulary piece of ``token_id``."""
        return self.sp.id_to_piece(token_id)


def flatten_ids(ids: Sequence[Sequence[int]], dtype: np.dtype | type = np.int64) -> np.ndarray:
    """Concatenate token id lists (``encode_batch`` output) into one array, in C speed."""
    total = sum(map(len, ids))
    return np.fromiter(itertools.chain.from_iterable(ids), dtype=dtype, count=total)
