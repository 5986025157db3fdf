"""``lmforge chat`` (one-shot, JSON, REPL, context trimming) and the chat export to
Hugging Face: apply_chat_template and model.generate give the ids our chat gives."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from chat_tokenizer import train

from lmforge import chat as chat_mod
from lmforge.chat import ChatSession, one_shot, repl, stream_reply
from lmforge.cli import build_parser, main
from lmforge.config import ModelConfig
from lmforge.errors import InputError
from lmforge.finetune.template import CHAT_TEMPLATE, END_MARKER, generation_prompt, marker_ids
from lmforge.model import Llama, generate, load_model, save_model
from lmforge.tokenizer import Tokenizer

Q1, Q2, Q3 = "Which token ends a turn?", "我在中国学到了很多。", "the model reads every token"
SYSTEM = "Answer in one word."


def make_model_dir(path: Path, sp: Path) -> Path:
    """A tiny random untied model; its greedy reply to ``Q1`` stops at ``<|end|>``.

    Swapping two rows of the LM head makes ``<|end|>`` win exactly where the greedy reply
    first picks token ``a``, so the reply ends after a few tokens by construction.
    """
    tok = Tokenizer.load(sp)
    cfg = ModelConfig(n_layer=2, n_head=2, n_embd=32, seq_len=64, ffn_multiple_of=16,
                      tie_embeddings=False)
    torch.manual_seed(0)
    model = Llama(cfg, tok.vocab_size).eval()
    try:
        end = marker_ids(tok)[END_MARKER]
    except InputError:  # a tokenizer without markers: just save the model
        end = None
    if end is not None:
        ref = list(generate(model, generation_prompt([("user", Q1)], tok), 12))
        k = next(i for i in range(2, 12) if ref[i] not in ref[:i] and ref[i] >= 8)
        assert end not in ref[:k]
        with torch.no_grad():
            model.lm_head.weight[[ref[k], end]] = model.lm_head.weight[[end, ref[k]]]
    special = {"bos": tok.bos_id, "eos": tok.eos_id, "pad": tok.pad_id, "unk": tok.unk_id}
    save_model(model, path, sp, special_ids=special, tokenizer_sha256=tok.sha256)
    return path


@pytest.fixture(scope="module")
def sp_path(chat_tokenizer) -> Path:
    return chat_tokenizer


@pytest.fixture(scope="module")
def tok(sp_path) -> Tokenizer:
    return Tokenizer.load(sp_path)


@pytest.fixture(scope="module")
def model_dir(sp_path, tmp_path_factory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("sft") / "sft", sp_path)


def reference(model_dir: Path, tok: Tokenizer, turns, n: int = 12) -> list[int]:
    """Greedy ids from ``generate`` with the chat prompt, cut after ``<|end|>`` or EOS."""
    model, _ = load_model(model_dir)
    out = []
    for t in generate(model, generation_prompt(turns, tok), n, eos_id=marker_ids(tok)[END_MARKER]):
        out.append(t)
        if t == tok.eos_id:
            break
    return out


def text_of(tok: Tokenizer, ids: list[int]) -> str:
    end = marker_ids(tok)[END_MARKER]
    return tok.decode([t for t in ids if t not in (end, tok.eos_id)])


def session(model_dir: Path, tok: Tokenizer, **kw) -> ChatSession:
    return ChatSession(load_model(model_dir)[0], tok, **kw)


def test_one_shot_prints_the_greedy_replies_and_renders_the_history(model_dir, tok, capsys,
                                                                    monkeypatch):
    end = marker_ids(tok)[END_MARKER]
    first = reference(model_dir, tok, [("user", Q1)])
    assert first[-1] == end and len(first) < 12  # stopped at <|end|>, not at the limit
    reply1 = text_of(tok, first)
    turns2 = [("user", Q1), ("assistant", reply1), ("user", Q2)]
    reply2 = text_of(tok, reference(model_dir, tok, turns2))
    prompts = []

    def recording(model, idx, *a, **kw):  # generate is called once per reply (KV cache)
        prompts.append(list(idx))
        return generate(model, idx, *a, **kw)

    monkeypatch.setattr(chat_mod, "generate", recording)
    main(["chat", "--model", str(model_dir), "-m", Q1, "-m", Q2, "--max-new-tokens", "12"])
    assert capsys.readouterr().out == f"{reply1}\n\n{reply2}\n"
    assert prompts == [generation_prompt([("user", Q1)], tok), generation_prompt(turns2, tok)]
    # The second prompt holds the first reply, closed by <|end|>.
    assert prompts[1][len(prompts[0]):][:len(tok.encode(reply1)) + 1] == tok.encode(reply1) + [end]

    main(["chat", "--model", str(model_dir), "--system", SYSTEM, "-m", Q1, "--json",
          "--max-new-tokens", "12"])
    got = json.loads(capsys.readouterr().out)
    sys_reply = text_of(tok, reference(model_dir, tok, [("system", SYSTEM), ("user", Q1)]))
    assert got == {"messages": [{"role": "system", "content": SYSTEM},
                                {"role": "user", "content": Q1},
                                {"role": "assistant", "content": sys_reply}]}


def test_stream_prints_multibyte_text_whole(tok):
    text = "我在中国学到了很多。🙂 ж"  # 🙂 and ж are byte-fallback pieces
    ids = tok.encode(text)
    assert len(ids) > len(text) // 2
    out = io.StringIO()
    writes = []
    out.write = lambda s: writes.append(s) or len(s)  # type: ignore[method-assign]
    end = marker_ids(tok)[END_MARKER]
    got = stream_reply(iter([*ids, end, 42]), tok, {end}, out)
    assert got == [*ids, end] and "".join(writes) == text
    assert not any("\ufffd" in w for w in writes) and len([w for w in writes if w]) > 3


def test_repl_resets_exits_and_stops_at_eof(model_dir, tok, monkeypatch, capsys):
    s = session(model_dir, tok, max_new_tokens=12)
    out, err = io.StringIO(), io.StringIO()
    repl(s, io.StringIO(f"{Q1}\n/reset\n\n{Q1}\n{Q2}"), out, err)  # no newline before EOF
    reply1 = text_of(tok, reference(model_dir, tok, [("user", Q1)]))
    turns2 = [("user", Q1), ("assistant", reply1), ("user", Q2)]
    reply2 = text_of(tok, reference(model_dir, tok, turns2))
    assert out.getvalue() == f"{reply1}\n{reply1}\n{reply2}\n"  # after /reset: the same answer
    assert err.getvalue() == "(conversation cleared)\n"
    assert s.history == [*turns2, ("assistant", reply2)]
    # Through the CLI, stdin a pipe: /exit ends the chat before the second message.
    monkeypatch.setattr("sys.stdin", io.StringIO(f"{Q1}\n/exit\n{Q2}\n"))
    main(["chat", "--model", str(model_dir), "--max-new-tokens", "12"])
    assert capsys.readouterr().out == f"{reply1}\n"


def test_long_conversations_drop_the_oldest_turns_and_keep_the_system(model_dir, tok,
                                                                      monkeypatch):
    lengths = []

    def recording(model, idx, *a, **kw):
        lengths.append(len(idx))
        return generate(model, idx, *a, **kw)

    monkeypatch.setattr(chat_mod, "generate", recording)
    err = io.StringIO()
    s = session(model_dir, tok, system=SYSTEM, max_new_tokens=8, err=err)
    for i in range(6):
        s.reply(f"{Q3} {i} " + Q1)
    assert max(lengths) <= 64 - 8 and len(lengths) == 6  # room for the reply
    assert err.getvalue().count("note: the conversation outgrew the model's 64-token") == 1
    assert s.turns()[0] == ("system", SYSTEM) and s.history[0][0] == "user"
    # The prompts left the oldest exchanges out; the history keeps every turn.
    assert len(s.history) == 12 and s.history[-2] == ("user", f"{Q3} 5 " + Q1)
    assert len(generation_prompt(s.turns(), tok)) > 64 - 8
    # One message that cannot fit is refused in one line and leaves the history alone.
    before = list(s.history)
    with pytest.raises(InputError, match="keeps 8 for the reply"):
        s.reply(Q3 * 10)
    assert s.history == before
    out, err = io.StringIO(), io.StringIO()
    repl(s, io.StringIO(f"{Q3 * 10}\n{Q1}\n"), out, err)
    assert err.getvalue().startswith("error: chat: the message makes a ") and len(s.history) > 0
    assert s.history[-2] == ("user", Q1)


def _long_chat(model_dir: Path, tok: Tokenizer, monkeypatch) -> tuple[ChatSession, list]:
    """A session whose six exchanges outgrew the 64-token context, and the prompts sent."""
    prompts: list[list[int]] = []

    def recording(model, idx, *a, **kw):
        prompts.append(list(idx))
        return generate(model, idx, *a, **kw)

    monkeypatch.setattr(chat_mod, "generate", recording)
    s = session(model_dir, tok, system=SYSTEM, max_new_tokens=8, err=io.StringIO())
    for i in range(6):
        s.reply(f"{Q3} {i} " + Q1)
    return s, prompts


@pytest.mark.parametrize("failure", [KeyboardInterrupt, RuntimeError])
def test_an_interrupted_reply_leaves_a_trimmed_history_as_it_was(model_dir, tok, monkeypatch,
                                                                 failure):
    """Ctrl-C (or an error) mid-reply after the context was trimmed: every old turn is
    still there (issue 43, defect 6: 6 turns before, 2 after)."""
    s, prompts = _long_chat(model_dir, tok, monkeypatch)
    before = list(s.history)
    word = tok.encode("the")[0]
    assert word not in s.stop_ids

    def broken(model, idx, *a, **kw):  # one token of the reply, then Ctrl-C or a failure
        prompts.append(list(idx))
        yield word
        raise failure("stopped mid-reply")

    monkeypatch.setattr(chat_mod, "generate", broken)
    with pytest.raises(failure):
        s.reply(Q1 + " " + Q3)
    assert s.history == before
    assert len(before) == 12 and before[0] == ("user", f"{Q3} 0 " + Q1)  # nothing trimmed
    for i, prompt in enumerate(prompts[:6]):  # each: the most recent exchanges that fit
        turns = before[:2 * i + 1]
        fits = [generation_prompt([("system", SYSTEM), *turns[d:]], tok)
                for d in range(0, len(turns), 2)]
        assert prompt == next(p for p in fits if len(p) <= 64 - 8)
    # The prompt it stopped in had to leave old exchanges out: the trimming case.
    full = generation_prompt([("system", SYSTEM), *before, ("user", Q1 + " " + Q3)], tok)
    assert len(full) > 64 - 8 >= len(prompts[-1])
    if failure is KeyboardInterrupt:  # the REPL's Ctrl-C path, too
        out, err = io.StringIO(), io.StringIO()
        repl(s, io.StringIO(f"{Q1}\n"), out, err)
        assert err.getvalue() == "(interrupted; the message was dropped)\n"
        assert s.history == before


def test_tokenizer_without_markers_is_one_line(tmp_path, capsys):
    plain = train(tmp_path / "plain.model", reserved=())
    model_dir = make_model_dir(tmp_path / "base", plain)
    with pytest.raises(SystemExit) as exit_:
        main(["chat", "--model", str(model_dir), "-m", "hi"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1
    assert err.startswith("error: tokenizer ") and "no chat marker <|system|>" in err
    pytest.importorskip("transformers")
    from lmforge.export import export_hf

    out = export_hf(model_dir, tmp_path / "hf")  # a base model exports as before
    assert "chat_template" not in json.loads((out / "tokenizer_config.json").read_text())
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == 2


def test_cli_parses_the_chat_options():
    args = build_parser().parse_args(["chat", "-m", "a", "--message", "b", "--seed", "3"])
    assert args.model == "models/sft" and args.message == ["a", "b"] and args.temperature == 0
    assert args.func is chat_mod.cmd_chat and not args.json


def test_hf_export_of_a_chat_model_matches_lmforge_chat(model_dir, tok, tmp_path):
    transformers = pytest.importorskip("transformers")
    from lmforge.export import export_hf

    out = export_hf(model_dir, tmp_path / "hf")
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHAT_TEMPLATE
    end = marker_ids(tok)[END_MARKER]
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [end, 2]
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == [end, 2]
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    replies = []
    for turns in ([("user", Q1)], [("system", SYSTEM), ("user", Q3)],
                  [("user", Q1), ("assistant", "好 🙂"), ("user", Q2)]):
        messages = [{"role": r, "content": c} for r, c in turns]
        got = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = list(got["input_ids"] if hasattr(got, "keys") else got)
        assert ids == generation_prompt(turns, tok)
        s = session(model_dir, tok, system=turns[0][1] if turns[0][0] == "system" else None,
                    max_new_tokens=20)
        s.history = [t for t in turns[:-1] if t[0] != "system"]
        text = io.StringIO()
        one_shot(s, [turns[-1][1]], text)
        x = torch.tensor([ids])
        with torch.no_grad():  # the exported generation_config: stop at <|end|> or EOS
            new = hf_model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                    max_new_tokens=20)[0, len(ids):].tolist()
        assert new == s.last_ids, turns
        assert text.getvalue() == text_of(tok, new) + "\n"
        replies.append(new)
    # The first reply stops at <|end|> in both; the last runs the full 20 tokens.
    assert replies[0][-1] == end and len(replies[0]) < 20 and len(replies[-1]) == 20, replies
