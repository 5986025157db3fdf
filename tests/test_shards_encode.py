"""The shards stage's tasks: row ranges planned from metadata, encoded exactly, in order,
whatever the worker count or the order the tasks ran in."""

from __future__ import annotations

import math
import os
import pickle
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lmforge.config import TokenizerConfig
from lmforge.errors import InputError
from lmforge.executor import LocalExecutor
from lmforge.shards import encode
from lmforge.shards.encode import (
    CHUNK_CHARS,
    MIN_CHUNK_CHARS,
    cut_rows,
    encode_rows,
    plan_tasks,
    split_chunk_chars,
    text_bytes_per_group,
)
from lmforge.tokenizer import Tokenizer
from lmforge.tokenizer import spm as sp_backend
from lmforge.tokenizer.spm import SentencePieceTokenizer
from lmforge.tokenizer.spm import sp_encode_arrays as encode_texts
from lmforge.tokenizer.train import train_model

PIECES = ["alpha ", "beta", "数据", "    return x\n", "\t", "😀", "\n", "Ω", "\x07"]
DOMAINS = ["a", "b"]


def write_part(path: Path, texts: list, domains: list, row_group_size: int | None = None,
               large: bool = False) -> Path:
    text = pa.array(texts, pa.large_string() if large else pa.string())
    pq.write_table(pa.table({"id": [str(i) for i in range(len(texts))], "text": text,
                             "domain": domains}),
                   path, row_group_size=row_group_size, compression="zstd")
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[list[Path], list[str], list[str], Tokenizer, Path]:
    rng = random.Random(0)
    root = tmp_path_factory.mktemp("enc")
    texts = ["".join(rng.choices(PIECES, k=rng.choice([0, 3, 40, 400]))) for _ in range(300)]
    domains = [rng.choice(DOMAINS) for _ in texts]
    # Part 1 has several row groups, part 2 large_string text.
    parts = [write_part(root / f"part-{p:05d}.parquet", texts[p * 100:(p + 1) * 100],
                        domains[p * 100:(p + 1) * 100], row_group_size=30 if p == 1 else None,
                        large=p == 2)
             for p in range(3)]
    model, _ = train_model(texts, TokenizerConfig(vocab_size=300, num_threads=1))
    model_path = root / "tokenizer.model"
    model_path.write_bytes(model)
    return parts, texts, domains, SentencePieceTokenizer(model), model_path


def tasks_for(corpus, chunk_chars: int | None = 3000, bos: bool = True, eos: bool = True):
    parts, _, _, tok, model_path = corpus
    return plan_tasks(parts, model_path, tok.sha256, bos, eos, np.uint16, DOMAINS,
                      chunk_chars=chunk_chars)


def concat(chunks) -> dict[str, list]:
    chunks = list(chunks)
    return {f: np.concatenate([getattr(c, f) for c in chunks]).tolist()
            for f in ("tokens", "lengths", "nbytes", "domains")}


# ------------------------------------------------------------------------ planning


def _check_ranges(ranges: list[tuple[int, int]], n_rows: int) -> None:
    """Every row exactly once, in order, no empty range."""
    assert [r for lo, hi in ranges for r in range(lo, hi)] == list(range(n_rows))
    assert all(hi > lo for lo, hi in ranges)


@pytest.mark.parametrize("groups, chunk", [
    ([(100, 10_000)], 1000),
    ([(100, 10_000)], 3000),
    ([(10, 5000), (90, 5000)], 1000),  # a dense group, then a sparse one
    ([(37, 1234), (0, 0), (64, 99_999), (5, 0), (1, 7)], 5000),
    ([(1000, 10**9)], 1000),  # more ranges wanted than rows: one row each
    ([(50, 0)], 1000),  # no text at all: one range
    ([(50, 100)], 10**9),
])
def test_row_ranges_cover_every_row_once_in_order(groups, chunk):
    ranges = cut_rows(groups, chunk)
    n_rows = sum(r for r, _ in groups)
    _check_ranges(ranges, n_rows)
    total = sum(b for _, b in groups)
    assert len(ranges) == min(n_rows, max(1, math.ceil(total / chunk)))


@pytest.mark.parametrize("groups, chunk", [
    ([(100, 10_000)], 1000),
    ([(999, 123_456)], 7000),
    ([(10, 5000), (90, 5000)], 1000),
    ([(30, 300), (30, 30_000), (30, 3000), (10, 10)], 2000),
    ([(20, 0), (30, 3000), (5, 0), (30, 3000), (7, 0)], 1000),  # groups of empty texts
])
def test_row_ranges_are_balanced(groups, chunk):
    """Each range's estimated text bytes (row group bytes / rows per row) is the total's
    equal share, give or take the rounding to whole rows."""
    ranges = cut_rows(groups, chunk)
    per_row = np.concatenate([np.full(r, b / r) for r, b in groups if r])
    est = [per_row[lo:hi].sum() for lo, hi in ranges]
    share = per_row.sum() / len(ranges)
    assert share <= chunk
    assert all(abs(e - share) <= per_row.max() for e in est)


def test_empty_part_has_no_ranges():
    assert cut_rows([], 1000) == [] and cut_rows([(0, 0)], 1000) == []


def test_tasks_come_from_metadata(corpus):
    parts, texts, _, tok, model_path = corpus
    tasks = tasks_for(corpus)
    for p in parts:
        mine = [(t.lo, t.hi) for t in tasks if t.path == str(p)]
        _check_ranges(mine, pq.ParquetFile(p).metadata.num_rows)
        size = sum(b for _, b in text_bytes_per_group(p))
        assert len(mine) == math.ceil(size / 3000) > 2
    assert [t.path for t in tasks] == sorted(t.path for t in tasks)  # parts in order
    assert len(text_bytes_per_group(parts[1])) == 4  # row groups of 30, 30, 30, 10
    t = tasks[0]
    assert (t.model, t.model_sha256, t.add_bos, t.add_eos, t.dtype, t.domains) == (
        str(model_path), tok.sha256, True, True, "<u2", ("a", "b"))


def test_chunk_size_gives_every_worker_work():
    assert split_chunk_chars(10**12, 512) == CHUNK_CHARS
    per = encode.TASKS_PER_WORKER
    assert split_chunk_chars(4 * 10**7, 8) == 4 * 10**7 // (per * 8)  # tasks for 8 workers
    assert split_chunk_chars(1000, 2) == MIN_CHUNK_CHARS  # tiny splits: one small task


def test_a_terabyte_makes_tens_of_thousands_of_pieces_not_millions():
    """Each task writes two piece files: the count a terabyte of text makes."""
    tasks = 10**12 / split_chunk_chars(10**12, 512)
    assert 5_000 < tasks < 50_000


@pytest.mark.parametrize("limit", [1, 7, 50, 10**9])
def test_encode_batches_cover_every_row_once_in_order(limit):
    rng = np.random.default_rng(limit)
    nbytes = rng.integers(0, 30, 200).astype(np.uint64)
    batches = encode.encode_batches(nbytes, limit)
    assert [lo for lo, _ in batches] == [0] + [hi for _, hi in batches[:-1]]
    assert batches[-1][1] == 200 and all(lo < hi for lo, hi in batches)
    for lo, hi in batches:  # only a batch's first row takes it past the limit
        assert nbytes[lo + 1 : hi].sum() < limit
    assert encode.encode_batches(np.zeros(0, np.uint64), limit) == [(0, 0)]


def test_encoding_in_small_batches_changes_nothing(corpus, monkeypatch):
    whole = concat(encode_rows(t) for t in tasks_for(corpus))
    monkeypatch.setattr(encode, "ENCODE_BATCH_CHARS", 40)  # a few documents a batch
    assert concat(encode_rows(t) for t in tasks_for(corpus)) == whole


def test_planner_cuts_finer_for_more_workers(corpus):
    parts, _, _, tok, model_path = corpus
    sizes = [sum(b for _, b in text_bytes_per_group(p)) for p in parts]
    for workers in (1, 4, 64):
        chunk = split_chunk_chars(sum(sizes), workers)
        tasks = plan_tasks(parts, model_path, tok.sha256, False, True, np.uint16, DOMAINS,
                           workers=workers)
        assert len(tasks) == sum(min(100, math.ceil(s / chunk)) for s in sizes)
    assert len(tasks) >= 2 * 64 or chunk == MIN_CHUNK_CHARS


# ------------------------------------------------------------------------ encoding


def test_encode_rows_equals_encoding_the_texts(corpus):
    _, texts, domains, tok, _ = corpus
    out = concat(encode_rows(t) for t in tasks_for(corpus))
    expected = [tok.encode(t, add_bos=True, add_eos=True) for t in texts]
    assert out["tokens"] == [i for e in expected for i in e]
    assert out["lengths"] == [len(e) for e in expected]
    assert out["nbytes"] == [len(t.encode("utf-8")) for t in texts]
    assert out["domains"] == [DOMAINS.index(d) for d in domains]
    chunk = encode_rows(tasks_for(corpus)[0])
    assert chunk.tokens.dtype == np.uint16 and chunk.lengths.dtype == np.int64
    assert chunk.nbytes.dtype == np.uint64 and chunk.domains.dtype == np.uint16


@pytest.mark.parametrize("workers", [1, 2])
def test_results_do_not_depend_on_workers(corpus, workers):
    tasks = tasks_for(corpus, bos=False)
    serial = concat(encode_rows(t) for t in tasks)
    assert concat(LocalExecutor(workers).map(encode_rows, tasks)) == serial


def test_results_do_not_depend_on_task_order(corpus):
    """A worker continues reading a part where its last task stopped; tasks out of
    order (as on a cluster) or from other parts in between read the same rows."""
    tasks = tasks_for(corpus, chunk_chars=1500)
    forward = [encode_rows(t) for t in tasks]
    rng = random.Random(1)
    order = list(range(len(tasks)))
    for _ in range(3):
        rng.shuffle(order)
        got = {i: encode_rows(tasks[i]) for i in order}
        assert concat(got[i] for i in range(len(tasks))) == concat(forward)


def test_a_rewritten_part_is_read_afresh(corpus, tmp_path):
    _, _, _, tok, model_path = corpus
    path = write_part(tmp_path / "part-00000.parquet", ["x y"] * 40, ["a"] * 40)
    tasks = plan_tasks([path], model_path, tok.sha256, False, False, np.uint16, DOMAINS,
                       chunk_chars=10)
    assert len(tasks) > 2
    encode_rows(tasks[0])  # the worker now holds this part open
    tmp = write_part(tmp_path / "new.parquet", ["beta"] * 40, ["b"] * 40)
    os.replace(tmp, path)
    got = encode_rows(tasks[1])
    assert got.tokens.tolist() == tok.encode("beta") * len(got.lengths)
    assert set(got.domains.tolist()) == {1}


def test_a_task_imports_no_pandas(corpus):
    """pyarrow's ``to_numpy`` and ``pa.array`` import pandas: half a second of CPU in
    every fresh worker, more than a task's own work on small splits."""
    code = ("import pickle, sys; from lmforge.shards.encode import encode_rows; "
            "encode_rows(pickle.loads(sys.stdin.buffer.read())); "
            "print('pandas' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], input=pickle.dumps(tasks_for(corpus)[0]),
                       capture_output=True, timeout=120)
    assert r.returncode == 0, r.stderr.decode()
    assert r.stdout.decode().strip() == "False"


def test_model_loads_once_per_process(corpus, tmp_path, monkeypatch):
    _, texts, _, _, _ = corpus
    other, _ = train_model(texts, TokenizerConfig(vocab_size=400, num_threads=1))
    new = SentencePieceTokenizer(other)
    loads = []
    real = sp_backend.spm.SentencePieceProcessor
    monkeypatch.setattr(sp_backend.spm, "SentencePieceProcessor",
                        lambda: loads.append(1) or real())
    monkeypatch.setattr(encode, "_MODELS", {})
    for t in tasks_for(corpus):
        encode_rows(t)
    assert len(loads) == 1
    # Another model at the same path (a new sha256) is loaded, not taken from the cache.
    path = tmp_path / "tokenizer.model"
    path.write_bytes(other)
    tasks = plan_tasks(corpus[0][:1], path, new.sha256, False, False, np.uint16, DOMAINS)
    got = encode_rows(tasks[0])
    assert got.tokens.tolist() == [i for t in texts[:got.lengths.size] for i in new.encode(t)]
    assert len(loads) == 2


def test_a_model_changed_since_planning_is_an_input_error(corpus, tmp_path):
    _, _, _, tok, model_path = corpus
    path = tmp_path / "tokenizer.model"
    path.write_bytes(model_path.read_bytes() + b"\0")
    tasks = plan_tasks(corpus[0][:1], path, tok.sha256, False, False, np.uint16, DOMAINS)
    with pytest.raises(InputError, match="changed during the run"):
        encode_rows(tasks[0])


@pytest.mark.parametrize("workers", [1, 2])
def test_a_null_cell_names_file_and_row(corpus, tmp_path, workers):
    _, _, _, tok, model_path = corpus
    texts = [f"doc {i}" for i in range(200)]
    texts[157] = None
    path = write_part(tmp_path / "part-00000.parquet", texts, ["a"] * 200, row_group_size=64)
    tasks = plan_tasks([path], model_path, tok.sha256, False, True, np.uint16, DOMAINS,
                       chunk_chars=100)
    with pytest.raises(InputError) as err:
        list(LocalExecutor(workers).map(encode_rows, tasks))
    msg = str(err.value)
    assert f"{path}: row 157: 'text' is null" in msg and "\n" not in msg


def test_a_non_string_column_is_an_input_error(corpus, tmp_path):
    _, _, _, tok, model_path = corpus
    path = tmp_path / "part-00000.parquet"
    pq.write_table(pa.table({"text": [1, 2, 3], "domain": ["a"] * 3}), path)
    tasks = plan_tasks([path], model_path, tok.sha256, False, True, np.uint16, DOMAINS)
    with pytest.raises(InputError, match=r"part-00000.parquet: column 'text' is int64, "
                                         r"expected string"):
        encode_rows(tasks[0])


def test_a_missing_column_is_an_input_error(tmp_path):
    path = tmp_path / "part-00000.parquet"
    pq.write_table(pa.table({"id": ["1"], "domain": ["a"]}), path)
    with pytest.raises(InputError, match="no column"):
        text_bytes_per_group(path)


class _OldSentencePiece:
    """sentencepiece < 0.2.1: no ``return_type``, id lists only."""

    def __init__(self, sp) -> None:
        self.sp = sp

    def encode(self, texts, **kw):
        if "return_type" in kw:
            raise TypeError("encode() got an unexpected keyword argument 'return_type'")
        return self.sp.encode(texts, **kw)


def test_encode_without_numpy_output_gives_the_same(corpus):
    _, texts, _, tok, _ = corpus
    new = encode_texts(tok.sp, texts, False, True, np.dtype("<u4"))
    old = encode_texts(_OldSentencePiece(tok.sp), texts, False, True, np.dtype("<u4"))
    assert new[0].dtype == old[0].dtype == np.dtype("<u4")
    assert np.array_equal(new[0], old[0]) and np.array_equal(new[1], old[1])
    assert encode_texts(tok.sp, [], False, True, np.dtype("<u2"))[0].shape == (0,)
