"""Mix's first pass: what the plan needs of every document, without its id or text.

A task per run of input parts measures each document (domain, characters, mixing
units) and writes the run's key file for the cluster ranks (``mix_ranks``); the driver
gets a few bytes a document, and ids only as a sample for the ranks' splitters.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from lmforge.data.mix_ranks import MAX_BUCKETS, ROW_BITS, SAMPLES_PER_RANGE, write_keys
from lmforge.data.mix_shuffle import MIN_SHUFFLE_TASKS, cut_runs
from lmforge.data.records import read_table

_CJK = re.compile("[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff]")
# Parquet bytes a measuring task reads at most (about 0.7 GB of text).
RUN_BYTES = 1 << 28


def estimate_tokens(text: str) -> float:
    """A tokenizer-free token estimate: one per CJK character, one per 4 other characters."""
    cjk = len(_CJK.findall(text))
    return cjk + (len(text) - cjk) / 4


@dataclass
class PartSizes:
    """One part's documents as the plan needs them: domain (an index into ``domains``,
    the part's own names), characters and mixing units."""

    domains: list[str]
    codes: np.ndarray
    chars: np.ndarray
    units: np.ndarray | None  # None when they are the characters


def measure_table(table: pa.Table, unit: str) -> PartSizes:
    """Domains, characters and mixing units of one table's documents."""
    chars = pc.utf8_length(table.column("text")).to_numpy().astype(np.int64)
    if unit == "chars":
        units = None  # the characters themselves
    else:
        units = np.array([estimate_tokens(t) for t in table.column("text").to_pylist()],
                         dtype=np.float64)
    encoded = pc.dictionary_encode(table.column("domain")).combine_chunks()
    return PartSizes(encoded.dictionary.to_pylist(),
                     encoded.indices.to_numpy(zero_copy_only=False).astype(np.int16),
                     chars, units)


def measure_part(args: tuple[str, str]) -> PartSizes:
    """One part's sizes (worker)."""
    path, unit = args
    return measure_table(read_table(path, columns=["domain", "text"]), unit)


@dataclass(frozen=True)
class MeasureTask:
    srcs: list[str]
    unit: str
    run: int  # the task's number: its documents' keys are (run << ROW_BITS) + row
    buckets: int
    keys: str  # the key file it writes
    samples: int


@dataclass
class Measured:
    """One run's parts' sizes, the buckets its key file holds and its sampled keys."""

    parts: list[PartSizes]
    buckets: list[int]
    samples: list[str]


def measure_run(task: MeasureTask) -> Measured:
    """Measure a run of parts and write its key file (worker)."""
    tables = [read_table(src, columns=["id", "domain", "text"]) for src in task.srcs]
    parts = [measure_table(t, task.unit) for t in tables]
    ids = pa.concat_arrays([t.column("id").combine_chunks() for t in tables]) \
        if tables else pa.array([], pa.string())
    domains = pa.concat_arrays([t.column("domain").combine_chunks() for t in tables]) \
        if tables else pa.array([], pa.string())
    held, samples = write_keys(ids, domains, task.run << ROW_BITS, task.buckets, task.keys,
                               task.samples)
    return Measured(parts, held, samples)


def measure_tasks(parts: list[Path], unit: str, work: Path) -> list[MeasureTask]:
    """Runs of parts of up to RUN_BYTES on disk, at least MIN_SHUFFLE_TASKS of them where
    there are parts enough; as many hash buckets (at most MAX_BUCKETS) as runs."""
    sizes = np.array([p.stat().st_size for p in parts], dtype=np.float64)
    runs = cut_runs(sizes, RUN_BYTES, MIN_SHUFFLE_TASKS)
    buckets = max(1, min(MAX_BUCKETS, len(runs)))
    samples = -(-SAMPLES_PER_RANGE * buckets // max(1, len(runs)))
    return [MeasureTask([str(p) for p in parts[lo:hi]], unit, k, buckets,
                        str(work / f"keys-{k:05d}.parquet"), samples)
            for k, (lo, hi) in enumerate(runs)]
