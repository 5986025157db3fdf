"""The tokenizer's training sample: exact against a keep-everything reference, flat memory."""

from __future__ import annotations

import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lmforge.tokenizer.sample import _water_fill, balanced_sample, doc_key


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
    shares = _water_fill(available, budget)
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
