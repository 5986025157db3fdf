"""train.strategy: fsdp under two gloo ranks on CPU: the DDP trajectory, sharded DCP
checkpoints that resume bit-identically after a SIGKILL, and 1/world of the bytes."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from test_train_loop import stage_repo, start_ranks, tracked_env
from test_train_loop import wait_ranks as wait

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def fsdp_repo(root: Path, strategy: str, **train: object) -> Path:
    stage_repo(root)
    params = yaml.safe_load((root / "params.yaml").read_text(encoding="utf-8"))
    # AdamW: params.yaml's Muon is refused under FSDP (config/train.py).
    params["train"].update({"nproc": 2, "strategy": strategy, "optimizer": "adamw",
                            "micro_batch_size": 4,
                            "max_steps": 10, "log_every": 1, "eval_every": 5, "compile": False,
                            "num_threads": 1, **train})
    (root / "params.yaml").write_text(yaml.safe_dump(params), encoding="utf-8")
    return root


def losses(root: Path) -> list[float]:
    rows = (root / "plots" / "train.tsv").read_text().splitlines()
    col = rows[0].split("\t").index("loss")
    return [float(r.split("\t")[col]) for r in rows[1:]]


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    """An unbroken two-rank FSDP run: 10 steps, a checkpoint every 4."""
    root = fsdp_repo(tmp_path_factory.mktemp("straight"), "fsdp", ckpt_every=4)
    out = wait(start_ranks(root, ["-m", "stages.train"]))[0]
    assert "x2 (fsdp)" in out, out
    return root


def kill_after_checkpoint(root: Path, procs: list[subprocess.Popen], step: int) -> Path:
    """SIGKILL every process once checkpoint ``step`` exists; return the run directory."""
    deadline = time.time() + 240
    ckpts = root / "models" / "checkpoints"
    while time.time() < deadline and not list(ckpts.glob(f"*/step-{step:06d}.pt")):
        assert all(p.poll() is None for p in procs), "finished before the kill"
        time.sleep(0.05)
    for p in procs:
        p.send_signal(signal.SIGKILL)
        p.wait()
    return next(ckpts.glob(f"*/step-{step:06d}.pt")).parent


def final_weights(root: Path) -> dict[str, torch.Tensor]:
    return load_file(root / "models" / "final" / "model.safetensors")


def test_fsdp_follows_the_ddp_trajectory(straight, tmp_path):
    ddp = fsdp_repo(tmp_path / "ddp", "ddp", ckpt_every=4)
    wait(start_ranks(ddp, ["-m", "stages.train"]))
    a, b = losses(ddp), losses(straight)
    assert len(a) == len(b) == 10
    assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-5, (a, b)
    va = json.loads((ddp / "metrics" / "train.json").read_text())["val_loss"]
    vb = json.loads((straight / "metrics" / "train.json").read_text())["val_loss"]
    assert abs(va - vb) < 1e-5
    # The consolidated export: the same tensors, whole, in models/final.
    wa, wb = final_weights(ddp), final_weights(straight)
    assert wa.keys() == wb.keys()
    for name in wa:
        assert wa[name].shape == wb[name].shape
        assert torch.allclose(wa[name], wb[name], atol=1e-5), name


def test_activation_checkpointing_under_fsdp_changes_no_figure(straight, tmp_path):
    """Recomputing a sharded block in the backward gathers its weights again: the same
    losses and weights as the run that kept its activations."""
    root = fsdp_repo(tmp_path / "ac", "fsdp", ckpt_every=4, activation_checkpointing=True)
    wait(start_ranks(root, ["-m", "stages.train"]))
    a, b = losses(straight), losses(root)
    assert len(b) == 10
    assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-5, (a, b)
    wa, wb = final_weights(straight), final_weights(root)
    for name in wa:
        assert torch.allclose(wa[name], wb[name], atol=1e-5), name


def test_sigkilled_fsdp_run_resumes_bit_identical(straight, tmp_path):
    killed = fsdp_repo(tmp_path / "killed", "fsdp", ckpt_every=4)
    procs = start_ranks(killed, ["-m", "stages.train"])
    run_dir = kill_after_checkpoint(killed, procs, 4)
    shards = run_dir / "step-000004.dcp"
    assert sorted(f.name for f in shards.iterdir() if f.suffix == ".distcp") == [
        "__0_0.distcp", "__1_0.distcp"]  # each rank wrote its own shards

    outs = wait(start_ranks(killed, ["-m", "stages.train"]))
    assert "resuming from" in outs[0], outs[0]
    a, b = final_weights(straight), final_weights(killed)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert losses(straight) == losses(killed)
    # keep_last 2 prunes a checkpoint's shards with it; the last one, consolidated in
    # one process (lmforge generate --model step-*.pt), is the exported model.
    assert sorted(f.name for f in run_dir.iterdir() if f.name.startswith("step-")) == [
        "step-000008.dcp", "step-000008.pt", "step-000010.dcp", "step-000010.pt"]
    from lmforge.model.saved import load_model

    last = load_model(run_dir / "step-000010.pt")[0].state_dict()
    for name in b:
        assert torch.equal(last[name], b[name]), name


def test_a_two_rank_fsdp_run_resumes_on_one_process(straight, tmp_path):
    """2 -> 1: DCP reshards; one process with twice the micro batch keeps the global
    batch, and the loader goes on at the same window, none skipped or repeated."""
    root = fsdp_repo(tmp_path / "resized", "fsdp", ckpt_every=4)
    kill_after_checkpoint(root, start_ranks(root, ["-m", "stages.train"]), 4)
    params = yaml.safe_load((root / "params.yaml").read_text(encoding="utf-8"))
    params["train"].update(nproc=1, micro_batch_size=8)
    (root / "params.yaml").write_text(yaml.safe_dump(params), encoding="utf-8")
    env = dict(os.environ, PYTHONPATH=str(REPO), DVC_ROOT=str(root))
    proc = subprocess.run([sys.executable, "-m", "stages.train"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "saved by 2 processes, this run has 1" in proc.stdout, proc.stdout
    metrics = json.loads((root / "metrics" / "train.json").read_text())
    assert metrics["steps"] == 10 and metrics["world_size"] == 1
    assert metrics["tokens"] == 10 * 8 * 32

    def loader_at_end(run_root: Path) -> dict:
        last = next((run_root / "models" / "checkpoints").glob("*/step-000010.pt"))
        return torch.load(last, weights_only=True)["ranks"][0]["loader"]

    assert loader_at_end(root) == loader_at_end(straight)
    # The same windows in every step: the losses agree to float rounding.
    a, b = losses(straight), losses(root)
    assert a[:4] == b[:4]
    assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-4, (a, b)
    wa, wb = final_weights(straight), final_weights(root)
    for name in wa:
        assert torch.allclose(wa[name], wb[name], atol=1e-4), name


_BYTES = textwrap.dedent("""
    import json, torch, torch.distributed as dist
    from lmforge.config import ModelConfig, TrainConfig
    from lmforge.model.llama import Llama
    from lmforge.train.distributed import setup
    from lmforge.train.fsdp import build_sharded, full_state, local_bytes
    from lmforge.train.optim import build_optimizer
    env = setup("cpu", 1)
    cfg = ModelConfig(n_layer=4, n_head=4, n_embd=128, seq_len=32)
    torch.manual_seed(0)
    eager = Llama(cfg, 515)  # 515 rows: the last rank's shard of the embedding is short
    whole = sum(p.numel() * p.element_size() for p in eager.parameters())
    torch.manual_seed(0)
    model = build_sharded(cfg, 515, env, bf16=False)
    full = full_state(model)
    same = all(torch.equal(full[k], v) for k, v in eager.state_dict().items()) if full else None
    opt = build_optimizer(model, TrainConfig(), env.device)
    x = torch.randint(0, 515, (2, 32))
    model(x, x)[1].backward()
    opt.step()
    print("BYTES", json.dumps({"whole": whole, "same_init": same, **local_bytes(model, opt)}))
    dist.destroy_process_group()
""")


def test_each_rank_holds_half_the_parameter_and_optimizer_bytes_from_a_meta_build(tmp_path):
    (tmp_path / "bytes.py").write_text(_BYTES, encoding="utf-8")
    outs = wait(start_ranks(tmp_path, ["bytes.py"]))
    figures = [json.loads(next(ln for ln in out.splitlines() if ln.startswith("BYTES "))[6:])
               for out in outs]
    assert figures[0]["same_init"] is True  # built on meta, shard by shard: the eager values
    whole = figures[0]["whole"]
    for f in figures:
        # Dim-0 shards: each rank holds ceil(rows / 2) of every tensor, so about half.
        assert abs(f["params"] - whole / 2) <= 0.01 * whole, f
        # AdamW: two fp32 moments per local element (DDP would hold 2 x whole).
        assert abs(f["optimizer"] - whole) <= 0.02 * whole, f
    assert sum(f["params"] for f in figures) >= whole


def test_meta_build_in_one_process_is_the_eager_model_bit_for_bit():
    from lmforge.config import ModelConfig
    from lmforge.model.llama import Llama
    from lmforge.train.distributed import DistEnv
    from lmforge.train.fsdp import build_sharded, ensure_process_group, full_state

    env = DistEnv(0, 1, 0, torch.device("cpu"))
    ensure_process_group(env)
    for tie in (False, True):
        cfg = ModelConfig(n_layer=3, n_head=4, n_embd=64, seq_len=32, tie_embeddings=tie)
        torch.manual_seed(5)
        eager = Llama(cfg, 300).state_dict()
        after_eager = torch.rand(4)
        torch.manual_seed(5)
        full = full_state(build_sharded(cfg, 300, env, bf16=False))
        assert torch.equal(torch.rand(4), after_eager)  # the generator moved on alike
        assert full.keys() == eager.keys()
        for name, value in eager.items():
            assert torch.equal(full[name], value), (tie, name)


@pytest.mark.parametrize("tie", [False, True])
def test_warm_start_with_adapters_reads_slices_into_the_eager_model_bit_for_bit(tmp_path, tie):
    """init_from a model directory + LoRA under fsdp (meta build, rows read from the
    file) gives the eager path's model: the same weights, adapters, and RNG after."""
    from lmforge.config import LoraConfig, ModelConfig, Params, TrainConfig
    from lmforge.model.llama import Llama
    from lmforge.model.lora import lora_modules
    from lmforge.model.saved import save_model
    from lmforge.train.distributed import DistEnv
    from lmforge.train.fsdp import ensure_process_group, full_state, is_sharded
    from lmforge.train.loop import build_model

    env = DistEnv(0, 1, 0, torch.device("cpu"))
    ensure_process_group(env)
    cfg = ModelConfig(n_layer=2, n_head=4, n_embd=64, seq_len=32, tie_embeddings=tie)
    torch.manual_seed(9)
    save_model(Llama(cfg, 300), tmp_path / "base")
    targets = ["attn", "mlp"] if tie else ["wq", "w2", "lm_head"]
    built = {}
    for strategy in ("ddp", "fsdp"):
        train = TrainConfig(strategy=strategy, init_from=str(tmp_path / "base"),
                            lora=LoraConfig(rank=4, alpha=8.0, targets=targets))
        torch.manual_seed(5)
        model, note = build_model(Params(model=cfg, train=train), 300, env, False, False, "")
        assert note.startswith(f"train: weights from {tmp_path / 'base'}")
        assert is_sharded(model) == (strategy == "fsdp")
        state = full_state(model) if strategy == "fsdp" else model.state_dict()
        built[strategy] = (state, len(lora_modules(model)), torch.rand(4))
    (eager, n_eager, rng_eager), (sharded, n_sharded, rng_sharded) = built["ddp"], built["fsdp"]
    assert n_eager == n_sharded > 0
    assert torch.equal(rng_eager, rng_sharded)  # the generator moved on alike
    assert eager.keys() == sharded.keys()
    for name, value in eager.items():
        assert torch.equal(sharded[name], value), name
    assert any(name.endswith("lora_a") and value.abs().sum() > 0 for name, value in eager.items())


def test_async_save_writes_the_state_of_its_step_and_commits_later(tmp_path):
    from lmforge.config import ModelConfig, TrainConfig
    from lmforge.train.distributed import DistEnv
    from lmforge.train.fsdp import (
        AsyncShardSaver,
        build_sharded,
        ensure_process_group,
        full_state,
        load_sharded,
    )
    from lmforge.train.optim import build_optimizer

    env = DistEnv(0, 1, 0, torch.device("cpu"))
    ensure_process_group(env)
    cfg = ModelConfig(n_layer=2, n_head=4, n_embd=64, seq_len=32)

    def step(model, opt, x):
        model(x, x)[1].backward()
        opt.step()
        opt.zero_grad()

    torch.manual_seed(0)
    model = build_sharded(cfg, 300, env, bf16=False)
    opt = build_optimizer(model, TrainConfig(), env.device)
    x = torch.randint(0, 300, (2, 32))
    step(model, opt, x)
    saved = {k: v.clone() for k, v in full_state(model).items()}
    committed: list[int] = []
    saver = AsyncShardSaver()
    saver.save(tmp_path / "step-000001.dcp", model, opt, lambda: committed.append(1))
    for _ in range(3):  # training goes on while the shards are written
        step(model, opt, x)
    assert not committed and not (tmp_path / "step-000001.dcp").exists()
    saver.finish()
    assert committed == [1] and (tmp_path / "step-000001.dcp" / ".metadata").is_file()
    assert not list(tmp_path.glob(".*"))

    torch.manual_seed(1)
    other = build_sharded(cfg, 300, env, bf16=False)
    other_opt = build_optimizer(other, TrainConfig(), env.device)
    load_sharded(tmp_path / "step-000001.dcp", other, other_opt)
    loaded = full_state(other)
    for name, value in saved.items():
        assert torch.equal(loaded[name], value), name


@pytest.mark.parametrize("section", ["train", "sft", "dpo"])
def test_fsdp_settings_it_cannot_honour_are_one_line_errors(tmp_path, section):
    from lmforge.config import load_params
    from lmforge.errors import ConfigError

    params = yaml.safe_load((REPO / "params.yaml").read_text(encoding="utf-8"))
    # AdamW: params.yaml's Muon under FSDP is a one-line error of its own (test_train_muon).
    params[section].update(strategy="fsdp", probe_micro_batch=True, optimizer="adamw")
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params), encoding="utf-8")
    with pytest.raises(ConfigError, match=f"{section}.probe_micro_batch: .*lmforge plan"):
        load_params(tmp_path / "params.yaml")
    # Fine-tuning with adapters is sharded too (tests/test_train_fsdp_finetune.py).
    params[section].update(probe_micro_batch=False, lora={"rank": 4, "targets": ["attn"]})
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params), encoding="utf-8")
    assert getattr(load_params(tmp_path / "params.yaml"), section).strategy == "fsdp"


def test_rank_batches_stream_each_ranks_share_and_pad_a_sharded_rank():
    from lmforge.train.distributed import DistEnv, rank_batches

    def env(rank):
        return DistEnv(rank, 2, rank, torch.device("cpu"))

    def five():  # a generator: read once, never held whole
        yield from range(5)

    assert list(rank_batches(five(), env(0), lockstep=True)) == [(0, True), (2, True),
                                                                  (4, True)]
    assert list(rank_batches(five(), env(1), lockstep=False)) == [(1, True), (3, True)]
    # Sharded: rank 1 runs one more forward, on the first batch, uncounted.
    assert list(rank_batches(five(), env(1), lockstep=True)) == [(1, True), (3, True),
                                                                  (0, False)]
    assert list(rank_batches(iter([]), env(1), lockstep=True)) == []


def test_a_frozen_model_from_weights_is_built_without_touching_the_generator(tmp_path):
    """keep_rng=False (DPO's reference): the file's weights, and no random draws."""
    from lmforge.config import ModelConfig
    from lmforge.model.llama import Llama
    from lmforge.model.saved import WEIGHTS, save_model
    from lmforge.train.distributed import DistEnv
    from lmforge.train.fsdp import build_sharded, ensure_process_group, full_state

    env = DistEnv(0, 1, 0, torch.device("cpu"))
    ensure_process_group(env)
    cfg = ModelConfig(n_layer=2, n_head=4, n_embd=64, seq_len=32)
    torch.manual_seed(4)
    base = Llama(cfg, 300)
    save_model(base, tmp_path / "base")
    torch.manual_seed(8)
    expected_draw = torch.rand(3)
    torch.manual_seed(8)
    model = build_sharded(cfg, 300, env, bf16=False, weights=tmp_path / "base" / WEIGHTS,
                          keep_rng=False)
    assert torch.equal(torch.rand(3), expected_draw)  # the generator did not move
    state = full_state(model)
    for name, value in base.state_dict().items():
        assert torch.equal(state[name], value), name


# A stage run that goes wrong after its checkpoint at step 2: every optimizer step from
# the third reports a NaN loss, or the third read of training data fails.
_FAULTY = textwrap.dedent("""
    import os
    from lmforge.model import llama
    from lmforge.shards import loader
    from lmforge.stage import run_stage
    from stages.train import main
    calls = {"n": 0}
    if os.environ["FAULT"] == "nan":
        _loss = llama.linear_cross_entropy
        def loss(*args, **kwargs):
            calls["n"] += 1
            value = _loss(*args, **kwargs)
            return value * float("nan") if calls["n"] > 2 else value
        llama.linear_cross_entropy = loss
    else:
        _next = loader.WindowLoader.next_batch
        def next_batch(self):
            calls["n"] += 1
            if calls["n"] > 2:
                raise OSError("read failed: a shard on a lost mount")
            return _next(self)
        loader.WindowLoader.next_batch = next_batch
    run_stage(main)
""")


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("fault", ["nan", "loader"])
def test_an_fsdp_run_stopped_by_an_error_keeps_its_last_checkpoint(tmp_path, world, fault):
    """The checkpoint still being written when the run stops is committed: the error
    names a file that exists, and the rerun resumes from it (and, where tracked, goes on
    in the failed run's MLflow run)."""
    root = fsdp_repo(tmp_path / "run", "fsdp", ckpt_every=2, max_steps=6, eval_every=0,
                     max_bad_steps=2, nproc=world)
    (root / "faulty.py").write_text(_FAULTY, encoding="utf-8")
    # One case is tracked: MLflow's start-up costs seconds in each process.
    tracked = world == 1 and fault == "nan"
    store = tmp_path / "mlflow.db"
    if world == 1:
        env = dict(os.environ, PYTHONPATH=str(REPO), DVC_ROOT=str(root), FAULT=fault,
                   **(tracked_env(store) if tracked else {}))
        proc = subprocess.run([sys.executable, "faulty.py"], cwd=root, env=env,
                              capture_output=True, text=True, timeout=300)
        codes, outs = [proc.returncode], [proc.stdout + proc.stderr]
    else:
        os.environ["FAULT"] = fault  # start_ranks passes the environment on
        try:
            procs = start_ranks(root, ["faulty.py"])
        finally:
            del os.environ["FAULT"]
        outs = [p.communicate(timeout=300)[0] for p in procs]
        codes = [p.returncode for p in procs]
    assert all(code != 0 for code in codes), outs
    run_dir = next((root / "models" / "checkpoints").glob("*/run.json")).parent
    assert (run_dir / "step-000002.pt").is_file() and (run_dir / "step-000002.dcp").is_dir()
    assert not list(run_dir.glob(".*.tmp")), sorted(p.name for p in run_dir.iterdir())
    record = json.loads((run_dir / "run.json").read_text())
    assert record["last_step"] == 2 and record["status"] == "failed"
    if fault == "nan":
        assert f"Last good checkpoint: {run_dir / 'step-000002.pt'}." in outs[0], outs[0]
    else:
        assert "a shard on a lost mount" in outs[0], outs[0]
    if tracked:
        assert [status for _, status in mlflow_runs(store)] == ["FAILED"]

    again = (wait(start_ranks(root, ["-m", "stages.train"])) if world == 2 else
             [subprocess.run([sys.executable, "-m", "stages.train"], cwd=root, check=True,
                             env=dict(env, FAULT=""), capture_output=True, text=True,
                             timeout=300).stdout])
    assert f"resuming from {run_dir / 'step-000002.pt'} at step 2/6" in again[0], again[0]
    assert json.loads((root / "metrics" / "train.json").read_text())["steps"] == 6
    if tracked:
        final = json.loads((root / "models" / "final" / "run.json").read_text())
        assert mlflow_runs(store) == [(final["mlflow_run_id"], "FINISHED")]


def mlflow_runs(store: Path) -> list[tuple[str, str]]:
    """Every run in an MLflow sqlite store: (run id, status)."""
    with contextlib.closing(sqlite3.connect(store)) as db:
        return db.execute("SELECT run_uuid, status FROM runs").fetchall()


def test_one_rank_fsdp_compiles_the_whole_forward_in_one_graph(monkeypatch):
    """On one rank the root is the only FSDP unit, and compile_blocks compiles its whole
    forward (FSDP's hooks stay outside): one graph, none recompiled over steps, the
    gradients those of the same model sharded and run eager. (aot_eager stands in for
    Inductor: it is Dynamo's trace through the sharded root that is tested.)"""
    import functools

    import torch._dynamo
    from torch._dynamo.utils import counters

    from lmforge.config import ModelConfig
    from lmforge.train.distributed import DistEnv
    from lmforge.train.fsdp import build_sharded, ensure_process_group

    env = DistEnv(0, 1, 0, torch.device("cpu"))
    ensure_process_group(env)
    cfg = ModelConfig(n_layer=2, n_head=4, n_embd=64, seq_len=32)
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(3)
    compiled = build_sharded(cfg, 300, env, bf16=False, compile_blocks=True)
    torch.manual_seed(3)
    eager = build_sharded(cfg, 300, env, bf16=False)
    assert "forward" in vars(compiled) and "forward" not in vars(eager)
    assert all("_compiled_call_impl" not in vars(b) or b._compiled_call_impl is None
               for b in compiled.layers)  # no block compiled on its own
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        x = torch.randint(300, (2, 32), generator=gen)
        for model in (compiled, eager):
            _, loss = model(x, x)
            loss.backward()
        for (name, a), b in zip(compiled.named_parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(a.grad.full_tensor(), b.grad.full_tensor(),
                                       rtol=1e-4, atol=1e-6, msg=name)
            a.grad = b.grad = None
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"] and not counters["recompiles"]
