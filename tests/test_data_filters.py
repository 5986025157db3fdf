"""Filter rules: one passing and one failing document per rule, per-domain overrides."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lmforge.config import DomainFilterConfig, FilterConfig, IngestConfig, Params, SourceConfig
from lmforge.data.filtering import run_filter
from lmforge.data.filters import RULES, domain_rules
from lmforge.data.records import SCHEMA
from lmforge.errors import ConfigError

EN = ("The river bends slowly through the valley, past farms and old stone bridges, "
      "where children fish in summer and the mill wheel turns. ") * 3
ZH = "河水缓缓流过山谷，经过农田和古老的石桥。夏天孩子们在这里钓鱼，磨坊的水车慢慢转动。" * 6
CODE = ("def area(radius: float) -> float:\n"
        "    # Circle area; radius in metres.\n"
        "    import math\n"
        "    return math.pi * radius ** 2\n\n"
        "# helper\n# another comment\n# and one more\nprint(area(2.0))\n") * 2


def fails(rule: str, text: str, cfg: FilterConfig | None = None, domain: str = "d") -> bool:
    cfg = cfg or FilterConfig(rules=[rule])
    rules = domain_rules(cfg, domain)
    r = RULES[rule]
    return r.fails(r.measure(text), rules.limits[r.threshold])


@pytest.mark.parametrize("good", [EN, ZH])
def test_every_rule_passes_clean_prose(good):
    for name in RULES:
        assert not fails(name, good), name


def test_min_chars_counts_characters_not_bytes():
    assert fails("min_chars", "short text")
    assert not fails("min_chars", ZH)  # 252 characters (756 bytes)
    zh_short = "短文本" * 40  # 120 characters, 360 bytes
    assert fails("min_chars", zh_short)


def test_hash_line_ratio():
    markdown_spam = "\n".join(["# buy", "# now", "# cheap", "text line"]) * 20
    assert fails("hash_line_ratio", markdown_spam)
    assert not fails("hash_line_ratio", "# Title\n\n" + EN)


def test_char_repeat_english_chinese_code():
    assert fails("char_repeat", "a" * 300 + " b c")
    assert fails("char_repeat", "哈" * 200 + "好的")
    assert fails("char_repeat", "=" * 200 + "\nsection title\n" + "=" * 200)
    assert not fails("char_repeat", CODE)
    assert not fails("char_repeat", ZH)


def test_control_chars():
    mojibake = EN[:200] + "\ufffd" * 5 + "\x07\x1b"
    assert fails("control_chars", mojibake)
    assert not fails("control_chars", EN + "\ttabs\r\nand newlines are fine\n")


def test_boilerplate_lines_chinese_and_english():
    ads = "\n".join(["点击这里免费领取", "关注公众号获取更多", "扫码加群", "Click here to win",
                     "Buy now!"]) + "\n" + EN
    assert fails("boilerplate", ads)
    # Everyday words that merely contain a cue are not advertising.
    tech = "\n".join(["IMAP4.subscribe(mailbox)", "端口转发", "我们关注性能", "limited by memory"] * 3)
    assert not fails("boilerplate", tech + EN)


def test_domain_override_of_rules_and_thresholds():
    cfg = FilterConfig(domains={
        "code": DomainFilterConfig(rules=["min_chars", "char_repeat"]),
        "poems": DomainFilterConfig(max_char_repeat_ratio=0.9),
    })
    comments = "\n".join(f"# comment {i}" for i in range(40)) + "\nx = 1\n"
    assert domain_rules(cfg, "code").first_failure(comments) is None
    assert domain_rules(cfg, "other").first_failure(comments)[0] == "hash_line_ratio"
    repeat = "之" * 150 + "不知" * 30
    assert domain_rules(cfg, "other").first_failure(repeat)[0] == "char_repeat"
    assert domain_rules(cfg, "poems").first_failure(repeat) is None


def test_unknown_rule_is_a_config_error():
    with pytest.raises(ConfigError, match="filter.rules: unknown rule.*gopher"):
        FilterConfig(rules=["min_chars", "gopher"]).validate()
    bad = FilterConfig(domains={"x": DomainFilterConfig(rules=["nope"])})
    with pytest.raises(ConfigError, match="filter.domains.x.rules"):
        bad.validate()


def test_filter_stage_writes_kept_and_rejects_with_rule(tmp_path):
    texts = [EN, "tiny", ZH, "a" * 400, CODE]
    domains = ["en", "en", "zh", "zh", "code"]
    n = len(texts)
    (tmp_path / "in").mkdir()
    pq.write_table(pa.table({"id": [f"d{i}" for i in range(n)], "text": texts, "domain": domains,
                             "source": ["s"] * n, "file": ["f"] * n, "line": list(range(n))},
                            schema=SCHEMA), tmp_path / "in" / "part-00000.parquet")
    cfg = FilterConfig(domains={"code": DomainFilterConfig(rules=["min_chars"])}, num_workers=1)
    metrics = run_filter(cfg, tmp_path / "in", tmp_path / "out")
    kept = pq.read_table(tmp_path / "out" / "part-00000.parquet").column("id").to_pylist()
    rej = pq.read_table(tmp_path / "out" / "rejects" / "part-00000.parquet").to_pydict()
    assert kept == ["d0", "d2", "d4"]
    assert dict(zip(rej["id"], rej["rule"], strict=True)) == {"d1": "min_chars", "d3": "char_repeat"}
    assert rej["text"] == ["tiny", "a" * 400]
    assert metrics["domains"]["en"] == {"in": 2, "kept": 1, "rejected": {"min_chars": 1}}
    assert metrics["total"]["in"] == n == metrics["total"]["kept"] + 2


def test_params_reject_override_for_unknown_domain():
    p = Params(ingest=IngestConfig(sources=[SourceConfig("x", "en")]),
               filter=FilterConfig(domains={"zh": DomainFilterConfig()}))
    p.mix.weights = {"en": 1.0}
    with pytest.raises(ConfigError, match="filter.domains"):
        p.validate()
