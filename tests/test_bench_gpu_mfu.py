"""The prepared GPU MFU script runs (tiny model) and reports every figure it promises."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "bench_gpu_mfu.py"


def run_script(*args: str) -> str:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--steps", "3",
                           "--warmup", "1", *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_cpu_smoke_run_reports_speed_and_ceiling():
    out = run_script("--device", "cpu", "--compile", "false")
    assert "fp32; eager" in out
    tok_s = float(re.search(r"tokens/s \(median of 3 steps\): ([\d,]+)", out)[1].replace(",", ""))
    assert tok_s > 0
    assert "MFU vs spec peak: n/a (no known fp32 peak for cpu)" in out
    share = float(re.search(r"matmul measured here: ([\d.]+)%", out)[1])
    assert 0 < share < 100
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", out).groups())
    assert 5 < first < 7.5 and last < 7.5  # ln(512) = 6.24 at initialisation
    # Both strategies, from the same initial weights (FSDP built on meta, shard by shard).
    firsts = re.findall(r"\[(ddp|fsdp)\] peak memory .*; loss ([\d.]+) ->", out)
    assert [name for name, _ in firsts] == ["ddp", "fsdp"]
    assert firsts[0][1] == firsts[1][1]
    assert float(re.search(r"fsdp / ddp tokens/s: ([\d.]+)", out)[1]) > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_run_reports_mfu():
    out = run_script("--device", "cuda")
    assert re.search(r"MFU vs spec peak: [\d.]+% of \d+ TFLOP/s|MFU vs spec peak: n/a", out)
