"""Domain kinds: each kind's rules keep clean text of that kind and still catch junk;
web pages keep the web-crawl rules; kind thresholds yield to values a user sets."""

from __future__ import annotations

import typing

import pytest

from lmforge.config import DomainFilterConfig, FilterConfig, FilterKind
from lmforge.data import kinds
from lmforge.data.filters import RULES, domain_rules
from lmforge.data.rule_names import RULE_NAMES

PLAY = """ACT I. SCENE II.
A room in the castle.
Enter the KING, the QUEEN, and LORD POLONIUS
KING
Though yet of our dear brother's death the memory be green, and that it us befitted
to bear our hearts in grief, yet so far hath discretion fought with nature
that we with wisest sorrow think on him, together with remembrance of ourselves.
QUEEN
Good Hamlet, cast thy nighted colour off, and let thine eye look like a friend on Denmark.
Do not for ever with thy vailed lids seek for thy noble father in the dust.
HAMLET
Ay, madam, it is common.
QUEEN
If it be, why seems it so particular with thee?
HAMLET
Seems, madam! nay it is; I know not seems.
Exeunt
"""
POEM_ZH = "静夜思\n床前明月光\n疑是地上霜\n举头望明月\n低头思故乡\n"
POEM_EN = """The Clod and the Pebble
Love seeketh not itself to please
Nor for itself hath any care
But for another gives its ease
And builds a heaven in hell's despair
So sang a little clod of clay
Trodden with the cattle's feet
But a pebble of the brook
Warbled out these metres meet
Love seeketh only self to please
To bind another to its delight
Joys in another's loss of ease
And builds a hell in heaven's despite
"""
MAN = """NAME
ls - list directory contents
SYNOPSIS
ls [OPTION]... [FILE]...
DESCRIPTION
List information about the FILEs (the current directory by default).
Sort entries alphabetically if none of -cftuvSUX nor --sort is specified.
-a, --all
do not ignore entries starting with .
-A, --almost-all
do not list implied . and ..
--author
with -l, print the author of each file
-b, --escape
print C-style escapes for nongraphic characters
--block-size=SIZE
with -l, scale sizes by SIZE when printing them
-B, --ignore-backups
do not list implied entries ending with ~
-c
with -lt: sort by, and show, ctime (time of last modification of file status information)
"""
GO = """package main

import (
\t"fmt"
\t"os"
)

// main prints its arguments, one per line.
func main() {
\tfor i, arg := range os.Args[1:] {
\t\tif arg == "" {
\t\t\tcontinue
\t\t}
\t\tfmt.Printf("%d: %s\\n", i, arg)
\t}
}
"""
MATH = """Let $x$ be a real number such that $x^2 - 5x + 6 = 0$. Find all possible values of $x$.
Solution: factor the left side as $(x - 2)(x - 3) = 0$, so $x = 2$ or $x = 3$.
Both values satisfy the equation, since $4 - 10 + 6 = 0$ and $9 - 15 + 6 = 0$.
Therefore the set of solutions is $\\{2, 3\\}$ and the sum of the solutions is $5$,
which agrees with the formula $-b/a = 5$ for the sum of the roots of a quadratic.
"""
ARTICLE = """The river bends slowly through the valley, past farms and old stone bridges.
In summer the children fish from the banks while the mill wheel turns beside them.
Nobody remembers who built the first bridge, but every spring the villagers repair it.
Travellers who stop at the inn hear stories about floods, weddings and a lost bell.
The innkeeper insists that the bell still rings under the water on stormy nights.
Most guests laugh politely, finish their soup, and walk down to the river to listen.
"""
MENU = "Home\nAbout us\nProducts\nContact\nLogin\n" + ARTICLE + "Share\nTweet\nMore\nTags\nNews\nBlog\n" * 2
COOKIES = ARTICLE + "This site uses cookies. Read our privacy policy.\n"
TICKET = """Customer: Hi, my order #48213 still hasn't arrived.
Agent: Sorry about that! Can you confirm the delivery address?
Customer: 12 Elm St, Springfield.
Agent: Thanks. It left the depot today, ETA Friday.
Customer: ok great, thanks
Agent: You're welcome :)
"""
CHAT_ZH = "用户：你好，我的快递到哪了？\n客服：您好，请提供订单号。\n用户：20231105\n客服：已发出，明天到。\n用户：好的谢谢"
REVIEW_ZH = "屏幕很清晰，电池也耐用，好评！"
REVIEW_EN = "Great kettle, boils fast."
TITLE = "Stormy weather"
TWEET = "Thank you #VeteransDay"


def first_failure(kind: str, text: str, **settings) -> str | None:
    cfg = FilterConfig(domains={"d": DomainFilterConfig(kind=kind, **settings)})
    failure = domain_rules(cfg, "d").first_failure(text)
    return failure[0] if failure else None


def test_kinds_are_the_config_choices_and_name_known_rules():
    assert set(typing.get_args(FilterKind)) == set(kinds.KINDS)
    assert FilterConfig().kind in kinds.KINDS
    fields = set(FilterConfig.__dataclass_fields__)
    for kind, rules in kinds.KIND_RULES.items():
        assert set(rules) <= RULE_NAMES and len(set(rules)) == len(rules), kind
        assert set(kinds.KIND_SETTINGS[kind]) <= fields, kind
    # Code runs exactly the rules that judge any text.
    assert set(kinds.KIND_RULES["code"]) == {n for n, r in RULES.items() if not r.prose}


@pytest.mark.parametrize(("kind", "text"), [
    ("web", ARTICLE), ("prose", ARTICLE), ("prose", PLAY), ("verse", POEM_ZH),
    ("verse", POEM_EN), ("reference", MAN), ("math", MATH), ("code", GO),
    ("dialogue", TICKET), ("dialogue", CHAT_ZH), ("short", REVIEW_ZH), ("short", REVIEW_EN),
    ("short", TITLE), ("short", TWEET), ("short", "Broke after a week...."),
])
def test_each_kind_keeps_clean_text_of_its_kind(kind, text):
    assert first_failure(kind, text) is None


@pytest.mark.parametrize(("text", "web_rule"), [
    (PLAY, "fineweb_dup_line_chars"), (POEM_ZH, "min_chars"), (POEM_EN, "fineweb_line_punct"),
    (GO, "gopher_min_words"), (TICKET, "gopher_min_words"), (CHAT_ZH, "min_chars"),
    (REVIEW_EN, "min_chars"), (TWEET, "min_chars"),
])
def test_the_web_rules_would_reject_them(text, web_rule):
    """Why kinds: the web rules reject each of these clean texts wholesale."""
    kind_of = {PLAY: "prose", POEM_ZH: "verse", POEM_EN: "verse", GO: "code",
               TICKET: "dialogue", CHAT_ZH: "dialogue", REVIEW_EN: "short", TWEET: "short"}
    assert first_failure("web", text) == web_rule
    assert first_failure(kind_of[text], text) is None


@pytest.mark.parametrize(("text", "rule"), [
    (MENU, "fineweb_short_lines"), (COOKIES, "c4_policy_lines"),
    (ARTICLE + "\nLorem ipsum dolor sit amet.", "c4_lorem_ipsum"),
])
def test_web_text_still_gets_the_web_rules(text, rule):
    assert first_failure("web", text) == rule


@pytest.mark.parametrize("kind", kinds.KINDS)
def test_every_kind_still_rejects_junk(kind):
    assert first_failure(kind, "short") == "min_chars"
    assert first_failure(kind, ARTICLE + "\x07" * 100) in ("control_chars", "gopher_alpha_words")
    assert first_failure(kind, ARTICLE + "=" * 2000) in ("char_repeat", "gopher_alpha_words",
                                                          "gopher_max_avg_word_length")


@pytest.mark.parametrize(("kind", "text", "rule"), [
    ("short", "wow!", "min_chars"), ("short", "好评！", "min_chars"),
    ("short", "!!!!!!!!!!!!!!!!!!", "char_repeat"),
    ("short", "12 34 56 78 90 ok", "gopher_alpha_words"),
    ("dialogue", "User: Hi\nBot: Hello", "min_chars"),
    ("dialogue", "User: Hello\nBot: Greetings!", "gopher_min_words"),
    ("dialogue", TICKET + "Agent: click here for a free trial\n" * 4, "boilerplate"),
    ("dialogue", "User: " + "buy cheap watches at our store today " * 8, "gopher_dup_5gram"),
])
def test_short_kinds_still_drop_fragments_and_spam(kind, text, rule):
    assert first_failure(kind, text) == rule


GENERATED = {
    "code_generated_header": [
        "// Code generated by protoc-gen-go. DO NOT EDIT.\n// source: api.proto\n\npackage api\n" + GO,
        "# -*- coding: utf-8 -*-\n# Generated by the protocol buffer compiler.  DO NOT EDIT!\n" + GO,
        "# This file is automatically @generated by Poetry 1.8.2 and should not be changed by hand.\n"
        + "[[package]]\nname = \"attrs\"\n" * 20,
    ],
    "code_lock_file": [
        '{\n  "name": "app",\n  "version": "1.0.0",\n  "lockfileVersion": 3,\n  "requires": true,\n'
        + '  "packages": {"node_modules/a": {"version": "1.0.0"}},\n' * 5 + "}\n",
        "\n".join(f"github.com/pkg/mod{i} v1.{i}.0 h1:abcdefghijklmnopqrstuvwxyzABCDEF0123456789ab=" for i in range(9)),
    ],
    "code_max_line_length": ["!function(e){var t={};" + "e.exports=function(n){return t[n]};" * 60 + "}();"],
    "code_mean_line_length": ["DATA = [\n" + ("    " + "0x1f, " * 30 + "\n") * 20 + "]\n"],
}


@pytest.mark.parametrize(("rule", "text"), [(r, t) for r, ts in GENERATED.items() for t in ts])
def test_code_drops_files_nobody_wrote_under_their_own_reason(rule, text):
    assert first_failure("code", text) == rule


def test_code_keeps_a_file_that_mentions_generation():
    text = ('"""Helpers for generated code: we never edit those files by hand."""\n' + GO)
    assert first_failure("code", text) is None


def test_kind_thresholds_yield_to_values_the_user_sets():
    verse = domain_rules(FilterConfig(domains={"p": DomainFilterConfig(kind="verse")}), "p")
    assert verse.settings["min_chars"] == 20 and verse.settings["max_char_repeat_ratio"] == 0.5
    tuned = FilterConfig(min_chars=100, domains={"p": DomainFilterConfig(kind="verse")})
    assert domain_rules(tuned, "p").settings["min_chars"] == 100  # global value set: it wins
    own = FilterConfig(domains={"p": DomainFilterConfig(kind="verse", min_chars=5)})
    assert domain_rules(own, "p").settings["min_chars"] == 5


def test_rules_narrow_a_kind_and_a_domain_list_is_exact():
    narrowed = FilterConfig(rules=["basic"], domains={"g": DomainFilterConfig(kind="code")})
    assert [r.name for r in domain_rules(narrowed, "g").rules] == [
        "min_chars", "char_repeat", "control_chars"]  # the code kind's basic rules
    assert [r.name for r in domain_rules(narrowed, "x").rules] == [
        "min_chars", "hash_line_ratio", "char_repeat", "control_chars", "boilerplate"]
    exact = FilterConfig(domains={"g": DomainFilterConfig(kind="code", rules=["c4"],
                                                          skip=["c4_curly_bracket"])})
    assert [r.name for r in domain_rules(exact, "g").rules] == [
        "c4_lorem_ipsum", "c4_javascript_lines", "c4_policy_lines", "c4_min_sentences"]


WIKI = """'''Autism''' is a [[neurodevelopmental disorder]] characterized by impaired
[[social interaction]], verbal and non-verbal communication, and restricted and repetitive
behavior.<ref name="DSM5">{{cite book | title = Diagnostic and Statistical Manual |
edition = 5th | year = 2013 | isbn = 978-0-89042-555-8 | pages = 50-59}}</ref> Parents
usually notice signs in the first two years of their child's life.<ref name=Land2008>{{cite
journal | author = Landa RJ | year = 2008 | volume = 4 | issue = 3 | pages = 138-47 |
doi = 10.1038/ncpneuro0731 | pmid = 18253102}}</ref> These signs often develop gradually,
though some children with autism reach their developmental milestones at a normal pace
and then worsen.<ref>{{cite journal | vauthors = Stefanatos GA | year = 2008 | volume = 18
| issue = 4 | pages = 305-19 | pmid = 18956241}}</ref>
"""


def test_reference_keeps_wikitext_whose_citation_templates_are_not_words():
    """Citation templates put '|', '=' and numbers among the words (bench/RESULTS.md)."""
    assert first_failure("prose", WIKI) == "gopher_alpha_words"
    assert first_failure("reference", WIKI) is None
