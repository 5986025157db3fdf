"""Dedup: signatures (oph, and affine32 = datasketch's), exact and near duplicates found."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from datasketch import MinHash

from lmforge.config import DedupConfig
from lmforge.data import minhash
from lmforge.data.dedup import run_dedup
from lmforge.data.records import SCHEMA

WORDS = [f"w{i}{c}" for i in range(400) for c in "ab"]
HANZI = [chr(0x4E00 + i * 7) for i in range(600)]


def english(rng: random.Random, n: int = 150) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def chinese(rng: random.Random, n: int = 300) -> str:
    return "".join(rng.choice(HANZI) for _ in range(n))


def mutate_words(text: str, k: int, rng: random.Random) -> str:
    words = text.split()
    for i in rng.sample(range(len(words)), k):
        words[i] = "changed"
    return " ".join(words)


def write_parts(directory: Path, docs: list[tuple[str, str, str]], per_part: int = 4) -> None:
    directory.mkdir(parents=True)
    for k in range(0, len(docs), per_part):
        chunk = docs[k : k + per_part]
        n = len(chunk)
        pq.write_table(pa.table({"id": [d[0] for d in chunk], "text": [d[1] for d in chunk],
                                 "domain": [d[2] for d in chunk], "source": ["s"] * n,
                                 "file": ["f"] * n, "line": list(range(n))}, schema=SCHEMA),
                       directory / f"part-{k // per_part:05d}.parquet")


def _mixed_texts() -> list[str]:
    """English and Chinese texts of many lengths, an empty one and very short ones."""
    rng = random.Random(5)
    texts = [english(rng, n) for n in (3, 40, 150, 400)] + [chinese(rng, n) for n in (2, 60, 300)]
    texts += ["", "x", english(rng, 150) + " " + chinese(rng, 20)]
    return [minhash.normalize(t) for t in texts]


def test_affine32_signatures_equal_datasketch_minhash():
    texts = _mixed_texts()
    ours = minhash.signatures(texts, 64, 3, "affine32")
    for text, sig in zip(texts, ours, strict=True):
        ref = MinHash(num_perm=64, seed=3, hashfunc=lambda h: h)
        ref.update_batch(minhash.shingle_hashes(text, "auto", 5, 5).tolist())
        assert np.array_equal(sig, ref.hashvalues)
    # Texts spanning several permutation blocks give the same values.
    shingles = minhash.shingle_sets(texts)
    assert np.array_equal(minhash.affine_signatures(shingles, len(texts), 64, 3, block=16), ours)


@pytest.mark.parametrize("scheme", minhash.SCHEMES)
def test_signatures_do_not_depend_on_the_batch(scheme):
    texts = _mixed_texts()
    together = minhash.signatures(texts, 64, 1, scheme)
    apart = np.stack([minhash.signatures([t], 64, 1, scheme)[0] for t in texts])
    small = minhash.signatures(texts, 64, 1, scheme, batch_chars=500)
    assert np.array_equal(together, apart) and np.array_equal(together, small)
    empty = np.iinfo(np.uint32).max
    assert (together[texts.index("")] == empty).all()
    assert not (np.delete(together, texts.index(""), axis=0) == empty).any()  # densified
    assert not np.array_equal(together, minhash.signatures(texts, 64, 2, scheme))  # seeded


def test_oph_estimates_jaccard_like_minhash():
    rng = random.Random(3)
    errors = {s: [] for s in minhash.SCHEMES}
    for k in range(12):
        base = minhash.normalize(english(rng, 300))
        other = mutate_words(base, 5 * k + 1, rng)
        a = set(minhash.shingle_hashes(base, "word", 5, 5).tolist())
        b = set(minhash.shingle_hashes(other, "word", 5, 5).tolist())
        true = len(a & b) / len(a | b)
        for scheme in minhash.SCHEMES:
            sa, sb = minhash.signatures([base, other], 256, 7, scheme, "word")
            errors[scheme].append(float(minhash.jaccard(sa, sb)) - true)
    # Unbiased, with a MinHash's spread (sd ~0.03 at 256 slots).
    for scheme, err in errors.items():
        assert abs(np.mean(err)) < 0.03 and np.max(np.abs(err)) < 0.12, (scheme, err)


def test_unknown_scheme_is_refused():
    with pytest.raises(ValueError, match="scheme"):
        minhash.signatures(["a b c"], 16, 1, "sha1")


def test_shingle_hashes_and_signatures_are_stable_across_processes():
    text = minhash.normalize(english(random.Random(2)) + " " + chinese(random.Random(2), 40))
    code = ("import sys; from lmforge.data import minhash as m; t = sys.stdin.read(); "
            "print(m.shingle_hashes(t, 'auto', 5, 5).tolist(), m.signatures([t])[0].tolist())")
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], input=text, capture_output=True,
                         text=True, env=env, check=True).stdout
    here = (minhash.shingle_hashes(text, "auto", 5, 5).tolist(),
            minhash.signatures([text])[0].tolist())
    assert out.strip() == f"{here[0]} {here[1]}"


def test_shingle_hashes_are_position_independent():
    a = minhash.shingle_hashes("one two three four five six", "word", 3, 5)
    b = minhash.shingle_hashes("zero one two three four five six", "word", 3, 5)
    assert set(a) < set(b) and len(b) == len(a) + 1
    zh = minhash.shingle_hashes("床前明月光疑是地上霜", "auto", 5, 5)
    assert len(zh) == 6  # auto picks character 5-grams for CJK
    assert len(minhash.shingle_hashes("short", "word", 5, 5)) == 1


def test_normalize_folds_width_case_and_whitespace():
    assert minhash.normalize("  Ｈｅｌｌｏ\tWORLD \n") == "hello world"
    assert minhash.exact_key(minhash.normalize("A  b")) == minhash.exact_key("a b")


def _docs():
    rng = random.Random(7)
    base_en, base_zh = english(rng), chinese(rng)
    near_zh = list(base_zh)
    for i in (10, 100, 200):
        near_zh[i] = "好"
    return [
        ("en-0", base_en, "en"),
        ("en-1", english(rng), "en"),  # unrelated
        ("en-2", mutate_words(base_en, 3, rng), "en"),  # planted near-dup
        ("en-3", "  " + base_en.upper().replace(" ", "\t", 5) + "\n", "en"),  # exact after norm
        ("zh-0", base_zh, "zh"),
        ("zh-1", "".join(near_zh), "zh"),  # near-dup, three characters changed
        ("zh-2", chinese(rng), "zh"),  # unrelated
        ("en-4", english(rng) + " tail", "en"),
        ("en-5", mutate_words(base_en, 3, rng) + " and a much longer ending " * 3, "en"),
    ]


def test_exact_and_near_duplicates_are_clustered(tmp_path):
    write_parts(tmp_path / "in", _docs())
    metrics = run_dedup(DedupConfig(num_workers=1), tmp_path / "in", tmp_path / "out")
    c = pq.read_table(tmp_path / "out" / "clusters.parquet").to_pydict()
    cluster = dict(zip(c["id"], c["cluster"], strict=True))
    sim = dict(zip(c["id"], c["similarity"], strict=True))
    assert {i for i in cluster if cluster[i] == "en-0"} == {"en-0", "en-2", "en-3", "en-5"}
    assert cluster["zh-1"] == "zh-0"
    for unrelated in ("en-1", "en-4", "zh-2"):
        assert cluster[unrelated] == unrelated
    assert sim["en-3"] == 1.0 and 0.5 < sim["en-2"] < 1.0 and 0.5 < sim["zh-1"] < 1.0
    kept = [i for p in sorted((tmp_path / "out").glob("part-*.parquet"))
            for i in pq.read_table(p).column("id").to_pylist()]
    assert kept == ["en-0", "en-1", "zh-0", "zh-2", "en-4"]
    assert metrics["domains"]["en"]["rejected"] == {"exact_dup": 1, "near_dup": 2}
    assert metrics["domains"]["zh"] == {"in": 3, "kept": 2, "rejected": {"near_dup": 1}}
    assert metrics["clusters"] == 2 and metrics["docs_in_clusters"] == 6


def test_keep_longest_and_exact_only(tmp_path):
    write_parts(tmp_path / "in", _docs())
    run_dedup(DedupConfig(keep="longest", num_workers=1), tmp_path / "in", tmp_path / "long")
    c = pq.read_table(tmp_path / "long" / "clusters.parquet").to_pydict()
    assert dict(zip(c["id"], c["cluster"], strict=True))["en-0"] == "en-5"
    metrics = run_dedup(DedupConfig(near=False, num_workers=1), tmp_path / "in", tmp_path / "ex")
    assert metrics["exact_dups"] == 1 and metrics["near_dups"] == 0


def test_output_is_byte_identical_across_runs_and_worker_counts(tmp_path):
    write_parts(tmp_path / "in", _docs(), per_part=2)
    run_dedup(DedupConfig(num_workers=1), tmp_path / "in", tmp_path / "a")
    run_dedup(DedupConfig(num_workers=2), tmp_path / "in", tmp_path / "b")
    names = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "b").iterdir())
    for name in names:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_keep_quality_prefers_the_cleaner_copy(tmp_path):
    rng = random.Random(11)
    sentences = [" ".join(rng.choice(WORDS) for _ in range(12)) + "." for _ in range(30)]
    clean = "\n".join(sentences)
    noisy = clean + "\n" + "\n".join(sentences[:3]) + "\n\x07\x07 $$ 123 456 789"
    docs = [("noisy", noisy, "en"), ("clean", clean, "en"), ("other", english(rng), "en")]
    write_parts(tmp_path / "in", docs)
    run_dedup(DedupConfig(keep="quality", num_workers=1), tmp_path / "in", tmp_path / "q")
    c = pq.read_table(tmp_path / "q" / "clusters.parquet").to_pydict()
    assert dict(zip(c["id"], c["cluster"], strict=True)) == {
        "noisy": "clean", "clean": "clean", "other": "other"}
    run_dedup(DedupConfig(keep="longest", num_workers=1), tmp_path / "in", tmp_path / "l")
    c = pq.read_table(tmp_path / "l" / "clusters.parquet").to_pydict()
    assert dict(zip(c["id"], c["cluster"], strict=True))["clean"] == "noisy"
