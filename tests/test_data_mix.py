"""Mix: shares hit in characters, clusters never straddle train/val, deterministic output."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lmforge.config import MixConfig
from lmforge.data.dedup import CLUSTERS_SCHEMA
from lmforge.data.mix import (
    domain_rng,
    fill_gap,
    run_mix,
    sample_copies,
    shortfall_line,
    shortfall_remedies,
)
from lmforge.data.records import SCHEMA, part_name, write_table
from lmforge.errors import InputError

SIZES = {"big": 300, "mid": 120, "zh": 60}


def make_corpus(directory: Path, cluster_size: int = 1, per_part: int = 70) -> None:
    """Docs of random length per domain; every ``cluster_size`` docs share a cluster."""
    rng = random.Random(3)
    rows = []
    for domain, n in SIZES.items():
        char = "字" if domain == "zh" else "x"
        for i in range(n):
            rows.append((f"{domain}-{i}", char * rng.randint(50, 2000), domain,
                         f"{domain}-{i - i % cluster_size}"))
    rng.shuffle(rows)
    directory.mkdir(parents=True)
    for k in range(0, len(rows), per_part):
        chunk = rows[k : k + per_part]
        n = len(chunk)
        pq.write_table(pa.table({"id": [r[0] for r in chunk], "text": [r[1] for r in chunk],
                                 "domain": [r[2] for r in chunk], "source": ["s"] * n,
                                 "file": ["f"] * n, "line": list(range(n))}, schema=SCHEMA),
                       directory / f"part-{k // per_part:05d}.parquet")
    pq.write_table(pa.table({"id": [r[0] for r in rows], "domain": [r[2] for r in rows],
                             "cluster": [r[3] for r in rows], "kept": [True] * len(rows),
                             "similarity": [1.0] * len(rows)}, schema=CLUSTERS_SCHEMA),
                   directory / "clusters.parquet")


def read_split(out: Path, split: str) -> pa.Table:
    return pa.concat_tables(pq.read_table(p) for p in sorted((out / split).glob("part-*.parquet")))


def cfg(**kw) -> MixConfig:
    base = dict(weights={"big": 0.2, "mid": 0.3, "zh": 0.5}, max_epochs=4.0, val_fraction=0.05,
                min_val_docs=3, part_docs=100, seed=11, num_workers=1)
    base.update(kw)
    return MixConfig(**base)


def test_shares_are_hit_in_characters(tmp_path):
    make_corpus(tmp_path / "in")
    metrics = run_mix(cfg(), tmp_path / "in", tmp_path / "out")
    train = read_split(tmp_path / "out", "train")
    chars = {}
    for text, domain in zip(train.column("text").to_pylist(), train.column("domain").to_pylist(),
                            strict=True):
        chars[domain] = chars.get(domain, 0) + len(text)
    total = sum(chars.values())
    weights = cfg().weights
    for domain, w in weights.items():
        assert abs(chars[domain] / total - w) < 0.02, domain
        m = metrics["domains"][domain]
        assert m["achieved_share"] == pytest.approx(chars[domain] / total, abs=1e-5)
        assert m["epochs"] <= 4.0 + 1e-9
        assert m["in"] == m["kept"] + sum(m["rejected"].values())
    assert max(metrics["domains"][d]["epochs"] for d in weights) == pytest.approx(4.0, rel=0.02)
    ids = train.column("id").to_pylist()
    assert len(ids) == len(set(ids)) and any("#r" in i for i in ids)


def test_downsampling_with_a_total(tmp_path):
    make_corpus(tmp_path / "in")
    metrics = run_mix(cfg(total=100_000), tmp_path / "in", tmp_path / "out")
    assert abs(metrics["train_units"] - 100_000) < 3 * 2000
    assert metrics["domains"]["big"]["rejected"]["downsampled"] > 0


def test_clusters_never_straddle_and_val_has_min_docs(tmp_path):
    make_corpus(tmp_path / "in", cluster_size=3)
    run_mix(cfg(), tmp_path / "in", tmp_path / "out")
    split_of: dict[str, set[str]] = {}
    for split in ("train", "val"):
        t = read_split(tmp_path / "out", split)
        for rid in t.column("id").to_pylist():
            domain, i = rid.split("#")[0].split("-")
            split_of.setdefault(f"{domain}-{int(i) // 3}", set()).add(split)
        if split == "val":
            counts = {d: t.column("domain").to_pylist().count(d) for d in SIZES}
            assert all(counts[d] >= 3 for d in SIZES)
            assert not any("#r" in i for i in t.column("id").to_pylist())
    assert all(len(s) == 1 for s in split_of.values())
    assert {"train"} in split_of.values() and {"val"} in split_of.values()


def test_mix_is_byte_identical_across_runs(tmp_path):
    make_corpus(tmp_path / "in")
    run_mix(cfg(), tmp_path / "in", tmp_path / "a")
    run_mix(cfg(num_workers=2), tmp_path / "in", tmp_path / "b")
    files = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*.parquet"))
    assert files and files == sorted(p.relative_to(tmp_path / "b")
                                     for p in (tmp_path / "b").rglob("*.parquet"))
    for f in files:
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes()
    # A different seed gives a different order.
    run_mix(cfg(seed=12), tmp_path / "in", tmp_path / "c")
    assert (tmp_path / "c" / files[0]).read_bytes() != (tmp_path / "a" / files[0]).read_bytes()


def test_val_takes_enough_of_every_domain_to_measure_it():
    """Documents and characters both reach their minimum; small domains are capped."""
    from lmforge.data.mix import split_val

    rng_data = np.random.default_rng(0)
    n = 400
    chars = rng_data.integers(500, 1500, n).astype(np.int64)
    clusters = np.arange(n) // 2  # pairs of near-duplicates (their clusters' ranks)
    idx = np.arange(n)
    cfg = MixConfig(weights={"a": 1.0}, val_fraction=0.01, min_val_docs=20,
                    min_val_chars=60_000, max_val_fraction=0.5)
    val = split_val(idx, clusters, chars, cfg, np.random.default_rng(1))
    assert val.sum() >= 20 and chars[val].sum() >= 60_000
    assert chars[val].sum() - 2 * chars.max() < 60_000  # no more than needed
    for c in set(clusters.tolist()):  # a cluster never straddles the split
        assert len({bool(val[i]) for i in idx if clusters[i] == c}) == 1
    small = split_val(idx[:30], clusters, chars, cfg, np.random.default_rng(1))
    assert small.sum() <= 15  # max_val_fraction of 30 documents
    few = MixConfig(weights={"a": 1.0}, min_val_docs=20, min_val_chars=0)
    assert split_val(idx, clusters, chars, few, np.random.default_rng(1)).sum() in (20, 21)


def test_mix_metrics_flag_a_domain_whose_val_is_below_the_minimum(tmp_path):
    from lmforge.data.mix import run_mix

    rows = [(f"a-{i}", "x" * 1000, "a") for i in range(200)]
    rows += [(f"b-{i}", "y" * 1000, "b") for i in range(10)]
    src = tmp_path / "in"
    src.mkdir()
    write_table(pa.table({"id": [r[0] for r in rows], "text": [r[1] for r in rows],
                          "domain": [r[2] for r in rows],
                          "source": ["t"] * len(rows)}), src / part_name(0))
    m = run_mix(MixConfig(weights={"a": 1, "b": 1}, min_val_docs=20, min_val_chars=20_000,
                          num_workers=1), src, tmp_path / "out")
    assert m["domains"]["a"]["val_docs"] == 20 and not m["domains"]["a"]["val_below_minimum"]
    assert m["domains"]["b"]["val_docs"] == 2 and m["domains"]["b"]["val_below_minimum"]


def test_a_weighted_domain_without_documents_is_an_error(tmp_path):
    from lmforge.errors import InputError

    make_corpus(tmp_path / "in")
    weights = {"big": 0.2, "mid": 0.3, "zh": 0.4, "gone": 0.1}
    with pytest.raises(InputError, match=r"^mix: gone has weight 0.1 \(10% of the train split\) "
                                         r"but no documents in .*; give it documents or set "
                                         r"mix.weights.gone: 0$"):
        run_mix(cfg(weights=weights), tmp_path / "in", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    m = run_mix(cfg(weights={**weights, "gone": 0}), tmp_path / "in", tmp_path / "out")
    assert "gone" not in m["domains"] and m["shortfalls"] == {}


def test_a_share_out_of_reach_is_reported_and_fails_above_the_tolerance(tmp_path):
    from lmforge.errors import InputError

    make_corpus(tmp_path / "in")
    # zh holds ~60k characters; at most 1 epoch it cannot be half of a 400k train split.
    short = cfg(total=400_000, max_epochs=1.0)
    with pytest.raises(InputError, match=r"^mix: zh: asked 50.0% of the train split, got "
                                         r"\d+\.\d% \(\d+% short; 1 epochs, it is at "
                                         r"mix.max_epochs 1\), above mix.max_shortfall 0.2"):
        run_mix(short, tmp_path / "in", tmp_path / "out")
    m = run_mix(cfg(total=400_000, max_epochs=1.0, max_shortfall=1.0), tmp_path / "in",
                tmp_path / "out")
    zh = m["shortfalls"]["zh"]
    assert zh["asked"] == 0.5 and zh["got"] == m["domains"]["zh"]["achieved_share"] < 0.4
    assert zh["shortfall"] == m["domains"]["zh"]["shortfall"] > 0.2 and zh["epochs"] == 1.0
    assert set(m["shortfalls"]) == {"zh"}  # the others got what they asked, or more


def test_no_shortfall_when_the_total_follows_the_caps(tmp_path):
    make_corpus(tmp_path / "in")
    m = run_mix(cfg(), tmp_path / "in", tmp_path / "out")
    assert m["shortfalls"] == {}
    assert all(d["shortfall"] <= 0.01 for d in m["domains"].values())


def test_a_shortfall_says_when_other_domains_took_more_than_their_share(tmp_path):
    """Thousands of short documents at 0.5 epochs fall short only because a domain of
    three long documents overshoots its share: the message says so, not 'too long'."""
    rows = [(f"s-{i}", f"review {i:05d} " + "z" * 87, "short") for i in range(2000)]
    rows += [(f"l-{i}", "y" * 60_000, "long") for i in range(3)]
    src = tmp_path / "in"
    src.mkdir()
    write_table(pa.table({"id": [r[0] for r in rows], "text": [r[1] for r in rows],
                          "domain": [r[2] for r in rows], "source": ["t"] * len(rows)}),
                src / part_name(0))
    m = run_mix(MixConfig(weights={"short": 1, "long": 1}, total=200_000, max_epochs=4.0,
                          val_fraction=0.0, min_val_docs=0, min_val_chars=0, max_shortfall=1.0,
                          num_workers=1), src, tmp_path / "out")
    short = m["shortfalls"]["short"]
    assert short["epochs"] == 0.5 and short["taken"] == short["target"] == 100_000
    assert short["why"] == ("it took all 100,000 chars asked, but the train split grew around "
                            "it (long took 54.5% for 50.0% asked: a domain of few long documents "
                            "overshoots its share)")
    assert "too long to sample finely" not in shortfall_line("short", short, MixConfig())
    # The remedy is long's documents, not short's epochs or weight.
    crowd = {"long": {"asked": 0.5, "got": 0.545}}
    assert shortfall_remedies("short", short, MixConfig(), crowd) == (
        "give long more or shorter documents, or accept it with mix.max_shortfall: 0.1")


# --------------------------------------------------------------------------- one long document

REPO = Path(__file__).resolve().parents[1]


def write_docs(directory: Path, rows: list[tuple[str, str, str]]) -> Path:
    """One part of (id, text, domain) rows, no clusters."""
    directory.mkdir()
    write_table(pa.table({"id": [r[0] for r in rows], "text": [r[1] for r in rows],
                          "domain": [r[2] for r in rows], "source": ["t"] * len(rows)}),
                directory / part_name(0))
    return directory


def one_long_document_corpus(directory: Path) -> Path:
    """``code`` as issue 46's JS sources: one 400k-character build file beside 400 short
    files of about as much together; ``prose``, 1,000 short documents."""
    rng = random.Random(5)
    rows = [("code-build", "b" * 400_000, "code")]
    rows += [(f"code-{i}", "c" * rng.randint(500, 1500), "code") for i in range(400)]
    rows += [(f"prose-{i}", "p" * rng.randint(200, 600), "prose") for i in range(1000)]
    return write_docs(directory, rows)


def no_val(**kw) -> MixConfig:
    return MixConfig(**{**dict(weights={"code": 1, "prose": 1}, val_fraction=0.0,
                               min_val_docs=0, min_val_chars=0, num_workers=1), **kw})


@pytest.mark.parametrize("seed", range(6))
def test_one_document_holding_half_a_domain_does_not_block_its_share(tmp_path, seed):
    """code holds 4.6x what is asked, half of it in one document: wherever that document
    falls in the seeded order, the sample goes on past it and reaches the share (before,
    it ended there: 'too few and too long to sample finely', for some seeds)."""
    src = one_long_document_corpus(tmp_path / "in")
    m = run_mix(no_val(total=350_000, seed=seed), src, tmp_path / "out")
    for domain in ("code", "prose"):
        d = m["domains"][domain]
        assert d["achieved_share"] == pytest.approx(d["target_share"], rel=0.05), domain
    assert m["shortfalls"] == {}
    train_ids = read_split(tmp_path / "out", "train").column("id").to_pylist()
    assert "code-build" not in train_ids  # 400k characters never fit a 175k share


def test_skipping_long_documents_is_deterministic():
    """The same seed gives the same sample, a different seed another; the miss is below
    the tolerance or the shortest document left out."""
    units = np.array([400_000.0] + [float(1000 + 7 * i % 500) for i in range(400)])
    runs = [sample_copies(units, 175_000, domain_rng(s, "code", "sample")) for s in (1, 1, 2)]
    assert np.array_equal(runs[0], runs[1]) and not np.array_equal(runs[0], runs[2])
    for copies in runs:
        assert copies[0] == 0 and abs((units * copies).sum() - 175_000) <= 1750


@pytest.mark.parametrize("long_first", [False, True])
def test_a_long_document_skipped_at_the_end_is_traded_in_not_added_on_top(long_first):
    """Issue 46's lodash case at mix.total null: 600 short files and one 544k build, the
    share 956k. Walked with the build last, every short file is taken (600k) and the
    gap is still open: the build is traded in for short files taken last, so the
    sample lands on the share (before: added on top, +19.7 %); with the build first the
    walk takes it and fills the rest with short files, as it always did."""
    units = np.array([1000.0] * 600 + [544_000.0])
    if long_first:
        units = units[::-1].copy()
    chosen = fill_gap(units, 956_000.0, 9560.0)
    assert len(set(chosen.tolist())) == len(chosen)  # no document twice
    assert units[chosen].sum() == pytest.approx(956_000.0, abs=1000.0)
    assert 544_000.0 in units[chosen]
    # A document longer than the whole gap is never traded in: the short files stay.
    huge = np.array([1000.0] * 600 + [2_000_000.0])
    assert huge[fill_gap(huge, 956_000.0, 9560.0)].sum() == 600_000.0


def old_sample_copies(units: np.ndarray, target: float, rng: np.random.Generator) -> np.ndarray:
    """The sampler before issue 46: the seeded order's prefix nearest the target."""
    total = units.sum()
    copies = np.zeros(len(units), dtype=np.int64)
    if total <= 0 or target <= 0:
        return copies
    full = int(target // total)
    copies += full
    rest = target - full * total
    order = rng.permutation(len(units))
    cum = np.cumsum(units[order])
    k = int(np.searchsorted(cum, rest))
    if k < len(order) and (cum[k] - rest) < (rest - (cum[k - 1] if k else 0.0)):
        k += 1
    copies[order[:k]] += 1
    return copies


def test_the_demo_corpus_sample_is_unchanged(tmp_path, monkeypatch):
    """On the shipped demo's documents (raw, before filter and dedup) with params.yaml's
    mix, every domain gets the very copies the prefix sampler gave: no domain of short
    documents changes. (The whole demo through ingest to mix wrote the same bytes
    before and after issue 46, dvc.lock's data/mixed hash.)"""
    import gzip
    import json

    from lmforge.config import load_params
    from lmforge.data import mix

    ids, domains, chars = [], [], []
    for path in sorted((REPO / "data" / "raw" / "demo").glob("*/*.jsonl.gz")):
        with gzip.open(path, "rt", encoding="utf-8") as f:
            for line in f:
                ids.append(json.loads(line)["id"])
                domains.append(path.parent.name)
                chars.append(len(json.loads(line)["text"]))
    names = sorted(set(domains))
    codes = np.array([names.index(d) for d in domains], dtype=np.int16)
    # No clusters: each document is its own, ranked by its id within its domain.
    rank = np.zeros(len(ids), dtype=np.int64)
    for k in range(len(names)):
        idx = np.flatnonzero(codes == k)
        rank[idx[np.argsort([ids[i] for i in idx])]] = np.arange(len(idx))

    def docs() -> mix.Docs:
        return mix.Docs(names, codes, np.array(chars, dtype=np.int64), None, rank.copy(),
                        [len(ids)])

    cfg = load_params(REPO / "params.yaml").mix
    new = mix.plan_mix(cfg, docs(), tmp_path)
    monkeypatch.setattr(mix, "sample_copies", old_sample_copies)
    old = mix.plan_mix(cfg, docs(), tmp_path)
    assert len(new.by_domain) == 6 and np.array_equal(new.copies, old.copies)
    assert new.shortfalls == old.shortfalls


def test_a_domain_of_too_long_documents_names_only_remedies_that_work(tmp_path):
    """Two documents of 2.5x the ask each: the domain holds five times what is asked, but
    no whole document fits, whatever the epochs or weights: the error says so and names
    more or shorter documents, or accepting it."""
    rows = [(f"long-{i}", "l" * 250_000, "long") for i in range(2)]
    rows += [(f"prose-{i}", "p" * 400, "prose") for i in range(1000)]
    src = write_docs(tmp_path / "in", rows)
    with pytest.raises(InputError) as e:
        run_mix(no_val(weights={"long": 1, "prose": 1}, total=200_000), src, tmp_path / "out")
    assert str(e.value) == (
        "mix: long: asked 50.0% of the train split, got 0.0% (100% short; 0 epochs, its "
        "documents are too few and too long to sample finely: it took 0 of the 100,000 chars "
        "asked), above mix.max_shortfall 0.2: give long more or shorter documents, or accept "
        "it with mix.max_shortfall: 1.0")


def test_a_domain_holding_too_little_still_fails_with_the_epoch_remedies(tmp_path):
    """prose holds 20k characters, asked 100k at most 2 epochs: more epochs, a smaller
    weight or total, or accepting it would each close the gap."""
    rows = [(f"code-{i}", "c" * 1000, "code") for i in range(300)]
    rows += [(f"prose-{i}", "p" * 200, "prose") for i in range(100)]
    src = write_docs(tmp_path / "in", rows)
    with pytest.raises(InputError, match=r"^mix: prose: asked 50\.0% of the train split, got "
                                         r"\d+\.\d% \(\d+% short; 2 epochs, it is at "
                                         r"mix\.max_epochs 2\), above mix\.max_shortfall 0\.2: "
                                         r"raise mix\.max_epochs, lower mix\.weights\.prose or "
                                         r"mix\.total, or accept it with mix\.max_shortfall: "
                                         r"0\.\d+$"):
        run_mix(no_val(total=200_000, max_epochs=2.0), src, tmp_path / "out")
