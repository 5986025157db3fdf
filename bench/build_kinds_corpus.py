"""A three-domain corpus for the filter kinds (not the demo's sources), out of git.

    python bench/build_kinds_corpus.py /tmp/kinds_corpus

Sources: Debian `manpages-zh` (Chinese man pages, roff reduced to text), Debian
`golang-github-spf13-cobra-dev` (Go source) and the `songci` (Song ci, one poem per
document) part of npm `chinese-poetry` 2.0.1 (the demo takes Tang poems, grouped).
Needs apt-get, dpkg-deb and npm. Writes OUT/<domain>/part-0000.jsonl.gz.
"""

from __future__ import annotations

import gzip
import json
import re
import subprocess
import sys
import tarfile
from pathlib import Path

_FONT = re.compile(r"\\f[BIRPV1-4]|\\f\(..|\\s[+-]?\d")


def roff_to_text(src: str) -> str:
    out = []
    for line in src.splitlines():
        if line.startswith(('.\\"', "'\\\"")) or line.strip() in (".", "'"):
            continue
        if line.startswith("."):
            macro, _, rest = line[1:].partition(" ")
            if macro in ("SH", "SS", "B", "I", "BI", "BR", "IR", "RB", "RI", "IP", "TH"):
                line = rest.replace('"', "")
            else:
                out.append("")
                continue
        line = _FONT.sub("", line).replace("\\-", "-").replace("\\e", "\\").replace("\\ ", " ")
        out.append(line.rstrip())
    return re.sub(r"\n{3,}", "\n\n", "\n".join(out)).strip()


def write(out: Path, domain: str, docs: list[dict]) -> None:
    path = out / domain / "part-0000.jsonl.gz"
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps(d, ensure_ascii=False) + "\n")
    print(f"{domain}: {len(docs)} documents")


def main(out: Path) -> None:
    work = out / ".work"
    (work / "root").mkdir(parents=True, exist_ok=True)
    subprocess.run(["apt-get", "download", "-qq", "manpages-zh=1.6.4.0-1",
                    "golang-github-spf13-cobra-dev=1.6.1-1"], cwd=work, check=True)
    for deb in work.glob("*.deb"):
        subprocess.run(["dpkg-deb", "-x", str(deb), str(work / "root")], check=True)
    subprocess.run(["npm", "pack", "chinese-poetry@2.0.1", "--silent"], cwd=work, check=True)
    man = []
    for p in sorted((work / "root/usr/share/man/zh_CN").rglob("*")):
        if p.is_file() and not p.is_symlink():
            raw = gzip.decompress(p.read_bytes()) if p.suffix == ".gz" else p.read_bytes()
            text = roff_to_text(raw.decode("utf-8", errors="replace"))
            if text:
                man.append({"id": f"man/{p.name}", "text": text})
    write(out, "zh_man", man)
    go = [{"id": f"go/{p.relative_to(work / 'root')}", "text": p.read_text(encoding="utf-8")}
          for p in sorted((work / "root/usr/share/gocode").rglob("*.go"))]
    write(out, "code_go", go)
    with tarfile.open(next(work.glob("chinese-poetry-*.tgz"))) as tar:
        data = json.load(tar.extractfile("package/dist/songci/ci.song.0.json"))
    ci = [{"id": f"ci/{i}", "text": "\n".join([d["rhythmic"], d["author"], *d["paragraphs"]])}
          for i, d in enumerate(data[:300])]
    write(out, "zh_ci", ci)


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/kinds_corpus"))
