"""The shards stage's parallel encoder: exact, in order, whatever the worker count."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lmforge.config import TokenizerConfig
from lmforge.shards.encode import ChunkEncoder, encode_texts, iter_chunks
from lmforge.tokenizer import Tokenizer
from lmforge.tokenizer.train import train_model

PIECES = ["alpha ", "beta", "数据", "    return x\n", "\t", "😀", "\n", "Ω", "\x07"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[list[Path], list[str], list[str], Tokenizer]:
    rng = random.Random(0)
    root = tmp_path_factory.mktemp("enc")
    texts = ["".join(rng.choices(PIECES, k=rng.choice([0, 3, 40, 400]))) for _ in range(300)]
    domains = [rng.choice(["a", "b"]) for _ in texts]
    parts = []
    for p in range(3):
        path = root / f"part-{p:05d}.parquet"
        sl = slice(p * 100, (p + 1) * 100)
        pq.write_table(pa.table({"id": [str(i) for i in range(100)], "text": texts[sl],
                                 "domain": domains[sl]}), path)
        parts.append(path)
    model, _ = train_model(texts, TokenizerConfig(vocab_size=300, num_threads=1))
    return parts, texts, domains, Tokenizer(model)


def test_chunks_keep_order_and_size(corpus):
    parts, texts, domains, _ = corpus
    chunks = list(iter_chunks(parts, {"a": 0, "b": 1}, chunk_chars=2000))
    assert len(chunks) > 5
    assert [t for c in chunks for t in c.texts] == texts
    assert np.concatenate([c.domains for c in chunks]).tolist() == [
        {"a": 0, "b": 1}[d] for d in domains]
    assert np.concatenate([c.nbytes for c in chunks]).tolist() == [
        len(t.encode()) for t in texts]
    # A chunk stops at the first read batch that reaches the size.
    longest = max(map(len, texts))
    assert all(sum(map(len, c.texts)) < 2000 + 64 * longest for c in chunks)


@pytest.mark.parametrize("workers", [1, 2])
def test_encoder_matches_sentencepiece_in_order(corpus, workers):
    parts, texts, _, tok = corpus
    chunks = list(iter_chunks(parts, {"a": 0, "b": 1}, chunk_chars=3000))
    with ChunkEncoder(tok, workers, add_bos=True, add_eos=True) as enc:
        out = list(enc.map(iter(chunks)))
    tokens = np.concatenate([o.tokens for o in out])
    lengths = np.concatenate([o.lengths for o in out])
    expected = [tok.encode(t, add_bos=True, add_eos=True) for t in texts]
    assert tokens.dtype == np.uint16
    assert lengths.tolist() == [len(e) for e in expected]
    assert tokens.tolist() == [i for e in expected for i in e]


class _OldSentencePiece:
    """sentencepiece < 0.2.1: no ``return_type``, id lists only."""

    def __init__(self, sp) -> None:
        self.sp = sp

    def encode(self, texts, **kw):
        if "return_type" in kw:
            raise TypeError("encode() got an unexpected keyword argument 'return_type'")
        return self.sp.encode(texts, **kw)


def test_encode_without_numpy_output_gives_the_same(corpus):
    _, texts, _, tok = corpus
    new = encode_texts(tok.sp, texts, False, True, np.dtype("<u4"))
    old = encode_texts(_OldSentencePiece(tok.sp), texts, False, True, np.dtype("<u4"))
    assert new[0].dtype == old[0].dtype == np.dtype("<u4")
    assert np.array_equal(new[0], old[0]) and np.array_equal(new[1], old[1])
    assert encode_texts(tok.sp, [], False, True, np.dtype("<u2"))[0].shape == (0,)
