"""A document as the filter rules see it: lines, paragraphs and words, each computed once.

``TextView.prose`` is the same document with its Markdown markup lines blanked out (HTML
comments, fenced code, tables, link-reference definitions): the kind of text Gopher's word and
repetition statistics were fitted on. In API documentation those lines repeat by design
(``-->``, ``added: v18.0.0``, the same example in two module systems) and hold long
tokens (URLs, anchors); they are not the repetition or the gibberish the rules look for.

Words are whitespace-separated tokens, as the Gopher paper counts them, except that
every CJK character (hanzi, kana, hangul) is a word of its own, carrying the
punctuation that follows it: Chinese has no spaces between words, so a character is
the unit that makes word counts, ratios and n-gram repetition mean the same thing.
"""

from __future__ import annotations

import bisect
import re
from functools import cached_property

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

CJK_RANGES = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff"
_CJK = re.compile(f"[{CJK_RANGES}]")
_CJK_WORD = re.compile(rf"[{CJK_RANGES}][^\w\s]*|[^\s{CJK_RANGES}]+")
_NO_LETTER_WORD = re.compile(r"(?<!\S)(?:[^\w\s]|[\d_])+(?!\S)")
_DIGIT = re.compile(r"[\d_]")
_PARAGRAPH_BREAK = re.compile(r"\n\s*\n")
CJK_MAJORITY = 0.3  # above this share of CJK characters a text is treated as CJK

# Markdown markup (CommonMark / GitHub). A text with none of these cues (nearly all prose)
# is its own prose view after one C-speed scan.
_MARKUP_CUE = re.compile(r"```|~~~|<[a-zA-Z/!]|\]:|\|")
_FENCE = re.compile(r"[ \t]*(`{3,}|~{3,})")
_BARE_FENCE = re.compile(r"[ \t]*(?:`{3,}|~{3,})\s*")  # a fence line that can close one
_COMMENT_START = re.compile(r"[ \t]*<!--")
_HTML_TABLE_START = re.compile(r"[ \t]*<table\b", re.IGNORECASE)
_HTML_TABLE_END = re.compile(r"</table>\s*$", re.IGNORECASE)
_HTML_TAGS_ONLY = re.compile(r"\s*(?:</?[a-zA-Z][^<>]*>\s*)+")  # <a id="x"></a>, <br/>
_LINK_DEFINITION = re.compile(  # [label]: destination "optional title"
    r" {0,3}\[[^\]]+\]:[ \t]*(?:<[^>]*>|\S+)"
    r"(?:[ \t]+(?:\"[^\"]*\"|'[^']*'|\([^)]*\)))?\s*")
_TABLE_DELIMITER = re.compile(  # |---|:--:| under a table's header row; one '|' at least
    r"[ \t]*\|?[ \t]*:?-+:?[ \t]*(?:\|[ \t]*:?-+:?[ \t]*)+\|?\s*"
    r"|[ \t]*\|[ \t]*:?-+:?[ \t]*\|\s*")


class _Closers:
    """Where each kind of block may end in one document, found in one pass over its lines,
    so that finding a block's end is a bisection, never a rescan of the rest of the text
    (a text of many unclosed openers stays linear)."""

    def __init__(self, lines: list[str]):
        self.lines = lines
        self.comments = [j for j, ln in enumerate(lines) if "-->" in ln]
        self.tables = [j for j, ln in enumerate(lines) if _HTML_TABLE_END.search(ln)]
        self.fences = [j for j, ln in enumerate(lines) if _BARE_FENCE.fullmatch(ln)]
        self.unclosed: dict[str, int] = {}  # fence character -> shortest fence left open

    def fence(self, start: int) -> int | None:
        """The line that closes the code fence opened at ``start``, or None.

        CommonMark lets an unclosed fence run to the end of the document; here it is not
        a fence at all, so one stray fence line cannot hide the rest of a text from the
        rules. A backtick fence's info string holds no backtick (```` ```x``` ```` is
        inline code).
        """
        opening = _FENCE.match(self.lines[start])
        char, size = opening.group(1)[0], len(opening.group(1))
        if char == "`" and "`" in self.lines[start][opening.end():]:
            return None
        if size >= self.unclosed.get(char, size + 1):  # a longer one found no closer
            return None
        for k in range(bisect.bisect_right(self.fences, start), len(self.fences)):
            j = self.fences[k]
            bare = self.lines[j].strip()
            if bare[0] == char and len(bare) >= size:
                return j
        self.unclosed[char] = size
        return None

    def comment(self, start: int) -> int | None:
        """The line whose '-->' closes the comment opened at ``start`` and ends that line,
        or None (a comment followed by text on its last line is not a markup line)."""
        line = self.lines[start]
        rest = line[line.index("<!--") + 4:]
        if "-->" not in rest:
            k = bisect.bisect_right(self.comments, start)
            if k == len(self.comments):
                return None
            start, rest = self.comments[k], self.lines[self.comments[k]]
        return start if not rest[rest.index("-->") + 3:].strip() else None

    def html_table(self, start: int) -> int | None:
        """The line ending with the '</table>' that closes the HTML table opened at
        ``start`` (Markdown allows HTML blocks; API docs use them for tables), or None."""
        k = bisect.bisect_left(self.tables, start)
        return self.tables[k] if k < len(self.tables) else None


def _table_end(lines: list[str], delimiter: int) -> int:
    """Index of the last row of the table whose delimiter row is at ``delimiter``: the
    rows go on while lines hold a '|'."""
    end = delimiter
    while end + 1 < len(lines) and "|" in lines[end + 1] and lines[end + 1].strip():
        end += 1
    return end


def markup_lines(text: str) -> list[bool] | None:
    """Per line of ``text`` (split at '\\n'), whether it is Markdown markup: a fenced code
    block with its fences, an HTML comment that fills its lines (``<!-- YAML ... -->``),
    a table (header, delimiter and rows; or an HTML ``<table>``), a link-reference
    definition or a line of HTML tags alone (anchors). None when no line is."""
    if not _MARKUP_CUE.search(text):
        return None
    lines = text.split("\n")
    closers = _Closers(lines)
    markup = [False] * len(lines)
    i = 0
    while i < len(lines):
        line = lines[i]
        end = None
        if _FENCE.match(line):
            end = closers.fence(i)
        elif _COMMENT_START.match(line):
            end = closers.comment(i)
        elif _HTML_TABLE_START.match(line):
            end = closers.html_table(i)
        elif _LINK_DEFINITION.fullmatch(line) or _HTML_TAGS_ONLY.fullmatch(line):
            end = i
        elif (i > 0 and "|" in lines[i - 1] and not markup[i - 1]
              and _TABLE_DELIMITER.fullmatch(line)):
            markup[i - 1] = True  # the header row
            end = _table_end(lines, i)
        if end is None:
            i += 1
            continue
        markup[i : end + 1] = [True] * (end + 1 - i)
        i = end + 1
    return markup if any(markup) else None


class TextView:
    """Lazily computed views of one document's text, shared by all rules."""

    def __init__(self, text: str):
        self.text = text
        self.cache: dict[str, float] = {}  # measurements one rule can reuse from another

    @cached_property
    def lines(self) -> list[str]:
        """Stripped non-empty lines."""
        return [s for s in (ln.strip() for ln in self.text.splitlines()) if s]

    @cached_property
    def prose(self) -> TextView:
        """The document with its markup lines blank (``markup_lines``): itself when it has
        none. Blank, not removed, so paragraphs stay apart where a fence stood between."""
        markup = markup_lines(self.text)
        if markup is None:
            return self
        kept = (ln if not m else "" for ln, m in
                zip(self.text.split("\n"), markup, strict=True))
        return TextView("\n".join(kept))

    @cached_property
    def paragraphs(self) -> list[str]:
        """Stripped non-empty blank-line-separated blocks."""
        return [s for s in (p.strip() for p in _PARAGRAPH_BREAK.split(self.text)) if s]

    @cached_property
    def cjk_chars(self) -> int:
        """Number of CJK characters (0 without a scan for ASCII text)."""
        return 0 if self.text.isascii() else len(_CJK.findall(self.text))

    @cached_property
    def nonspace_chars(self) -> int:
        return len("".join(self.text.split()))

    @cached_property
    def is_cjk(self) -> bool:
        """Mostly CJK: word lengths mean nothing here."""
        return self.nonspace_chars > 0 and self.cjk_chars / self.nonspace_chars > CJK_MAJORITY

    @cached_property
    def words(self) -> list[str]:
        """Whitespace tokens; a CJK character (with its trailing punctuation) is one token."""
        return _CJK_WORD.findall(self.text) if self.cjk_chars else self.text.split()

    @cached_property
    def word_array(self) -> pa.Array:
        """The words as an Arrow array, for vectorised (RE2, hashing) passes over them."""
        return pa.array(self.words, type=pa.string())

    @cached_property
    def no_letter_tokens(self) -> list[str]:
        """Tokens with no letter (CJK characters are letters): symbols and numbers."""
        return _NO_LETTER_WORD.findall(self.text)

    @cached_property
    def symbol_words(self) -> int:
        """Tokens with no letter or digit ('—', '...', '*')."""
        return sum(not _DIGIT.search(t) for t in self.no_letter_tokens)

    @cached_property
    def word_ids(self) -> np.ndarray:
        """Each word as a dense integer id (equal words, equal ids), via Arrow's hashing."""
        if not self.words:
            return np.zeros(0, dtype=np.uint64)
        return pc.dictionary_encode(self.word_array).indices.to_numpy().astype(np.uint64)

    @cached_property
    def word_chars(self) -> np.ndarray:
        """Length in characters of each word."""
        return np.fromiter(map(len, self.words), dtype=np.int64, count=len(self.words))

