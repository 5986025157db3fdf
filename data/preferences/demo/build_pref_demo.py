"""Build the demo preference (DPO) set from the demo instruction set.

Input: ``data/instructions/demo/{train,test}.jsonl.gz`` (see that directory's
PROVENANCE.md). Output: ``train.jsonl.gz`` and ``test.jsonl.gz`` in ``--out`` (default:
this directory), one preference pair per input record, in input order, in TRL's
conversational shape plus provenance fields::

    {"prompt": [{"role": "user", "content": ...}],
     "chosen": [{"role": "assistant", "content": <the record's assistant answer>}],
     "rejected": [{"role": "assistant", "content": <a plausible wrong answer>}],
     "task": ..., "source_id": ..., "lang": ...,
     "rejected_kind": "truncated" | "repeated" | "corrupted" | "related"}

Rejected answers are of four kinds, drawn per record in the shares of ``KIND_WEIGHTS``
(a record whose kind cannot apply gets a related answer):

- ``truncated``: the answer cut off before its end (``cut_short``).
- ``repeated``: the answer with its end repeated in a loop (``repeat_tail``).

- ``related``: the answer of another record of the same task and language and split
  (another word's antonym, another poem's line, another function's signature, ...),
  preferring one close to the record: same part of speech (WordNet), same line length
  (poems), same module (Python).
- ``corrupted``: the record's own answer minimally edited: one or two characters of a
  poem line replaced by characters of other lines, or two of its characters swapped
  (length kept); a parameter of a signature dropped or renamed to another signature's
  parameter name; a content word of a definition / summary / example replaced by a
  content word of another record, or the text cut off inside a clause (an example
  sentence instead gets the asked word itself replaced by another record's asked word of
  the same part of speech, so that it no longer uses the word; a cut-off example could
  still use it well).
  Single-word tasks (wn_synonym, wn_antonym, poem_author) only get ``related``.

A record whose answer cannot be corrupted (a single word, a signature without
parameters, a two-word definition without content words) falls back to ``related``. A rejected
answer never equals (after strip, ignoring case) the chosen answer or any of the
record's accepted ``answers``; the builder asserts that, and that no test prompt is a
train prompt. Test pairs draw related answers and replacement words from the test split
only, so the test set does not depend on train.

Deterministic: every random choice comes from ``random.Random`` seeded with a string
(``random.seed`` hashes strings with SHA-512, unlike the per-process salted ``hash()``),
one generator per split and task; records keep their input order; the gzip header has
no name and mtime 0. Standard library only, offline::

    python data/preferences/demo/build_pref_demo.py [--out DIR] [--seed N]
"""

from __future__ import annotations

import argparse
import ast
import gzip
import io
import json
import math
import random
import re
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCE = HERE.parent.parent / "instructions" / "demo"
SPLITS = ("train", "test")
DEFAULT_SEED = 0

# Tasks whose answer can be minimally edited; the others are single words or names.
POEM_LINE_TASKS = frozenset({"poem_next_line", "poem_first_line"})
TEXT_TASKS = frozenset({"wn_define", "wn_example", "py_summary"})
CORRUPTIBLE = POEM_LINE_TASKS | TEXT_TASKS | {"py_signature"}

WORD = re.compile(r"(?<!\w)[A-Za-z]+(?!\w)")  # a word, not part of an identifier
HEADWORD = re.compile(r'"(.+?)"')  # the asked word in a WordNet prompt
ARTICLE = re.compile(r"\b(an?) $", re.I)  # an indefinite article before a replaced word
STOPWORD_TEXT = """
    a an the and or but nor so yet of in on at to for from by with without into onto
    over under about above below after before between through during against among
    as than that this these those there here which who whom whose what when where why
    how is are was were be been being am do does did done have has had having not no
    it its it's he she they them their his her him we us our you your i me my one ones
    all any some each every such other another more most less least very too also just
    only then thus if else while whether can could will would shall should may might
    must return returns given specified value object true false none
"""
STOPWORDS = frozenset(STOPWORD_TEXT.split())


@dataclass(frozen=True)
class Record:
    """One instruction record: its prompt, chosen answer and accepted answers."""

    prompt: str
    chosen: str
    task: str
    source_id: str
    lang: str
    answers: tuple[str, ...]

    @property
    def headword(self) -> str:
        """The asked word of a WordNet prompt ("" for other tasks)."""
        m = HEADWORD.search(self.prompt) if self.task.startswith("wn_") else None
        return m.group(1) if m else ""

    @property
    def group(self) -> str:
        """What a related answer should share: POS, line length or module."""
        if self.source_id.startswith("wordnet:"):
            return self.source_id.split(":")[1]
        if self.task in POEM_LINE_TASKS:
            return str(len(self.chosen))
        if self.source_id.startswith("python:"):
            return self.source_id.rsplit(".", 1)[0]
        return ""

    def accepts(self, text: str) -> bool:
        """Whether text is the chosen answer or an accepted one (strip, casefold)."""
        key = text.strip().casefold()
        return key == self.chosen.strip().casefold() or any(
            key == a.strip().casefold() for a in self.answers)


def read_records(path: Path) -> list[Record]:
    """Read an instruction set file (user + assistant turn per line)."""
    out = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            user, assistant = r["messages"]
            assert user["role"] == "user" and assistant["role"] == "assistant", r
            out.append(Record(prompt=user["content"], chosen=assistant["content"],
                              task=r["task"], source_id=r["source_id"], lang=r["lang"],
                              answers=tuple(r["answers"])))
    return out


def uses_word(text: str, word: str) -> bool:
    """Whether text contains word as a whole word (the instruction set's own test)."""
    return bool(word) and re.search(rf"\b{re.escape(word)}\b", text, re.I) is not None


def match_case(word: str, like: str) -> str:
    """word capitalised as like is (acronyms such as "RFC" are kept as they are)."""
    if like[:1].isupper():
        return word[:1].upper() + word[1:]
    return word[:1].lower() + word[1:] if word[1:].islower() else word


# --------------------------------------------------------------------------- related


def related(rec: Record, pool: list[Record], rng: random.Random) -> str | None:
    """Another record's answer: same task, other item, not accepted here.

    Candidates close to rec (same ``group``) are preferred; for WordNet tasks the
    asked word itself and answers that merely repeat it are left out. Answers are drawn
    as often as they occur, so rejected answers follow the chosen answers' distribution
    (a frequent poet is as often rejected as chosen) and only right / wrong tells them
    apart.
    """
    head = rec.headword
    near: list[str] = []
    far: list[str] = []
    for other in pool:
        text = other.chosen
        if (other.source_id == rec.source_id or rec.accepts(text)
                or (head and (other.headword.casefold() == head.casefold()
                              or uses_word(text, head)))):
            continue
        (near if other.group == rec.group else far).append(text)
    candidates = near or far
    return rng.choice(candidates) if candidates else None


# --------------------------------------------------------------------------- corrupted


def corrupt_line(line: str, chars: list[str], rng: random.Random) -> str | None:
    """A poem line with 1-2 characters replaced from other lines, or two swapped."""
    op = rng.choice(("replace1", "replace2", "swap"))
    out = list(line)
    if op == "swap":
        pairs = [(i, j) for i in range(len(out)) for j in range(i + 1, len(out))
                 if out[i] != out[j]]
        if not pairs:
            return None
        i, j = rng.choice(pairs)
        out[i], out[j] = out[j], out[i]
    else:
        k = min(1 if op == "replace1" else 2, len(out))
        for pos in rng.sample(range(len(out)), k):
            choices = [c for c in chars if c != out[pos]]
            if not choices:
                return None
            out[pos] = rng.choice(choices)
    return "".join(out)


def split_params(params: str) -> list[str]:
    """Split a parameter list at top-level commas (outside brackets and quotes)."""
    parts, depth, quote, start, i = [], 0, "", 0, 0
    while i < len(params):
        c = params[i]
        if quote:
            if c == "\\":
                i += 1
            elif c == quote:
                quote = ""
        elif c in "'\"":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == "," and depth == 0:
            parts.append(params[start:i].strip())
            start = i + 1
        i += 1
    last = params[start:].strip()
    return parts + [last] if last else parts


def param_name(param: str) -> str:
    """The bare name of a parameter ("" for the markers * and /)."""
    return param.split("=", 1)[0].strip().lstrip("*") if param not in ("*", "/") else ""


def valid_params(params: list[str]) -> bool:
    """Whether the parameter list parses as Python."""
    try:
        ast.parse(f"def _({', '.join(params)}): pass")
    except SyntaxError:
        return False
    return True


def signature_parts(signature: str) -> tuple[str, list[str]] | None:
    """(qualified name, parameters) of ``mod.f(a, b=1)``, or None if not of that form."""
    if not signature.endswith(")") or "(" not in signature:
        return None
    name, _, rest = signature.partition("(")
    return name, split_params(rest[:-1])


def corrupt_signature(signature: str, names: list[str], rng: random.Random) -> str | None:
    """A signature with one parameter dropped or renamed to another function's name."""
    parts = signature_parts(signature)
    if parts is None:
        return None
    func, params = parts
    named = [i for i, p in enumerate(params) if param_name(p)]
    if not named:
        return None
    i = rng.choice(named)
    own = {param_name(p) for p in params}
    new_names = [n for n in names if n not in own]
    if rng.random() < 0.5 or not new_names:  # drop
        out = params[:i] + params[i + 1:]
        if out and out[0] == "/":  # no positional-only parameter left
            out = out[1:]
        if "*" in out and all(p.startswith("**") for p in out[out.index("*") + 1:]):
            out.remove("*")  # a bare * needs a keyword parameter after it
    else:  # rename
        old = params[i]
        stars = old[: len(old) - len(old.lstrip("*"))]
        default = old.partition("=")[1:]
        out = params[:i] + [stars + rng.choice(new_names) + "".join(default)] + params[i + 1:]
    if valid_params(params) and not valid_params(out):
        return None
    return f"{func}({', '.join(out)})"


def truncate(text: str, rng: random.Random) -> str | None:
    """The first 40-70 % of the words of text, cut inside a clause.

    The cut never follows punctuation nor precedes "or" / "and" / "(" (a definition
    cut at its ";" or before "or ..." would still be a right answer) and, where
    possible, follows a stopword ("... his ability to"), so the text is visibly
    unfinished.
    """
    words = text.split()
    if len(words) < 4:
        return None
    cuts = [k for k in range(max(2, math.ceil(len(words) * 0.4)),
                             max(2, int(len(words) * 0.7)) + 1)
            if words[k - 1][-1].isalnum() and words[k].casefold() not in ("or", "and")
            and not words[k].startswith("(")]
    open_cuts = [k for k in cuts if words[k - 1].casefold() in STOPWORDS]
    if not (open_cuts or cuts):
        return None
    return " ".join(words[: rng.choice(open_cuts or cuts)])


def substitute(text: str, targets: list[re.Match[str]], pool: list[str],
               rng: random.Random) -> str | None:
    """text with the targets (word matches) replaced by one word from pool."""
    own = {m.group(0).casefold() for m in targets}
    choices = [w for w in pool if w.casefold() not in own]
    if not targets or not choices:
        return None
    word = rng.choice(choices)
    out, end = [], 0
    for m in targets:
        before = ARTICLE.sub(lambda a: fix_article(a.group(1), word) + " ",
                             text[end:m.start()])
        out += [before, match_case(word, m.group(0))]
        end = m.end()
    return "".join(out) + text[end:]


def fix_article(article: str, word: str) -> str:
    """The indefinite article (a / an, case kept) that goes before word."""
    right = "an" if word[:1].casefold() in "aeiou" else "a"
    return match_case(right, article)


def content_words(text: str) -> list[re.Match[str]]:
    """Matches of the content words of text (4+ letters, not a stopword)."""
    return [m for m in WORD.finditer(text)
            if len(m.group(0)) >= 4 and m.group(0).casefold() not in STOPWORDS]


def corrupt_text(rec: Record, pool_words: list[str], headwords: list[str],
                 rng: random.Random) -> str | None:
    """A definition / summary / example with a word replaced, or cut off mid-way."""
    def swap_word() -> str | None:
        if rec.task == "wn_example" and uses_word(rec.chosen, rec.headword):
            targets = list(re.finditer(rf"\b{re.escape(rec.headword)}\b", rec.chosen, re.I))
            return substitute(rec.chosen, targets, headwords, rng)
        words = content_words(rec.chosen)
        return substitute(rec.chosen, [rng.choice(words)], pool_words, rng) if words else None

    ops: list[Callable[[], str | None]] = [swap_word, lambda: truncate(rec.chosen, rng)]
    if rec.task != "wn_example" and rng.random() < 0.5:
        ops.reverse()  # an example cut short may still use the word well: swap it first
    for op in ops:
        text = op()
        if text:
            return text
    return None


# --------------------------------------------------------------------------- building


def cut_short(rec: Record, rng: random.Random) -> str | None:
    """The answer cut off before its end: what a reply stopped too early looks like.

    Text: ``truncate`` (inside a clause). A poem line: its first 2 to n-2 characters. A
    signature: cut after the "(" or after one of its parameters' commas. A single word
    or name: its first 40-70 % of characters (at least one).
    """
    text = rec.chosen
    if rec.task in TEXT_TASKS:
        return truncate(text, rng)
    if rec.task in POEM_LINE_TASKS:
        return text[: rng.randint(2, len(text) - 2)] if len(text) >= 4 else None
    if rec.task == "py_signature":
        cuts = [i + 1 for i, c in enumerate(text) if c in "(,"][:-1] or [text.find("(") + 1]
        return text[: rng.choice(cuts)].rstrip() if cuts[0] > 0 else None
    if len(text) < 2:
        return None
    return text[: max(1, rng.randint(math.ceil(len(text) * 0.4), int(len(text) * 0.7)))]


def repeat_tail(rec: Record, rng: random.Random) -> str:
    """The answer with its end repeated two or three more times: a degenerate loop."""
    text = rec.chosen
    if rec.lang == "zh":
        tail = text[-rng.randint(1, min(2, len(text))):]
        return text + tail * rng.randint(2, 3)
    words = text.split()
    tail = " ".join(words[-rng.randint(1, min(2, len(words))):])
    return " ".join([text] + [tail] * rng.randint(2, 3))


# The share of each kind of rejected answer; a record whose kind cannot apply (nothing
# to corrupt, too short to cut) gets a related answer instead.
KIND_WEIGHTS = {"truncated": 0.4, "repeated": 0.2, "corrupted": 0.2, "related": 0.2}
KINDS = tuple(KIND_WEIGHTS)


def build_task(task: str, records: list[Record], rng: random.Random) -> list[tuple[str, str]]:
    """(rejected answer, kind) for each record of one task of one split, in order."""
    kinds = rng.choices(KINDS, weights=list(KIND_WEIGHTS.values()), k=len(records))
    chars = [c for r in records for c in r.chosen]
    pool_words = [m.group(0) for r in records for m in content_words(r.chosen)]
    param_names = [param_name(p) for r in records
                   for p in (signature_parts(r.chosen) or ("", []))[1] if param_name(p)]
    out = []
    for i, rec in enumerate(records):
        rejected, kind = None, "related"
        if kinds[i] in ("truncated", "repeated"):
            rejected = (cut_short(rec, rng) if kinds[i] == "truncated"
                        else repeat_tail(rec, rng))
            if rejected is not None and (not rejected.strip() or rec.accepts(rejected)):
                rejected = None
            kind = kinds[i] if rejected is not None else "related"
        elif kinds[i] == "corrupted" and task in CORRUPTIBLE:
            if task in POEM_LINE_TASKS:
                rejected = corrupt_line(rec.chosen, chars, rng)
            elif task == "py_signature":
                rejected = corrupt_signature(rec.chosen, param_names, rng)
            else:
                headwords = [r.headword for r in records
                             if r.group == rec.group and " " not in r.headword]
                rejected = corrupt_text(rec, pool_words, headwords, rng)
            if rejected is not None and rec.accepts(rejected):
                rejected = None
            kind = "corrupted" if rejected is not None else "related"
        if rejected is None:
            rejected = related(rec, records, rng)
        if rejected is None:
            raise SystemExit(f"no rejected answer for {rec.source_id}: {rec.prompt}")
        out.append((rejected, kind))
    return out


def build_split(split: str, records: list[Record], seed: int) -> list[dict]:
    """The preference pairs of one split, in the records' order."""
    by_task: dict[tuple[str, str], list[int]] = {}
    for i, rec in enumerate(records):
        by_task.setdefault((rec.task, rec.lang), []).append(i)
    rejected: dict[int, tuple[str, str]] = {}
    for (task, lang), idx in sorted(by_task.items()):
        rng = random.Random(f"lmforge-pref-demo:{seed}:{split}:{task}:{lang}")
        for i, pair in zip(idx, build_task(task, [records[i] for i in idx], rng), strict=True):
            rejected[i] = pair
    return [{"prompt": [{"role": "user", "content": rec.prompt}],
             "chosen": [{"role": "assistant", "content": rec.chosen}],
             "rejected": [{"role": "assistant", "content": rejected[i][0]}],
             "task": rec.task, "source_id": rec.source_id, "lang": rec.lang,
             "rejected_kind": rejected[i][1]}
            for i, rec in enumerate(records)]


def check(splits: dict[str, list[Record]], pairs: dict[str, list[dict]]) -> None:
    """Assert the set's invariants (see the module docstring)."""
    for split, recs in splits.items():
        assert len(recs) == len(pairs[split])
        for rec, pair in zip(recs, pairs[split], strict=True):
            rejected = pair["rejected"][0]["content"]
            assert pair["chosen"][0]["content"] == rec.chosen
            assert rejected.strip() and not rec.accepts(rejected), (rec, rejected)
            assert pair["rejected_kind"] in KINDS
    train_prompts = {r.prompt for r in splits["train"]}
    leaked = [r.prompt for r in splits["test"] if r.prompt in train_prompts]
    assert not leaked, f"test prompts in train: {leaked[:5]}"


def write_jsonl_gz(path: Path, rows: Iterable[dict]) -> int:
    """Write rows as gzip -9 JSONL with no name and mtime 0; return the file size."""
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", compresslevel=9, fileobj=buf, mtime=0) as gz:
        for row in rows:
            gz.write((json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8"))
    path.write_bytes(buf.getvalue())
    return len(buf.getvalue())


def counts_table(pairs: dict[str, list[dict]]) -> str:
    """A markdown table of pairs per task, kind and split."""
    c = Counter((p["task"], p["rejected_kind"], s) for s, ps in pairs.items() for p in ps)
    lines = ["| task | " + " | ".join(f"{s} {k}" for s in SPLITS for k in KINDS) + " |",
             "| --- |" + " ---: |" * (len(SPLITS) * len(KINDS))]
    tasks = sorted({t for t, _, _ in c})
    for task in [*tasks, "total"]:
        def n(kind: str, split: str, task: str = task) -> int:
            return sum(v for (t, k, s), v in c.items()
                       if k == kind and s == split and task in (t, "total"))
        cells = [f"{n(k, s):,}" for s in SPLITS for k in KINDS]
        name = "**total**" if task == "total" else task
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=HERE, help="output directory")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help="random seed")
    args = parser.parse_args(argv)
    splits = {s: read_records(SOURCE / f"{s}.jsonl.gz") for s in SPLITS}
    pairs = {s: build_split(s, recs, args.seed) for s, recs in splits.items()}
    check(splits, pairs)
    args.out.mkdir(parents=True, exist_ok=True)
    for split in SPLITS:
        size = write_jsonl_gz(args.out / f"{split}.jsonl.gz", pairs[split])
        print(f"{args.out / f'{split}.jsonl.gz'}: {len(pairs[split]):,} pairs, {size:,} bytes")
    print(counts_table(pairs))


if __name__ == "__main__":
    main()
