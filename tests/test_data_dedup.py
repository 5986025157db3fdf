"""Dedup: signatures match datasketch, exact and near duplicates found, nothing else."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
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


def test_signature_equals_datasketch_minhash():
    rng = random.Random(1)
    text = minhash.normalize(english(rng))
    hashes = minhash.shingle_hashes(text, "word", 5, 5)
    a, b = minhash.permutations(64, 3)
    ours = minhash.signature(hashes, a, b, chunk=16)  # several chunks
    ref = MinHash(num_perm=64, seed=3, hashfunc=lambda h: h)
    ref.update_batch([int(h) for h in hashes])
    assert np.array_equal(ours, ref.hashvalues)


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
