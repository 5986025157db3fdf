"""The shards stage: tokenize mixed/{train,val} into binary shard sets.

No token passes through the driver (at a terabyte, 650 GB would go through one NIC).
Two maps on an executor (this machine's process pool or a Ray cluster,
:mod:`lmforge.executor`):

1. encode (a task per row range, planned from the Parquet metadata): the worker reads
   and encodes its rows into a piece (token ids, and per document its token count,
   UTF-8 bytes and domain) and returns the token counts only.
2. write shards (a task per shard): from the counts, in task order, the driver cuts the
   documents into shards exactly as one writer would (:class:`ShardCuts`); each shard's
   task copies its runs of documents out of the pieces into ``shard-NNNNN.{bin,idx}`` and
   returns the shard's manifest entry.

The driver writes the manifest. The bytes do not depend on where or on how many workers
the tasks ran.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmforge.config import ShardsConfig
from lmforge.executor import Executor, LocalExecutor
from lmforge.io import atomic_dir
from lmforge.shards.encode import PieceTask, RowsTask, encode_piece, plan_tasks, read_piece
from lmforge.shards.format import token_dtype
from lmforge.shards.writer import ShardCuts, ShardWriter
from lmforge.tokenizer import Tokenizer
from lmforge.tokenizer.corpus import list_parts, read_domains
from lmforge.tokenizer.files import locate_tokenizer

SPLITS = ("train", "val")
# A shard task writes exactly the documents it is given: no cut of its own.
_NO_CUT = 1 << 62


@dataclass(frozen=True)
class ShardTask:
    """Shard ``index`` of a set in ``out_dir``: runs ``(piece, start, stop, first token,
    end token)`` of documents, in order."""

    out_dir: str
    index: int
    dtype: str
    vocab_size: int
    tokenizer_sha256: str
    domains: tuple[str, ...]
    runs: tuple[tuple[str, int, int, int, int], ...]


def write_shard(task: ShardTask) -> tuple[dict[str, Any], dict[str, dict[str, int]]]:
    """Write one shard from its runs of piece documents; return its manifest entry and
    per-domain totals (runs on a worker)."""
    writer = ShardWriter(task.out_dir, task.vocab_size, task.tokenizer_sha256,
                         list(task.domains), _NO_CUT, first_shard=task.index)
    for piece, *span in task.runs:
        enc = read_piece(piece, task.dtype, *span)
        writer.add(enc.tokens, enc.lengths, enc.nbytes, enc.domains)
    writer.flush()
    return writer.shards[0], writer.totals


def plan_shards(pieces: list[PieceTask], lengths: Any, shard_tokens: int
                ) -> list[list[tuple[str, int, int, int, int]]]:
    """Each shard's runs of piece documents, from the pieces' token counts in order
    (``lengths`` may be a stream: it is read once, and nothing per document is kept)."""
    cuts, shards, runs = ShardCuts(shard_tokens), [], []
    for piece, counts in zip(pieces, lengths, strict=True):
        for cut in cuts.add(counts):
            if cut is None:
                shards.append(runs)
                runs = []
            else:
                runs.append((piece.out, *cut))
    if cuts.open:
        shards.append(runs)
    return shards


def encode_split(tasks: list[RowsTask], executor: Executor, writer: ShardWriter,
                 desc: str | None = None) -> None:
    """Run ``tasks`` on ``executor`` and have shard tasks write ``writer``'s shard set
    from the pieces they encode (kept beside the shards while they are written)."""
    work = writer.out_dir / ".pieces"
    work.mkdir()
    pieces = [PieceTask(t, str(work / f"piece-{i:06d}")) for i, t in enumerate(tasks)]
    plan = plan_shards(pieces, executor.map(encode_piece, pieces, desc), writer.shard_tokens)
    shard_tasks = [ShardTask(str(writer.out_dir), k, writer.dtype.str, writer.vocab_size,
                             writer.tokenizer_sha256, tuple(writer.domain_names), tuple(runs))
                   for k, runs in enumerate(plan)]
    for entry, totals in executor.map(write_shard, shard_tasks,
                                      desc and f"{desc}: write"):
        writer.adopt(entry, totals)
    shutil.rmtree(work)


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
