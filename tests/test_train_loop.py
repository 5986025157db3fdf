"""The training loop and stage: accumulation, the non-finite guard, checkpoints, resume."""

from __future__ import annotations

import contextlib
import copy
import io
import json
import math
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from stores import seed_store

from lmforge.config import ModelConfig, Params, TrainConfig
from lmforge.errors import ConfigError, InputError, LmforgeError
from lmforge.model import Llama, load_model
from lmforge.model import llama as llama_module
from lmforge.shards import ShardSet, WindowLoader, eval_batches
from lmforge.shards.writer import write_shards
from lmforge.tokenizer.files import tokenizer_sha256
from lmforge.train import checkpoint as ckpt
from lmforge.train import runs
from lmforge.train.compiler import compile_support, resolve_compile
from lmforge.train.distributed import DistEnv
from lmforge.train.loop import TrainData, train
from lmforge.train.pipeline import TrainPaths
from lmforge.train.precision import resolve_precision
from lmforge.train.step import optimizer_step

REPO = Path(__file__).resolve().parents[1]
CPU = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def write_tokenizer(path: Path) -> int:
    """A tiny BPE sentencepiece model at ``path`` (a folder such as models/tokenizer gets
    tokenizer.model); returns its vocab size."""
    import sentencepiece as spm

    path = path if path.suffix else path / "tokenizer.model"

    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "kappa", "omega", "sigma", "tau"]
    sents = [" ".join(rng.choice(words, 10)) for _ in range(200)]
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(sents), model_writer=buf,
                                   vocab_size=300, model_type="bpe", byte_fallback=True,
                                   minloglevel=2)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(buf.getvalue())
    return 300


def make_inputs(root: Path) -> TrainPaths:
    """Tokenizer + train/val shards under ``root`` in the repo layout."""
    paths = TrainPaths().under(root)
    vocab = write_tokenizer(paths.tokenizer)
    sha = tokenizer_sha256(paths.tokenizer)
    rng = np.random.default_rng(1)
    for directory, ndocs in ((paths.train_shards, 60), (paths.val_shards, 8)):
        # Learnable documents: each token is a fixed function of the one before, mostly.
        docs = []
        for _ in range(ndocs):
            t = [int(rng.integers(3, vocab))]
            for _ in range(int(rng.integers(40, 120))):
                t.append((t[-1] * 7 + 3) % vocab if rng.random() < 0.8
                         else int(rng.integers(3, vocab)))
            docs.append(t + [2])
        write_shards(directory, docs, vocab, tokenizer_sha256=sha, shard_tokens=2000)
    return paths


def tiny_params(**train_kw) -> Params:
    train = dict(max_steps=30, micro_batch_size=4, max_lr=3e-3, warmup=3, log_every=5,
                 eval_every=10, eval_batches=2, ckpt_every=5, keep_last=2, num_threads=1,
                 compile=False)  # compiled training has its own tests
    train.update(train_kw)
    return Params(model=ModelConfig(n_layer=2, n_head=4, n_embd=64, seq_len=32),
                  train=TrainConfig(**train))


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> TrainPaths:
    return make_inputs(tmp_path_factory.mktemp("repo"))


def open_data(paths: TrainPaths) -> TrainData:
    return TrainData(ShardSet(paths.train_shards), ShardSet(paths.val_shards), WindowLoader,
                     eval_batches)


def run(params: Params, paths: TrainPaths, ckpt_dir: Path, logs: list[str] | None = None):
    return train(params, open_data(paths), ckpt_dir, "t" * 64, CPU, track=False,
                 log=(logs.append if logs is not None else lambda _: None))


class ListLoader:
    """Hands out the given batches in order (for the accumulation test)."""

    def __init__(self, batches):
        self.batches = list(batches)

    def next_batch(self):
        return self.batches.pop(0)


def test_accumulated_micro_batches_give_the_full_batch_gradient():
    torch.manual_seed(0)
    cfg = ModelConfig(n_layer=2, n_head=2, n_embd=32, seq_len=16)
    base = Llama(cfg, 64)
    x, y = torch.randint(0, 64, (2, 8, 16))
    updates = []
    for accum in (1, 4):
        model = copy.deepcopy(base)
        before = [p.detach().clone() for p in model.parameters()]
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        prec = resolve_precision("fp32", CPU.device)
        b = 8 // accum
        loader = ListLoader((x[i:i + b], y[i:i + b]) for i in range(0, 8, b))
        loss, norm, _ = optimizer_step(model, None, model, opt, prec.grad_scaler(), prec,
                                       loader, accum, 0.0, CPU)
        assert not loader.batches  # every micro-batch was used
        updates.append(([b0 - p.detach() for b0, p in zip(before, model.parameters(),
                                                            strict=True)], loss, norm))
    (g1, loss1, n1), (g4, loss4, n4) = updates
    assert loss4 == pytest.approx(loss1, rel=1e-5) and n4 == pytest.approx(n1, rel=1e-4)
    for a, b in zip(g1, g4, strict=True):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-4)
    assert any(a.abs().sum() > 0 for a in g1)


@pytest.mark.parametrize("fused", [True, False])
def test_micro_batches_weigh_by_their_target_tokens_and_an_all_masked_one_by_zero(fused):
    """Prompt-masked fine-tuning: the step's loss is the mean over all its target tokens,
    however they fall into micro-batches; a micro-batch without targets adds nothing."""
    torch.manual_seed(0)
    cfg = ModelConfig(n_layer=2, n_head=2, n_embd=32, seq_len=16)
    base = Llama(cfg, 64)
    base.fused_loss = fused
    x, y = torch.randint(0, 64, (2, 4, 16))
    y[0, :10] = -100  # few targets in the first micro-batch
    y[1] = -100  # none in the second
    y[2, 3:] = -100

    def step(batches):
        model = copy.deepcopy(base)
        before = [p.detach().clone() for p in model.parameters()]
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        prec = resolve_precision("fp32", CPU.device)
        loss, norm, _ = optimizer_step(model, None, model, opt, prec.grad_scaler(), prec,
                                       ListLoader(batches), len(batches), 0.0, CPU)
        return [b - p.detach() for b, p in zip(before, model.parameters(), strict=True)], loss

    whole, loss_whole = step([(x, y)])  # one batch: the mean over its target tokens
    split, loss_split = step([(x[i:i + 1], y[i:i + 1]) for i in range(4)])
    assert math.isfinite(loss_split) and loss_split == pytest.approx(loss_whole, rel=1e-5)
    for a, b in zip(whole, split, strict=True):
        assert torch.isfinite(b).all()
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-4)
    # Without the empty micro-batch: the same step.
    kept, loss_kept = step([(x[i:i + 1], y[i:i + 1]) for i in (0, 2, 3)])
    assert loss_kept == pytest.approx(loss_whole, rel=1e-5)
    for a, b in zip(kept, split, strict=True):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-4)


def test_grad_norm_is_logged_before_clipping():
    torch.manual_seed(0)
    model = Llama(ModelConfig(n_layer=1, n_head=2, n_embd=16, seq_len=8), 32)
    x, y = torch.randint(0, 32, (2, 4, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    prec = resolve_precision("fp32", CPU.device)
    _, norm, _ = optimizer_step(model, None, model, opt, prec.grad_scaler(), prec,
                                ListLoader([(x, y)]), 1, 1e-3, CPU)
    assert norm > 1e-3  # the clip threshold did not cap the reported norm


def test_training_reduces_loss_and_writes_history(inputs, tmp_path):
    result = run(tiny_params(max_steps=40, eval_every=20), inputs, tmp_path / "ck")
    rows = result.history
    losses = [r["loss"] for r in rows if "loss" in r]
    assert losses[-1] < losses[0] - 0.5
    assert [r["step"] for r in rows] == sorted({5 * i for i in range(1, 9)} | {20})
    assert result.metrics["steps"] == 40 and result.metrics["tokens"] == 40 * 4 * 32
    assert result.metrics["val_loss"] < np.log(300)
    run_dir = tmp_path / "ck" / runs.run_id(result.fingerprint)
    assert sorted(p.name for p in run_dir.glob("*.pt")) == ["step-000035.pt", "step-000040.pt"]
    # A checkpoint carries its model config: `lmforge generate --model <ckpt>` loads it.
    model, config = load_model(run_dir / "step-000040.pt")
    assert config["step"] == 40 and config["vocab_size"] == 300
    final = result.model.state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, final[name]), name


def test_non_finite_steps_are_skipped_then_stop(inputs, tmp_path, monkeypatch):
    original = llama_module.linear_cross_entropy  # the training loss (fused path)
    calls = {"n": 0}

    def flaky_loss(*args, **kwargs):
        calls["n"] += 1
        loss = original(*args, **kwargs)
        return loss * float("nan") if calls["n"] in (3, 4) else loss

    monkeypatch.setattr(llama_module, "linear_cross_entropy", flaky_loss)
    result = run(tiny_params(max_steps=8, ckpt_every=100, eval_every=0), inputs,
                 tmp_path / "a")
    assert result.metrics["skipped_steps"] == 2
    assert all(torch.isfinite(p).all() for p in result.model.parameters())

    monkeypatch.setattr(llama_module, "linear_cross_entropy",
                        lambda *a, **k: original(*a, **k) * float("inf"))
    logs: list[str] = []
    with pytest.raises(LmforgeError, match="3 consecutive steps"):
        run(tiny_params(max_steps=20, max_bad_steps=3, eval_every=0), inputs, tmp_path / "b",
            logs)
    assert sum("update skipped" in line for line in logs) == 3


def test_each_run_keeps_its_own_checkpoints(inputs, tmp_path):
    ck = tmp_path / "ck"
    first = run(tiny_params(max_steps=10, eval_every=0), inputs, ck)
    assert first.metrics["resumed_from"] is None
    again = run(tiny_params(max_steps=10, eval_every=0, log_every=2), inputs, ck)  # logging only
    assert again.metrics["resumed_from"] == "step-000010.pt"
    other = run(tiny_params(max_steps=10, eval_every=0, max_lr=1e-3), inputs, ck)
    assert other.metrics["resumed_from"] is None
    # Two runs, two directories; the first run's checkpoints are still all there.
    dirs = {d.name: d for d in ck.iterdir() if d.is_dir()}
    assert set(dirs) == {runs.run_id(first.fingerprint), runs.run_id(other.fingerprint)}
    mine = dirs[runs.run_id(first.fingerprint)]
    assert [p.name for p in ckpt.list_checkpoints(mine)] == ["step-000005.pt", "step-000010.pt"]
    record = json.loads((mine / "run.json").read_text())
    assert record["fingerprint"] == first.fingerprint and record["last_step"] == 10
    assert record["status"] == "finished" and record["identity"]["train"]["max_lr"] == 3e-3
    assert ckpt.fingerprint_of(record["identity"]) == first.fingerprint
    back = run(tiny_params(max_steps=10, eval_every=0), inputs, ck)
    assert back.metrics["resumed_from"] == "step-000010.pt"


def test_keep_last_prunes_only_within_the_run(inputs, tmp_path):
    ck = tmp_path / "ck"
    a = run(tiny_params(max_steps=10, eval_every=0, ckpt_every=2, keep_last=2), inputs, ck)
    b = run(tiny_params(max_steps=6, eval_every=0, ckpt_every=2, keep_last=1), inputs, ck)
    names = {d: [p.name for p in ckpt.list_checkpoints(ck / runs.run_id(r.fingerprint))]
             for d, r in (("a", a), ("b", b))}
    assert names == {"a": ["step-000008.pt", "step-000010.pt"], "b": ["step-000006.pt"]}


def test_the_last_step_is_checkpointed_so_a_finished_run_is_not_trained_again(inputs,
                                                                             tmp_path):
    ck = tmp_path / "ck"
    done = run(tiny_params(max_steps=7, eval_every=0, ckpt_every=5), inputs, ck)
    logs: list[str] = []
    again = run(tiny_params(max_steps=7, eval_every=0, ckpt_every=5), inputs, ck, logs)
    assert again.metrics["resumed_from"] == "step-000007.pt"
    assert not any(line.startswith("step ") for line in logs)  # no training step ran
    for name, tensor in done.model.state_dict().items():
        assert torch.equal(again.model.state_dict()[name], tensor), name


def test_flat_layout_checkpoints_are_moved_into_their_run(inputs, tmp_path):
    ck = tmp_path / "ck"
    first = run(tiny_params(max_steps=10, eval_every=0), inputs, ck)
    mine = ck / runs.run_id(first.fingerprint)
    for f in ckpt.list_checkpoints(mine):  # as an older lmforge left them
        f.replace(ck / f.name)
    shutil.rmtree(mine)
    logs: list[str] = []
    again = run(tiny_params(max_steps=10, eval_every=0), inputs, ck, logs)
    assert again.metrics["resumed_from"] == "step-000010.pt"
    assert any("moved 2 checkpoint(s) of the flat layout" in line for line in logs)
    assert not list(ck.glob("step-*.pt"))


def test_a_run_being_trained_is_locked_against_a_second_process(inputs, tmp_path):
    ck = tmp_path / "ck"
    params = tiny_params(max_steps=5, eval_every=0)
    fp = run(params, inputs, ck).fingerprint
    with runs.locked(ck / runs.run_id(fp)):
        assert runs.is_locked(ck / runs.run_id(fp))
        probe = subprocess.run(
            [sys.executable, "-c", "import sys; from lmforge.train import runs\n"
             "try:\n    runs.locked(sys.argv[1]).__enter__()\n"
             "except Exception as e:\n    print(e)", str(ck / runs.run_id(fp))],
            capture_output=True, text=True, check=True)
        assert f"is being trained by another process (pid {os.getpid()})" in probe.stdout
    assert not runs.is_locked(ck / runs.run_id(fp))


def test_checkpoint_and_run_json_are_fsynced_before_and_after_the_rename(tmp_path,
                                                                        monkeypatch):
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(a, b):
        events.append(("rename", str(b)))
        return real_replace(a, b)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    path = ckpt.save_checkpoint(tmp_path, 3, {"x": torch.ones(2)}, keep_last=2)
    kinds = [k for k, _ in events]
    assert kinds == ["fsync", "rename", "fsync"], events
    assert events[0][1].endswith(".tmp") and events[1][1] == str(path)
    assert events[2][1] == str(tmp_path)  # the directory entry of the rename


def test_corrupt_newest_checkpoint_falls_back_to_the_previous(inputs, tmp_path):
    ck = tmp_path / "ck"
    result = run(tiny_params(max_steps=10, eval_every=0), inputs, ck)
    ck = ck / runs.run_id(result.fingerprint)
    newest = ck / "step-000010.pt"
    newest.write_bytes(newest.read_bytes()[:1000])  # truncated, as by a full disk
    logs: list[str] = []
    state, path = ckpt.load_resumable(ck, result.fingerprint, logs.append)
    assert path.name == "step-000005.pt" and state["step"] == 5
    assert "unreadable" in logs[0] and "step-000010.pt" in logs[0]


# --------------------------------------------------------------------------- the real stage

# Runs the stage as DVC does, with data loading slowed down so the kill lands mid-run.
_RUNNER = """
import sys, time
from lmforge.shards import loader
_next = loader.WindowLoader.next_batch
def slow(self):
    time.sleep(0.02)
    return _next(self)
loader.WindowLoader.next_batch = slow
from lmforge.stage import run_stage
from stages.train import main
run_stage(main)
"""


def stage_repo(root: Path) -> Path:
    make_inputs(root)
    params = yaml.safe_load((REPO / "params.yaml").read_text(encoding="utf-8"))
    params["model"] = {"n_layer": 2, "n_head": 4, "n_embd": 64, "seq_len": 32}
    params["train"] = {"max_steps": 30, "micro_batch_size": 4, "max_lr": 3e-3, "warmup": 3,
                       "log_every": 5, "eval_every": 10, "eval_batches": 2, "ckpt_every": 5,
                       # Two threads: parallel kernels must still give the same bits.
                       "keep_last": 2, "num_threads": 2}
    (root / "params.yaml").write_text(yaml.safe_dump(params), encoding="utf-8")
    (root / "runner.py").write_text(_RUNNER, encoding="utf-8")
    return root


def tracked_env(mlflow_db: Path) -> dict[str, str]:
    """The variables that make a training process track into ``mlflow_db`` (made empty
    first unless it exists), whatever the suite's default (conftest: tracking off)."""
    seed_store(mlflow_db)
    return {"LMFORGE_TRACKING": "on", "MLFLOW_TRACKING_URI": f"sqlite:///{mlflow_db}"}


def start_stage(root: Path, tracked: bool = False) -> subprocess.Popen:
    """The train stage in ``root``, tracked into an MLflow store beside it if asked."""
    tracking = tracked_env(root.parent / "mlflow.db") if tracked else {}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "src"), str(REPO)]),
               DVC_ROOT=str(root), **tracking)
    return subprocess.Popen([sys.executable, "runner.py"], cwd=root, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen) -> str:
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    return out


def test_sigkill_then_resume_is_bit_identical(tmp_path):
    # The straight run is tracked in MLflow, the killed one not (MLflow's start-up is
    # seconds in each of its three processes): the weights agree all the same.
    straight = stage_repo(tmp_path / "straight")
    out = finish(start_stage(straight, tracked=True))
    assert "resuming" not in out
    # train.compile is auto: where Inductor can build, this checks the compiled step.
    if compile_support(torch.device("cpu")) is None:
        assert ", compiled" in out, out
    assert ", chunked loss" in out, out  # the first line names the loss path too

    killed = stage_repo(tmp_path / "killed")
    proc = start_stage(killed)
    ck_root = killed / "models" / "checkpoints"
    deadline = time.monotonic() + 60
    while (not list(ck_root.glob("*/step-000010.pt")) and time.monotonic() < deadline
           and proc.poll() is None):
        time.sleep(0.002)
    assert proc.poll() is None, "the run ended before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (killed / "models" / "final").exists()
    (run_a,) = [d for d in ck_root.iterdir() if d.is_dir()]
    killed_at = [p.name for p in ckpt.list_checkpoints(run_a)]

    # While A is paused, an experiment with another learning rate runs to the end...
    params_a = (killed / "params.yaml").read_text(encoding="utf-8")
    params_b = yaml.safe_load(params_a)
    params_b["train"]["max_lr"] = 1e-3
    params_b["train"]["compile"] = False  # B need only run to its end beside A: no compile
    (killed / "params.yaml").write_text(yaml.safe_dump(params_b), encoding="utf-8")
    out = finish(start_stage(killed))
    assert "resuming" not in out
    assert [p.name for p in ckpt.list_checkpoints(run_a)] == killed_at  # A untouched
    assert len([d for d in ck_root.iterdir() if d.is_dir()]) == 2

    # ... and A, rerun, resumes from its own last checkpoint, not from step 0.
    (killed / "params.yaml").write_text(params_a, encoding="utf-8")
    out = finish(start_stage(killed))
    assert f"resuming from {run_a / killed_at[-1]}" in out, out

    final_a = straight / "models" / "final"
    final_b = killed / "models" / "final"
    assert ((final_a / "model.safetensors").read_bytes()
            == (final_b / "model.safetensors").read_bytes())
    metrics_a = json.loads((straight / "metrics" / "train.json").read_text())
    metrics_b = json.loads((killed / "metrics" / "train.json").read_text())
    assert metrics_b["resumed_from"] and metrics_a["resumed_from"] is None
    assert metrics_a["val_loss"] == metrics_b["val_loss"]
    assert metrics_a["train_loss"] == metrics_b["train_loss"]

    # The stage's other outputs: config + tokenizer copy, run id, curve.
    model, config = load_model(final_a)
    assert config["vocab_size"] == 300 and config["special_ids"]["eos"] == 2
    assert (final_a / "tokenizer.model").read_bytes() == (
        straight / "models" / "tokenizer" / "tokenizer.model").read_bytes()
    assert json.loads((final_a / "run.json").read_text())["mlflow_run_id"]
    tsv = (straight / "plots" / "train.tsv").read_text().splitlines()
    assert tsv[0].split("\t") == ["step", "loss", "lr", "grad_norm", "tokens_per_sec"]
    assert len(tsv) == 1 + 6 and all(cell for row in tsv for cell in row.split("\t"))
    val = (straight / "plots" / "val.tsv").read_text().splitlines()
    assert val[0].split("\t") == ["step", "val_loss"]
    steps = [int(row.split("\t")[0]) for row in val[1:]]
    assert steps and 10 in steps and 5 not in steps  # only where val loss was measured


def test_rng_states_round_trip_through_a_weights_only_checkpoint(tmp_path):
    import random

    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    saved = ckpt.capture_rng(CPU.device)
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    torch.save({"rng": saved}, tmp_path / "r.pt")
    ckpt.restore_rng(torch.load(tmp_path / "r.pt", weights_only=True)["rng"], CPU.device)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


def start_ranks(root: Path, argv: list[str], mlflow_db: Path | None = None
                ) -> list[subprocess.Popen]:
    """Start ``python argv`` as two gloo ranks, as torchrun would (its launcher would
    only add start-up time); rank 0 tracks into ``mlflow_db`` when one is given."""
    tracking = {} if mlflow_db is None else tracked_env(mlflow_db)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = []
    for rank in range(2):
        # This checkout's src first: the venv's editable install may be another checkout's.
        path = os.pathsep.join([str(REPO / "src"), str(REPO)])
        env = dict(os.environ, PYTHONPATH=path, DVC_ROOT=str(root), RANK=str(rank),
                   LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **tracking)
        procs.append(subprocess.Popen([sys.executable, *argv], cwd=root, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    return procs


def wait_ranks(procs: list[subprocess.Popen]) -> list[str]:
    """Wait for every rank; each must succeed. Their output, by rank."""
    outs = []
    for proc in procs:
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, out
        outs.append(out)
    return outs


def run_two_ranks(root: Path, module: str, mlflow_db: Path | None = None) -> list[str]:
    """Run ``python -m module`` as two gloo ranks; return their output."""
    return wait_ranks(start_ranks(root, ["-m", module], mlflow_db))


@pytest.mark.slow
@pytest.mark.parametrize("compile_", [False, "auto"])
def test_two_process_ddp_matches_one_process_with_the_same_global_batch(tmp_path, compile_):
    """torchrun (gloo) with 2 x 4 windows per step ~ one process with 8 windows per step."""
    from safetensors.torch import load_file

    root = stage_repo(tmp_path / "ddp")
    params = yaml.safe_load((root / "params.yaml").read_text(encoding="utf-8"))
    params["train"].update(nproc=2, micro_batch_size=4, max_steps=10, eval_every=0,
                           compile=compile_)
    (root / "params.yaml").write_text(yaml.safe_dump(params), encoding="utf-8")
    outs = run_two_ranks(root, "stages.train")
    if compile_ == "auto" and compile_support(torch.device("cpu")) is None:
        assert ", compiled" in outs[0], outs[0]  # torch.compile over DistributedDataParallel
    metrics = json.loads((root / "metrics" / "train.json").read_text())
    assert metrics["world_size"] == 2 and metrics["tokens"] == 10 * 8 * 32
    ddp = load_file(root / "models" / "final" / "model.safetensors")

    # The same windows per step in one process: rank r of 2 takes every other window.
    single = run(tiny_params(max_steps=10, micro_batch_size=8, eval_every=0),
                 TrainPaths().under(root), tmp_path / "single").model.state_dict()
    for name, weight in ddp.items():
        assert torch.allclose(weight, single[name], atol=2e-4), name


# --------------------------------------------------------------------------- samples, doc mask

class RecordingRun:
    """Stands in for the MLflow run: keeps what the loop logs."""

    run_id = "recording"

    def __init__(self):
        self.texts: dict[str, str] = {}
        self.metrics: list[tuple[int, dict]] = []

    def log_metrics(self, metrics, step):
        self.metrics.append((step, dict(metrics)))

    def log_text(self, text, artifact_file):
        self.texts[artifact_file] = text

    def finish(self, status="FINISHED"):
        self.status = status


def test_fixed_prompt_samples_are_logged_without_touching_training(inputs, tmp_path,
                                                                   monkeypatch):
    from lmforge.train import loop

    recorder = RecordingRun()
    monkeypatch.setattr(loop, "open_run", lambda params, run_id=None, stage="train": recorder)
    params = tiny_params(max_steps=6, sample_every=3, eval_every=0, ckpt_every=100)
    prompts = [("alpha beta", [1, 5, 6]), ("", [1])]
    sampled = train(params, open_data(inputs), tmp_path / "a", "t" * 64, CPU, track=True,
                    prompts=prompts, decode=lambda ids: " ".join(map(str, ids)),
                    log=lambda _: None)
    assert sorted(recorder.texts) == ["samples/step-000003.txt", "samples/step-000006.txt"]
    body = recorder.texts["samples/step-000003.txt"]
    assert "### alpha beta" in body and "### (unconditional)" in body
    # Each prompt is followed by its 64-token continuation (decode joins ids with spaces).
    first = body.split("### alpha beta\n", 1)[1].splitlines()[0]
    assert first.startswith("alpha beta") and len(first[len("alpha beta"):].split()) == 64
    plain = run(tiny_params(max_steps=6, eval_every=0, ckpt_every=100), inputs, tmp_path / "b")
    for a, b in zip(sampled.model.parameters(), plain.model.parameters(), strict=True):
        assert torch.equal(a, b)  # sampling consumed none of the training randomness


def test_doc_mask_training_uses_document_positions(inputs, tmp_path):
    params = tiny_params(max_steps=12, eval_every=6, ckpt_every=100)
    masked = copy.deepcopy(params)
    masked.model.doc_mask = True
    plain_run = run(params, inputs, tmp_path / "a")
    masked_run = run(masked, inputs, tmp_path / "b")
    losses = [r["loss"] for r in masked_run.history if "loss" in r]
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]
    assert np.isfinite(masked_run.metrics["val_loss"])
    # Same batches, same init: only the attention pattern differs.
    assert masked_run.metrics["val_loss"] != plain_run.metrics["val_loss"]
    assert masked_run.fingerprint != plain_run.fingerprint


def test_compile_setting_resolves_per_device(monkeypatch):
    cpu = torch.device("cpu")
    assert resolve_compile(False, cpu) == (False, "eager")
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    on, how = resolve_compile("auto", cpu)
    assert not on and "no C++ compiler on PATH (no-such-compiler-here)" in how
    with pytest.raises(ConfigError, match="train.compile: true, but torch.compile cannot run"):
        resolve_compile(True, cpu)
    monkeypatch.delenv("CXX")
    if compile_support(cpu) is None:
        assert resolve_compile("auto", cpu) == (True, "compiled")


def test_compile_setting_does_not_change_the_run_fingerprint():
    fps = {ckpt.fingerprint(ModelConfig(), TrainConfig(compile=c, fused_loss=f), 1, {}, {}, "t")
           for c in ("auto", True, False) for f in (True, False)}
    assert len(fps) == 1
    assert ckpt.fingerprint(ModelConfig(), TrainConfig(max_lr=1e-4), 1, {}, {}, "t") not in fps


def test_init_from_starts_from_saved_weights_and_checks_them(inputs, tmp_path):
    from lmforge.model.saved import save_model

    base = run(tiny_params(max_steps=10, eval_every=0), inputs, tmp_path / "a")
    saved = tmp_path / "base"
    save_model(base.model, saved, tokenizer_sha256="t" * 64)
    logs: list[str] = []
    # A learning rate of ~0: the continued run's weights stay the saved ones.
    cont = run(tiny_params(max_steps=1, max_lr=1e-12, eval_every=0, init_from=str(saved)),
               inputs, tmp_path / "b", logs)
    assert any(line.startswith(f"train: weights from {saved}") for line in logs)
    for name, tensor in base.model.state_dict().items():
        assert torch.allclose(cont.model.state_dict()[name], tensor, atol=1e-8), name
    fresh = run(tiny_params(max_steps=1, max_lr=1e-12, eval_every=0), inputs, tmp_path / "c")
    assert cont.metrics["val_loss"] == pytest.approx(base.metrics["val_loss"], abs=1e-6)
    assert cont.metrics["val_loss"] < fresh.metrics["val_loss"] - 0.1

    # The run's context is its own (RoPE has no learned positions); the architecture is
    # the source's, and a line names the model keys of params.yaml it does not use.
    longer = tiny_params(max_steps=1, eval_every=0, init_from=str(saved))
    longer.model.seq_len = 48
    logs.clear()
    assert run(longer, inputs, tmp_path / "d", logs).model.config.seq_len == 48
    assert not any("are not used" in line for line in logs), logs
    wider = tiny_params(max_steps=1, eval_every=0, init_from=str(saved))
    wider.model.n_embd, wider.model.n_layer = 128, 3
    logs.clear()
    adopted = run(wider, inputs, tmp_path / "e", logs).model.config
    assert (adopted.n_embd, adopted.n_layer) == (64, 2)
    assert any(line.endswith("params.yaml's model.n_layer, model.n_embd are not used")
               for line in logs), logs
    other_tok = tmp_path / "other-tokenizer"
    save_model(base.model, other_tok, tokenizer_sha256="u" * 64)
    with pytest.raises(InputError, match="set tokenizer.init_from"):
        run(tiny_params(max_steps=1, init_from=str(other_tok)), inputs, tmp_path / "f")
    # A checkpoint of the run's own folder: refused, and not pruned as another run's.
    own = tmp_path / "a" / runs.run_id(base.fingerprint) / "step-000010.pt"
    with pytest.raises(InputError, match=r"train.init_from: .*step-000010.pt is inside "
                                         r".*where runs prune their checkpoints; copy it"):
        run(tiny_params(max_steps=1, init_from=str(own)), inputs, tmp_path / "a")
    assert own.is_file()
    # From another folder, a full checkpoint is a source like a model dir.
    run(tiny_params(max_steps=1, eval_every=0, init_from=str(own)), inputs, tmp_path / "h")
    bare = tmp_path / "bare.safetensors"
    bare.write_bytes((saved / "model.safetensors").read_bytes())
    with pytest.raises(InputError, match=r"^train.init_from: .*bare.safetensors"):
        run(tiny_params(max_steps=1, init_from=str(bare)), inputs, tmp_path / "i")
    with pytest.raises(InputError, match="(?i)init_from: .*nothing.*: no such file or directory"):
        run(tiny_params(max_steps=1, init_from=str(tmp_path / "nothing")), inputs,
            tmp_path / "g")


def test_init_from_a_model_with_padded_embeddings_keeps_its_rows(inputs, tmp_path):
    """Qwen pads its embedding past the tokenizer's ids: the run keeps the rows; a model
    with fewer rows than the tokenizer has ids is refused."""
    from lmforge.model.saved import save_model

    cfg = tiny_params().model
    for vocab in (320, 280):
        torch.manual_seed(0)
        save_model(Llama(cfg, vocab), tmp_path / f"v{vocab}", tokenizer_sha256="t" * 64)
    result = run(tiny_params(max_steps=2, eval_every=0, init_from=str(tmp_path / "v320")),
                 inputs, tmp_path / "a")
    assert result.model.vocab_size == 320 and math.isfinite(result.metrics["val_loss"])
    with pytest.raises(InputError, match=r"^train.init_from: .*v280 has vocab_size 280, "
                                         r"the shards 300"):
        run(tiny_params(max_steps=2, init_from=str(tmp_path / "v280")), inputs,
            tmp_path / "b")


def test_init_from_new_weights_under_the_same_path_are_not_resumed(inputs, tmp_path):
    from lmforge.model.saved import save_model

    saved = tmp_path / "base"
    first = run(tiny_params(max_steps=5, eval_every=0), inputs, tmp_path / "a")
    save_model(first.model, saved, tokenizer_sha256="t" * 64)
    params = tiny_params(max_steps=5, eval_every=0, init_from=str(saved))
    ck = tmp_path / "ck"
    assert run(params, inputs, ck).metrics["resumed_from"] is None
    assert run(params, inputs, ck).metrics["resumed_from"] == "step-000005.pt"
    second = run(tiny_params(max_steps=6, eval_every=0), inputs, tmp_path / "b")
    save_model(second.model, saved, tokenizer_sha256="t" * 64)  # same path, new weights
    assert run(params, inputs, ck).metrics["resumed_from"] is None


@pytest.mark.skipif(compile_support(torch.device("cpu")) is not None,
                    reason="torch.compile cannot build here")
def test_compiled_step_with_doc_mask_and_activation_checkpointing_matches_eager(inputs,
                                                                              tmp_path):
    results = []
    for compile_ in (False, True):
        params = tiny_params(max_steps=4, eval_every=0, log_every=1, compile=compile_,
                             activation_checkpointing=True)
        params.model.doc_mask = True
        results.append(run(params, inputs, tmp_path / str(compile_)))
    eager, compiled = ([row["loss"] for row in r.history] for r in results)
    assert len(eager) == 4 and eager == pytest.approx(compiled, rel=1e-4)


def test_compile_auto_falls_back_to_eager_when_the_first_step_fails(inputs, tmp_path,
                                                                      monkeypatch):
    from torch._dynamo.exc import TorchDynamoException

    from lmforge.train import loop

    class Broken(torch.nn.Module):
        """What torch.compile gives when the toolchain fails: an error at the first call."""

        def forward(self, *args, **kwargs):
            raise TorchDynamoException("C++ compile error: omp.h: No such file")

    monkeypatch.setattr(loop, "resolve_compile",
                        lambda requested, device: (requested is not False, "compiled"))
    monkeypatch.setattr(loop.torch, "compile", lambda module: Broken())
    logs: list[str] = []
    fell_back = run(tiny_params(max_steps=6, eval_every=0, compile="auto"), inputs,
                    tmp_path / "a", logs)
    assert sum("torch.compile failed (C++ compile error: omp.h" in line for line in logs) == 1
    eager = run(tiny_params(max_steps=6, eval_every=0), inputs, tmp_path / "b")
    for name, tensor in eager.model.state_dict().items():
        assert torch.equal(fell_back.model.state_dict()[name], tensor), name
    # Asked for explicitly, a failing compile is a one-line error, not a silent fallback.
    with pytest.raises(LmforgeError, match=r"^train.compile: true, but torch.compile failed "
                                           r"\(C\+\+ compile error: omp.h: No such file\); "
                                           r"set train.compile to auto or false$"):
        run(tiny_params(max_steps=6, eval_every=0, compile=True), inputs, tmp_path / "c")


def test_fp16_overflow_that_never_ends_stops_the_run():
    from lmforge.train.loop import FP16_OVERFLOW_LIMIT, check_fp16_overflow
    from lmforge.train.precision import Precision

    class Scaler:
        def get_scale(self):
            return 2.0 ** -14

    fp16, fp32, inf = Precision("fp16", "cuda"), Precision("fp32", "cpu"), float("inf")
    assert check_fp16_overflow(2.0, inf, fp32, Scaler(), 5, 1) == 0
    assert check_fp16_overflow(2.0, 1.0, fp16, Scaler(), 5, 1) == 0  # a good step resets
    assert check_fp16_overflow(inf, inf, fp16, Scaler(), 5, 1) == 0  # the NaN guard's case
    streak = 0
    for step in range(1, FP16_OVERFLOW_LIMIT):
        streak = check_fp16_overflow(2.0, inf, fp16, Scaler(), streak, step)
    assert streak == FP16_OVERFLOW_LIMIT - 1
    with pytest.raises(LmforgeError, match=r"fp16 gradients overflowed 30 steps in a row .*"
                                           r"loss scale now 6.1e-05.*bf16 or fp32"):
        check_fp16_overflow(2.0, inf, fp16, Scaler(), streak, FP16_OVERFLOW_LIMIT)


def test_init_from_the_stage_output_is_refused(tmp_path):
    from lmforge.train.pipeline import run_train_stage

    paths = TrainPaths().under(tmp_path)
    with pytest.raises(InputError, match=r"is inside .*final, an output of this stage"):
        run_train_stage(tiny_params(init_from=str(paths.final)), paths)


@pytest.mark.parametrize("section", ["train", "sft", "dpo"])
def test_init_from_errors_name_the_section_that_was_set(inputs, tmp_path, section):
    """sft.init_from: models/sft is refused as sft.init_from, never as train.init_from."""
    import dataclasses

    from lmforge.config import DpoConfig, SftConfig
    from lmforge.train.dpo import DpoPaths, run_dpo_stage
    from lmforge.train.pipeline import run_train_stage
    from lmforge.train.sft import SftPaths, run_sft_stage

    stage = {"train": (TrainPaths, run_train_stage), "sft": (SftPaths, run_sft_stage),
             "dpo": (DpoPaths, run_dpo_stage)}[section]
    paths = stage[0]()  # the repo layout: refused before anything is read
    params = tiny_params()
    cfg = {"train": TrainConfig, "sft": SftConfig, "dpo": DpoConfig}[section]
    params = dataclasses.replace(params, **{section: cfg(init_from=str(paths.final))})
    with pytest.raises(InputError) as refused:
        stage[1](params, paths)
    assert str(refused.value).startswith(f"{section}.init_from: {paths.final} is inside")
    assert f"point {section}.init_from there" in str(refused.value)
    assert "train.init_from" not in str(refused.value) or section == "train"

    # The loop's own checks (the weights to start from) name it too.
    missing = tmp_path / "nowhere"
    loop_params = dataclasses.replace(params, train=cfg(**{
        **dataclasses.asdict(tiny_params().train), "lora": None, "init_from": str(missing)}))
    with pytest.raises(InputError, match=rf"^{section}\.init_from: {missing}: "):
        train(loop_params, open_data(inputs), tmp_path / "ck", "t" * 64, CPU, track=False,
              log=lambda _: None)


def test_a_run_whose_outputs_cannot_be_written_ends_failed_in_mlflow(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    from lmforge.train import pipeline

    paths = make_inputs(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("LMFORGE_TRACKING", "on")

    def full_disk(*_a, **_k):
        raise OSError("No space left on device")

    monkeypatch.setattr(pipeline, "write_outputs", full_disk)
    with pytest.raises(OSError, match="No space left"):
        pipeline.run_train_stage(tiny_params(max_steps=2, eval_every=0, num_threads=1), paths)
    client = MlflowClient(tracking_uri=uri)
    (exp,) = [e for e in client.search_experiments() if e.name == "lmforge"]
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.status == "FAILED"
    (recorded,) = runs.list_runs(paths.checkpoints)  # lmforge checkpoints says so too
    assert recorded.record["status"] == "failed" and recorded.status == "interrupted"


def test_lora_run_trains_only_adapters_and_resumes_exactly(inputs, tmp_path):
    from lmforge.config import LoraConfig
    from lmforge.model.lora import lora_modules, merge_lora
    from lmforge.model.saved import save_model

    base = run(tiny_params(max_steps=6, eval_every=0), inputs, tmp_path / "a")
    saved = tmp_path / "base"
    save_model(base.model, saved, tokenizer_sha256="t" * 64)
    lora = LoraConfig(rank=4, alpha=8.0, targets=["attn", "mlp"])
    params = tiny_params(max_steps=8, eval_every=0, ckpt_every=4, init_from=str(saved),
                         lora=lora, max_lr=1e-2)
    logs: list[str] = []
    tuned = run(params, inputs, tmp_path / "b", logs)
    assert any("trained: LoRA" in line for line in logs)
    adapters = lora_modules(tuned.model)
    assert len(adapters) == 2 * 7  # 2 layers x (wq wk wv wo w1 w2 w3)
    before = base.model.state_dict()
    for name, tensor in tuned.model.state_dict().items():
        plain = name.replace(".base.", ".")
        if "lora_" not in name:  # the frozen base is untouched, to the bit
            assert torch.equal(tensor, before[plain]), name
    assert any(m.lora_b.abs().sum() > 0 for m in adapters.values())  # adapters trained
    merged = merge_lora(copy.deepcopy(tuned.model))
    x = torch.randint(0, 300, (2, 16))
    with torch.no_grad():
        assert torch.allclose(merged(x), tuned.model.eval()(x), atol=1e-5)
    # Killed after step 4 and resumed: the same adapters as the unbroken run.
    run_dir = tmp_path / "b" / runs.run_id(tuned.fingerprint)
    (run_dir / "step-000008.pt").unlink()
    resumed = run(params, inputs, tmp_path / "b", logs)
    assert any("resuming from" in line and "step-000004" in line for line in logs)
    for name, tensor in tuned.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[name], tensor), name


def test_replay_rows_come_from_the_second_shard_set_and_define_the_run(inputs, tmp_path):
    data = open_data(inputs)
    data.replay, data.replay_share = ShardSet(inputs.val_shards), 0.25
    params = tiny_params(max_steps=4, eval_every=0)
    with_replay = train(params, data, tmp_path / "a", "t" * 64, CPU, track=False,
                        log=lambda _: None)
    plain = run(params, inputs, tmp_path / "a")
    assert with_replay.fingerprint != plain.fingerprint  # two runs, never resumed as one
    from lmforge.train.loop import open_loader

    loader = open_loader(data, 32, 4, 0, CPU, doc_mask=False)
    val_windows = {tuple(r) for r in ShardSet(inputs.val_shards).windows(
        np.arange(0, ShardSet(inputs.val_shards).num_tokens - 33, 1), 32).tolist()}
    rows = [tuple(r) for _ in range(5) for r in loader.next_batch()[0].tolist()]
    assert sum(r in val_windows for r in rows) == 5  # 25 % of 20 rows


def test_two_process_lora_fine_tuning_with_replay_runs_under_ddp(tmp_path):
    """The sft stage under 2 gloo ranks: frozen base, adapters, replay rows, masked loss."""
    from safetensors.torch import load_file

    from lmforge.model.saved import save_model

    root = stage_repo(tmp_path / "sft")
    paths = TrainPaths().under(root)
    base = run(tiny_params(max_steps=4, eval_every=0), paths, tmp_path / "base-ckpt")
    save_model(base.model, root / "base", paths.tokenizer,
               tokenizer_sha256=tokenizer_sha256(paths.tokenizer))
    sha = tokenizer_sha256(paths.tokenizer)
    rng = np.random.default_rng(3)
    for split, n in (("train", 40), ("val", 6)):  # conversations: 1 = prompt, mask on answer
        docs = [[int(x) for x in rng.integers(3, 300, int(rng.integers(10, 30)))]
                for _ in range(n)]
        masks = [[0] * (len(d) // 2) + [1] * (len(d) - len(d) // 2) for d in docs]
        write_shards(root / "data" / "sft" / split, docs, 300, tokenizer_sha256=sha,
                     masks=masks)
    params = yaml.safe_load((root / "params.yaml").read_text(encoding="utf-8"))
    params["sft_data"] = {"seq_len": 32}
    params["sft"] = {"init_from": "base", "max_steps": 4, "micro_batch_size": 4,
                     "eval_every": 0, "eval_batches": 2, "ckpt_every": 2, "log_every": 2,
                     "nproc": 2, "num_threads": 1, "replay": 0.25, "compile": False,
                     "lora": {"rank": 4, "alpha": 8, "targets": ["attn"]}}
    (root / "params.yaml").write_text(yaml.safe_dump(params), encoding="utf-8")
    run_two_ranks(root, "stages.sft", tmp_path / "mlflow.db")
    metrics = json.loads((root / "metrics" / "sft.json").read_text())
    assert metrics["world_size"] == 2 and metrics["mode"] == "lora"
    assert metrics["trainable_params"] == 2 * 4 * 4 * (64 + 64)  # 2 layers x q,k,v,o
    assert math.isfinite(metrics["train_loss"]) and metrics["replay_row_share"] == 0.25
    merged = load_file(root / "models" / "sft" / "model.safetensors")
    before = base.model.state_dict()
    assert not torch.equal(merged["layers.0.attn.wq.weight"], before["layers.0.attn.wq.weight"])
    assert torch.equal(merged["layers.0.mlp.w1.weight"], before["layers.0.mlp.w1.weight"])
    assert (root / "models" / "sft" / "adapter" / "adapter.safetensors").is_file()
    # Rank 0 tracked the fine-tuning in a run of its own, named after its stage.
    run_id = json.loads((root / "models" / "sft" / "run.json").read_text())["mlflow_run_id"]
    with contextlib.closing(sqlite3.connect(tmp_path / "mlflow.db")) as db:
        tracked = db.execute("SELECT run_uuid, status, name FROM runs").fetchall()
    assert [(r, s, n.endswith("-sft")) for r, s, n in tracked] == [(run_id, "FINISHED", True)]
