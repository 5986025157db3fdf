"""scripts/stage_clock.py: dvc repro's lines echoed, each stage timed, skipped ones listed."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "stage_clock.py"


def load():
    spec = importlib.util.spec_from_file_location("stage_clock", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_each_stage_runs_until_the_next_one_starts(capsys):
    lines = ["Stage 'ingest' didn't change, skipping\n", "Running stage 'train':\n",
             "> python -m stages.train\n", "step 10/300\n", "Running stage 'evaluate':\n",
             "eval done\n", "Use `dvc push` to send your updates to remote storage.\n"]
    ticks = iter([0.0, 5.0, 10.0, 72.5, 80.0])  # start, skip, train, evaluate, end
    times = load().clock(lines, now=lambda: next(ticks))
    assert times == [("ingest", None), ("train", 62.5), ("evaluate", 7.5)]
    assert capsys.readouterr().out == "".join(lines)  # everything passed through


def test_command_writes_the_table(tmp_path):
    out = tmp_path / "deep" / "times.txt"
    text = "Running stage 'a':\nhello\nStage 'b' didn't change, skipping\n"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], input=text,
                          capture_output=True, text=True, check=True)
    assert proc.stdout == text
    lines = out.read_text().splitlines()
    assert lines[0].startswith("stage times (dvc repro, ")
    assert lines[1].split()[0] == "a" and lines[1].endswith(" s")
    assert lines[2].split() == ["b", "cached"]
