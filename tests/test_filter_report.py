"""The filter report: per domain, per rule, rejections with examples and the measured
value beside the threshold; written by the stage, and by `lmforge filter report` for a
sample of the raw sources without writing filtered data."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from lmforge.cli import main as cli_main
from lmforge.config import DomainFilterConfig, FilterConfig
from lmforge.data.filter_report import EXAMPLES, render
from lmforge.data.filtering import loss_problems, run_filter
from lmforge.data.records import SCHEMA

ARTICLE = """The river bends slowly through the valley, past farms and old stone bridges.
In summer the children fish from the banks while the mill wheel turns beside them.
Nobody remembers who built the first bridge, but every spring the villagers repair it.
Travellers who stop at the inn hear stories about floods, weddings and a lost bell.
"""
TEXTS = [ARTICLE] * 6 + ["tiny"] * 5 + [ARTICLE + "=" * 900] * 2


def test_report_lists_rules_with_counts_and_examples(tmp_path):
    n = len(TEXTS)
    (tmp_path / "in").mkdir()
    pq.write_table(pa.table({"id": [f"d{i}" for i in range(n)], "text": TEXTS,
                             "domain": ["en"] * n, "source": ["s"] * n, "file": ["f"] * n,
                             "line": list(range(n))}, schema=SCHEMA),
                   tmp_path / "in" / "part-00000.parquet")
    cfg = FilterConfig(num_workers=1, domains={"en": DomainFilterConfig(min_docs=2)})
    examples: dict = {}
    metrics = run_filter(cfg, tmp_path / "in", tmp_path / "out", examples)
    assert [e[0] for e in examples["en"]["min_chars"]] == ["d6", "d7", "d8"][:EXAMPLES]
    report = render(cfg, metrics, examples, loss_problems(cfg, metrics))
    assert "| en | prose | 13 | 6 | 53.8% **over** | 0.5 | en 62%, sk 38% |" in report  # "tiny"
    assert "| min_chars | 5 | 5 | min 200 |" in report
    assert "| char_repeat | 2 | 2 | max 0.3 |" in report
    assert "| gopher_min_words | 0 | 5 | min 50 |" in report  # judged, though never first
    assert "- `min_chars` 4 (min 200) `d6`: tiny" in report
    assert "- filter: en lost 7 of 13 documents (54%, above max_loss 0.5)" in report
    assert report.count("- `min_chars`") == EXAMPLES


def test_cli_reports_a_sample_of_the_raw_sources(tmp_path, monkeypatch, capsys):
    raw = tmp_path / "raw" / "poems.jsonl"
    raw.parent.mkdir()
    poem = "静夜思\n床前明月光\n疑是地上霜\n举头望明月\n低头思故乡\n"
    raw.write_text("".join(json.dumps({"id": f"p{i}", "text": poem}) + "\n" for i in range(50)),
                   encoding="utf-8")
    (tmp_path / "params.yaml").write_text(
        "ingest:\n  sources:\n    - {path: raw/*.jsonl, domain: poems}\n"
        "mix:\n  weights: {poems: 1.0}\n", encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    cli_main(["filter", "report", "--sample", "20"])
    out = capsys.readouterr().out
    assert "| poems | prose | 20 | 0 | 100.0% **over** | 0.5 |" in out
    assert "| min_chars | 20 | 20 | min 200 |" in out
    assert "filter.domains.poems.max_loss: 1.0" in out
    assert not Path("data").exists()  # nothing written
    (tmp_path / "params.yaml").write_text(
        "ingest:\n  sources:\n    - {path: raw/*.jsonl, domain: poems}\n"
        "filter:\n  domains: {poems: {kind: verse}}\n"
        "mix:\n  weights: {poems: 1.0}\n", encoding="utf-8")
    cli_main(["filter", "report", "--sample", "20", "--out", "report.md"])
    assert "| poems | verse | 20 | 20 | 0.0% | 0.5 |" in Path("report.md").read_text(encoding="utf-8")
