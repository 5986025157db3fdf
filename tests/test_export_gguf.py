"""GGUF export read back by a second, independent consumer: transformers' own GGUF reader
(``from_pretrained(..., gguf_file=...)``, which dequantises and undoes llama.cpp's q/k
permutation) must compute our logits and encode our ids. llama.cpp itself reads the
same files in the opt-in test at the end (LMFORGE_LLAMA_CPP=1) and bench/bench_gguf.py."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch

from lmforge.cli import main
from lmforge.config import CHAT_MARKERS, ModelConfig
from lmforge.errors import InputError
from lmforge.export import import_hf
from lmforge.export.gguf import export_gguf
from lmforge.export.gguf_tensors import permute_qk
from lmforge.export.gguf_vocab import pre_tokenizer_name
from lmforge.finetune.template import CHAT_TEMPLATE, generation_prompt
from lmforge.model import Llama, load_model, save_model
from lmforge.model.llama import apply_rope, rope_tables
from lmforge.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from test_export_hf import SAMPLES, make_model_dir, write_sp  # noqa: E402

TEXT = "The model reads every token of corpus and learns which token is next."
# Largest logit difference allowed per type, on logits of magnitude ~0.7. Measured on this
# test's model: f16 2.2e-4 (11 significant bits per weight), bf16 1.7e-3 (8 bits), q8_0
# 5.2e-3; each bound is about 4x that, far below what a wrong layout gives (~0.5). q4_0 is
# lossy by design (0.11): it must still correlate with ours (bench_gguf.py measures its
# cost on real text).
TOLERANCE = {"f16": 1e-3, "bf16": 5e-3, "q8_0": 2e-2}


@pytest.fixture(scope="module")
def sp_base(tmp_path_factory) -> Path:
    return write_sp(tmp_path_factory.mktemp("base") / "tokenizer.model")


@pytest.fixture(scope="module")
def sp_chat(tmp_path_factory) -> Path:
    return write_sp(tmp_path_factory.mktemp("chat") / "tokenizer.model",
                    reserved_tokens=list(CHAT_MARKERS))


def fields(path: Path) -> dict:
    """The GGUF file's metadata as Python values."""
    reader = gguf.GGUFReader(str(path))
    return {k: f.contents() for k, f in reader.fields.items()}


def our_logits(model_dir: Path, ids: list[int]) -> torch.Tensor:
    model, _ = load_model(model_dir)
    with torch.no_grad():
        return model(torch.tensor([ids])).float()[0]


def their_logits(gguf_path: Path, ids: list[int]) -> torch.Tensor:
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32)
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits.float()[0]


def as_transformers_reads(theirs, text: str) -> str:
    """``text`` as transformers' GGUF tokenizer sees it. Its reader builds a ``llama``
    (sentencepiece) vocabulary with a Metaspace that puts a space before a text not
    starting with one, and does not read ``tokenizer.ggml.add_space_prefix`` (false in our
    files; llama.cpp honours it: the opt-in test below). So it encodes text as we encode
    " " + text, which is what is compared: the pieces, scores and byte fallback are ours."""
    from tokenizers.pre_tokenizers import Metaspace

    pre = theirs.backend_tokenizer.pre_tokenizer
    prepends = isinstance(pre, Metaspace) and pre.prepend_scheme != "never"
    return " " + text if prepends and text and not text.startswith(" ") else text


def their_tokenizer(gguf_path: Path):
    return transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent),
                                                      gguf_file=gguf_path.name)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("chat", [False, True])
def test_transformers_reads_our_file_with_our_logits_and_ids(tmp_path, sp_base, sp_chat,
                                                              tied, chat):
    sp = sp_chat if chat else sp_base
    model_dir = make_model_dir(tmp_path / "model", sp, tie_embeddings=tied, n_kv_head=2)
    out = export_gguf(model_dir, tmp_path / "model.gguf")
    tok = Tokenizer.load(sp)
    ids = tok.encode(TEXT)
    diff = (our_logits(model_dir, ids) - their_logits(out, ids)).abs().max().item()
    assert diff <= 1e-4
    names = {t.name for t in gguf.GGUFReader(str(out)).tensors}
    assert ("output.weight" in names) == (not tied)
    theirs = their_tokenizer(out)
    for text in SAMPLES:
        assert theirs.encode(text, add_special_tokens=False) == tok.encode(
            as_transformers_reads(theirs, text)), text
    meta = fields(out)
    assert meta["tokenizer.ggml.model"] == "llama"
    assert meta["tokenizer.ggml.add_space_prefix"] is False
    assert meta["tokenizer.ggml.add_bos_token"] is False
    assert meta["tokenizer.ggml.eos_token_id"] == tok.eos_id
    byte = tok.token_to_id("<0x41>")
    assert meta["tokenizer.ggml.token_type"][byte] == gguf.TokenType.BYTE
    modelfile = (tmp_path / "model.Modelfile").read_text()
    assert "FROM ./model.gguf" in modelfile
    if chat:
        end = tok.token_to_id("<|end|>")
        assert meta["tokenizer.chat_template"] == CHAT_TEMPLATE
        assert meta["tokenizer.ggml.eot_token_id"] == end
        assert meta["tokenizer.ggml.token_type"][end] == gguf.TokenType.CONTROL
        assert 'PARAMETER stop "<|end|>"' in modelfile
        assert "<|{{ .Role }}|>{{ .Content }}<|end|>" in modelfile
        turns = [("user", "Which token is next?")]
        rendered = theirs.apply_chat_template([{"role": r, "content": c} for r, c in turns],
                                              add_generation_prompt=True, tokenize=False)
        assert theirs.encode(rendered, add_special_tokens=False) == generation_prompt(turns, tok)
    else:
        assert "tokenizer.chat_template" not in meta
        assert "tokenizer.ggml.eot_token_id" not in meta
        assert "TEMPLATE" not in modelfile and "PARAMETER stop" not in modelfile


@pytest.mark.parametrize("qtype", ["f16", "bf16", "q8_0", "q4_0"])
def test_smaller_types_keep_norms_f32_and_stay_close(tmp_path, sp_base, qtype):
    model_dir = make_model_dir(tmp_path / "model", sp_base, tie_embeddings=False)
    out = export_gguf(model_dir, tmp_path / f"model-{qtype}.gguf", qtype=qtype)
    f32 = export_gguf(model_dir, tmp_path / "model-f32.gguf")
    want = gguf.GGMLQuantizationType[qtype.upper()]
    kinds = {t.name: t.tensor_type for t in gguf.GGUFReader(str(out)).tensors}
    assert all(k == gguf.GGMLQuantizationType.F32 for n, k in kinds.items()
               if n.endswith("norm.weight"))
    assert kinds["blk.0.attn_q.weight"] == want
    assert out.stat().st_size < f32.stat().st_size
    ids = Tokenizer.load(sp_base).encode(TEXT)
    ours = our_logits(model_dir, ids)
    theirs = their_logits(out, ids)
    if qtype in TOLERANCE:
        assert (ours - theirs).abs().max().item() <= TOLERANCE[qtype]
    assert torch.corrcoef(torch.stack([ours.flatten(), theirs.flatten()]))[0, 1] > 0.95


def test_llama_cpp_pair_rotation_on_permuted_rows_is_our_rotate_half():
    """The permutation's point: llama.cpp rotates adjacent pairs (2i, 2i+1); on the
    permuted projection rows that gives our rotate-half result, permuted the same way."""
    head_dim, n_heads, seq = 8, 3, 5
    cos, sin = rope_tables(seq, head_dim, 10000.0)
    x = torch.randn(seq, n_heads * head_dim, dtype=torch.float64)
    ours = apply_rope(x.view(seq, n_heads, head_dim), cos[:, None].double(),
                      sin[:, None].double()).reshape(seq, -1)
    y = permute_qk(x.T, n_heads).T.reshape(seq, n_heads, head_dim // 2, 2)
    angle = torch.arange(seq, dtype=torch.float64)[:, None] * (
        10000.0 ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    c, s = torch.cos(angle)[:, None], torch.sin(angle)[:, None]
    pairs = torch.stack([y[..., 0] * c - y[..., 1] * s, y[..., 0] * s + y[..., 1] * c], -1)
    assert torch.allclose(pairs.reshape(seq, -1), permute_qk(ours.T, n_heads).T)


def hf_family_dir(tmp_path: Path, kind: str, chat_template: str | None) -> Path:
    """A tiny random Qwen2, Qwen3 or Llama (Llama 3 split) with a byte-level tokenizer.json,
    imported into our format as `lmforge import hf` does."""
    from hf_tokenizers import build

    tok_dir = build(tmp_path / "tok", style="llama3" if kind == "llama" else "qwen2")
    if chat_template is not None:
        cfg_path = tok_dir / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg.update(chat_template=chat_template, eos_token="<|im_end|>")
        cfg_path.write_text(json.dumps(cfg))
    vocab = len(json.loads((tok_dir / "tokenizer.json").read_text())["model"]["vocab"]) + 7
    shape = dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
                 max_position_embeddings=64, tie_word_embeddings=kind == "qwen2",
                 # Qwen3's own head width (not 64 / 4). transformers' GGUF reader does not
                 # read attention.key_length for qwen3 and takes Qwen3Config's default, 128.
                 **({"head_dim": 128} if kind == "qwen3" else {}))
    cls = {"qwen2": "Qwen2", "qwen3": "Qwen3", "llama": "Llama"}[kind]
    torch.manual_seed(0)
    model = getattr(transformers, f"{cls}ForCausalLM")(
        getattr(transformers, f"{cls}Config")(**shape)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    hf_dir = tmp_path / "hf"
    model.save_pretrained(hf_dir)
    for f in tok_dir.iterdir():
        (hf_dir / f.name).write_bytes(f.read_bytes())
    return import_hf(hf_dir, tmp_path / "ours")


CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + "
          "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\n' }}{% endif %}")


@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "llama"])
def test_a_tokenizer_json_model_goes_out_as_gpt2_with_its_own_template(tmp_path, kind):
    from hf_tokenizers import HARD_TEXTS

    model_dir = hf_family_dir(tmp_path, kind, CHATML)
    out = export_gguf(model_dir, tmp_path / "m.gguf")
    meta = fields(out)
    tok = Tokenizer.load(model_dir)
    assert meta["general.architecture"] == kind
    assert meta["tokenizer.ggml.model"] == "gpt2"
    assert meta["tokenizer.ggml.pre"] == ("llama-bpe" if kind == "llama" else "qwen2")
    assert len(meta["tokenizer.ggml.tokens"]) == load_model(model_dir)[0].vocab_size
    assert meta["tokenizer.chat_template"] == CHATML
    assert meta["tokenizer.ggml.eot_token_id"] == tok.token_to_id("<|im_end|>")
    ids = tok.encode(HARD_TEXTS[0] + " " + HARD_TEXTS[1])
    diff = (our_logits(model_dir, ids) - their_logits(out, ids)).abs().max().item()
    assert diff <= 1e-4
    theirs = their_tokenizer(out)  # it splits by the regex tokenizer.ggml.pre names
    for text in HARD_TEXTS:
        assert theirs.encode(text, add_special_tokens=False) == tok.encode(text), text
    modelfile = (tmp_path / "m.Modelfile").read_text()
    assert "<|im_start|>{{ .Role }}" in modelfile and 'PARAMETER stop "<|im_end|>"' in modelfile


def test_an_unknown_pre_tokenizer_is_refused_in_one_line():
    with pytest.raises(InputError, match="no llama.cpp counterpart") as e:
        pre_tokenizer_name({"type": "Whitespace"}, Path("x/tokenizer.json"))
    assert "\n" not in str(e.value)


def test_a_foreign_file_is_never_replaced_and_an_earlier_export_is(tmp_path, sp_base, capsys):
    model_dir = make_model_dir(tmp_path / "model", sp_base)
    out = tmp_path / "m.gguf"
    out.write_bytes(b"someone else's file")
    with pytest.raises(InputError, match="not an earlier lmforge export") as e:
        export_gguf(model_dir, out)
    assert "\n" not in str(e.value) and out.read_bytes() == b"someone else's file"
    # A GGUF file lmforge did not write (another converter's) is foreign too.
    writer = gguf.GGUFWriter(str(out), "llama")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(InputError, match="not an earlier lmforge export"):
        export_gguf(model_dir, out)
    main(["export", "gguf", str(out), "--model", str(model_dir), "--force"])
    assert "lmforge.export" in fields(out)
    assert "ollama create" in capsys.readouterr().out
    export_gguf(model_dir, out, qtype="f16")  # ours now: replaced without --force
    assert fields(out)["general.file_type"] == gguf.LlamaFileType.MOSTLY_F16
    (tmp_path / "m.Modelfile").write_text("FROM ./mine.gguf\n")
    with pytest.raises(InputError, match="lmforge did not write it"):
        export_gguf(model_dir, out)
    assert not list(tmp_path.glob(".m.gguf.*"))  # no temporary file left behind


def test_a_model_no_gguf_architecture_computes_is_refused_in_one_line(tmp_path, sp_base):
    tok = Tokenizer.load(sp_base)
    cfg = ModelConfig(n_layer=1, n_head=2, n_embd=32, seq_len=32, ffn_multiple_of=16,
                      qk_norm=True)  # q/k norms on the llama family: no such architecture
    save_model(Llama(cfg, tok.vocab_size), tmp_path / "odd", sp_base,
               special_ids=tok.special_ids(), tokenizer_sha256=tok.sha256)
    with pytest.raises(InputError, match="no GGUF architecture computes this") as e:
        export_gguf(tmp_path / "odd", tmp_path / "odd.gguf")
    assert "\n" not in str(e.value) and not (tmp_path / "odd.gguf").exists()


@pytest.mark.parametrize("option, message", [({"normalization": "nfkc"}, "applies none"),
                                             ({"byte_fallback": False}, "no byte-fallback")])
def test_a_tokenizer_llama_cpp_would_read_otherwise_is_refused(tmp_path, option, message):
    sp = write_sp(tmp_path / "tokenizer.model", **option)
    model_dir = make_model_dir(tmp_path / "model", sp)
    with pytest.raises(InputError, match=message) as e:
        export_gguf(model_dir, tmp_path / "m.gguf")
    assert "\n" not in str(e.value) and not (tmp_path / "m.gguf").exists()


# --- llama.cpp itself (opt-in: llama-cpp-python builds llama.cpp from source) -----------

LLAMA_CPP = os.environ.get("LMFORGE_LLAMA_CPP") == "1"


@pytest.mark.skipif(not LLAMA_CPP, reason="set LMFORGE_LLAMA_CPP=1 (needs llama-cpp-python)")
@pytest.mark.parametrize("chat", [False, True])
def test_llama_cpp_continues_and_chats_as_we_do(tmp_path, sp_base, sp_chat, chat):
    llama_cpp = pytest.importorskip("llama_cpp")
    from lmforge.chat import ChatSession
    from lmforge.model.generate import generate

    sp = sp_chat if chat else sp_base
    model_dir = make_model_dir(tmp_path / "model", sp, tie_embeddings=False, n_kv_head=2)
    out = export_gguf(model_dir, tmp_path / "m.gguf")
    llm = llama_cpp.Llama(str(out), n_ctx=64, logits_all=True, verbose=False)
    tok = Tokenizer.load(sp)
    model, _ = load_model(model_dir)
    prompt = tok.encode("The model reads")
    assert llm.tokenize(b"The model reads", add_bos=False) == prompt
    ours = list(generate(model, prompt, 32))
    llm.reset()
    theirs = []
    for token in llm.generate(prompt, temp=0.0, top_k=1, repeat_penalty=1.0):
        theirs.append(token)
        if len(theirs) == 32:
            break
    assert theirs == ours
    if chat:
        session = ChatSession(model, tok, max_new_tokens=24)
        reply = session.reply("Which token is next?")
        got = llm.create_chat_completion([{"role": "user", "content": "Which token is next?"}],
                                         temperature=0.0, top_k=1, max_tokens=24,
                                         repeat_penalty=1.0)
        # llama-cpp-python drops the bytes of an incomplete character where we write U+FFFD
        # (a random model emits stray byte pieces).
        assert got["choices"][0]["message"]["content"] == reply.replace("\ufffd", "")
        assert llama_prompt_ids(llm, out, [("user", "Which token is next?")]) == \
            generation_prompt([("user", "Which token is next?")], tok)
    assert math.isfinite(llm.scores[0, 0])


def llama_prompt_ids(llm, gguf_path: Path, turns: list[tuple[str, str]]) -> list[int]:
    """The ids llama-cpp-python's chat handler feeds the model: the file's template
    rendered by its Jinja formatter, tokenized with special tokens parsed."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    meta = fields(gguf_path)
    tokens = meta["tokenizer.ggml.tokens"]
    fmt = Jinja2ChatFormatter(meta["tokenizer.chat_template"],
                              eos_token=tokens[meta["tokenizer.ggml.eos_token_id"]],
                              bos_token=tokens[meta["tokenizer.ggml.bos_token_id"]])
    text = fmt(messages=[{"role": r, "content": c} for r, c in turns]).prompt
    return llm.tokenize(text.encode(), add_bos=False, special=True)


@pytest.mark.skipif(not LLAMA_CPP, reason="set LMFORGE_LLAMA_CPP=1 (needs llama-cpp-python)")
def test_llama_cpp_stops_a_reply_at_our_end_of_turn(tmp_path, sp_chat):
    """A model made to close its turn at once: llama.cpp must stop there too (the file's
    end-of-turn id), with an empty reply, as lmforge chat does."""
    llama_cpp = pytest.importorskip("llama_cpp")
    from lmforge.chat import ChatSession

    model_dir = make_model_dir(tmp_path / "model", sp_chat, tie_embeddings=False)
    model, config = load_model(model_dir)
    tok = Tokenizer.load(sp_chat)
    end = tok.token_to_id("<|end|>")
    with torch.no_grad():  # dimension 0 of the residual stream: 1 at every position
        model.tok_embeddings.weight[:, 0] = 1.0
        for layer in model.layers:
            layer.attn.wo.weight[0] = 0.0
            layer.mlp.w2.weight[0] = 0.0
        model.norm.weight[0] = 1.0
        model.lm_head.weight[end, 0] = 100.0  # so <|end|> has the largest logit
    save_model(model, tmp_path / "stops", sp_chat, special_ids=config["special_ids"],
               tokenizer_sha256=tok.sha256)
    out = export_gguf(tmp_path / "stops", tmp_path / "stops.gguf")
    session = ChatSession(model, tok, max_new_tokens=16)
    assert session.reply("Which token is next?") == "" and session.last_ids == [end]
    llm = llama_cpp.Llama(str(out), n_ctx=64, verbose=False)
    got = llm.create_chat_completion([{"role": "user", "content": "Which token is next?"}],
                                     temperature=0.0, top_k=1, max_tokens=16,
                                     repeat_penalty=1.0)["choices"][0]
    assert got["message"]["content"] == "" and got["finish_reason"] == "stop"


# --- open chat models whose EOS is their end of turn (issue 43) ---------------------------

@pytest.mark.parametrize("kind, end", [("qwen2.5", "<|im_end|>"), ("llama3.1", "<|eot_id|>")])
def test_an_open_chat_models_end_of_turn_is_its_templates_own(tmp_path, kind, end):
    """Qwen2.5/Llama 3.1 Instruct: EOS is the end of turn and generation_config.json
    stops at more ids. The file's eot is the template's end of turn (not the lowest other
    stop id), and the Modelfile stops there first, then at every other stop id."""
    from open_chat_models import chat_model, generation_config, token_ids

    model_dir = chat_model(tmp_path, kind)
    ids = token_ids(model_dir)
    meta = fields(export_gguf(model_dir, tmp_path / "m.gguf"))
    assert meta["tokenizer.ggml.eot_token_id"] == ids[end]
    assert meta["tokenizer.ggml.eos_token_id"] == ids[end]
    lines = (tmp_path / "m.Modelfile").read_text().splitlines()
    stops = [line for line in lines if line.startswith("PARAMETER stop")]
    assert stops[0] == f'PARAMETER stop "{end}"'
    by_id = {i: t for t, i in ids.items()}
    wanted = {f'PARAMETER stop "{by_id[i]}"'
              for i in generation_config(kind, ids)["eos_token_id"]}
    assert set(stops) == wanted and len(stops) == len(wanted)


def test_a_hugging_face_folder_is_sent_to_import_hf_in_one_line(tmp_path, capsys):
    from open_chat_models import hf_chat_model

    hf_dir = hf_chat_model(tmp_path)
    capsys.readouterr()  # transformers' progress bars
    # Every command that loads a model says so, not only the exports.
    for argv in (["export", "gguf", str(tmp_path / "m.gguf")],
                 ["export", "hf", str(tmp_path / "out")],
                 ["generate", "Hello"], ["chat", "-m", "Hello"]):
        with pytest.raises(SystemExit):
            main([*argv, "--model", str(hf_dir)])
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1, err
        assert f"{hf_dir} is a Hugging Face folder" in err
        assert "lmforge import hf" in err and "first" in err
    assert not (tmp_path / "m.gguf").exists() and not (tmp_path / "out").exists()
