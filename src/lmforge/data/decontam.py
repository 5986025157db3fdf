"""Decontamination: which evaluation items also sit in the training text.

The 13-gram method of GPT-3 (Brown et al. 2020, appendix C) as NeMo Curator runs it:
text is lowercased and split into words (a CJK character is a word, as the filter
counts them; punctuation is dropped); each string of an evaluation item (question,
answer, choice, turn) gives its 13-word windows, or itself whole when it has fewer
than 13 words but at least ``min_ngram`` (8); a string written in CJK characters alone (a
poem line, a short answer) is one n-gram from ``min_cjk_chars`` (5) characters, since a
character is a word here and a five-character line is as particular as eight English
words. An item with no such string is too short to tell. An item is contaminated when
one of its n-grams occurs in a training document; an n-gram found in more than ``max_matches``
documents is a common phrase (a licence line, a proverb) and is not counted. With
``remove``, the documents holding a counted n-gram are dropped (counted per domain);
otherwise the text passes unchanged and the report says what overlaps.
"""

from __future__ import annotations

import functools
import gzip
import json
import pickle
import re
import shutil
import tempfile
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from lmforge.config import DecontamConfig
from lmforge.data.records import list_parts, read_table, write_table
from lmforge.data.textview import CJK_RANGES
from lmforge.errors import InputError
from lmforge.executor import Executor, LocalExecutor, PartLog, output_settings
from lmforge.io import files_fingerprint, resumable_dir

_TOKEN = re.compile(rf"[{CJK_RANGES}]|[^\W_{CJK_RANGES}]+")
_CJK = re.compile(rf"[{CJK_RANGES}]")
# Examples kept per evaluation set in the report, and characters shown of each.
EXAMPLES = 5
SNIPPET = 160
_EVAL_SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".json.gz")


def words(text: str) -> list[str]:
    """Lowercased words; each CJK character is one."""
    return _TOKEN.findall(text.lower())


@dataclass(frozen=True)
class Item:
    """One evaluation item: its set, where it is (file:line), its strings (question,
    answer, choices, each turn), each checked on its own."""

    set: str
    where: str
    strings: tuple[str, ...]

    @property
    def text(self) -> str:
        return "\n".join(self.strings)


def _strings(value: Any) -> list[str]:
    """Every string inside a JSON value (prompts, answers, choices, messages)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []


def _eval_files(path: Path) -> list[Path]:
    if path.is_dir():
        return sorted(p for p in path.rglob("*") if p.name.endswith(_EVAL_SUFFIXES))
    if path.is_file():
        return [path]
    raise InputError(f"{path}: no such evaluation set (file or folder)")


def read_items(name: str, path: str | Path) -> list[Item]:
    """The items of an evaluation set: every record of every JSON / JSON-lines file under
    ``path`` (an lm-eval task folder, a test split), its strings joined."""
    items = []
    for f in _eval_files(Path(path)):
        raw = (gzip.decompress(f.read_bytes()) if f.name.endswith(".gz") else f.read_bytes())
        text = raw.decode("utf-8-sig")
        if f.name.endswith((".json", ".json.gz")) and text.lstrip().startswith("["):
            records = [(i + 1, r) for i, r in enumerate(json.loads(text))]
        else:
            records = []
            for lineno, line in enumerate(text.splitlines(), start=1):
                if line.strip():
                    try:
                        records.append((lineno, json.loads(line)))
                    except json.JSONDecodeError as e:
                        raise InputError(f"{f}:{lineno}: evaluation record is not JSON ({e.msg})") from None
        items += [Item(name, f"{f}:{n}", tuple(_strings(r))) for n, r in records]
    return items


def ngrams(text: str, n: int, min_n: int, min_cjk: int | None = None) -> set[tuple[str, ...]]:
    """One string's n-grams: empty when it is shorter than ``min_n`` words, unless it is
    CJK characters alone and at least ``min_cjk`` of them."""
    w = words(text)
    if len(w) < min_n:
        cjk = min_cjk is not None and len(w) >= min_cjk and all(_CJK.fullmatch(c) for c in w)
        return {tuple(w)} if cjk else set()
    if len(w) < n:
        return {tuple(w)}
    return {tuple(w[i:i + n]) for i in range(len(w) - n + 1)}


def item_ngrams(item: Item, n: int, min_n: int, min_cjk: int | None = None
                ) -> set[tuple[str, ...]]:
    """An item's n-grams: those of each of its strings (an answer of one word adds none)."""
    return {g for s in item.strings for g in ngrams(s, n, min_n, min_cjk)}


@dataclass
class NgramIndex:
    """The evaluation n-grams, with what a scan needs to look them up cheaply."""

    items: dict[tuple[str, ...], list[int]] = field(default_factory=dict)  # n-gram -> items
    firsts: set[str] = field(default_factory=set)
    lengths: set[int] = field(default_factory=set)

    def add(self, gram: tuple[str, ...], item: int) -> None:
        self.items.setdefault(gram, []).append(item)
        self.firsts.add(gram[0])
        self.lengths.add(len(gram))

    def find(self, text: str) -> set[tuple[str, ...]]:
        """The evaluation n-grams that occur in ``text``."""
        w = words(text)
        found = set()
        lengths = sorted(self.lengths)
        for i, first in enumerate(w):
            if first in self.firsts:
                for n in lengths:
                    gram = tuple(w[i:i + n])
                    if gram in self.items:
                        found.add(gram)
        return found


def build_index(items: list[Item], cfg: DecontamConfig) -> tuple[NgramIndex, list[bool]]:
    """The index of every item's n-grams, and which items were long enough to check."""
    index = NgramIndex()
    checked = []
    for k, item in enumerate(items):
        grams = item_ngrams(item, cfg.ngram, cfg.min_ngram, cfg.min_cjk_chars)
        checked.append(bool(grams))
        for g in grams:
            index.add(g, k)
    return index, checked


@dataclass(frozen=True)
class ScanTask:
    src: str
    index: str  # the pickled NgramIndex: written once, read once per worker process


@functools.lru_cache(maxsize=2)
def load_index(path: str) -> NgramIndex:
    """The index a scan task reads (cached: a worker's later tasks reuse it)."""
    return pickle.loads(Path(path).read_bytes())


def scan_part(task: ScanTask) -> list[tuple[str, str, list[tuple[str, ...]]]]:
    """(id, domain, n-grams found) of each document of one part that holds any (worker)."""
    cols = read_table(task.src).select(["id", "text", "domain"]).to_pydict()
    index = load_index(task.index)
    out = []
    for rid, text, domain in zip(cols["id"], cols["text"], cols["domain"], strict=True):
        found = index.find(text)
        if found:
            out.append((rid, domain, sorted(found)))
    return out


def run_decontam(cfg: DecontamConfig, sets: dict[str, str], in_dir: str | Path,
                 out_dir: str | Path, executor: Executor | None = None,
                 held_out: set[str] | frozenset[str] = frozenset()) -> dict[str, Any]:
    """Check every evaluation set in ``sets`` (name -> file or folder) against the
    documents of ``in_dir``; write its parts to ``out_dir`` (less the matching documents
    when ``cfg.remove``); return the metrics (per set and per domain, with examples).

    Documents in ``held_out`` (mix's val split) are no training text: an item found only
    there is counted apart (``in_val_only``), not as contamination; ``remove`` drops
    them too (a held-out copy of an evaluation item helps no one, and a removal can move
    the val split)."""
    executor = executor or LocalExecutor(cfg.num_workers)
    cfg = output_settings(cfg)
    items = [it for name, path in sets.items() for it in read_items(name, path)]
    index, checked = build_index(items, cfg)
    parts = list_parts(in_dir)
    per_part: list[list[tuple[str, str, list[tuple[str, ...]]]]] = []
    with tempfile.TemporaryDirectory(prefix=".decontam-", dir=Path(out_dir).parent) as work:
        path = Path(work) / "index.pkl"  # on shared storage, beside the output, for Ray
        path.write_bytes(pickle.dumps(index, protocol=5))
        tasks = [ScanTask(str(p), str(path)) for p in parts]
        per_part.extend(executor.map(scan_part, tasks, "decontam"))
    matches = [m for found in per_part for m in found]
    docs_of: Counter = Counter(g for _, _, grams in matches for g in grams)
    common = {g for g, n in docs_of.items() if n > cfg.max_matches}
    dirty = {rid: (domain, [g for g in grams if g not in common])
             for rid, domain, grams in matches if any(g not in common for g in grams)}
    metrics = _metrics(cfg, sets, items, checked, index, dirty, common, held_out)
    removed = set(dirty) if cfg.remove else set()
    found_ids = [[rid for rid, _, _ in found if rid in dirty] for found in per_part]
    metrics["domains"] = _write_parts(parts, out_dir, removed, cfg, found_ids, held_out,
                                      executor)
    return metrics


def _metrics(cfg: DecontamConfig, sets: dict[str, str], items: list[Item], checked: list[bool],
             index: NgramIndex, dirty: dict[str, tuple[str, list]], common: set,
             held_out: set[str] | frozenset[str]) -> dict[str, Any]:
    """Per set: items, checked, contaminated (share of checked), examples with the
    training document and the shared words; items found in held-out documents only."""
    hits: dict[int, tuple[str, str, tuple[str, ...]]] = {}
    val_hits: set[int] = set()
    for rid, (domain, grams) in sorted(dirty.items()):
        for g in grams:
            for k in index.items[g]:
                if rid in held_out:
                    val_hits.add(k)
                else:
                    hits.setdefault(k, (rid, domain, g))
    by_set: dict[str, Any] = {}
    for name in sets:
        ks = [k for k, it in enumerate(items) if it.set == name]
        n_checked = sum(checked[k] for k in ks)
        dirty_ks = [k for k in ks if k in hits]
        domains = Counter(hits[k][1] for k in dirty_ks)
        by_set[name] = {
            "path": sets[name], "items": len(ks), "checked": n_checked,
            "too_short": len(ks) - n_checked, "contaminated": len(dirty_ks),
            "in_val_only": sum(k in val_hits and k not in hits for k in ks),
            "contaminated_share": round(len(dirty_ks) / n_checked, 4) if n_checked else 0.0,
            "by_domain": dict(sorted(domains.items())),
            "examples": [{"item": items[k].where, "text": _snip(items[k].text),
                          "train_id": hits[k][0], "domain": hits[k][1],
                          "shared": " ".join(hits[k][2])} for k in dirty_ks[:EXAMPLES]]}
    return {"ngram": cfg.ngram, "min_ngram": cfg.min_ngram, "min_cjk_chars": cfg.min_cjk_chars,
            "max_matches": cfg.max_matches,
            "remove": cfg.remove, "common_ngrams_ignored": len(common), "sets": by_set}


def _snip(text: str) -> str:
    one = " ".join(text.split())
    return one[:SNIPPET] + ("…" if len(one) > SNIPPET else "")


@dataclass(frozen=True)
class CopyTask:
    src: str
    out: str
    dirty: tuple[str, ...]  # this part's documents holding a counted n-gram, sorted
    held: tuple[str, ...]  # ... of which in mix's val split (sorted: a stable digest)
    remove: bool


def copy_part(task: CopyTask) -> dict[str, Counter]:
    """Copy one part without its removed documents (the same bytes when none is);
    per domain: documents in, kept, matched in training text, matched in val (worker)."""
    table = read_table(task.src)
    ids, domains = (table.column(c).to_pylist() for c in ("id", "domain"))
    dirty, held = set(task.dirty), set(task.held)
    keep = [not (task.remove and rid in dirty) for rid in ids]
    counts: dict[str, Counter] = defaultdict(Counter)
    for rid, domain, k in zip(ids, domains, keep, strict=True):
        counts[domain]["in"] += 1
        counts[domain]["kept"] += k
        counts[domain]["matched"] += rid in dirty and rid not in held
        counts[domain]["matched_val"] += rid in held
    if all(keep):
        shutil.copyfile(task.src, task.out)  # the same bytes: nothing downstream changes
    else:
        write_table(table.filter(pa.array(keep)), task.out)
    return dict(counts)


def _write_parts(parts: list[Path], out_dir: str | Path, removed: set[str],
                 cfg: DecontamConfig, dirty: list[list[str]],
                 held_out: set[str] | frozenset[str], executor: Executor) -> dict[str, Any]:
    """Copy the parts to ``out_dir`` (without the ``removed`` ids), a task a part
    (``dirty``: each part's matched documents); per-domain counts."""
    counts: dict[str, Counter] = defaultdict(Counter)
    with resumable_dir(out_dir, files_fingerprint(parts, "decontam", cfg, sorted(removed))) as tmp:
        tasks = [CopyTask(str(p), str(tmp / p.name), tuple(sorted(ids)),
                          tuple(sorted(i for i in ids if i in held_out)), bool(removed))
                 for p, ids in zip(parts, dirty, strict=True)]
        for part_counts in executor.map(copy_part, tasks, "decontam: write",
                                        PartLog(tmp / ".done" / "write")):
            for domain, c in part_counts.items():
                counts[domain].update(c)
        clusters = parts[0].parent / "clusters.parquet" if parts else None
        if clusters is not None and clusters.is_file():  # dedup's: mix splits val by cluster
            shutil.copyfile(clusters, tmp / clusters.name)
    return {d: {"in": c["in"], "kept": c["kept"], "matched": c["matched"],
                "matched_val": c["matched_val"],
                "rejected": {"eval_overlap": c["in"] - c["kept"]} if c["in"] > c["kept"] else {}}
            for d, c in sorted(counts.items())}


def render(metrics: dict[str, Any]) -> str:
    """The report as markdown: per set, then per domain, with examples."""
    m = metrics
    lines = ["# Decontamination report", "",
             f"Evaluation items checked for {m['ngram']}-gram overlap with the training text "
             f"(items of {m['min_ngram']}-{m['ngram'] - 1} words: the whole item; CJK "
             f"characters alone: the whole item from {m['min_cjk_chars']}; "
             f"shorter: too short to tell; an n-gram in more than {m['max_matches']} documents "
             f"is common and not counted: {m['common_ngrams_ignored']:,} such). Overlapping documents "
             f"{'removed' if m['remove'] else 'kept (decontam.remove: false)'}.", "",
             "Contaminated: found in a training document; mix's val split is held out, so an "
             "item found only there is counted apart.", "",
             "| set | items | checked | contaminated | share | in domains | in val only |",
             "|---|---:|---:|---:|---:|---|---:|"]
    for name, s in m["sets"].items():
        where = ", ".join(f"{d} {n}" for d, n in s["by_domain"].items()) or "-"
        lines.append(f"| {name} | {s['items']:,} | {s['checked']:,} | {s['contaminated']:,} | "
                     f"{s['contaminated_share']:.1%} | {where} | {s['in_val_only']:,} |")
    lines += ["", "| domain | documents | training documents holding an evaluation n-gram | "
              "val documents holding one | removed |", "|---|---:|---:|---:|---:|"]
    for d, c in m["domains"].items():
        lines.append(f"| {d} | {c['in']:,} | {c['matched']:,} | {c['matched_val']:,} | "
                     f"{c['in'] - c['kept']:,} |")
    for name, s in m["sets"].items():
        if s["examples"]:
            lines += ["", f"## {name}", ""]
            lines += [f"- `{e['item']}` in `{e['train_id']}` ({e['domain']}): shared "
                      f"\"{e['shared']}\"; item: {e['text']}" for e in s["examples"]]
    return "\n".join(lines) + "\n"
