"""JSON files holding one array of records (what many exporters and APIs write).

The array is read whole (one file is one task; ``max_record_bytes`` still bounds each
record) and walked element by element with the standard decoder, so each record keeps
the 1-based line it starts on and a bad element is rejected alone. A syntax error
between elements leaves the rest of the file unreadable: it is one reject at that line.
A ``.json`` file that does not start with ``[`` is read as JSON lines.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterator
from pathlib import Path

from lmforge.data import readers
from lmforge.data.readers import Doc, Reject

_DECODER = json.JSONDecoder()
_SPACE = " \t\r\n"


def is_array(path: str | Path) -> bool:
    """Whether the file's first non-blank character (after a BOM) is ``[``."""
    try:
        with readers.open_binary(path) as stream:
            head = stream.read(4096).removeprefix(readers._BOM).lstrip()
    except (EOFError, OSError, zlib.error):
        return False
    return head[:1] == b"["


def _skip(text: str, at: int, line: int) -> tuple[int, int]:
    """(index, line) after the whitespace at ``at``."""
    end = at
    while end < len(text) and text[end] in _SPACE:
        end += 1
    return end, line + text.count("\n", at, end)


def iter_json_array(path: str | Path, text_field: str, id_field: str | None,
                    max_bytes: int) -> Iterator[Doc | Reject]:
    """The records of ``[{...}, {...}]``, each with the line it starts on."""
    try:
        with readers.open_binary(path) as stream:
            data = stream.read().removeprefix(readers._BOM)
    except (EOFError, OSError, zlib.error) as e:
        yield readers._stream_error(1, e)
        return
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        yield Reject(line, readers.INVALID_UTF8, f"{e.reason} at byte {e.start}; the file is not read")
        return
    at, line = _skip(text, 0, 1)
    at += 1  # the '['
    while True:
        at, line = _skip(text, at, line)
        if text.startswith("]", at):
            return
        try:
            obj, end = _DECODER.raw_decode(text, at)
        except (json.JSONDecodeError, RecursionError) as e:
            msg = getattr(e, "msg", "nested too deeply")
            yield Reject(line, readers.INVALID_JSON, f"{msg}; the rest of the file is not read")
            return
        yield _element(line, obj, end - at, text_field, id_field, max_bytes)
        line += text.count("\n", at, end)
        at, line = _skip(text, end, line)
        if text.startswith(",", at):
            at += 1
        elif not text.startswith("]", at):
            yield Reject(line, readers.INVALID_JSON, "expected ',' or ']' after a record; "
                         "the rest of the file is not read")
            return


def _element(line: int, obj: object, size: int, text_field: str, id_field: str | None,
             max_bytes: int) -> Doc | Reject:
    if size > max_bytes:
        return Reject(line, readers.TOO_LARGE, f"{size} characters > max_record_bytes={max_bytes}")
    if not isinstance(obj, dict):
        return Reject(line, readers.NOT_AN_OBJECT, f"a JSON {type(obj).__name__}, not an object")
    rid = obj.get(id_field) if id_field else None
    return readers._doc_or_reject(line, obj.get(text_field), rid, obj.get("source"), max_bytes)
