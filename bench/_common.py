"""Shared helpers of the data benchmarks: the demo corpus, and a line of figures."""

from __future__ import annotations

import gzip
import json
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "data" / "raw" / "demo"


def demo_docs(domains: tuple[str, ...] | None = None) -> list[tuple[str, str]]:
    """(domain, text) of every demo document, in file order."""
    out = []
    for d in sorted(p for p in DEMO.iterdir() if p.is_dir()):
        if domains and d.name not in domains:
            continue
        for f in sorted(d.glob("*.jsonl.gz")):
            with gzip.open(f, "rt", encoding="utf-8") as fh:
                out.extend((d.name, json.loads(line)["text"]) for line in fh)
    return out


def checkout_src(rev: str, where: Path) -> Path:
    """``src/`` of git revision ``rev``, extracted under ``where`` (its PYTHONPATH)."""
    shutil.rmtree(where, ignore_errors=True)
    where.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "src"],
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(where)], input=archive, check=True)
    return where / "src"
