"""A document as the filter rules see it: lines, paragraphs and words, each computed once.

Words are whitespace-separated tokens, as the Gopher paper counts them, except that
every CJK character (hanzi, kana, hangul) is a word of its own, carrying the
punctuation that follows it: Chinese has no spaces between words, so a character is
the unit that makes word counts, ratios and n-gram repetition mean the same thing.
"""

from __future__ import annotations

import re
from functools import cached_property

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

CJK_RANGES = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff"
_CJK = re.compile(f"[{CJK_RANGES}]")
_CJK_WORD = re.compile(rf"[{CJK_RANGES}][^\w\s]*|[^\s{CJK_RANGES}]+")
_NO_LETTER_WORD = re.compile(r"(?<!\S)(?:[^\w\s]|[\d_])+(?!\S)")
_DIGIT = re.compile(r"[\d_]")
_PARAGRAPH_BREAK = re.compile(r"\n\s*\n")
CJK_MAJORITY = 0.3  # above this share of CJK characters a text is treated as CJK


class TextView:
    """Lazily computed views of one document's text, shared by all rules."""

    def __init__(self, text: str):
        self.text = text
        self.cache: dict[str, float] = {}  # measurements one rule can reuse from another

    @cached_property
    def lines(self) -> list[str]:
        """Stripped non-empty lines."""
        return [s for s in (ln.strip() for ln in self.text.splitlines()) if s]

    @cached_property
    def paragraphs(self) -> list[str]:
        """Stripped non-empty blank-line-separated blocks."""
        return [s for s in (p.strip() for p in _PARAGRAPH_BREAK.split(self.text)) if s]

    @cached_property
    def cjk_chars(self) -> int:
        """Number of CJK characters (0 without a scan for ASCII text)."""
        return 0 if self.text.isascii() else len(_CJK.findall(self.text))

    @cached_property
    def nonspace_chars(self) -> int:
        return len("".join(self.text.split()))

    @cached_property
    def is_cjk(self) -> bool:
        """Mostly CJK: word lengths mean nothing here."""
        return self.nonspace_chars > 0 and self.cjk_chars / self.nonspace_chars > CJK_MAJORITY

    @cached_property
    def words(self) -> list[str]:
        """Whitespace tokens; a CJK character (with its trailing punctuation) is one token."""
        return _CJK_WORD.findall(self.text) if self.cjk_chars else self.text.split()

    @cached_property
    def word_array(self) -> pa.Array:
        """The words as an Arrow array, for vectorised (RE2, hashing) passes over them."""
        return pa.array(self.words, type=pa.string())

    @cached_property
    def no_letter_tokens(self) -> list[str]:
        """Tokens with no letter (CJK characters are letters): symbols and numbers."""
        return _NO_LETTER_WORD.findall(self.text)

    @cached_property
    def symbol_words(self) -> int:
        """Tokens with no letter or digit ('—', '...', '*')."""
        return sum(not _DIGIT.search(t) for t in self.no_letter_tokens)

    @cached_property
    def word_ids(self) -> np.ndarray:
        """Each word as a dense integer id (equal words, equal ids), via Arrow's hashing."""
        if not self.words:
            return np.zeros(0, dtype=np.uint64)
        return pc.dictionary_encode(self.word_array).indices.to_numpy().astype(np.uint64)

    @cached_property
    def word_chars(self) -> np.ndarray:
        """Length in characters of each word."""
        return np.fromiter(map(len, self.words), dtype=np.int64, count=len(self.words))

