"""Shard writer and reader: dtype choice, manifest, and corrupt shards reported."""

from __future__ import annotations

import json

import numpy as np
import pytest

from lmforge.errors import InputError
from lmforge.shards import ShardSet
from lmforge.shards.format import HEADER_SIZE, read_header
from lmforge.shards.writer import write_shards

SHA = "ab" * 32


def _docs(vocab: int, n: int = 40, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=int(k)).tolist() for k in rng.integers(1, 50, size=n)]


@pytest.mark.parametrize("vocab,dtype", [(8192, "uint16"), (65536, "uint16"),
                                         (65537, "uint32"), (200_000, "uint32")])
def test_dtype_follows_vocab_and_ids_roundtrip(tmp_path, vocab, dtype):
    docs = _docs(vocab)
    docs[0].append(vocab - 1)  # the largest id must survive, not wrap
    m = write_shards(tmp_path, docs, vocab, tokenizer_sha256=SHA, shard_tokens=300)
    assert m["dtype"] == dtype
    s = ShardSet(tmp_path, verify_checksums=True)
    np.testing.assert_array_equal(s.read(0, s.num_tokens), np.concatenate(docs))
    assert s.dtype == np.dtype(dtype)
    assert read_header(tmp_path / "shard-00000.bin").dtype == np.dtype(dtype)


def test_id_beyond_vocab_is_refused_not_truncated(tmp_path):
    with pytest.raises(InputError, match="refusing to truncate"):
        write_shards(tmp_path, [[1, 2, 70_000]], 65536)


def test_manifest_counts_and_index(tmp_path):
    docs = _docs(1000, n=60)
    domains = [i % 3 for i in range(60)]
    nbytes = [7 * len(d) + 1 for d in docs]
    m = write_shards(tmp_path, docs, 1000, domains=domains, domain_names=["x", "y", "z"],
                     doc_bytes=nbytes, tokenizer_sha256=SHA, shard_tokens=250)
    assert len(m["shards"]) > 1
    assert all(sh["tokens"] <= 250 for sh in m["shards"])
    assert sum(sh["docs"] for sh in m["shards"]) == 60 == m["num_docs"]
    for code, name in enumerate(["x", "y", "z"]):
        sel = [i for i in range(60) if domains[i] == code]
        assert m["totals"][name] == {"docs": len(sel),
                                     "tokens": sum(len(docs[i]) for i in sel),
                                     "bytes": sum(nbytes[i] for i in sel)}
    s = ShardSet(tmp_path)
    np.testing.assert_array_equal(s.doc_ends, np.cumsum([len(d) for d in docs]))
    np.testing.assert_array_equal(s.doc_domains, domains)
    np.testing.assert_array_equal(s.doc_bytes, nbytes)
    assert s.domain_names == ["x", "y", "z"]
    assert json.loads((tmp_path / "manifest.json").read_text()) == m


def test_writer_is_deterministic(tmp_path):
    docs = _docs(5000)
    write_shards(tmp_path / "a", docs, 5000, shard_tokens=200)
    write_shards(tmp_path / "b", docs, 5000, shard_tokens=200)
    for f in sorted((tmp_path / "a").iterdir()):
        assert f.read_bytes() == (tmp_path / "b" / f.name).read_bytes()


@pytest.fixture
def shard_dir(tmp_path):
    write_shards(tmp_path, _docs(3000), 3000, tokenizer_sha256=SHA, shard_tokens=400)
    return tmp_path


def test_truncated_shard_is_reported(shard_dir):
    path = shard_dir / "shard-00001.bin"
    path.write_bytes(path.read_bytes()[:-3])
    with pytest.raises(InputError, match=r"shard-00001\.bin: file is .* truncated"):
        ShardSet(shard_dir)


def test_truncated_header_is_reported(shard_dir):
    path = shard_dir / "shard-00000.bin"
    path.write_bytes(path.read_bytes()[:20])
    with pytest.raises(InputError, match=r"shard-00000\.bin: truncated shard header"):
        ShardSet(shard_dir)


def _flip(path, offset: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x10
    path.write_bytes(bytes(raw))


def test_bit_flip_in_tokens_is_caught_by_checksums(shard_dir):
    _flip(shard_dir / "shard-00000.bin", HEADER_SIZE + 11)
    ShardSet(shard_dir)  # sizes still agree: only the checksum can tell
    with pytest.raises(InputError, match=r"shard-00000\.bin: sha256 does not match"):
        ShardSet(shard_dir, verify_checksums=True)


@pytest.mark.parametrize("offset,what", [(0, "not an lmforge shard"), (8, "format version"),
                                         (12, "dtype code"), (17, "truncated or corrupt"),
                                         (45, "tokenizer")])
def test_bit_flip_in_header_is_reported(shard_dir, offset, what):
    _flip(shard_dir / "shard-00001.bin", offset)
    with pytest.raises(InputError, match=what) as e:
        ShardSet(shard_dir)
    assert "shard-00001.bin" in str(e.value) and "\n" not in str(e.value)


def test_corrupt_index_is_reported(shard_dir):
    idx = shard_dir / "shard-00000.idx"
    idx.write_bytes(idx.read_bytes()[:-1])
    with pytest.raises(InputError, match=r"shard-00000\.idx"):
        ShardSet(shard_dir)


def test_missing_manifest_is_reported(tmp_path):
    with pytest.raises(InputError, match="no shard manifest"):
        ShardSet(tmp_path)
