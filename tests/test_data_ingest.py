"""Ingest: every reader format, every bad-input kind rejected with its reason and counted."""

from __future__ import annotations

import gzip
import json
import pickle
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from files import tree

from lmforge.config import IngestConfig, SourceConfig
from lmforge.data import readers
from lmforge.data.ingest import run_ingest
from lmforge.errors import InputError
from lmforge.executor import LocalExecutor

GOOD = "A perfectly ordinary document about rivers and mountains."


def _jsonl(path: Path, rows: list, gz: bool = False) -> Path:
    data = "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows).encode()
    path.write_bytes(gzip.compress(data, mtime=0) if gz else data)
    return path


def _ingest(tmp_path: Path, *sources: SourceConfig, **kw) -> tuple[dict, pa.Table, pa.Table]:
    cfg = IngestConfig(sources=list(sources), num_workers=1, **kw)
    metrics = run_ingest(cfg, tmp_path / "out")
    docs = pq.read_table(tmp_path / "out" / "part-00000.parquet")
    rejects = pq.read_table(tmp_path / "out" / "rejects.parquet")
    return metrics, docs, rejects


def _reasons(rejects: pa.Table) -> list[str]:
    return rejects.column("reason").to_pylist()


def test_jsonl_and_gzip_read_with_ids(tmp_path):
    _jsonl(tmp_path / "a.jsonl", [{"id": "x1", "text": GOOD}, {"text": GOOD + " two"}])
    _jsonl(tmp_path / "b.jsonl.gz", [{"id": 7, "text": GOOD + " three"}], gz=True)
    metrics, docs, rejects = _ingest(tmp_path, SourceConfig(str(tmp_path / "*.jsonl*"), "en"))
    assert docs.column("id").to_pylist() == ["x1", f"{tmp_path}/a.jsonl:2", "7"]
    assert docs.column("text").to_pylist()[2] == GOOD + " three"
    assert set(docs.column("domain").to_pylist()) == {"en"}
    assert rejects.num_rows == 0
    assert metrics["domains"]["en"] == {"in": 3, "kept": 3, "rejected": {}}


def test_custom_text_field_and_parquet(tmp_path):
    pq.write_table(pa.table({"content": [GOOD, "第二篇文档的内容。"], "uid": ["u1", "u2"]}),
                   tmp_path / "d.parquet")
    src = SourceConfig(str(tmp_path / "d.parquet"), "mixed", text_field="content", id_field="uid")
    _, docs, _ = _ingest(tmp_path, src)
    assert docs.column("id").to_pylist() == ["u1", "u2"]
    assert docs.column("text").to_pylist() == [GOOD, "第二篇文档的内容。"]


def test_parquet_without_text_column_is_a_clear_error(tmp_path):
    pq.write_table(pa.table({"body": [GOOD]}), tmp_path / "d.parquet")
    with pytest.raises(InputError, match="no column 'text'.*body"):
        _ingest(tmp_path, SourceConfig(str(tmp_path / "d.parquet"), "en"))


@pytest.mark.parametrize("split,expected", [("file", 1), ("paragraph", 3)])
def test_txt_per_file_and_per_paragraph(tmp_path, split, expected):
    (tmp_path / "t.txt").write_text("first block\nstill first\n\n\nsecond\n  \nthird\n")
    _, docs, _ = _ingest(tmp_path, SourceConfig(str(tmp_path / "t.txt"), "en", txt_split=split))
    assert docs.num_rows == expected
    if split == "paragraph":
        assert docs.column("text").to_pylist()[0] == "first block\nstill first"
        assert docs.column("line").to_pylist() == [1, 5, 7]


def test_every_bad_record_is_rejected_with_its_reason(tmp_path):
    lines = [
        json.dumps({"id": "ok", "text": GOOD}),
        '{"id": "broken", "text": ',  # invalid JSON
        json.dumps({"id": "nt"}),  # missing text
        json.dumps({"id": "num", "text": 42}),  # non-string text
        json.dumps({"id": "nul", "text": "abc\u0000def"}),  # NUL
        json.dumps({"id": "empty", "text": "   \n"}),  # empty
        json.dumps({"id": "big", "text": "x" * 500}),  # over max_record_bytes
        json.dumps(["not", "an", "object"]),
        '{"id": "sur", "text": "\\ud800 lone surrogate"}',
        json.dumps({"id": "ok", "text": GOOD + " again"}),  # duplicate id
    ]
    raw = "\n".join(lines).encode() + b"\n" + b'{"id": "bad", "text": "caf\xe9"}\n'
    (tmp_path / "bad.jsonl").write_bytes(raw)
    metrics, docs, rejects = _ingest(tmp_path, SourceConfig(str(tmp_path / "bad.jsonl"), "en"),
                                     max_record_bytes=300)
    assert docs.column("id").to_pylist() == ["ok"]
    by_line = dict(zip(rejects.column("line").to_pylist(), _reasons(rejects), strict=True))
    assert by_line == {
        2: readers.INVALID_JSON, 3: readers.MISSING_TEXT, 4: readers.NON_STRING_TEXT,
        5: readers.NUL_BYTES, 6: readers.EMPTY_TEXT, 7: readers.TOO_LARGE,
        8: readers.NOT_AN_OBJECT, 9: readers.INVALID_UTF8, 10: readers.DUPLICATE_ID,
        11: readers.INVALID_UTF8,
    }
    c = metrics["domains"]["en"]
    assert c["in"] == 11 and c["kept"] == 1 and sum(c["rejected"].values()) == 10
    assert set(rejects.column("file").to_pylist()) == {str(tmp_path / "bad.jsonl")}


def test_truncated_gzip_keeps_what_was_read_and_counts_the_rest(tmp_path):
    rows = [{"id": str(i), "text": f"{GOOD} number {i} " * 20} for i in range(200)]
    data = gzip.compress("".join(json.dumps(r) + "\n" for r in rows).encode(), mtime=0)
    (tmp_path / "t.jsonl.gz").write_bytes(data[: len(data) // 2])
    metrics, docs, rejects = _ingest(tmp_path, SourceConfig(str(tmp_path / "t.jsonl.gz"), "en"))
    assert 0 < docs.num_rows < 200
    assert _reasons(rejects) == [readers.TRUNCATED]
    assert metrics["domains"]["en"]["rejected"] == {readers.TRUNCATED: 1}


def test_over_long_line_is_skipped_without_losing_the_next(tmp_path):
    _jsonl(tmp_path / "l.jsonl", [{"text": "y" * 5000}, {"id": "after", "text": GOOD}])
    _, docs, rejects = _ingest(tmp_path, SourceConfig(str(tmp_path / "l.jsonl"), "en"),
                               max_record_bytes=1000)
    assert docs.column("id").to_pylist() == ["after"]
    assert _reasons(rejects) == [readers.TOO_LARGE]


def test_glob_matching_nothing_names_the_source(tmp_path):
    _jsonl(tmp_path / "a.jsonl", [{"text": GOOD}])
    pattern = str(tmp_path / "x" / "*.jsonl")
    with pytest.raises(InputError) as err:
        _ingest(tmp_path, SourceConfig(str(tmp_path / "a.jsonl"), "en"), SourceConfig(pattern, "zh"))
    assert str(err.value) == f"ingest.sources[1].path: no file matches '{pattern}'"


def test_unknown_extension_under_auto_is_an_error(tmp_path):
    (tmp_path / "data.xlsx").write_text("text\nhello\n")
    with pytest.raises(InputError, match="cannot tell the format"):
        _ingest(tmp_path, SourceConfig(str(tmp_path / "data.xlsx"), "en"))


def test_zst_without_zstandard_is_a_clear_error(tmp_path, monkeypatch):
    (tmp_path / "a.jsonl.zst").write_bytes(b"\x28\xb5\x2f\xfd")
    monkeypatch.setattr(readers, "zstd_available", lambda: False)
    with pytest.raises(InputError, match="zstandard"):
        _ingest(tmp_path, SourceConfig(str(tmp_path / "*.zst"), "en"))


def test_parts_roll_over_and_are_deterministic_across_workers(tmp_path):
    for k in range(3):
        _jsonl(tmp_path / f"p{k}.jsonl", [{"id": f"{k}-{i}", "text": f"{GOOD} {k} {i}"}
                                          for i in range(7)])
    src = SourceConfig(str(tmp_path / "p*.jsonl"), "en")
    run_ingest(IngestConfig(sources=[src], part_docs=5, num_workers=1), tmp_path / "one")
    run_ingest(IngestConfig(sources=[src], part_docs=5, num_workers=2), tmp_path / "two")
    one = sorted(p.name for p in (tmp_path / "one").iterdir())
    assert one == [f"part-{i:05d}.parquet" for i in range(5)] + ["rejects.parquet"]
    for name in one:
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes()
    ids = pq.read_table(tmp_path / "one", columns=["id"]).column("id").to_pylist()
    assert ids == [f"{k}-{i}" for k in range(3) for i in range(7)]


def test_zst_jsonl_is_read(tmp_path):
    zstandard = pytest.importorskip("zstandard")
    data = "".join(json.dumps({"id": f"z{i}", "text": f"{GOOD} {i}"}) + "\n" for i in range(3))
    (tmp_path / "a.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(data.encode()))
    metrics, docs, rejects = _ingest(tmp_path, SourceConfig(str(tmp_path / "a.jsonl.zst"), "en"))
    assert docs.column("id").to_pylist() == ["z0", "z1", "z2"] and rejects.num_rows == 0
    assert metrics["domains"]["en"] == {"in": 3, "kept": 3, "rejected": {}}


def test_truncated_zst_is_counted(tmp_path):
    zstandard = pytest.importorskip("zstandard")
    data = "".join(json.dumps({"text": f"{GOOD} {i} " * 30}) + "\n" for i in range(100)).encode()
    blob = zstandard.ZstdCompressor().compress(data)
    (tmp_path / "t.jsonl.zst").write_bytes(blob[: len(blob) // 2])
    _, docs, rejects = _ingest(tmp_path, SourceConfig(str(tmp_path / "t.jsonl.zst"), "en"))
    assert docs.num_rows < 100
    assert _reasons(rejects)[-1] in (readers.TRUNCATED, readers.CORRUPT)


@pytest.mark.parametrize("content", [b"", b"\n\n  \n"])
def test_empty_file_is_a_reject_not_a_silence(tmp_path, content):
    (tmp_path / "empty.jsonl").write_bytes(content)
    _jsonl(tmp_path / "full.jsonl", [{"id": "a", "text": GOOD}])
    metrics, docs, rejects = _ingest(tmp_path, SourceConfig(str(tmp_path / "*.jsonl"), "en"))
    assert docs.column("id").to_pylist() == ["a"]
    assert rejects.to_pylist() == [{"file": str(tmp_path / "empty.jsonl"), "line": 0, "domain": "en",
                                    "reason": readers.EMPTY_FILE, "detail": "the file holds no records"}]
    assert metrics["domains"]["en"] == {"in": 2, "kept": 1, "rejected": {readers.EMPTY_FILE: 1}}


def test_huge_line_is_streamed_past(tmp_path):
    """A line far beyond max_record_bytes is drained in chunks, never held whole."""
    with open(tmp_path / "h.jsonl", "wb") as f:
        f.write(b'{"text": "' + b"z" * (8 << 20) + b'"}\n')
        f.write(json.dumps({"id": "next", "text": GOOD}).encode() + b"\n")
    _, docs, rejects = _ingest(tmp_path, SourceConfig(str(tmp_path / "h.jsonl"), "en"),
                               max_record_bytes=1 << 16)
    assert docs.column("id").to_pylist() == ["next"]
    assert rejects.to_pylist()[0]["reason"] == readers.TOO_LARGE
    assert rejects.to_pylist()[0]["line"] == 1


def test_hf_parquet_layout_with_content_column(tmp_path):
    (tmp_path / "data").mkdir()
    for k in range(2):
        pq.write_table(pa.table({"content": [f"{GOOD} {k}"], "repo": ["r"]}),
                       tmp_path / "data" / f"train-0000{k}-of-00002.parquet")
    src = SourceConfig(str(tmp_path / "data" / "*.parquet"), "code", text_field="content",
                       id_field=None)
    _, docs, _ = _ingest(tmp_path, src)
    assert docs.column("text").to_pylist() == [f"{GOOD} 0", f"{GOOD} 1"]
    assert docs.column("id").to_pylist()[0].endswith("train-00000-of-00002.parquet:0")


BOM = b"\xef\xbb\xbf"  # what Notepad, PowerShell and Excel put at the start of UTF-8 files


def _compressed(data: bytes, suffix: str) -> bytes:
    if suffix == ".gz":
        return gzip.compress(data, mtime=0)
    if suffix == ".zst":
        return pytest.importorskip("zstandard").ZstdCompressor().compress(data)
    return data


@pytest.mark.parametrize("suffix", ["", ".gz", ".zst"])
@pytest.mark.parametrize("newline", [b"\n", b"\r\n"], ids=["lf", "crlf"])
@pytest.mark.parametrize("bom", [BOM, b""], ids=["bom", "no-bom"])
def test_jsonl_with_a_byte_order_mark_keeps_its_first_record(tmp_path, suffix, newline, bom):
    rows = [json.dumps({"id": f"r{i}", "text": f"{GOOD} {i}"}).encode() for i in range(3)]
    data = bom + newline.join(rows) + newline
    (tmp_path / f"bom.jsonl{suffix}").write_bytes(_compressed(data, suffix))
    metrics, docs, rejects = _ingest(tmp_path, SourceConfig(str(tmp_path / f"bom.jsonl{suffix}"), "en"))
    assert docs.column("id").to_pylist() == ["r0", "r1", "r2"] and rejects.num_rows == 0
    assert docs.column("text").to_pylist() == [f"{GOOD} {i}" for i in range(3)]  # no \r, no BOM
    assert docs.column("line").to_pylist() == [1, 2, 3]
    assert metrics["domains"]["en"] == {"in": 3, "kept": 3, "rejected": {}}


def test_only_the_leading_byte_order_mark_is_dropped(tmp_path):
    inner = "zero\ufeffwidth no-break space stays"  # U+FEFF inside a text is data
    raw = BOM + BOM + json.dumps({"id": "a", "text": GOOD}).encode() + b"\n"  # a second BOM is not
    raw += json.dumps({"id": "b", "text": inner}, ensure_ascii=False).encode() + b"\n"
    raw += BOM + json.dumps({"id": "c", "text": GOOD}).encode() + b"\n"  # nor one mid-file
    (tmp_path / "b.jsonl").write_bytes(raw)
    _, docs, rejects = _ingest(tmp_path, SourceConfig(str(tmp_path / "b.jsonl"), "en"))
    assert docs.column("id").to_pylist() == ["b"]
    assert docs.column("text").to_pylist() == [inner]
    assert rejects.column("line").to_pylist() == [1, 3]
    assert _reasons(rejects) == [readers.INVALID_JSON] * 2


def test_a_file_holding_only_a_byte_order_mark_is_empty(tmp_path):
    (tmp_path / "e.jsonl").write_bytes(BOM + b"\r\n")
    _, docs, rejects = _ingest(tmp_path, SourceConfig(str(tmp_path / "e.jsonl"), "en"))
    assert docs.num_rows == 0 and _reasons(rejects) == [readers.EMPTY_FILE]


@pytest.mark.parametrize("suffix", ["", ".gz"])
@pytest.mark.parametrize("split,expected", [
    ("file", ["first block\nstill first\n\nsecond\n"]),
    ("paragraph", ["first block\nstill first", "second"]),
])
def test_txt_with_a_byte_order_mark_has_it_stripped(tmp_path, suffix, split, expected):
    data = BOM + b"first block\nstill first\n\nsecond\n"
    (tmp_path / f"t.txt{suffix}").write_bytes(_compressed(data, suffix))
    src = SourceConfig(str(tmp_path / f"t.txt{suffix}"), "en", txt_split=split)
    _, docs, rejects = _ingest(tmp_path, src)
    assert docs.column("text").to_pylist() == expected and rejects.num_rows == 0


# --- CSV, TSV and JSON arrays


@pytest.mark.parametrize("newline", [b"\n", b"\r\n"], ids=["lf", "crlf"])
@pytest.mark.parametrize("bom", [BOM, b""], ids=["bom", "no-bom"])
@pytest.mark.parametrize("suffix", ["", ".gz"])
def test_csv_with_quoting_newlines_and_bad_rows(tmp_path, newline, bom, suffix):
    rows = [b"review_id,stars,review",                       # line 1: the header
            b'r1,5,"Great kettle, boils fast."',              # 2: a quoted comma
            b'r2,1,"Broke after a week.' + newline + b'Would not buy again."',  # 3-4
            b"r3,4",                                          # 5: a cell short
            b"",                                              # 6: a blank line
            b'r4,3,"She said ""fine"" and left."',            # 7: doubled quotes
            b"r5,2,",                                         # 8: empty text
            b"r6,5,\xe5\xa5\xbd\xe8\xaf\x84\xef\xbc\x81",     # 9: 好评！
            b"r7,1,\xff\xfe bad bytes",                       # 10: not UTF-8
            b"r8,5,too,many,cells"]                           # 11
    data = bom + newline.join(rows) + newline
    (tmp_path / f"reviews.csv{suffix}").write_bytes(_compressed(data, suffix))
    src = SourceConfig(str(tmp_path / f"reviews.csv{suffix}"), "reviews", text_field="review",
                       id_field="review_id")
    metrics, docs, rejects = _ingest(tmp_path, src)
    assert docs.column("id").to_pylist() == ["r1", "r2", "r4", "r6"]
    nl = newline.decode()
    assert docs.column("text").to_pylist() == [
        "Great kettle, boils fast.", f"Broke after a week.{nl}Would not buy again.",
        'She said "fine" and left.', "好评！"]
    assert docs.column("line").to_pylist() == [2, 3, 7, 9]
    assert rejects.select(["line", "reason"]).to_pylist() == [
        {"line": 5, "reason": "wrong_column_count"}, {"line": 8, "reason": readers.EMPTY_TEXT},
        {"line": 10, "reason": readers.INVALID_UTF8}, {"line": 11, "reason": "wrong_column_count"}]
    assert rejects.column("file").to_pylist()[0] == str(tmp_path / f"reviews.csv{suffix}")
    assert metrics["domains"]["reviews"]["rejected"] == {
        "wrong_column_count": 2, readers.EMPTY_TEXT: 1, readers.INVALID_UTF8: 1}


def test_tsv_reads_by_tab_and_names_a_missing_column(tmp_path):
    (tmp_path / "t.tsv").write_text("id\ttitle\n1\tRiver maps, vol. 2\n2\tMountain passes\n")
    _, docs, _ = _ingest(tmp_path, SourceConfig(str(tmp_path / "t.tsv"), "titles", text_field="title"))
    assert docs.column("text").to_pylist() == ["River maps, vol. 2", "Mountain passes"]
    assert docs.column("id").to_pylist() == ["1", "2"]
    with pytest.raises(InputError, match="no column 'text'.*id, title"):
        _ingest(tmp_path, SourceConfig(str(tmp_path / "t.tsv"), "titles"))


@pytest.mark.parametrize("bom", [BOM, b""], ids=["bom", "no-bom"])
def test_json_array_records_keep_their_lines_and_bad_ones_are_rejected(tmp_path, bom):
    body = ('[\r\n  {"id": "a", "text": "first"},\r\n  {"id": "b",\r\n   "text": "second"},\r\n'
            '  42,\r\n  {"id": "c"},\r\n  {"id": "d", "text": "对话"}\r\n]\r\n')
    (tmp_path / "export.json").write_bytes(bom + body.encode())
    metrics, docs, rejects = _ingest(tmp_path, SourceConfig(str(tmp_path / "export.json"), "chat"))
    assert docs.column("id").to_pylist() == ["a", "b", "d"]
    assert docs.column("text").to_pylist() == ["first", "second", "对话"]
    assert docs.column("line").to_pylist() == [2, 3, 7]
    assert rejects.select(["line", "reason"]).to_pylist() == [
        {"line": 5, "reason": readers.NOT_AN_OBJECT}, {"line": 6, "reason": readers.MISSING_TEXT}]
    assert metrics["domains"]["chat"]["kept"] == 3


def test_a_broken_json_array_keeps_what_came_before(tmp_path):
    (tmp_path / "cut.json").write_text('[{"text": "one"},\n {"text": "two"},\n {"text": "thr')
    _, docs, rejects = _ingest(tmp_path, SourceConfig(str(tmp_path / "cut.json"), "en"))
    assert docs.column("text").to_pylist() == ["one", "two"]
    assert rejects.select(["line", "reason"]).to_pylist() == [{"line": 3, "reason": readers.INVALID_JSON}]


def test_a_json_file_of_lines_is_still_json_lines(tmp_path):
    _jsonl(tmp_path / "lines.json", [{"id": "x", "text": GOOD}, {"id": "y", "text": GOOD + "!"}])
    _, docs, _ = _ingest(tmp_path, SourceConfig(str(tmp_path / "lines.json"), "en"))
    assert docs.column("id").to_pylist() == ["x", "y"]


def _dup_corpus(root: Path, docs_per_file: int = 7) -> SourceConfig:
    """Three files whose first 7 ids repeat within a file and across files, with a
    broken line each: ``(7k + i) mod 10`` for record i < 7 of file k, ``k/i`` after."""
    for k in range(3):
        rows = [{"id": f"{(7 * k + i) % 10}" if i < 7 else f"{k}/{i}", "text": f"{GOOD} {k} {i}"}
                for i in range(docs_per_file)]
        _jsonl(root / f"p{k}.jsonl", [*rows, '{"id": "bad"'])
    return SourceConfig(str(root / "p*.jsonl"), "en")


@pytest.mark.parametrize("buckets", [1, 3, 8])
def test_duplicate_ids_keep_the_first_copy_whatever_the_bucket_count(tmp_path, buckets):
    """The id check is a grouping hash-partitioned by id: the first copy in file and
    record order is kept, the others rejected in each file's record order, and the
    bytes do not depend on how many buckets the ids were spread over."""
    src = _dup_corpus(tmp_path)
    cfg = IngestConfig(sources=[src], part_docs=4, num_workers=1)
    metrics = run_ingest(cfg, tmp_path / "out", buckets=buckets)
    docs = pq.read_table(tmp_path / "out", columns=["id", "file", "line"])
    docs = docs.filter(pc.is_valid(docs.column("id")))  # rejects.parquet has no id column
    first = {}
    for k in range(3):
        for i in range(7):
            first.setdefault(f"{(7 * k + i) % 10}", (f"{tmp_path}/p{k}.jsonl", i + 1))
    assert list(zip(docs.column("id").to_pylist(), zip(docs.column("file").to_pylist(),
                                                        docs.column("line").to_pylist(),
                                                        strict=True), strict=True)) == \
        sorted(first.items(), key=lambda kv: kv[1])
    rejects = pq.read_table(tmp_path / "out" / "rejects.parquet").to_pylist()
    dups = [(r["file"][-8:], r["line"], r["detail"]) for r in rejects
            if r["reason"] == readers.DUPLICATE_ID]
    assert dups[:3] == [("p1.jsonl", 4, "id '0' already seen"), ("p1.jsonl", 5, "id '1' already seen"),
                        ("p1.jsonl", 6, "id '2' already seen")]
    assert len(dups) == 21 - 10
    # File by file: its broken line first, then its duplicates in record order.
    assert [(r["file"][-8:], r["reason"]) for r in rejects][:5] == [
        ("p0.jsonl", readers.INVALID_JSON), ("p1.jsonl", readers.INVALID_JSON),
        *[("p1.jsonl", readers.DUPLICATE_ID)] * 3]
    assert metrics["total"] == {"in": 24, "kept": 10, "rejected": {
        readers.DUPLICATE_ID: 11, readers.INVALID_JSON: 3}}
    assert metrics["parts"] == 3
    if buckets > 1:
        reference = tmp_path / "one"
        run_ingest(cfg, reference, buckets=1)
        assert tree(reference) == tree(tmp_path / "out")


def test_the_driver_gets_per_file_figures_not_rows(tmp_path):
    """What the tasks return to the driver does not grow with the documents: 100 times
    as many kept per file, the same pickled bytes (within the width of the counts)."""
    sizes = {}
    for n in (7, 700):
        root = tmp_path / str(n)
        root.mkdir()
        executor = Metered()
        metrics = run_ingest(IngestConfig(sources=[_dup_corpus(root, n)], part_docs=5000,
                                          num_workers=1), root / "out", executor, buckets=2)
        assert metrics["total"]["kept"] == 10 + 3 * (n - 7)
        sizes[n] = executor.result_bytes
        assert executor.results == {"ingest_file": 3, "find_duplicate_ids": 2,
                                    "write_part": 1, "write_rejects": 1}
    assert sizes[700] < 1.2 * sizes[7], sizes


class Metered(LocalExecutor):
    """The local pool, counting results by function and their pickled bytes."""

    def __init__(self) -> None:
        super().__init__(1)
        self.results: dict[str, int] = {}
        self.result_bytes = 0

    def _run(self, fn, tasks):
        for result in super()._run(fn, tasks):
            self.results[fn.__name__] = self.results.get(fn.__name__, 0) + 1
            self.result_bytes += len(pickle.dumps(result))
            yield result


def test_parts_cut_across_row_groups_of_a_large_file(tmp_path, monkeypatch):
    """A file many parts long, its temporary rows in many row groups: each part reads
    the row groups it spans, less the duplicates, and gets exactly its documents."""
    from lmforge.data import ingest

    monkeypatch.setattr(ingest, "_FLUSH_ROWS", 5)  # row groups of 5 rows (the pool forks)
    src = _dup_corpus(tmp_path, 40)
    cfg = IngestConfig(sources=[src], part_docs=4, num_workers=1)
    metrics = run_ingest(cfg, tmp_path / "out", LocalExecutor(1), buckets=3)
    ids = [i for p in sorted((tmp_path / "out").glob("part-*")) for i in
           pq.read_table(p, columns=["id"]).column("id").to_pylist()]
    # File 0 holds ids 0-6, file 1 adds 7-9 (its 0-3 are repeats), file 2 only repeats.
    assert ids == ([str(i) for i in range(7)] + [f"0/{i}" for i in range(7, 40)]
                   + ["7", "8", "9"] + [f"1/{i}" for i in range(7, 40)]
                   + [f"2/{i}" for i in range(7, 40)])
    assert metrics["parts"] == -(-len(ids) // 4)
    reference = tmp_path / "one_group"
    monkeypatch.setattr(ingest, "_FLUSH_ROWS", 4096)
    run_ingest(cfg, reference, LocalExecutor(1), buckets=1)
    assert tree(reference) == tree(tmp_path / "out")
