"""The Hugging Face backend: a model's own ``tokenizer.json`` (``tokenizers``), used as is.

What the library does, the way our pipeline needs it:

- Text is encoded without the post-processor's specials (``add_special_tokens=False``):
  our code adds BOS/EOS by id, as it does with sentencepiece.
- Special added tokens are never matched inside text (``encode_special_tokens``): a
  message holding ``<|im_end|>`` encodes to the characters, not to the token, as a
  sentencepiece control symbol would. (transformers matches them; both agree on any text
  that holds no special token's string.) Non-special added tokens are matched, as
  transformers matches them: they are part of the vocabulary's text.
- Decoding skips special tokens, as sentencepiece drops control symbols.
- bos/eos/pad come from ``tokenizer_config.json`` beside the file (strings, or
  ``{"content": ...}``), else ``config.json``'s ``*_token_id``; unk from the model.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as RustTokenizer

from lmforge.errors import InputError
from lmforge.parallel import resolve_workers
from lmforge.tokenizer import BYTE, HF_FILE, NORMAL, SPECIAL, Tokenizer

CONFIG_FILE = "tokenizer_config.json"
MODEL_CONFIG = "config.json"
SPECIALS = ("bos", "eos", "pad")
_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")
# Normalizers that put a "▁" before a text (Llama 2 / Mistral tokenizer.json).
_PREFIXING = {"Prepend"}


class HFTokenizer(Tokenizer):
    """A ``tokenizers`` tokenizer loaded from ``tokenizer.json`` bytes; ``tk`` is the library's."""

    backend = "hf"
    file_name = HF_FILE

    def __init__(self, data: bytes, name: str = "<bytes>",
                 special_tokens: dict[str, Any] | None = None) -> None:
        """``special_tokens``: ``{"bos": token or id, ...}`` (from the configs beside it)."""
        try:
            self.spec: dict[str, Any] = json.loads(data)
            self.tk = RustTokenizer.from_str(data.decode("utf-8"))
        except Exception as e:  # JSON, UTF-8 or the library's own parse errors
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise InputError(f"{name}: not a Hugging Face tokenizer.json ({first})") from None
        self.tk.encode_special_tokens = True  # specials are never matched inside text
        self.name = name
        self.sha256: str = hashlib.sha256(data).hexdigest()
        vocab = self.tk.get_vocab(with_added_tokens=True)
        # Added tokens may sit past the model's ids: the id space must hold every one.
        self.vocab_size: int = max(self.tk.get_vocab_size(with_added_tokens=True),
                                   max(vocab.values(), default=-1) + 1)
        self._special = {i for i, t in self.tk.get_added_tokens_decoder().items() if t.special}
        special_tokens = special_tokens or {}
        self.bos_id, self.eos_id, self.pad_id = (self._id_of(special_tokens.get(k), k)
                                                 for k in SPECIALS)
        self.unk_id: int = self._model_unk_id()

    def _id_of(self, value: Any, key: str) -> int:
        """An id from a token string or id; -1 for none or a token the vocabulary lacks."""
        if isinstance(value, bool) or value is None:
            return -1
        if isinstance(value, int):
            return value if 0 <= value < self.vocab_size else -1
        token_id = self.tk.token_to_id(str(value))
        return -1 if token_id is None else token_id

    def _model_unk_id(self) -> int:
        model = self.spec.get("model") or {}
        if isinstance(model.get("unk_id"), int):  # Unigram
            return model["unk_id"]
        unk = model.get("unk_token")
        token_id = self.tk.token_to_id(unk) if isinstance(unk, str) else None
        return -1 if token_id is None else token_id

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        return self._wrap(self.tk.encode(text, add_special_tokens=False).ids, add_bos, add_eos)

    def encode_batch(self, texts: Sequence[str], num_threads: int = 0, add_bos: bool = False,
                     add_eos: bool = False) -> list[list[int]]:
        """Token ids of many texts: the library's ``encode_batch_fast`` (no offsets), on its
        Rust thread pool (``RAYON_NUM_THREADS``, default all cores), or on this thread
        when ``num_threads`` resolves to 1."""
        with _parallelism(resolve_workers(num_threads) > 1):
            encodings = self.tk.encode_batch_fast(list(texts), add_special_tokens=False)
        if not (add_bos and self.bos_id >= 0) and not (add_eos and self.eos_id >= 0):
            return [e.ids for e in encodings]
        return [self._wrap(e.ids, add_bos, add_eos) for e in encodings]

    def _wrap(self, ids: list[int], add_bos: bool, add_eos: bool) -> list[int]:
        # As sentencepiece: a BOS/EOS the tokenizer lacks is not added.
        if add_bos and self.bos_id >= 0:
            ids = [self.bos_id, *ids]
        if add_eos and self.eos_id >= 0:
            ids.append(self.eos_id)
        return ids

    def encode_markup(self, text: str) -> list[int]:
        """Ids of text in which special tokens' strings ARE those tokens: a chat
        template's rendering, encoded as transformers' ``apply_chat_template`` does. Only
        for text our code wrote around checked contents (``finetune.model_template``)."""
        self.tk.encode_special_tokens = False
        try:
            return self.tk.encode(text, add_special_tokens=False).ids
        finally:
            self.tk.encode_special_tokens = True

    def special_texts(self) -> frozenset[str]:
        """The strings of the special added tokens (``<|im_end|>``, ...)."""
        decoder = self.tk.get_added_tokens_decoder()
        return frozenset(decoder[i].content for i in self._special)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tk.decode(list(ids), skip_special_tokens=True)

    def decode_batch(self, batch: Sequence[Sequence[int]], num_threads: int = 0) -> list[str]:
        with _parallelism(resolve_workers(num_threads) > 1):
            return self.tk.decode_batch([list(ids) for ids in batch], skip_special_tokens=True)

    def piece(self, token_id: int) -> str:
        piece = self.tk.id_to_token(token_id)
        return "" if piece is None else piece

    def token_to_id(self, token: str) -> int | None:
        return self.tk.token_to_id(token)

    def kind(self, token_id: int) -> str:
        if token_id in self._special or token_id == self.unk_id:
            return SPECIAL
        if self.byte_fallback and _BYTE_PIECE.fullmatch(self.piece(token_id)):
            return BYTE
        return NORMAL

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special

    @property
    def byte_fallback(self) -> bool:
        """Whether the model falls back to ``<0xNN>`` pieces (Llama 2 / Mistral style);
        byte-level BPE (GPT-2, Llama 3, Qwen) needs none: every byte is in its alphabet."""
        return bool((self.spec.get("model") or {}).get("byte_fallback"))

    @property
    def normalizer(self) -> str | None:
        return describe(self.spec.get("normalizer"))

    @property
    def adds_prefix(self) -> bool:
        norm = self.spec.get("normalizer")
        if _PREFIXING & set(_types(norm)):
            return True
        return any(_prefixes(p) for p in _parts(self.spec.get("pre_tokenizer")))


def describe(component: dict[str, Any] | None) -> str | None:
    """A normalizer by name: ``"NFC"``, ``"Sequence[Prepend, Replace]"``; None for none."""
    if not component:
        return None
    if component.get("type") == "Sequence":
        inner = [describe(c) for c in component.get("normalizers") or []]
        return f"Sequence[{', '.join(x for x in inner if x)}]"
    return str(component.get("type"))


def _types(component: dict[str, Any] | None) -> list[str]:
    return [str(c.get("type")) for c in _parts(component)]


def _parts(component: dict[str, Any] | None) -> list[dict[str, Any]]:
    """A normalizer or pre-tokenizer flattened: the members of a Sequence, else itself."""
    if not component:
        return []
    if component.get("type") == "Sequence":
        members = component.get("normalizers") or component.get("pretokenizers") or []
        return [p for m in members for p in _parts(m)]
    return [component]


def _prefixes(pre: dict[str, Any]) -> bool:
    """Whether a pre-tokenizer puts a space before a text's first word."""
    if pre.get("type") == "ByteLevel":
        return bool(pre.get("add_prefix_space"))
    if pre.get("type") == "Metaspace":
        return pre.get("prepend_scheme", "always") != "never" and pre.get(
            "add_prefix_space", True)
    return False


def read_special_tokens(folder: Path) -> dict[str, Any]:
    """``{"bos": token or id, ...}``: tokenizer_config.json's tokens, else config.json's ids."""
    config = _read_json(folder / CONFIG_FILE)
    model = _read_json(folder / MODEL_CONFIG)
    out: dict[str, Any] = {}
    for key in SPECIALS:
        token = config.get(f"{key}_token")
        if isinstance(token, dict):  # {"content": "<s>", "lstrip": false, ...}
            token = token.get("content")
        if token is None:
            token = model.get(f"{key}_token_id")
            if isinstance(token, list):  # Llama 3 lists several EOS ids: the first
                token = token[0] if token else None
        out[key] = token
    return out


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object file beside the tokenizer; {} when absent; bad JSON names the file."""
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(f"{path}: unreadable JSON ({e})") from None
    return value if isinstance(value, dict) else {}


@contextlib.contextmanager
def _parallelism(on: bool) -> Iterator[None]:
    """Off for one call, when asked (the library reads ``TOKENIZERS_PARALLELISM`` at each
    call); on leaves the user's setting, or the library's default (parallel)."""
    key = "TOKENIZERS_PARALLELISM"
    if on:
        yield
        return
    old = os.environ.get(key)
    os.environ[key] = "false"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = old
