"""Hugging Face Llama export/import: transformers loads our model with the same logits,
the tokenizer files encode to our ids, and import -> export gives back the same weights."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import chat_tokenizer
import pytest
import torch
from safetensors.torch import load_file

from lmforge.config import ModelConfig, TokenizerConfig
from lmforge.errors import InputError
from lmforge.export import add_export_parser, add_import_parser, export_hf, import_hf
from lmforge.export.hf_config import ffn_multiple_for
from lmforge.model import Llama, load_model, save_model
from lmforge.model.llama import ffn_hidden_size
from lmforge.tokenizer import Tokenizer
from lmforge.tokenizer.train import train_model

transformers = pytest.importorskip("transformers")

WORDS = ["the", "model", "reads", "every", "token", "of", "corpus", "and", "learns", "which"]
SAMPLES = [
    "The model reads every token.",
    "  leading spaces,   inner runs   and trailing  ",
    "我在中国学到了很多。她说：“你好！”",
    "def f(x):\n    if x > 10:\n        return x * 2\n\treturn None\n",
    "x = 12345 + 0.5  # digits split",
    "unseen: 🙂 ж Ω 鳳凰",  # byte fallback
    "",
]


def corpus(seed: int = 0) -> list[str]:
    """The shared test corpus over this file's words, without chat markers."""
    return chat_tokenizer.corpus(seed, WORDS, code_tail="")


def write_sp(path: Path, **kw) -> Path:
    """A base model's tokenizer (no chat markers: tests/test_chat.py exports chat models)."""
    kw.setdefault("reserved_tokens", [])
    cfg = TokenizerConfig(vocab_size=500, character_coverage=1.0, num_threads=1, **kw)
    path.write_bytes(train_model(corpus(), cfg)[0])
    return path


@pytest.fixture(scope="module")
def sp_path(tmp_path_factory) -> Path:
    return write_sp(tmp_path_factory.mktemp("sp") / "tokenizer.model")


def make_model_dir(path: Path, sp: Path, **kw) -> Path:
    """A tiny random model of ours, saved the way the train stage saves models/final."""
    tok = Tokenizer.load(sp)
    cfg = ModelConfig(n_layer=2, n_head=4, n_embd=64, seq_len=64, ffn_multiple_of=16, **kw)
    torch.manual_seed(0)
    model = Llama(cfg, tok.vocab_size)
    with torch.no_grad():  # norms start at 1; randomise them so a swapped name shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    special = {"bos": tok.bos_id, "eos": tok.eos_id, "pad": tok.pad_id, "unk": tok.unk_id}
    save_model(model, path, sp, special_ids=special, tokenizer_sha256=tok.sha256)
    return path


def our_logits(model_dir: Path, ids: torch.Tensor) -> torch.Tensor:
    model, _ = load_model(model_dir)
    with torch.no_grad():
        return model(ids)


def hf_logits(hf_dir: Path, ids: torch.Tensor) -> torch.Tensor:
    model = transformers.LlamaForCausalLM.from_pretrained(hf_dir).eval()
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("kw", [{"tie_embeddings": True}, {"tie_embeddings": False, "n_kv_head": 2}],
                         ids=["tied", "untied-gqa"])
def test_transformers_loads_the_export_with_our_logits(tmp_path, sp_path, kw):
    src = make_model_dir(tmp_path / "final", sp_path, rope_base=5000.0, norm_eps=1e-6, **kw)
    out = export_hf(src, tmp_path / "hf")
    ids = torch.randint(0, Tokenizer.load(sp_path).vocab_size, (2, 48),
                        generator=torch.Generator().manual_seed(1))
    ours, theirs = our_logits(src, ids), hf_logits(out, ids)
    assert theirs.shape == ours.shape
    assert (ours - theirs).abs().max().item() < 1e-4
    cfg = transformers.AutoConfig.from_pretrained(out)
    assert cfg.tie_word_embeddings is kw["tie_embeddings"]
    assert cfg.num_key_value_heads == kw.get("n_kv_head", 4)
    assert cfg.rope_parameters["rope_theta"] == 5000.0 and cfg.rms_norm_eps == 1e-6
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == Tokenizer.load(sp_path).eos_id


@pytest.mark.parametrize("normalization", ["identity", "nfkc"])
def test_hf_tokenizer_encodes_to_our_ids(tmp_path, sp_path, normalization):
    sp = sp_path if normalization == "identity" else write_sp(
        tmp_path / "nfkc.model", normalization="nfkc")
    out = export_hf(make_model_dir(tmp_path / "final", sp), tmp_path / "hf")
    ours = Tokenizer.load(sp)
    theirs = transformers.AutoTokenizer.from_pretrained(out)
    for text in SAMPLES:
        ids = ours.encode(text)
        assert theirs.encode(text) == ids, text
        assert theirs.decode(ids) == ours.decode(ids)
    assert theirs.eos_token_id == ours.eos_id and theirs.bos_token_id == ours.bos_id
    if normalization == "identity":  # lossless: the text itself comes back
        assert all(theirs.decode(theirs.encode(t)) == t for t in SAMPLES)
        assert type(theirs).__name__ == "LlamaTokenizer"
    for name in ("tokenizer.model", "tokenizer.json", "special_tokens_map.json"):
        assert (out / name).is_file()


def hf_checkpoint(path: Path, sp: Path, tie: bool, **save_kw) -> Path:
    """A tiny random LlamaForCausalLM saved by transformers, with our tokenizer beside it."""
    cfg = transformers.LlamaConfig(
        vocab_size=Tokenizer.load(sp).vocab_size, hidden_size=48, intermediate_size=160,
        num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
        max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=20000.0,
        tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2, pad_token_id=3)
    torch.manual_seed(2)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path, **save_kw)
    shutil.copyfile(sp, path / "tokenizer.model")
    return path


@pytest.mark.parametrize("tie,shard", [(False, False), (True, True)], ids=["untied", "tied-sharded"])
def test_import_matches_hf_logits_and_export_gives_back_the_weights(tmp_path, sp_path, tie, shard):
    src = hf_checkpoint(tmp_path / "hf", sp_path, tie, **({"max_shard_size": "40KB"} if shard else {}))
    assert (src / "model.safetensors.index.json").is_file() == shard
    ours = import_hf(src, tmp_path / "final")
    ids = torch.randint(0, 400, (2, 40), generator=torch.Generator().manual_seed(3))
    assert (our_logits(ours, ids) - hf_logits(src, ids)).abs().max().item() < 1e-4
    saved = json.loads((ours / "config.json").read_text())
    assert saved["special_ids"] == {"bos": 1, "eos": 2, "pad": 3, "unk": 0}
    back = export_hf(ours, tmp_path / "back")
    original = {}
    for f in src.glob("*.safetensors"):
        original.update(load_file(f))
    exported = load_file(back / "model.safetensors")
    assert exported.keys() == original.keys()
    assert all(torch.equal(exported[k], original[k]) for k in original)


@pytest.mark.parametrize("change,message", [
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_type 'linear'"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "rope_type 'yarn'"),
    ({"attention_bias": True}, "attention_bias"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"model_type": "gemma"}, "model_type"),
    ({"intermediate_size": 64}, "intermediate_size"),
])
def test_import_refuses_unsupported_features_in_one_line(tmp_path, sp_path, change, message):
    src = hf_checkpoint(tmp_path / "hf", sp_path, tie=True)
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(InputError, match=message) as err:
        import_hf(src, tmp_path / "final")
    assert "\n" not in str(err.value) and "config.json" in str(err.value)
    assert not (tmp_path / "final").exists()


def test_import_refuses_extra_tensors_and_bad_shapes(tmp_path, sp_path):
    src = hf_checkpoint(tmp_path / "hf", sp_path, tie=True)
    from safetensors.torch import save_file
    state = load_file(src / "model.safetensors")
    save_file({**state, "model.layers.0.self_attn.q_proj.bias": torch.zeros(48)},
              src / "model.safetensors")
    with pytest.raises(InputError, match="q_proj.bias"):
        import_hf(src, tmp_path / "final")
    state["model.norm.weight"] = torch.ones(47)
    save_file(state, src / "model.safetensors")
    with pytest.raises(InputError, match="do not match"):
        import_hf(src, tmp_path / "final")


@pytest.mark.parametrize("d", [48, 64, 256, 576, 2048, 4096])
@pytest.mark.parametrize("extra", [0, 1, 37, 256, 1000])
def test_any_intermediate_size_from_8_3_d_up_is_reachable(d, extra):
    width = -(-8 * d // 3) + extra
    m = ffn_multiple_for(d, width, "cfg")
    assert ffn_hidden_size(ModelConfig(n_embd=d, n_head=1, ffn_multiple_of=m)) == width


def test_export_refuses_to_replace_a_folder_that_holds_no_model(tmp_path, sp_path):
    src = make_model_dir(tmp_path / "final", sp_path)
    keep = tmp_path / "mine"
    keep.mkdir()
    (keep / "notes.txt").write_text("precious")
    with pytest.raises(InputError, match="not an earlier lmforge export"):
        export_hf(src, keep)
    assert (keep / "notes.txt").read_text() == "precious"
    (src / "tokenizer.model").write_bytes(b"changed")
    with pytest.raises(InputError, match="does not match the tokenizer"):
        export_hf(src, tmp_path / "hf")


def _precious_model_folder(path: Path) -> Path:
    """A folder the user made that merely holds a config.json (someone's own HF model)."""
    path.mkdir()
    (path / "config.json").write_text('{"model_type": "llama"}')
    (path / "notes.txt").write_text("precious")
    return path


def test_export_never_replaces_a_folder_just_because_it_holds_config_json(tmp_path, sp_path):
    src = make_model_dir(tmp_path / "final", sp_path)
    keep = _precious_model_folder(tmp_path / "their-model")
    with pytest.raises(InputError) as err:
        export_hf(src, keep)
    msg = str(err.value)
    assert "\n" not in msg and str(keep) in msg and "--force" in msg
    assert (keep / "notes.txt").read_text() == "precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final", "their-model"]  # no temp left


def test_export_replaces_an_empty_folder_an_earlier_export_or_with_force(tmp_path, sp_path):
    src = make_model_dir(tmp_path / "final", sp_path)
    (tmp_path / "hf").mkdir()
    out = export_hf(src, tmp_path / "hf")  # empty: fine
    marker = json.loads((out / ".lmforge-export").read_text())
    assert marker["tool"] == "lmforge" and marker["command"] == "export hf"
    assert marker["source"] == str(src) and marker["version"] and marker["time"]
    (out / "stale.bin").write_bytes(b"from the earlier export")
    export_hf(src, out)  # an earlier export: replaced whole
    assert not (out / "stale.bin").exists() and (out / "model.safetensors").is_file()
    keep = _precious_model_folder(tmp_path / "their-model")
    export_hf(src, keep, force=True)
    assert not (keep / "notes.txt").exists() and (keep / ".lmforge-export").is_file()


def test_export_with_force_still_never_replaces_its_own_input(tmp_path, sp_path):
    src = make_model_dir(tmp_path / "work" / "final", sp_path)
    with pytest.raises(InputError, match="output folder is the input folder"):
        export_hf(src, src, force=True)
    with pytest.raises(InputError, match="holds the input"):
        export_hf(src, tmp_path / "work", force=True)
    assert (src / "model.safetensors").is_file()


def test_import_never_replaces_a_trained_model_or_a_foreign_folder(tmp_path, sp_path):
    src = hf_checkpoint(tmp_path / "hf", sp_path, tie=True)
    trained = make_model_dir(tmp_path / "final", sp_path)  # the train stage's output: no marker
    weights = (trained / "model.safetensors").read_bytes()
    for target in (trained, _precious_model_folder(tmp_path / "their-model")):
        with pytest.raises(InputError) as err:
            import_hf(src, target)
        assert str(target) in str(err.value) and "--force" in str(err.value)
    assert (trained / "model.safetensors").read_bytes() == weights
    assert (tmp_path / "their-model" / "notes.txt").read_text() == "precious"


def test_import_replaces_an_earlier_import_or_export_or_with_force(tmp_path, sp_path):
    src = hf_checkpoint(tmp_path / "hf", sp_path, tie=True)
    out = import_hf(src, tmp_path / "base")
    marker = json.loads((out / ".lmforge-export").read_text())
    assert marker["tool"] == "lmforge" and marker["command"] == "import hf"
    assert marker["source"] == str(src)
    assert load_model(out)[0].num_params() > 0
    import_hf(src, out, seq_len=32)  # an earlier import: replaced
    assert load_model(out)[0].config.seq_len == 32
    exported = export_hf(out, tmp_path / "exported")
    import_hf(src, exported)  # an earlier export is ours too: replaced whole
    assert not (exported / "special_tokens_map.json").exists()
    trained = make_model_dir(tmp_path / "final", sp_path)
    import_hf(src, trained, force=True)
    assert json.loads((trained / ".lmforge-export").read_text())["command"] == "import hf"


def test_import_cli_needs_out_and_passes_force(tmp_path, sp_path, capsys):
    parser = argparse.ArgumentParser(prog="lmforge")
    sub = parser.add_subparsers(dest="command", required=True)
    add_export_parser(sub)
    add_import_parser(sub)
    with pytest.raises(SystemExit):  # no default: models/final is the train stage's output
        parser.parse_args(["import", "hf", str(tmp_path / "hf")])
    assert "--out" in capsys.readouterr().err
    src = hf_checkpoint(tmp_path / "hf", sp_path, tie=True)
    keep = _precious_model_folder(tmp_path / "their-model")
    args = parser.parse_args(["import", "hf", str(src), "--out", str(keep)])
    with pytest.raises(InputError):
        args.func(args)
    args = parser.parse_args(["import", "hf", str(src), "--out", str(keep), "--force"])
    args.func(args)
    assert not (keep / "notes.txt").exists()
    keep = _precious_model_folder(tmp_path / "other")
    args = parser.parse_args(["export", "hf", str(keep), "--model", str(tmp_path / "their-model")])
    with pytest.raises(InputError):
        args.func(args)
    args = parser.parse_args(["export", "hf", str(keep), "--model", str(tmp_path / "their-model"),
                              "--force"])
    args.func(args)
    assert not (keep / "notes.txt").exists()


def test_cli_parsers_run_export_then_import(tmp_path, sp_path, capsys):
    parser = argparse.ArgumentParser(prog="lmforge")
    sub = parser.add_subparsers(dest="command", required=True)
    add_export_parser(sub)
    add_import_parser(sub)
    src = make_model_dir(tmp_path / "final", sp_path)
    args = parser.parse_args(["export", "hf", str(tmp_path / "hf"), "--model", str(src)])
    args.func(args)
    args = parser.parse_args(["import", "hf", str(tmp_path / "hf"), "--out",
                              str(tmp_path / "again"), "--seq-len", "32"])
    args.func(args)
    assert "exported" in capsys.readouterr().out
    model, cfg = load_model(tmp_path / "again")
    assert model.config.seq_len == 32 and cfg["tokenizer_sha256"] == Tokenizer.load(sp_path).sha256
    first, again = load_file(src / "model.safetensors"), load_file(tmp_path / "again" / "model.safetensors")
    assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first)


# --- open chat models: stop ids and generation defaults (issue 43) ------------------------

@pytest.mark.parametrize("eos", ["<|im_end|>", "<|endoftext|>"], ids=["instruct", "eos-not-eot"])
def test_an_open_chat_model_goes_out_stopping_at_its_end_of_turn(tmp_path, eos):
    """Qwen2.5-Instruct (EOS <|im_end|>; generation_config.json stops at <|im_end|> and
    <|endoftext|> and has its sampling defaults), and a fine-tune whose tokenizer's EOS is
    <|endoftext|>, which is not its end of turn, and which has no generation_config.json.
    Both exports stop at <|im_end|> in transformers' generate; the first keeps the
    source's generation defaults as they came in."""
    from open_chat_models import chat_model, generation_config, token_ids

    instruct = eos == "<|im_end|>"
    model_dir = chat_model(tmp_path, eos=eos, generation=instruct)
    ids = token_ids(model_dir)
    end, stops = ids["<|im_end|>"], [ids["<|im_end|>"], ids["<|endoftext|>"]]
    out = export_hf(model_dir, tmp_path / "out")
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == stops
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == stops
    if instruct:
        source = generation_config("qwen2.5", ids)
        assert {k: gen.get(k) for k in source} == source
        assert (gen["temperature"], gen["top_p"], gen["repetition_penalty"]) == (0.7, 0.8, 1.05)
        # Nothing to add: the source's file itself.
        assert ((out / "generation_config.json").read_bytes()
                == (model_dir / "generation_config.json").read_bytes())
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert end in model.generation_config.eos_token_id
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}], return_dict=True,
                                     add_generation_prompt=True, return_tensors="pt")
    n = prompt["input_ids"].shape[1]
    # The end of turn made by far the likeliest token: generate must stop right after it.
    with torch.no_grad():
        reply = model.generate(**prompt, max_new_tokens=8, do_sample=False,
                               sequence_bias={(end,): 100.0})[0, n:].tolist()
    assert reply == [end]


def test_a_fine_tune_of_an_imported_chat_model_keeps_its_generation_defaults(tmp_path):
    """The pipeline's path: the tokenizer stage copies the imported model's tokenizer
    files (init_from) into models/tokenizer, a training stage saves its weights beside
    that copy, and the export of the fine-tune has the source's sampling defaults."""
    from open_chat_models import chat_model, generation_config, token_ids

    from lmforge.model.saved import load_model, save_model
    from lmforge.tokenizer.files import copy_tokenizer

    base = chat_model(tmp_path, generation=True)
    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    assert "generation_config.json" in copy_tokenizer(base, tokenizer)
    model, config = load_model(base)
    save_model(model, tmp_path / "sft", tokenizer, special_ids=config["special_ids"],
               tokenizer_sha256=config["tokenizer_sha256"])
    out = export_hf(tmp_path / "sft", tmp_path / "out")
    gen = json.loads((out / "generation_config.json").read_text())
    source = generation_config("qwen2.5", token_ids(base))
    assert {k: gen.get(k) for k in source} == source
    assert gen["temperature"] == 0.7 and gen["eos_token_id"][0] == token_ids(base)["<|im_end|>"]
