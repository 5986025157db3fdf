"""TSV is read by its own rules (IANA text/tab-separated-values): no quoting, one line is
one row exactly as written; CSV keeps RFC 4180 quoting (tests/test_data_ingest.py)."""

from __future__ import annotations

import gzip

import pytest

from lmforge.data import readers
from lmforge.data.formats import iter_records

BOM = b"\xef\xbb\xbf"
FIVE = ['1\t"Hi," she said.', "2\tsecond message", '3\t"unbalanced quote at start',
        "4\tfourth", "5\tfifth"]


def _read(path, text_field="text", id_field="id"):
    return list(iter_records(path, "auto", text_field, id_field, "file", 1 << 20))


def _docs(records):
    return [(r.pos, r.id, r.text) for r in records if isinstance(r, readers.Doc)]


@pytest.mark.parametrize("newline", ["\n", "\r\n"], ids=["lf", "crlf"])
@pytest.mark.parametrize("bom", [BOM, b""], ids=["bom", "no-bom"])
@pytest.mark.parametrize("gz", [False, True], ids=["plain", "gz"])
def test_a_leading_quote_is_data_and_every_line_is_one_row(tmp_path, newline, bom, gz):
    data = bom + newline.join(["id\ttext", *FIVE, ""]).encode()
    path = tmp_path / ("quotes.tsv.gz" if gz else "quotes.tsv")
    path.write_bytes(gzip.compress(data, mtime=0) if gz else data)
    records = _read(path)
    assert _docs(records) == [
        (2, "1", '"Hi," she said.'), (3, "2", "second message"),
        (4, "3", '"unbalanced quote at start'), (5, "4", "fourth"), (6, "5", "fifth")]
    assert len(records) == 5  # nothing rejected either


def test_quotes_in_a_header_and_inside_cells_are_kept(tmp_path):
    (tmp_path / "t.tsv").write_text('id\ttext\n"a"\tsays ""hi""\nb\tends with a quote"\n')
    assert _docs(_read(tmp_path / "t.tsv")) == [
        (2, '"a"', 'says ""hi""'), (3, "b", 'ends with a quote"')]


def test_a_row_with_the_wrong_number_of_fields_is_a_counted_reject_with_its_line(tmp_path):
    # A quote would have hidden row 3's missing tab inside row 2's cell before.
    (tmp_path / "t.tsv").write_text(
        'id\ttext\n1\t"open quote\n2 no tab here\n3\tthree\textra\n\n4\tfour\n')
    records = _read(tmp_path / "t.tsv")
    assert _docs(records) == [(2, "1", '"open quote'), (6, "4", "four")]
    rejects = [(r.pos, r.reason) for r in records if isinstance(r, readers.Reject)]
    assert rejects == [(3, "wrong_column_count"), (4, "wrong_column_count")]


def test_csv_still_follows_rfc_4180(tmp_path):
    (tmp_path / "t.csv").write_text('id,text\n1,"Hi, she said."\n2,"two\nlines"\n3,three\n')
    assert _docs(_read(tmp_path / "t.csv")) == [
        (2, "1", "Hi, she said."), (3, "2", "two\nlines"), (5, "3", "three")]
