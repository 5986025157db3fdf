"""The shards stage end to end: mixed parquet + tokenizer in, verified shard sets out."""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lmforge.config import ShardsConfig, TokenizerConfig
from lmforge.errors import InputError
from lmforge.executor import Executor
from lmforge.shards import ShardSet, WindowLoader, encode
from lmforge.shards.build import build_shards
from lmforge.shards.format import token_dtype
from lmforge.shards.writer import ShardWriter
from lmforge.tokenizer import Tokenizer
from lmforge.tokenizer.train import train_model

REPO = Path(__file__).resolve().parents[1]
PIECES = ["alpha", "beta", "gamma", "数据", "模型", "    return x\n", "\t", "😀", "\n", " "]


def _docs(rng: random.Random, n: int) -> list[str]:
    return ["".join(rng.choices(PIECES, k=rng.randint(0, 60))) for _ in range(n)]


def write_mixed(root: Path, seed: int = 0) -> dict[str, list[tuple[str, str]]]:
    """Mixed parts for both splits; return (text, domain) per split in file order."""
    rng = random.Random(seed)
    rows: dict[str, list[tuple[str, str]]] = {}
    for split, n_parts in (("train", 3), ("val", 1)):
        rows[split] = []
        for p in range(n_parts):
            texts = _docs(rng, 50)
            domains = [rng.choice(["prose", "code", "zh"]) for _ in texts]
            if split == "val":
                domains = ["zh" if d == "prose" else d for d in domains]  # a domain missing
            out = root / "data" / "mixed" / split / f"part-{p:05d}.parquet"
            out.parent.mkdir(parents=True, exist_ok=True)
            pq.write_table(pa.table({"id": [f"{split}{p}-{i}" for i in range(50)],
                                     "text": texts, "domain": domains,
                                     "source": ["t"] * 50}), out, compression="zstd")
            rows[split] += list(zip(texts, domains, strict=True))
    return rows


def write_tokenizer(root: Path, rows) -> Path:
    cfg = TokenizerConfig(vocab_size=300, num_threads=1)
    model, _ = train_model([t for t, _ in rows["train"]], cfg)
    path = root / "models" / "tokenizer" / "tokenizer.model"
    path.parent.mkdir(parents=True)
    path.write_bytes(model)
    return path


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("repo")
    rows = write_mixed(root)
    tok_path = write_tokenizer(root, rows)
    cfg = ShardsConfig(shard_tokens=2000, num_workers=2)
    metrics = build_shards(root / "data/mixed", tok_path, root / "data/shards", cfg)
    return root, rows, Tokenizer.load(tok_path), metrics, cfg


@pytest.mark.parametrize("split", ["train", "val"])
def test_every_document_decodes_back(built, split):
    root, rows, tok, metrics, _ = built
    s = ShardSet(root / "data/shards" / split, verify_checksums=True)
    assert s.tokenizer_sha256 == tok.sha256
    assert s.domain_names == ["code", "prose", "zh"]  # one table for both splits
    assert len(s.doc_ends) == len(rows[split])
    starts = s.doc_starts()
    for i, (text, domain) in enumerate(rows[split]):
        ids = s.read(int(starts[i]), int(s.doc_ends[i]))
        assert ids[-1] == tok.eos_id  # EOS after every document
        assert tok.decode(ids[:-1].tolist()) == text
        assert s.domain_names[s.doc_domains[i]] == domain
        assert s.doc_bytes[i] == len(text.encode("utf-8"))
    assert metrics[split]["tokens"] == s.num_tokens
    assert metrics[split]["docs"] == len(rows[split])


def test_shards_split_and_totals(built):
    root, rows, _, metrics, cfg = built
    s = ShardSet(root / "data/shards/train")
    m = s.manifest
    assert len(m["shards"]) > 1 and all(sh["tokens"] <= cfg.shard_tokens for sh in m["shards"])
    assert m["dtype"] == "uint16" and m["eos"] is True and m["bos"] is False
    for code, name in enumerate(s.domain_names):
        sel = s.doc_domains == code
        lens = np.diff(np.concatenate([[0], s.doc_ends]))
        assert m["totals"][name] == {"docs": int(sel.sum()), "tokens": int(lens[sel].sum()),
                                     "bytes": int(s.doc_bytes[sel].sum())}
    assert metrics["val"]["per_domain"]["prose"]["docs"] == 0


def test_output_is_deterministic(built, tmp_path):
    root, _, _, _, cfg = built
    build_shards(root / "data/mixed", root / "models/tokenizer/tokenizer.model",
                 tmp_path, ShardsConfig(shard_tokens=cfg.shard_tokens, num_workers=1))
    for split in ("train", "val"):
        for f in sorted((root / "data/shards" / split).iterdir()):
            assert f.read_bytes() == (tmp_path / split / f.name).read_bytes(), f.name


class _ShuffledExecutor(Executor):
    """Runs the tasks in this process in a scrambled order, as a cluster might, and
    yields the results in task order."""

    name = "shuffled"
    workers = 3
    ran = 0

    def _run(self, fn, tasks):
        self.ran += len(tasks)
        order = list(range(len(tasks)))
        random.Random(len(tasks)).shuffle(order)
        results = {i: fn(tasks[i]) for i in order}
        return iter([results[i] for i in range(len(tasks))])


def test_any_executor_writes_the_same_bytes(built, tmp_path, monkeypatch):
    root, _, _, _, cfg = built
    monkeypatch.setattr(encode, "CHUNK_CHARS", 1000)  # several tasks per part
    monkeypatch.setattr(encode, "MIN_CHUNK_CHARS", 1000)
    executor = _ShuffledExecutor()
    metrics = build_shards(root / "data/mixed", root / "models/tokenizer/tokenizer.model",
                           tmp_path, ShardsConfig(shard_tokens=cfg.shard_tokens),
                           executor=executor)
    assert metrics["num_workers"] == 3 and executor.ran > 4 * 4
    for split in ("train", "val"):
        for f in sorted((root / "data/shards" / split).iterdir()):
            assert f.read_bytes() == (tmp_path / split / f.name).read_bytes(), f.name


class _Metered(Executor):
    """Runs the tasks in this process; counts the pickled bytes of what each function
    returns to the driver."""

    name = "metered"
    workers = 2

    def __init__(self) -> None:
        self.result_bytes: dict[str, int] = {}
        self.results: dict[str, int] = {}

    def _run(self, fn, tasks):
        for task in tasks:
            result = fn(task)
            size = len(pickle.dumps(result))
            self.result_bytes[fn.__name__] = self.result_bytes.get(fn.__name__, 0) + size
            self.results[fn.__name__] = self.results.get(fn.__name__, 0) + 1
            yield result


@pytest.mark.parametrize("shard_tokens", [1, 300, 10**9])
def test_shard_tasks_write_what_one_writer_would_and_no_token_reaches_the_driver(
        built, tmp_path, monkeypatch, shard_tokens):
    """Shards cut by tasks from the pieces' token counts are the bytes one writer,
    given every document in order, writes (a shard per document, many, one); what comes
    back to the driver is the counts (8 B a document) and a manifest entry per shard."""
    root, _, tok, _, _ = built
    monkeypatch.setattr(encode, "CHUNK_CHARS", 1000)  # several pieces per part
    monkeypatch.setattr(encode, "MIN_CHUNK_CHARS", 1000)
    executor = _Metered()
    metrics = build_shards(root / "data/mixed", root / "models/tokenizer/tokenizer.model",
                           tmp_path / "tasks", ShardsConfig(shard_tokens=shard_tokens),
                           executor=executor)
    split = tmp_path / "tasks" / "train"
    parts = sorted((root / "data/mixed/train").glob("part-*.parquet"))
    writer = ShardWriter(tmp_path / "one", tok.vocab_size, tok.sha256,
                         metrics["domains"], shard_tokens)
    for task in encode.plan_tasks(parts, root / "models/tokenizer/tokenizer.model", tok.sha256,
                                  False, True, token_dtype(tok.vocab_size), metrics["domains"]):
        enc = encode.encode_rows(task)
        writer.add(enc.tokens, enc.lengths, enc.nbytes, enc.domains)
    writer.close({k: json.loads((split / "manifest.json").read_text())[k]
                  for k in ("bos", "eos", "bos_id", "eos_id", "pad_id")})
    assert sorted(p.name for p in split.iterdir()) == sorted(p.name for p in (tmp_path / "one").iterdir())
    for f in split.iterdir():
        assert f.read_bytes() == (tmp_path / "one" / f.name).read_bytes(), f.name
    docs = metrics["train"]["docs"] + metrics["val"]["docs"]
    tokens = metrics["train"]["tokens"] + metrics["val"]["tokens"]
    assert metrics["train"]["shards"] == {1: docs - metrics["val"]["docs"], 10**9: 1}.get(
        shard_tokens, metrics["train"]["shards"])
    # int64 counts, and numpy's pickling of an array (~150 bytes) per piece
    assert executor.result_bytes["encode_piece"] <= 8 * docs + 200 * executor.results["encode_piece"]
    assert executor.result_bytes["encode_piece"] < 2 * tokens  # a token is 2 bytes (uint16)


def test_bos_is_prepended_when_asked(built, tmp_path):
    root, rows, tok, _, _ = built
    build_shards(root / "data/mixed", root / "models/tokenizer/tokenizer.model", tmp_path,
                 ShardsConfig(bos=True, eos=False))
    s = ShardSet(tmp_path / "val")
    assert np.all(s.read(0, s.num_tokens)[s.doc_starts()] == tok.bos_id)
    assert s.num_tokens == sum(len(tok.encode(t)) + 1 for t, _ in rows["val"])


def test_loader_reads_stage_output(built):
    root, _, _, _, _ = built
    loader = WindowLoader(ShardSet(root / "data/shards/train"), seq_len=16, batch_size=4, seed=0)
    x, y = loader.next_batch()
    assert x.shape == (4, 16) and bool((x[:, 1:] == y[:, :-1]).all())


def test_wrong_text_type_is_reported(tmp_path):
    for split in ("train", "val"):
        out = tmp_path / "mixed" / split / "part-00000.parquet"
        out.parent.mkdir(parents=True)
        pq.write_table(pa.table({"id": ["a"], "text": [3], "domain": ["d"]}), out)
    model, _ = train_model(["abc def"] * 50, TokenizerConfig(vocab_size=280, num_threads=1))
    (tmp_path / "t.model").write_bytes(model)
    with pytest.raises(InputError, match=r"part-00000\.parquet: column 'text' is int64"):
        build_shards(tmp_path / "mixed", tmp_path / "t.model", tmp_path / "out", ShardsConfig())
    assert not (tmp_path / "out" / "train").exists()  # nothing half-written


def test_stages_run_from_the_command_line(built, tmp_path):
    """``python -m stages.tokenizer`` then ``stages.shards`` in a scratch repo; errors exit 2."""
    src, _, _, _, _ = built
    root, empty = tmp_path / "repo", tmp_path / "empty"
    shutil.copytree(src / "data/mixed", root / "data/mixed")
    empty.mkdir()
    params = (REPO / "params.yaml").read_text().replace("vocab_size: 8192", "vocab_size: 300")
    for d in (root, empty):
        (d / "params.yaml").write_text(params)
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'src'}"}
    env.pop("DVC_ROOT", None)
    for stage in ("tokenizer", "shards"):
        r = subprocess.run([sys.executable, "-m", f"stages.{stage}"], cwd=root, env=env,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert (root / "metrics" / f"{stage}.json").is_file()
    assert ShardSet(root / "data/shards/val").tokenizer_sha256 == \
        Tokenizer.load(root / "models/tokenizer/tokenizer.model").sha256
    r = subprocess.run([sys.executable, "-m", "stages.shards"], cwd=empty, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "tokenizer.model" in r.stderr
