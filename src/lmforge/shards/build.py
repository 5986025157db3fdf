"""The shards stage: tokenize mixed/{train,val} into binary shard sets."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from lmforge.config import ShardsConfig
from lmforge.io import atomic_dir
from lmforge.shards.encode import ChunkEncoder, iter_chunks
from lmforge.shards.writer import ShardWriter
from lmforge.tokenizer import Tokenizer
from lmforge.tokenizer.corpus import list_parts, read_domains

SPLITS = ("train", "val")


def encode_split(parts: list[Path], encoder: ChunkEncoder, writer: ShardWriter,
                 domain_codes: dict[str, int]) -> None:
    """Encode every document of ``parts`` (in order) into ``writer``."""
    for enc in encoder.map(iter_chunks(parts, domain_codes)):
        writer.add(enc.tokens, enc.lengths, enc.nbytes, enc.domains)


def build_shards(mixed_dir: str | Path, tokenizer_path: str | Path, out_dir: str | Path,
                 cfg: ShardsConfig) -> dict[str, Any]:
    """Write ``out_dir/{train,val}`` shard sets from ``mixed_dir``; return stage metrics."""
    tok = Tokenizer.load(tokenizer_path)
    metrics: dict[str, Any] = {"tokenizer_sha256": tok.sha256, "vocab_size": tok.vocab_size}
    extra = {"bos": cfg.bos, "eos": cfg.eos, "bos_id": tok.bos_id, "eos_id": tok.eos_id,
             "pad_id": tok.pad_id}
    # The encoder's workers start before this process reads any Parquet (see encode.py).
    with ChunkEncoder(tok, cfg.num_workers, cfg.bos, cfg.eos) as encoder:
        parts = {split: list_parts(Path(mixed_dir) / split) for split in SPLITS}
        # One domain-code table for both splits, so codes mean the same thing everywhere.
        domain_names = read_domains(parts["train"] + parts["val"])
        codes = {name: code for code, name in enumerate(domain_names)}
        metrics["domains"] = domain_names
        for split in SPLITS:
            start = time.perf_counter()
            with atomic_dir(Path(out_dir) / split) as tmp:
                writer = ShardWriter(tmp, tok.vocab_size, tok.sha256, domain_names,
                                     cfg.shard_tokens)
                encode_split(parts[split], encoder, writer, codes)
                manifest = writer.close(extra)
            metrics[split] = _split_metrics(parts[split], manifest,
                                            time.perf_counter() - start)
    metrics["num_workers"] = encoder.workers
    return metrics


def _split_metrics(parts: list[Path], manifest: dict[str, Any],
                   seconds: float) -> dict[str, Any]:
    return {
        "parts": len(parts),
        "shards": len(manifest["shards"]),
        "dtype": manifest["dtype"],
        "docs": manifest["num_docs"],
        "tokens": manifest["num_tokens"],
        "bytes": sum(t["bytes"] for t in manifest["totals"].values()),
        "per_domain": manifest["totals"],
        "seconds": round(seconds, 3),
        "tokens_per_sec": round(manifest["num_tokens"] / max(seconds, 1e-9)),
    }
