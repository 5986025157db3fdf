"""The shards stage: tokenize mixed/{train,val} into binary shard sets."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from lmforge.config import ShardsConfig
from lmforge.io import atomic_dir
from lmforge.shards.writer import ShardWriter
from lmforge.tokenizer import Tokenizer, flatten_ids
from lmforge.tokenizer.corpus import iter_text_batches, list_parts, read_domains

SPLITS = ("train", "val")
# Documents per batched encode: enough to keep the threads busy, few enough that the
# Python id lists (~36 bytes a token) stay small.
ENCODE_BATCH_ROWS = 256


def encode_split(parts: list[Path], tok: Tokenizer, writer: ShardWriter,
                 domain_codes: dict[str, int], cfg: ShardsConfig) -> None:
    """Encode every document of ``parts`` (in order) into ``writer``."""
    for path in parts:
        for batch in iter_text_batches(path, batch_rows=ENCODE_BATCH_ROWS):
            ids = tok.encode_batch(batch.texts, num_threads=cfg.num_workers,
                                   add_bos=cfg.bos, add_eos=cfg.eos)
            lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
            domains = np.array([domain_codes[d] for d in batch.domains], dtype=np.uint16)
            writer.add(flatten_ids(ids), lengths, batch.text_bytes.to_numpy(), domains)


def build_shards(mixed_dir: str | Path, tokenizer_path: str | Path, out_dir: str | Path,
                 cfg: ShardsConfig) -> dict[str, Any]:
    """Write ``out_dir/{train,val}`` shard sets from ``mixed_dir``; return stage metrics."""
    tok = Tokenizer.load(tokenizer_path)
    parts = {split: list_parts(Path(mixed_dir) / split) for split in SPLITS}
    # One domain-code table for both splits, so codes mean the same thing everywhere.
    domain_names = read_domains(parts["train"] + parts["val"])
    codes = {name: code for code, name in enumerate(domain_names)}
    extra = {"bos": cfg.bos, "eos": cfg.eos, "bos_id": tok.bos_id, "eos_id": tok.eos_id,
             "pad_id": tok.pad_id}
    metrics: dict[str, Any] = {"tokenizer_sha256": tok.sha256, "vocab_size": tok.vocab_size,
                               "domains": domain_names}
    for split in SPLITS:
        start = time.perf_counter()
        with atomic_dir(Path(out_dir) / split) as tmp:
            writer = ShardWriter(tmp, tok.vocab_size, tok.sha256, domain_names,
                                 cfg.shard_tokens)
            encode_split(parts[split], tok, writer, codes, cfg)
            manifest = writer.close(extra)
        seconds = time.perf_counter() - start
        metrics[split] = {
            "parts": len(parts[split]),
            "shards": len(manifest["shards"]),
            "dtype": manifest["dtype"],
            "docs": manifest["num_docs"],
            "tokens": manifest["num_tokens"],
            "bytes": sum(t["bytes"] for t in manifest["totals"].values()),
            "per_domain": manifest["totals"],
            "seconds": round(seconds, 3),
            "tokens_per_sec": round(manifest["num_tokens"] / max(seconds, 1e-9)),
        }
    return metrics
