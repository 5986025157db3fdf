"""The prepared GPU check (bench/bench_gpu_mfu.py) runs on a CPU (tiny model) and reports,
prints and writes every figure it promises: plain and FSDP steps, the profile, the JSON,
and nanoGPT's train.py run beside it (a stand-in printing train.py's lines here; the real
train.py when NANOGPT_DIR names a checkout)."""

from __future__ import annotations

import ast
import gzip
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "bench" / "bench_gpu_mfu.py"
NANOGPT_DIR = os.environ.get("NANOGPT_DIR")

sys.path.insert(0, str(REPO / "bench"))
try:
    import bench_gpu_mfu as bench
finally:
    sys.path.pop(0)

# Lines as train.py prints them (karpathy/nanoGPT 3adf61e, train.py and model.py):
#   print(f"tokens per iteration will be: {tokens_per_iter:,}")
#   print("number of parameters: %.2fM" % (self.get_num_params()/1e6,))
#   print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
#   print(f"iter {iter_num}: loss {lossf:.4f}, time {dt*1000:.2f}ms, mfu {running_mfu*100:.2f}%")
# This excerpt is from a real run (CPU, the tiny shape) of train.py with the overrides
# bench_gpu_mfu.py builds, its warning lines included.
REAL_LOG = """\
Overriding: wandb_log = False
tokens per iteration will be: 256
found vocab_size = 512 (inside data/lmforge_random/meta.pkl)
Initializing a new model from scratch
number of parameters: 0.13M
/work/main/.nanogpt/train.py:196: FutureWarning: `torch.cuda.amp.GradScaler(args...)` is deprecated.
  scaler = torch.cuda.amp.GradScaler(enabled=(dtype == 'float16'))
num decayed parameter tensors: 10, with 135,168 parameters
using fused AdamW: False
step 0: train loss 6.2474, val loss 6.2481
iter 0: loss 6.2543, time 33.36ms, mfu -100.00%
iter 1: loss 6.2435, time 17.44ms, mfu -100.00%
iter 2: loss 6.2494, time 15.04ms, mfu -100.00%
iter 39: loss 6.2391, time 7.38ms, mfu 0.01%
iter 40: loss 6.2548, time 7.36ms, mfu 0.01%
"""

# A stand-in for a nanoGPT checkout: it checks what train.py needs from its working
# directory (configurator.py, data/<dataset>/ with train.bin, val.bin and meta.pkl),
# records its arguments, and prints train.py's lines: iterations 0-4 at 100 ms, then
# 2, 3, 4 ms in turn (median of 5-40: 3 ms).
FAKE_TRAIN = """\
import os, pickle, sys
args = dict(a[2:].split("=", 1) for a in sys.argv[1:])
data = os.path.join("data", args["dataset"])
assert os.path.isfile("configurator.py")
vocab = pickle.load(open(os.path.join(data, "meta.pkl"), "rb"))["vocab_size"]
sizes = [os.path.getsize(os.path.join(data, s + ".bin")) for s in ("train", "val")]
open(os.environ["FAKE_RECORD"], "w").write(repr((sys.argv[1:], vocab, sizes)))
if os.environ.get("FAKE_FAIL"):
    print("iter 0: loss 6.2543, time 33.36ms, mfu -100.00%")
    sys.exit("RuntimeError: CUDA out of memory (stand-in)")
tokens = int(args["batch_size"]) * int(args["block_size"]) * int(args["gradient_accumulation_steps"])
print(f"tokens per iteration will be: {tokens:,}")
print("number of parameters: %.2fM" % (0.13,))
for iter_num in range(int(args["max_iters"]) + 1):
    dt = (100.0 if iter_num < 5 else 2.0 + iter_num % 3) / 1000
    running_mfu = -1.0 if iter_num < 5 else 0.0001
    print(f"iter {iter_num}: loss {6.25:.4f}, time {dt*1000:.2f}ms, mfu {running_mfu*100:.2f}%")
"""

# model.py's interface as the in-process profile uses it (GPTConfig, GPT(config) returning
# (logits, loss) for (idx, targets), configure_optimizers), on a one-layer stand-in.
FAKE_MODEL = """\
from dataclasses import dataclass
import torch
import torch.nn.functional as F
from torch import nn

@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50304
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True

class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, idx, targets=None):
        logits = self.lm_head(self.wte(idx))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        return torch.optim.AdamW(self.parameters(), lr=learning_rate, betas=betas,
                                 weight_decay=weight_decay)
"""


def fake_nanogpt(root: Path) -> Path:
    root.mkdir(parents=True)
    (root / "train.py").write_text(FAKE_TRAIN)
    (root / "model.py").write_text(FAKE_MODEL)
    (root / "configurator.py").write_text("")
    (root / "COMMIT").write_text("0123456789abcdef\n")
    return root


def run_script(*args: str, env: dict | None = None, ok: bool = True) -> str:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--steps", "3",
                           "--warmup", "1", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})
    assert (proc.returncode == 0) == ok, proc.stdout + proc.stderr
    return proc.stdout


# --------------------------------------------------------------------------- units


def test_the_parser_reads_train_py_lines():
    log = bench.parse_nanogpt_log(REAL_LOG)
    assert log["iter_ms"] == {0: 33.36, 1: 17.44, 2: 15.04, 39: 7.38, 40: 7.36}
    assert log["losses"][40] == 6.2548
    assert log["tokens_per_iter"] == 256 and log["params"] == pytest.approx(130_000)
    # The issue's GPU figures: 16,384 tokens at 34.6 ms per iteration, 123.59M parameters.
    lines = [f"tokens per iteration will be: {16 * 1024:,}",
             "number of parameters: %.2fM" % (123_587_328 / 1e6,)]  # noqa: UP031 (model.py's)
    lines += [f"iter {i}: loss {10.9:.4f}, time {(900.0 if i < 5 else 34.6):.2f}ms, "
              f"mfu {(-1.0 if i < 5 else 0.62) * 100:.2f}%" for i in range(41)]
    gpu = bench.nanogpt_figures(bench.parse_nanogpt_log("\n".join(lines)),
                                bench.GPT2_SMALL, bench.NANOGPT_WINDOW)
    assert gpu["iterations"] == 36 and gpu["ms_median"] == 34.6
    assert gpu["tok_s"] == pytest.approx(16384 / 0.0346)  # ~473,500, as issue 44 says
    # 6 N + 12 L d T with nanoGPT's N: ~404 TFLOP/s at that speed, as issue 44 says.
    assert gpu["flops_per_token"] * gpu["tok_s"] / 1e12 == pytest.approx(404.7, abs=0.5)


def test_the_median_window_and_the_ratios():
    ms = {i: float(i) for i in range(41)}  # iteration i took i ms
    assert bench.window_median(ms, 5, 40) == (22.5, 36)
    assert bench.window_median({4: 1.0, 5: 9.0, 6: 3.0, 7: 5.0}, 5, 40) == (5.0, 3)
    with pytest.raises(ValueError, match="no iteration in 5..40"):
        bench.window_median({0: 1.0, 4: 2.0}, 5, 40)
    doc = {"plain": {"tok_s": 330_798.0}, "fsdp": {"tok_s": 206_316.0},
           "nanogpt": {"tok_s": 473_000.0}}
    r = bench.ratios(doc)
    assert r["plain_over_nanogpt"] == pytest.approx(0.699, abs=1e-3)
    assert r["fsdp_over_plain"] == pytest.approx(0.624, abs=1e-3)
    assert set(bench.ratios({**doc, "nanogpt": None})) == {"fsdp_over_plain"}


def test_the_nanogpt_command_line_matches_the_issue_and_runs_offline(tmp_path):
    args = bench.nanogpt_overrides(bench.GPT2_SMALL, 16, 1, torch.device("cuda"), "bf16",
                                   True, 40, tmp_path / "out")
    issue = ["--batch_size=16", "--block_size=1024", "--n_layer=12", "--n_head=12",
             "--n_embd=768", "--bias=False", "--dropout=0.0", "--compile=True",
             "--dtype=bfloat16"]
    assert set(issue) <= set(args)
    assert {"--gradient_accumulation_steps=1", "--max_iters=40", "--log_interval=1",
            "--eval_iters=1", "--always_save_checkpoint=False", "--wandb_log=False",
            "--init_from=scratch", "--device=cuda", f"--out_dir={tmp_path / 'out'}",
            f"--dataset={bench.NANOGPT_DATASET}"} <= set(args)
    assert int(next(a for a in args if a.startswith("--eval_interval="))[16:]) > 40
    # configurator.py splits on '=' once per argument and needs '--key=value'.
    assert all(a.startswith("--") and a.count("=") == 1 for a in args)
    cpu = bench.nanogpt_overrides(bench.TINY, 4, 2, torch.device("cpu"), "fp32", False, 12,
                                  tmp_path)
    assert {"--device=cpu", "--dtype=float32", "--compile=False", "--block_size=64",
            "--gradient_accumulation_steps=2", "--max_iters=12"} <= set(cpu)


def test_all_puts_every_file_under_out_and_a_checkout_must_hold_train_py(
        tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench, "REPO", tmp_path)  # --all's default checkout: REPO/.nanogpt
    nano = fake_nanogpt(tmp_path / ".nanogpt")
    args = bench.parse_args(["--all", "--out", str(tmp_path / "o"), "--strategy", "plain"])
    assert args.nanogpt == str(nano) and args.strategy == "both"
    assert args.json == str(tmp_path / "o" / "bench_gpu_mfu.json")
    assert args.profile == str(tmp_path / "o" / "profile.txt")
    assert args.nanogpt_log == tmp_path / "o" / "nanogpt.log"
    plain = bench.parse_args(["--strategy", "plain"])
    assert plain.json is None and plain.profile is None and plain.nanogpt is None
    for argv, message in ((["--all"], "--all needs --out"),
                          (["--nanogpt", str(tmp_path)], "no train.py there")):
        with pytest.raises(SystemExit):
            bench.parse_args(argv)
        assert message in capsys.readouterr().err


def test_the_profile_table_ranks_cpu_ops_by_self_time():
    # 1,024-square: the matmul (2 GFLOP) outweighs relu and sum by ~100x even on a busy
    # 2-core runner, where a 256-square one lost to relu's first allocation once in CI.
    x = torch.randn(1024, 1024)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            (x @ x).relu().sum()
    rows = bench.top_events(prof.key_averages(), cuda=False, steps=3)
    assert rows[0]["name"] == "aten::mm" and rows[0]["calls"] == 3
    assert [r["self_ms"] for r in rows] == sorted((r["self_ms"] for r in rows), reverse=True)
    assert sum(r["share"] for r in rows) == pytest.approx(1.0)
    assert rows[0]["ms_per_step"] == pytest.approx(rows[0]["self_ms"] / 3)
    # No CUDA events in a CPU profile: the kernel table of a CUDA run would be empty here.
    assert bench.top_events(prof.key_averages(), cuda=True, steps=3) == []
    text = bench.format_profile({"kind": "CPU ops", "steps": 3, "top": rows,
                                 "ops_table": "TABLE"}, "TITLE")
    assert text.startswith("TITLE\ntop ") and "aten::mm" in text and text.endswith("TABLE\n")


def test_a_profiler_failure_keeps_the_step_figures(monkeypatch):
    def broken(*_args):
        raise RuntimeError("CUPTI_ERROR_NOT_INITIALIZED (stand-in)")

    monkeypatch.setattr(bench, "profile_step", broken)
    args = bench.parse_args(["--tiny", "--device", "cpu", "--compile", "false",
                             "--steps", "2", "--warmup", "0"])
    r = bench.measure("plain", args, torch.device("cpu"), bench.TINY, 2, profile_steps=1)
    assert r["tok_s"] > 0 and len(r["losses"]) == 2
    assert r["profile"] == {"error": "RuntimeError: CUPTI_ERROR_NOT_INITIALIZED (stand-in)"}


class CountingStep:
    """A stand-in step: sleeps ``seconds`` a call and counts the calls."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.calls = seconds, 0

    def run(self, _loader: object) -> float:
        self.calls += 1
        time.sleep(self.seconds)
        return float(self.calls)


@pytest.mark.parametrize("synced", [True, False])
def test_time_steps_times_each_step_once_back_to_back_or_alone(synced):
    step = CountingStep(0.002)
    t0 = time.perf_counter()
    times, losses = bench.time_steps(step, None, 5, torch.device("cpu"), synced=synced)
    wall = time.perf_counter() - t0
    assert losses == [1.0, 2.0, 3.0, 4.0, 5.0] and step.calls == 5
    assert len(times) == 5 and min(times) >= 0.002
    # Back to back, the intervals tile the run: nothing between steps goes untimed.
    assert sum(times) <= wall
    if not synced:
        assert sum(times) == pytest.approx(wall, abs=0.002)


# --------------------------------------------------------------------------- runs


def test_cpu_run_of_the_whole_check_writes_every_figure(tmp_path):
    nano, out = fake_nanogpt(tmp_path / "nano"), tmp_path / "out"
    record = tmp_path / "record"
    stdout = run_script("--device", "cpu", "--compile", "false", "--all", "--nanogpt",
                        str(nano), "--out", str(out), env={"FAKE_RECORD": str(record)})
    assert "fp32; eager" in stdout
    tok_s = float(re.search(r"\[plain\] tokens/s \(median of 3 steps back to back, as the loop runs them\): "
                            r"([\d,]+)",
                            stdout)[1].replace(",", ""))
    assert tok_s > 0
    assert "MFU vs spec peak: n/a (no known fp32 peak for cpu)" in stdout
    share = float(re.search(r"matmul measured here: ([\d.]+)%", stdout)[1])
    assert 0 < share < 100
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", stdout).groups())
    assert 5 < first < 7.5 and last < 7.5  # ln(512) = 6.24 at initialisation
    # Both strategies, from the same initial weights and data (FSDP built on meta), the
    # profiled plain step included.
    firsts = re.findall(r"\[(plain|fsdp)\] peak memory .*; loss ([\d.]+) ->", stdout)
    assert [name for name, _ in firsts] == ["plain", "fsdp"]
    assert firsts[0][1] == firsts[1][1]
    assert float(re.search(r"fsdp / plain tokens/s: ([\d.]+)", stdout)[1]) > 0
    # nanoGPT: run in a folder holding configurator.py and the random dataset it reads.
    argv, vocab, sizes = ast.literal_eval(record.read_text())
    assert vocab == 512 and min(sizes) >= 2 * 64 * 2
    assert "--block_size=64" in argv and "--n_layer=2" in argv and "--batch_size=4" in argv
    assert "median of iterations 5-40 (36): 3.00 ms/iter x 256 tokens = 85,333" in stdout
    doc = json.loads((out / "bench_gpu_mfu.json").read_text())
    check_document(doc, plain_tok_s=tok_s)
    assert doc["nanogpt"]["tok_s"] == pytest.approx(256 / 0.003)
    assert doc["nanogpt"]["commit"] == "0123456789abcdef"
    assert (out / "nanogpt.log").read_text().count("iter ") == 41
    profile = (out / "profile.txt").read_text()
    # The plain step's timeline: a Chrome trace of the profiled steps, gzipped.
    with gzip.open(out / "trace_plain.json.gz", "rt") as f:
        trace = json.load(f)
    assert any(e.get("name") == "aten::mm" for e in trace["traceEvents"])
    assert not (out / "trace_fsdp.json.gz").exists()
    assert "the plain step" in profile and "top " in profile and "CPU ops" in profile
    assert len(re.findall(r"^ +\d+ +[\d.]+ +[\d.]+% +\d+ +\S", profile, re.M)) == 15
    # Every strategy profiled, and nanoGPT's model.py stepped in this process beside it.
    assert "the fsdp step" in (out / "profile_fsdp.txt").read_text()
    assert "nanoGPT model.py in-process" in (out / "profile_nanogpt.txt").read_text()
    for key in ("profile", "profile_fsdp", "profile_nanogpt"):
        assert doc[key]["busy_ms_per_step"] > 0, key
    assert doc["profile_nanogpt"]["tok_s"] > 0


def check_document(doc: dict, plain_tok_s: float) -> None:
    """The JSON holds every figure the issue asks for."""
    for key in ("device", "torch", "shape", "micro", "tokens_per_step", "matmul_tflops",
                "spec_peak_tflops", "plain", "fsdp", "nanogpt", "ratios", "profile",
                "phases_s", "total_s"):
        assert key in doc, key
    assert doc["errors"] == {}
    for strategy in ("plain", "fsdp"):
        figures = doc[strategy]
        for key in ("tok_s", "tflops", "mfu_spec", "mfu_matmul", "peak_memory_mib",
                    "plan_total_mib", "plan_over_measured"):
            assert key in figures, (strategy, key)
        assert figures["plan_total_mib"] == pytest.approx(figures["plan"]["total"] / 2**20)
        assert figures["peak_memory_mib"] > 0 and figures["mfu_matmul"] > 0
    assert round(doc["plain"]["tok_s"]) == round(plain_tok_s)
    assert doc["ratios"]["plain_over_nanogpt"] == pytest.approx(
        doc["plain"]["tok_s"] / doc["nanogpt"]["tok_s"])
    assert doc["ratios"]["fsdp_over_plain"] == pytest.approx(
        doc["fsdp"]["tok_s"] / doc["plain"]["tok_s"])
    assert doc["profile"]["strategy"] == "plain" and len(doc["profile"]["top"]) == 15
    assert set(doc["phases_s"]) == {"plain", "fsdp", "nanogpt", "profile_nanogpt"}
    assert doc["profile_fsdp"]["strategy"] == "fsdp"


def test_a_failing_part_is_recorded_and_the_others_kept(tmp_path):
    nano, out = fake_nanogpt(tmp_path / "nano"), tmp_path / "out"
    stdout = run_script("--device", "cpu", "--compile", "false", "--strategy", "plain",
                        "--steps", "1", "--nanogpt", str(nano), "--out", str(out),
                        env={"FAKE_RECORD": str(tmp_path / "r"), "FAKE_FAIL": "1"}, ok=False)
    assert "[nanogpt] FAILED: RuntimeError: nanoGPT train.py exited 1" in stdout
    doc = json.loads((out / "bench_gpu_mfu.json").read_text())
    assert doc["plain"]["tok_s"] > 0 and doc["nanogpt"] is None
    assert "CUDA out of memory (stand-in)" in doc["errors"]["nanogpt"]
    assert "plain_over_nanogpt" not in doc["ratios"]


@pytest.mark.skipif(not NANOGPT_DIR, reason="NANOGPT_DIR names no nanoGPT checkout")
def test_real_nanogpt_train_py_runs_beside_the_step_on_cpu(tmp_path):
    out = tmp_path / "out"
    stdout = run_script("--device", "cpu", "--compile", "false", "--all", "--nanogpt",
                        NANOGPT_DIR, "--out", str(out))
    doc = json.loads((out / "bench_gpu_mfu.json").read_text())
    check_document(doc, plain_tok_s=doc["plain"]["tok_s"])
    nano = doc["nanogpt"]
    assert nano["iterations"] == 36 and nano["tokens_per_iter"] == 4 * 64
    assert 0.05e6 < nano["params"] < 0.2e6  # 2 x 64 wide, vocab 512: ~0.13M
    assert 5 < nano["loss_last"] < 7.5
    assert "plain / nanogpt tokens/s:" in stdout
    log = (out / "nanogpt.log").read_text()
    assert "found vocab_size = 512" in log and "Overriding: compile = False" in log


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_run_reports_mfu():
    out = run_script("--device", "cuda")
    assert re.search(r"MFU vs spec peak: [\d.]+% of \d+ TFLOP/s|MFU vs spec peak: n/a", out)


def test_the_plan_beside_the_step_is_of_the_loss_the_step_ran(tmp_path):
    out = tmp_path / "o"
    for loss, buffers in (("false", False), ("true", True)):
        stdout = run_script("--device", "cpu", "--compile", "false", "--strategy", "plain",
                            "--steps", "1", "--fused-loss", loss, "--json",
                            str(out / f"{loss}.json"))
        assert ("plain loss" if loss == "false" else "chunked loss") in stdout
        doc = json.loads((out / f"{loss}.json").read_text())
        assert (doc["plain"]["plan"]["loss_buffers"] > 0) is buffers


def test_the_src_digest_names_the_tree_that_ran(tmp_path):
    (tmp_path / "src" / "pkg").mkdir(parents=True)
    module = tmp_path / "src" / "pkg" / "a.py"
    module.write_text("x = 1\n")
    first = bench.src_digest(tmp_path)
    assert first == bench.src_digest(tmp_path) and len(first) == 64
    module.write_text("x = 2\n")
    assert bench.src_digest(tmp_path) != first
    out = subprocess.run([sys.executable, str(SCRIPT), "--src-sha256"], capture_output=True,
                         text=True, timeout=120, check=True).stdout.strip()
    assert out == bench.src_digest()
