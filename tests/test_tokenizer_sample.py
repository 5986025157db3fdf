"""The tokenizer's training sample: exact against a keep-everything reference, flat memory."""

from __future__ import annotations

import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lmforge.tokenizer.sample import balanced_sample, doc_key, water_fill


def write_parts(root: Path, rows: list[tuple[str, str, str]], n_parts: int) -> list[Path]:
    """``rows`` of (id, text, domain) in order, cut into ``n_parts`` consecutive parts."""
    root.mkdir(parents=True, exist_ok=True)
    paths = []
    size = -(-len(rows) // n_parts)
    for p in range(n_parts):
        chunk = rows[p * size:(p + 1) * size]
        path = root / f"part-{p:05d}.parquet"
        pq.write_table(pa.table({"id": [r[0] for r in chunk], "text": [r[1] for r in chunk],
                                 "domain": [r[2] for r in chunk]}), path)
        paths.append(path)
    return paths


def skewed_rows(rng: random.Random, scale: int) -> list[tuple[str, str, str]]:
    """A large, a medium and a tiny domain (arriving last), uneven lengths, some repeats."""
    rows = []
    for domain, n, longest in (("big", 60 * scale, 400), ("mid", 12 * scale, 900),
                               ("tiny", 5, 50)):
        for i in range(n):
            text = rng.choice("abcdefg数据") * rng.randint(1, longest)
            rows.append((f"{domain}-{i}", text, domain))
    head, tail = rows[:-5], rows[-5:]
    rng.shuffle(head)
    rows = head + tail + head[:20]  # the same ids again: an up-sampled repeat
    return rows


def reference_sample(rows: list[tuple[str, str, str]], budget: int, seed: int) -> list[str]:
    """Keep every document, then share the budget: what the streaming sampler must equal."""
    per_domain: dict[str, dict[str, str]] = {}
    for doc_id, text, domain in rows:
        per_domain.setdefault(domain, {}).setdefault(doc_id, text)
    available = {d: sum(map(len, docs.values())) for d, docs in per_domain.items()}
    shares = water_fill(available, budget)
    chosen = []
    for domain, docs in per_domain.items():
        left = shares[domain]
        for key, text in sorted((doc_key(seed, i), t) for i, t in docs.items()):
            if left <= 0:
                break
            chosen.append((key, text[:left]))
            left -= len(text[:left])
    return [t for _, t in sorted(chosen)]


@pytest.mark.parametrize("budget", [3_000, 20_000, 10_000_000])
def test_streaming_sample_equals_keep_everything(tmp_path, budget):
    rows = skewed_rows(random.Random(budget), scale=3)
    parts = write_parts(tmp_path, rows, n_parts=4)
    sample = balanced_sample(parts, budget, seed=7)
    assert sample.texts == reference_sample(rows, budget, seed=7)
    # Repeated ids add nothing: the sample of the rows without them is the same.
    once = write_parts(tmp_path / "once", rows[:-20], n_parts=2)
    assert balanced_sample(once, budget, seed=7).texts == sample.texts
    if budget < 10_000_000:
        assert sum(sample.chars_per_domain.values()) == budget


def test_memory_stays_flat_as_the_corpus_grows(tmp_path):
    budget, longest = 4_000, 900
    peaks = []
    for scale in (3, 24):
        rows = skewed_rows(random.Random(scale), scale)
        total = sum(len(t) for _, t, _ in rows)
        assert total > 10 * budget
        sample = balanced_sample(write_parts(tmp_path / str(scale), rows, 3), budget, seed=1)
        assert sum(map(len, sample.texts)) == budget
        peaks.append(sample.peak_held_chars)
    # The budget plus at most one document per domain, however big the corpus.
    assert max(peaks) <= budget + 3 * longest
    assert peaks[1] <= peaks[0] + 3 * longest


def test_copies_made_by_mix_are_skipped(tmp_path):
    """mix up-samples a small domain as ``id#rN`` rows; the sample takes each text once."""
    from lmforge.config import MixConfig
    from lmforge.data.mix import run_mix
    from lmforge.data.records import is_repeat, list_parts, read_table

    rng = random.Random(3)
    rows = [(f"big-{i}", "".join(rng.choice("abcdef ") for _ in range(300)), "big")
            for i in range(40)]
    rows += [(f"small-{i}", "".join(rng.choice("数据库表") for _ in range(100)), "small")
             for i in range(10)]
    deduped = write_parts(tmp_path / "deduped", rows, n_parts=2)[0].parent
    metrics = run_mix(MixConfig(weights={"big": 0.5, "small": 0.5}, max_epochs=3,
                                min_val_docs=1, val_fraction=0.1, num_workers=1),
                      deduped, tmp_path / "mixed")
    assert metrics["domains"]["small"]["epochs"] > 2  # really up-sampled
    parts = list_parts(tmp_path / "mixed" / "train")
    ids = [i for p in parts for i in read_table(p, columns=["id"]).column("id").to_pylist()]
    copies = sum(map(is_repeat, ids))
    assert copies > 0
    sample = balanced_sample(parts, 10_000_000, seed=1)
    assert sample.repeats_skipped == copies
    originals = {i for i in ids if not is_repeat(i)}
    assert len(sample.texts) == len(originals)
    assert sum(sample.available_chars.values()) == sum(map(len, sample.texts))


def test_repeat_ids_round_trip():
    from lmforge.data.records import is_repeat, repeat_id

    assert repeat_id("doc:7", 0) == "doc:7" and not is_repeat("doc:7")
    assert is_repeat(repeat_id("doc:7", 1)) and is_repeat("a#r12")
    assert not is_repeat("a#r0") and not is_repeat("a#rx") and not is_repeat("a#r1b")
