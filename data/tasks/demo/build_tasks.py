"""Build the demo lm-eval task suite (the *.jsonl files beside this script).

Run from the repository root, after ``dvc repro mix`` (the cloze and Chinese pairs come
from the mix stage's val split, ``data/mixed/val``):

    python data/tasks/demo/build_tasks.py

Deterministic: the same inputs give byte-identical files (sorted inputs, a fixed seed per
item derived from its id, JSON with a fixed key order). Every record is
``{"id", "context", "choices", "answer", ...metadata}``; the YAML task files score
``context`` + ``choices[i]`` by log-likelihood (README.md beside this script).
"""

from __future__ import annotations

import gzip
import hashlib
import itertools
import json
import random
import re
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

import pyarrow.parquet as pq

from lmforge.finetune.template import END_MARKER, render_text

HERE = Path(__file__).resolve().parent
VAL = Path("data/mixed/val")
TRAIN = Path("data/mixed/train")
TEST_MC = Path("data/instructions/demo/test_mc.jsonl.gz")
TEST_PREF = Path("data/preferences/demo/test.jsonl.gz")
SEED = "lmforge-tasks-demo-v1"


def rng_for(*key: str) -> random.Random:
    """A generator seeded by the item's key alone (so items do not depend on each other)."""
    digest = hashlib.sha256("\x1f".join((SEED, *key)).encode("utf-8")).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def write_jsonl(name: str, records: list[dict]) -> None:
    """Write ``records`` to ``name`` beside this script, one JSON object a line."""
    ids = [r["id"] for r in records]
    if len(set(ids)) != len(ids):
        raise SystemExit(f"{name}: duplicate ids")
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    (HERE / name).write_text(text, encoding="utf-8", newline="\n")
    print(f"{name}: {len(records)} items")


def pair(item_id: str, context: str, good: str, bad: str, **meta: str) -> dict:
    """A two-way item with the good choice at a seeded position (ties cannot favour it)."""
    answer = rng_for(item_id, "order").randrange(2)
    choices = [good, bad] if answer == 0 else [bad, good]
    return {"id": item_id, "context": context, "choices": choices, "answer": answer, **meta}


# --------------------------------------------------------------------------- English pairs

SINGULAR_PLURAL = [("dog", "dogs"), ("teacher", "teachers"), ("child", "children"),
                   ("woman", "women"), ("doctor", "doctors"), ("bird", "birds"),
                   ("student", "students"), ("farmer", "farmers"), ("man", "men"),
                   ("girl", "girls"), ("boy", "boys"), ("king", "kings"),
                   ("sister", "sisters"), ("horse", "horses"), ("neighbour", "neighbours")]
# (3rd singular present, plural present, rest of the predicate)
VERBS = [("walks", "walk", "to the village every morning"),
         ("sings", "sing", "in the garden"), ("knows", "know", "the answer"),
         ("likes", "like", "the new house"), ("writes", "write", "long letters"),
         ("sleeps", "sleep", "after dinner"), ("reads", "read", "the newspaper"),
         ("lives", "live", "near the river"), ("waits", "wait", "by the door"),
         ("comes", "come", "home late")]
THINGS = [("book", "books"), ("chair", "chairs"), ("letter", "letters"),
          ("house", "houses"), ("window", "windows"), ("garden", "gardens"),
          ("picture", "pictures"), ("road", "roads"), ("table", "tables"),
          ("horse", "horses"), ("carriage", "carriages"), ("room", "rooms")]
ADJECTIVES = ["old", "small", "new", "large", "quiet", "pretty", "cold", "empty"]
# (person, reflexive, wrong reflexive)
ANAPHORS = [("The king", "himself", "herself"), ("The queen", "herself", "himself"),
            ("The man", "himself", "herself"), ("The woman", "herself", "himself"),
            ("The boy", "himself", "herself"), ("The girl", "herself", "himself"),
            ("His mother", "herself", "himself"), ("Her father", "himself", "herself"),
            ("The children", "themselves", "himself"), ("The sisters", "themselves", "herself"),
            ("The men", "themselves", "himself"), ("The girls", "themselves", "herself")]
REFLEXIVE_VERBS = ["hurt", "praised", "blamed", "saw", "admired", "described", "helped",
                   "defended"]
# (base form for "did not", simple past, past participle, wrong participle, object)
IRREGULAR = [("write", "wrote", "written", "wrote", "a letter"),
             ("eat", "ate", "eaten", "ate", "the bread"),
             ("break", "broke", "broken", "broke", "the cup"),
             ("speak", "spoke", "spoken", "spoke", "to the doctor"),
             ("take", "took", "taken", "took", "the money"),
             ("see", "saw", "seen", "saw", "the house"),
             ("give", "gave", "given", "gave", "a present"),
             ("forget", "forgot", "forgotten", "forgot", "the name"),
             ("choose", "chose", "chosen", "chose", "a book"),
             ("drive", "drove", "driven", "drove", "the carriage"),
             ("begin", "began", "begun", "began", "the work"),
             ("sing", "sang", "sung", "sang", "the song")]
SUBJECTS = ["She", "He", "The girl", "My brother", "Her aunt", "The old man", "They", "We"]
A_AN = [("an", "a", w) for w in ("apple", "egg", "hour", "idea", "orange", "answer",
                                 "old house", "honest man", "empty room", "uncle")] + \
       [("a", "an", w) for w in ("book", "letter", "house", "young man", "garden",
                                 "useful book", "horse", "small room", "cup", "visit")]
A_AN_FRAMES = ["She gave him {det} {noun}.", "There was {det} {noun} in the story.",
               "He found {det} {noun} yesterday.", "It was {det} {noun}, after all."]
PER_PHENOMENON = 40


def agreement_pair(r: random.Random) -> tuple[str, str]:
    """Subject-verb agreement across a prepositional phrase with a noun of the other number."""
    (sg, pl), (v_sg, v_pl, rest) = r.choice(SINGULAR_PLURAL), r.choice(VERBS)
    attractor = r.choice(THINGS)
    if r.random() < 0.5:  # singular subject, plural attractor
        head, noun_pp, good, bad = sg, attractor[1], v_sg, v_pl
    else:
        head, noun_pp, good, bad = pl, attractor[0], v_pl, v_sg
    frame = f"The {head} near the {noun_pp} {{}} {rest}."
    return frame.format(good), frame.format(bad)


def determiner_pair(r: random.Random) -> tuple[str, str]:
    """this/that with a singular noun, these/those with a plural one."""
    sg, pl = r.choice(THINGS)
    adj = r.choice(ADJECTIVES)
    near = r.random() < 0.5
    if r.random() < 0.5:
        good, bad = ("This", "These") if near else ("That", "Those")
        verb, noun = "is", sg
    else:
        good, bad = ("These", "This") if near else ("Those", "That")
        verb, noun = "are", pl
    frame = f"{{}} {noun} {verb} very {adj}."
    return frame.format(good), frame.format(bad)


def anaphor_pair(r: random.Random) -> tuple[str, str]:
    """A reflexive that agrees with its antecedent in gender and number."""
    person, good, bad = r.choice(ANAPHORS)
    verb = r.choice(REFLEXIVE_VERBS)
    frame = f"{person} {verb} {{}} in the end."
    return frame.format(good), frame.format(bad)


def participle_pair(r: random.Random) -> tuple[str, str]:
    """The irregular past participle after "has"/"had", not the simple past."""
    _, _, participle, wrong, obj = r.choice(IRREGULAR)
    subject = r.choice(SUBJECTS)
    aux = r.choice(["had", "has" if subject not in ("They", "We") else "have"])
    frame = f"{subject} {aux} {{}} {obj}."
    return frame.format(participle), frame.format(wrong)


def past_pair(r: random.Random) -> tuple[str, str]:
    """The simple past after "yesterday", not the past participle."""
    _, past, participle, _, obj = r.choice(IRREGULAR)  # the two forms differ in each
    subject = r.choice(SUBJECTS)
    frame = f"Yesterday {subject[0].lower() + subject[1:]} {{}} {obj}."
    return frame.format(past), frame.format(participle)


def article_pair(r: random.Random) -> tuple[str, str]:
    """"an" before a vowel sound, "a" before a consonant sound."""
    good, bad, noun = r.choice(A_AN)
    frame = r.choice(A_AN_FRAMES)
    return frame.format(det=good, noun=noun), frame.format(det=bad, noun=noun)


PHENOMENA = {"subject_verb_agreement": agreement_pair, "determiner_noun": determiner_pair,
             "anaphor_agreement": anaphor_pair, "irregular_past_participle": participle_pair,
             "irregular_past_tense": past_pair, "indefinite_article": article_pair}


def minpairs_en() -> list[dict]:
    """PER_PHENOMENON distinct pairs per phenomenon, each drawn from its own seed."""
    out = []
    for name, make in PHENOMENA.items():
        seen: set[str] = set()
        for k in itertools.count():
            if len(seen) == PER_PHENOMENON:
                break
            if k > 100 * PER_PHENOMENON:
                raise SystemExit(f"minpairs_en: {name} has too few distinct pairs")
            good, bad = make(rng_for("en", name, str(k)))
            if good in seen or good == bad:
                continue
            seen.add(good)
            out.append(pair(f"en/{name}/{len(seen) - 1:03d}", "", good, bad, phenomenon=name))
    return out


# --------------------------------------------------------------------------- corpus splits


def documents(split: Path, domain: str) -> list[dict]:
    """The split's documents of ``domain``, sorted by id."""
    files = sorted(split.glob("*.parquet"))
    if not files:
        raise SystemExit(f"{split}: no parquet files (run `dvc repro mix` first)")
    docs = [row for f in files
            for row in pq.read_table(f, columns=["id", "text", "domain"]).to_pylist()
            if row["domain"] == domain]
    return sorted(docs, key=lambda d: d["id"])


COUPLET = re.compile(r"^[\u4e00-\u9fff]{5,7}，[\u4e00-\u9fff]{5,7}。$")
ZH_PER_DOC = 6


def minpairs_zh() -> list[dict]:
    """A held-out poem couplet vs the same couplet with two of its characters swapped.

    Couplets (5 or 7 characters, comma, 5 or 7, full stop) from the val split's
    zh_classical documents, skipping any that also occur in a train document; up to
    ZH_PER_DOC per document, picked by a seeded shuffle.
    """
    train_text = "\n".join(d["text"] for d in documents(TRAIN, "zh_classical"))
    out = []
    for doc in documents(VAL, "zh_classical"):
        lines = sorted({ln.strip() for ln in doc["text"].split("\n")
                        if COUPLET.match(ln.strip()) and ln.strip() not in train_text})
        rng_for("zh", doc["id"]).shuffle(lines)
        for k, line in enumerate(lines[:ZH_PER_DOC]):
            r = rng_for("zh", doc["id"], line)
            chars = [i for i, c in enumerate(line) if "\u4e00" <= c <= "\u9fff"]
            while True:
                i, j = sorted(r.sample(chars, 2))
                if line[i] != line[j]:
                    break
            bad = line[:i] + line[j] + line[i + 1:j] + line[i] + line[j + 1:]
            out.append(pair(f"zh/{doc['id']}/{k}", "", line, bad, document=doc["id"]))
    return out


# --------------------------------------------------------------------------- cloze

WORD = re.compile(r"[A-Za-z]{3,}")
FINAL = re.compile(r"(\s)([A-Za-z]{3,})([.!?][\"']?)$")
CLOZE_PER_DOC = 6
CLOZE_WORDS = (25, 80)
CLOZE_CHOICES = 4


def cloze_en() -> list[dict]:
    """The last word of a held-out paragraph against three words from the same chapter.

    Paragraphs of CLOZE_WORDS words from the val split's en_literature chapters that end
    in a word of 3+ letters and a full stop (or ! ?); the context is the paragraph up
    to that word, the choices are the word and three others of the chapter with the
    same capitalisation (so a name competes with names), the punctuation dropped.
    """
    train_text = "\n".join(d["text"] for d in documents(TRAIN, "en_literature"))
    out = []
    for doc in documents(VAL, "en_literature"):
        vocab = sorted(set(WORD.findall(doc["text"])))
        paragraphs = []
        for para in doc["text"].split("\n\n"):
            para = para.strip()
            m = FINAL.search(para)
            if m and CLOZE_WORDS[0] <= len(para.split()) <= CLOZE_WORDS[1] \
                    and para[-60:] not in train_text:
                paragraphs.append((para, m))
        order = list(range(len(paragraphs)))
        rng_for("cloze", doc["id"]).shuffle(order)
        for k, idx in enumerate(order[:CLOZE_PER_DOC]):
            para, m = paragraphs[idx]
            space, word = m.group(1), m.group(2)
            title = word[0].isupper()
            pool = [w for w in vocab if w.lower() != word.lower() and w[0].isupper() == title]
            others = rng_for("cloze", doc["id"], para).sample(pool, CLOZE_CHOICES - 1)
            answer = rng_for("cloze", doc["id"], para, "order").randrange(CLOZE_CHOICES)
            words = others[:answer] + [word] + others[answer:]
            out.append({"id": f"cloze/{doc['id']}/{k}", "context": para[:m.start()],
                        "choices": [space + w for w in words], "answer": answer,
                        "document": doc["id"]})
    return out


# --------------------------------------------------------------------------- chat tasks


def read_jsonl_gz(path: Path) -> Iterator[tuple[int, dict]]:
    """(line number, object) of a gzipped JSON-lines file."""
    if not path.is_file():
        raise SystemExit(f"{path}: missing")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if line.strip():
                yield n, json.loads(line)


def chat_context(turns: Iterable[dict]) -> str:
    """The turns in our chat format up to the open assistant turn, without the BOS."""
    return render_text([(t["role"], t["content"]) for t in turns],
                       add_generation_prompt=True, bos="")


def unique(records: list[dict], name: str) -> list[dict]:
    """Drop repeated (context, choices) items, keeping the first; say how many went."""
    seen, out = set(), []
    for r in records:
        key = (r["context"], tuple(r["choices"]))
        if key not in seen:
            seen.add(key)
            out.append(r)
    if len(out) < len(records):
        print(f"{name}: dropped {len(records) - len(out)} repeated items")
    return out


def instruct_mc() -> list[dict]:
    """The instruction set's held-out multiple-choice records, in our chat format."""
    out = []
    for n, rec in read_jsonl_gz(TEST_MC):
        out.append({"id": f"mc/{n:04d}", "context": chat_context(rec["messages"][:-1]),
                    "choices": [c + END_MARKER for c in rec["choices"]],
                    "answer": rec["answer"], "task": rec["task"], "lang": rec["lang"]})
    return unique(out, "instruct_mc")


PREF_PER_TASK = 24


def pref_pairs() -> list[dict]:
    """Held-out preference pairs, chosen vs rejected reply, in our chat format: the first
    PREF_PER_TASK pairs of each task in a seeded order (the whole split would triple the
    run time for little more precision)."""
    by_task: dict[str, list[tuple[int, dict]]] = {}
    for n, rec in read_jsonl_gz(TEST_PREF):
        by_task.setdefault(rec["task"], []).append((n, rec))
    picked = []
    for task, items in sorted(by_task.items()):
        rng_for("pref", task).shuffle(items)
        picked += items[:PREF_PER_TASK]
    out = []
    for n, rec in sorted(picked, key=lambda item: item[0]):
        (chosen,), (rejected,) = rec["chosen"], rec["rejected"]
        item_id = f"pref/{n:04d}"
        out.append(pair(item_id, chat_context(rec["prompt"]), chosen["content"] + END_MARKER,
                        rejected["content"] + END_MARKER, task=rec["task"], lang=rec["lang"],
                        rejected_kind=rec["rejected_kind"]))
    return unique(out, "pref_pairs")


def main() -> None:
    if not Path("dvc.yaml").is_file():
        sys.exit("run from the repository root: python data/tasks/demo/build_tasks.py")
    write_jsonl("minpairs_en.jsonl", minpairs_en())
    write_jsonl("minpairs_zh.jsonl", minpairs_zh())
    write_jsonl("cloze_en.jsonl", cloze_en())
    write_jsonl("instruct_mc.jsonl", instruct_mc())
    write_jsonl("pref_pairs.jsonl", pref_pairs())


if __name__ == "__main__":
    main()
