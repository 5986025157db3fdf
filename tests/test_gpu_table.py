"""bench/gpu_table.py reads a committed GPU run folder as bench/RESULTS.md shows it: the
ratios are the JSON's, the busy time the profile's own total, the variants the log's."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RUN = REPO / "bench" / "results" / "gpu_h200" / "run2"
sys.path.insert(0, str(REPO / "bench"))
try:
    import gpu_table
finally:
    sys.path.pop(0)


def test_rows_carry_the_runs_figures():
    doc = json.loads((RUN / "bench_gpu_mfu.json").read_text())
    rows = gpu_table.rows(RUN)
    plain, fsdp = rows[0], rows[1]
    assert plain["vs_nanogpt"] == pytest.approx(doc["ratios"]["plain_over_nanogpt"])
    assert fsdp["tok_s"] / plain["tok_s"] == pytest.approx(doc["ratios"]["fsdp_over_plain"])
    # The profiler's total over its steps: kernels only, so below the timed step.
    assert 0 < plain["busy_ms"] < plain["step_ms"]
    names = [r["what"] for r in rows]
    assert any("--fused-loss true" in n for n in names)
    assert "| what | tokens/s |" in gpu_table.markdown(RUN)


def test_a_variant_that_failed_has_no_figures(tmp_path):
    (tmp_path / "variants.log").write_text(
        "=== variant liger: --fused-loss liger\n[plain] FAILED: TorchRuntimeError\n"
        "=== variant ok: --compile-mode x\n[plain] tokens/s (median of 20 steps): 1,234\n"
        "[plain] peak memory 2,048 MB; loss 1 -> 1\n")
    got = gpu_table.variants(tmp_path / "variants.log")
    assert [(v["name"], v["tok_s"], v["memory_mib"]) for v in got] == [
        ("liger", None, None), ("ok", 1234.0, 2048.0)]


def test_a_run_timed_back_to_back_shows_each_step_alone_beside_it():
    run = RUN.with_name("run4")
    doc = json.loads((run / "bench_gpu_mfu.json").read_text())
    rows = gpu_table.rows(run)
    whats = [r["what"] for r in rows]
    assert whats[0].endswith("; steps back to back") and whats[1].endswith("each step alone")
    assert rows[0]["tok_s"] == doc["plain"]["tok_s"]
    assert rows[1]["tok_s"] == doc["plain"]["tok_s_synced"]
    assert rows[2]["tok_s"] / rows[0]["tok_s"] == pytest.approx(doc["ratios"]["fsdp_over_plain"])
    # The variant's line since the steps were timed back to back.
    variants = [r for r in rows if r["what"].startswith("variant:")]
    assert len(variants) == 1 and variants[0]["tok_s"] > 0
    log = (run / "variants.log").read_text()
    assert "median of 20 steps back to back" in log
