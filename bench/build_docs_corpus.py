"""A corpus of technical Markdown (API documentation), one section per document, out of git;
then what the `reference` kind keeps of it, per rule.

    python bench/build_docs_corpus.py /tmp/docs_corpus           # build, then measure
    python bench/build_docs_corpus.py /tmp/docs_corpus --measure # measure only

Source: Debian ``nodejs-doc`` 18.20.4+dfsg-1~deb12u3 (MIT, the Node.js API reference as
``/usr/share/doc/nodejs/api/*.md.gz``): every page cut at its ``## `` headings (outside
code fences), the text before the first heading a document of its own. The pages carry
what a documentation corpus is made of: ``<!-- YAML added: ... changes: ... -->`` history
comments, tables, link-reference definitions (``[`util`]: util.md``) and code fences.

Writes OUT/node_api/part-0000.jsonl.gz (the same package gives the same bytes: gzip with
mtime 0), then prints, for the rules of kind ``reference`` at the default thresholds, the
documents kept and the first rule that rejects each of the others, with samples. The
measurement uses whatever ``lmforge`` is on the path, so the same command on an older
checkout (``PYTHONPATH=/tmp/before/src``) gives the "before" figures.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

from build_kinds_corpus import write  # run from bench/: python bench/build_docs_corpus.py

DEB = "nodejs-doc=18.20.4+dfsg-1~deb12u3"
DEB_SHA256 = "d2fbd4f3aecccea9d901a03842ef8380379e0d33010a48af5e797ed68ae874ce"
API_DIR = "usr/share/doc/nodejs/api"
DOMAIN = "node_api"
_FENCE = re.compile(r"^\s*(```|~~~)")


def fetch(work: Path) -> Path:
    """The package unpacked under work/root (downloaded once, checked against its SHA-256)."""
    work.mkdir(parents=True, exist_ok=True)
    debs = sorted(work.glob("nodejs-doc_*.deb"))
    if not debs:
        subprocess.run(["apt-get", "download", "-qq", DEB], cwd=work, check=True)
        debs = sorted(work.glob("nodejs-doc_*.deb"))
    got = hashlib.sha256(debs[0].read_bytes()).hexdigest()
    if got != DEB_SHA256:
        sys.exit(f"error: {debs[0].name}: sha256 {got}, expected {DEB_SHA256}")
    subprocess.run(["dpkg-deb", "-x", str(debs[0]), str(work / "root")], check=True)
    return work / "root" / API_DIR


def sections(markdown: str) -> list[str]:
    """The page cut before each ``## `` heading; a '## ' inside a code fence is code."""
    parts: list[list[str]] = [[]]
    fenced = False
    for line in markdown.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
        if not fenced and line.startswith("## "):
            parts.append([])
        parts[-1].append(line)
    return [t for t in ("\n".join(p).strip() for p in parts) if t]


def build(out: Path) -> Path:
    """Write the corpus; return its file."""
    api = fetch(out / ".work")
    docs = []
    for page in sorted(api.glob("*.md.gz")):
        name = page.name.removesuffix(".md.gz")
        for i, text in enumerate(sections(gzip.decompress(page.read_bytes()).decode("utf-8"))):
            docs.append({"id": f"node/{name}/{i}", "text": text})
    write(out, DOMAIN, docs)  # the kinds corpus's writer: the same gzip bytes, mtime 0
    return out / DOMAIN / "part-0000.jsonl.gz"


def measure(path: Path, kind: str, samples: int) -> None:
    """Kept documents and first-failing rules under ``kind`` at the default thresholds."""
    from lmforge.config import DomainFilterConfig, FilterConfig
    from lmforge.data.filters import domain_rules

    rules = domain_rules(FilterConfig(domains={DOMAIN: DomainFilterConfig(kind=kind)}), DOMAIN)
    with gzip.open(path, "rt", encoding="utf-8") as f:
        docs = [json.loads(line) for line in f]
    first: Counter = Counter()
    shown: dict[str, list[str]] = {}
    for d in docs:
        failure = rules.first_failure(d["text"])
        if failure is None:
            continue
        first[failure[0]] += 1
        shown.setdefault(failure[0], []).append(
            f"    {d['id']} ({failure[1]:.3g}, {len(d['text'])} chars): "
            + d["text"][:150].replace("\n", "⏎"))
    kept = len(docs) - sum(first.values())
    print(f"kind {kind}: {kept} of {len(docs)} kept ({kept / len(docs):.1%})")
    for name, n in first.most_common():
        print(f"  {name}: {n}")
        print("\n".join(shown[name][:samples]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", nargs="?", default="/tmp/docs_corpus", type=Path)
    p.add_argument("--measure", action="store_true", help="measure only (corpus built)")
    p.add_argument("--kind", default="reference")
    p.add_argument("--samples", type=int, default=3, help="rejected samples shown per rule")
    args = p.parse_args()
    path = args.out / DOMAIN / "part-0000.jsonl.gz"
    if not args.measure:
        path = build(args.out)
    measure(path, args.kind, args.samples)


if __name__ == "__main__":
    main()
