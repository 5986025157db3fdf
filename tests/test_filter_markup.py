"""Technical Markdown under the `reference` kind: Gopher's statistics see the prose, not the
markup (history comments, code fences, tables, link-reference definitions), short API
entries are kept, and the demo corpus still gives the filter outputs committed in
metrics/filter.json (bench/RESULTS.md, "Technical Markdown under kind reference")."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from lmforge.config import DomainFilterConfig, FilterConfig, load_params
from lmforge.data.filter_cli import sample_table
from lmforge.data.filtering import domain_metrics, judge_table
from lmforge.data.filters import RULES, domain_rules
from lmforge.data.textview import TextView, markup_lines

REPO = Path(__file__).resolve().parents[1]

# One API section in the shape of Node.js's documentation: each method has a YAML history
# comment, the same example in two module systems, and the page's link definitions.
_METHOD = """### `zipper.{name}(source[, options])`

<!-- YAML
added: v{major}.0.0
changes:
  - version: v18.0.0
    pr-url: https://github.com/example/zipper/pull/{pr}
    description: The `options` argument is optional.
-->

* `source` {{Buffer|string}}
* `options` {{Object}}

{prose}

```mjs
import {{ {name} }} from 'node:zipper';
const out = {name}(Buffer.from('hello'));
console.log(out.length);
```

```cjs
const {{ {name} }} = require('node:zipper');
const out = {name}(Buffer.from('hello'));
console.log(out.length);
```
"""
_METHODS = [
    ("deflate", 4, 101, "Compresses the source with the raw DEFLATE algorithm. No header or\n"
     "checksum is written, so the reader must know the format in advance."),
    ("inflate", 5, 202, "Expands data that was written by `deflate()`. A truncated input\n"
     "raises an error unless the `finishFlush` option says otherwise."),
    ("gzip", 6, 303, "Wraps the compressed bytes in a gzip member: a ten-byte header, the\n"
     "body and a trailer holding a CRC-32 and the length of the input."),
    ("gunzip", 7, 404, "Reads one or more gzip members and returns their concatenated\n"
     "contents; trailing garbage after the last member is ignored."),
]
API_SECTION = "## Class: `Zipper`\n\nCompression and decompression for streams and buffers.\n\n" \
    + "\n".join(_METHOD.format(name=n, major=m, pr=p, prose=t) for n, m, p, t in _METHODS) \
    + """
| Method | Output | Streaming |
| ------ | ------ | --------- |
| deflate | raw | yes |
| gzip | wrapped | yes |

[`Buffer`]: buffer.md#class-buffer
[`stream.Readable`]: stream.md#class-streamreadable
"""

# Short API entries: a heading, a type or signature and one sentence, under 200 characters
# (what API documentation is made of).
SHORT_ENTRIES = [
    """## `cluster.isWorker`

<!-- YAML
added: v0.6.0
-->

* {boolean}

True if the process is not a primary (it is the negation of `cluster.isPrimary`).
""",
    """## `os.tmpdir()`

<!-- YAML
added: v0.9.9
-->

* Returns: {string}

Returns the operating system's default directory for temporary files as a string.
""",
    """## `zlib.createGzip([options])`

<!-- YAML
added: v0.5.8
-->

* `options` {zlib options}

Creates and returns a new [`Gzip`][] object. See [example][zlib.createGzip example].
""",
]


def reference_rules():
    """The rules and settings of a domain of kind `reference` at the defaults."""
    return domain_rules(FilterConfig(domains={"docs": DomainFilterConfig(kind="reference")}),
                        "docs")


def test_markdown_markup_lines_do_not_count_as_repetition():
    rules = reference_rules()
    view = TextView(API_SECTION)
    for name in ("gopher_dup_lines", "gopher_dup_line_chars", "gopher_dup_paragraphs",
                 "gopher_dup_paragraph_chars"):
        r = RULES[name]
        value = r.measure(view, rules.settings)
        assert not r.fails(value, rules.settings[r.threshold]), (name, value)
    assert rules.first_failure(API_SECTION) is None


def test_the_same_lines_counted_as_text_would_be_rejected():
    # The markup is what the rule fired on: measured on the whole text (no prose view),
    # more than a third of the lines repeat.
    lines = TextView(API_SECTION).lines
    repeats = len(lines) - len(set(lines))
    assert repeats / len(lines) > reference_rules().settings["gopher_max_dup_line_ratio"]


def test_repeated_prose_is_still_repetition_inside_markdown():
    spam = "Buy the best zipper today, the best zipper for your streams.\n\n" * 12
    rules = reference_rules()
    failure = rules.first_failure(API_SECTION + "\n" + spam)
    assert failure is not None and failure[0].startswith("gopher_dup"), failure


def test_markup_lines_are_the_markdown_constructs():
    text = "\n".join([
        "Intro line with a | pipe in prose.",     # 0 prose
        "<!-- YAML",                              # 1 comment
        "added: v1.0.0",                          # 2
        "-->",                                    # 3
        "```js",                                  # 4 fence
        "const a = 1;",                           # 5
        "```",                                    # 6
        "| a | b |",                              # 7 table header
        "|---|:-:|",                              # 8 delimiter
        "| 1 | 2 |",                              # 9 row
        "",                                       # 10
        "[`util`]: util.md#util",                 # 11 link definition
        '<a id="old_anchor"></a>',                # 12 tags alone
        "<!-- a note --> followed by text",       # 13 prose: the comment does not fill it
        "Inline ```code``` is prose.",            # 14 prose
    ])
    markup = markup_lines(text)
    assert [i for i, m in enumerate(markup) if m] == [1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 12]


def test_an_unclosed_fence_or_comment_hides_nothing():
    # A stray fence or comment opener must not take the rest of a text from the rules.
    assert markup_lines("Some prose.\n```\nmore prose\nand more\n") is None
    assert markup_lines("Some prose.\n<!-- never closed\nmore prose\n") is None
    assert TextView("Plain prose without markup.").prose.text == "Plain prose without markup."


@pytest.mark.parametrize("text", SHORT_ENTRIES)
def test_a_short_api_section_is_kept_under_reference(text):
    assert len(text.strip()) < 200  # under the old minimum of every kind but verse/short
    assert reference_rules().first_failure(text) is None


@pytest.mark.parametrize("text", [
    "## `http.get(options[, callback])`\n",            # a heading alone
    "## `BroadcastChannel`\n\n<!-- YAML\nadded: v18.0.0\n-->\n\nSee {BroadcastChannel}.\n",
    "# Asynchronous context tracking\n\n<!--introduced_in=v16.4.0-->\n\n"
    "> Stability: 2 - Stable\n\n<!-- source_link=lib/async_hooks.js -->\n",
])
def test_a_section_with_nothing_to_read_is_still_rejected(text):
    assert reference_rules().first_failure(text) is not None


def test_a_top_ngram_that_occurs_once_is_not_repetition():
    # Every 4-gram of this entry is unique; counting the first one's characters as "the
    # most frequent" would put a 150-character text over the 0.16 limit.
    text = "Returns the current default value of the `autoSelectFamily` option of sockets."
    assert RULES["gopher_top_4gram"].measure(TextView(text), {}) == 0.0
    assert RULES["gopher_top_2gram"].measure(TextView("the cat the cat the cat"), {}) > 0.5


def test_the_demo_corpus_gives_the_committed_filter_outputs():
    """Every demo domain keeps and rejects what metrics/filter.json (the filter stage's
    output at dvc.lock) says: the same counts per rule, for the documents as ingest
    reads them."""
    params = load_params(str(REPO / "params.yaml"))
    sources = [dataclasses.replace(s, path=str(REPO / s.path)) for s in params.ingest.sources]
    table = sample_table(dataclasses.replace(params.ingest, sources=sources), 10**9)
    failures: dict = {}
    *_, counts, redacted, _ = judge_table(table, params.filter, failures, {})
    got = domain_metrics(params.filter, counts, redacted, failures, {})["domains"]
    committed = json.loads((REPO / "metrics" / "filter.json").read_text(encoding="utf-8"))
    for domain, want in committed["domains"].items():
        have = got[domain]
        assert (have["in"], have["kept"], have["rejected"], have.get("fails", {})) == \
            (want["in"], want["kept"], want["rejected"], want.get("fails", {})), domain
