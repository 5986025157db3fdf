"""Gopher quality and repetition rules (Rae et al. 2021, appendix A; datatrove's defaults).

Word-based rules use the script-aware words of ``TextView``: a Chinese character is
a word, so word counts, symbol ratios and n-gram repetition mean the same thing in
Chinese as in English. Average word length and stop words depend on the script:
the length rule does not apply to CJK text, and the stop-word rule counts the
function characters of Chinese (modern and classical) as well as the English ones.

Every rule here but the two word counts measures the document's prose (``TextView.prose``):
Markdown markup lines (HTML comments, code fences, tables, link-reference definitions) are
left out, as the web text Gopher's thresholds were fitted on had none; in documentation
they repeat by design and hold URLs. A text without markup is measured as it is.
"""

from __future__ import annotations

import itertools
import re
import string
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from lmforge.data.rulebook import Measure, rule
from lmforge.data.textview import TextView

QUALITY = "gopher_quality"
REPETITION = "gopher_repetition"
STOP_WORDS = frozenset(
    ["the", "be", "to", "of", "and", "that", "have", "with"]  # Gopher's English list
    + list("的了是在和有不也就都这我他之乎者而其以于所焉矣")  # modern + classical Chinese
)
_ELLIPSIS = re.compile(r"\.\.\.|…+")
MIN_SPACED_WORDS = 20  # fewer space-separated words than this: no mean length is measured
_PUNCT = string.punctuation + "，。！？；：、“”‘’（）《》…—"
_BULLETS = ("•", "-", "*", "·", "‣", "◦", "▪")
_P = np.uint64(0x9E3779B97F4A7C15)  # odd multiplier of the n-gram rolling hash


def gopher_rule(name: str, threshold: str, *, group: str,
                reject_below: bool = False) -> Callable[[Measure], Measure]:
    """``rulebook.rule`` for a Gopher statistic: the registered rule measures the prose
    view of the document; the function itself stays as written (it measures the view it
    is given)."""

    def register(measure: Measure) -> Measure:
        def on_prose(view: TextView, settings: Mapping[str, Any]) -> float | None:
            return measure(view.prose, settings)

        on_prose.__doc__ = measure.__doc__
        rule(name, threshold, reject_below=reject_below, group=group)(on_prose)
        return measure

    return register


# --------------------------------------------------------------------------- quality


# How much text there is counts the whole document: an API entry's signature, code example
# or table is part of what it says. What the words are like (below) is measured on prose.
@rule("gopher_min_words", "gopher_min_words", reject_below=True, group=QUALITY)
def word_count(view: TextView, settings: Mapping[str, Any]) -> float:
    """Words that are not pure punctuation (a CJK character counts as one)."""
    return len(view.words) - view.symbol_words


@rule("gopher_max_words", "gopher_max_words", group=QUALITY)
def word_count_max(view: TextView, settings: Mapping[str, Any]) -> float:
    """The same count, against the maximum."""
    return len(view.words) - view.symbol_words


def _mean_word_length(view: TextView) -> float | None:
    # Only the words between spaces have a length; a CJK character is not a word length.
    # Whitespace tokens cover the non-space characters, so no per-word pass is needed.
    spaced = len(view.words) - view.cjk_chars
    if view.is_cjk or spaced < MIN_SPACED_WORDS:
        return None
    return (view.nonspace_chars - view.cjk_chars) / spaced


@gopher_rule("gopher_min_avg_word_length", "gopher_min_avg_word_length", reject_below=True,
             group=QUALITY)
def mean_word_length(view: TextView, settings: Mapping[str, Any]) -> float | None:
    """Mean characters per word (not applicable to CJK text)."""
    return _mean_word_length(view)


@gopher_rule("gopher_max_avg_word_length", "gopher_max_avg_word_length", group=QUALITY)
def mean_word_length_max(view: TextView, settings: Mapping[str, Any]) -> float | None:
    """The same mean, against the maximum."""
    return _mean_word_length(view)


@gopher_rule("gopher_symbol_ratio", "gopher_max_symbol_word_ratio", group=QUALITY)
def symbol_word_ratio(view: TextView, settings: Mapping[str, Any]) -> float:
    """'#' or ellipses (``...``, a run of ``…``) per word, whichever is higher."""
    n = max(len(view.words), 1)
    return max(view.text.count("#"), len(_ELLIPSIS.findall(view.text))) / n


@gopher_rule("gopher_bullet_lines", "gopher_max_bullet_lines_ratio", group=QUALITY)
def bullet_line_ratio(view: TextView, settings: Mapping[str, Any]) -> float:
    """Share of lines that start with a bullet."""
    lines = view.lines
    return sum(ln.startswith(_BULLETS) for ln in lines) / len(lines) if lines else 0.0


@gopher_rule("gopher_ellipsis_lines", "gopher_max_ellipsis_lines_ratio", group=QUALITY)
def ellipsis_line_ratio(view: TextView, settings: Mapping[str, Any]) -> float:
    """Share of lines that end with an ellipsis (truncated teasers)."""
    lines = view.lines
    return sum(ln.endswith(("...", "…")) for ln in lines) / len(lines) if lines else 0.0


@gopher_rule("gopher_alpha_words", "gopher_min_alpha_words_ratio", reject_below=True,
             group=QUALITY)
def alpha_word_ratio(view: TextView, settings: Mapping[str, Any]) -> float:
    """Share of tokens with at least one letter (CJK characters are letters)."""
    words = view.words
    if not words:
        return 0.0
    return 1.0 - len(view.no_letter_tokens) / len(words)


@gopher_rule("gopher_stop_words", "gopher_min_stop_words", reject_below=True, group=QUALITY)
def stop_word_count(view: TextView, settings: Mapping[str, Any]) -> float:
    """Stop words present, counted up to the minimum (English, or Chinese function words)."""
    need = settings["gopher_min_stop_words"]
    found = (w for w in view.words if w.lower().strip(_PUNCT) in STOP_WORDS)
    return sum(1 for _ in itertools.islice(found, need))


# --------------------------------------------------------------------------- repetition


def duplicate_stats(items: list[str]) -> tuple[int, int]:
    """(items that repeat an earlier one, characters in them), as datatrove counts."""
    seen: set[str] = set()
    dups = dup_chars = 0
    for item in items:
        if item in seen:
            dups += 1
            dup_chars += len(item)
        else:
            seen.add(item)
    return dups, dup_chars


@gopher_rule("gopher_dup_lines", "gopher_max_dup_line_ratio", group=REPETITION)
def dup_line_ratio(view: TextView, settings: Mapping[str, Any]) -> float:
    """Share of lines that are a repeat of an earlier line."""
    lines = view.lines
    return duplicate_stats(lines)[0] / len(lines) if lines else 0.0


@gopher_rule("gopher_dup_paragraphs", "gopher_max_dup_para_ratio", group=REPETITION)
def dup_paragraph_ratio(view: TextView, settings: Mapping[str, Any]) -> float:
    """Share of paragraphs that are a repeat of an earlier paragraph."""
    paras = view.paragraphs
    return duplicate_stats(paras)[0] / len(paras) if paras else 0.0


@gopher_rule("gopher_dup_line_chars", "gopher_max_dup_line_char_ratio", group=REPETITION)
def dup_line_char_ratio(view: TextView, settings: Mapping[str, Any]) -> float:
    """Share of characters in repeated lines."""
    return duplicate_stats(view.lines)[1] / max(len(view.text), 1)


@gopher_rule("gopher_dup_paragraph_chars", "gopher_max_dup_para_char_ratio", group=REPETITION)
def dup_paragraph_char_ratio(view: TextView, settings: Mapping[str, Any]) -> float:
    """Share of characters in repeated paragraphs."""
    return duplicate_stats(view.paragraphs)[1] / max(len(view.text), 1)


def ngram_hashes(ids: np.ndarray, n: int) -> np.ndarray:
    """A 64-bit hash of every run of ``n`` word ids (empty when there are fewer words)."""
    width = len(ids) - n + 1
    if width <= 0:
        return np.zeros(0, dtype=np.uint64)
    h = np.zeros(width, dtype=np.uint64)
    with np.errstate(over="ignore"):  # wraparound is the intended mod 2^64
        for k in range(n):
            h = h * _P + ids[k : k + width] + np.uint64(1)
    return h


def top_ngram_char_ratio(view: TextView, n: int) -> float:
    """Characters covered by the most frequent n-gram's occurrences / all characters."""
    h = ngram_hashes(view.word_ids, n)
    if not len(h):
        return 0.0
    values, counts = np.unique(h, return_counts=True)  # a sort; no argsort needed
    top = int(counts.argmax())
    if counts[top] < 2:
        # No n-gram repeats: nothing is repeated. Counting one occurrence (as datatrove
        # does) rejects any text under ~5 n-grams' length: in a 150-character API entry
        # one 4-gram of identifiers is already 0.2 of the characters.
        return 0.0
    start = int(np.argmax(h == values[top]))
    # Its characters, with the n-1 spaces between the words, as datatrove measures it.
    chars = int(view.word_chars[start : start + n].sum()) + n - 1
    return chars * int(counts[top]) / max(len(view.text), 1)


def dup_ngram_char_ratio(view: TextView, n: int) -> float:
    """Characters in words covered by a repeated n-gram / all characters.

    Gopher's definition: every occurrence after the first of an n-gram marks its words,
    and a character covered by several such occurrences is counted once.
    """
    h = ngram_hashes(view.word_ids, n)
    if not len(h):
        return 0.0
    _, first, inverse = np.unique(h, return_index=True, return_inverse=True)
    starts = np.flatnonzero(first[inverse] != np.arange(len(h)))
    if not len(starts):
        return 0.0
    size = len(view.word_ids) + 1
    depth = np.cumsum(np.bincount(starts, minlength=size) - np.bincount(starts + n, minlength=size))
    return int(view.word_chars[depth[:-1] > 0].sum()) / max(len(view.text), 1)


def bounded_dup_ngram_ratio(view: TextView, n: int, limit: float) -> float:
    """``dup_ngram_char_ratio``, skipped when a shorter n-gram's ratio already passes.

    Every repeat of an n-gram repeats the (n-1)-grams inside it, so the ratio never
    grows with n: when the 5-gram ratio is within this rule's limit it is returned as
    an upper bound (the decision is the same) and the n-gram pass is saved.
    """
    if n > 5:
        shorter = view.cache.get(f"dup_{n - 1}gram")
        if shorter is not None and shorter <= limit:
            view.cache[f"dup_{n}gram"] = shorter
            return shorter
    value = dup_ngram_char_ratio(view, n)
    view.cache[f"dup_{n}gram"] = value
    return value


def _register_ngram_rules() -> None:
    for n in (2, 3, 4):
        gopher_rule(f"gopher_top_{n}gram", f"gopher_max_top_{n}gram_ratio", group=REPETITION)(
            lambda view, settings, n=n: top_ngram_char_ratio(view, n))
    for n in range(5, 11):
        key = f"gopher_max_dup_{n}gram_ratio"
        gopher_rule(f"gopher_dup_{n}gram", key, group=REPETITION)(
            lambda view, settings, n=n, key=key: bounded_dup_ngram_ratio(view, n, settings[key]))


_register_ngram_rules()
