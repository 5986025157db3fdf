"""Near-duplicate detection quality on planted pairs made from the demo corpus.

Each sampled demo document gets one copy with a random share of its words (CJK: its
characters) replaced by fresh tokens; the pair's true Jaccard similarity over the
dedup shingles is computed exactly. The dedup stage then runs on all documents, and
the script reports recall for pairs at J >= 0.85 and the false-positive rate for
pairs at J <= 0.5 (targets: >= 0.95 and <= 0.005). The baseline is the LSH S-curve's
own prediction for the same pairs, printed beside the measurement.

    .venv/bin/python bench/bench_dedup_quality.py [--pairs 600] [--scheme oph|affine32]
"""

from __future__ import annotations

import argparse
import random
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from _common import demo_docs

from lmforge.config import DedupConfig
from lmforge.data import minhash
from lmforge.data.dedup import run_dedup
from lmforge.data.records import SCHEMA


def mutate(text: str, rate: float, rng: random.Random) -> str:
    cjk = minhash.cjk_share(minhash.codepoints(text)) > minhash.CJK_CHAR_SHARE
    units = list(text) if cjk else text.split(" ")
    for i in range(len(units)):
        if rng.random() < rate:
            units[i] = chr(0x4E00 + rng.randrange(20000)) if cjk else f"x{rng.randrange(10**9)}"
    return ("" if cjk else " ").join(units)


def true_jaccard(a: str, b: str) -> float:
    sa = set(minhash.shingle_hashes(a, "auto", 5, 5).tolist())
    sb = set(minhash.shingle_hashes(b, "auto", 5, 5).tolist())
    return len(sa & sb) / len(sa | sb)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=600)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scheme", default="oph", choices=minhash.SCHEMES)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    docs = [(d, minhash.normalize(t)) for d, t in demo_docs()]
    docs = [x for x in docs if len(x[1]) > 500]
    sample = rng.sample(docs, min(args.pairs, len(docs)))
    cfg = DedupConfig(num_workers=0, scheme=args.scheme)
    rows, pairs = [], []
    for k, (domain, text) in enumerate(sample):
        # Rates spread the pairs over J from ~1 down to ~0.2.
        copy = mutate(text, rng.choice([0.005, 0.01, 0.02, 0.1, 0.15, 0.2, 0.3]), rng)
        rows += [(f"a{k}", text, domain), (f"b{k}", copy, domain)]
        pairs.append((f"a{k}", f"b{k}", true_jaccard(text, copy)))
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "in"
        src.mkdir()
        for p in range(0, len(rows), 200):
            chunk = rows[p : p + 200]
            n = len(chunk)
            pq.write_table(pa.table({"id": [r[0] for r in chunk], "text": [r[1] for r in chunk],
                                     "domain": [r[2] for r in chunk], "source": ["s"] * n,
                                     "file": ["f"] * n, "line": list(range(n))}, schema=SCHEMA),
                           src / f"part-{p // 200:05d}.parquet")
        run_dedup(cfg, src, Path(tmp) / "out")
        c = pq.read_table(Path(tmp) / "out" / "clusters.parquet").to_pydict()
    cluster = dict(zip(c["id"], c["cluster"], strict=True))
    found = [(j, cluster[a] == cluster[b]) for a, b, j in pairs]
    high = [hit for j, hit in found if j >= 0.85]
    low = [hit for j, hit in found if j <= 0.5]
    s = lambda j: 1 - (1 - j**cfg.rows) ** cfg.bands  # noqa: E731 - the LSH S-curve
    s_high = sum(s(j) for j, _ in found if j >= 0.85) / max(len(high), 1)
    s_low = sum(s(j) for j, _ in found if j <= 0.5) / max(len(low), 1)
    print(f"scheme={cfg.scheme} pairs={len(pairs)} bands={cfg.bands} rows={cfg.rows} num_perm={cfg.num_perm} "
          f"threshold={(1 / cfg.bands) ** (1 / cfg.rows):.3f}")
    print(f"J >= 0.85: {len(high)} pairs, recall {sum(high) / max(len(high), 1):.4f} "
          f"(S-curve baseline {s_high:.4f}; target >= 0.95)")
    print(f"J <= 0.50: {len(low)} pairs, false positives {sum(low) / max(len(low), 1):.4f} "
          f"(S-curve baseline {s_low:.4f}; target <= 0.005)")


if __name__ == "__main__":
    main()
