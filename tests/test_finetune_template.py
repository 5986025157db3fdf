"""The chat template: reserved marker ids, the loss mask, rejects, the marker-in-text
behaviour, and Hugging Face's apply_chat_template giving exactly our ids."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from chat_tokenizer import corpus, train

from lmforge.config import ModelConfig, TokenizerConfig
from lmforge.errors import ConfigError, InputError
from lmforge.finetune.records import Example, ReadResult
from lmforge.finetune.template import (
    CHAT_MARKERS,
    CHAT_TEMPLATE,
    EMPTY_MASK,
    TOO_LONG,
    check_rendered,
    generation_prompt,
    marker_ids,
    render,
    render_all,
    render_text,
)
from lmforge.tokenizer import Tokenizer
from lmforge.tokenizer.train import train_model

CONVERSATIONS = {
    "english": [("user", "Which token ends a turn?"), ("assistant", "The end marker, every time.")],
    "chinese-system": [("system", "你是一个有帮助的助手。"), ("user", "我在中国学到了很多。"),
                       ("assistant", "她说：“你好！”")],
    "multi-turn": [("system", "Answer in one word."), ("user", "the model?"), ("assistant", "reads"),
                   ("user", "  and then\n\tevery token"), ("assistant", "learns\n"),
                   ("user", "代码 def f(x):\n    return x"), ("assistant", "好 🙂")],
}


@pytest.fixture(scope="module")
def sp_path(chat_tokenizer) -> Path:
    return chat_tokenizer


@pytest.fixture(scope="module")
def tok(sp_path) -> Tokenizer:
    return Tokenizer.load(sp_path)


def test_markers_are_single_reserved_ids_never_made_from_text(tok, tmp_path):
    ids = marker_ids(tok)
    assert [ids[m] for m in CHAT_MARKERS] == [4, 5, 6, 7]
    assert [tok.piece(i) for i in range(4, 8)] == list(CHAT_MARKERS)
    for marker in CHAT_MARKERS:  # typed as text, a marker is ordinary pieces
        enc = tok.encode(f"say {marker} now{marker}")
        assert not set(enc) & {4, 5, 6, 7} and tok.decode(enc) == f"say {marker} now{marker}"
    # No reserved tokens by default: the pipeline's tokenizer is unchanged.
    plain = Tokenizer.load(train(tmp_path / "plain.model", reserved=()))
    assert plain.piece(4) not in CHAT_MARKERS
    with pytest.raises(InputError, match="no chat marker <|system|>"):
        marker_ids(plain)
    for bad in (["<|a|>", "<|a|>"], ["<s>"], ["<| a |>"], [""]):
        with pytest.raises(ConfigError, match="reserved token"):
            train_model(corpus(), TokenizerConfig(vocab_size=500), reserved_tokens=bad)


def test_dummy_prefix_tokenizer_is_refused(tmp_path):
    nfkc = Tokenizer.load(train(tmp_path / "nfkc.model", normalization="nfkc"))
    with pytest.raises(InputError, match="needs normalization: identity"):
        render(CONVERSATIONS["english"], nfkc)


def masked_runs(ids: list[int], mask: list[int]) -> list[list[int]]:
    runs, run = [], []
    for i, m in zip(ids, mask, strict=True):
        if m:
            run.append(i)
        elif run:
            runs.append(run)
            run = []
    return runs + ([run] if run else [])


@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_layout_and_loss_mask(tok, name):
    turns = CONVERSATIONS[name]
    ids, mask = render(turns, tok)
    m = marker_ids(tok)
    want = [tok.bos_id]
    for role, content in turns:
        want += [m[f"<|{role}|>"], *tok.encode(content), m["<|end|>"]]
    assert ids == want and len(mask) == len(ids)
    # The mask covers exactly each assistant content and its closing <|end|>.
    runs = masked_runs(ids, mask)
    answers = [c for r, c in turns if r == "assistant"]
    assert [tok.decode(run[:-1]) for run in runs] == answers
    assert all(run[-1] == m["<|end|>"] for run in runs)
    opened = [i for i, t in enumerate(ids) if t in (m["<|system|>"], m["<|user|>"], m["<|assistant|>"])]
    assert len(opened) == len(turns) and not any(mask[i] for i in opened) and mask[0] == 0
    assert sum(mask) == sum(len(tok.encode(a)) + 1 for a in answers)
    gen = generation_prompt(turns, tok)
    assert gen == ids + [m["<|assistant|>"]]


def test_marker_typed_in_a_message_stays_text(tok):
    text = "What does <|user|> mean? And <|end|><|assistant|>?"
    turns = [("user", text), ("assistant", "A marker: <|end|>")]
    ids, mask = render(turns, tok)
    m = marker_ids(tok)
    assert ids.count(m["<|user|>"]) == 1 and ids.count(m["<|assistant|>"]) == 1
    assert ids.count(m["<|end|>"]) == 2
    assert [tok.decode(r[:-1]) for r in masked_runs(ids, mask)] == ["A marker: <|end|>"]


def test_empty_mask_and_too_long_are_rejected(tok):
    result = ReadResult()
    ok = Example("x.jsonl", 1, tuple(CONVERSATIONS["english"]))
    no_answer = Example("x.jsonl", 2, (("system", "s"), ("user", "only a question")))
    long = Example("x.jsonl", 3, (("user", "the model " * 40), ("assistant", "yes")))
    result.examples = [ok, no_answer, long]
    result.counts.n_in = result.counts.kept = 3
    out = render_all(result, tok, max_tokens=60)
    assert [(r.file, r.line) for r in out] == [("x.jsonl", 1)] and result.examples == [ok]
    msgs = [r.message() for r in result.rejects]
    assert msgs[0].startswith(f"rejected x.jsonl:2: {EMPTY_MASK}: no assistant token to learn in")
    assert msgs[1].startswith(f"rejected x.jsonl:3: {TOO_LONG}: ") and msgs[1].endswith(
        " tokens > max_tokens=60")
    c = result.counts
    assert (c.n_in, c.kept, dict(c.rejected)) == (3, 1, {EMPTY_MASK: 1, TOO_LONG: 1})
    assert check_rendered([1, 4, 9, 7], [0, 0, 0, 0], None)[0] == EMPTY_MASK
    assert check_rendered([1, 6, 9, 7], [0, 0, 1, 1], 4) is None


def make_model_dir(path: Path, sp: Path) -> Path:
    from lmforge.model import Llama, save_model

    tok = Tokenizer.load(sp)
    cfg = ModelConfig(n_layer=1, n_head=2, n_embd=32, seq_len=64, ffn_multiple_of=16)
    torch.manual_seed(0)
    model = Llama(cfg, tok.vocab_size)
    special = {"bos": tok.bos_id, "eos": tok.eos_id, "pad": tok.pad_id, "unk": tok.unk_id}
    save_model(model, path, sp, special_ids=special, tokenizer_sha256=tok.sha256)
    return path


@pytest.fixture(scope="module")
def hf_tok(sp_path, tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    from lmforge.export import export_hf

    root = tmp_path_factory.mktemp("hf")
    out = export_hf(make_model_dir(root / "final", sp_path), root / "hf")
    special = json.loads((out / "special_tokens_map.json").read_text())
    assert special["additional_special_tokens"] == list(CHAT_MARKERS)
    hf = transformers.AutoTokenizer.from_pretrained(out)
    hf.chat_template = CHAT_TEMPLATE
    return hf


def hf_ids(hf, turns, **kw) -> list[int]:
    out = hf.apply_chat_template([{"role": r, "content": c} for r, c in turns], tokenize=True, **kw)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_hf_apply_chat_template_gives_our_ids(tok, hf_tok, name):
    turns = CONVERSATIONS[name]
    assert hf_tok.apply_chat_template([{"role": r, "content": c} for r, c in turns],
                                      tokenize=False) == render_text(turns)
    assert hf_ids(hf_tok, turns) == render(turns, tok)[0]
    prompt = turns[:-1]
    assert hf_ids(hf_tok, prompt, add_generation_prompt=True) == generation_prompt(prompt, tok)
    assert hf_tok.convert_tokens_to_ids(list(CHAT_MARKERS)) == [4, 5, 6, 7]
    ids = render(turns, tok)[0]
    assert hf_tok.decode(ids, skip_special_tokens=False) == render_text(turns)
    answer_only = hf_tok.decode(ids, skip_special_tokens=True)
    assert answer_only == "".join(c for _, c in turns)  # markers and BOS are special


def test_hf_matches_a_marker_typed_in_text_unlike_us(tok, hf_tok):
    # Documented difference: Hugging Face matches special tokens inside text.
    turns = [("user", "type <|user|> here"), ("assistant", "ok")]
    ours, theirs = render(turns, tok)[0], hf_ids(hf_tok, turns)
    assert ours.count(5) == 1 and theirs.count(5) == 2
