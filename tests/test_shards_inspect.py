"""``lmforge inspect shards``: counts, dtype, length histogram and decoded samples."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from lmforge.config import TokenizerConfig
from lmforge.errors import InputError
from lmforge.shards.inspect import add_inspect_parser, inspect_shards
from lmforge.shards.writer import write_shards
from lmforge.tokenizer import Tokenizer
from lmforge.tokenizer.spm import SentencePieceTokenizer
from lmforge.tokenizer.train import train_model

DOCS = {"code": ["def f(x):\n\treturn x  # two spaces\n"] * 3,
        "prose": ["The cat sat on the mat. " * n for n in (1, 4, 30)] + ["Short."],
        "zh": []}


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> tuple[Path, Tokenizer]:
    """``models/tokenizer/tokenizer.model`` and ``data/shards/{train,val}`` in a scratch repo."""
    root = tmp_path_factory.mktemp("repo")
    texts = [t for docs in DOCS.values() for t in docs]
    model, _ = train_model(texts * 5, TokenizerConfig(vocab_size=300, num_threads=1))
    tok_path = root / "models" / "tokenizer" / "tokenizer.model"
    tok_path.parent.mkdir(parents=True)
    tok_path.write_bytes(model)
    tok = SentencePieceTokenizer(model)
    names = list(DOCS)
    docs, domains = [], []
    for code, name in enumerate(names):
        for text in DOCS[name]:
            docs.append(tok.encode(text, add_eos=True))
            domains.append(code)
    for split in ("train", "val"):
        write_shards(root / "data" / "shards" / split, docs, tok.vocab_size, domains=domains,
                     domain_names=names, tokenizer_sha256=tok.sha256, shard_tokens=200)
    return root, tok


def test_report_counts_histogram_and_samples(repo):
    root, tok = repo
    report = inspect_shards(root / "data/shards/train", verify=True)
    assert "uint16" in report and "checksums: verified" in report
    for name, docs in DOCS.items():
        tokens = sum(len(tok.encode(t)) + 1 for t in docs)
        row = re.search(rf"^{name}\s+(\S+)\s+(\S+)", report, re.M)
        assert row and row.groups() == (f"{len(docs):,}", f"{tokens:,}")
    assert re.search(r"^zh .*\n(.|\n)*zh: no documents", report, re.M)
    # Every document is in exactly one histogram bucket.
    counts = [int(c) for c in re.findall(r"\| #*\s+(\d+)$", report, re.M)]
    assert sum(counts) == sum(map(len, DOCS.values()))
    # Samples are decoded and escaped, so tabs and newlines show.
    assert repr(DOCS["code"][0]) in report
    assert repr(DOCS["prose"][0]) in report


def test_parent_dir_reports_each_split(repo):
    root, _ = repo
    report = inspect_shards(root / "data/shards")
    assert report.count("shards ") == 2 and "train" in report and "val" in report


def test_wrong_or_missing_tokenizer_shows_ids(repo, tmp_path):
    root, _ = repo
    other, _ = train_model(["something else entirely"] * 20,
                           TokenizerConfig(vocab_size=300, num_threads=1))
    (tmp_path / "other.model").write_bytes(other)
    report = inspect_shards(root / "data/shards/val", tmp_path / "other.model")
    assert "showing ids" in report and repr(DOCS["code"][0]) not in report
    # Copied away from models/tokenizer, the shards find no tokenizer to decode with.
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in (root / "data/shards/val").iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    assert "no tokenizer found" in inspect_shards(copy)


def test_command_line(repo, capsys):
    root, _ = repo
    parser = argparse.ArgumentParser()
    add_inspect_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["inspect", "shards", str(root / "data/shards/train"),
                              "--tokenizer", str(root / "models/tokenizer/tokenizer.model")])
    args.func(args)
    assert repr(DOCS["prose"][0]) in capsys.readouterr().out
    args = parser.parse_args(["inspect", "shards", str(root / "nowhere")])
    with pytest.raises(InputError, match="nowhere: no such shards directory"):
        args.func(args)
