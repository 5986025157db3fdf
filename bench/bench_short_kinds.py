"""The filter kinds on the text real users have (bench/build_short_corpus.py's corpus).

    python bench/build_short_corpus.py /tmp/short_corpus
    python bench/bench_short_kinds.py /tmp/short_corpus

Ingests the corpus as the ingest stage does (CSV, TSV, JSON arrays, parquet), filters
every domain with its kind only (no per-rule edits), then with kind ``web`` for all as
the baseline a new user meets, and prints per domain: documents in, kept and lost per
kind, the reasons, and, for the code domain, the rejects beside the files' own
``generated`` label. The full filter report (examples with values) is written to
OUT/filter_report.md.
"""

from __future__ import annotations

import dataclasses
import sys
import tempfile
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq

from lmforge.config import DomainFilterConfig, load_params
from lmforge.data.filter_report import render
from lmforge.data.filtering import loss_problems, run_filter
from lmforge.data.ingest import run_ingest


def main(corpus: Path) -> None:
    params = load_params(corpus / "params.yaml")
    work = Path(tempfile.mkdtemp(prefix="short_kinds_"))
    ingest = run_ingest(dataclasses.replace(params.ingest, num_workers=1), work / "ingested")
    print("ingest rejects:", {d: c["rejected"] for d, c in ingest["domains"].items() if c["rejected"]})
    kinds_cfg = dataclasses.replace(params.filter, num_workers=1)
    web_cfg = dataclasses.replace(kinds_cfg, domains={d: DomainFilterConfig(kind="web")
                                                      for d in kinds_cfg.domains})
    examples: dict = {}
    failures: dict = {}
    by_kind = run_filter(kinds_cfg, work / "ingested", work / "kinds", examples, failures=failures)
    by_web = run_filter(web_cfg, work / "ingested", work / "web")
    print("\n| domain | in | kind | kept | lost | top reasons | web: kept | web: top reasons |")
    print("|---|---:|---|---:|---:|---|---:|---|")
    for d, c in by_kind["domains"].items():
        w = by_web["domains"][d]
        print(f"| {d} | {c['in']:,} | {c['kind']} | {c['kept']:,} | {c['loss']:.1%} | "
              f"{_top(c['rejected'])} | {w['kept']:,} ({1 - w['loss']:.1%}) | {_top(w['rejected'])} |")
    print("\nloss guard with kinds only:", loss_problems(kinds_cfg, by_kind) or "passes")
    (corpus / "filter_report.md").write_text(
        render(kinds_cfg, by_kind, examples, loss_problems(kinds_cfg, by_kind, failures)),
        encoding="utf-8")
    code_labels(corpus, work)


def _top(rejected: dict[str, int], n: int = 3) -> str:
    return ", ".join(f"{r} {k:,}" for r, k in Counter(rejected).most_common(n)) or "-"


def code_labels(corpus: Path, work: Path) -> None:
    """The code domain's rejects beside each file's own label (generated or written)."""
    labels = dict(zip(*pq.read_table(corpus / "code" / "files.parquet",
                                     columns=["path", "generated"]).to_pydict().values(), strict=True))
    rejects = pq.read_table(work / "kinds" / "rejects", filters=[("domain", "==", "code")],
                            columns=["id", "rule"]).to_pydict()
    rule_of = dict(zip(rejects["id"], rejects["rule"], strict=True))
    table = Counter((labels[p], rule_of.get(p, "kept")) for p in labels)
    print("\ncode: (labelled generated, verdict) -> files:", dict(sorted(table.items())))
    for p, g in labels.items():
        if not g and rule_of.get(p, "kept").startswith("code_"):
            head = Path(p).read_text(encoding="utf-8", errors="replace")[:300]
            line = next((ln for ln in head.splitlines() if "generated" in ln.lower()), "")
            print(f"  labelled written, rejected {rule_of[p]}: {p}: {line.strip()!r}")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/short_corpus"))
