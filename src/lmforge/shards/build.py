"""The shards stage: tokenize mixed/{train,val} into binary shard sets.

The driver plans row ranges from the Parquet metadata and writes the shards; the
encoding, reading included, runs as tasks on an executor (this machine's process pool
or a Ray cluster, :mod:`lmforge.executor`), whose results come back in task order: the
same bytes wherever and on how many workers they ran.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from lmforge.config import ShardsConfig
from lmforge.executor import Executor, LocalExecutor
from lmforge.io import atomic_dir
from lmforge.shards.encode import RowsTask, encode_rows, plan_tasks
from lmforge.shards.format import token_dtype
from lmforge.shards.writer import ShardWriter
from lmforge.tokenizer import Tokenizer
from lmforge.tokenizer.corpus import list_parts, read_domains
from lmforge.tokenizer.files import locate_tokenizer

SPLITS = ("train", "val")


def encode_split(tasks: list[RowsTask], executor: Executor, writer: ShardWriter,
                 desc: str | None = None) -> None:
    """Run ``tasks`` on ``executor`` and write their documents, in task order."""
    for enc in executor.map(encode_rows, tasks, desc):
        writer.add(enc.tokens, enc.lengths, enc.nbytes, enc.domains)


def build_shards(mixed_dir: str | Path, tokenizer_path: str | Path, out_dir: str | Path,
                 cfg: ShardsConfig, executor: Executor | None = None) -> dict[str, Any]:
    """Write ``out_dir/{train,val}`` shard sets from ``mixed_dir``; return stage metrics.

    ``tokenizer_path`` is a tokenizer file or a folder holding one (``models/tokenizer``).

    The encoding runs on ``executor`` (default: the local pool of ``cfg.num_workers``)."""
    executor = executor or LocalExecutor(cfg.num_workers)
    tok = Tokenizer.load(tokenizer_path)
    metrics: dict[str, Any] = {"tokenizer_sha256": tok.sha256, "vocab_size": tok.vocab_size}
    extra = {"bos": cfg.bos, "eos": cfg.eos, "bos_id": tok.bos_id, "eos_id": tok.eos_id,
             "pad_id": tok.pad_id}
    parts = {split: list_parts(Path(mixed_dir) / split) for split in SPLITS}
    # One domain-code table for both splits, so codes mean the same thing everywhere.
    domain_names = read_domains(parts["train"] + parts["val"])
    metrics["domains"] = domain_names
    for split in SPLITS:
        start = time.perf_counter()
        tasks = plan_tasks(parts[split], locate_tokenizer(tokenizer_path), tok.sha256, cfg.bos, cfg.eos,
                           token_dtype(tok.vocab_size), domain_names, executor.workers)
        with atomic_dir(Path(out_dir) / split) as tmp:
            writer = ShardWriter(tmp, tok.vocab_size, tok.sha256, domain_names,
                                 cfg.shard_tokens)
            encode_split(tasks, executor, writer, f"shards: {split}")
            manifest = writer.close(extra)
        metrics[split] = _split_metrics(parts[split], manifest, time.perf_counter() - start)
    metrics["num_workers"] = executor.workers
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
