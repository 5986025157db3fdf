"""Queued DVC experiments in MLflow: every run lands in the main repo's store, truthfully.

A temporary git+DVC repo (as in test_pipeline_e2e) is reproduced once; then two queued
training experiments and one queued evaluation-only experiment run through
`dvc queue start`, each in its own temp copy of the repo. All of them must log to the
main repo's mlflow.db (DVC_ROOT), named after their experiments.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from demo_repo import REPO, copy_repo, run, stage_env, tiny_params

from lmforge.experiments import queue_fingerprint, wait_for_queue_change

pytestmark = pytest.mark.slow

STEPS = 12
QUEUE_TIMEOUT_S = 600


def queue_params() -> dict:
    """The e2e test's tiny params, shorter still: a loss point every 2 of 12 steps."""
    params = tiny_params()
    params["train"].update(max_steps=STEPS, log_every=2, eval_every=6, ckpt_every=6,
                           compile=False, self_check=False, sample_every=0)
    params["evaluate"].update(train_batches=1, max_new_tokens=4, prompts=["It is"],
                              temperatures=[0.0])
    return params


@pytest.fixture(scope="module")
def env() -> dict[str, str]:
    return stage_env(tracking=True)


PRETRAINING = ("ingest", "filter", "dedup", "decontam", "mix", "tokenizer", "shards", "train",
               "evaluate")


def make_repo(template: Path, root: Path, env: dict[str, str]) -> None:
    """The pretraining pipeline with the queue's params, in a copy of the session's demo
    repo (its data stages already reproduced), reproduced."""
    copy_repo(template, root)
    # The pretraining stages: what is tracked here is a queued training run.
    pipeline = yaml.safe_load((REPO / "dvc.yaml").read_text(encoding="utf-8"))
    pipeline["stages"] = {name: stage for name, stage in pipeline["stages"].items()
                          if name in PRETRAINING}
    (root / "dvc.yaml").write_text(yaml.safe_dump(pipeline, sort_keys=False), encoding="utf-8")
    (root / "params.yaml").write_text(yaml.safe_dump(queue_params(), sort_keys=False),
                                      encoding="utf-8")
    run(["git", "add", "-A"], root, env)
    run(["git", "commit", "-qm", "queue params"], root, env)
    out = run(["dvc", "repro"], root, env)
    # The data stages' params are the template's: only training and evaluation ran.
    assert "Running stage 'ingest'" not in out and "Running stage 'train'" in out, out
    run(["git", "add", "-A"], root, env)
    run(["git", "commit", "-qm", "repro"], root, env)


def wait_for_queue(root: Path, env: dict[str, str], names: list[str]) -> dict[str, str]:
    """Poll `dvc queue status` until every experiment has left Queued/Running."""
    deadline = time.monotonic() + QUEUE_TIMEOUT_S
    while True:
        seen = queue_fingerprint(root)  # an experiment ending during the status is a change
        out = run(["dvc", "queue", "status"], root, env)
        status = {}
        for line in out.splitlines():  # Task  Name  Created  Status
            fields = line.split()
            if len(fields) >= 4 and fields[1] in names:
                status[fields[1]] = fields[-1]
        if len(status) == len(names) and not {"Queued", "Running"} & set(status.values()):
            return status
        if time.monotonic() > deadline:
            pytest.fail(f"queue still busy after {QUEUE_TIMEOUT_S}s:\n{out}")
        # Each poll is a DVC process (~1.5 s of CPU): on a small machine a tight poll
        # slows the experiments it waits for. Polled again when DVC's queue files change.
        wait_for_queue_change(10, root, since=seen)


@pytest.fixture(scope="module")
def queued(demo_data_repo, tmp_path_factory, env) -> Path:
    """The repo after two queued training experiments and one evaluation-only one."""
    root = tmp_path_factory.mktemp("queue")
    make_repo(demo_data_repo[0], root, env)
    run(["dvc", "exp", "run", "--queue", "-S", "train.max_lr=1e-3", "-n", "a"], root, env)
    run(["dvc", "exp", "run", "--queue", "-S", "train.max_lr=5e-3", "-n", "b"], root, env)
    run(["dvc", "exp", "run", "--queue", "-S", "evaluate.max_new_tokens=6", "-n", "c"],
        root, env)
    run(["dvc", "queue", "start"], root, env)
    status = wait_for_queue(root, env, ["a", "b", "c"])
    failed = [name for name, s in status.items() if s != "Success"]
    logs = "".join(subprocess.run(["dvc", "queue", "logs", name], cwd=root, env=env,
                                  capture_output=True, text=True).stdout[-3000:]
                   for name in failed)
    assert not failed, f"{status}\n{logs}"
    return root


def runs(root: Path) -> dict[str, dict]:
    """Every run in the repo's store by name: status, tags, params, metric histories."""
    db = sqlite3.connect(root / "mlflow.db")
    out = {}
    for run_id, name, status in db.execute("select run_uuid, name, status from runs"):
        history: dict[str, list[int]] = {}
        for key, step in db.execute("select key, step from metrics where run_uuid = ?",
                                    (run_id,)):
            history.setdefault(key, []).append(step)
        out[name] = {
            "id": run_id, "status": status, "metrics": history,
            "tags": dict(db.execute("select key, value from tags where run_uuid = ?",
                                    (run_id,))),
            "params": dict(db.execute("select key, value from params where run_uuid = ?",
                                      (run_id,))),
        }
    db.close()
    return out


def test_queued_training_runs_land_in_the_main_store(queued):
    found = runs(queued)
    for name in ("a", "b"):
        assert name in found, sorted(found)
        r = found[name]
        assert r["status"] == "FINISHED"
        assert r["tags"]["dvc_exp_name"] == name
        assert len(set(r["metrics"]["loss"])) >= STEPS // 2, r["metrics"]["loss"]
        assert {"lr", "grad_norm", "tokens_per_sec", "val_loss"} <= set(r["metrics"])
        assert "eval/val_loss" in r["metrics"] or "eval/val_loss_mix_weighted" in r["metrics"]
        assert any(k.startswith("eval_domain/") for k in r["metrics"])
        assert r["tags"].get("lmforge.evaluated") == "1"
    assert found["a"]["params"]["train.max_lr"] == "0.001"
    assert found["b"]["params"]["train.max_lr"] == "0.005"
    # Nothing went to the queue's temp copies of the repo.
    assert not list((queued / ".dvc" / "tmp").rglob("mlflow.db"))


def test_a_queued_evaluation_only_experiment_gets_its_own_nested_run(queued):
    found = runs(queued)
    baseline_id = json.loads((queued / "models" / "final" / "run.json").read_text()
                             )["mlflow_run_id"]
    (baseline,) = [r for r in found.values() if r["id"] == baseline_id]
    c = found["c"]
    assert c["status"] == "FINISHED"
    assert c["tags"]["lmforge.train_run_id"] == baseline_id
    assert c["tags"]["mlflow.parentRunId"] == baseline_id
    assert c["params"]["evaluate.max_new_tokens"] == "6"
    assert "loss" not in c["metrics"]  # the curves stay on the training run
    assert any(k.startswith("eval/") for k in c["metrics"])
    # The baseline's own evaluation was logged once, by `dvc repro`, and not overwritten.
    evals = [k for k in baseline["metrics"] if k.startswith("eval/")]
    assert evals and all(len(baseline["metrics"][k]) == 1 for k in evals)


def test_no_run_is_left_running(queued):
    statuses = {name: r["status"] for name, r in runs(queued).items()}
    assert set(statuses.values()) == {"FINISHED"}, statuses
