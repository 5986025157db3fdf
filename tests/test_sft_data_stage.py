"""The sft_data stage: records of every shape in, counted rejects, masked packed shards out."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest
from chat_tokenizer import train as train_tokenizer

from lmforge.config import SftDataConfig
from lmforge.errors import InputError
from lmforge.finetune.build import build
from lmforge.model.loss import IGNORE_INDEX
from lmforge.shards.loader import ShardSet, WindowLoader
from lmforge.tokenizer import Tokenizer


def lines(*objs) -> bytes:
    return "\r\n".join(json.dumps(o, ensure_ascii=False) for o in objs).encode() + b"\r\n"


@pytest.fixture(scope="module")
def tokenizer(chat_tokenizer):
    return chat_tokenizer


def test_every_record_is_kept_or_rejected_and_only_answers_are_targets(tokenizer, tmp_path):
    chat = [{"messages": [{"role": "user", "content": f"question {i}"},
                          {"role": "assistant", "content": f"answer {i} 答"}]}
            for i in range(40)]
    bad = [{"messages": [{"role": "user", "content": "q"},
                         {"role": "assistant", "content": ""}]},           # empty answer
           {"messages": [{"role": "narrator", "content": "x"}]},          # unknown role
           {"instruction": "long " * 400, "output": "y"}]                 # too long
    (tmp_path / "chat.jsonl").write_bytes(b"\xef\xbb\xbf" + lines(*chat, *bad))
    with gzip.open(tmp_path / "alpaca.jsonl.gz", "wb") as f:
        f.write(lines(*[{"instruction": f"do {i}", "input": "", "output": f"done {i}"}
                        for i in range(20)]))
    cfg = SftDataConfig(sources=[str(tmp_path / "*.jsonl*")], seq_len=64, val_fraction=0.2)
    m = build(cfg, tokenizer, tmp_path / "sft")
    c = m["counts"]
    assert c["in"] == 63 and c["kept"] == 60
    assert set(c["rejected"]) == {"empty_assistant", "bad_role", "too_long"}
    assert len(m["first_rejects"]) == 3 and all(":" in r for r in m["first_rejects"])
    assert m["train"]["examples"] + m["val"]["examples"] == 60 and m["val"]["examples"] > 0
    tok = Tokenizer.load(tokenizer)
    shards = ShardSet(tmp_path / "sft" / "train")
    assert shards.has_loss_mask and shards.manifest["seq_len"] == 64
    batch = WindowLoader(shards, 64, m["train"]["rows"], seed=0).next_batch()
    targets = batch[1][batch[1] != IGNORE_INDEX].tolist()
    text = tok.decode([t for t in targets if t >= 8])  # without the chat markers
    assert "answer" in text and "done" in text
    assert "question" not in text and "do " not in text  # prompts are never targets
    assert m["train"]["target_tokens"] == int(np.count_nonzero(
        (batch[1] != IGNORE_INDEX).numpy()))


def test_a_tokenizer_without_chat_markers_and_an_empty_glob_are_one_line(tokenizer,
                                                                         tmp_path):
    plain = train_tokenizer(tmp_path / "plain.model", reserved=())
    (tmp_path / "a.jsonl").write_text('{"prompt": "p", "completion": "c"}\n')
    with pytest.raises(InputError, match="no chat marker"):
        build(SftDataConfig(sources=[str(tmp_path / "a.jsonl")]), plain, tmp_path / "o")
    with pytest.raises(InputError, match="matches no file"):
        build(SftDataConfig(sources=[str(tmp_path / "none*.jsonl")]), tokenizer,
              tmp_path / "o")
