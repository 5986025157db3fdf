"""The console report of the data stages: a corrupt record is named in one line."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from lmforge.data.report import summary_line

REPO = Path(__file__).resolve().parents[1]


def test_summary_line_sums_domains_and_orders_reasons():
    metrics = {"domains": {
        "a": {"in": 10, "kept": 7, "rejected": {"min_chars": 1, "char_repeat": 2}},
        "b": {"in": 5, "kept": 4, "rejected": {"min_chars": 1}},
    }}
    assert summary_line("filter", metrics) == (
        "filter: 15 in, 11 kept, 4 rejected (char_repeat 2, min_chars 2)")


def test_ingest_names_each_corrupt_record(tmp_path):
    raw = tmp_path / "data" / "raw"
    raw.mkdir(parents=True)
    (raw / "a.jsonl").write_text(
        '{"text": "a perfectly good document"}\n{"text": broken\n{"body": "x"}\n',
        encoding="utf-8")
    params = {"ingest": {"sources": [{"path": "data/raw/*.jsonl", "domain": "web"}]},
              "mix": {"weights": {"web": 1.0}}}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params), encoding="utf-8")
    shutil.copytree(REPO / "stages", tmp_path / "stages")
    proc = subprocess.run([sys.executable, "-m", "stages.ingest"], cwd=tmp_path,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "ingest: 3 in, 1 kept, 2 rejected (invalid_json 1, missing_text 1)"
    assert lines[1].startswith("  rejected data/raw/a.jsonl:2: invalid_json: ")
    assert lines[2].startswith("  rejected data/raw/a.jsonl:3: missing_text: ")
    assert "Traceback" not in proc.stderr
