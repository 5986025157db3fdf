"""The C4 rules (Raffel et al. 2020) as document-level measurements.

C4 drops a page that contains "lorem ipsum" or a curly bracket, and one left with
fewer than five sentences after its line filters (a kept line ends in terminal
punctuation and has at least three words). It also removes lines that mention
javascript or a cookie/terms policy; here those lines are counted, and a document
with more than the allowed number is rejected, so text is never silently rewritten.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from lmforge.data.rulebook import rule
from lmforge.data.textview import _CJK, TextView

GROUP = "c4"
TERMINAL = (".", "!", "?", '"', "'", "”", "’", "。", "！", "？", "…", "」", "』", "；")
_SENTENCE_END = re.compile(r"[.!?。！？]+")
_POLICY = ("terms of use", "privacy policy", "cookie policy", "uses cookies", "use of cookies",
           "use cookies")


@rule("c4_lorem_ipsum", None, group=GROUP)
def has_lorem_ipsum(view: TextView, settings: Mapping[str, Any]) -> float:
    """1 when the text holds placeholder "lorem ipsum"."""
    return float("lorem ipsum" in view.text.lower())


@rule("c4_curly_bracket", None, group=GROUP)
def has_curly_bracket(view: TextView, settings: Mapping[str, Any]) -> float:
    """1 when the text holds '{' (C4's proxy for code in prose pages)."""
    return float("{" in view.text)


@rule("c4_javascript_lines", "c4_max_javascript_lines", group=GROUP)
def javascript_lines(view: TextView, settings: Mapping[str, Any]) -> float:
    """Lines that mention javascript ("please enable JavaScript")."""
    if "javascript" not in view.text.lower():
        return 0.0
    return sum("javascript" in ln.lower() for ln in view.lines)


@rule("c4_policy_lines", "c4_max_policy_lines", group=GROUP)
def policy_lines(view: TextView, settings: Mapping[str, Any]) -> float:
    """Lines about terms of use, privacy or cookies."""
    low = view.text.lower()
    if not any(p in low for p in _POLICY):
        return 0.0
    return sum(any(p in ln.lower() for p in _POLICY) for ln in view.lines)


def _line_words(line: str) -> int:
    # Words of one line, script-aware like the document's words (CJK: characters).
    words = len(line.split())
    return words if words >= 3 or line.isascii() else words + len(_CJK.findall(line))


@rule("c4_min_sentences", "c4_min_sentences", reject_below=True, group=GROUP)
def sentence_count(view: TextView, settings: Mapping[str, Any]) -> float:
    """Sentences in the lines C4 keeps (ending in terminal punctuation, 3+ words)."""
    kept = [ln for ln in view.lines if ln.endswith(TERMINAL) and _line_words(ln) >= 3]
    return sum(len(_SENTENCE_END.findall(ln)) or 1 for ln in kept)
