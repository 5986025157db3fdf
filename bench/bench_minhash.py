"""MinHash signatures per second per core: lmforge's numpy path vs datasketch's own.

Both get the same normalised demo documents, num_perm and shingles (word 5-grams, or
character 5-grams for CJK); datasketch's ``MinHash.update_batch`` is timed on the
shingles already encoded as bytes (its fastest use), lmforge's time includes
shingling. One process, so the figures are per core.

    .venv/bin/python bench/bench_minhash.py [--docs 600] [--num-perm 128]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from _common import demo_docs
from datasketch import MinHash

from lmforge.data import minhash


def shingle_strings(text: str, n_word: int, n_char: int) -> list[bytes]:
    """The same shingles lmforge hashes, as the byte strings datasketch takes."""
    cp = minhash.codepoints(text)
    if minhash.cjk_share(cp) > minhash.CJK_CHAR_SHARE:
        n = min(n_char, len(text))
        return list({text[i : i + n].encode() for i in range(len(text) - n + 1)})
    words = text.split(" ")
    n = min(n_word, len(words))
    return list({" ".join(words[i : i + n]).encode() for i in range(len(words) - n + 1)})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--docs", type=int, default=600)
    ap.add_argument("--num-perm", type=int, default=128)
    args = ap.parse_args()
    docs = demo_docs()
    step = max(1, len(docs) // args.docs)
    texts = [minhash.normalize(t) for _, t in docs[::step]][: args.docs]
    chars = sum(map(len, texts))

    a, b = minhash.permutations(args.num_perm, 1)
    t0 = time.perf_counter()
    for t in texts:
        minhash.signature(minhash.shingle_hashes(t, "auto", 5, 5), a, b)
    ours = time.perf_counter() - t0

    shingles = [shingle_strings(t, 5, 5) for t in texts]
    n_shingles = sum(map(len, shingles))
    t0 = time.perf_counter()
    for s in shingles:
        m = MinHash(num_perm=args.num_perm, seed=1)
        m.update_batch(s)
    base = time.perf_counter() - t0

    print(f"docs={len(texts)} chars={chars} shingles={n_shingles} num_perm={args.num_perm}")
    print(f"datasketch MinHash.update_batch: {len(texts) / base:9.1f} signatures/s/core "
          f"({n_shingles / base / 1e6:.2f} M shingles/s)")
    print(f"lmforge numpy signatures:        {len(texts) / ours:9.1f} signatures/s/core "
          f"({n_shingles / ours / 1e6:.2f} M shingles/s)")
    print(f"ratio lmforge / datasketch: {base / ours:.1f}x  (target >= 10x)")
    assert np.isfinite(base / ours)


if __name__ == "__main__":
    main()
