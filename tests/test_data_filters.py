"""Filter rules: for every rule one passing and one failing document in English, Chinese
and code; per-domain application; PII; the stage's rejects and metrics."""

from __future__ import annotations

import dataclasses
import gzip
import json
import re
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lmforge.config import DomainFilterConfig, FilterConfig, load_params
from lmforge.data import pii, rule_names, rulebook
from lmforge.data.filtering import run_filter
from lmforge.data.filters import RULES, domain_rules
from lmforge.data.records import SCHEMA
from lmforge.data.rulebook import groups
from lmforge.data.textview import TextView
from lmforge.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]

EN = """The river bends slowly through the valley, past farms and old stone bridges.
In summer the children fish from the banks while the mill wheel turns beside them.
Nobody remembers who built the first bridge, but every spring the villagers repair it.
Travellers who stop at the inn hear stories about floods, weddings and a lost bell.
The innkeeper insists that the bell still rings under the water on stormy nights.
Most guests laugh politely, finish their soup, and walk down to the river to listen.
"""
ZH = """河水缓缓流过山谷，经过农田和古老的石桥。夏天孩子们在岸边钓鱼，磨坊的水车在一旁慢慢转动。
没有人记得第一座桥是谁修的，但每年春天村民都会把它修补一遍。路过的旅人在客栈歇脚时，
总能听到关于洪水、婚礼和一口失落铜钟的故事。店主坚持说，暴风雨的夜里还能听见钟声从水底传来。
大多数客人只是礼貌地笑笑，喝完汤，然后走到河边去听一听。第二天清晨，雾气还没有散去，
他们背起行囊继续赶路，只有少数人会在桥头回望一眼。
"""
CODE = '''def area(radius: float) -> float:
    """Return the area of a circle with the given radius in metres."""
    import math

    if radius < 0:
        raise ValueError("radius must not be negative")
    return math.pi * radius ** 2


def describe(shapes: list[float]) -> str:
    total = sum(area(r) for r in shapes)
    return f"{len(shapes)} circles covering {total:.2f} square metres"
'''
GOOD = {"en": EN, "zh": ZH, "code": CODE}
_TERMINAL = re.compile(r"[.!?。！？\"”]+(?=\s|$)")


def _lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.strip()]


def _words(text: str) -> list[str]:
    return TextView(text).words


def _strip_stop_words(text: str) -> str:
    stop = {"the", "and", "of", "to", "with", "that", "be", "have"} | set("的了是在和有不也就都这我他之乎者而其以于所焉矣")
    return " ".join(w for w in _words(text) if w.lower().strip(".,，。") not in stop)


# How to spoil a good document so that one rule rejects it (any language).
BAD: dict[str, Callable[[str], str]] = {
    "min_chars": lambda t: t[:40],
    "hash_line_ratio": lambda t: "\n".join("# " + ln for ln in _lines(t)),
    "char_repeat": lambda t: t + "=" * (2 * len(t)),
    "control_chars": lambda t: t + "\x07" * (len(t) // 20),
    "boilerplate": lambda t: t + "\nClick here to win!\n点击这里领取\n扫码关注\nBuy now!\n",
    "gopher_min_words": lambda t: " ".join(_words(t)[:20]),
    "gopher_max_words": lambda t: t,  # with gopher_max_words lowered below
    "gopher_min_avg_word_length": lambda t: " ".join(w[:1] for w in t.split()),
    "gopher_max_avg_word_length": lambda t: " ".join(w * 6 for w in t.split()),
    "gopher_symbol_ratio": lambda t: t + " #" * len(_words(t)),
    "gopher_bullet_lines": lambda t: "\n".join("• " + ln for ln in _lines(t)),
    "gopher_ellipsis_lines": lambda t: "\n".join(ln + "..." for ln in _lines(t)),
    "gopher_alpha_words": lambda t: t + " 1234" * len(_words(t)),
    "gopher_stop_words": _strip_stop_words,
    "gopher_dup_lines": lambda t: "\n".join(ln for ln in _lines(t) for _ in range(3)),
    "gopher_dup_paragraphs": lambda t: "\n\n".join([t.strip()] * 3 + ["end"]),
    "gopher_dup_line_chars": lambda t: "\n".join(ln for ln in _lines(t) for _ in range(3)),
    "gopher_dup_paragraph_chars": lambda t: "\n\n".join([t.strip()] * 3),
    **{f"gopher_top_{n}gram": (lambda t: t + " spam eggs" * len(_words(t))) for n in (2, 3, 4)},
    **{f"gopher_dup_{n}gram": (lambda t: t + "\n" + t) for n in range(5, 11)},
    "c4_lorem_ipsum": lambda t: t + "\nLorem ipsum dolor sit amet.",
    "c4_curly_bracket": lambda t: t + "\n{",
    "c4_javascript_lines": lambda t: t + "\nPlease enable JavaScript to view this page.",
    "c4_policy_lines": lambda t: t + "\nRead our privacy policy.",
    "c4_min_sentences": lambda t: _TERMINAL.sub("", t),
    "fineweb_line_punct": lambda t: _TERMINAL.sub("", t),
    "fineweb_short_lines": lambda t: "\n".join(t[i : i + 12] for i in range(0, len(t), 12)),
    "fineweb_dup_line_chars": lambda t: t + "\n" + _lines(t)[0],
    "fineweb_list_ratio": lambda t: "\n".join(_words(t)),
}
OVERRIDES = {"gopher_max_words": {"gopher_max_words": 20}}
# Rules that measure nothing on CJK text (word lengths): they must never reject it.
NOT_FOR_CJK = {"gopher_min_avg_word_length", "gopher_max_avg_word_length"}


def verdict(rule: str, text: str, **settings) -> tuple[bool, float | None]:
    """(rejected?, value) when only ``rule`` runs, with optional setting overrides."""
    cfg = FilterConfig(rules=[rule], skip=[], **{**OVERRIDES.get(rule, {}), **settings})
    r = RULES[rule]
    rules = domain_rules(cfg, "d")
    value = r.measure(TextView(text), rules.settings)
    return r.fails(value, rules.settings[r.threshold] if r.threshold else None), value


def test_every_rule_has_a_failing_example():
    assert set(BAD) == set(RULES)


@pytest.mark.parametrize("rule", sorted(RULES))
@pytest.mark.parametrize("lang", ["en", "zh"])
def test_rule_passes_good_and_rejects_bad_prose(rule, lang):
    good_fails, _ = verdict(rule, GOOD[lang])
    if rule == "gopher_max_words":
        good_fails, _ = verdict(rule, GOOD[lang], gopher_max_words=100_000)
    assert not good_fails, f"good {lang} text rejected by {rule}"
    bad_fails, value = verdict(rule, BAD[rule](GOOD[lang]))
    if lang == "zh" and rule in NOT_FOR_CJK:
        assert value is None and not bad_fails
    else:
        assert bad_fails, f"spoiled {lang} text passed {rule} (value {value})"


@pytest.mark.parametrize("rule", sorted(RULES))
def test_rule_on_code(rule):
    """Prose rules are skipped for a code domain; asked for, they still catch bad code."""
    code_domain = domain_rules(FilterConfig(domains={"py": DomainFilterConfig(kind="code")}), "py")
    names = {r.name for r in code_domain.rules}
    assert (rule in names) == (not RULES[rule].prose)
    if not RULES[rule].prose:
        assert not verdict(rule, CODE)[0], f"good code rejected by {rule}"
    assert verdict(rule, BAD[rule](CODE))[0], f"spoiled code passed {rule}"


def test_chinese_is_measured_in_characters():
    view = TextView(ZH)
    assert view.is_cjk and len(view.words) > 150  # one word per hanzi
    assert verdict("gopher_min_words", "床前明月光，疑是地上霜。" * 3)[0]  # 30 words < 50
    assert not verdict("min_chars", ZH)[0] and verdict("min_chars", "短文本" * 40)[0]


def test_groups_and_skip_resolve_to_rules():
    rules = domain_rules(FilterConfig(kind="web", rules=["min_chars", "fineweb"],
                                      skip=["fineweb_list_ratio"]), "d")
    assert [r.name for r in rules.rules] == ["min_chars", "fineweb_line_punct",
                                             "fineweb_short_lines", "fineweb_dup_line_chars"]


def test_domain_override_of_rules_and_thresholds():
    cfg = FilterConfig(rules=["char_repeat", "hash_line_ratio"], domains={
        "code": DomainFilterConfig(kind="code"),
        "poems": DomainFilterConfig(max_char_repeat_ratio=0.9),
        "asked": DomainFilterConfig(kind="code", rules=["hash_line_ratio"]),
    })
    comments = "\n".join(f"# comment {i}" for i in range(40)) + "\nx = 1\n"
    assert domain_rules(cfg, "code").first_failure(comments) is None
    assert domain_rules(cfg, "other").first_failure(comments)[0] == "hash_line_ratio"
    assert domain_rules(cfg, "asked").first_failure(comments)[0] == "hash_line_ratio"
    repeat = "之" * 150 + "不知" * 30
    assert domain_rules(cfg, "other").first_failure(repeat)[0] == "char_repeat"
    assert domain_rules(cfg, "poems").first_failure(repeat) is None


def test_unknown_rule_or_bad_threshold_is_a_config_error():
    with pytest.raises(ConfigError, match="filter.rules: unknown rule.*gopher_nope"):
        FilterConfig(rules=["min_chars", "gopher_nope"]).validate()
    with pytest.raises(ConfigError, match="filter.domains.x.skip"):
        FilterConfig(domains={"x": DomainFilterConfig(skip=["nope"])}).validate()
    with pytest.raises(ConfigError, match="filter.domains.x.fineweb_max_short_line_ratio"):
        FilterConfig(domains={"x": DomainFilterConfig(fineweb_max_short_line_ratio=2.0)}).validate()
    with pytest.raises(ConfigError, match="pii_kinds"):
        FilterConfig(pii_kinds=["email", "passport"]).validate()


def test_rule_names_module_matches_the_registry_exactly():
    """config validates against rule_names without importing the rules: it must name
    exactly the registered rules, in their groups and run order, and the PII kinds."""
    registered = {g: tuple(names) for g, names in groups().items()}
    assert registered == rule_names.RULE_GROUPS
    assert set(RULES) == rule_names.RULE_NAMES
    assert {n: r.group for n, r in RULES.items()} == rule_names.RULE_GROUP
    assert not rule_names.RULE_NAMES & set(rule_names.RULE_GROUPS)  # a name is one or the other
    fields = {f.name for f in dataclasses.fields(FilterConfig)}
    assert {r.threshold for r in RULES.values() if r.threshold} <= fields
    assert pii.KINDS == rule_names.PII_KINDS
    assert set(pii._FINDERS) == set(pii.PLACEHOLDERS) == set(rule_names.PII_KINDS)
    assert set(FilterConfig().pii_kinds) <= set(rule_names.PII_KINDS)
    assert not rule_names.unknown_rules(list(rule_names.RULE_GROUPS))


def test_an_undeclared_rule_cannot_register():
    with pytest.raises(ValueError, match="declare it in group 'basic'"):
        rulebook.rule("not_declared", None)(lambda view, settings: 0.0)
    with pytest.raises(ValueError, match="declare it in group 'c4'"):  # wrong group
        rulebook.rule("min_chars_again", None, group="c4")(lambda view, settings: 0.0)
    assert "not_declared" not in RULES and "min_chars_again" not in RULES


def _demo_docs(domain: str, n: int) -> list[str]:
    path = REPO / "data" / "raw" / "demo" / domain / "part-0000.jsonl.gz"
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line)["text"] for _, line in zip(range(n), f, strict=False)]


@pytest.mark.parametrize("domain", ["en_literature", "en_tech", "zh_modern", "zh_classical",
                                    "code_python", "math"])
def test_demo_domains_pass_with_the_shipped_params(domain):
    """Good documents of every demo domain pass the rules params.yaml gives that domain."""
    docs = _demo_docs(domain, 30)
    rules = domain_rules(load_params(REPO / "params.yaml").filter, domain)
    failed = [f for f in map(rules.first_failure, docs) if f]
    assert len(docs) == 30 and len(failed) <= 3, failed


# --------------------------------------------------------------------------- PII


def test_pii_finds_validated_personal_data_only():
    text = ("Mail jane.doe@example.org or call +1 415 555 0132 / 138-0013-8000. "
            "Server 8.8.8.8, LAN 192.168.1.1, version 1.2.3, 999.1.1.1. "
            "身份证 11010519491231002X, 错误 110105194912310021, 日期错 110105194913310029.")
    kinds = [(text[s:e], k) for s, e, k in pii.find(text)]
    assert kinds == [("jane.doe@example.org", "email"), ("+1 415 555 0132", "phone"),
                     ("138-0013-8000", "phone"), ("8.8.8.8", "ip"),
                     ("11010519491231002X", "cn_id")]
    red, counts = pii.redact(text, ["email", "cn_id"])
    assert "<EMAIL>" in red and "<ID_NUMBER>" in red and "8.8.8.8" in red
    assert counts == {"email": 1, "cn_id": 1}


def test_cn_id_checksum():
    assert pii.valid_cn_id("11010519491231002X")
    assert not pii.valid_cn_id("110105194912310021")  # wrong check character
    assert not pii.valid_cn_id("11010519490231002X")  # 31 February


# --------------------------------------------------------------------------- stage


def _write_in(tmp_path: Path, texts: list[str], domains: list[str]) -> None:
    n = len(texts)
    (tmp_path / "in").mkdir()
    pq.write_table(pa.table({"id": [f"d{i}" for i in range(n)], "text": texts, "domain": domains,
                             "source": ["s"] * n, "file": ["f"] * n, "line": list(range(n))},
                            schema=SCHEMA), tmp_path / "in" / "part-00000.parquet")


def test_filter_stage_writes_kept_and_rejects_with_rule(tmp_path):
    texts = [EN, "tiny", ZH, "a" * 400, CODE, EN + "\nWrite to me at jo@example.com today."]
    domains = ["en", "en", "zh", "zh", "code", "en"]
    _write_in(tmp_path, texts, domains)
    cfg = FilterConfig(domains={"code": DomainFilterConfig(kind="code", min_chars=100)},
                       pii="redact", num_workers=1)
    metrics = run_filter(cfg, tmp_path / "in", tmp_path / "out")
    kept = pq.read_table(tmp_path / "out" / "part-00000.parquet").to_pydict()
    rej = pq.read_table(tmp_path / "out" / "rejects" / "part-00000.parquet").to_pydict()
    assert kept["id"] == ["d0", "d2", "d4", "d5"]
    assert kept["text"][3].endswith("me at <EMAIL> today.")
    assert dict(zip(rej["id"], rej["rule"], strict=True)) == {"d1": "min_chars", "d3": "char_repeat"}
    assert rej["text"] == ["tiny", "a" * 400]
    en = metrics["domains"]["en"]
    assert (en["in"], en["kept"], en["rejected"]) == (3, 2, {"min_chars": 1})
    assert en["pii_redacted"] == {"email": 1}
    assert "gopher_stop_words" in en["rules"] and "gopher_stop_words" not in metrics["domains"]["code"]["rules"]
    for c in metrics["domains"].values():
        assert c["in"] == c["kept"] + sum(c["rejected"].values())


def test_pii_drop_rejects_the_document(tmp_path):
    _write_in(tmp_path, [EN, EN.replace("inn", "inn (call 555-123-4567)", 1)], ["en", "en"])
    metrics = run_filter(FilterConfig(pii="drop", num_workers=1), tmp_path / "in", tmp_path / "out")
    assert metrics["domains"]["en"]["rejected"] == {"pii": 1}
    rej = pq.read_table(tmp_path / "out" / "rejects" / "part-00000.parquet").to_pydict()
    assert rej["id"] == ["d1"] and rej["value"] == [1.0]
