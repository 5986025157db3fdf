"""Text normalisation, shingle hashing and MinHash signatures, vectorised in numpy.

Signatures follow ``datasketch.MinHash``'s default scheme (``affine32``) exactly: each
32-bit shingle hash is pre-mixed with the MurmurHash3 finalizer, then permutation k
maps it to ``a_k * h + b_k mod 2^32`` with datasketch's own ``(a, b)`` for the seed.
Only the shingle hash differs from datasketch's default (SHA-1 per shingle, slow in
Python): here it is a polynomial rolling hash over code points computed for a whole
document at once, so ``datasketch.MinHash(hashfunc=lambda h: h)`` fed our shingle
hashes gives the same hash values, and ``LeanMinHash`` / ``MinHashLSH`` take them as is.
"""

from __future__ import annotations

import hashlib
import unicodedata

import numpy as np
from datasketch import MinHash

SCHEME = "affine32"
_MAX32 = np.uint32(0xFFFFFFFF)
# Odd multipliers (so they are invertible mod 2^64): one for characters, one for words.
_P_CHAR = 0x100000001B3
_P_WORD = 0x9E3779B97F4A7C15
_P_CHAR_INV = pow(_P_CHAR, -1, 1 << 64)
_SPACE = 32
# CJK ideographs (+ extension A, compatibility), kana and hangul: scripts written without spaces.
_CJK_BOUNDS = np.array([0x3040, 0x3100, 0x3400, 0x4DC0, 0x4E00, 0xA000, 0xAC00, 0xD7B0,
                        0xF900, 0xFB00, 0x20000, 0x2FA20], dtype=np.uint64)  # [lo, hi) pairs
CJK_CHAR_SHARE = 0.3  # ``shingle: auto`` uses character n-grams above this share


def normalize(text: str) -> str:
    """NFKC, lowercase, whitespace runs collapsed to one space: the dedup view of a text."""
    if not unicodedata.is_normalized("NFKC", text):  # the check is ~100x cheaper
        text = unicodedata.normalize("NFKC", text)
    return " ".join(text.lower().split())


def exact_key(normalized: str) -> bytes:
    """A 128-bit digest of the normalised text (collisions are negligible at any scale)."""
    return hashlib.blake2b(normalized.encode("utf-8"), digest_size=16).digest()


def codepoints(text: str) -> np.ndarray:
    """The text's Unicode code points as uint64 (one C-speed encode, no Python loop)."""
    return np.frombuffer(text.encode("utf-32-le"), dtype="<u4").astype(np.uint64)


def cjk_share(cp: np.ndarray) -> float:
    """Share of non-space characters that are CJK."""
    chars = cp[cp != _SPACE]
    if not len(chars):
        return 0.0
    # Inside a [lo, hi) range exactly when an odd number of bounds are <= the code point.
    inside = np.searchsorted(_CJK_BOUNDS, chars, side="right") & 1
    return float(np.count_nonzero(inside)) / len(chars)


def _rolling(values: np.ndarray, n: int, mult: int) -> np.ndarray:
    """Polynomial hash of every window of ``n`` values (a text shorter than n: one window)."""
    n = min(n, len(values))
    if n == 0:
        return np.zeros(0, dtype=np.uint64)
    m = np.uint64(mult)
    width = len(values) - n + 1
    h = np.zeros(width, dtype=np.uint64)
    with np.errstate(over="ignore"):  # wraparound is the intended mod 2^64
        for i in range(n):
            h = h * m + values[i : i + width]
    return h


def _powers(base: int, n: int) -> np.ndarray:
    """``base ** j mod 2^64`` for j in [0, n)."""
    out = np.ones(n, dtype=np.uint64)
    with np.errstate(over="ignore"):
        out[1:] = np.cumprod(np.full(n - 1, base, dtype=np.uint64), dtype=np.uint64)
    return out


def _word_hashes(cp: np.ndarray) -> np.ndarray:
    """One 64-bit hash per space-separated word of a normalised text, via prefix sums."""
    if not len(cp):
        return np.zeros(0, dtype=np.uint64)
    bounds = np.flatnonzero(cp == _SPACE)
    starts = np.concatenate(([0], bounds + 1))
    ends = np.concatenate((bounds, [len(cp)]))
    with np.errstate(over="ignore"):
        powers = _powers(_P_CHAR, len(cp))
        inv = _powers(_P_CHAR_INV, len(cp))
        prefix = np.concatenate(([np.uint64(0)], np.cumsum(cp * powers, dtype=np.uint64)))
        # sum_{j in word} cp[j] * P^(j - start): the same value wherever the word occurs.
        return (prefix[ends] - prefix[starts]) * inv[starts]


def _fold32(h: np.ndarray) -> np.ndarray:
    return ((h ^ (h >> np.uint64(32))) & np.uint64(0xFFFFFFFF)).astype(np.uint32)


def shingle_hashes(normalized: str, shingle: str, word_ngram: int, char_ngram: int) -> np.ndarray:
    """The distinct 32-bit hashes of a normalised text's shingles.

    ``shingle``: ``word`` n-grams, ``char`` n-grams, or ``auto`` (characters when more
    than ``CJK_CHAR_SHARE`` of the text is CJK, which has no spaces between words).
    """
    cp = codepoints(normalized)
    if shingle == "auto":
        shingle = "char" if cjk_share(cp) > CJK_CHAR_SHARE else "word"
    if shingle == "char":
        h = _rolling(cp, char_ngram, _P_CHAR)
    else:
        h = _rolling(_word_hashes(cp), word_ngram, _P_WORD)
    return np.unique(_fold32(h))


def permutations(num_perm: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """datasketch's own (a, b) permutation parameters for ``num_perm`` and ``seed``."""
    a, b = MinHash(num_perm=num_perm, seed=seed, scheme=SCHEME).permutations
    return a.astype(np.uint32), b.astype(np.uint32)


def _fmix32(h: np.ndarray) -> np.ndarray:
    """MurmurHash3's 32-bit finalizer, as datasketch pre-mixes every input hash."""
    h = h ^ (h >> np.uint32(16))
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> np.uint32(13))
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> np.uint32(16))


def signature(hashes: np.ndarray, a: np.ndarray, b: np.ndarray, chunk: int = 2048) -> np.ndarray:
    """The MinHash signature (uint32[num_perm]) of a set of 32-bit shingle hashes."""
    sig = np.full(len(a), _MAX32, dtype=np.uint32)
    if not len(hashes):
        return sig
    with np.errstate(over="ignore"):
        hv = _fmix32(hashes.astype(np.uint32))
        # Chunks bound the (shingles x num_perm) temporary for very long documents.
        for start in range(0, len(hv), chunk):
            block = hv[start : start + chunk, None] * a + b
            np.minimum(sig, block.min(axis=0), out=sig)
    return sig


def jaccard(sig_a: np.ndarray, sig_b: np.ndarray) -> np.ndarray | float:
    """Estimated Jaccard similarity: the share of equal signature slots (row-wise)."""
    return np.mean(sig_a == sig_b, axis=-1)
