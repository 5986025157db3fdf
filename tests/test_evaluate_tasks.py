"""Held-out task scoring: teacher-forced exact match agrees with a greedy generate loop,
the response loss is the masked cross-entropy, multiple choice picks the most likely
choice, padding changes nothing, and the shipped demo test files read as documented."""

from __future__ import annotations

import gzip
import json
import math
import zlib
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lmforge.config import ModelConfig
from lmforge.errors import InputError
from lmforge.evaluate.report import tasks_markdown
from lmforge.evaluate.sequences import score_sequences
from lmforge.evaluate.stats import ratio_stderr
from lmforge.evaluate.tasks import (
    EXACT_TASKS,
    TaskRecord,
    read_task_records,
    score_choices,
    score_responses,
)
from lmforge.finetune.template import END_MARKER, generation_prompt, marker_ids, render
from lmforge.model.generate import generate
from lmforge.model.llama import Llama
from lmforge.tokenizer import Tokenizer

DEMO = Path(__file__).resolve().parents[1] / "data" / "instructions" / "demo"


@pytest.fixture(scope="module")
def tok(chat_tokenizer) -> Tokenizer:
    return Tokenizer.load(chat_tokenizer)


@pytest.fixture(scope="module")
def llama(tok) -> Llama:
    torch.manual_seed(0)
    cfg = ModelConfig(n_layer=2, n_head=2, n_embd=32, seq_len=128, ffn_multiple_of=16)
    return Llama(cfg, tok.vocab_size)


class ScriptedLM(torch.nn.Module):
    """Next-token logits from the whole prefix: seeded noise (or zeros), and for a
    prefix in ``script`` the given logits set exactly (equal values make a tie).

    Runs under ``generate``'s KV cache by remembering the context in the cache object.
    """

    def __init__(self, vocab_size: int, script: dict[tuple[int, ...], dict[int, float]],
                 noise: bool = True) -> None:
        super().__init__()
        self.config = ModelConfig(n_layer=1, n_head=1, n_embd=2, seq_len=128)
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # generate reads device and dtype
        self.vocab_size, self.script, self.noise = vocab_size, script, noise

    def next_logits(self, prefix: list[int]) -> torch.Tensor:
        if self.noise:
            seed = zlib.crc32(np.asarray(prefix, dtype=np.int64).tobytes())
            logits = torch.randn(self.vocab_size, generator=torch.Generator().manual_seed(seed))
        else:
            logits = torch.zeros(self.vocab_size)
        for token, value in self.script.get(tuple(prefix), {}).items():
            logits[token] = value
        return logits

    def forward(self, idx: torch.Tensor, cache=None) -> torch.Tensor:
        rows = idx.tolist()
        if cache is None:
            return torch.stack([torch.stack([self.next_logits(r[:t + 1]) for t in range(len(r))])
                                for r in rows])
        before = cache.ctx if cache.pos else []  # pos 0: a (re-)prefill
        ctx = before + rows[0]
        cache.ctx, cache.pos = ctx, cache.pos + len(rows[0])
        return torch.stack([self.next_logits(ctx[:t + 1])
                            for t in range(len(before), len(ctx))])[None]


def follow(script: dict, prefix: list[int], tokens: list[int], value: float = 10.0) -> None:
    """Make ``tokens`` a scripted continuation of ``prefix`` (with logit ``value``)."""
    for i, token in enumerate(tokens):
        script.setdefault(tuple(prefix + tokens[:i]), {})[token] = value


def record(question: str, answers: list[str], task: str = "wn_synonym", line: int = 1,
           reply: str | None = None, turns: tuple = ()) -> TaskRecord:
    reply = answers[0] if reply is None else reply
    return TaskRecord("t.jsonl", line, (*turns, ("user", question), ("assistant", reply)),
                      task, "en", answers)


def greedy_hit(model: torch.nn.Module, tok: Tokenizer, rec: TaskRecord) -> bool:
    """The reference: decode greedily with generate() and compare token lists."""
    end = marker_ids(tok)[END_MARKER]
    out = list(generate(model, generation_prompt(rec.prompt, tok), 16, eos_id=end))
    return any(out == tok.encode(a) + [end] for a in rec.answers)


def test_exact_match_equals_a_greedy_generate_loop(tok):
    end = marker_ids(tok)[END_MARKER]
    script: dict = {}

    def prompt(rec: TaskRecord) -> list[int]:
        return generation_prompt(rec.prompt, tok)

    recs, want = {}, {}
    recs["hit"] = r = record("the model?", ["reads"])
    follow(script, prompt(r), tok.encode("reads") + [end])
    want["hit"] = True
    # Several answers: greedy gives the second; the reference reply is the first.
    recs["multi"] = r = record("which token?", ["every token", "the token", "token"])
    follow(script, prompt(r), tok.encode("the token") + [end])
    want["multi"] = True
    recs["early"] = r = record("the user?", ["learns which token"])
    a = tok.encode("learns which token")
    assert len(a) > 1
    follow(script, prompt(r), a[:1] + [end])
    want["early"] = False
    recs["late"] = r = record("and?", ["model"])
    follow(script, prompt(r), tok.encode("model") + tok.encode(" the")[:1])
    want["late"] = False
    # Ties: the first maximum wins, as torch.argmax in sample_next.
    for name, other, hit in (("tie_lost", 8, False), ("tie_won", tok.vocab_size - 1, True)):
        recs[name] = r = record(f"every {name}?", ["reads every"])
        a = tok.encode("reads every") + [end]
        assert len(a) > 2 and other not in a
        follow(script, prompt(r), a)
        script[tuple(prompt(r) + a[:1])] = {a[1]: 10.0, other: 10.0}
        want[name] = hit
    recs["unscripted"] = record("system?", ["end", "user"])
    want["unscripted"] = False
    recs["loose"] = r = record("corpus?", ["which"], task="wn_define")
    follow(script, prompt(r), tok.encode("which") + [end])
    model = ScriptedLM(tok.vocab_size, script)

    for name, rec in recs.items():
        got = score_responses(model, tok, [rec], batch_size=4)["exact_match"]
        if rec.task in EXACT_TASKS:
            assert got["overall"]["correct"] == greedy_hit(model, tok, rec) == want[name], name
        else:
            assert got["tasks"] == {} and got["overall"]["n"] == 0
    allrecs = list(recs.values())
    got = score_responses(model, tok, allrecs, batch_size=3)["exact_match"]
    hits = sum(want[n] for n, r in recs.items() if r.task in EXACT_TASKS)
    assert got["overall"]["correct"] == hits == 3 and got["overall"]["n"] == 7
    assert got["overall"]["exact_match"] == pytest.approx(3 / 7)
    assert got["overall"]["exact_match_stderr"] == pytest.approx(math.sqrt(3 / 7 * 4 / 7 / 7))
    assert set(got["tasks"]) == {"wn_synonym"}


def test_teacher_forced_argmax_matches_generate_on_a_real_model(llama, tok):
    """KV-cache decoding and the full-sequence pass agree on the greedy tokens."""
    seqs, starts, want = [], [], []
    for i, q in enumerate(["the model?", "这是什么？", "def f(x):\n    return x", "end"]):
        head = generation_prompt([("user", q)], tok)
        out = list(generate(llama, head, 4 + i))
        seqs += [head + out, head + out[:-1] + [(out[-1] + 1) % tok.vocab_size]]
        starts += [len(head)] * 2
        want += [True, False]
    got = score_sequences(llama, seqs, starts, batch_size=3)
    assert got.greedy.tolist() == want
    assert got.tokens.tolist() == [len(s) - st for s, st in zip(seqs, starts, strict=True)]


def direct_loss(model: torch.nn.Module, tok: Tokenizer, rec: TaskRecord) -> tuple[float, int]:
    """Summed nats and tokens of the last assistant turn, one record at a time."""
    ids, mask = render(rec.turns, tok)
    start = len(generation_prompt(rec.prompt, tok))
    keep = torch.tensor([bool(m) and i >= start for i, m in enumerate(mask)])[1:]
    with torch.no_grad():
        logits = model(torch.tensor([ids[:-1]]))[0]
    nats = F.cross_entropy(logits, torch.tensor(ids[1:]), reduction="none")
    return float(nats[keep].sum()), int(keep.sum())


LOSS_RECORDS = [
    record("the model?", ["reads every token"], task="a"),
    record("这是什么？", ["我在中国学到了很多。"], task="a"),
    record("one more?", ["x"], task="b"),
    # Multi-turn: only the last assistant turn is scored.
    record("and then?", ["learns"], task="b",
           turns=(("system", "Answer in one word."), ("user", "the model?"),
                  ("assistant", "reads every token of the corpus"))),
]


def test_response_loss_is_the_masked_cross_entropy(llama, tok):
    got = score_responses(llama, tok, LOSS_RECORDS, batch_size=3)["response"]
    per = [direct_loss(llama, tok, r) for r in LOSS_RECORDS]
    nbytes = [len(r.reply.encode()) for r in LOSS_RECORDS]
    for name, pick in (("a", [0, 1]), ("b", [2, 3])):
        fig = got["tasks"][name]
        nats, tokens = sum(per[i][0] for i in pick), sum(per[i][1] for i in pick)
        assert fig["loss"] == pytest.approx(nats / tokens, abs=1e-5)
        assert fig["bits_per_byte"] == pytest.approx(
            nats / math.log(2) / sum(nbytes[i] for i in pick), abs=1e-5)
        assert (fig["n"], fig["tokens"]) == (2, tokens)
    total = got["overall"]
    assert total["loss"] == pytest.approx(sum(p[0] for p in per) / sum(p[1] for p in per),
                                          abs=1e-5)
    assert total["tokens"] == sum(len(tok.encode(r.reply)) + 1 for r in LOSS_RECORDS)
    assert total["bytes"] == sum(nbytes) and total["n"] == 4
    assert total["loss_stderr"] > 0 and math.isfinite(total["bits_per_byte_stderr"])
    single = score_responses(llama, tok, LOSS_RECORDS[:1], batch_size=1)["response"]
    assert math.isnan(single["overall"]["loss_stderr"])  # one record: no spread


def test_ratio_stderr_is_the_standard_error_of_the_mean_for_equal_lengths():
    rng = np.random.default_rng(0)
    nats = rng.random(50) * 10
    tokens = np.full(50, 4.0)
    want = (nats / 4).std(ddof=1) / math.sqrt(50)
    assert ratio_stderr(nats, tokens) == pytest.approx(want)


def words_of_one_token(tok: Tokenizer, n: int, length: int) -> list[str]:
    found = [w for w in ("model", "reads", "token", "which", "every", "learns", "corpus")
             if len(tok.encode(w)) == 1 and len(w) == length]
    assert len(found) >= n
    return found[:n]


def test_multiple_choice_picks_the_most_likely_choice(tok):
    end = marker_ids(tok)[END_MARKER]
    script: dict = {}
    # Short choice: likely in total, unlikely per byte; long one the reverse.
    short, long = "a", "the model reads every token"
    by_length = TaskRecord("mc.jsonl", 1, (("user", "q1"), ("assistant", short)), "mc_len",
                           "en", [short], [long, short], 1)
    head = generation_prompt(by_length.prompt, tok)
    follow(script, head, tok.encode(short) + [end], 8.0)
    follow(script, head, tok.encode(long) + [end], 7.0)
    # Two single-token choices of equal length and no script: an exact tie, the first wins.
    w0, w1 = words_of_one_token(tok, 2, 5)
    tie = TaskRecord("mc.jsonl", 2, (("user", "q2"), ("assistant", w1)), "mc_tie", "en",
                     [w1], [w0, w1], 1)
    easy = TaskRecord("mc.jsonl", 3, (("user", "q3"), ("assistant", "reads")), "mc_easy", "en",
                      ["reads"], ["learns", "corpus", "reads"], 2)
    follow(script, generation_prompt(easy.prompt, tok), tok.encode("reads") + [end])
    model = ScriptedLM(tok.vocab_size, script, noise=False)

    # The reference: the summed log-probability of each choice, one sequence at a time.
    def loglik(rec: TaskRecord, choice: str) -> float:
        return -direct_loss(model, tok, TaskRecord("x", 0, (*rec.prompt, ("assistant", choice)),
                                                     "x", "en", [choice]))[0]
    ll = [loglik(by_length, c) for c in by_length.choices]
    assert ll[1] > ll[0] and ll[1] / len(short) < ll[0] / len(long)

    got = score_choices(model, tok, [by_length, tie, easy], batch_size=2)["multiple_choice"]
    tasks = got["tasks"]
    assert (tasks["mc_len"]["acc"], tasks["mc_len"]["acc_norm"]) == (1.0, 0.0)
    assert (tasks["mc_tie"]["acc"], tasks["mc_tie"]["acc_norm"]) == (0.0, 0.0)
    assert (tasks["mc_easy"]["acc"], tasks["mc_easy"]["acc_norm"]) == (1.0, 1.0)
    overall = got["overall"]
    assert overall["n"] == 3 and overall["acc"] == pytest.approx(2 / 3)
    assert overall["acc_norm"] == pytest.approx(1 / 3)
    assert overall["acc_stderr"] == pytest.approx(math.sqrt(2 / 9 / 3))
    assert overall["chance"] == pytest.approx((1 / 2 + 1 / 2 + 1 / 3) / 3)
    with pytest.raises(InputError, match="t.jsonl:1: not a multiple-choice record"):
        score_choices(model, tok, [record("q", ["a"])], batch_size=2)


def flat(d: dict, prefix: str = "") -> dict[str, float]:
    out = {}
    for k, v in d.items():
        out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k: v})
    return out


def test_padding_changes_no_figure(llama, tok):
    recs = [*LOSS_RECORDS, record("the model reads every token of the corpus, and?",
                                  ["learns which user", "learns"], task="wn_synonym")]
    alone = flat(score_responses(llama, tok, recs, batch_size=1))
    batched = flat(score_responses(llama, tok, recs, batch_size=8))
    assert alone.keys() == batched.keys()
    for key, value in alone.items():
        assert batched[key] == pytest.approx(value, abs=1e-5, nan_ok=True), key
    # Per sequence: a short one alone and among longer ones.
    short = generation_prompt([("user", "x")], tok) + tok.encode("reads")
    longer = [generation_prompt([("user", "the model " * k)], tok) + tok.encode("every token")
              for k in (3, 6)]
    one = score_sequences(llama, [short], [len(short) - 2], batch_size=1)
    many = score_sequences(llama, [*longer, short], [5, 7, len(short) - 2], batch_size=3)
    assert many.nats[2] == pytest.approx(one.nats[0], abs=1e-5)
    assert many.greedy[2] == one.greedy[0] and many.tokens[2] == one.tokens[0] == 2
    mc = [TaskRecord("m", i, (("user", q), ("assistant", "x")), "t", "en", ["x"],
                     ["model", "the model reads every token", "x"], i % 3)
          for i, q in enumerate(["a?", "the corpus of the model?", "b"])]
    assert (flat(score_choices(llama, tok, mc, batch_size=1))
            == flat(score_choices(llama, tok, mc, batch_size=9)))


def test_model_mode_is_restored_and_too_long_is_refused(llama, tok):
    llama.train()
    score_responses(llama, tok, LOSS_RECORDS[:2], batch_size=2)
    assert llama.training
    llama.eval()
    score_responses(llama, tok, LOSS_RECORDS[:2], batch_size=2)
    assert not llama.training
    with pytest.raises(InputError, match=r"t.jsonl:1: \d+ tokens with the reply, more than"):
        score_responses(llama, tok, [record("the model " * 100, ["x"])], batch_size=2)


# --------------------------------------------------------------------------- files

TEST_TASKS = {"wn_define": 98, "wn_synonym": 67, "wn_antonym": 50, "wn_example": 64,
              "poem_author": 27, "poem_first_line": 27, "poem_next_line": 102,
              "py_summary": 51, "py_signature": 57}  # PROVENANCE.md's table
MC_TASKS = {"wn_synonym": 67, "wn_antonym": 50, "poem_author": 27}


def test_reading_the_shipped_demo_test_files():
    test = read_task_records(DEMO / "test.jsonl.gz")
    mc = read_task_records(DEMO / "test_mc.jsonl.gz")
    assert len(test) == 543 and len(mc) == 144
    assert Counter(r.task for r in test) == TEST_TASKS
    assert Counter(r.task for r in mc) == MC_TASKS
    assert set(TEST_TASKS) > EXACT_TASKS
    assert set(TEST_TASKS) - EXACT_TASKS == {"wn_define", "wn_example", "py_summary"}
    assert {r.lang for r in test} == {"en", "zh"}
    assert all(r.choices is None and r.answer is None and r.answers for r in test)
    assert all(len(r.choices) == 4 and r.choices[r.answer] == r.reply for r in mc)
    assert all(r.turns[0][0] == "user" and len(r.turns) == 2 for r in test + mc)
    assert test[0].line == 1 and test[-1].line == 543 and test[0].source_id


def test_demo_files_score_end_to_end(tok):
    """A slice of the demo through both scorers and the markdown table."""
    torch.manual_seed(0)
    model = Llama(ModelConfig(n_layer=1, n_head=2, n_embd=32, seq_len=1024,
                              ffn_multiple_of=16), tok.vocab_size)
    test = read_task_records(DEMO / "test.jsonl.gz")[:60]
    mc = read_task_records(DEMO / "test_mc.jsonl.gz")[:24]
    base = {**score_responses(model, tok, test, 16), **score_choices(model, tok, mc, 16)}
    assert base["response"]["overall"]["n"] == 60
    assert set(base["exact_match"]["tasks"]) == {r.task for r in test} & EXACT_TASKS
    assert base["multiple_choice"]["overall"]["chance"] == 0.25
    md = tasks_markdown(base, base)
    assert "### Exact match" in md and "### Response loss" in md and "### Multiple choice" in md
    assert "| all | 60 |" in md and "| all | 24 |" in md


def write(path: Path, objs: list, bom: bool = False, eol: bytes = b"\n") -> Path:
    data = b"".join((o if isinstance(o, str) else json.dumps(o, ensure_ascii=False))
                    .encode() + eol for o in objs)
    data = (b"\xef\xbb\xbf" if bom else b"") + data
    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)
    return path


GOOD = {"messages": [{"role": "user", "content": "Give the antonym of the adjective \"hot\"."},
                     {"role": "assistant", "content": "cold"}],
        "task": "wn_antonym", "source_id": "wordnet:a:1", "lang": "en", "answers": ["cold"]}
GOOD_MC = {**GOOD, "choices": ["warm", "cold", "big", "red"], "answer": 1}


def test_bom_crlf_and_gzip_are_read(tmp_path):
    recs = read_task_records(write(tmp_path / "t.jsonl.gz", [GOOD, "", GOOD_MC], bom=True,
                                   eol=b"\r\n"))
    assert [r.line for r in recs] == [1, 3]
    assert recs[0].turns == (("user", 'Give the antonym of the adjective "hot".'),
                             ("assistant", "cold"))
    assert (recs[1].choices, recs[1].answer, recs[1].answers) == (GOOD_MC["choices"], 1, ["cold"])


BAD = [
    ('{"messages": [', "invalid_json"),
    ({**GOOD, "messages": [{"role": "bot", "content": "x"}]}, "bad_role"),
    ({k: v for k, v in GOOD.items() if k != "task"}, "task is null, not a string"),
    ({**GOOD, "lang": 1}, "lang is int, not a string"),
    ({**GOOD, "answers": "cold"}, "answers is not a list of strings"),
    ({**GOOD, "answers": ["cold", 2]}, "answers is not a list of strings"),
    ({**GOOD, "answers": []}, "answers is empty"),
    ({**GOOD, "choices": ["a", "b"]}, "'choices' and 'answer' go together"),
    ({**GOOD_MC, "answer": True}, "answer is bool, not an integer"),
    ({**GOOD_MC, "answer": 4}, "answer 4 is not an index of 4 choices"),
    ({**GOOD_MC, "choices": ["cold"], "answer": 0}, "at least 2 non-empty strings"),
    ({**GOOD, "source_id": 3}, "source_id is int, not a string"),
]


@pytest.mark.parametrize(("bad", "message"), BAD, ids=[m for _, m in BAD])
def test_a_bad_line_is_an_error_naming_file_and_line(tmp_path, bad, message):
    path = write(tmp_path / "t.jsonl", [GOOD, bad])
    with pytest.raises(InputError, match=f"t.jsonl:2: .*{message}"):
        read_task_records(path)


def test_an_empty_file_is_an_error(tmp_path):
    with pytest.raises(InputError, match="empty_file|no records"):
        read_task_records(write(tmp_path / "t.jsonl", []))


def test_markdown_flags_changes_beyond_two_standard_errors():
    def em(p: float, se: float, n: int = 100) -> dict:
        return {"n": n, "correct": int(p * n), "exact_match": p, "exact_match_stderr": se}

    base = {"exact_match": {"overall": em(0.2, 0.04), "tasks": {"x": em(0.2, 0.04),
                                                                "y": em(0.0, 0.0)}}}
    tuned = {"exact_match": {"overall": em(0.21, 0.04), "tasks": {"x": em(0.5, 0.05),
                                                                  "y": em(0.0, 0.0)}}}
    rows = {line.split(" | ")[0][2:]: line for line in tasks_markdown(base, tuned).splitlines()
            if line.startswith("| ") and "task" not in line}
    assert rows["x"].endswith("| +0.300 | yes |")
    assert rows["y"].endswith("| +0.000 | no |")
    assert rows["all"].endswith("| +0.010 | no |")
    assert "Response loss" not in tasks_markdown(base, tuned)
