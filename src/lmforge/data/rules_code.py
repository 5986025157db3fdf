"""Code that nobody wrote: generated files, lock files, minified and data-only files.

Held-out code corpora carry them and they teach a model nothing about writing code.
The header patterns are the conventions generators follow (Go's ``// Code generated
... DO NOT EDIT.``, protobuf's ``DO NOT EDIT!``, ``@generated`` of Cargo, Poetry and
Meta's tools); the line-length limits are the Codex paper's (Chen et al. 2021: a file
with a line over 1,000 characters or a mean line over 100 is dropped), which StarCoder's
data filters also use.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from lmforge.data.rulebook import rule
from lmforge.data.textview import TextView

GROUP = "code_generated"
# Where generators put their notice: the first lines of the file.
_HEAD_CHARS = 2000
_GENERATED = re.compile(
    r"^\W*code generated .*do not edit|do not edit[!.]|@generated\b|"
    r"\bauto-?generated\b.*\b(do not|don't) (edit|modify)|"
    r"this file (is|was) (automatically |auto-?)?generated",
    re.IGNORECASE | re.MULTILINE)
# Lock files: npm/pnpm (lockfileVersion), yarn v1, Pipfile.lock, go.sum lines.
_LOCK_HEAD = re.compile(r'"lockfileVersion"\s*:|^lockfileVersion:|^# yarn lockfile v1|'
                        r'"pipfile-spec"\s*:', re.MULTILINE)
_GO_SUM = re.compile(r"^\S+ v\S+ h1:[A-Za-z0-9+/]+=*$")


@rule("code_generated_header", None, prose=False, group=GROUP)
def generated_header(view: TextView, settings: Mapping[str, Any]) -> float:
    """1 when the file's first lines carry a generator's 'do not edit' notice."""
    return 1.0 if _GENERATED.search(view.text[:_HEAD_CHARS]) else 0.0


@rule("code_lock_file", None, prose=False, group=GROUP)
def lock_file(view: TextView, settings: Mapping[str, Any]) -> float:
    """1 for a dependency lock file (package-lock, pnpm, yarn, Pipfile.lock, go.sum)."""
    if _LOCK_HEAD.search(view.text[:_HEAD_CHARS]):
        return 1.0
    lines = view.lines[:50]
    return 1.0 if len(lines) >= 3 and all(_GO_SUM.match(ln) for ln in lines) else 0.0


@rule("code_max_line_length", "code_max_line_length", prose=False, group=GROUP)
def max_line_length(view: TextView, settings: Mapping[str, Any]) -> float:
    """The longest line in characters (a minified bundle is one line of thousands)."""
    return float(max(map(len, view.text.splitlines()), default=0))


@rule("code_mean_line_length", "code_max_mean_line_length", prose=False, group=GROUP)
def mean_line_length(view: TextView, settings: Mapping[str, Any]) -> float:
    """Mean length of the non-empty lines (embedded data, long generated tables)."""
    lines = view.lines
    return sum(map(len, lines)) / len(lines) if lines else 0.0
