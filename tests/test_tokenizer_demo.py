"""Round trip on the demo corpus itself: every domain, including text the model never saw."""

from __future__ import annotations

import gzip
import itertools
import json
from pathlib import Path

import pytest

from lmforge.config import TokenizerConfig
from lmforge.tokenizer import Tokenizer
from lmforge.tokenizer.spm import SentencePieceTokenizer
from lmforge.tokenizer.train import train_model

DEMO = Path(__file__).resolve().parents[1] / "data" / "raw" / "demo"
DOCS_PER_DOMAIN = 8
MAX_DOC_CHARS = 30_000  # keeps the test fast; longer documents are cut by the trainer


def demo_docs() -> dict[str, list[str]]:
    """The first few documents of each demo domain (whole, never cut)."""
    out = {}
    for domain_dir in sorted(p for p in DEMO.iterdir() if p.is_dir()):
        with gzip.open(sorted(domain_dir.glob("part-*.jsonl.gz"))[0], "rt",
                       encoding="utf-8") as f:
            texts = (json.loads(line)["text"] for line in f)
            out[domain_dir.name] = list(itertools.islice(
                (t for t in texts if len(t) <= MAX_DOC_CHARS), DOCS_PER_DOMAIN))
    return out


@pytest.fixture(scope="module")
def docs_and_tok() -> tuple[dict[str, list[str]], Tokenizer]:
    if not DEMO.is_dir():
        pytest.fail(f"{DEMO}: the demo corpus is missing from the repository")
    docs = demo_docs()
    # Trained on the first half of each domain only: the rest is unseen text.
    seen = [t for texts in docs.values() for t in texts[:DOCS_PER_DOMAIN // 2]]
    model, _ = train_model(seen, TokenizerConfig(vocab_size=2000, character_coverage=0.995,
                                                 num_threads=1))
    return docs, SentencePieceTokenizer(model)


def test_every_demo_domain_round_trips(docs_and_tok):
    docs, tok = docs_and_tok
    assert len(docs) == 6 and all(len(t) == DOCS_PER_DOMAIN for t in docs.values())
    for domain, texts in docs.items():
        decoded = tok.decode_batch(tok.encode_batch(texts, num_threads=1), num_threads=1)
        for i, (text, back) in enumerate(zip(texts, decoded, strict=True)):
            assert back == text, f"{domain} document {i} does not round-trip"


def test_unseen_characters_fall_back_to_bytes(docs_and_tok):
    _, tok = docs_and_tok
    text = "䶵 𠮷 𝔘 \u2028 \x0b"  # rare CJK, astral plane, odd whitespace
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert any(tok.sp.is_byte(i) for i in ids) and tok.unk_id not in ids
