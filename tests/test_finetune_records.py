"""Instruction records: every input shape gives the same turns, every bad record is
rejected with its reason and a one-line message, and in == kept + rejected."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from lmforge.errors import InputError
from lmforge.finetune.records import parse_record, read_examples

TURNS = (("user", "Name a prime number."), ("assistant", "7"))
SAME = [
    {"messages": [{"role": "user", "content": "Name a prime number."},
                  {"role": "assistant", "content": "7"}]},
    {"instruction": "Name a prime number.", "output": "7"},
    {"instruction": "Name a prime number.", "input": "", "output": "7"},
    {"prompt": "Name a prime number.", "completion": "7"},
    {"prompt": [{"role": "user", "content": "Name a prime number."}],
     "completion": [{"role": "assistant", "content": "7"}]},
]


def write_lines(path: Path, lines: list[str | dict], prefix: bytes = b"", eol: bytes = b"\n") -> Path:
    data = b"".join((json.dumps(x, ensure_ascii=False) if isinstance(x, dict) else x)
                    .encode("utf-8") + eol for x in lines)
    path.write_bytes(prefix + data)
    return path


@pytest.mark.parametrize("record", SAME, ids=["messages", "alpaca", "alpaca-empty-input",
                                              "prompt-completion", "prompt-completion-lists"])
def test_every_shape_gives_the_same_turns(record):
    assert parse_record(record) == TURNS


def test_alpaca_input_and_system_turns():
    rec = {"instruction": "Translate.", "input": "你好", "output": "Hello"}
    assert parse_record(rec) == (("user", "Translate.\n\n你好"), ("assistant", "Hello"))
    chat = {"messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hi."},
                         {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}
    assert [r for r, _ in parse_record(chat)] == ["system", "user", "assistant", "user", "assistant"]


def msgs(*pairs) -> dict:
    return {"messages": [{"role": r, "content": c} for r, c in pairs]}


BAD = [  # (line, reason, detail)
    ('{"messages": [', "invalid_json", "Expecting value at column 15"),
    ("[1, 2]", "not_an_object", "a JSON list, not an object"),
    ({"text": "plain"}, "unknown_format",
     "needs 'messages', 'instruction' + 'output' or 'prompt' + 'completion' (keys: text)"),
    ({"instruction": "no output"}, "unknown_format",
     "needs 'messages', 'instruction' + 'output' or 'prompt' + 'completion' (keys: instruction)"),
    ({"messages": [{"content": "hi"}, {"role": "assistant", "content": "x"}]}, "missing_role",
     "messages[0] has no 'role'"),
    (msgs(("human", "hi"), ("assistant", "x")), "bad_role",
     'messages[0].role is "human", not system, user or assistant'),
    (msgs(("user", None), ("assistant", "x")), "wrong_type", "messages[0].content is null, not a string"),
    ({"messages": "hi"}, "wrong_type", "messages is str, not a list"),
    ({"instruction": "x", "output": 7}, "wrong_type", "output is int, not a string"),
    (msgs(("user", "hi"), ("assistant", "  \n")), "empty_assistant",
     "no non-empty assistant turn in 2 turns"),
    ({"messages": []}, "empty_assistant", "no non-empty assistant turn in 0 turns"),
    (msgs(("user", "hi"), ("assistant", "yes"), ("user", "and?")), "last_not_assistant",
     "the last of 3 turns is user, not assistant"),
]


def test_every_reject_reason_with_its_line_and_counts(tmp_path):
    good = msgs(("user", "hi"), ("assistant", "hello"))
    lines = [good] + [b[0] for b in BAD] + ["", good]  # a blank line is not a record
    path = write_lines(tmp_path / "x.jsonl", lines)
    with path.open("ab") as f:
        f.write(b'{"prompt": "caf\xe9", "completion": "x"}\n')  # Latin-1, not UTF-8
    result = read_examples([path])
    assert [(e.line, e.turns) for e in result.examples] == [
        (1, (("user", "hi"), ("assistant", "hello"))), (len(BAD) + 3, parse_record(good))]
    want = [f"rejected {path}:{i}: {reason}: {detail}" for i, (_, reason, detail)
            in enumerate(BAD, start=2)]
    want.append(f"rejected {path}:{len(BAD) + 4}: invalid_utf8: invalid continuation byte at byte 15")
    assert [r.message() for r in result.rejects] == want
    c = result.counts
    assert c.n_in == len(BAD) + 3 == c.kept + sum(c.rejected.values()) and c.kept == 2
    assert c.rejected["unknown_format"] == 2 and c.rejected["wrong_type"] == 3
    assert c.rejected["empty_assistant"] == 2 and sum(c.rejected.values()) == len(BAD) + 1


def test_bom_crlf_and_gzip_files_read(tmp_path):
    rows = [SAME[0], SAME[1], {"prompt": "两行\r\n文本", "completion": "好"}]
    bom = write_lines(tmp_path / "bom.jsonl", rows, prefix=b"\xef\xbb\xbf", eol=b"\r\n")
    gz = tmp_path / "plain.jsonl.gz"
    gz.write_bytes(gzip.compress(write_lines(tmp_path / "p.jsonl", rows).read_bytes()))
    for path in (bom, gz):
        result = read_examples([path])
        assert not result.rejects, [r.message() for r in result.rejects]
        assert [e.turns for e in result.examples] == [TURNS, TURNS,
                                                      (("user", "两行\r\n文本"), ("assistant", "好"))]


def test_unusable_files(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"\n\n")
    long = write_lines(tmp_path / "long.jsonl", [{"prompt": "x" * 200, "completion": "y"}, SAME[3]])
    result = read_examples([empty, long], max_record_bytes=100)
    assert [r.message() for r in result.rejects] == [
        f"rejected {empty}:0: empty_file: the file holds no records",
        f"rejected {long}:1: record_too_large: line longer than max_record_bytes=100"]
    assert result.counts.n_in == 3 and result.counts.kept == 1
    array = tmp_path / "alpaca_data.json"
    array.write_text('[\n  {"instruction": "x", "output": "y"}\n]\n')
    with pytest.raises(InputError, match="a JSON array, not JSON lines"):
        read_examples([array])
