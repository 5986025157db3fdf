"""The mix stage: per-domain train/val split, then re-weighting of the train split.

1. Split each domain's documents into train and val FIRST, by near-duplicate cluster
   (a cluster never straddles the split), so up-sampling never leaks val text.
2. Pick a train size per domain to hit ``mix.weights`` (shares measured in characters,
   or estimated tokens), repeating a domain at most ``max_epochs`` times or sampling
   a seeded subset of it.
3. Shuffle each split globally (seeded) and write parts in two levels whose tasks'
   memory is bounded: runs of input parts scatter their rows to one file each, ordered
   by output group; each group gathers its rows from those files, orders them and
   writes its parts (``mix_shuffle``).

The driver plans from a few bytes a document: tasks measure the parts
(``mix_measure``) and rank every document's near-duplicate cluster within its domain
(``mix_ranks``), so no id, cluster name or text reaches it.
"""

from __future__ import annotations

import math
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from lmforge.config import MixConfig
from lmforge.data.counts import Counts
from lmforge.data.mix_measure import measure_run, measure_tasks
from lmforge.data.mix_ranks import cluster_ranks
from lmforge.data.mix_shuffle import (
    Groups,
    Placement,
    gather_group,
    gather_tasks,
    place,
    scatter_batch,
    scatter_tasks,
)
from lmforge.data.records import list_parts, read_table
from lmforge.errors import InputError
from lmforge.executor import Executor, LocalExecutor, PartLog, output_settings
from lmforge.io import files_fingerprint, resumable_dir

DOWNSAMPLED = "downsampled"
SPLITS = ("train", "val")


# --------------------------------------------------------------------------- planning


def domain_rng(seed: int, domain: str, purpose: str) -> np.random.Generator:
    """A generator that depends only on the seed, the domain and what it is for."""
    return np.random.default_rng([seed, zlib.crc32(domain.encode()), zlib.crc32(purpose.encode())])


def split_val(doc_idx: np.ndarray, cluster_rank: np.ndarray, chars: np.ndarray,
              cfg: MixConfig, rng: np.random.Generator) -> np.ndarray:
    """A boolean val mask over one domain's documents, taking whole clusters at a time.

    ``cluster_rank``: each document's cluster, as the rank of its name among the
    domain's cluster names, sorted (``mix_ranks``): the clusters are shuffled from that
    order. Val gets at least ``max(min_val_docs, val_fraction * n)`` documents and
    ``min_val_chars`` characters, so every domain's val loss rests on enough text to
    measure, but never more than ``max_val_fraction`` of the documents (a cluster that
    would pass that cap is left in train), and never all of them (train keeps at least
    one cluster).
    """
    n = len(doc_idx)
    want_docs = max(cfg.min_val_docs, math.ceil(cfg.val_fraction * n))
    cap = max(1, math.floor(cfg.max_val_fraction * n))
    ranks = cluster_rank[doc_idx]
    members = np.argsort(ranks, kind="stable")  # positions by cluster, in order within one
    first = np.concatenate([[0], np.cumsum(np.bincount(ranks))]) if n else np.zeros(1, int)
    order = np.arange(len(first) - 1)
    rng.shuffle(order)  # as shuffling the sorted names: the same permutation
    val = np.zeros(n, dtype=bool)
    docs = taken_chars = 0
    for cluster in order[:-1].tolist():  # the last cluster always stays in train
        if docs >= want_docs and taken_chars >= cfg.min_val_chars:
            break
        pos = members[first[cluster]:first[cluster + 1]]
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
    order = np.arange(len(units), dtype=np.int32 if len(units) < 2**31 else np.int64)
    rng.shuffle(order)  # rng.permutation's very order, in 32 bits
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
    got = float(cum[k - 1]) if k else 0.0  # the same float the walk below would reach
    del cum  # the walk's memory: one chunk of Python floats, not the whole domain
    extra: list[int] = []  # taken after the first k
    skipped: list[int] = []
    for pos, u in _walk(units, k):
        if got + u < rest:
            extra.append(pos)
            got += u
            continue
        over, under = got + u - rest, rest - got
        if min(over, under) <= tolerance:
            if over < under:
                extra.append(pos)
            return _positions(k, extra)
        skipped.append(pos)
    if skipped:
        traded = trade_in(units, [*range(k), *extra], skipped, rest, tolerance)
        if traded is not None:
            return traded
        shortest = min(skipped, key=lambda p: units[p])  # the first in the order on ties
        if got + units[shortest] - rest < rest - got:
            extra.append(shortest)
    return _positions(k, extra)


def _walk(units: np.ndarray, start: int, chunk: int = 4096):
    """(position, units as a Python float) from ``start`` on, a chunk at a time: the walk
    mostly ends within a few documents, so the rest is never made into Python floats."""
    for lo in range(start, len(units), chunk):
        yield from enumerate(units[lo:lo + chunk].tolist(), start=lo)


def _positions(k: int, extra: list[int]) -> np.ndarray:
    """The first ``k`` positions and then ``extra``."""
    return np.concatenate([np.arange(k, dtype=np.int64), np.array(extra, dtype=np.int64)])


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


@dataclass
class Docs:
    """Every input document as the plan needs it, in input order: no id, no text."""

    domains: list[str]  # sorted
    codes: np.ndarray  # per document: its domain's index in ``domains``
    chars: np.ndarray
    units: np.ndarray | None  # mixing units; None when they are the characters
    cluster_rank: np.ndarray | None  # per document: its cluster within its domain
    part_docs: list[int]  # documents per input part

    def mix_units(self) -> np.ndarray:
        """Each document's mixing units (float64: every sum is the same float)."""
        return self.units if self.units is not None else self.chars.astype(np.float64)

    def units_at(self, idx: np.ndarray) -> np.ndarray:
        """The mixing units of the documents ``idx`` (the same floats as ``mix_units``)."""
        return self.units[idx] if self.units is not None else self.chars[idx].astype(np.float64)

    def pop_ranks(self) -> np.ndarray:
        """The cluster ranks, let go of here: only the val split needs them."""
        ranks, self.cluster_rank = self.cluster_rank, None
        assert ranks is not None, "the cluster ranks were used already"
        return ranks


def measure_docs(executor: Executor, parts: list[Path], unit: str, in_dir: Path, work: Path,
                 done: Path | None = None) -> Docs:
    """Measure every part and rank every document's cluster, by tasks (``work``: their
    scratch files; ``done``: their completion log, for a rerun after a kill)."""
    tasks = measure_tasks(parts, unit, work)
    measured = list(executor.map(measure_run, tasks, "mix: measure",
                                 PartLog(done / "measure") if done else None))
    sizes = [part for m in measured for part in m.parts]
    run_docs = [sum(len(part.chars) for part in m.parts) for m in measured]
    names = sorted({d for part in sizes for d in part.domains})
    code_of = {d: k for k, d in enumerate(names)}
    part_docs = [len(part.chars) for part in sizes]
    codes = _concat([np.array([code_of[d] for d in part.domains], dtype=np.int16)[part.codes]
                     for part in sizes], np.int16)
    chars = _concat([part.chars for part in sizes], np.int64)
    units = None if unit == "chars" else _concat([part.units for part in sizes], np.float64)
    for part in sizes:  # each part's own arrays go as the whole ones are made
        part.codes = part.chars = part.units = np.zeros(0)
    ranks = cluster_ranks(executor, [(t.keys, m.buckets) for t, m in zip(tasks, measured, strict=True)],
                          [key for m in measured for key in m.samples], in_dir / "clusters.parquet",
                          tasks[0].buckets if tasks else 1, np.cumsum([0, *run_docs]), work, done)
    return Docs(names, codes, chars, units, ranks, part_docs)


def _concat(arrays: list[np.ndarray], dtype: type) -> np.ndarray:
    return np.concatenate(arrays) if arrays else np.zeros(0, dtype)


def ids_at(task: tuple[str, np.ndarray]) -> list[str]:
    """The ids of one part's documents at the given positions (worker)."""
    path, positions = task
    return read_table(path, columns=["id"]).column("id").take(pa.array(positions)).to_pylist()


def val_ids(cfg: MixConfig, in_dir: str | Path, executor: Executor | None = None) -> set[str]:
    """The ids run_mix holds out for val from ``in_dir`` (the same plan; nothing written):
    what is not training text, for the decontamination check."""
    in_dir = Path(in_dir)
    executor = executor or LocalExecutor(cfg.num_workers)
    parts = list_parts(in_dir)
    with tempfile.TemporaryDirectory(prefix=".mix-plan-", dir=in_dir.parent) as work:
        docs = measure_docs(executor, parts, cfg.unit, in_dir, Path(work))
    plan = plan_mix(cfg, docs, in_dir)
    first = np.cumsum([0, *docs.part_docs])
    tasks = [(str(p), np.flatnonzero(plan.is_val[first[k]:first[k + 1]]))
             for k, p in enumerate(parts)]
    return {i for ids in executor.map(ids_at, tasks, "mix: val ids") for i in ids}


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
        docs = measure_docs(executor, parts, cfg.unit, in_dir, tmp / ".plan", done)
        plan = plan_mix(cfg, docs, in_dir)
        write_splits(executor, plan, docs, parts, cfg.part_docs, tmp, done)
    return plan.metrics


def write_splits(executor: Executor, plan: MixPlan, docs: Docs, parts: list[Path],
                 part_docs: int, tmp: Path, done: Path) -> None:
    """Shuffle the planned rows into ``tmp``/{train,val} (``mix_shuffle``)."""
    groups = {s: Groups.of(pl, docs.chars, part_docs) for s, pl in plan.placements.items()}
    first = np.cumsum([0, *docs.part_docs])
    part_chars = np.array([float(docs.chars[a:b].sum())
                           for a, b in zip(first, first[1:], strict=False)])
    scatter = scatter_tasks(plan.placements, groups, parts, docs.part_docs, part_chars,
                            tmp / ".buckets", part_docs)
    held = list(executor.map(scatter_batch, scatter, "mix: scatter", PartLog(done / "scatter")))
    for split, pl in plan.placements.items():
        (tmp / split).mkdir(exist_ok=True)
        gather = gather_tasks(split, groups[split], held, scatter, tmp / split, part_docs)
        written = sum(executor.map(gather_group, gather, f"mix: {split}", PartLog(done / split)))
        assert written == pl.rows, f"{split}: wrote {written} of {pl.rows} rows"


@dataclass
class MixPlan:
    """What the mix decided for every document, before any row is written."""

    by_domain: dict[str, np.ndarray]  # document indices per domain
    is_val: np.ndarray  # bool
    copies: np.ndarray  # train copies (0 for val)
    shortfalls: dict[str, dict[str, float]]
    metrics: dict[str, Any]  # the stage's metrics (metrics/mix.json)
    placements: dict[str, Placement]  # per split: where each row goes


def plan_mix(cfg: MixConfig, docs: Docs, in_dir: Path) -> MixPlan:
    """The val split, each train document's copies, the metrics and the shuffled
    placement of rows; an InputError when a domain has no weight or falls too far short.
    Takes ``docs``' cluster ranks (``Docs.pop_ranks``): the driver's memory at the
    shuffle's planning is what every document costs the plan, so each array goes once
    used."""
    missing = sorted(set(docs.domains) - set(cfg.weights))
    if missing:
        raise InputError(f"{in_dir}: domain(s) {', '.join(missing)} have no mix.weights entry")

    check_weighted_domains(cfg, set(docs.domains), in_dir)

    chars, cluster_rank = docs.chars, docs.pop_ranks()
    n = len(chars)
    is_val = np.zeros(n, dtype=bool)
    copies = np.zeros(n, dtype=np.int32)  # a few epochs at most
    index = np.int32 if n < 2**31 else np.int64
    by_domain = {d: np.flatnonzero(docs.codes == k).astype(index)
                 for k, d in enumerate(docs.domains)}
    for d, idx in by_domain.items():
        is_val[idx] = split_val(idx, cluster_rank, chars, cfg, domain_rng(cfg.seed, d, "split"))
    del cluster_rank
    targets = train_targets({d: float(docs.units_at(idx[~is_val[idx]]).sum())
                             for d, idx in by_domain.items()}, cfg)
    for d, idx in by_domain.items():
        train = idx[~is_val[idx]]
        copies[train] = sample_copies(docs.units_at(train), targets[d],
                                      domain_rng(cfg.seed, d, "sample"))
    units = docs.mix_units()  # whole, for sums over every document (their float order)
    shortfalls = shortfall_of(by_domain, is_val, copies, units, cfg, targets)
    for d, short in shortfalls.items():
        if short["shortfall"] > REPORT_SHORTFALL:  # said in the metrics and the stage output
            short["why"] = shortfall_reason(d, short, cfg, shortfalls)
    too_short = {d: s for d, s in shortfalls.items() if s["shortfall"] > cfg.max_shortfall}
    if too_short:
        raise InputError("\nerror: ".join(
            f"{shortfall_line(d, s, cfg)}, above mix.max_shortfall {cfg.max_shortfall}: "
            f"{shortfall_remedies(d, s, cfg, shortfalls)}" for d, s in sorted(too_short.items())))

    metrics = _metrics(by_domain, is_val, copies, chars, units, targets, cfg)
    del units
    for d, short in shortfalls.items():
        metrics["domains"][d]["shortfall"] = short["shortfall"]
    # Domains short of their asked share by more than REPORT_SHORTFALL: asked vs got.
    metrics["shortfalls"] = {d: s for d, s in sorted(shortfalls.items())
                             if s["shortfall"] > REPORT_SHORTFALL}
    placements = {
        "train": place(copies, np.random.default_rng([cfg.seed, 0])),
        "val": place(is_val.astype(np.int8), np.random.default_rng([cfg.seed, 1])),
    }
    return MixPlan(by_domain, is_val, copies, shortfalls, metrics, placements)


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
