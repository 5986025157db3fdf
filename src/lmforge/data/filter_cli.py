"""``lmforge filter report``: the filter report for a sample of the raw sources, in
seconds, before any stage has run and without writing filtered data."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa

from lmforge.config import IngestConfig, load_params
from lmforge.data import formats, readers
from lmforge.data.filter_report import render
from lmforge.data.filtering import domain_metrics, guarded_domains, judge_table, loss_problems
from lmforge.data.ingest import id_and_source, resolve_files


def sample_table(cfg: IngestConfig, per_domain: int) -> pa.Table:
    """The first ``per_domain`` readable documents of each domain, read as ingest reads."""
    rows: dict[str, list[Any]] = {"id": [], "text": [], "domain": [], "source": []}
    taken: dict[str, int] = {}
    for i, path in resolve_files(cfg.sources):
        src = cfg.sources[i]
        if taken.get(src.domain, 0) >= per_domain:
            continue
        for rec in formats.iter_records(path, src.format, src.text_field, src.id_field,
                                        src.txt_split, cfg.max_record_bytes):
            if not isinstance(rec, readers.Doc):
                continue
            doc_id, source = id_and_source(rec, path)
            rows["id"].append(doc_id)
            rows["text"].append(rec.text)
            rows["domain"].append(src.domain)
            rows["source"].append(source)
            taken[src.domain] = taken.get(src.domain, 0) + 1
            if taken[src.domain] >= per_domain:
                break
    return pa.table(rows, schema=pa.schema([(k, pa.string()) for k in rows]))


def filter_report(params_path: str, per_domain: int) -> str:
    """The markdown report for a sample of every domain."""
    params = load_params(params_path)
    table = sample_table(params.ingest, per_domain)
    failures: dict = {}
    languages: dict = {}
    *_, counts, redacted, examples = judge_table(table, params.filter, failures, languages)
    metrics = domain_metrics(params.filter, counts, redacted, failures, languages)
    samples = {d: [t for t, dd in zip(table.column("text").to_pylist(),
                                      table.column("domain").to_pylist(), strict=True) if dd == d]
               for d in guarded_domains(params.filter, metrics)}
    problems = loss_problems(params.filter, metrics, failures, samples)
    return render(params.filter, metrics, examples, problems,
                  title=f"Filter report (sample: the first {per_domain:,} documents per domain)")


def cmd_report(args: argparse.Namespace) -> None:
    text = filter_report(args.params, args.sample)
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")
        print(f"filter report: {args.out}")
    else:
        sys.stdout.write(text)


def add_filter_parser(sub: Any) -> None:
    p = sub.add_parser("filter", help="the filter rules on your data")
    fsub = p.add_subparsers(dest="filter_command", required=True)
    r = fsub.add_parser("report", help="what the rules reject per domain, on a sample "
                        "of the raw sources (nothing written but --out)")
    r.add_argument("--sample", type=int, default=200, help="documents per domain (200)")
    r.add_argument("--params", default="params.yaml")
    r.add_argument("--out", default=None, help="write the markdown here (default: stdout)")
    r.set_defaults(func=cmd_report)
