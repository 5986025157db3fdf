"""A cheap document quality score in [0, 1], used to pick which near-duplicate to keep.

The score multiplies signals the filter rules measure (so a document that barely
passed them scores low): the share of its characters outside repeated lines, the
share of tokens with a letter, the share of lines ending in punctuation (prose) and
the absence of control characters, times a length factor that saturates at 200 words.
"""

from __future__ import annotations

from lmforge.data.rules_basic import control_char_ratio
from lmforge.data.rules_fineweb import line_punct_ratio
from lmforge.data.rules_gopher import alpha_word_ratio, dup_line_char_ratio
from lmforge.data.textview import TextView

SATURATION_WORDS = 200


def quality_score(text: str) -> float:
    """Higher is better; 0 for an empty text."""
    view = TextView(text)
    if not view.words:
        return 0.0
    no_settings: dict = {}
    score = (1.0 - dup_line_char_ratio(view, no_settings))
    score *= alpha_word_ratio(view, no_settings)
    score *= 0.5 + 0.5 * line_punct_ratio(view, no_settings)
    score *= 1.0 - min(1.0, 10 * control_char_ratio(view, no_settings))
    return score * min(1.0, len(view.words) / SATURATION_WORDS)
