"""The loss guard: a domain the rules cut too far stops the filter stage with one line
naming the domain, the share, the rules with their counts and the override."""

from __future__ import annotations

import dataclasses
import json
import re
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lmforge.config import DomainFilterConfig, FilterConfig, Params
from lmforge.data.filter_advice import domain_samples, smallest_skip
from lmforge.data.filtering import guarded_domains, loss_problems, run_filter
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
    assert line.startswith("filter: poems lost 12 of 12 documents (100%, above max_loss 0.5): "
                           "min_chars 12 (the first rule failed; every rule they fail: ")
    assert line.endswith("or accept the loss with filter.domains.poems.max_loss: 1.0")


def _apply(cfg: FilterConfig, domain: str, option: str) -> FilterConfig:
    """``cfg`` with one printed option (``filter.domains.D.kind: K`` or ``.skip: [..]``)."""
    key, value = option.split(": ", 1)
    override = dataclasses.replace(cfg.domains.get(domain) or DomainFilterConfig())
    if key.endswith(".kind"):
        override.kind = value.split(" ")[0]
    else:
        override.skip = [r.strip() for r in value[1:value.index("]")].split(",")]
    return dataclasses.replace(cfg, domains={**cfg.domains, domain: override})


@pytest.mark.parametrize("start", ["prose", "web"])
def test_following_the_advice_once_passes_the_guard(tmp_path, start):
    """Every option the guard prints (a kind, the smallest skip list) passes next time."""
    write_ingested(tmp_path / "in")
    cfg = FilterConfig(num_workers=1, kind=start)
    failures: dict = {}
    metrics = run_filter(cfg, tmp_path / "in", tmp_path / "out", failures=failures)
    samples = domain_samples(tmp_path / "in", guarded_domains(cfg, metrics))
    (line,) = loss_problems(cfg, metrics, failures, samples)
    options = re.findall(r"filter\.domains\.poems\.(?:kind: \w+|skip: \[[^\]]*\])", line)
    assert [o.split(":")[0].rsplit(".", 1)[1] for o in options] == ["kind", "skip"], line
    assert "filter.domains.poems.kind: verse (keeps 100% of its 12 documents" in line
    skip = options[1]
    # min_chars alone (what the old message said) keeps nothing: every rule is judged.
    assert "min_chars" in skip and skip != "filter.domains.poems.skip: [min_chars]"
    for n, option in enumerate(options):
        fixed = _apply(cfg, "poems", option)
        again = run_filter(fixed, tmp_path / "in", tmp_path / f"again{n}")
        assert loss_problems(fixed, again) == [], option


def _apply_all(cfg: FilterConfig, domain: str, option: str) -> FilterConfig:
    """``cfg`` with every ``filter.domains.D.<key>: <value>`` setting one printed option
    names (a kind, a skip list, languages, pii), applied exactly as printed."""
    override = dataclasses.replace(cfg.domains.get(domain) or DomainFilterConfig())
    found = re.findall(rf"filter\.domains\.{domain}\.(\w+): (\[[^\]]*\]|\w+)", option)
    assert found, option
    for key, value in found:
        listed = [v.strip() for v in value[1:-1].split(",")] if value.startswith("[") else value
        setattr(override, key, listed)
    return dataclasses.replace(cfg, domains={**cfg.domains, domain: override})


def _options(line: str) -> list[str]:
    """The options of a guard line's 'keep them with A or B, or accept ...' clause."""
    keep = line.split("; keep them with ", 1)[1].split(", or accept the loss", 1)[0]
    return keep.split(" or ")


def _poems_with_email(directory: Path) -> None:
    """The guard test's domains, each poem signed with an e-mail address (PII)."""
    write_ingested(directory)
    table = pq.read_table(directory / "part-00000.parquet").to_pydict()
    table["text"] = [t + "投稿 li.bai@example.com\n" if d == "poems" else t
                     for t, d in zip(table["text"], table["domain"], strict=True)]
    pq.write_table(pa.table(table, schema=SCHEMA), directory / "part-00000.parquet")


@pytest.mark.parametrize(("start", "step", "setting"), [
    ("prose", {"languages": ["en"]}, "languages: [en, "),  # the rules and the language
    ("web", {"languages": ["en"]}, "languages: [en, "),
    ("verse", {"languages": ["en"]}, "languages: [en, "),  # the language step alone
    ("prose", {"pii": "drop"}, "pii: redact"),  # the rules and the PII step
    ("verse", {"pii": "drop"}, "pii: redact"),  # the PII step alone
])
def test_advice_counts_the_language_and_pii_steps(tmp_path, start, step, setting):
    """Followed once, every option passes the guard: each one gives back what the
    language and PII steps reject as well as the rules (issue 43, defect 5: 'kind: verse
    (keeps 100 %)' kept 0 of 12 Chinese poems with languages: [en])."""
    if "pii" in step:
        _poems_with_email(tmp_path / "in")
    else:
        write_ingested(tmp_path / "in")
    cfg = FilterConfig(num_workers=1, kind=start, **step)
    failures: dict = {}
    metrics = run_filter(cfg, tmp_path / "in", tmp_path / "out", failures=failures)
    assert metrics["domains"]["poems"]["kept"] == 0 and metrics["domains"]["prose"]["kept"] == 12
    samples = domain_samples(tmp_path / "in", guarded_domains(cfg, metrics))
    (line,) = loss_problems(cfg, metrics, failures, samples)
    options = _options(line)
    assert options, line
    for n, option in enumerate(options):
        fixed = _apply_all(cfg, "poems", option)
        again: dict = {}
        metrics = run_filter(fixed, tmp_path / "in", tmp_path / f"again{n}", failures=again)
        assert loss_problems(fixed, metrics, again) == [], option
    # Each names the step that rejects them all, besides any rule or kind.
    assert all(f"filter.domains.poems.{setting}" in o for o in options), line


def test_the_smallest_skip_list_is_exact():
    failures = Counter({("a",): 5, ("a", "b"): 3, ("b", "c"): 4, ("c",): 1})
    assert smallest_skip(failures, kept=2, need=7) == (["a"], 7)
    assert smallest_skip(failures, kept=2, need=10) == (["a", "b"], 10)
    assert smallest_skip(failures, kept=2, need=11) == (["a", "b", "c"], 15)  # no pair is enough
    assert smallest_skip(failures, kept=2, need=15) == (["a", "b", "c"], 15)
    assert smallest_skip(failures, kept=2, need=16) is None  # more than there are


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
