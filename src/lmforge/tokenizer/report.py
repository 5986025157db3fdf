"""What a trained tokenizer does to held-out text: compression, byte fallback, round trip."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from lmforge.tokenizer import BYTE, SPECIAL, Tokenizer, flatten_ids
from lmforge.tokenizer.corpus import TextBatch, iter_text_batches

# Held-out characters scored at most: the val split of a large corpus is itself large,
# and the ratios settle long before this.
EVAL_CHARS = 20_000_000
_COUNTS = ("docs", "chars", "bytes", "tokens", "byte_tokens", "unk_tokens",
           "roundtrip_failures")


def vocab_stats(tok: Tokenizer) -> dict[str, int]:
    """Alphabet size (single-character pieces), merges (longer pieces), byte and special ids.

    For byte-level BPE a single-character piece is one byte of its 256-symbol alphabet,
    and there are no byte-fallback pieces.
    """
    stats = {"alphabet_size": 0, "merges_learned": 0, "byte_pieces": 0, "special_pieces": 0}
    for i in range(tok.vocab_size):
        kind = tok.kind(i)
        if kind == BYTE:
            stats["byte_pieces"] += 1
        elif kind == SPECIAL:
            stats["special_pieces"] += 1
        elif len(tok.piece(i)) == 1:
            stats["alphabet_size"] += 1
        else:
            stats["merges_learned"] += 1
    return stats


def heldout_stats(tok: Tokenizer, parts: Iterable[Path], num_threads: int = 0,
                  max_chars: int = EVAL_CHARS) -> dict[str, Any]:
    """Per-domain chars/token, bytes/token, byte-fallback and unknown rates, round trips.

    Byte fallback counts ``<0xNN>`` pieces (none in byte-level BPE, whose rate is 0); the
    unknown rate counts ``unk_id`` (none = 0).
    """
    is_byte = np.array([tok.kind(i) == BYTE for i in range(tok.vocab_size)], dtype=bool)
    acc: dict[str, dict[str, int]] = {}
    chars = 0
    for batch in _batches(parts):
        if chars >= max_chars:
            break
        ids = tok.encode_batch(batch.texts, num_threads=num_threads)
        decoded = tok.decode_batch(ids, num_threads=num_threads)
        lengths = np.array([len(x) for x in ids], dtype=np.int64)
        flat = flatten_ids(ids)
        doc = np.repeat(np.arange(len(ids)), lengths)
        byte_tokens = np.bincount(doc, weights=is_byte[flat], minlength=len(ids))
        unk_tokens = np.bincount(doc, weights=flat == tok.unk_id, minlength=len(ids))
        nbytes = batch.text_bytes.to_numpy(zero_copy_only=False)
        for i, (text, domain) in enumerate(zip(batch.texts, batch.domains, strict=True)):
            a = acc.setdefault(domain, dict.fromkeys(_COUNTS, 0))
            a["docs"] += 1
            a["chars"] += len(text)
            a["bytes"] += int(nbytes[i])
            a["tokens"] += int(lengths[i])
            a["byte_tokens"] += int(byte_tokens[i])
            a["unk_tokens"] += int(unk_tokens[i])
            a["roundtrip_failures"] += decoded[i] != text
            chars += len(text)
    total = {k: sum(a[k] for a in acc.values()) for k in _COUNTS}
    per_domain = {d: _ratios(a) for d, a in sorted(acc.items())}
    return {"all": _ratios(total), "domains": per_domain}


def _batches(parts: Iterable[Path]) -> Iterator[TextBatch]:
    for path in parts:
        yield from iter_text_batches(path)


def _ratios(a: dict[str, int]) -> dict[str, Any]:
    tokens = max(a["tokens"], 1)
    return {**a,
            "chars_per_token": round(a["chars"] / tokens, 4),
            "bytes_per_token": round(a["bytes"] / tokens, 4),
            "byte_fallback_rate": round(a["byte_tokens"] / tokens, 6),
            "unk_rate": round(a["unk_tokens"] / tokens, 6)}
