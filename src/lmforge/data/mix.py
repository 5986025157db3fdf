"""The mix stage: per-domain train/val split, then re-weighting of the train split.

1. Split each domain's documents into train and val FIRST, by near-duplicate cluster
   (a cluster never straddles the split), so up-sampling never leaks val text.
2. Pick a train size per domain to hit ``mix.weights`` (shares measured in characters,
   or estimated tokens), repeating a domain at most ``max_epochs`` times or sampling
   a seeded subset of it.
3. Shuffle each split globally (seeded) and write parts in two levels whose tasks'
   memory is bounded: runs of input parts scatter their rows to one file each, ordered
   by output group; each group gathers its rows from those files, orders them and
   writes its parts (see "writing" below).
"""

from __future__ import annotations

import math
import re
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from lmforge.config import MixConfig
from lmforge.data.counts import Counts
from lmforge.data.records import (
    COMPRESSION,
    list_parts,
    part_name,
    read_table,
    repeat_id,
    write_table,
)
from lmforge.errors import InputError
from lmforge.executor import Executor, LocalExecutor, PartLog, output_settings
from lmforge.io import atomic_path, files_fingerprint, resumable_dir

DOWNSAMPLED = "downsampled"
SPLITS = ("train", "val")
_CJK = re.compile("[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff]")


# --------------------------------------------------------------------------- pass 1


@dataclass
class PartSizes:
    ids: list[str]
    domains: list[str]
    chars: np.ndarray
    units: np.ndarray


def estimate_tokens(text: str) -> float:
    """A tokenizer-free token estimate: one per CJK character, one per 4 other characters."""
    cjk = len(_CJK.findall(text))
    return cjk + (len(text) - cjk) / 4


def measure_part(args: tuple[str, str]) -> PartSizes:
    """Ids, domains, characters and mixing units of one part's documents (worker)."""
    path, unit = args
    table = read_table(path, columns=["id", "domain", "text"])
    chars = pc.utf8_length(table.column("text")).to_numpy().astype(np.int64)
    if unit == "chars":
        units = chars.astype(np.float64)
    else:
        units = np.array([estimate_tokens(t) for t in table.column("text").to_pylist()],
                         dtype=np.float64)
    return PartSizes(table.column("id").to_pylist(), table.column("domain").to_pylist(),
                     chars, units)


# --------------------------------------------------------------------------- planning


def domain_rng(seed: int, domain: str, purpose: str) -> np.random.Generator:
    """A generator that depends only on the seed, the domain and what it is for."""
    return np.random.default_rng([seed, zlib.crc32(domain.encode()), zlib.crc32(purpose.encode())])


def split_val(doc_idx: np.ndarray, clusters: list[str], chars: np.ndarray, cfg: MixConfig,
              rng: np.random.Generator) -> np.ndarray:
    """A boolean val mask over one domain's documents, taking whole clusters at a time.

    Val gets at least ``max(min_val_docs, val_fraction * n)`` documents and
    ``min_val_chars`` characters, so every domain's val loss rests on enough text to
    measure, but never more than ``max_val_fraction`` of the documents (a cluster that
    would pass that cap is left in train), and never all of them (train keeps at least
    one cluster).
    """
    n = len(doc_idx)
    want_docs = max(cfg.min_val_docs, math.ceil(cfg.val_fraction * n))
    cap = max(1, math.floor(cfg.max_val_fraction * n))
    members: dict[str, list[int]] = {}
    for pos, i in enumerate(doc_idx):
        members.setdefault(clusters[i], []).append(pos)
    order = sorted(members)
    rng.shuffle(order)
    val = np.zeros(n, dtype=bool)
    docs = taken_chars = 0
    for cluster in order[:-1]:  # the last cluster always stays in train
        if docs >= want_docs and taken_chars >= cfg.min_val_chars:
            break
        pos = members[cluster]
        if docs + len(pos) > cap:
            continue
        val[pos] = True
        docs += len(pos)
        taken_chars += int(chars[doc_idx[pos]].sum())
    return val


def train_targets(train_units: dict[str, float], cfg: MixConfig) -> dict[str, float]:
    """Units of train data per domain: ``weights`` scaled to ``total`` or the epoch cap."""
    weights = {d: cfg.weights.get(d, 0.0) for d in train_units}
    live = {d: w for d, w in weights.items() if w > 0 and train_units[d] > 0}
    norm = sum(live.values())
    if not live:
        return dict.fromkeys(train_units, 0.0)
    if cfg.total is not None:
        total = float(cfg.total)
    else:  # as large as possible while no domain repeats more than max_epochs
        total = min(cfg.max_epochs * train_units[d] * norm / w for d, w in live.items())
    return {d: min(total * live[d] / norm, cfg.max_epochs * train_units[d]) if d in live else 0.0
            for d in train_units}


def sample_copies(units: np.ndarray, target: float, rng: np.random.Generator) -> np.ndarray:
    """Copies of each document so their units add up to ``target``: whole epochs first,
    then a seeded random subset for the fractional epoch (``fill_gap``)."""
    total = units.sum()
    copies = np.zeros(len(units), dtype=np.int64)
    if total <= 0 or target <= 0:
        return copies
    full = int(target // total)
    copies += full
    rest = target - full * total
    order = rng.permutation(len(units))
    # A miss too small to report as a shortfall ends the walk where it always ended, so a
    # domain of short documents (every demo domain) keeps the very same sample.
    copies[order[fill_gap(units[order], rest, REPORT_SHORTFALL * target)]] += 1
    return copies


def fill_gap(units: np.ndarray, rest: float, tolerance: float) -> np.ndarray:
    """Positions, in the seeded order ``units`` come in, of the documents that fill ``rest``.

    Documents are taken in order while they fit. At the first that would reach past the
    gap, the walk stops if taking it or not lands within ``tolerance`` of ``rest``
    (taking it when that is nearer): a domain of short documents is sampled as it
    always was. Otherwise that document is too long for the gap: it is skipped and the
    walk goes on, so one huge document cannot end the sample wherever it falls in the
    order. If the gap is still open at the end, a skipped document is traded in for
    documents already taken (``trade_in``), or else the shortest skipped one is added
    when that lands nearer ``rest`` than the gap does.
    """
    cum = np.cumsum(units)
    k = int(np.searchsorted(cum, rest))  # units[:k] fit: the vectorised common case
    taken = list(range(k))
    got = float(cum[k - 1]) if k else 0.0  # the same float the walk below would reach
    skipped: list[int] = []
    for pos, u in enumerate(units[k:].tolist(), start=k):
        if got + u < rest:
            taken.append(pos)
            got += u
            continue
        over, under = got + u - rest, rest - got
        if min(over, under) <= tolerance:
            if over < under:
                taken.append(pos)
            return np.array(taken, dtype=np.int64)
        skipped.append(pos)
    if skipped:
        traded = trade_in(units, taken, skipped, rest, tolerance)
        if traded is not None:
            return traded
        shortest = min(skipped, key=lambda p: units[p])  # the first in the order on ties
        if got + units[shortest] - rest < rest - got:
            taken.append(shortest)
    return np.array(taken, dtype=np.int64)


def trade_in(units: np.ndarray, taken: list[int], skipped: list[int], rest: float,
             tolerance: float) -> np.ndarray | None:
    """The walk's sample with one long skipped document in it, made room for by giving
    back documents taken last, or None when no such trade lands within ``tolerance``.

    Every document short of the gap was taken and the gap is still open: the long
    documents were skipped only for where they fell in the order. Adding one overshoots by
    more than the gap, so the documents taken last are given back, latest first, each
    only if that brings the sample nearer ``rest`` and keeps it above ``rest -
    tolerance``. The first skipped document (in the seeded order) whose trade lands within
    ``tolerance`` is kept: a domain whose one huge file holds half its text still gets its
    share, holding that file or not as the seed says.
    """
    for long_pos in skipped:
        if units[long_pos] > rest + tolerance:
            continue  # longer than the whole gap: no trade can hold it
        kept, got = list(taken), float(units[taken].sum()) + float(units[long_pos])
        for i in range(len(kept) - 1, -1, -1):
            if got <= rest:
                break
            less = got - float(units[kept[i]])
            if less >= rest - tolerance and abs(less - rest) < got - rest:
                got = less
                kept.pop(i)
        if abs(got - rest) <= tolerance:
            return np.array(sorted([*kept, long_pos]), dtype=np.int64)
    return None


@dataclass(frozen=True)
class Placement:
    """Where each output row comes from (global doc index, repeat), in the shuffled order
    of its split: row ``r`` goes to output part ``r // part_docs``, row ``r % part_docs``."""

    doc: np.ndarray
    repeat: np.ndarray


def place(copies: np.ndarray, rng: np.random.Generator) -> Placement:
    """Expand copies into rows and shuffle them globally."""
    doc = np.repeat(np.arange(len(copies)), copies)
    repeat = np.concatenate([np.arange(c) for c in copies]) if len(copies) else doc
    perm = rng.permutation(len(doc))
    return Placement(doc[perm], repeat[perm].astype(np.int64))


# --------------------------------------------------------------------------- writing
#
# The shuffle in two levels, each task bounded by SHUFFLE_CHARS: a scatter task reads a
# run of input parts and writes, per split, ONE file of its rows ordered by output group
# (a row group per group); a gather task reads its group's row group from every scatter
# file, orders the rows by their shuffled rank and writes the group's output parts.
# Intermediate files: one per scatter task and split, so O(input chars / SHUFFLE_CHARS),
# where one file per (input part, output part) pair grew with documents (~10^8 at 1 TB).

# Characters of text a scatter task reads or a gather task holds, at most (about 1 GB of
# ASCII text in memory): at 1 TB, ~1,000 scatter files and ~1,000 groups a split.
SHUFFLE_CHARS = 1 << 30
# Tasks a level at least, where there are parts enough: small inputs still use the cores.
MIN_SHUFFLE_TASKS = 16


def cut_runs(sizes: np.ndarray, budget: float, min_runs: int) -> list[tuple[int, int]]:
    """Consecutive runs ``[lo, hi)`` of items, each run's sizes summing to at most
    ``budget`` and to at most a ``min_runs``-th of the whole (one item alone may pass):
    so there are at least ``min(min_runs, len(sizes))`` runs when the items allow."""
    limit = min(budget, float(sizes.sum()) / max(1, min_runs))
    runs, lo, held = [], 0, 0.0
    for i, size in enumerate(sizes.tolist()):
        if i > lo and held + size > limit:
            runs.append((lo, i))
            lo, held = i, 0.0
        held += size
    if len(sizes):
        runs.append((lo, len(sizes)))
    return runs


@dataclass(frozen=True)
class Groups:
    """One split's output parts cut into gather groups: part ``k`` is in group
    ``of_part[k]``, group ``g`` holds parts ``[first_part[g], first_part[g + 1])``."""

    first_part: np.ndarray
    of_part: np.ndarray

    @classmethod
    def of(cls, pl: Placement, chars: np.ndarray, part_docs: int) -> Groups:
        """Groups of consecutive output parts by the characters their rows hold."""
        n_parts = -(-len(pl.doc) // part_docs)
        part_chars = np.add.reduceat(chars[pl.doc], np.arange(0, len(pl.doc), part_docs)) \
            if len(pl.doc) else np.zeros(0)
        runs = cut_runs(part_chars, SHUFFLE_CHARS, MIN_SHUFFLE_TASKS)
        first = np.array([lo for lo, _ in runs] + [n_parts], dtype=np.int64)
        return cls(first, np.repeat(np.arange(len(runs)), np.diff(first)))


@dataclass(frozen=True)
class Rows:
    """The rows of a split one scatter task provides: source document, repeat, rank in
    the shuffled split and output group."""

    doc: np.ndarray
    repeat: np.ndarray
    rank: np.ndarray
    group: np.ndarray


@dataclass(frozen=True)
class ScatterTask:
    srcs: list[str]
    first_doc: int  # global index of the first document of srcs[0]
    rows: dict[str, Rows]  # per split
    paths: dict[str, str]  # per split: the one file this task writes


def scatter_batch(task: ScatterTask) -> dict[str, list[int]]:
    """Write this run of input parts' rows of each split to one file, a row group per
    output group in group order; return the groups each file holds, in that order."""
    table = pa.concat_tables(read_table(src) for src in task.srcs)
    held: dict[str, list[int]] = {}
    for split, mine in task.rows.items():
        if not len(mine.doc):
            held[split] = []
            continue
        order = np.argsort(mine.group, kind="stable")
        rows = table.take(pa.array(mine.doc[order] - task.first_doc))
        ids = [repeat_id(rid, int(r))
               for rid, r in zip(rows.column("id").to_pylist(), mine.repeat[order], strict=True)]
        rows = rows.set_column(rows.schema.get_field_index("id"), "id", pa.array(ids))
        rows = rows.append_column("_rank", pa.array(mine.rank[order]))
        groups, starts = np.unique(mine.group[order], return_index=True)
        bounds = [*starts.tolist(), len(order)]
        with atomic_path(task.paths[split]) as tmp, \
                pq.ParquetWriter(tmp, rows.schema, compression=COMPRESSION) as writer:
            for lo, hi in zip(bounds, bounds[1:], strict=False):
                writer.write_table(rows.slice(lo, hi - lo), row_group_size=hi - lo)
        held[split] = groups.tolist()
    return held


@dataclass(frozen=True)
class GatherTask:
    pieces: list[tuple[str, int]]  # (scatter file, row group) holding this group's rows
    first_rank: int  # rank of the group's first row
    outs: list[str]  # the group's output parts, in order
    part_docs: int


def gather_group(task: GatherTask) -> int:
    """Order one group's rows by their shuffled rank and write its output parts."""
    table = pa.concat_tables(pq.ParquetFile(path).read_row_group(rg) for path, rg in task.pieces)
    table = table.take(pc.sort_indices(table.column("_rank")))
    ranks = table.column("_rank").to_numpy()
    expected = np.arange(task.first_rank, task.first_rank + len(ranks))
    assert np.array_equal(ranks, expected), f"{task.outs[0]}: the group's rows are not whole"
    table = table.drop_columns(["_rank"])
    for k, out in enumerate(task.outs):
        write_table(table.slice(k * task.part_docs, task.part_docs), out)
    return table.num_rows


def scatter_tasks(plan: MixPlan, parts: list[Path], sizes: list[PartSizes], bucket_dir: Path,
                  groups: dict[str, Groups], part_docs: int) -> list[ScatterTask]:
    """One task per run of input parts holding up to SHUFFLE_CHARS characters."""
    offsets = np.cumsum([0] + [len(s.ids) for s in sizes])
    in_chars = np.array([float(s.chars.sum()) for s in sizes])
    tasks = []
    for b, (lo, hi) in enumerate(cut_runs(in_chars, SHUFFLE_CHARS, MIN_SHUFFLE_TASKS)):
        rows = {}
        for split, pl in plan.placements.items():
            rank = np.flatnonzero((pl.doc >= offsets[lo]) & (pl.doc < offsets[hi]))
            rows[split] = Rows(pl.doc[rank], pl.repeat[rank], rank,
                               groups[split].of_part[rank // part_docs])
        tasks.append(ScatterTask([str(p) for p in parts[lo:hi]], int(offsets[lo]), rows,
                                 {s: str(bucket_dir / s / part_name(b)) for s in rows}))
    return tasks


def gather_tasks(split: str, groups: Groups, held: list[dict[str, list[int]]],
                 scatter: list[ScatterTask], out_dir: Path, part_docs: int) -> list[GatherTask]:
    """One task per group: the row group it has in each scatter file, the parts it writes."""
    pieces: list[list[tuple[str, int]]] = [[] for _ in range(len(groups.first_part) - 1)]
    for task, has in zip(scatter, held, strict=True):
        for rg, g in enumerate(has[split]):
            pieces[g].append((task.paths[split], rg))
    bounds = groups.first_part.tolist()
    return [GatherTask(pieces[g], lo * part_docs,
                       [str(out_dir / part_name(k)) for k in range(lo, hi)], part_docs)
            for g, (lo, hi) in enumerate(zip(bounds, bounds[1:], strict=False))]


def read_clusters(path: Path, ids: list[str]) -> list[str]:
    """The dedup cluster of every document (its own id when it is in no cluster table)."""
    if not path.is_file():
        return list(ids)
    table = read_table(path, columns=["id", "cluster"])
    cluster_of = dict(zip(table.column("id").to_pylist(), table.column("cluster").to_pylist(), strict=True))
    return [cluster_of.get(i, i) for i in ids]


def val_ids(cfg: MixConfig, in_dir: str | Path, executor: Executor | None = None) -> set[str]:
    """The ids run_mix holds out for val from ``in_dir`` (the same plan; nothing written):
    what is not training text, for the decontamination check."""
    in_dir = Path(in_dir)
    executor = executor or LocalExecutor(cfg.num_workers)
    sizes = list(executor.map(measure_part, [(str(p), cfg.unit) for p in list_parts(in_dir)],
                              "mix: measure"))
    plan = plan_mix(cfg, in_dir, sizes)
    ids = [i for s in sizes for i in s.ids]
    return {ids[k] for k in np.flatnonzero(plan.is_val)}


def run_mix(cfg: MixConfig, in_dir: str | Path, out_dir: str | Path,
            executor: Executor | None = None) -> dict[str, Any]:
    """Split, re-weight and shuffle ``in_dir`` into ``out_dir``/{train,val}; return metrics.

    Per-part work runs on ``executor`` (default: the local pool); a rerun after a kill
    skips what was done."""
    in_dir = Path(in_dir)
    executor = executor or LocalExecutor(cfg.num_workers)
    cfg = output_settings(cfg)
    parts = list_parts(in_dir)
    inputs = [*parts, in_dir / "clusters.parquet"] if (in_dir / "clusters.parquet").is_file() else parts
    with resumable_dir(out_dir, files_fingerprint(inputs, "mix", cfg)) as tmp:
        done = tmp / ".done"
        sizes = list(executor.map(measure_part, [(str(p), cfg.unit) for p in parts],
                                  "mix: measure", PartLog(done / "measure")))
        plan = plan_mix(cfg, in_dir, sizes)
        groups = {s: Groups.of(pl, plan.chars, cfg.part_docs) for s, pl in plan.placements.items()}
        scatter = scatter_tasks(plan, parts, sizes, tmp / ".buckets", groups, cfg.part_docs)
        held = list(executor.map(scatter_batch, scatter, "mix: scatter", PartLog(done / "scatter")))
        for split, pl in plan.placements.items():
            (tmp / split).mkdir(exist_ok=True)
            gather = gather_tasks(split, groups[split], held, scatter, tmp / split,
                                  cfg.part_docs)
            written = sum(executor.map(gather_group, gather, f"mix: {split}",
                                       PartLog(done / split)))
            assert written == len(pl.doc), f"{split}: wrote {written} of {len(pl.doc)} rows"

    metrics = _metrics(plan.by_domain, plan.is_val, plan.copies, plan.chars, plan.units,
                       plan.targets, cfg)
    for d, short in plan.shortfalls.items():
        metrics["domains"][d]["shortfall"] = short["shortfall"]
    # Domains short of their asked share by more than REPORT_SHORTFALL: asked vs got.
    metrics["shortfalls"] = {d: s for d, s in sorted(plan.shortfalls.items())
                             if s["shortfall"] > REPORT_SHORTFALL}
    return metrics


@dataclass
class MixPlan:
    """What the mix decided for every document, before any row is written."""

    by_domain: dict[str, np.ndarray]  # document indices per domain
    is_val: np.ndarray  # bool
    copies: np.ndarray  # int64 train copies (0 for val)
    chars: np.ndarray
    units: np.ndarray
    targets: dict[str, float]  # train units asked per domain
    shortfalls: dict[str, dict[str, float]]
    placements: dict[str, Placement]  # per split: where each row goes


def plan_mix(cfg: MixConfig, in_dir: Path, sizes: list[PartSizes]) -> MixPlan:
    """The val split, each train document's copies and the shuffled placement of rows;
    an InputError when a domain has no weight or falls too far short."""
    ids = [i for s in sizes for i in s.ids]
    domains = np.array([d for s in sizes for d in s.domains], dtype=object)
    chars = np.concatenate([s.chars for s in sizes])
    units = np.concatenate([s.units for s in sizes])
    clusters = read_clusters(in_dir / "clusters.parquet", ids)
    missing = sorted(set(domains.tolist()) - set(cfg.weights))
    if missing:
        raise InputError(f"{in_dir}: domain(s) {', '.join(missing)} have no mix.weights entry")

    check_weighted_domains(cfg, set(domains.tolist()), in_dir)

    n = len(ids)
    is_val = np.zeros(n, dtype=bool)
    copies = np.zeros(n, dtype=np.int64)
    by_domain = {d: np.flatnonzero(domains == d) for d in sorted(set(domains.tolist()))}
    for d, idx in by_domain.items():
        is_val[idx] = split_val(idx, clusters, chars, cfg, domain_rng(cfg.seed, d, "split"))
    targets = train_targets({d: float(units[idx[~is_val[idx]]].sum())
                             for d, idx in by_domain.items()}, cfg)
    for d, idx in by_domain.items():
        train = idx[~is_val[idx]]
        copies[train] = sample_copies(units[train], targets[d], domain_rng(cfg.seed, d, "sample"))
    shortfalls = shortfall_of(by_domain, is_val, copies, units, cfg, targets)
    for d, short in shortfalls.items():
        if short["shortfall"] > REPORT_SHORTFALL:  # said in the metrics and the stage output
            short["why"] = shortfall_reason(d, short, cfg, shortfalls)
    too_short = {d: s for d, s in shortfalls.items() if s["shortfall"] > cfg.max_shortfall}
    if too_short:
        raise InputError("\nerror: ".join(
            f"{shortfall_line(d, s, cfg)}, above mix.max_shortfall {cfg.max_shortfall}: "
            f"{shortfall_remedies(d, s, cfg, shortfalls)}" for d, s in sorted(too_short.items())))

    placements = {
        "train": place(copies, np.random.default_rng([cfg.seed, 0])),
        "val": place(is_val.astype(np.int64), np.random.default_rng([cfg.seed, 1])),
    }
    return MixPlan(by_domain, is_val, copies, chars, units, targets, shortfalls, placements)


# A shortfall above this (relative) is reported; above mix.max_shortfall it is an error.
REPORT_SHORTFALL = 0.01


def check_weighted_domains(cfg: MixConfig, present: set[str], where: str | Path) -> None:
    """A domain with a weight must have documents: never renormalise over the others."""
    total = sum(cfg.weights.values())
    empty = [(d, w) for d, w in sorted(cfg.weights.items()) if w > 0 and d not in present]
    if empty:
        raise InputError("\nerror: ".join(
            f"mix: {d} has weight {w} ({w / total:.0%} of the train split) but no documents "
            f"in {where} (see metrics/filter.json and metrics/dedup.json); give it documents "
            f"or set mix.weights.{d}: 0" for d, w in empty))


def shortfall_of(by_domain: dict[str, np.ndarray], is_val: np.ndarray, copies: np.ndarray,
                 units: np.ndarray, cfg: MixConfig,
                 targets: dict[str, float] | None = None) -> dict[str, dict[str, float]]:
    """Per domain: the share of the train split asked (weights) and got, the relative
    shortfall, the epochs used (a domain capped at max_epochs falls short), and the
    units it was to take (``target``) and took (``taken``): a domain that took all it
    was to take falls short only because others took more than theirs."""
    train_units = {d: float((units[idx] * copies[idx] * ~is_val[idx]).sum())
                   for d, idx in by_domain.items()}
    unique = {d: float(units[idx[~is_val[idx]]].sum()) for d, idx in by_domain.items()}
    total = sum(train_units.values())
    weight_sum = sum(cfg.weights.get(d, 0.0) for d in by_domain)
    out = {}
    for d in by_domain:
        asked = cfg.weights.get(d, 0.0) / weight_sum if weight_sum else 0.0
        got = train_units[d] / total if total else 0.0
        out[d] = {"asked": round(asked, 6), "got": round(got, 6),
                  "shortfall": round(max(0.0, 1 - got / asked), 4) if asked else 0.0,
                  "epochs": round(train_units[d] / unique[d], 4) if unique[d] else 0.0}
        if targets is not None:
            out[d].update(target=round(targets.get(d, 0.0)), taken=round(train_units[d]))
    return out


def shortfall_line(domain: str, s: dict[str, Any], cfg: MixConfig) -> str:
    """``mix: d: asked 15.0% of the train split, got 11.2% (25% short; 2.0 epochs, why)``."""
    why = s.get("why") or shortfall_reason(domain, s, cfg, {})
    return (f"mix: {domain}: asked {s['asked']:.1%} of the train split, got {s['got']:.1%} "
            f"({s['shortfall']:.0%} short; {s['epochs']:g} epochs, {why})")


def shortfall_cause(s: dict[str, float], cfg: MixConfig) -> str:
    """``epochs`` (at its epoch cap), ``coarse`` (it took less than it was to take: its
    documents left out are each longer than the gap) or ``grew`` (it took what it was
    to take, but other domains took more than theirs)."""
    if s["epochs"] >= cfg.max_epochs - 1e-6:
        return "epochs"
    target, taken = s.get("target"), s.get("taken")
    return "coarse" if target is None or taken < target * (1 - REPORT_SHORTFALL) else "grew"


def _overshooting(domain: str, others: dict[str, dict[str, float]]) -> list[tuple[str, dict]]:
    """The other domains that took more than their shares, the largest overshoot first."""
    return sorted(((d, o) for d, o in others.items() if d != domain
                   and o["got"] > o["asked"] * (1 + REPORT_SHORTFALL)),
                  key=lambda kv: kv[1]["asked"] - kv[1]["got"])


def shortfall_reason(domain: str, s: dict[str, float], cfg: MixConfig,
                     others: dict[str, dict[str, float]]) -> str:
    """Why a domain fell short: its epoch cap, its own coarse documents, or the others
    taking more than their shares (then the split grew around it)."""
    unit, cause = cfg.unit, shortfall_cause(s, cfg)
    if cause == "epochs":
        return f"it is at mix.max_epochs {cfg.max_epochs:g}"
    target, taken = s.get("target"), s.get("taken")
    if cause == "coarse":
        got = f": it took {taken:,} of the {target:,} {unit} asked" if target else ""
        return f"its documents are too few and too long to sample finely{got}"
    grew = ", ".join(f"{d} took {o['got']:.1%} for {o['asked']:.1%} asked"
                     for d, o in _overshooting(domain, others))
    return (f"it took all {taken:,} {unit} asked, but the train split grew around it"
            + (f" ({grew}: a domain of few long documents overshoots its share)" if grew else ""))


def shortfall_remedies(domain: str, s: dict[str, float], cfg: MixConfig,
                       others: dict[str, dict[str, float]]) -> str:
    """The changes that would close the shortfall, for its cause only: more epochs or a
    smaller ask lift an epoch cap, but no weight or cap helps a domain whose documents
    are too long to sample finely, nor one that others crowd out with theirs."""
    cause = shortfall_cause(s, cfg)
    if cause == "epochs":
        fixes = ["raise mix.max_epochs", f"lower mix.weights.{domain}"
                 + (" or mix.total" if cfg.total is not None else "")]
    elif cause == "coarse":
        fixes = [f"give {domain} more or shorter documents"]
    else:
        over = [d for d, _ in _overshooting(domain, others)]
        fixes = [f"give {', '.join(over)} more or shorter documents"] if over else []
    fixes.append(f"accept it with mix.max_shortfall: {math.ceil(s['shortfall'] * 20) / 20}")
    return ", or ".join(fixes) if len(fixes) < 3 else f"{', '.join(fixes[:-1])}, or {fixes[-1]}"


def _metrics(by_domain: dict[str, np.ndarray], is_val: np.ndarray, copies: np.ndarray,
             chars: np.ndarray, units: np.ndarray, targets: dict[str, float],
             cfg: MixConfig) -> dict[str, Any]:
    counts = Counts()
    total_train = float((units * copies).sum())
    weight_sum = sum(cfg.weights.get(d, 0.0) for d in by_domain)
    shares: dict[str, Any] = {}
    for d, idx in by_domain.items():
        c = counts[d]
        c.n_in = len(idx)
        used = is_val[idx] | (copies[idx] > 0)
        c.kept = int(used.sum())
        if (~used).any():
            c.rejected[DOWNSAMPLED] = int((~used).sum())
        train = idx[~is_val[idx]]
        val = idx[is_val[idx]]
        domain_train = float((units[train] * copies[train]).sum())
        shares[d] = {
            "target_share": round(cfg.weights.get(d, 0.0) / weight_sum, 6) if weight_sum else 0.0,
            "achieved_share": round(domain_train / total_train, 6) if total_train else 0.0,
            "epochs": round(domain_train / units[train].sum(), 4) if units[train].sum() else 0.0,
            "train_docs": int(copies[train].sum()),
            "train_unique_docs": int((copies[train] > 0).sum()),
            "train_chars": int((chars[train] * copies[train]).sum()),
            "val_docs": len(val),
            "val_chars": int(chars[val].sum()),
            # Held back by max_val_fraction (a small domain): its val figures are rough.
            "val_below_minimum": bool(len(val) < cfg.min_val_docs
                                      or chars[val].sum() < cfg.min_val_chars),
        }
    metrics = counts.as_dict()
    for d, extra in shares.items():
        metrics["domains"][d].update(extra)
    metrics.update(unit=cfg.unit, train_units=round(total_train, 1),
                   train_docs=int(copies.sum()), val_docs=int(is_val.sum()))
    return metrics
