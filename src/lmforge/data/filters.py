"""Quality filter rules: small, named measurements of a text, each with a threshold.

In the spirit of datatrove's filter blocks: a rule is a name, a function that
measures one property of a document, the ``filter.*`` threshold it is compared with,
and the direction (reject above or below). Adding a rule (Gopher repetition, C4
lines, FineWeb ratios, PII) is one ``@rule`` function here plus its threshold key.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from lmforge.config import FilterConfig


@dataclass(frozen=True)
class Rule:
    """``measure(text)`` compared with the threshold named ``threshold``."""

    name: str
    measure: Callable[[str], float]
    threshold: str
    reject_below: bool = False  # True: a value under the threshold fails (a minimum)

    def fails(self, value: float, limit: float) -> bool:
        return value < limit if self.reject_below else value > limit


RULES: dict[str, Rule] = {}


def rule(name: str, threshold: str, reject_below: bool = False):
    """Register ``measure`` as rule ``name`` checked against ``filter.<threshold>``."""

    def register(measure: Callable[[str], float]) -> Callable[[str], float]:
        RULES[name] = Rule(name, measure, threshold, reject_below)
        return measure

    return register


# --------------------------------------------------------------------------- rules


@rule("min_chars", "min_chars", reject_below=True)
def char_count(text: str) -> float:
    """Characters (not bytes) once surrounding whitespace is stripped."""
    return len(text.strip())


@rule("hash_line_ratio", "max_hash_line_ratio")
def hash_line_ratio(text: str) -> float:
    """Share of non-empty lines that start with '#' (markdown headers, hashtag spam)."""
    lines = [ln.lstrip() for ln in text.splitlines() if ln.strip()]
    return sum(ln.startswith("#") for ln in lines) / len(lines) if lines else 0.0


@rule("char_repeat", "max_char_repeat_ratio")
def char_repeat_ratio(text: str) -> float:
    """Share of non-space characters taken by the single most frequent one."""
    # Counting code points with numpy is ~10x faster than collections.Counter.
    cp = np.frombuffer("".join(text.split()).encode("utf-32-le"), dtype="<u4")
    if not len(cp):
        return 0.0
    _, counts = np.unique(cp, return_counts=True)
    return int(counts.max()) / len(cp)


# C0/C1 controls other than tab/newline/CR, and U+FFFD (what a bad decode leaves).
_CONTROL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\ufffd]")


@rule("control_chars", "max_control_char_ratio")
def control_char_ratio(text: str) -> float:
    """Share of control and replacement characters (mojibake, binary junk)."""
    return len(_CONTROL.findall(text)) / len(text) if text else 0.0


# Advertising / call-to-action phrases, Chinese and English. Phrases, not bare words:
# "转发" (forwarding) and "subscribe" (an API name) are everyday words in technical text.
_BOILERPLATE = re.compile(
    r"点击(这里|此处|下方|链接|阅读|关注|购买|领取|查看)|关注(我们|公众号|微信|本号|作者)|"
    r"扫码|扫一扫|二维码|免费领取|加微信|添加微信|长按识别|阅读原文|优惠券|"
    r"\bclick here\b|\bsubscribe (now|today|to (our|my|the) (channel|newsletter|list))\b|"
    r"\bbuy now\b|\bfollow us\b|\bsign up (now|today|for (free|our))\b|"
    r"\blimited[- ]time offer\b|\bfree trial\b|\bshare this (post|article|page)\b|"
    r"\bcookie policy\b|\ball rights reserved\b",
    re.IGNORECASE,
)


# Literal cues of the patterns above: a text with none of them (nearly all) is passed
# after a few C-speed substring scans, without running the regex on every line.
_BOILERPLATE_CUES = ("点击", "关注", "扫码", "扫一扫", "二维码", "免费领取", "微信", "长按识别",
                     "阅读原文", "优惠券", "click here", "subscribe", "buy now", "follow us",
                     "sign up", "limited", "free trial", "share this", "cookie policy",
                     "all rights reserved")


@rule("boilerplate", "max_boilerplate_lines")
def boilerplate_lines(text: str) -> float:
    """Lines that carry advertising / boilerplate phrases (点击这里, 关注公众号, click here ...)."""
    low = text.lower()
    hit_lines: set[int] = set()
    seen_lines: set[int] = set()
    for cue in _BOILERPLATE_CUES:
        at = low.find(cue)
        while at != -1:
            start = low.rfind("\n", 0, at) + 1
            end = low.find("\n", at)
            end = len(low) if end == -1 else end
            if start not in seen_lines:  # run the full pattern once per cue-bearing line
                seen_lines.add(start)
                if _BOILERPLATE.search(low, start, end):
                    hit_lines.add(start)
            at = low.find(cue, end)
    return len(hit_lines)


# --------------------------------------------------------------------------- per domain


@dataclass(frozen=True)
class DomainRules:
    """The rules one domain runs, with their thresholds resolved."""

    rules: tuple[Rule, ...]
    limits: dict[str, float]

    def first_failure(self, text: str) -> tuple[str, float] | None:
        """(rule name, measured value) of the first rule that rejects ``text``, or None."""
        for r in self.rules:
            value = r.measure(text)
            if r.fails(value, self.limits[r.threshold]):
                return r.name, value
        return None


def unknown_rules(names: list[str]) -> list[str]:
    """The names in ``names`` that are not registered rules."""
    return [n for n in names if n not in RULES]


def domain_rules(cfg: FilterConfig, domain: str) -> DomainRules:
    """Resolve ``filter.domains.<domain>`` overrides over the defaults."""
    override = cfg.domains.get(domain)
    names = override.rules if override and override.rules is not None else cfg.rules
    rules = tuple(RULES[n] for n in names)
    limits: dict[str, float] = {}
    for r in rules:
        value = getattr(override, r.threshold, None) if override else None
        limits[r.threshold] = value if value is not None else getattr(cfg, r.threshold)
    return DomainRules(rules, limits)
