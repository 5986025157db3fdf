"""The loss guard: a domain the rules cut too far stops the filter stage with one line
naming the domain, the share, the rules with their counts and the override."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lmforge.config import DomainFilterConfig, FilterConfig, Params
from lmforge.data.filtering import loss_problems, run_filter
from lmforge.data.records import SCHEMA
from lmforge.errors import InputError

REPO = Path(__file__).resolve().parents[1]
ARTICLE = """The river bends slowly through the valley, past farms and old stone bridges.
In summer the children fish from the banks while the mill wheel turns beside them.
Nobody remembers who built the first bridge, but every spring the villagers repair it.
Travellers who stop at the inn hear stories about floods, weddings and a lost bell.
"""
POEMS = ["静夜思\n床前明月光\n疑是地上霜\n举头望明月\n低头思故乡\n",
         "春晓\n春眠不觉晓\n处处闻啼鸟\n夜来风雨声\n花落知多少\n",
         "登鹳雀楼\n白日依山尽\n黄河入海流\n欲穷千里目\n更上一层楼\n"]


def write_ingested(directory: Path, n_poems: int = 12, n_prose: int = 12) -> None:
    texts = [POEMS[i % 3] for i in range(n_poems)] + [ARTICLE] * n_prose
    domains = ["poems"] * n_poems + ["prose"] * n_prose
    n = len(texts)
    directory.mkdir(parents=True)
    pq.write_table(pa.table({"id": [f"d{i}" for i in range(n)], "text": texts, "domain": domains,
                             "source": ["s"] * n, "file": ["f"] * n, "line": list(range(n))},
                            schema=SCHEMA), directory / "part-00000.parquet")


def test_guard_names_domain_share_rules_and_override(tmp_path):
    write_ingested(tmp_path / "in")
    cfg = FilterConfig(num_workers=1)
    metrics = run_filter(cfg, tmp_path / "in", tmp_path / "out")
    assert metrics["domains"]["poems"]["kept"] == 0
    assert metrics["domains"]["poems"]["loss"] == 1.0
    assert metrics["domains"]["poems"]["kind"] == "prose"
    (line,) = loss_problems(cfg, metrics)
    assert "\n" not in line
    assert line == ("filter: poems lost 12 of 12 documents (100%, above max_loss 0.5): "
                    "min_chars 12; keep them with filter.domains.poems.skip: [min_chars] "
                    "(or a kind that fits the text, now prose), or accept the loss with "
                    "filter.domains.poems.max_loss: 1.0")


def test_the_override_and_the_right_kind_both_pass(tmp_path):
    write_ingested(tmp_path / "in")
    accepted = FilterConfig(num_workers=1, domains={"poems": DomainFilterConfig(max_loss=1.0,
                                                                                min_docs=0)})
    metrics = run_filter(accepted, tmp_path / "in", tmp_path / "a")
    assert loss_problems(accepted, metrics) == []
    verse = FilterConfig(num_workers=1, domains={"poems": DomainFilterConfig(kind="verse")})
    metrics = run_filter(verse, tmp_path / "in", tmp_path / "b")
    assert metrics["domains"]["poems"]["kept"] == 12 and loss_problems(verse, metrics) == []


def test_a_domain_left_with_too_few_documents(tmp_path):
    write_ingested(tmp_path / "in", n_poems=3)
    cfg = FilterConfig(num_workers=1, domains={"poems": DomainFilterConfig(kind="verse")})
    metrics = run_filter(cfg, tmp_path / "in", tmp_path / "out")
    (line,) = loss_problems(cfg, metrics)
    assert line.startswith("filter: poems kept 3 of 3 documents, fewer than min_docs 10 "
                           "(too few for a val split)")
    assert line.endswith("filter.domains.poems.min_docs: 3")
    assert "keep them" not in line  # nothing was removed: nothing to keep back
    cfg.domains["poems"].min_docs = 3
    assert loss_problems(cfg, metrics) == []


def test_the_stage_stops_after_writing_its_metrics(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(REPO))  # the stages package lives at the repo root
    from stages.filter import main

    write_ingested(tmp_path / "data" / "ingested")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InputError, match=r"^filter: poems lost 12 of 12 documents \(100%"):
        main(Params(filter=FilterConfig(num_workers=1)))
    metrics = json.loads((tmp_path / "metrics" / "filter.json").read_text(encoding="utf-8"))
    assert metrics["domains"]["poems"]["rejected"] == {"min_chars": 12}
    assert "filter: 24 in, 12 kept, 12 rejected" in capsys.readouterr().out
