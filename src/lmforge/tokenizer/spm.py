"""The sentencepiece backend: a ``tokenizer.model`` (trained by the tokenizer stage)."""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Sequence

import numpy as np
import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2 as model_pb2

from lmforge.errors import InputError
from lmforge.parallel import resolve_workers
from lmforge.tokenizer import BYTE, NORMAL, SP_FILE, SPECIAL, Tokenizer


class SentencePieceTokenizer(Tokenizer):
    """A loaded sentencepiece model; ``sp`` is the processor itself."""

    backend = "sentencepiece"
    file_name = SP_FILE

    def __init__(self, model: bytes, name: str = "<bytes>") -> None:
        self.sp = spm.SentencePieceProcessor()
        try:
            self.sp.LoadFromSerializedProto(model)
        except (RuntimeError, OSError) as e:  # long library text: its first line
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise InputError(f"{name}: not a sentencepiece model ({first})") from None
        self.name = name
        self.model = model
        self.sha256: str = hashlib.sha256(model).hexdigest()
        self.vocab_size: int = self.sp.get_piece_size()
        self.bos_id: int = self.sp.bos_id()
        self.eos_id: int = self.sp.eos_id()
        self.pad_id: int = self.sp.pad_id()
        self.unk_id: int = self.sp.unk_id()
        self._proto: model_pb2.ModelProto | None = None

    @property
    def proto(self) -> model_pb2.ModelProto:
        """The model's protobuf (normaliser and trainer specs)."""
        if self._proto is None:
            self._proto = model_pb2.ModelProto()
            self._proto.ParseFromString(self.model)
        return self._proto

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        return self.sp.encode(text, add_bos=add_bos, add_eos=add_eos)

    def encode_batch(self, texts: Sequence[str], num_threads: int = 0, add_bos: bool = False,
                     add_eos: bool = False) -> list[list[int]]:
        return self.sp.encode(list(texts), add_bos=add_bos, add_eos=add_eos,
                              num_threads=resolve_workers(num_threads))

    def encode_arrays(self, texts: list[str], add_bos: bool, add_eos: bool,
                      dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
        return sp_encode_arrays(self.sp, texts, add_bos, add_eos, dtype)

    def decode(self, ids: Sequence[int]) -> str:
        return self.sp.decode(list(ids))

    def decode_batch(self, batch: Sequence[Sequence[int]], num_threads: int = 0) -> list[str]:
        return self.sp.decode([list(ids) for ids in batch],
                              num_threads=resolve_workers(num_threads))

    def piece(self, token_id: int) -> str:
        return self.sp.id_to_piece(token_id)

    def token_to_id(self, token: str) -> int | None:
        token_id = self.sp.piece_to_id(token)
        # piece_to_id answers unk_id for a piece it lacks.
        return token_id if self.sp.id_to_piece(token_id) == token else None

    def kind(self, token_id: int) -> str:
        sp = self.sp
        if sp.is_byte(token_id):
            return BYTE
        if sp.is_control(token_id) or sp.is_unknown(token_id) or sp.is_unused(token_id):
            return SPECIAL
        return NORMAL

    def is_special(self, token_id: int) -> bool:
        # Only control symbols: an unknown piece is what text encodes to when it must.
        return bool(self.sp.is_control(token_id))

    @property
    def normalizer(self) -> str | None:
        name = self.proto.normalizer_spec.name
        return None if name == "identity" else name

    @property
    def adds_prefix(self) -> bool:
        spec = self.proto.normalizer_spec
        return bool(spec.add_dummy_prefix or spec.remove_extra_whitespaces)

    @property
    def byte_fallback(self) -> bool:
        """Whether characters outside the vocabulary encode as byte pieces."""
        return bool(self.proto.trainer_spec.byte_fallback)


def sp_encode_arrays(sp: spm.SentencePieceProcessor, texts: list[str], add_bos: bool,
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
