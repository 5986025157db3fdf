"""The shipped demo instruction set (data/instructions/demo): shape, split and size guarantees."""

from __future__ import annotations

import gzip
import json
from collections import Counter
from pathlib import Path

import pytest

SFT = Path(__file__).resolve().parents[1] / "data" / "instructions" / "demo"
#: What PROVENANCE.md promises: a few thousand train and a few hundred test records.
TRAIN_RANGE = (2_000, 10_000)
TEST_RANGE = (200, 1_500)
MAX_FILE_BYTES = 2_000_000
MAX_CHARS = {"en": 600, "zh": 200}


def load(name: str) -> list[dict]:
    path = SFT / name
    if not path.is_file():
        pytest.fail(f"{path}: missing; rebuild with data/instructions/demo/build_sft_demo.py")
    assert path.stat().st_size < MAX_FILE_BYTES
    raw = path.read_bytes()
    assert raw[4:8] == b"\0\0\0\0", f"{name}: gzip mtime is not 0 (bytes would not be stable)"
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def splits() -> dict[str, list[dict]]:
    return {s: load(f"{s}.jsonl.gz") for s in ("train", "test")}


def test_records_are_user_then_assistant(splits: dict[str, list[dict]]) -> None:
    for records in splits.values():
        for r in records:
            roles = [m["role"] for m in r["messages"]]
            assert roles in (["user", "assistant"], ["system", "user", "assistant"]), r
            assert r["messages"][-2]["content"].strip(), r
            assert r["messages"][-1]["content"].strip(), r
            assert r["task"] and r["source_id"] and r["lang"] in MAX_CHARS, r
            assert r["answers"] and all(a.strip() for a in r["answers"]), r


def test_conversations_fit_the_character_cap(splits: dict[str, list[dict]]) -> None:
    for records in splits.values():
        for r in records:
            chars = sum(len(m["content"]) for m in r["messages"])
            assert chars < MAX_CHARS[r["lang"]], r


def test_no_source_item_in_both_splits(splits: dict[str, list[dict]]) -> None:
    train = {r["source_id"] for r in splits["train"]}
    test = {r["source_id"] for r in splits["test"]}
    assert not train & test


def test_sizes_tasks_and_languages(splits: dict[str, list[dict]]) -> None:
    assert TRAIN_RANGE[0] <= len(splits["train"]) <= TRAIN_RANGE[1]
    assert TEST_RANGE[0] <= len(splits["test"]) <= TEST_RANGE[1]
    train_tasks = Counter(r["task"] for r in splits["train"])
    test_tasks = Counter(r["task"] for r in splits["test"])
    assert set(train_tasks) == set(test_tasks)  # every task is evaluated
    assert {r["lang"] for r in splits["test"]} == {"en", "zh"}
    prompts = [(r["task"], r["messages"][-2]["content"]) for s in splits.values() for r in s]
    assert len(set(prompts)) == len(prompts)


def test_multiple_choice_variant(splits: dict[str, list[dict]]) -> None:
    mc = load("test_mc.jsonl.gz")
    assert mc
    test_ids = {r["source_id"] for r in splits["test"]}
    for r in mc:
        assert r["source_id"] in test_ids, r
        choices = r["choices"]
        assert len(choices) == 4 and len(set(choices)) == 4, r
        assert choices[r["answer"]] == r["messages"][-1]["content"], r
        wrong = {c for i, c in enumerate(choices) if i != r["answer"]}
        assert not wrong & set(r["answers"]), r  # no distractor is an accepted answer
