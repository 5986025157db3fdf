"""Decontamination: planted evaluation items in the training text are found (13-gram,
or the whole item of 8-12 words), near-misses are not, common n-grams are ignored, and
remove drops exactly the matching documents, counted per domain."""

from __future__ import annotations

import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lmforge.config import DecontamConfig
from lmforge.data.decontam import ngrams, read_items, render, run_decontam, words
from lmforge.data.records import SCHEMA

FILLER = ("the weather in the valley was mild that spring and the farmers planted "
          "barley beside the river while the children walked to school ")
QUESTION = ("Which river flows through the old city of Prague and empties into the Elbe "
            "north of the capital near Melnik?")  # 21 words
SHORT_ITEM = "What is the capital city of the Czech Republic today?"  # 10 words
POEM = "床前明月光，疑是地上霜。举头望明月，低头思故乡。"  # 20 characters = 20 words
TINY = "Antonym of hot?"  # 3 words: too short to tell


def _train(tmp_path, docs: dict[str, tuple[str, str]]):
    (tmp_path / "train").mkdir()
    ids = list(docs)
    pq.write_table(pa.table({"id": ids, "text": [docs[i][1] for i in ids],
                             "domain": [docs[i][0] for i in ids], "source": ["s"] * len(ids),
                             "file": ["f"] * len(ids), "line": list(range(len(ids)))},
                            schema=SCHEMA), tmp_path / "train" / "part-00000.parquet")


def _eval_set(tmp_path):
    (tmp_path / "tasks").mkdir()
    rows = [{"question": QUESTION, "answer": "Vltava"}, {"question": SHORT_ITEM, "answer": "Prague"},
            {"prompt": POEM, "choices": ["a", "b"]}, {"question": TINY, "answer": "cold"},
            {"question": "How many legs does a spider have in total when fully grown?", "answer": "8"}]
    (tmp_path / "tasks" / "qa.jsonl").write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in rows))
    return {"tasks": str(tmp_path / "tasks")}


def test_words_are_lowercased_and_cjk_characters_are_words():
    assert words("Hello, World! 床前明月光") == ["hello", "world", "床", "前", "明", "月", "光"]
    assert ngrams(TINY, 13, 8) == set()
    assert ngrams(SHORT_ITEM, 13, 8) == {tuple(words(SHORT_ITEM))}
    assert len(ngrams(QUESTION, 13, 8)) == len(words(QUESTION)) - 12


def test_planted_overlaps_are_found_and_near_misses_are_not(tmp_path):
    twelve = " ".join(QUESTION.split()[:12])  # 12 words of the question: below 13
    changed = QUESTION.replace("Elbe", "Danube").replace("Prague", "Brno")  # every 13-gram differs?
    docs = {
        "q-copy": ("web", FILLER + QUESTION.upper().replace("?", " !") + " " + FILLER),
        "short-copy": ("web", FILLER + SHORT_ITEM + FILLER),
        "poem": ("zh", "唐诗三首：" + POEM + "——李白"),
        "near-12": ("web", FILLER + twelve + " and then something else entirely " + FILLER),
        "near-edit": ("web", FILLER + changed + FILLER),
        "clean": ("web", FILLER * 3),
        "tiny": ("web", FILLER + TINY + FILLER),
    }
    _train(tmp_path, docs)
    (tmp_path / "train" / "clusters.parquet").write_bytes(b"dedup's clusters")
    cfg = DecontamConfig(num_workers=1)
    m = run_decontam(cfg, _eval_set(tmp_path), tmp_path / "train", tmp_path / "out")
    s = m["sets"]["tasks"]
    assert (s["items"], s["checked"], s["too_short"]) == (5, 4, 1)
    assert s["contaminated"] == 3  # question, short item, poem; not the spider question
    assert sorted(e["train_id"] for e in s["examples"]) == ["poem", "q-copy", "short-copy"]
    assert s["by_domain"] == {"web": 2, "zh": 1}
    assert m["domains"]["web"] == {"in": 6, "kept": 6, "matched": 2, "matched_val": 0,
                                   "rejected": {}}
    kept = pq.read_table(tmp_path / "out" / "part-00000.parquet")
    assert kept.num_rows == 7  # remove: false passes every document
    assert (tmp_path / "out" / "part-00000.parquet").read_bytes() == \
        (tmp_path / "train" / "part-00000.parquet").read_bytes()
    assert (tmp_path / "out" / "clusters.parquet").read_bytes() == b"dedup's clusters"
    assert "| tasks | 5 | 4 | 3 | 75.0% | web 2, zh 1 | 0 |" in render(m)


def test_a_short_string_of_cjk_characters_alone_is_checked_from_min_cjk_chars(tmp_path):
    """A poem's next line (5 characters) is an n-gram of its own; a line one character
    off, a 4-character answer and a short mixed string are not."""
    assert ngrams("疑是地上霜", 13, 8, 5) == {tuple("疑是地上霜")}
    assert ngrams("疑是地上霜", 13, 8) == set()  # without the CJK floor: too short
    assert ngrams("地上之霜", 13, 8, 5) == set()  # 4 characters
    assert ngrams("李白 wrote 静夜思", 13, 8, 5) == set()  # 5 words, not CJK alone
    (tmp_path / "tasks").mkdir()
    rows = [{"question": "What line follows 床前明月光 in the poem?", "answer": "疑是地上霜"},
            {"question": "What line follows 白日依山尽 in the poem?", "answer": "黄河入海流"},
            {"question": "Which season?", "answer": "地上之霜"}]
    (tmp_path / "tasks" / "poems.jsonl").write_text(
        "\n".join(json.dumps(r, ensure_ascii=False) for r in rows), encoding="utf-8")
    _train(tmp_path, {"poem": ("zh", "静夜思：" + POEM),
                      "near": ("zh", "白日依山尽，黄河入大海。"),  # one character off
                      "clean": ("web", FILLER)})
    m = run_decontam(DecontamConfig(num_workers=1), {"tasks": str(tmp_path / "tasks")},
                     tmp_path / "train", tmp_path / "out")
    s = m["sets"]["tasks"]
    assert (s["items"], s["checked"], s["contaminated"]) == (3, 2, 1)
    assert [e["train_id"] for e in s["examples"]] == ["poem"]
    assert s["examples"][0]["shared"] == " ".join("疑是地上霜")
    assert m["min_cjk_chars"] == 5 and "CJK characters alone: the whole item from 5" in render(m)


def test_remove_drops_the_matching_documents_and_counts_them(tmp_path):
    _train(tmp_path, {"a": ("web", FILLER + QUESTION + FILLER), "b": ("web", FILLER * 2),
                      "c": ("zh", POEM)})
    m = run_decontam(DecontamConfig(num_workers=1, remove=True), _eval_set(tmp_path),
                     tmp_path / "train", tmp_path / "out")
    assert pq.read_table(tmp_path / "out" / "part-00000.parquet").column("id").to_pylist() == ["b"]
    assert m["domains"]["web"] == {"in": 2, "kept": 1, "matched": 1, "matched_val": 0,
                                   "rejected": {"eval_overlap": 1}}
    assert m["domains"]["zh"]["rejected"] == {"eval_overlap": 1}


def test_an_item_found_only_in_the_val_split_is_not_contamination(tmp_path):
    _train(tmp_path, {"train": ("web", FILLER * 2 + SHORT_ITEM), "val": ("web", FILLER + QUESTION)})
    m = run_decontam(DecontamConfig(num_workers=1), _eval_set(tmp_path), tmp_path / "train",
                     tmp_path / "out", held_out={"val"})
    s = m["sets"]["tasks"]
    assert (s["contaminated"], s["in_val_only"]) == (1, 1)
    assert [e["train_id"] for e in s["examples"]] == ["train"]
    assert m["domains"]["web"]["matched"] == 1 and m["domains"]["web"]["matched_val"] == 1


def test_an_ngram_in_too_many_documents_is_common_not_contamination(tmp_path):
    docs = {f"d{i}": ("web", FILLER + QUESTION + FILLER) for i in range(4)}
    _train(tmp_path, docs)
    m = run_decontam(DecontamConfig(num_workers=1, max_matches=3), _eval_set(tmp_path),
                     tmp_path / "train", tmp_path / "out")
    assert m["sets"]["tasks"]["contaminated"] == 0 and m["common_ngrams_ignored"] > 0


def test_eval_sets_of_every_shape_are_read(tmp_path):
    conv = {"messages": [{"role": "user", "content": "Name the river."},
                         {"role": "assistant", "content": "Vltava"}]}
    (tmp_path / "sft.jsonl.gz").write_bytes(gzip.compress(json.dumps(conv).encode()))
    (tmp_path / "arr.json").write_text(json.dumps([{"q": "one"}, {"q": "two"}]))
    (items,) = read_items("sft", tmp_path / "sft.jsonl.gz")
    assert items.text == "user\nName the river.\nassistant\nVltava"
    assert items.where.endswith("sft.jsonl.gz:1")
    assert [i.text for i in read_items("arr", tmp_path / "arr.json")] == ["one", "two"]
    with pytest.raises(Exception, match="no such evaluation set"):
        read_items("x", tmp_path / "missing")


def test_the_shares_go_to_mlflow_as_metrics(tmp_path):
    from lmforge.evaluate.tracking import decontam_metrics

    assert decontam_metrics(tmp_path) == {}
    (tmp_path / "decontam.json").write_text(json.dumps({"sets": {
        "tasks": {"contaminated_share": 0.25}, "sft_test": {"contaminated_share": 0.0}}}))
    assert decontam_metrics(tmp_path) == {"decontam/sft_test": 0.0, "decontam/tasks": 0.25}


def test_min_cjk_chars_must_lie_between_one_and_min_ngram():
    from lmforge.errors import ConfigError

    with pytest.raises(ConfigError, match=r"decontam\.min_cjk_chars: 9 must be <= "
                                          r"decontam\.min_ngram=8"):
        DecontamConfig(min_cjk_chars=9).validate()
    with pytest.raises(ConfigError, match=r"decontam\.min_cjk_chars: 0 must be > 0"):
        DecontamConfig(min_cjk_chars=0).validate()


class _Recording:
    """The local pool (one process), keeping every task it is given."""

    def __new__(cls):
        from lmforge.executor import LocalExecutor

        class Recording(LocalExecutor):
            def __init__(self) -> None:
                super().__init__(1)
                self.tasks: dict[str, list] = {}

            def _run(self, fn, tasks):
                self.tasks.setdefault(fn.__name__, []).extend(tasks)
                return super()._run(fn, tasks)

        return Recording()


def _parts(tmp_path, n: int) -> None:
    """``n`` parts of two documents each, the question planted in every third one."""
    (tmp_path / "train").mkdir()
    for k in range(n):
        ids = [f"p{k}-a", f"p{k}-b"]
        texts = [FILLER + (QUESTION if k % 3 == 0 else "") + FILLER, FILLER * 2]
        pq.write_table(pa.table({"id": ids, "text": texts, "domain": ["web", "web"],
                                 "source": ["s"] * 2, "file": ["f"] * 2, "line": [0, 1]},
                                schema=SCHEMA), tmp_path / "train" / f"part-{k:05d}.parquet")


def test_the_index_goes_to_the_tasks_as_a_file_and_the_tasks_write_the_parts(tmp_path):
    """A scan task carries the index's path, not the index (it went with every task: 281 KB
    each in the demo), and a task per part writes the output; nothing is left beside it."""
    import pickle

    _parts(tmp_path, 7)
    many = {"question": [f"{QUESTION} variant {i} " + FILLER for i in range(300)]}
    (tmp_path / "big.jsonl").write_text(json.dumps(many))
    sets = {**_eval_set(tmp_path), "big": str(tmp_path / "big.jsonl")}
    executor = _Recording()
    m = run_decontam(DecontamConfig(remove=True), sets, tmp_path / "train", tmp_path / "out",
                     executor)
    scans, copies = executor.tasks["scan_part"], executor.tasks["copy_part"]
    assert len(scans) == len(copies) == 7
    assert max(len(pickle.dumps(t)) for t in scans) < 1_000  # the index is ~100 KB
    assert m["domains"]["web"] == {"in": 14, "kept": 11, "matched": 3, "matched_val": 0,
                                   "rejected": {"eval_overlap": 3}}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.jsonl", "out", "tasks", "train"]


def test_a_killed_write_resumes_with_the_same_bytes(tmp_path):
    from lmforge.executor import LocalExecutor

    class StopsAfter(LocalExecutor):
        def _run(self, fn, tasks):
            for k, result in enumerate(super()._run(fn, tasks)):
                if fn.__name__ == "copy_part" and k == 3:
                    raise KeyboardInterrupt
                yield result

    _parts(tmp_path, 8)
    cfg, sets = DecontamConfig(remove=True), _eval_set(tmp_path)
    whole = run_decontam(cfg, sets, tmp_path / "train", tmp_path / "whole",
                         LocalExecutor(1))
    with pytest.raises(KeyboardInterrupt):
        run_decontam(cfg, sets, tmp_path / "train", tmp_path / "out",
                     StopsAfter(1))
    rerun = _Recording()
    assert run_decontam(cfg, sets, tmp_path / "train", tmp_path / "out",
                        rerun) == whole
    assert len(rerun.tasks["copy_part"]) == 5  # the 3 parts written before were kept
    for p in sorted((tmp_path / "whole").iterdir()):
        assert (tmp_path / "out" / p.name).read_bytes() == p.read_bytes()
