"""The FineWeb quality rules (Penedo et al. 2024; datatrove's ``FineWebQualityFilter``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lmforge.data.rulebook import rule
from lmforge.data.rules_c4 import TERMINAL
from lmforge.data.rules_gopher import duplicate_stats
from lmforge.data.textview import TextView

GROUP = "fineweb"


@rule("fineweb_line_punct", "fineweb_min_line_punct_ratio", reject_below=True, group=GROUP)
def line_punct_ratio(view: TextView, settings: Mapping[str, Any]) -> float:
    """Share of lines that end in terminal punctuation (Chinese 。！？ included)."""
    lines = view.lines
    return sum(ln.endswith(TERMINAL) for ln in lines) / len(lines) if lines else 0.0


@rule("fineweb_short_lines", "fineweb_max_short_line_ratio", group=GROUP)
def short_line_ratio(view: TextView, settings: Mapping[str, Any]) -> float:
    """Share of lines of at most ``fineweb_short_line_chars`` characters."""
    lines = view.lines
    limit = settings["fineweb_short_line_chars"]
    return sum(len(ln) <= limit for ln in lines) / len(lines) if lines else 0.0


@rule("fineweb_dup_line_chars", "fineweb_max_dup_line_char_ratio", group=GROUP)
def dup_line_char_ratio(view: TextView, settings: Mapping[str, Any]) -> float:
    """Characters in repeated lines / characters that are not newlines."""
    chars = len(view.text) - view.text.count("\n")
    return duplicate_stats(view.lines)[1] / chars if chars else 0.0


@rule("fineweb_list_ratio", "fineweb_max_newline_word_ratio", group=GROUP)
def newline_word_ratio(view: TextView, settings: Mapping[str, Any]) -> float:
    """Newlines per word: high for lists, menus and tables of links."""
    words = len(view.words)
    return view.text.count("\n") / words if words else 0.0
