"""lmforge mix sweep / fit / score around a fake DVC: which proxies are queued (a rerun
goes on where the sweep was), what each is told, and the fit's outputs from their
results. The real DVC queue runs in tests/test_pipeline_e2e.py."""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from lmforge.config import load_params
from lmforge.errors import InputError
from lmforge.mixture import report, sweep

REPO = Path(__file__).resolve().parents[1]
DOMAINS = ["code_python", "en_literature", "en_tech", "math", "zh_classical", "zh_modern"]
AVAILABLE = [3.0e6, 3.6e6, 4.2e6, 4.8e6, 1.6e6, 1.4e6]


@pytest.fixture
def workspace(tmp_path, monkeypatch):
    """A repo root with params.yaml and the metrics a reproduced pipeline leaves."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.setenv("LMFORGE_TRACKING", "on")
    (tmp_path / "params.yaml").write_text((REPO / "params.yaml").read_text(encoding="utf-8"))
    (tmp_path / "metrics").mkdir()
    # Domain d was repeated e times: it wrote e x its text.
    epochs = [0.5, 1.0, 2.0, 0.25, 1.5, 2.0]
    mix = {"domains": {d: {"train_chars": a * e, "epochs": e, "achieved_share": 1 / 6}
                       for d, a, e in zip(DOMAINS, AVAILABLE, epochs, strict=True)}}
    (tmp_path / "metrics" / "mix.json").write_text(json.dumps(mix))
    (tmp_path / "metrics" / "shards.json").write_text(json.dumps({"train": {"tokens": 4e6}}))
    (tmp_path / "models" / "tokenizer").mkdir(parents=True)
    (tmp_path / "models" / "tokenizer" / "tokenizer.model").write_bytes(b"sp-model")
    return tmp_path


def params(**sweep_cfg):
    p = load_params("params.yaml")
    p.mix_sweep = dataclasses.replace(p.mix_sweep, **sweep_cfg)
    p.validate()
    return p


def test_domain_sizes_are_the_unique_text_behind_each_share(workspace):
    sizes = sweep.domain_sizes()
    assert sizes.domains == DOMAINS
    assert np.allclose(sizes.available, AVAILABLE)
    assert sum(sizes.natural.values()) == pytest.approx(1.0)
    assert sizes.natural["math"] == pytest.approx(4.8 / sum(AVAILABLE) * 1e6)


def test_mix_json_missing_is_one_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InputError, match="dvc repro mix"):
        sweep.domain_sizes()


def test_proxy_mixtures_are_seeded_bounded_and_a_longer_sweep_keeps_the_first(workspace):
    sizes = sweep.domain_sizes()
    bounds = {"math": [0.1, 0.5]}
    six = sweep.proxy_mixtures(params(proxies=6, bounds=bounds).mix_sweep, sizes)
    ten = sweep.proxy_mixtures(params(proxies=10, bounds=bounds).mix_sweep, sizes)
    assert np.array_equal(ten[:6], six)
    assert np.allclose(ten.sum(axis=1), 1.0)
    math_col = DOMAINS.index("math")
    assert ((ten[:, math_col] >= 0.1) & (ten[:, math_col] <= 0.5)).all()
    other = sweep.proxy_mixtures(params(proxies=6, bounds=bounds, seed=1).mix_sweep, sizes)
    assert not np.allclose(other, six)


class FakeDvc:
    """Records what the sweep asks of DVC; experiments in ``states`` already exist."""

    def __init__(self, states: dict[str, str]) -> None:
        self.states = dict(states)
        self.queued: dict[str, list[str]] = {}
        self.calls: list[tuple[str, ...]] = []

    def dvc(self, *args: str) -> str:
        self.calls.append(args)
        if args[:2] == ("exp", "remove"):
            del self.states[args[2]]
        return "{}" if args[0] == "status" else ""

    def start(self, jobs: int) -> None:  # the queue runs: every queued one succeeds
        self.calls.append(("queue", "start", "-j", str(jobs)))
        self.states.update(dict.fromkeys(self.queued, "success"))

    def queue(self, name: str, sets: list[str], targets: tuple[str, ...] = ()) -> None:
        assert targets == ("evaluate",)  # the stages after evaluate never run for a proxy
        assert name not in self.states, f"{name} queued twice"
        self.queued[name] = sets

    def experiments(self) -> dict:
        return {n: {"state": s, "metrics": {}, "params": {}} for n, s in self.states.items()}

    def install(self, monkeypatch) -> None:
        monkeypatch.setattr(sweep, "dvc", self.dvc)
        monkeypatch.setattr(sweep, "queue_experiment", self.queue)
        monkeypatch.setattr(sweep, "start_queue", self.start)
        monkeypatch.setattr(sweep, "experiments", self.experiments)
        monkeypatch.setattr(sweep, "wait_for_queue", lambda report=None: None)


def today_key(p) -> str:
    """The settings key of the sweep ``p`` asks for, in the workspace as it is."""
    return sweep.sweep_settings(p, sweep.sweep_tokenizer(p.mix_sweep.name))[0]


def test_a_rerun_queues_only_the_proxies_not_done_and_retries_the_failed(workspace,
                                                                         monkeypatch):
    p = params(proxies=5, jobs=2)
    k = today_key(p)
    fake = FakeDvc({f"mixsweep-{k}-00": "success", f"mixsweep-{k}-02": "failed",
                    f"mixsweep-{k}-03": "running", "other-exp": "success"})
    fake.install(monkeypatch)
    lines: list[str] = []
    names = sweep.run_sweep(p, log=lines.append)
    assert names == [f"mixsweep-{k}-{i:02d}" for i in range(5)]
    assert sorted(fake.queued) == [f"mixsweep-{k}-01", f"mixsweep-{k}-02", f"mixsweep-{k}-04"]
    assert ("exp", "remove", f"mixsweep-{k}-02") in fake.calls
    assert ("queue", "start", "-j", "2") in fake.calls
    assert any("3 proxies queued, 2 already there" in line for line in lines), lines

    # What a proxy is told: its weights, the proxy's shape and budget, the frozen tokenizer.
    sets = fake.queued[f"mixsweep-{k}-01"]
    weights = {s.split("=")[0].removeprefix("mix.weights."): float(s.split("=")[1])
               for s in sets if s.startswith("mix.weights.")}
    assert sorted(weights) == DOMAINS and sum(weights.values()) == pytest.approx(1, abs=1e-5)
    expected = sweep.proxy_mixtures(params(proxies=5).mix_sweep, sweep.domain_sizes())[1]
    assert np.allclose([weights[d] for d in DOMAINS], expected, atol=1e-6)
    frozen = workspace / "models" / "mix_sweep" / "mixsweep" / "tokenizer.model"
    assert f"tokenizer.init_from={frozen}" in sets
    assert frozen.read_bytes() == b"sp-model"
    assert {"model.n_layer=2", "train.max_steps=150", "train.compile=false",
            "evaluate.max_batches=32", "train.warmup=0.05"} <= set(sets)
    # A warmup in steps is the real run's share of its steps for the proxy: 40 of its
    # 150 would be most of it, and the whole of a shorter one.
    p.train = dataclasses.replace(p.train, warmup=50, max_steps=500)
    assert "train.warmup=0.1" in sweep.proxy_sets(p, frozen)


def test_a_rerun_with_every_proxy_done_starts_no_queue(workspace, monkeypatch):
    p = params(proxies=2, jobs=2)
    k = today_key(p)
    fake = FakeDvc({f"mixsweep-{k}-00": "success", f"mixsweep-{k}-01": "success"})
    fake.install(monkeypatch)
    lines: list[str] = []
    assert sweep.run_sweep(p, log=lines.append) == [f"mixsweep-{k}-00", f"mixsweep-{k}-01"]
    assert not fake.queued and not any(c[:2] == ("queue", "start") for c in fake.calls)
    assert any("0 proxies queued, 2 already there" in line for line in lines), lines
    # One still running: the queue is started (it may have been stopped) and waited for.
    fake = FakeDvc({f"mixsweep-{k}-00": "success", f"mixsweep-{k}-01": "running"})
    fake.install(monkeypatch)
    sweep.run_sweep(p, log=lambda _: None)
    assert not fake.queued and ("queue", "start", "-j", "2") in fake.calls


def test_the_frozen_tokenizer_outlives_a_new_workspace_tokenizer(workspace, monkeypatch):
    FakeDvc({}).install(monkeypatch)
    sweep.run_sweep(params(proxies=1), log=lambda _: None)
    (workspace / "models" / "tokenizer" / "tokenizer.model").write_bytes(b"retrained")
    fake = FakeDvc({})
    fake.install(monkeypatch)
    lines: list[str] = []
    sweep.run_sweep(params(proxies=2), log=lines.append)
    frozen = workspace / "models" / "mix_sweep" / "mixsweep" / "tokenizer.model"
    assert frozen.read_bytes() == b"sp-model"
    assert all(f"tokenizer.init_from={frozen}" in sets for sets in fake.queued.values())
    assert any("changed since sweep mixsweep froze" in line for line in lines), lines
    # A sweep of another name freezes the workspace's tokenizer as it is now.
    FakeDvc({}).install(monkeypatch)
    sweep.run_sweep(params(proxies=1, name="sweep2"), log=lambda _: None)
    assert (workspace / "models" / "mix_sweep" / "sweep2" / "tokenizer.model"
            ).read_bytes() == b"retrained"


def test_a_rerun_with_other_settings_queues_new_proxies_and_keeps_the_old(workspace,
                                                                          monkeypatch):
    fake = FakeDvc({})
    fake.install(monkeypatch)
    sweep.run_sweep(params(proxies=3), log=lambda _: None)
    first = sorted(fake.queued)
    assert len(first) == 3
    for change in ({"max_steps": 600}, {"seed": 1}, {"proxy_model": {"n_layer": 3}}):
        fake.queued = {}
        lines: list[str] = []
        sweep.run_sweep(params(proxies=3, **change), log=lines.append)
        assert len(fake.queued) == 3 and not set(fake.queued) & set(first), (change, lines)
        assert any("3 proxies queued, 0 already there" in line for line in lines), lines
        assert set(first) <= set(fake.states) and not any(c[:2] == ("exp", "remove")
                                                          for c in fake.calls)
    # A change in the workspace's params.yaml the proxies train with counts too; one that
    # only changes how runs are observed does not.
    for key, value, new in (("train.max_lr", 5e-4, True), ("train.log_every", 7, False),
                            ("dedup.num_workers", 1, False)):
        raw = yaml.safe_load(Path("params.yaml").read_text(encoding="utf-8"))
        section, field = key.split(".")
        raw[section][field] = value
        Path("params.yaml").write_text(yaml.safe_dump(raw), encoding="utf-8")
        fake.queued = {}
        sweep.run_sweep(params(proxies=3), log=lambda _: None)
        assert bool(fake.queued) == new, key
        if new:
            first = sorted(fake.queued)


def test_fit_uses_only_the_proxies_of_todays_settings_and_says_what_the_others_differ_in(
        workspace, monkeypatch):
    shares, bpb = synthetic_results(20, np.random.default_rng(0))
    old = params(proxies=20, max_steps=600)
    exps = {**fake_experiments(shares, bpb), **fake_experiments(shares[:8], bpb[:8] + 1, p=old)}
    assert len(exps) == 28
    monkeypatch.setattr(report, "experiments", lambda: exps)
    lines: list[str] = []
    fitted = report.run_fit(params(proxies=20, candidates=5_000), log=lines.append)
    saved = json.loads((workspace / "metrics" / "mix_fit.json").read_text())
    assert saved["proxies"] == sorted(fake_experiments(shares, bpb))
    assert fitted.trusted
    line = next(line for line in lines if "left out" in line)
    assert "8 proxies of sweep mixsweep trained with other settings" in line
    assert "train.max_steps 600 -> 150" in line and "model." not in line, line

    # Only proxies of other settings: refused in one line that says why.
    monkeypatch.setattr(report, "experiments", lambda: fake_experiments(shares, bpb, p=old))
    with pytest.raises(InputError, match=r"no finished proxies of sweep mixsweep with "
                                         r"today's settings .*train.max_steps 600 -> 150"):
        report.run_fit(params(proxies=20), log=lambda _: None)


def test_stale_data_stages_stop_the_sweep_before_queueing(workspace, monkeypatch):
    fake = FakeDvc({})
    fake.install(monkeypatch)
    monkeypatch.setattr(sweep, "dvc", lambda *a, **k: json.dumps({"dedup": []})
                        if a[0] == "status" else "")
    with pytest.raises(InputError, match="dedup"):
        sweep.run_sweep(params(proxies=2), log=lambda _: None)
    assert not fake.queued


# ------------------------------------------------------------------------------ fit


def synthetic_results(n: int, rng: np.random.Generator, noise: float = 0.002):
    """Proxies whose bits-per-byte follow a known law: each domain gains from its own
    share and a little from its language's neighbours."""
    sizes = sweep.domain_sizes()
    shares = sweep.proxy_mixtures(params(proxies=n).mix_sweep, sizes)
    gain = np.full((6, 6), 0.05) + np.eye(6) * 1.2
    bpb = 3.0 - np.log1p(shares @ gain.T * 4) + rng.normal(0, noise, (n, 6))
    return shares, bpb


def recorded_params(p) -> dict:
    """params.yaml as DVC records it for a proxy of sweep ``p``: the workspace's, with the
    sweep's overrides."""
    raw = yaml.safe_load(Path("params.yaml").read_text(encoding="utf-8"))
    raw["mix_sweep"].update({n: getattr(p.mix_sweep, n) for n in sweep.SAMPLING})
    for override in sweep.proxy_sets(p, sweep.sweep_tokenizer(p.mix_sweep.name)):
        key, _, text = override.partition("=")
        *parents, leaf = key.split(".")
        node = raw
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = yaml.safe_load(text)
    return {"params.yaml": raw}


def fake_experiments(shares, bpb, failed=(), p=None):
    """Finished proxies of sweep ``p`` (the default params) with these results."""
    p = p or params()
    key, recorded = today_key(p), recorded_params(p)
    exps = {}
    for i, (s, b) in enumerate(zip(shares, bpb, strict=True)):
        name = f"mixsweep-{key}-{i:02d}"
        exps[name] = {"state": "failed" if i in failed else "success", "params": recorded,
                      "metrics": {
                          "metrics/mix.json": {"domains": {
                              d: {"achieved_share": float(v)} for d, v in zip(DOMAINS, s, strict=True)}},
                          "metrics/eval.json": {"val": {"domains": {
                              d: {"bits_per_byte": float(v)} for d, v in zip(DOMAINS, b, strict=True)}}}}}
    return exps


def test_fit_recommends_a_feasible_mixture_and_writes_what_dvc_and_mlflow_show(
        workspace, monkeypatch):
    shares, bpb = synthetic_results(24, np.random.default_rng(0))
    exps = fake_experiments(shares, bpb, failed={5})
    first = next(iter(exps))
    exps["mixsweep-confirm"] = exps["other"] = exps[first]
    monkeypatch.setattr(report, "experiments", lambda: exps)
    lines: list[str] = []
    # 20 in params, 24 run (`mix sweep --proxies 24`): all of them count.
    p = params(proxies=20, candidates=20_000, top_k=50)
    fitted = report.run_fit(p, log=lines.append)
    assert fitted.trusted and fitted.rank_corr > 0.8, fitted.rank_corr
    rec = fitted.recommendation
    assert sorted(rec) == DOMAINS and sum(rec.values()) == pytest.approx(1.0)
    # Feasible: no domain read more than max_epochs times by the real run.
    chars = report.train_chars(p, sweep.domain_sizes())
    assert all(rec[d] * chars / a <= p.mix.max_epochs + 1e-9
               for d, a in zip(DOMAINS, AVAILABLE, strict=True))
    assert fitted.predicted_objective < fitted.reference_objective

    saved = json.loads((workspace / "metrics" / "mix_fit.json").read_text())
    assert len(saved["proxies"]) == 23 and first.replace("-00", "-05") not in saved["proxies"]
    rows = (workspace / "plots" / "mix_fit.tsv").read_text().splitlines()
    assert rows[0] == "proxy\tmeasured\tpredicted" and len(rows) == 24
    md = (workspace / "metrics" / "mix_fit.md").read_text()
    assert "dvc exp run --temp evaluate -n mixsweep-confirm -S mix.weights." in md
    assert any("recommended mix.weights" in line for line in lines)

    import mlflow

    runs = mlflow.search_runs(experiment_names=["lmforge"],
                              filter_string="tags.`lmforge.stage` = 'mix_fit'")
    assert len(runs) == 1
    assert runs.iloc[0]["metrics.rank_corr"] == pytest.approx(fitted.rank_corr)


def test_a_fit_on_noise_recommends_nothing_and_says_why(workspace, monkeypatch):
    rng = np.random.default_rng(1)
    shares, _ = synthetic_results(20, rng)
    noise = 3.0 + rng.normal(0, 0.05, (20, 6))
    monkeypatch.setattr(report, "experiments", lambda: fake_experiments(shares, noise))
    fitted = report.run_fit(params(proxies=20, candidates=5_000), log=lambda _: None)
    assert not fitted.trusted and fitted.recommendation is None
    assert "rank correlation" in fitted.reason
    md = (workspace / "metrics" / "mix_fit.md").read_text()
    assert "no recommendation" in md and "dvc exp run" not in md


def test_no_finished_proxy_is_one_line(workspace, monkeypatch):
    monkeypatch.setattr(report, "experiments", dict)
    with pytest.raises(InputError, match="lmforge mix sweep"):
        report.run_fit(params(), log=lambda _: None)


def test_score_uses_the_objectives_fixed_weights(workspace, monkeypatch):
    b = {d: 2.0 + i / 10 for i, d in enumerate(DOMAINS)}
    (workspace / "metrics" / "eval.json").write_text(json.dumps(
        {"val": {"domains": {d: {"bits_per_byte": v} for d, v in b.items()}}}))
    other = fake_experiments([np.full(6, 1 / 6)], [np.full(6, 2.5)])
    monkeypatch.setattr(report, "experiments", lambda: other)
    (name,) = other
    scores = report.run_score(params(), [name], log=lambda _: None)
    assert scores["workspace"] == pytest.approx(np.mean(list(b.values())))
    assert scores[name] == pytest.approx(2.5)
    target = report.run_score(params(objective="target", target_domain="math"), [],
                              log=lambda _: None)
    assert target["workspace"] == pytest.approx(b["math"])
    with pytest.raises(InputError, match="nope"):
        report.run_score(params(), ["nope"], log=lambda _: None)


def test_mix_sweep_settings_are_checked_on_load(tmp_path):
    raw = yaml.safe_load((REPO / "params.yaml").read_text(encoding="utf-8"))
    raw["mix_sweep"]["bounds"] = {"klingon": [0.1, 0.2]}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    from lmforge.errors import ConfigError

    with pytest.raises(ConfigError, match="klingon"):
        load_params(tmp_path / "params.yaml")
    raw["mix_sweep"].update(bounds={}, objective="target", target_domain=None)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match="target_domain"):
        load_params(tmp_path / "params.yaml")


def test_experiments_reads_dvc_exp_show_for_queued_temp_and_failed_runs(monkeypatch):
    """The shape of `dvc exp show --json --all-commits` (DVC 3): a branch with data is no
    experiment; a queued one has an executor state; one run with --temp has none."""
    from lmforge import experiments as exps

    def rev(name, v):
        return {"rev": "r" + name, "name": name, "data": {
            "rev": "r" + name, "metrics": {"m.json": {"data": {"v": v}}},
            "params": {"params.yaml": {"data": {"a": v}}}}}

    shown = [{"rev": "workspace", "name": None, "data": rev("ws", 0)["data"],
              "experiments": None},
             {"rev": "abc", "name": "main", "data": rev("main", 1)["data"], "experiments": [
                 {"revs": [rev("q-00", 2)], "executor": {"state": "success"}, "name": "q-00"},
                 {"revs": [rev("q-01", 3)], "executor": {"state": "failed"}, "name": "q-01"},
                 {"revs": [rev("confirm", 4)], "executor": None, "name": "confirm"}]}]
    monkeypatch.setattr(exps, "dvc", lambda *a, **k: json.dumps(shown))
    found = exps.experiments()
    assert sorted(found) == ["confirm", "q-00", "q-01"]
    assert [found[n]["state"] for n in ("q-00", "q-01", "confirm")] == [
        "success", "failed", "success"]
    assert found["confirm"]["metrics"] == {"m.json": {"v": 4}}
    assert found["q-00"]["params"] == {"params.yaml": {"a": 2}}


def test_a_failed_queue_status_poll_is_tried_again_and_the_third_failure_is_the_error(
        monkeypatch):
    """`dvc queue status` can fail after printing its table (DVC's worker-status race);
    one failed poll must not end a sweep, three in a row must, naming dvc's error."""
    from lmforge import experiments as exps
    from lmforge.errors import LmforgeError

    table = ("Task     Name   Created    Status\n46efa32  p-00   12:06 PM   Running\n"
             "8d2b9c0  p-01   12:07 PM   Success\n")
    answers = [LmforgeError("dvc queue status failed: Extra data"), table]

    def fake_dvc(*args):
        assert args == ("queue", "status")
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(exps, "dvc", fake_dvc)
    assert exps.busy_experiments(pause=0) == ["46efa32  p-00   12:06 PM   Running"]
    assert answers == []

    answers[:] = [LmforgeError(f"dvc queue status failed: try {i}") for i in range(3)]
    with pytest.raises(LmforgeError, match="try 2"):
        exps.busy_experiments(pause=0)
    assert answers == []


def test_dvc_failure_names_stderr_after_a_table_on_stdout(tmp_path, monkeypatch):
    """The one-line error ends with dvc's error, not the table dvc printed before it."""
    from lmforge import experiments as exps
    from lmforge.errors import LmforgeError

    fake = tmp_path / "dvc"
    fake.write_text("#!/bin/sh\necho 'Task Name Created Status'\necho 'abc p-00 Running'\n"
                    "echo 'ERROR: unexpected error - Extra data: line 1' >&2\nexit 255\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    with pytest.raises(LmforgeError, match=r"Running / ERROR: unexpected error - Extra data"):
        exps.dvc("queue", "status")


def test_the_queue_is_polled_again_as_soon_as_dvcs_queue_files_change(tmp_path, monkeypatch):
    """An experiment ending writes Celery's task result: the wait asks `dvc queue status`
    then, not a whole poll interval (here 10 minutes) later."""
    from lmforge import experiments as exps

    monkeypatch.chdir(tmp_path)
    results = tmp_path / ".dvc" / "tmp" / "exps" / "celery" / "result"
    results.mkdir(parents=True)
    running = "46efa32  p-00   12:06 PM   Running\n"
    polls: list[float] = []

    def fake_dvc(*args):
        polls.append(time.monotonic())
        return running if len(polls) == 1 else "46efa32  p-00   12:06 PM   Success\n"

    def finish():  # the queue's worker, a moment later
        time.sleep(1.0)
        (results / "celery-task-meta-1").write_text("{}")

    monkeypatch.setattr(exps, "dvc", fake_dvc)
    seen: list[int] = []
    worker = threading.Thread(target=finish)
    start = time.monotonic()
    worker.start()
    exps.wait_for_queue(poll=600.0, report=seen.append)
    worker.join()
    assert seen == [1] and len(polls) == 2
    assert polls[1] - start < 60  # woken by the file, not by the 600 s poll


def test_an_experiment_ending_while_the_queue_is_asked_is_not_missed(tmp_path, monkeypatch):
    """The result file is written while `dvc queue status` runs (it takes seconds) and
    that status still said Running: the change counts, the next poll comes at once."""
    from lmforge import experiments as exps

    monkeypatch.chdir(tmp_path)
    results = tmp_path / ".dvc" / "tmp" / "exps" / "celery" / "result"
    results.mkdir(parents=True)
    polls: list[float] = []

    def fake_dvc(*args):
        polls.append(time.monotonic())
        if len(polls) == 1:
            (results / "celery-task-meta-1").write_text("{}")  # ends as the table prints
            return "46efa32  p-00   12:06 PM   Running\n"
        return "46efa32  p-00   12:06 PM   Success\n"

    monkeypatch.setattr(exps, "dvc", fake_dvc)
    exps.wait_for_queue(poll=30.0)
    assert len(polls) == 2 and polls[1] - polls[0] < 10  # not the 30 s poll


def test_waiting_for_a_queue_change_times_out_when_nothing_changes(tmp_path):
    from lmforge.experiments import queue_fingerprint, wait_for_queue_change

    run_dir = tmp_path / ".dvc" / "tmp" / "exps" / "run" / "abc"
    run_dir.mkdir(parents=True)
    (run_dir / "abc.run").write_text('{"status": 1}')
    before = queue_fingerprint(tmp_path)
    wait_for_queue_change(0.2, tmp_path, tick=0.05)  # returns: nothing changed, time is up
    assert queue_fingerprint(tmp_path) == before and len(before) == 2  # the folder, the file
    (run_dir / "abc.out").write_text("Running stage 'train':\n")  # the experiment's log
    before = queue_fingerprint(tmp_path)  # (the folder's mtime may move as the log appears)
    with (run_dir / "abc.out").open("a") as log:
        log.write("step 1 loss 5.0\n")
    assert queue_fingerprint(tmp_path) == before
    (run_dir / "abc.run").write_text('{"status": 2, "done": 1}')
    assert queue_fingerprint(tmp_path) != before
    assert queue_fingerprint(tmp_path / "elsewhere") == ()  # no queue: nothing to see
