"""A vocabulary over 65,535: the shards stage writes uint32 shards, and a model trains on them."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import sentencepiece as spm
import torch

from lmforge.config import ModelConfig, ShardsConfig
from lmforge.model.llama import Llama
from lmforge.shards import ShardSet, WindowLoader
from lmforge.shards.build import build_shards
from lmforge.tokenizer import Tokenizer

N_SYMBOLS = 65_600  # user-defined pieces push the learned ones above 65,535
PATTERN = "the cat <w65599> sat on <w70> the mat <w40000>\n"


def big_vocab_model() -> bytes:
    """A lossless sentencepiece model whose vocabulary does not fit uint16."""
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(["the cat sat on the mat"] * 20), model_writer=buf,
        model_type="bpe", vocab_size=N_SYMBOLS + 300, hard_vocab_limit=False,
        user_defined_symbols=[f"<w{i}>" for i in range(N_SYMBOLS)], byte_fallback=True,
        unk_id=0, bos_id=1, eos_id=2, pad_id=3, normalization_rule_name="identity",
        add_dummy_prefix=False, remove_extra_whitespaces=False, minloglevel=2)
    return buf.getvalue()


@pytest.fixture(scope="module")
def uint32_shards(tmp_path_factory) -> tuple[Path, Tokenizer]:
    root = tmp_path_factory.mktemp("u32")
    (root / "tokenizer.model").write_bytes(big_vocab_model())
    texts = [PATTERN * n for n in range(1, 40)]
    for split in ("train", "val"):
        out = root / "mixed" / split
        out.mkdir(parents=True)
        pq.write_table(pa.table({"id": [f"{split}{i}" for i in range(len(texts))],
                                 "text": texts, "domain": ["toy"] * len(texts)}),
                       out / "part-00000.parquet")
    build_shards(root / "mixed", root / "tokenizer.model", root / "shards",
                 ShardsConfig(num_workers=1))
    return root / "shards", Tokenizer.load(root / "tokenizer.model")


def test_big_vocabulary_writes_exact_uint32_shards(uint32_shards):
    path, tok = uint32_shards
    assert tok.vocab_size > 65_536
    shards = ShardSet(path / "train", verify_checksums=True)
    assert shards.dtype == np.dtype("uint32") and shards.manifest["dtype"] == "uint32"
    tokens = shards.read(0, shards.num_tokens)
    assert int(tokens.max()) > 65_535  # ids a uint16 shard would have wrapped
    first = tokens[:int(shards.doc_ends[0])]
    assert tok.decode(first[:-1].tolist()) == PATTERN and first[-1] == tok.eos_id


def test_uint32_shards_train_a_model(uint32_shards):
    path, tok = uint32_shards
    torch.manual_seed(0)
    loader = WindowLoader(ShardSet(path / "train"), seq_len=16, batch_size=4, seed=0)
    cfg = ModelConfig(n_layer=1, n_head=2, n_embd=16, seq_len=16, ffn_multiple_of=16)
    model = Llama(cfg, tok.vocab_size)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(20):
        x, y = loader.next_batch()
        assert int(x.max()) > 65_535 or int(y.max()) > 65_535
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    # From log(vocab) ~ 11 at the start down towards the pattern's entropy.
    assert losses[0] > 10 and np.mean(losses[-3:]) < 0.5 * losses[0]
    # What it predicts are the pattern's own ids, high ones included: none was wrapped.
    x, _ = loader.next_batch()
    with torch.no_grad():
        predicted = model(x).argmax(-1)
    pattern_ids = torch.tensor(sorted(set(tok.encode(PATTERN)) | {tok.eos_id}))
    assert torch.isin(predicted, pattern_ids).float().mean() > 0.9
    assert int(predicted.max()) > 65_535
