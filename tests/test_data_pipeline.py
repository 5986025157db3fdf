"""The data stages end to end through their entry points: identity and determinism."""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

import pyarrow.parquet as pq

from lmforge.config import (
    DecontamConfig,
    DedupConfig,
    EvaluatePostConfig,
    FilterConfig,
    HarnessConfig,
    IngestConfig,
    MixConfig,
    Params,
    SourceConfig,
)

REPO = Path(__file__).resolve().parents[1]


def make_raw(root: Path) -> None:
    rng = random.Random(5)
    words = [f"word{i}" for i in range(500)]
    first = ""
    for domain in ("en", "zh"):
        for part in range(2):
            rows = []
            for i in range(30):
                if domain == "en":
                    text = " ".join(rng.choice(words) for _ in range(rng.randint(40, 200)))
                else:
                    text = "".join(chr(0x4E00 + rng.randrange(3000)) for _ in range(rng.randint(80, 400)))
                rows.append(json.dumps({"id": f"{domain}/{part}/{i}", "text": text}))
                first = first or text
            rows.append(rows[3].replace(f'/{part}/3"', f'/{part}/dup"'))  # exact duplicate text
            rows.append('{"id": "broken", "text": ')  # invalid JSON
            rows.append(json.dumps({"id": f"{domain}/{part}/short", "text": "too short"}))
            path = root / "data" / "raw" / domain / f"part-{part}.jsonl.gz"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(gzip.compress(("\n".join(rows) + "\n").encode(), mtime=0))
    # Evaluation sets for decontam: one item copied from a training document, one not.
    (root / "data" / "tasks").mkdir(parents=True)
    copied = " ".join(first.split()[:20])
    (root / "data" / "tasks" / "t.jsonl").write_text(json.dumps({"q": copied}) + "\n")
    (root / "data" / "test.jsonl").write_text(json.dumps({"q": "an item nobody wrote down before today at all"}) + "\n")


def params() -> Params:
    return Params(
        ingest=IngestConfig(sources=[SourceConfig("data/raw/en/*.jsonl.gz", "en"),
                                     SourceConfig("data/raw/zh/*.jsonl.gz", "zh")],
                            part_docs=25, num_workers=2),
        # Random-word documents have no stop words or sentences: the basic rules only.
        filter=FilterConfig(rules=["min_chars", "char_repeat", "control_chars"], min_chars=50,
                            num_workers=2),
        dedup=DedupConfig(num_workers=2),
        mix=MixConfig(weights={"en": 0.7, "zh": 0.3}, min_val_docs=2, part_docs=40,
                      num_workers=2),
        decontam=DecontamConfig(num_workers=2),
        harness=HarnessConfig(task_dir="data/tasks"),
        evaluate_post=EvaluatePostConfig(test="data/test.jsonl", test_mc=None, test_pref=None),
    )


def run_all(root: Path, monkeypatch) -> dict[str, dict]:
    monkeypatch.syspath_prepend(str(REPO))  # the stages package lives at the repo root
    from stages import decontam, dedup, filter, ingest, mix

    monkeypatch.chdir(root)
    p = params()
    p.validate()
    for stage in (ingest, filter, dedup, decontam, mix):
        stage.main(p)
    return {s: json.loads((root / "metrics" / f"{s}.json").read_text())
            for s in ("ingest", "filter", "dedup", "decontam", "mix")}


def test_pipeline_counts_add_up_and_outputs_are_byte_identical(tmp_path, monkeypatch):
    for run in ("a", "b"):
        make_raw(tmp_path / run)
    ma = run_all(tmp_path / "a", monkeypatch)
    mb = run_all(tmp_path / "b", monkeypatch)
    assert ma == mb
    files = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a" / "data").rglob("*.parquet"))
    assert any("mixed/val" in str(f) for f in files)
    for f in files:
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f

    for stage, m in ma.items():
        for domain, c in m["domains"].items():
            assert c["in"] == c["kept"] + sum(c["rejected"].values()), (stage, domain)
    # Each stage takes in what the previous one kept.
    for prev, nxt in (("ingest", "filter"), ("filter", "dedup"), ("dedup", "decontam"),
                      ("decontam", "mix")):
        for domain in ("en", "zh"):
            assert ma[nxt]["domains"][domain]["in"] == ma[prev]["domains"][domain]["kept"]
    assert ma["ingest"]["total"]["rejected"] == {"invalid_json": 4}
    assert ma["filter"]["total"]["rejected"] == {"min_chars": 4}
    assert ma["dedup"]["exact_dups"] == 4
    found = ma["decontam"]["sets"]["tasks"]
    assert found["contaminated"] + found["in_val_only"] == 1  # the copied item, wherever it went
    assert ma["decontam"]["sets"]["sft_test"]["contaminated"] == 0
    val = pq.read_table(tmp_path / "a" / "data" / "mixed" / "val").num_rows
    assert val == ma["mix"]["val_docs"] >= 4
