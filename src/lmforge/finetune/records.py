"""Instruction records -> conversations of (role, content) turns.

One JSON object per line (plain, ``.gz`` or ``.zst``; a UTF-8 byte-order mark and CRLF
line ends are accepted, as in ``lmforge.data.readers``), in any of the shapes users have:

* chat: ``{"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}``
  (the Hugging Face / OpenAI shape);
* Alpaca: ``{"instruction": "...", "input": "...", "output": "..."}``, ``input`` optional;
  the user turn is the instruction, then a blank line and the input when there is one;
* ``{"prompt": ..., "completion": ...}``: strings (one user and one assistant turn) or
  message lists (TRL's conversational prompt/completion).

A record with several shapes' keys is read as the first of that list. Every line in is
either kept or rejected with a reason and a one-line detail, so ``in == kept + rejected``
(checked). A kept conversation has a non-empty assistant turn and ends with an assistant
turn. Length (``too_long``) and the loss mask (``empty_mask``) are checked when the turns
are rendered to ids (``lmforge.finetune.template.render_all``).
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmforge.data import readers
from lmforge.data.counts import DomainCounts
from lmforge.data.readers import Reject
from lmforge.errors import InputError

SYSTEM, USER, ASSISTANT = "system", "user", "assistant"
ROLES = (SYSTEM, USER, ASSISTANT)

# Reasons a record is rejected (the reader's own: invalid_json, not_an_object,
# invalid_utf8, record_too_large, truncated_file, corrupt_file, empty_file).
INVALID_JSON = readers.INVALID_JSON
UNKNOWN_FORMAT = "unknown_format"
MISSING_ROLE = "missing_role"
BAD_ROLE = "bad_role"
WRONG_TYPE = "wrong_type"
EMPTY_ASSISTANT = "empty_assistant"
LAST_NOT_ASSISTANT = "last_not_assistant"

Turn = tuple[str, str]

DEFAULT_MAX_RECORD_BYTES = 64 * 1024 * 1024  # as ingest.max_record_bytes


@dataclass(frozen=True)
class Example:
    """One kept record: the file, its 1-based line, and its turns.

    ``turns`` is what the reader's ``parse`` returned: a conversation's turns, or for a
    preference record a ``lmforge.finetune.preferences.Pair``.
    """

    file: str
    line: int
    turns: Any


@dataclass(frozen=True)
class Rejected:
    file: str
    line: int
    reason: str
    detail: str

    def message(self) -> str:
        """``rejected data/x.jsonl:3: empty_assistant: ...`` (one line)."""
        return f"rejected {self.file}:{self.line}: {self.reason}: {self.detail}"


@dataclass
class ReadResult:
    """Kept examples, rejected records, and the counts (``in == kept + rejected``)."""

    examples: list[Example] = field(default_factory=list)
    rejects: list[Rejected] = field(default_factory=list)
    counts: DomainCounts = field(default_factory=DomainCounts)

    def reject(self, file: str, line: int, reason: str, detail: str) -> None:
        """Record a reject of a record not yet counted."""
        self.counts.n_in += 1
        self.counts.rejected[reason] += 1
        self.rejects.append(Rejected(file, line, reason, detail))

    def check(self) -> None:
        """A mismatch is a bug here, never a data problem."""
        total = self.counts.kept + sum(self.counts.rejected.values())
        assert self.counts.n_in == total, f"in={self.counts.n_in} != kept+rejected={total}"
        assert self.counts.kept == len(self.examples)


class BadRecord(Exception):
    """Why a parsed JSON object is not a usable conversation."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _string(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise BadRecord(WRONG_TYPE, f"{where} is {_type_name(value)}, not a string")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:  # a lone surrogate from a "\ud800" escape
        raise BadRecord(readers.INVALID_UTF8, f"{where}: unpaired surrogate at offset {e.start}") from None
    return value


def _messages(value: Any, where: str) -> list[Turn]:
    if not isinstance(value, list):
        raise BadRecord(WRONG_TYPE, f"{where} is {_type_name(value)}, not a list")
    turns = []
    for i, msg in enumerate(value):
        at = f"{where}[{i}]"
        if not isinstance(msg, dict):
            raise BadRecord(WRONG_TYPE, f"{at} is {_type_name(msg)}, not an object")
        if "role" not in msg:
            raise BadRecord(MISSING_ROLE, f"{at} has no 'role'")
        role = msg["role"]
        if role not in ROLES:
            raise BadRecord(BAD_ROLE, f"{at}.role is {json.dumps(role, ensure_ascii=False)[:40]}, "
                                      "not system, user or assistant")
        turns.append((role, _string(msg.get("content"), f"{at}.content")))
    return turns


def parse_record(obj: dict[str, Any]) -> tuple[Turn, ...]:
    """The turns of one record, or ``BadRecord`` with the reason."""
    if "messages" in obj:
        turns = _messages(obj["messages"], "messages")
    elif "instruction" in obj and "output" in obj:
        user = _string(obj["instruction"], "instruction")
        extra = obj.get("input")
        if extra is not None and _string(extra, "input"):
            user = f"{user}\n\n{extra}"
        turns = [(USER, user), (ASSISTANT, _string(obj["output"], "output"))]
    elif "prompt" in obj and "completion" in obj:
        prompt, completion = obj["prompt"], obj["completion"]
        turns = (_messages(prompt, "prompt") if isinstance(prompt, list)
                 else [(USER, _string(prompt, "prompt"))])
        turns += (_messages(completion, "completion") if isinstance(completion, list)
                  else [(ASSISTANT, _string(completion, "completion"))])
    else:
        keys = ", ".join(sorted(obj)[:8]) or "none"
        raise BadRecord(UNKNOWN_FORMAT, "needs 'messages', 'instruction' + 'output' or "
                                        f"'prompt' + 'completion' (keys: {keys})")
    if not any(role == ASSISTANT and content.strip() for role, content in turns):
        raise BadRecord(EMPTY_ASSISTANT, f"no non-empty assistant turn in {len(turns)} turns")
    if turns[-1][0] != ASSISTANT:
        raise BadRecord(LAST_NOT_ASSISTANT, f"the last of {len(turns)} turns is "
                                            f"{turns[-1][0]}, not assistant")
    return tuple(turns)


Parser = Callable[[dict[str, Any]], Any]


def iter_examples(path: str | Path, max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
                  parse: Parser = parse_record) -> Iterator[tuple[int, Any] | Reject]:
    """(line, turns) for each good record of a JSON-lines file, a ``Reject`` for each bad one.

    ``parse`` turns a JSON object into the record (``BadRecord`` when it is not one).

    Blank lines are not records. A file that is one JSON array (Alpaca's original
    ``alpaca_data.json``) is an ``InputError`` naming the fix, not a reject per line.
    """
    lineno = 0
    try:
        with readers.open_binary(path) as stream:
            for lineno, raw in readers._read_lines(stream, max_record_bytes):
                if raw is None:
                    yield Reject(lineno, readers.TOO_LARGE,
                                 f"line longer than max_record_bytes={max_record_bytes}")
                    continue
                if lineno == 1:  # the encoding's mark, which json.loads refuses
                    raw = raw.removeprefix(readers._BOM)
                    if raw.strip() == b"[":
                        raise InputError(f"{path}: a JSON array, not JSON lines (one object "
                                         "per line); convert it with: jq -c '.[]'")
                if not raw.strip():
                    continue
                yield _parse_line(lineno, raw, parse)
    except (EOFError, OSError, zlib.error) as e:
        yield readers._stream_error(lineno + 1, e)
    except Exception as e:  # zstandard.ZstdError and friends: a broken file, not a bug
        if type(e).__module__.startswith("zstandard"):
            yield readers._stream_error(lineno + 1, e)
        else:
            raise


def _parse_line(lineno: int, raw: bytes, parse: Parser) -> tuple[int, Any] | Reject:
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return Reject(lineno, readers.INVALID_UTF8, f"{e.reason} at byte {e.start}")
    try:
        obj = json.loads(line.rstrip("\r\n"))  # so an error's column is on this line
    except json.JSONDecodeError as e:
        return Reject(lineno, INVALID_JSON, f"{e.msg} at column {e.colno}")
    except RecursionError:
        return Reject(lineno, INVALID_JSON, "nested too deeply")
    if not isinstance(obj, dict):
        return Reject(lineno, readers.NOT_AN_OBJECT, f"a JSON {_type_name(obj)}, not an object")
    try:
        return lineno, parse(obj)
    except BadRecord as e:
        return Reject(lineno, e.reason, e.detail)


def read_examples(paths: Iterable[str | Path],
                  max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
                  parse: Parser = parse_record) -> ReadResult:
    """Read every file, in order: kept examples, rejects and counts."""
    result = ReadResult()
    for path in paths:
        name = str(path)
        before = result.counts.n_in
        for rec in iter_examples(path, max_record_bytes, parse):
            if isinstance(rec, Reject):
                result.reject(name, rec.pos, rec.reason, rec.detail)
                continue
            result.counts.n_in += 1
            result.counts.kept += 1
            result.examples.append(Example(name, rec[0], rec[1]))
        if result.counts.n_in == before:  # nothing at all: say so rather than vanish
            result.reject(name, 0, readers.EMPTY_FILE, "the file holds no records")
    result.check()
    return result
