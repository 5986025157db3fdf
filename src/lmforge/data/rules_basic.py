"""The rules of the practice notes: length, '#' lines, one dominant character,
control characters and advertising boilerplate."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from lmforge.data.rulebook import rule
from lmforge.data.textview import TextView


@rule("min_chars", "min_chars", reject_below=True, prose=False)
def char_count(view: TextView, settings: Mapping[str, Any]) -> float:
    """Characters (not bytes) once surrounding whitespace is stripped."""
    return len(view.text.strip())


@rule("hash_line_ratio", "max_hash_line_ratio")
def hash_line_ratio(view: TextView, settings: Mapping[str, Any]) -> float:
    """Share of non-empty lines that start with '#' (markdown headers, hashtag spam)."""
    lines = view.lines
    return sum(ln.startswith("#") for ln in lines) / len(lines) if lines else 0.0


@rule("char_repeat", "max_char_repeat_ratio", prose=False)
def char_repeat_ratio(view: TextView, settings: Mapping[str, Any]) -> float:
    """Share of non-space characters taken by the single most frequent one."""
    # Counting code points with numpy is ~10x faster than collections.Counter.
    cp = np.frombuffer("".join(view.text.split()).encode("utf-32-le"), dtype="<u4")
    if not len(cp):
        return 0.0
    return int(np.bincount(cp - cp.min()).max()) / len(cp)


# C0/C1 controls other than tab/newline/CR, and U+FFFD (what a bad decode leaves).
_CONTROL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\ufffd]")


@rule("control_chars", "max_control_char_ratio", prose=False)
def control_char_ratio(view: TextView, settings: Mapping[str, Any]) -> float:
    """Share of control and replacement characters (mojibake, binary junk)."""
    text = view.text
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
def boilerplate_lines(view: TextView, settings: Mapping[str, Any]) -> float:
    """Lines that carry advertising / boilerplate phrases (点击这里, 关注公众号, click here ...)."""
    low = view.text.lower()
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
