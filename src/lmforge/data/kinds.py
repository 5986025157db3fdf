"""Domain kinds: the rules and thresholds that fit each kind of text (names and numbers only).

A domain declares ``kind`` (``filter.domains.<d>.kind``, else ``filter.kind``). Its kind
decides which rules can run on it: ``filter.rules`` (when given) is intersected with the
kind's rules, a domain's own ``rules`` list is taken as is, and ``skip`` takes rules out.
A kind also moves some thresholds, but only while ``filter.<key>`` is at its default: a
value set globally or per domain wins. README ("Filter kinds") gives the reason for each
exclusion; tests/test_filter_kinds.py runs every kind on samples of its text.
"""

from __future__ import annotations

from typing import Any

from lmforge.data.rule_names import RULE_GROUPS

_BASIC = RULE_GROUPS["basic"]
_QUALITY = RULE_GROUPS["gopher_quality"]
_REPETITION = RULE_GROUPS["gopher_repetition"]
_FINEWEB = RULE_GROUPS["fineweb"]


def _without(rules: tuple[str, ...], *drop: str) -> tuple[str, ...]:
    return tuple(r for r in rules if r not in drop)


# Kind -> the rules it runs, in run order.
KIND_RULES: dict[str, tuple[str, ...]] = {
    # Web pages: everything the web-crawl filters were tuned on (Gopher, FineWeb's line
    # rules, C4's placeholder / javascript / cookie-policy lines).
    "web": (*_BASIC, *_QUALITY, *_REPETITION, *_FINEWEB,
            "c4_lorem_ipsum", "c4_javascript_lines", "c4_policy_lines"),
    # Edited text (books, essays, articles, plays): FineWeb's line rules judge web
    # lines (menus, teasers); dialogue, verse quotations and headings fail them.
    "prose": (*_BASIC, *_QUALITY, *_REPETITION, "fineweb_list_ratio"),
    # Poems, lyrics: short lines without final punctuation, refrains, terse lines with
    # few function words, and short whole documents.
    "verse": _without((*_BASIC, *_QUALITY), "gopher_stop_words"),
    # Reference and markup (docs, man pages, wikitext): headings, option lists and
    # signatures are short, unpunctuated lines and repeat identifiers; '#', '--' and
    # '...' are syntax, not spam.
    "reference": (*_without((*_BASIC, *_QUALITY), "gopher_symbol_ratio"), *_REPETITION),
    # Mathematics: formulas are not words, worked solutions repeat their expressions.
    "math": (*_BASIC, "gopher_min_words", "gopher_max_words", "gopher_bullet_lines",
             "gopher_ellipsis_lines", "gopher_stop_words"),
    # Source code: only the rules that judge any text (length, one dominant character,
    # control characters), and the ones that find code nobody wrote (a generated-file
    # header, lock files, minified or data-only files with very long lines).
    "code": ("min_chars", "char_repeat", "control_chars", *RULE_GROUPS["code_generated"]),
    # Chat transcripts, support tickets, forum threads: turns are short, speaker labels
    # repeat (no top-n-gram or duplicate-line rules), a question may have no stop word,
    # '...' ends many a turn, and FineWeb's and C4's line rules judge web lines. Spam
    # and pasted junk are still caught: word lengths, symbols, letters, ads, and the
    # duplicated 5-10-grams of copied blocks.
    "dialogue": (*_without(_BASIC, "hash_line_ratio"),
                 *_without(_QUALITY, "gopher_stop_words", "gopher_ellipsis_lines",
                           "gopher_bullet_lines"),
                 *(f"gopher_dup_{n}gram" for n in range(5, 11))),
    # Reviews, titles, messages: a document may be one sentence or a title, so every
    # rule about lines, paragraphs, n-grams or stop words measures noise; '#' starts a
    # hashtag (the symbol ratio counts it) and a trailing '...' is a trailing thought.
    # Length, one dominant character, control characters, ads, word lengths and
    # letters remain.
    "short": (*_without(_BASIC, "hash_line_ratio"),
              *_without(_QUALITY, "gopher_stop_words", "gopher_ellipsis_lines",
                        "gopher_bullet_lines", "gopher_symbol_ratio")),
}
KINDS: tuple[str, ...] = tuple(KIND_RULES)

# Gopher's n-gram limits assume words; with a CJK character counted as a word a 5-gram
# is two or three words, and edited text quotes set phrases and repeats names.
_LOOSE_NGRAMS = {f"gopher_max_dup_{n}gram_ratio": round(0.3 - 0.02 * (n - 5), 2)
                 for n in range(5, 11)}

# Kind -> thresholds it moves off the defaults (while those are at their defaults).
KIND_SETTINGS: dict[str, dict[str, Any]] = {
    "web": {},
    "prose": dict(_LOOSE_NGRAMS),
    # A quatrain is 20-30 characters; a refrain or 之/不 may take a fifth of a poem.
    "verse": {"min_chars": 20, "gopher_min_words": 10, "max_char_repeat_ratio": 0.5},
    # Short entries (a man page's NAME section, a glossary term, an API entry: a heading,
    # a signature and one sentence, ~100 characters and 10 words, whose one function word
    # may be its only stop word: "Creates and returns a new Gzip object."); markup (wiki
    # citation templates, reST roles, tables) puts '|', '=' and numbers among the words,
    # so fewer of them hold letters (measured: wikitext sections at 0.73-0.80, and API
    # docs, bench/RESULTS.md).
    "reference": {"min_chars": 100, "gopher_min_words": 10, "gopher_min_stop_words": 1,
                  "gopher_min_alpha_words_ratio": 0.6, **_LOOSE_NGRAMS},
    # A problem statement may be one sentence.
    "math": {"gopher_min_words": 20},
    "code": {},
    # The notes' first pass drops fragments under 20 characters; a short exchange
    # ("User: Where is my order?" / "Bot: It shipped today.") is a few words. Emoticons,
    # '?!' and order numbers are no-letter tokens: a turn of six words with one is 0.83.
    "dialogue": {"min_chars": 20, "gopher_min_words": 5, "gopher_min_alpha_words_ratio": 0.6,
                 "gopher_max_symbol_word_ratio": 0.2, **_LOOSE_NGRAMS},
    # A title ("Stormy weather") is two words; ':)', '5/5' and prices are a larger share
    # of a short text; 好评！ (3 characters) and "wow!" are left out by min_chars 10; one
    # character may be a third of a short review (好好好, "!!!").
    "short": {"min_chars": 10, "gopher_min_words": 2, "gopher_min_alpha_words_ratio": 0.6,
              "max_char_repeat_ratio": 0.4},
}
