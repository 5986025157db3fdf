"""The filter stage: apply the quality rules to every part, in parallel.

Part ``i`` of the input becomes part ``i`` of the output (possibly with fewer rows),
and its rejected documents go to ``rejects/part-i`` with the rule that fired.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from lmforge.config import FilterConfig
from lmforge.data.counts import Counts
from lmforge.data.filters import DomainRules, domain_rules
from lmforge.data.records import list_parts, read_table, write_table
from lmforge.io import atomic_dir
from lmforge.parallel import imap_ordered

REJECTS_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("domain", pa.string()),
        ("source", pa.string()),
        ("rule", pa.string()),
        ("value", pa.float64()),
        ("text", pa.string()),
    ]
)


@dataclass(frozen=True)
class PartTask:
    src: str
    out: str
    rejects_out: str
    cfg: FilterConfig


def filter_part(task: PartTask) -> Counts:
    """Filter one part; write the kept rows and the rejects; return the counts (worker)."""
    table = read_table(task.src)
    rules: dict[str, DomainRules] = {}
    counts = Counts()
    keep: list[bool] = []
    rejected: dict[str, list[Any]] = {name: [] for name in REJECTS_SCHEMA.names}
    cols = table.select(["id", "text", "domain", "source"]).to_pydict()
    for rid, text, domain, source in zip(cols["id"], cols["text"], cols["domain"], cols["source"], strict=True):
        if domain not in rules:
            rules[domain] = domain_rules(task.cfg, domain)
        c = counts[domain]
        c.n_in += 1
        failure = rules[domain].first_failure(text)
        keep.append(failure is None)
        if failure is None:
            c.kept += 1
            continue
        c.rejected[failure[0]] += 1
        for name, value in zip(REJECTS_SCHEMA.names, (rid, domain, source, failure[0],
                                                      float(failure[1]), text), strict=True):
            rejected[name].append(value)
    write_table(table.filter(pa.array(keep, pa.bool_())), task.out)
    write_table(pa.table(rejected, schema=REJECTS_SCHEMA), task.rejects_out)
    return counts


def run_filter(cfg: FilterConfig, in_dir: str | Path, out_dir: str | Path) -> dict[str, Any]:
    """Filter ``in_dir``/part-* into ``out_dir``; return per-domain metrics."""
    parts = list_parts(in_dir)
    counts = Counts()
    with atomic_dir(out_dir) as tmp:
        (tmp / "rejects").mkdir()
        tasks = [PartTask(str(p), str(tmp / p.name), str(tmp / "rejects" / p.name), cfg)
                 for p in parts]
        for part_counts in imap_ordered(filter_part, tasks, cfg.num_workers, desc="filter"):
            counts.merge(part_counts)
    metrics = counts.as_dict()
    metrics["parts"] = len(parts)
    return metrics
