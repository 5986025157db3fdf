"""Tokenizer training: lossless round trip, sampling, piece cutting, the stage end to end."""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lmforge.config import TokenizerConfig
from lmforge.errors import ConfigError, InputError
from lmforge.tokenizer import Tokenizer
from lmforge.tokenizer.build import build_tokenizer
from lmforge.tokenizer.sample import balanced_sample
from lmforge.tokenizer.spm import SentencePieceTokenizer
from lmforge.tokenizer.train import sentence_pieces, train_model

CJK = "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年得就那要下以生会自着去之过家学对可她里后小么心多天而能好都然没日于起还发成事只作当想看文无开手十用主行方又如前所本见经头面公同三已老从动两长知民样现分将外但身些与高意进把法此实回二理美点月明其"  # noqa: E501
WORDS = ["the", "model", "reads", "every", "token", "of", "corpus", "and", "learns", "which",
         "piece", "comes", "next", "while", "data", "flows", "through", "stages", "that",
         "filter", "mix", "documents"]


def make_docs(rng: random.Random, domain: str, n: int) -> list[str]:
    """Small synthetic documents of one domain (prose, Chinese, or indented code)."""
    docs = []
    for _ in range(n):
        if domain == "en":
            lines = [" ".join(rng.choices(WORDS, k=rng.randint(5, 15))) + "." for _ in range(8)]
        elif domain == "zh":
            lines = ["".join(rng.choices(CJK, k=rng.randint(8, 20))) + "。" for _ in range(6)]
        else:
            name = rng.choice(WORDS)
            lines = [line for i in range(3) for line in (
                f"def {name}_{i}(x):", f"    if x > {rng.randint(0, 999)}:",
                "        return x * 2", "\treturn None", "")]
        docs.append("\n".join(lines) + "\n")
    return docs


def write_mixed(root: Path, seed: int = 0, docs_per_domain: int = 40) -> Path:
    """``root/mixed/{train,val}/part-*.parquet`` with three domains."""
    rng = random.Random(seed)
    for split, n in (("train", docs_per_domain), ("val", 6)):
        rows = [(f"{split}-{d}-{i}", t, d) for d in ("en", "zh", "code")
                for i, t in enumerate(make_docs(rng, d, n))]
        rng.shuffle(rows)
        out = root / "mixed" / split
        out.mkdir(parents=True)
        for p in range(2):
            chunk = rows[p::2]
            pq.write_table(pa.table({"id": [r[0] for r in chunk], "text": [r[1] for r in chunk],
                                     "domain": [r[2] for r in chunk],
                                     "source": ["test"] * len(chunk)}),
                           out / f"part-{p:05d}.parquet", compression="zstd")
    return root / "mixed"


CFG = TokenizerConfig(vocab_size=800, sample_chars=200_000, character_coverage=0.9995,
                      num_threads=1)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    mixed = write_mixed(root)
    metrics = build_tokenizer(mixed / "train", mixed / "val", root / "tokenizer", CFG)
    return root, metrics, Tokenizer.load(root / "tokenizer" / "tokenizer.model")


HARD_TEXTS = [
    "It is a truth universally acknowledged, that a single man...",
    "床前明月光，疑是地上霜。\n举头望明月，低头思故乡。",
    "罕见字：𠀀𪚥龘䲜𡃁 and full-width ＡＢＣ１２３，。！",
    "emoji 😀👩‍👩‍👧 🇯🇵 ✊🏽 end",
    "ctrl \x00\x01\x07\x1b[31m\x7f\u200b\ufeff\r\n\r\n done",
    "def f(x):\n\tif x:\n        return  x   \n\n\n\t\t  \n",
    "   leading and trailing spaces   ",
    "\n\n",
    "",
    " ",
    "x" * 5000 + "\n" + "数" * 3000,
]


@pytest.mark.parametrize("text", HARD_TEXTS)
def test_decode_encode_is_identity(trained, text):
    _, _, tok = trained
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert all(0 <= i < tok.vocab_size for i in ids)


def test_special_ids_sha_and_batch(trained):
    root, metrics, tok = trained
    assert (tok.unk_id, tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 2, 3)
    model = (root / "tokenizer" / "tokenizer.model").read_bytes()
    assert tok.sha256 == hashlib.sha256(model).hexdigest() == metrics["sha256"]
    assert tok.vocab_size == CFG.vocab_size
    assert tok.encode_batch(HARD_TEXTS, num_threads=2) == [tok.encode(t) for t in HARD_TEXTS]
    assert tok.decode_batch(tok.encode_batch(HARD_TEXTS)) == HARD_TEXTS
    ids = tok.encode("abc", add_bos=True, add_eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id


def test_metrics(trained):
    root, m, _ = trained
    assert m["lossless"] is True and m["roundtrip_failures"] == 0
    assert set(m["chars_per_token"]) == {"en", "zh", "code", "all"}
    assert all(v > 0 for v in m["chars_per_token"].values())
    # English prose compresses better than Chinese at this size.
    assert m["chars_per_token"]["en"] > m["chars_per_token"]["zh"]
    assert m["alphabet_size"] + m["merges_learned"] + m["byte_pieces"] + m["special_pieces"] \
        == CFG.vocab_size
    # unk, bos, eos, pad + the chat markers reserved as control symbols
    assert m["byte_pieces"] == 256 and m["special_pieces"] == 4 + len(CFG.reserved_tokens)
    assert 0 <= m["byte_fallback_rate"]["all"] < 1
    assert m["sample"]["chars"] <= CFG.sample_chars
    assert (root / "tokenizer" / "tokenizer.vocab").read_text().count("\t") >= CFG.vocab_size


def test_training_is_deterministic(trained, tmp_path):
    root, metrics, _ = trained
    again = build_tokenizer(root / "mixed" / "train", root / "mixed" / "val", tmp_path / "t",
                            CFG)
    assert again["sha256"] == metrics["sha256"]


def test_bpe_model_does_not_depend_on_thread_count(trained):
    root, metrics, _ = trained
    sample = balanced_sample(sorted((root / "mixed" / "train").glob("*.parquet")),
                             CFG.sample_chars, CFG.seed)
    two = TokenizerConfig(**{**CFG.__dict__, "num_threads": 2})
    model, _ = train_model(sample.texts, two)
    assert hashlib.sha256(model).hexdigest() == metrics["sha256"]


def test_nfkc_is_reported_lossy(trained, tmp_path):
    root, _, _ = trained
    cfg = TokenizerConfig(**{**CFG.__dict__, "normalization": "nfkc"})
    m = build_tokenizer(root / "mixed" / "train", root / "mixed" / "val", tmp_path / "t", cfg)
    assert m["lossless"] is False
    tok = Tokenizer.load(tmp_path / "t" / "tokenizer.model")
    assert tok.decode(tok.encode("ＡＢＣ，  x")) != "ＡＢＣ，  x"


def test_init_from_reuses_an_existing_model_and_scores_it(trained, tmp_path):
    root, metrics, _ = trained
    source = root / "tokenizer"  # a directory holding tokenizer.model, as import hf writes
    cfg = TokenizerConfig(**{**CFG.__dict__, "init_from": str(source), "vocab_size": 4000})
    m = build_tokenizer(root / "mixed" / "train", root / "mixed" / "val", tmp_path / "t", cfg)
    assert (tmp_path / "t" / "tokenizer.model").read_bytes() == (
        source / "tokenizer.model").read_bytes()
    assert m["sha256"] == metrics["sha256"] and m["vocab_size"] == CFG.vocab_size
    assert m["chars_per_token"] == metrics["chars_per_token"] and m["lossless"] is True
    assert m["init_from"] == str(source / "tokenizer.model") and m["train_seconds"] == 0.0
    bad = tmp_path / "bad.model"
    bad.write_bytes(b"not a model")
    cfg = TokenizerConfig(**{**CFG.__dict__, "init_from": str(bad)})
    with pytest.raises(InputError, match=r"^tokenizer.init_from: .*bad.model: not a "
                                         r"sentencepiece model"):
        build_tokenizer(root / "mixed" / "train", root / "mixed" / "val", tmp_path / "u", cfg)
    assert not (tmp_path / "u").exists()


def test_sample_is_balanced_seeded_and_order_free(tmp_path):
    mixed = write_mixed(tmp_path)
    parts = sorted((mixed / "train").glob("*.parquet"))
    budget = 9000
    s1 = balanced_sample(parts, budget, seed=1)
    assert sum(s1.chars_per_domain.values()) == sum(map(len, s1.texts)) == budget
    assert max(s1.chars_per_domain.values()) - min(s1.chars_per_domain.values()) <= 1
    assert balanced_sample(parts[::-1], budget, seed=1).texts == s1.texts
    assert balanced_sample(parts, budget, seed=2).texts != s1.texts


def test_small_domain_gives_its_share_to_the_others(tmp_path):
    out = tmp_path / "train"
    out.mkdir()
    texts = ["a" * 100] * 2 + ["b" * 100] * 50 + ["c" * 100] * 50
    doms = ["small"] * 2 + ["x"] * 50 + ["y"] * 50
    pq.write_table(pa.table({"id": [str(i) for i in range(102)], "text": texts, "domain": doms}),
                   out / "part-00000.parquet")
    s = balanced_sample([out / "part-00000.parquet"], 3000, seed=0)
    assert s.chars_per_domain == {"small": 200, "x": 1400, "y": 1400}


@pytest.mark.parametrize("max_bytes", [16, 64, 1000])
def test_sentence_pieces_cut_at_lines_and_keep_everything(max_bytes):
    rng = random.Random(max_bytes)
    text = "".join(rng.choice(["short line\n", "中文的一行文字\n", "y" * 80 + "\n", "\n",
                               "😀" * 30]) for _ in range(60))
    pieces = list(sentence_pieces([text], max_bytes))
    assert "".join(pieces) == text
    assert all(0 < len(p.encode()) <= max_bytes for p in pieces)
    # A piece ends at a line end unless its line alone is longer than max_bytes.
    lines = text.splitlines(keepends=True)
    if max_bytes >= max(len(line.encode()) for line in lines):
        assert all(p.endswith("\n") for p in pieces[:-1])


def test_unigram_too_large_vocab_is_one_line_config_error():
    cfg = TokenizerConfig(model_type="unigram", vocab_size=5000, num_threads=1)
    with pytest.raises(ConfigError, match="Vocabulary size too high"):
        train_model(["abc def ghi"] * 20, cfg)


def test_null_text_is_reported_with_file_and_row(tmp_path):
    for split in ("train", "val"):
        (tmp_path / split).mkdir()
        pq.write_table(pa.table({"id": ["a", "b"], "text": ["ok", None], "domain": ["d", "d"]}),
                       tmp_path / split / "part-00000.parquet")
    with pytest.raises(InputError, match=r"part-00000\.parquet: row 1: 'text' is null"):
        build_tokenizer(tmp_path / "train", tmp_path / "val", tmp_path / "out", CFG)


def test_missing_input_is_reported(tmp_path):
    with pytest.raises(InputError, match="no part-"):
        build_tokenizer(tmp_path / "train", tmp_path / "val", tmp_path / "out", CFG)


def test_bad_model_file_is_reported(tmp_path):
    (tmp_path / "x.model").write_bytes(b"not a model")
    with pytest.raises(InputError, match=r"x\.model: not a sentencepiece model"):
        Tokenizer.load(tmp_path / "x.model")


@pytest.mark.parametrize("byte_fallback", [True, False])
def test_unknown_and_byte_fallback_rates(tmp_path, byte_fallback):
    from lmforge.tokenizer.report import heldout_stats

    cfg = TokenizerConfig(vocab_size=280 if byte_fallback else 20,
                          byte_fallback=byte_fallback, num_threads=1)
    model, _ = train_model(["abc abd bcd dab cab " * 20] * 20, cfg)
    pq.write_table(pa.table({"id": ["0"], "text": ["abc 数据 xyz"], "domain": ["d"]}),
                   tmp_path / "part-00000.parquet")
    stats = heldout_stats(SentencePieceTokenizer(model), [tmp_path / "part-00000.parquet"], 1)["all"]
    if byte_fallback:
        assert stats["unk_rate"] == 0 and stats["byte_fallback_rate"] > 0
        assert stats["roundtrip_failures"] == 0
    else:
        assert stats["unk_rate"] > 0 and stats["byte_fallback_rate"] == 0
        assert stats["roundtrip_failures"] == 1
