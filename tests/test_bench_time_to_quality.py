"""bench/bench_time_to_quality.py runs end to end on tiny shards and reports what it
promises: per-variant bits/byte with stderr, per domain, tok/s, equal-wall-time step counts;
and it hands nanoGPT the same token streams."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from test_train_loop import REPO, make_inputs

from lmforge.shards import ShardSet

SCRIPT = REPO / "bench" / "bench_time_to_quality.py"


def tiny_repo(root: Path) -> Path:
    make_inputs(root)
    params = yaml.safe_load((REPO / "params.yaml").read_text(encoding="utf-8"))
    params["model"] = {"n_layer": 2, "n_head": 4, "n_embd": 64, "seq_len": 32}
    params["train"] = {"max_steps": 3, "micro_batch_size": 4, "warmup": 1, "log_every": 1,
                       "eval_batches": 2, "num_threads": 1, "compile": False}
    (root / "params.yaml").write_text(yaml.safe_dump(params), encoding="utf-8")
    return root


def test_the_bench_reports_every_variant_at_equal_tokens_and_equal_wall_time(tmp_path):
    root = tiny_repo(tmp_path / "repo")
    out = root / "out.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--params", "params.yaml", "--shards", "data/shards",
         "--variants", "baseline,muon,chosen", "--chosen", "muon,zero_init,qk_norm",
         "--modes", "tokens,wall", "--threads", "1", "--out", str(out)],
        cwd=root, capture_output=True, text=True, timeout=600,
        env={"PYTHONPATH": f"{REPO / 'src'}:{REPO / 'tests'}", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    figures = json.loads(out.read_text())
    runs = figures["runs"]
    assert set(runs) == {f"{v}/{m}/seed1337" for v in ("baseline", "muon", "chosen")
                         for m in ("tokens", "wall")}
    for key, run in runs.items():
        assert 0 < run["bpb"] < 20 and run["bpb_stderr"] > 0, key
        assert run["domains"] and run["tokens_per_sec"] > 0, key
        if key.endswith("tokens/seed1337"):
            assert run["steps"] == 3
    assert "vs baseline: bpb" in proc.stdout and "muon/wall" in proc.stdout


def test_nanogpt_gets_the_same_token_streams(tmp_path):
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import bench_time_to_quality as bench
    finally:
        sys.path.pop(0)
    root = tiny_repo(tmp_path / "repo")
    vocab = bench.nanogpt_data(root / "data" / "shards", tmp_path / "nano")
    assert vocab == 300
    for split in ("train", "val"):
        shards = ShardSet(root / "data" / "shards" / split)
        theirs = np.fromfile(tmp_path / "nano" / f"{split}.bin", dtype=np.uint16)
        np.testing.assert_array_equal(theirs, shards.read(0, shards.num_tokens))
    assert bench.wall_steps({"seconds": 10.0}, {"tokens": 1000, "seconds": 5.0}, 100) == 20


def test_reuse_takes_the_runs_that_answer_the_same_question(tmp_path, capsys):
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import bench_time_to_quality as bench
    finally:
        sys.path.pop(0)
    earlier = {"steps": 500, "shape": "demo", "chosen": ["muon", "qk_norm"], "sets": [],
               "runs": {"baseline/tokens/seed1": {"bpb": 2.7}, "chosen/tokens/seed1": {"bpb": 2.3}}}
    path = tmp_path / "tokens.json"
    path.write_text(json.dumps(earlier))
    now = {"steps": 500, "shape": "demo", "chosen": ["muon", "qk_norm"], "sets": []}
    assert bench.reused_runs(path, now) == earlier["runs"]
    # Another chosen set: its chosen runs are trained again, the rest reused.
    assert bench.reused_runs(path, {**now, "chosen": ["muon"]}) == {
        "baseline/tokens/seed1": {"bpb": 2.7}}
    assert "reused from" in capsys.readouterr().out
    for key, value in (("steps", 300), ("shape", "8x512"), ("sets", ["train.muon_lr=0.04"])):
        with pytest.raises(SystemExit, match=f"{key} .* differs"):
            bench.reused_runs(path, {**now, key: value})
