"""The project's tokenizer: one typed interface, two backends.

:class:`Tokenizer` is the type every caller uses. ``Tokenizer.load(path)`` picks the
backend from the file: a sentencepiece ``tokenizer.model`` (trained by the tokenizer
stage) or a Hugging Face ``tokenizer.json`` (a model's own, used as is), or a folder
holding one of them (``tokenizer.json`` first: it is what transformers loads).

Both backends share two rules. Encoding text never produces a special token: a
sentencepiece control symbol, or a Hugging Face special added token (``<|im_end|>``
typed in a message stays text), so callers insert specials by id. Decoding drops special
tokens, as sentencepiece drops control symbols.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from lmforge.errors import InputError
from lmforge.tokenizer.files import HF_FILE, SP_FILE, is_hf_file, locate_tokenizer

__all__ = ["HF_FILE", "SP_FILE", "Tokenizer", "flatten_ids"]

NORMAL, BYTE, SPECIAL = "normal", "byte", "special"  # token kinds (:meth:`Tokenizer.kind`)


class Tokenizer(ABC):
    """A loaded tokenizer; ``sha256`` identifies the exact file that defines it.

    Ids: ``bos_id``, ``eos_id``, ``pad_id``, ``unk_id`` are -1 where the tokenizer has none.
    """

    backend: str  # "sentencepiece" | "hf"
    file_name: str  # the defining file's canonical name: tokenizer.model | tokenizer.json
    name: str  # where it was loaded from, for messages
    sha256: str
    vocab_size: int
    bos_id: int
    eos_id: int
    pad_id: int
    unk_id: int

    @classmethod
    def load(cls, path: str | Path) -> Tokenizer:
        """A ``tokenizer.model``, a ``tokenizer.json``, or a folder holding one of them."""
        file = locate_tokenizer(path)
        try:
            data = file.read_bytes()
        except OSError as e:
            raise InputError(f"{file}: cannot read tokenizer ({e.strerror})") from None
        return cls.from_bytes(file, data)

    @staticmethod
    def from_bytes(file: Path, data: bytes) -> Tokenizer:
        """The tokenizer ``data`` read from ``file`` (whose folder holds its companions)."""
        if is_hf_file(file):
            from lmforge.tokenizer.hf import HFTokenizer, read_special_tokens

            return HFTokenizer(data, str(file), read_special_tokens(file.parent))
        from lmforge.tokenizer.spm import SentencePieceTokenizer

        return SentencePieceTokenizer(data, str(file))

    @abstractmethod
    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """Token ids of one text."""

    @abstractmethod
    def encode_batch(self, texts: Sequence[str], num_threads: int = 0, add_bos: bool = False,
                     add_eos: bool = False) -> list[list[int]]:
        """Token ids of many texts, encoded on ``num_threads`` threads (0 = all cores)."""

    def encode_arrays(self, texts: list[str], add_bos: bool, add_eos: bool,
                      dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
        """Flat ids (``dtype``) and int64 per-text lengths of ``texts``, on one thread."""
        ids = self.encode_batch(texts, num_threads=1, add_bos=add_bos, add_eos=add_eos)
        lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        return flatten_ids(ids, dtype), lengths

    @abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids`` (special tokens dropped); the inverse of ``encode``."""

    @abstractmethod
    def decode_batch(self, batch: Sequence[Sequence[int]], num_threads: int = 0) -> list[str]:
        """Texts of many id lists, decoded on ``num_threads`` threads (0 = all cores)."""

    @abstractmethod
    def piece(self, token_id: int) -> str:
        """The vocabulary piece of ``token_id``."""

    @abstractmethod
    def token_to_id(self, token: str) -> int | None:
        """The id of vocabulary piece ``token``, or None when it is not one."""

    @abstractmethod
    def kind(self, token_id: int) -> str:
        """``"special"`` (never produced by encoding text; control, unknown, added special),
        ``"byte"`` (a byte-fallback piece ``<0xNN>``) or ``"normal"``."""

    def is_special(self, token_id: int) -> bool:
        """Whether ``token_id`` is a token that encoding text never produces."""
        return self.kind(token_id) == SPECIAL

    @property
    @abstractmethod
    def normalizer(self) -> str | None:
        """The normalisation applied to text before encoding, by name; None = text kept."""

    @property
    @abstractmethod
    def adds_prefix(self) -> bool:
        """Whether a text's ids depend on its being encoded alone (a dummy prefix space,
        dropped whitespace): then contents encoded one by one differ from the whole."""

    def special_ids(self) -> dict[str, int]:
        """bos/eos/pad/unk ids (-1 where there is none), as model config.json records them."""
        return {"bos": self.bos_id, "eos": self.eos_id, "pad": self.pad_id, "unk": self.unk_id}


def flatten_ids(ids: Sequence[Sequence[int]], dtype: np.dtype | type = np.int64) -> np.ndarray:
    """Concatenate token id lists (``encode_batch`` output) into one array, in C speed."""
    total = sum(map(len, ids))
    return np.fromiter(itertools.chain.from_iterable(ids), dtype=dtype, count=total)
