"""Text normalisation, shingle hashing and MinHash signatures, vectorised in numpy.

Speed comes from working on a batch of texts at once: the batch is encoded once, every
shingle of every text is hashed by whole-array arithmetic (a polynomial rolling hash
over code points; no Python call per shingle or per word), and the sketch is made for
all the batch's shingles together. Two sketch schemes:

- ``oph`` (default): one-permutation hashing with optimal densification (Shrivastava,
  ICML 2017). Each shingle's 64-bit hash picks one of ``num_perm`` bins and competes
  for that bin's minimum, so the work per shingle is O(1) instead of O(num_perm); a bin
  no shingle fell into borrows the value of the first filled bin in a fixed pseudo-random
  order of bins, the same for every text, so that equal bins still mean "same minimum
  shingle" with probability J. Slot agreement estimates Jaccard as a MinHash does.
- ``affine32``: ``datasketch.MinHash``'s default scheme, bit for bit: each 32-bit
  shingle hash is pre-mixed with the MurmurHash3 finalizer, then permutation k maps it
  to ``a_k * h + b_k mod 2^32`` with datasketch's own ``(a, b)``, so
  ``MinHash(hashfunc=lambda h: h)`` fed ``shingle_hashes`` gives the same values. For
  sketches that must be comparable with ones datasketch made; O(num_perm) per shingle.

Either way the values are uint32, stored in ``datasketch.LeanMinHash`` under
``LSH_SCHEME`` for ``MinHashLSH``.
"""

from __future__ import annotations

import hashlib
import unicodedata
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from datasketch import MinHash

SCHEMES = ("oph", "affine32")
LSH_SCHEME = "affine32"  # datasketch's uint32 storage, what both schemes produce
_MAX32 = np.uint32(0xFFFFFFFF)
# Odd multipliers (so they are invertible mod 2^64): one for characters, one for words.
_P_CHAR = 0x100000001B3
_P_WORD = 0x9E3779B97F4A7C15
_P_CHAR_INV = pow(_P_CHAR, -1, 1 << 64)
_GOLDEN = 0x9E3779B97F4A7C15  # seeds are spread by it before mixing
_SPACE = 32
# CJK ideographs (+ extension A, compatibility), kana and hangul: scripts written without
# spaces. [lo, hi) pairs, turned into a lookup table over code points below _CJK_END.
_CJK_RANGES = ((0x3040, 0x3100), (0x3400, 0x4DC0), (0x4E00, 0xA000), (0xAC00, 0xD7B0),
               (0xF900, 0xFB00), (0x20000, 0x2FA20))
_CJK_END = 0x2FA20
CJK_CHAR_SHARE = 0.3  # ``shingle: auto`` uses character n-grams above this share
BATCH_CHARS = 1 << 18  # texts hashed together: bounds per-character temporaries (~MBs)
BLOCK_ELEMS = 1 << 21  # affine32: shingles x permutations per block, a few MB


def normalize(text: str) -> str:
    """NFKC, lowercase, whitespace runs collapsed to one space: the dedup view of a text."""
    if not unicodedata.is_normalized("NFKC", text):  # the check is ~100x cheaper
        text = unicodedata.normalize("NFKC", text)
    return " ".join(text.lower().split())


def exact_key(normalized: str) -> bytes:
    """A 128-bit digest of the normalised text (collisions are negligible at any scale)."""
    return hashlib.blake2b(normalized.encode("utf-8"), digest_size=16).digest()


def codepoints(text: str) -> np.ndarray:
    """The text's Unicode code points as uint32 (one C-speed encode, no Python loop)."""
    return np.frombuffer(text.encode("utf-32-le"), dtype="<u4")


@lru_cache(maxsize=1)
def _cjk_table() -> np.ndarray:
    table = np.zeros(_CJK_END + 1, dtype=bool)  # the last entry: everything above
    for lo, hi in _CJK_RANGES:
        table[lo:hi] = True
    return table


def _cjk_positions(cp: np.ndarray) -> np.ndarray:
    """Indices of the CJK characters; only characters from kana up are looked up."""
    high = np.flatnonzero(cp >= _CJK_RANGES[0][0])
    return high[_cjk_table()[np.minimum(cp[high], _CJK_END)]]


def cjk_share(cp: np.ndarray) -> float:
    """Share of non-space characters that are CJK."""
    chars = np.count_nonzero(cp != _SPACE)
    return len(_cjk_positions(cp)) / chars if chars else 0.0


def _ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """``concatenate([arange(s, s + c) for s, c in zip(starts, counts)])`` without a loop."""
    offsets = np.cumsum(counts) - counts
    return np.repeat(starts - offsets, counts) + np.arange(int(counts.sum()), dtype=np.int64)


def _rolling(values: np.ndarray, n: int, mult: int) -> np.ndarray:
    """Polynomial hash of every window of ``n`` values: ``sum v[i+k] * mult^(n-1-k)``."""
    width = len(values) - n + 1
    if width <= 0:
        return np.zeros(0, dtype=np.uint64)
    m = np.uint64(mult)
    h = values[:width].astype(np.uint64)
    with np.errstate(over="ignore"):  # wraparound is the intended mod 2^64
        for i in range(1, n):
            np.multiply(h, m, out=h)
            np.add(h, values[i : i + width], out=h)
    return h


def _powers_uncached(base: int, n: int) -> np.ndarray:
    out = np.empty(max(n, 1), dtype=np.uint64)
    out[0] = 1
    done, step = 1, np.uint64(base)
    with np.errstate(over="ignore"):
        while done < n:  # doubling: out[k:2k] = out[0:k] * base^k
            take = min(done, n - done)
            np.multiply(out[:take], step, out=out[done : done + take])
            done += take
            step = step * step
    return out[:n]


@lru_cache(maxsize=2)
def _powers_cached(base: int, n: int) -> np.ndarray:
    out = _powers_uncached(base, n)
    out.flags.writeable = False
    return out


def _powers(base: int, n: int) -> np.ndarray:
    """``base ** j mod 2^64`` for j in [0, n): cached up to a batch's size, as every batch
    needs them; a longer text gets its own, uncached."""
    if n > 2 * BATCH_CHARS:
        return _powers_uncached(base, n)
    return _powers_cached(base, 2 * BATCH_CHARS)[:n]


def _windows(values: np.ndarray, starts: np.ndarray, lens: np.ndarray, n: int,
             mult: int) -> tuple[np.ndarray, np.ndarray]:
    """Window hashes of the spans ``values[starts[k]:starts[k] + lens[k]]``, span by span.

    A span of length >= n gives its ``len - n + 1`` windows; a shorter, non-empty one a
    single window over all of it (as ``_rolling`` of the span alone would); windows never
    leave their span. Returns the hashes and how many each span has.
    """
    counts = np.where(lens >= n, lens - n + 1, np.minimum(lens, 1))
    short = np.flatnonzero((lens > 0) & (lens < n))
    if not len(short):
        return _rolling(values, n, mult)[_ranges(starts, counts)], counts
    h = np.empty(int(counts.sum()), dtype=np.uint64)
    at = np.cumsum(counts) - counts
    long = lens >= n
    h[_ranges(at[long], counts[long])] = _rolling(values, n, mult)[
        _ranges(starts[long], counts[long])]
    for k in short:  # rare: texts of fewer than n characters or words
        h[at[k]] = _rolling(values[starts[k] : starts[k] + lens[k]], int(lens[k]), mult)[0]
    return h, counts


@dataclass
class _Joined:
    """Texts joined by single spaces, as code points, with where each text lies."""

    cp: np.ndarray  # uint32
    starts: np.ndarray  # int64
    lens: np.ndarray  # int64
    spaces: np.ndarray  # int64, positions of every space (the joining ones included)

    @classmethod
    def of(cls, texts: Sequence[str]) -> _Joined:
        lens = np.fromiter(map(len, texts), dtype=np.int64, count=len(texts))
        cp = codepoints(" ".join(texts))
        return cls(cp, np.cumsum(lens + 1) - (lens + 1), lens, np.flatnonzero(cp == _SPACE))

    def count(self, positions: np.ndarray) -> np.ndarray:
        """How many of the sorted ``positions`` fall inside each text."""
        return (np.searchsorted(positions, self.starts + self.lens)
                - np.searchsorted(positions, self.starts))


def _word_hashes(cp: np.ndarray, spaces: np.ndarray) -> np.ndarray:
    """One 64-bit hash per space-separated word, the same wherever the word occurs:
    ``sum cp[j] * P^(j - start)`` over the word's characters, from prefix sums."""
    starts = np.concatenate(([0], spaces + 1))
    ends = np.concatenate((spaces, [len(cp)]))
    with np.errstate(over="ignore"):
        prefix = np.zeros(len(cp) + 1, dtype=np.uint64)
        prefix[1:] = cp  # same-type arithmetic below runs numpy's fast loops
        np.multiply(prefix[1:], _powers(_P_CHAR, len(cp)), out=prefix[1:])
        np.cumsum(prefix, out=prefix)  # a cumsum beats a reduceat over many short words
        # len(cp) + 1: a text ending in a space (not normalised) has an empty last word.
        return (prefix[ends] - prefix[starts]) * _powers(_P_CHAR_INV, len(cp) + 1)[starts]


def _fold32(h: np.ndarray) -> np.ndarray:
    return ((h ^ (h >> np.uint64(32))) & np.uint64(0xFFFFFFFF)).astype(np.uint32)


def _char_shingles(j: _Joined, n: int) -> tuple[np.ndarray, np.ndarray]:
    return _windows(j.cp.astype(np.uint64), j.starts, j.lens, n, _P_CHAR)


def _word_shingles(j: _Joined, n: int) -> tuple[np.ndarray, np.ndarray]:
    # The joining spaces end words too, so each text has (its own spaces + 1) words.
    nwords = j.count(j.spaces) + 1
    return _windows(_word_hashes(j.cp, j.spaces), np.cumsum(nwords) - nwords, nwords, n,
                    _P_WORD)


def _use_chars(j: _Joined, shingle: str) -> np.ndarray:
    """Per text: whether it is shingled by characters (``auto``: mostly CJK)."""
    if shingle != "auto":
        return np.full(len(j.lens), shingle == "char")
    chars = j.lens - j.count(j.spaces)
    return j.count(_cjk_positions(j.cp)) > CJK_CHAR_SHARE * np.maximum(chars, 1)


@dataclass
class Shingles:
    """The 64-bit shingle hashes of a batch of texts, one contiguous segment per text.

    The first ``counts[0]`` hashes belong to text ``docs[0]``, the next ``counts[1]`` to
    ``docs[1]``, and so on; empty texts have no segment. Hashes are not deduplicated (a
    minimum does not need it).
    """

    hashes: np.ndarray  # uint64
    counts: np.ndarray  # int64, >= 1
    docs: np.ndarray  # int64


def shingle_sets(texts: Sequence[str], shingle: str = "auto", word_ngram: int = 5,
                 char_ngram: int = 5) -> Shingles:
    """The shingle hashes of a batch of normalised texts, computed together.

    ``shingle``: ``word`` n-grams, ``char`` n-grams, or ``auto`` (characters when more
    than ``CJK_CHAR_SHARE`` of a text is CJK, which has no spaces between words).
    """
    docs = np.array([k for k, t in enumerate(texts) if t], dtype=np.int64)
    joined = _Joined.of([texts[k] for k in docs])
    by_chars = _use_chars(joined, shingle)
    hashes, counts, owners = [], [], []
    for pick, shingler, n in ((by_chars, _char_shingles, char_ngram),
                              (~by_chars, _word_shingles, word_ngram)):
        if not pick.any():
            continue
        # A batch of one kind (the usual case) reuses the encoding.
        j = joined if pick.all() else _Joined.of([texts[k] for k in docs[pick]])
        h, c = shingler(j, n)
        hashes.append(h)
        counts.append(c)
        owners.append(docs[pick])
    if not hashes:
        return Shingles(np.zeros(0, np.uint64), np.zeros(0, np.int64), np.zeros(0, np.int64))
    return Shingles(np.concatenate(hashes), np.concatenate(counts), np.concatenate(owners))


def shingle_hashes(normalized: str, shingle: str, word_ngram: int, char_ngram: int) -> np.ndarray:
    """The distinct 32-bit hashes of one normalised text's shingles (see ``shingle_sets``):
    what the ``affine32`` scheme permutes, and the sets the dedup's Jaccard is over."""
    return np.unique(_fold32(shingle_sets([normalized], shingle, word_ngram, char_ngram).hashes))


@lru_cache(maxsize=4)
def permutations(num_perm: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """datasketch's own (a, b) permutation parameters for ``num_perm`` and ``seed``."""
    a, b = MinHash(num_perm=num_perm, seed=seed, scheme="affine32").permutations
    a, b = a.astype(np.uint32), b.astype(np.uint32)
    a.flags.writeable = b.flags.writeable = False
    return a, b


def _fmix32(h: np.ndarray) -> np.ndarray:
    """MurmurHash3's 32-bit finalizer, as datasketch pre-mixes every input hash."""
    h = h ^ (h >> np.uint32(16))
    h *= np.uint32(0x85EBCA6B)
    h ^= h >> np.uint32(13)
    h *= np.uint32(0xC2B2AE35)
    return h ^ (h >> np.uint32(16))


def _fmix64(h: np.ndarray) -> np.ndarray:
    """MurmurHash3's 64-bit finalizer: a bijection that spreads every input bit."""
    with np.errstate(over="ignore"):
        h = h ^ (h >> np.uint64(33))
        h *= np.uint64(0xFF51AFD7ED558CCD)
        h ^= h >> np.uint64(33)
        h *= np.uint64(0xC4CEB9FE1A85EC53)
        return h ^ (h >> np.uint64(33))


def _seeded(h: np.ndarray, seed: int) -> np.ndarray:
    with np.errstate(over="ignore"):
        return _fmix64(h + np.uint64((seed * _GOLDEN + 1) % (1 << 64)))


def affine_signatures(shingles: Shingles, n_docs: int, num_perm: int, seed: int,
                      block: int | None = None) -> np.ndarray:
    """``affine32`` signatures (uint32 [n_docs, num_perm]), equal to datasketch's.

    The (permutation x shingle) products are made ``block`` shingles at a time in one
    reused buffer, and reduced per text with ``np.minimum.reduceat``; a text that spans
    blocks takes the minimum of its pieces. Texts without shingles keep the empty value.
    """
    a, b = permutations(num_perm, seed)
    sig = np.full((n_docs, num_perm), _MAX32, dtype=np.uint32)
    total = len(shingles.hashes)
    if not total:
        return sig
    block = block or max(64, BLOCK_ELEMS // num_perm)
    hv = _fmix32(_fold32(shingles.hashes))
    seg_starts = np.cumsum(shingles.counts) - shingles.counts
    buf = np.empty((num_perm, min(block, total)), dtype=np.uint32)
    a_col, b_col = a[:, None], b[:, None]
    for lo in range(0, total, block):
        hi = min(lo + block, total)
        first = int(np.searchsorted(seg_starts, lo, side="right")) - 1
        last = int(np.searchsorted(seg_starts, hi, side="left"))
        cuts = seg_starts[first:last] - lo
        cuts[0] = 0  # the first segment may have begun in an earlier block
        out = buf[:, : hi - lo]
        np.multiply(a_col, hv[lo:hi], out=out)  # wraps mod 2^32, as datasketch's
        np.add(out, b_col, out=out)
        mins = np.minimum.reduceat(out, cuts, axis=1).T
        docs = shingles.docs[first:last]
        sig[docs] = np.minimum(sig[docs], mins)
    return sig


@lru_cache(maxsize=4)
def _borrow_order(num_perm: int, seed: int) -> np.ndarray:
    """Row i: every bin, in the pseudo-random order in which an empty bin i looks for a
    filled one. The first distinct bins of an i.i.d. uniform sequence (optimal
    densification's probes) come in a uniformly random order, so this is the same rule."""
    keys = np.arange(num_perm * num_perm, dtype=np.uint64).reshape(num_perm, num_perm)
    order = np.argsort(_seeded(keys, seed + 1), axis=1, kind="stable")
    order.flags.writeable = False
    return order


def _densify(sig: np.ndarray, filled: np.ndarray, seed: int) -> None:
    """Fill each empty bin of a text that has a filled one, in place (see ``_borrow_order``)."""
    docs, bins = np.nonzero(~filled & filled.any(axis=1, keepdims=True))
    order = _borrow_order(sig.shape[1], seed)
    start, width = 0, 4
    while len(docs):  # each round looks a little further; most bins stop in the first
        cand = order[bins, start : start + width]
        ok = filled[docs[:, None], cand]
        hit = ok.any(axis=1)
        src = cand[np.arange(len(cand)), ok.argmax(axis=1)]
        sig[docs[hit], bins[hit]] = sig[docs[hit], src[hit]]
        docs, bins = docs[~hit], bins[~hit]
        start, width = start + width, width * 2


def oph_signatures(shingles: Shingles, n_docs: int, num_perm: int, seed: int) -> np.ndarray:
    """``oph`` signatures (uint32 [n_docs, num_perm]): one-permutation hashing, densified.

    A shingle's mixed 64-bit hash gives its bin (high 32 bits, by multiply-shift onto
    [0, num_perm)) and its value (low 32 bits); each bin keeps its minimum value. Texts
    without shingles keep the empty value in every bin.
    """
    h = _seeded(shingles.hashes, seed)
    bins = ((h >> np.uint64(32)) * np.uint64(num_perm)) >> np.uint64(32)
    slots = np.repeat(shingles.docs * num_perm, shingles.counts) + bins.astype(np.int64)
    sig = np.full(n_docs * num_perm, _MAX32, dtype=np.uint32)
    np.minimum.at(sig, slots, h.astype(np.uint32))  # the cast keeps the low 32 bits
    filled = np.zeros(n_docs * num_perm, dtype=bool)
    filled[slots] = True
    sig, filled = sig.reshape(n_docs, num_perm), filled.reshape(n_docs, num_perm)
    _densify(sig, filled, seed)
    return sig


def _batches(texts: Sequence[str], max_chars: int) -> Iterator[tuple[int, int]]:
    """Consecutive [lo, hi) ranges of texts with about ``max_chars`` characters each."""
    lo, size = 0, 0
    for k, t in enumerate(texts):
        size += len(t)
        if size >= max_chars:
            yield lo, k + 1
            lo, size = k + 1, 0
    if lo < len(texts):
        yield lo, len(texts)


def signatures(texts: Sequence[str], num_perm: int = 128, seed: int = 1,
               scheme: str = "oph", shingle: str = "auto", word_ngram: int = 5,
               char_ngram: int = 5, batch_chars: int = BATCH_CHARS) -> np.ndarray:
    """MinHash signatures (uint32 [len(texts), num_perm]) of normalised texts.

    ``scheme``: ``oph`` or ``affine32`` (see the module docstring). Texts are shingled
    and sketched about ``batch_chars`` characters at a time; a text's signature does not
    depend on the batch it falls in.
    """
    if scheme not in SCHEMES:
        raise ValueError(f"unknown MinHash scheme {scheme!r} (expected one of {SCHEMES})")
    sketch = oph_signatures if scheme == "oph" else affine_signatures
    sig = np.empty((len(texts), num_perm), dtype=np.uint32)
    for lo, hi in _batches(texts, batch_chars):
        batch = texts[lo:hi]
        shingles = shingle_sets(batch, shingle, word_ngram, char_ngram)
        sig[lo:hi] = sketch(shingles, len(batch), num_perm, seed)
    return sig


def jaccard(sig_a: np.ndarray, sig_b: np.ndarray) -> np.ndarray | float:
    """Estimated Jaccard similarity: the share of equal signature slots (row-wise)."""
    return np.mean(sig_a == sig_b, axis=-1)
