"""The whole pipeline under DVC, on a slice of the demo corpus, in a temporary git repo.

One module-scoped repo runs `dvc repro` once with tiny params; the tests then check the
outputs of all eight stages, the MLflow run, and that `dvc exp run -S ...` reruns only
what depends on the changed key.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from demo_repo import DEMO, DOCS_PER_DOMAIN, REPO, VOCAB, copy_repo, run, stage_env

from lmforge.config import load_params
from lmforge.experiments import committed_json
from lmforge.mixture import sweep

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def env() -> dict[str, str]:
    """The stages' environment after pretraining: MLflow off (nothing after
    test_mlflow_run_has_curves_and_eval reads it; test_tracking_queue tracks experiments)."""
    return stage_env()


@pytest.fixture(scope="module")
def pipeline(demo_data_repo, tmp_path_factory, env) -> tuple[Path, str]:
    """A temp git+DVC repo holding the pipeline, tiny params and a demo slice; reproduced,
    pretraining and its evaluation tracked in MLflow.

    The data stages ran in the session's template repo (conftest), copied here with
    their lock and cache; DVC's output is the template's and this repo's together.
    Post-training runs untracked: test_mlflow_run_has_curves_and_eval reads the training
    run, and MLflow's start-up is seconds in each stage (the post-training stages'
    tracking is tested in test_tracking_eval and the DDP fine-tuning test).
    """
    template, data_out = demo_data_repo
    root = copy_repo(template, tmp_path_factory.mktemp("repo"))
    out = run(["dvc", "repro", "evaluate"], root, stage_env(tracking=True))
    out += run(["dvc", "repro"], root, env)
    run(["git", "add", "-A"], root, env)
    run(["git", "commit", "-qm", "repro"], root, env)
    return root, data_out + out


def load(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def test_all_stages_ran(pipeline):
    root, out = pipeline
    metrics = {"evaluate": "eval", "evaluate_post": "post"}
    for stage in ("ingest", "filter", "dedup", "mix", "tokenizer", "shards", "train",
                  "evaluate", "sft_data", "sft", "evaluate_post"):
        assert f"Running stage '{stage}'" in out
        assert (root / "metrics" / f"{metrics.get(stage, stage)}.json").is_file()
    status = subprocess.run(["dvc", "status"], cwd=root, capture_output=True, text=True,
                            env=os.environ | {"PATH": f"{Path(sys.executable).parent}:"
                                              f"{os.environ['PATH']}"})
    assert "up to date" in status.stdout, status.stdout


def test_data_stages_account_for_every_document(pipeline):
    root, _ = pipeline
    ingest = load(root / "metrics" / "ingest.json")
    domains = set(ingest["domains"])
    assert domains == {p.name for p in DEMO.iterdir() if p.is_dir()}
    for stage in ("ingest", "filter", "dedup"):
        for domain, m in load(root / "metrics" / f"{stage}.json")["domains"].items():
            rejected = sum(m["rejected"].values())
            assert m["in"] == m["kept"] + rejected, (stage, domain, m)
    assert sum(m["in"] for m in ingest["domains"].values()) == DOCS_PER_DOMAIN * len(domains)
    mix = load(root / "metrics" / "mix.json")
    for domain in domains:
        assert mix["domains"][domain]["val_docs"] >= 1
    assert list((root / "data" / "mixed" / "train").glob("part-*.parquet"))
    assert list((root / "data" / "mixed" / "val").glob("part-*.parquet"))


def test_tokenizer_and_shards(pipeline):
    root, _ = pipeline
    assert (root / "models" / "tokenizer" / "tokenizer.model").is_file()
    manifest = load(root / "data" / "shards" / "train" / "manifest.json")
    assert manifest["vocab_size"] == VOCAB
    assert manifest["dtype"] == "uint16"
    shards = load(root / "metrics" / "shards.json")
    assert json.dumps(shards)  # present and parseable
    assert list((root / "data" / "shards" / "val").glob("*.bin"))


def test_train_and_evaluate_outputs(pipeline):
    root, _ = pipeline
    final = root / "models" / "final"
    for name in ("model.safetensors", "config.json", "tokenizer.model", "run.json"):
        assert (final / name).is_file(), name
    # One pretraining, one fine-tuning and one DPO run, each in its own directory.
    runs = {load(d / "run.json")["identity"].get("stage", "train"): d
            for d in (root / "models" / "checkpoints").iterdir()}
    assert sorted(runs) == ["dpo", "sft", "train"]
    for run_dir in runs.values():
        assert list(run_dir.glob("step-*.pt"))
    train = load(root / "metrics" / "train.json")
    assert train["steps"] == 24
    tsv = (root / "plots" / "train.tsv").read_text(encoding="utf-8").splitlines()
    assert tsv[0].split("\t")[:2] == ["step", "loss"]
    val = (root / "plots" / "val.tsv").read_text(encoding="utf-8").splitlines()
    assert val[0] == "step\tval_loss" and len(val) >= 2
    assert len(tsv) > 1 + 24 // 4 - 1
    ev = load(root / "metrics" / "eval.json")
    mix = ev["val"]["mix_weighted"]
    assert ev["loss"] == mix["loss"] and ev["bits_per_byte"] == mix["bits_per_byte"]
    assert math.isfinite(mix["loss"]) and math.isfinite(ev["val"]["token_weighted"]["loss"])
    assert mix["loss"] < math.log(VOCAB)  # it learned something in 24 steps
    assert 0 < mix["loss_stderr"] < 1 and "mix_weighted" in ev["weighting"]
    assert math.isfinite(ev["train_val_gap_mix_weighted"])
    for domain in load(root / "metrics" / "ingest.json")["domains"]:
        d = ev["val"]["domains"][domain]
        assert d["bits_per_byte"] > 0 and d["docs"] >= 2 and d["loss_stderr"] > 0
        assert 0 < d["mix_weight_tokens"] < 1
    samples = (root / "metrics" / "samples.md").read_text(encoding="utf-8")
    assert "床前明月光" in samples


def test_mlflow_run_has_curves_and_eval(pipeline):
    root, _ = pipeline
    run_id = load(root / "models" / "final" / "run.json")["mlflow_run_id"]
    db = sqlite3.connect(root / "mlflow.db")
    keys = {k for (k,) in db.execute(
        "select distinct key from metrics where run_uuid = ?", (run_id,))}
    assert {"loss", "grad_norm", "lr", "tokens_per_sec"} <= keys
    assert any(k.startswith("eval/") for k in keys), keys
    n_params = db.execute("select count(*) from params where run_uuid = ?", (run_id,)).fetchone()
    assert n_params[0] > 50
    tags = dict(db.execute("select key, value from tags where run_uuid = ?", (run_id,)))
    assert len(tags["git_revision"]) >= 40


def test_exp_run_train_param_skips_data_stages(pipeline, env):
    root, _ = pipeline
    # Checkpoints are no DVC output: a run written there never makes `train` look changed.
    ck = root / "models" / "checkpoints"
    other = ck / ("0" * 16)
    other.mkdir()
    (other / "run.json").write_text("{}", encoding="utf-8")
    status = json.loads(subprocess.run(["dvc", "status", "--json"], cwd=root, env=env,
                                       capture_output=True, text=True, check=True).stdout)
    assert "train" not in status, status
    shutil.rmtree(other)
    before = {d.name: sorted(p.name for p in d.glob("step-*.pt")) for d in ck.iterdir()}
    out = run(["dvc", "exp", "run", "-S", "train.max_lr=5e-4"], root, env)
    for stage in ("ingest", "filter", "dedup", "mix", "tokenizer", "shards"):
        assert f"Stage '{stage}' didn't change, skipping" in out, out[-3000:]
        assert f"Running stage '{stage}'" not in out
    assert "Running stage 'train'" in out
    assert "Running stage 'evaluate'" in out
    # The first run's checkpoints persist, but were made with other params: never resumed,
    # never removed; the experiment's run has a directory of its own.
    assert load(root / "metrics" / "train.json")["resumed_from"] is None
    after = {d.name: sorted(p.name for p in d.glob("step-*.pt")) for d in ck.iterdir()}
    # Three new runs: the experiment's pretraining and the fine-tuning and DPO of its model.
    assert len(after) == len(before) + 3
    assert all(after[name] == files for name, files in before.items())
    diff = json.loads(run(["dvc", "metrics", "diff", "HEAD", "--json"], root, env))
    assert "base.bpb" in diff["metrics/headline.json"]
    # The experiment beside its baseline: the changed param and the headline figures as
    # numbers, in a 200-column terminal.
    shown = run(["dvc", "exp", "show", "--only-changed", "--no-pager"], root,
                {**env, "COLUMNS": "200"}).splitlines()
    assert max(map(len, shown)) <= 200, "\n".join(shown)
    (header,) = [line for line in shown if "Experiment" in line]
    assert "train.max_lr" in header and "base.bpb" in header, header
    (row,) = [line for line in shown if "└── " in line]  # the experiment's row
    bpb = load(root / "metrics" / "headline.json")["base"]["bpb"]
    assert f"{bpb:.5g}" in row.split(), row


def test_dvc_plots_page_carries_every_curve(pipeline, env):
    root, _ = pipeline
    out = root / "plots_html"
    run(["dvc", "plots", "show", "-o", str(out)], root, env)
    page = (out / "index.html").read_text(encoding="utf-8")
    assert "vega" in page.lower()
    for name in ("loss", "learning_rate", "grad_norm", "tokens_per_sec",
                 "bits_per_byte_by_domain"):
        assert name in page, name
    for domain in load(root / "metrics" / "ingest.json")["domains"]:
        assert domain in page  # the per-domain bits-per-byte bars have their data inline


def test_post_training_outputs(pipeline, env):
    root, _ = pipeline
    # The fine-tuning run is listed with the pretraining runs, and matched to the sft
    # section of params.yaml, not to train's.
    listing = run(["lmforge", "checkpoints"], root, env)
    assert "[sft] (this is the run params.yaml trains)" in listing, listing
    data = load(root / "metrics" / "sft_data.json")
    c = data["counts"]
    assert c["in"] == 300 and c["kept"] + sum(c["rejected"].values()) == 300
    assert data["train"]["examples"] + data["val"]["examples"] == c["kept"]
    assert 0 < data["train"]["target_share"] < 1
    sft = load(root / "metrics" / "sft.json")
    assert sft["steps"] == 6 and sft["mode"] == "full" and sft["replay_row_share"] == 0.25
    assert sft["replay_loss_token_share"] > 0.25  # replay rows are all targets
    for name in ("model.safetensors", "config.json", "tokenizer.model", "run.json"):
        assert (root / "models" / "sft" / name).is_file(), name
    headline = load(root / "metrics" / "post.json")
    assert headline["sft"]["token_accuracy"] > 0
    for model in ("sft", "dpo"):
        assert "en_literature" in headline["forgetting_bits_per_byte"][model]
    post = load(root / "metrics" / "post_detail.json")
    for model in ("base", "sft", "dpo"):
        assert math.isfinite(post["tasks"][model]["response"]["overall"]["loss"])
        assert post["tasks"][model]["multiple_choice"]["overall"]["n"] == 20
        assert post["preferences"][model]["overall"]["n"] == 40
        assert 0 <= headline[model]["pref_accuracy"] <= 1
    # The DPO model's reward is measured against its reference, the SFT model.
    assert post["preferences"]["dpo"]["overall"]["reference"] == "sft"
    assert "reward_accuracy" not in post["preferences"]["sft"]["overall"]
    domains = set(load(root / "metrics" / "ingest.json")["domains"])
    for model in ("sft", "dpo"):
        rows = {r["domain"] for r in post["forgetting"][model]["bits_per_byte"]}
        assert domains | {"mix_weighted", "token_weighted"} == rows
    # Fine-tuning moved the model, so its response loss differs from the base's.
    assert post["tasks"]["sft"]["response"]["overall"]["loss"] != \
        post["tasks"]["base"]["response"]["overall"]["loss"]
    for name in ("forgetting.md", "post_tasks.md", "post_samples.md"):
        assert (root / "metrics" / name).stat().st_size > 100, name


def test_dpo_outputs(pipeline, env):
    root, _ = pipeline
    data = load(root / "metrics" / "dpo_data.json")
    c = data["counts"]
    assert c["in"] == 300 and c["kept"] + sum(c["rejected"].values()) == 300
    assert data["train"]["pairs"] + data["val"]["pairs"] == c["kept"]
    dpo = load(root / "metrics" / "dpo.json")
    assert dpo["steps"] == 4 and dpo["mode"] == "full" and dpo["beta"] == 0.05
    for key in ("val_loss", "val_reward_accuracy", "val_reward_margin", "val_kl_per_token"):
        assert math.isfinite(dpo[key]), key
    assert dpo["val_kl_per_token"] > 0  # the policy moved away from its reference
    for name in ("model.safetensors", "config.json", "tokenizer.model", "run.json"):
        assert (root / "models" / "dpo" / name).is_file(), name
    rows = (root / "plots" / "dpo.tsv").read_text().splitlines()
    assert rows[0].split("\t")[:2] == ["step", "loss"] and "reward_accuracy" in rows[0]
    assert len(rows) == 1 + 2  # logged at steps 2 and 4
    listing = run(["lmforge", "checkpoints"], root, env)
    assert "[dpo] (this is the run params.yaml trains)" in listing, listing


def test_harness_scores_every_model_on_every_shipped_task(pipeline):
    root, _ = pipeline
    figures = load(root / "metrics" / "harness.json")
    tasks = {p.stem for p in (REPO / "data" / "tasks" / "demo").glob("*.yaml")}
    assert len(tasks) == 5 and set(figures["chance"]) == {f"demo_{t}" for t in tasks}
    for model in ("base", "sft", "dpo"):
        assert set(figures[model]) == set(figures["chance"])
        for task, figs in figures[model].items():
            assert figs["n"] == 6 and 0 <= figs["acc"] <= 1, (model, task)
    table = (root / "metrics" / "harness.md").read_text(encoding="utf-8")
    assert "| demo_pref_pairs |" in table and "chance" in table


def changed_stages(root: Path, env: dict[str, str], key: str, value: str) -> set[str]:
    """The stages `dvc status` finds changed once params.yaml sets ``key`` to ``value``
    (params.yaml restored after): those whose own params name the key. DVC reruns them
    and what depends on them (``downstream``)."""
    path = root / "params.yaml"
    before = path.read_text(encoding="utf-8")
    params = yaml.safe_load(before)
    section, name = key.split(".")
    params[section][name] = yaml.safe_load(value)
    path.write_text(yaml.safe_dump(params, sort_keys=False), encoding="utf-8")
    try:
        status = subprocess.run(["dvc", "status", "--json"], cwd=root, env=env,
                                capture_output=True, text=True, check=True).stdout
    finally:
        path.write_text(before, encoding="utf-8")
    return set(json.loads(status))


def downstream(root: Path, stage: str) -> set[str]:
    """The stages dvc.yaml runs after ``stage`` because they read, directly or through
    another stage, what it writes."""
    stages = yaml.safe_load((root / "dvc.yaml").read_text(encoding="utf-8"))["stages"]

    def outs(name: str) -> set[str]:
        return {o if isinstance(o, str) else next(iter(o)) for o in stages[name].get("outs", [])}

    found, frontier = set(), outs(stage)
    while frontier:
        readers = {n for n, s in stages.items() if n not in found
                   and any(d in frontier for d in s.get("deps", []))}
        found |= readers
        frontier = set().union(*(outs(n) for n in readers)) if readers else set()
    return found


def test_post_training_params_change_only_post_training_stages(pipeline, env):
    root, _ = pipeline
    # Each key changes its own stage and nothing upstream of it (`dvc status`), and DVC
    # reruns that stage and what reads its outputs (dvc.yaml): a whole experiment that
    # reruns every stage after `train` is test_exp_run_train_param_skips_data_stages.
    upstream = {"ingest", "filter", "dedup", "decontam", "mix", "tokenizer", "shards",
                "train", "evaluate"}
    changed = changed_stages(root, env, "sft.lr", "5e-4")
    assert "sft" in changed and not changed & (upstream | {"sft_data"}), changed
    changed = changed_stages(root, env, "sft_data.val_fraction", "0.2")
    assert "sft_data" in changed and not changed & upstream, changed
    changed = changed_stages(root, env, "dpo.beta", "0.2")
    assert "dpo" in changed and not changed & (upstream | {"sft_data", "sft", "dpo_data"}), changed
    assert downstream(root, "dpo") == {"evaluate_post", "harness", "headline"}
    assert downstream(root, "sft") >= {"dpo", "evaluate_post", "harness", "headline"}
    assert not downstream(root, "sft") & (upstream | {"sft_data", "dpo_data"})


def test_mix_sweep_queues_proxies_that_rerun_only_mix_to_evaluate_and_fits(pipeline, env):
    """lmforge mix sweep / fit / score on the real DVC queue: two proxies, run side by side
    (jobs=2); what each proxy is told and the fit's arithmetic are tested on many proxies
    around a fake queue in tests/test_mixture_sweep.py."""
    root, _ = pipeline
    params = yaml.safe_load((root / "params.yaml").read_text(encoding="utf-8"))
    params["mix_sweep"].update(proxies=2, jobs=2, max_steps=4, micro_batch_size=4,
                               eval_batches=2, proxy_model={"n_layer": 1, "n_embd": 32},
                               candidates=2000, top_k=10)
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False),
                                      encoding="utf-8")
    out = run(["lmforge", "mix", "sweep"], root, env)
    assert "2 proxies queued, 0 already there" in out, out
    assert "did not succeed" not in out, out
    key = re.search(r"settings ([0-9a-f]{8}): ", out).group(1)
    names = [f"mixsweep-{key}-{i:02d}" for i in range(2)]
    shown = json.loads(run(["dvc", "exp", "show", "--json"], root, env))
    found = {r["name"]: r for c in shown for e in (c.get("experiments") or [])
             for r in e["revs"]}
    frozen = str(root / "models" / "mix_sweep" / "mixsweep" / "tokenizer.model")
    sweep_weights = []
    loaded = load_params(root / "params.yaml")
    today = sweep.proxy_settings(params, sweep.proxy_sets(loaded, Path(frozen)),
                                 loaded.mix_sweep, Path(frozen))
    assert sweep.settings_key(today) == key
    for name in names:
        assert name in found, sorted(found)
        data = found[name]["data"]
        p = data["params"]["params.yaml"]["data"]
        assert p["tokenizer"]["init_from"] == frozen and p["model"]["n_layer"] == 1
        # What DVC recorded is what the sweep's key stands for (the values, their types).
        recorded = sweep.recorded_settings(p)
        assert recorded == {k: v for k, v in today.items() if k != "tokenizer.frozen_sha256"}
        sweep_weights.append(p["mix"]["weights"])
        # Detail files are plain outputs, committed in the experiment's git commit.
        tokenizer = committed_json(found[name]["rev"], cwd=str(root))["metrics/tokenizer.json"]
        assert tokenizer["init_from"] == frozen
        logs = run(["dvc", "queue", "logs", name], root, env)
        for stage in ("ingest", "filter", "dedup"):
            assert f"Running stage '{stage}'" not in logs, logs[-3000:]
        for stage in ("mix", "tokenizer", "shards", "train", "evaluate"):
            assert f"Running stage '{stage}'" in logs, logs[-3000:]
        assert "Running stage 'sft" not in logs  # nothing after evaluate
    assert sweep_weights[0] != sweep_weights[1]
    # The tokenizer is the one frozen from the workspace, so every proxy's ids agree.
    assert Path(frozen).read_bytes() == (root / "models" / "tokenizer" /
                                         "tokenizer.model").read_bytes()

    # A rerun queues nothing: every proxy is there.
    assert "0 proxies queued, 2 already there" in run(["lmforge", "mix", "sweep"], root, env)

    out = run(["lmforge", "mix", "fit"], root, env)
    fit = load(root / "metrics" / "mix_fit.json")
    assert fit["proxies"] == names and len(fit["measured_objective"]) == 2
    assert all(math.isfinite(v) for v in fit["measured_objective"])
    laws = {law["name"]: law for law in fit["laws"]}
    assert "linear" in laws and laws["mixing_law"]["error"]  # 2 points: too few for it
    if fit["trusted"]:
        assert sum(fit["recommendation"].values()) == pytest.approx(1.0)
    else:
        assert fit["recommendation"] is None and "rank correlation" in fit["reason"]
    assert (root / "plots" / "mix_fit.tsv").read_text().count("\n") == 3
    scored = run(["lmforge", "mix", "score", names[1]], root, env)
    assert "workspace: objective" in scored and f"{names[1]}: objective" in scored
