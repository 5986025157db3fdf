"""MLflow tracking of training and evaluation runs, against a temporary sqlite store."""

from __future__ import annotations

import base64
import json
import shutil
import zlib
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from lmforge import tracking
from lmforge.config import load_params
from lmforge.evaluate import tracking as eval_tracking
from lmforge.evaluate.tracking import log_to_mlflow
from lmforge.train import telemetry

REPO = Path(__file__).resolve().parents[1]
# The tags are a contract with the MLflow UI and with users' searches: spelled out here.
EVALUATED, TRAIN_RUN, PARENT = "lmforge.evaluated", "lmforge.train_run_id", "mlflow.parentRunId"
KIND = "mlflow.experimentKind"

OLD_RESULTS = {  # metrics/eval.json before the mixture-weighted figures
    "bits_per_byte": 2.5, "seconds": 1.0, "train_val_gap": -0.1,
    "train": {"bits_per_byte": 2.4, "loss": 5.4, "perplexity": 221.0, "tokens": 100},
    "val": {"bits_per_byte": 2.5, "loss": 5.5, "perplexity": 245.0, "tokens": 200,
            "domains": {"math": {"bits_per_byte": 2.1, "loss": 4.6, "perplexity": 99.0,
                                 "tokens": 80},
                        "zh_modern": {"bits_per_byte": 2.9, "loss": 6.1,
                                      "perplexity": 445.0, "tokens": 120}}},
}


def new_results(bpb: float = 2.5) -> dict:
    """metrics/eval.json as the evaluate stage is changing it to."""
    domain = {"loss": 5.0, "loss_stderr": 0.1, "perplexity": 148.0, "bits_per_byte": bpb,
              "bits_per_byte_stderr": 0.05, "tokens": 100, "docs": 3,
              "mix_weight_tokens": 0.5, "mix_weight_bytes": 0.5}
    return {
        "bits_per_byte": bpb, "loss": 5.0,
        "weighting": {"mix_weighted": "by mix weight", "token_weighted": "by token",
                      "stderr": "over documents"},
        "val": {"mix_weighted": {"loss": 5.0, "loss_stderr": 0.1, "perplexity": 148.0,
                                 "bits_per_byte": bpb, "bits_per_byte_stderr": 0.05},
                "token_weighted": {"loss": 5.2, "perplexity": 181.0, "bits_per_byte": 2.6,
                                   "tokens": 200},
                "domains": {"math": domain, "zh_modern": dict(domain, bits_per_byte=3.0)}},
        "train": {"mix_weighted": {"loss": 4.9, "bits_per_byte": 2.4},
                  "token_weighted": {"loss": 5.1, "bits_per_byte": 2.5}},
        "train_val_gap_mix_weighted": 0.1,
        "seconds": 2.0,
    }


@pytest.fixture(scope="module")
def empty_db(tmp_path_factory) -> Path:
    """An empty store, made once: creating the schema takes seconds."""
    path = tmp_path_factory.mktemp("store") / "mlflow.db"
    MlflowClient(tracking_uri=f"sqlite:///{path}").search_experiments()
    return path


@pytest.fixture
def store(tmp_path, monkeypatch, empty_db) -> Path:
    """A temp repo root with its own sqlite store, as the working directory."""
    shutil.copy(empty_db, tmp_path / "mlflow.db")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("LMFORGE_TRACKING", "on")
    monkeypatch.delenv("DVC_EXP_NAME", raising=False)
    monkeypatch.setenv("DVC_ROOT", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "params.yaml").write_text((REPO / "params.yaml").read_text())
    metrics = tmp_path / "metrics"
    metrics.mkdir()
    for stage in ("ingest", "dedup"):
        (metrics / f"{stage}.json").write_text(json.dumps({"domains": {
            "math": {"in": 10, "kept": 9, "rejected": {"x": 1}},
            "zh_modern": {"in": 5, "kept": 5, "rejected": {}}}}))
    return tmp_path


def client(root: Path) -> MlflowClient:
    return MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")


def train_run(root: Path, name: str = "exp-train") -> str:
    """A finished training run with a loss curve; models/final/run.json names it."""
    run = tracking.start_run(load_params(root / "params.yaml"), run_name=name, root=root)
    for step in (1, 2, 3):
        run.log_metrics({"loss": 5.0 - step / 10}, step)
    run.finish("FINISHED")
    final = root / "models" / "final"
    final.mkdir(parents=True, exist_ok=True)
    (final / "run.json").write_text(json.dumps({"mlflow_run_id": run.run_id}))
    return run.run_id


def all_runs(root: Path) -> list:
    c = client(root)
    exp = c.get_experiment_by_name(tracking.EXPERIMENT)
    return c.search_runs([exp.experiment_id])


def test_first_evaluation_goes_into_the_training_run(store):
    run_id = train_run(store)
    log_to_mlflow(new_results(2.5), "samples", store / "models" / "final")
    run = client(store).get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.metrics["eval/val_bits_per_byte_mix_weighted"] == 2.5
    assert run.data.tags[EVALUATED] == "1"
    assert len(all_runs(store)) == 1


def test_a_second_evaluation_gets_its_own_run_nested_under_the_training_run(
        store, monkeypatch):
    run_id = train_run(store)
    final = store / "models" / "final"
    log_to_mlflow(OLD_RESULTS, "first", final)
    monkeypatch.setenv("DVC_EXP_NAME", "eval-32")
    # As `dvc exp run -S evaluate.max_new_tokens=32` leaves it: only evaluate reruns.
    raw = yaml.safe_load((store / "params.yaml").read_text())
    raw["evaluate"]["max_new_tokens"] = 32
    (store / "params.yaml").write_text(yaml.safe_dump(raw))
    log_to_mlflow(dict(OLD_RESULTS, val=dict(OLD_RESULTS["val"], loss=4.0)), "second", final)

    c = client(store)
    train = c.get_run(run_id)
    assert train.data.metrics["eval/val_loss"] == 5.5  # not overwritten
    (other,) = [r for r in all_runs(store) if r.info.run_id != run_id]
    assert other.info.run_name == "eval-32"
    assert other.info.status == "FINISHED"
    assert other.data.tags[TRAIN_RUN] == run_id
    assert other.data.tags[PARENT] == run_id
    assert other.data.params["evaluate.max_new_tokens"] == "32"
    assert other.data.metrics["eval/val_loss"] == 4.0
    assert "loss" not in other.data.metrics  # the curves stay on the training run
    got = c.download_artifacts(other.info.run_id, "eval/samples.md", str(store))
    assert Path(got).read_text() == "second"


def test_an_evaluation_run_outside_dvc_exp_is_named_by_time(store):
    train_run(store)
    final = store / "models" / "final"
    log_to_mlflow(OLD_RESULTS, "a", final)
    log_to_mlflow(OLD_RESULTS, "b", final)
    names = sorted(r.info.run_name for r in all_runs(store))
    assert names[0].startswith("evaluate-") and names[1] == "exp-train", names


def test_evaluating_a_run_the_store_lacks_opens_an_unnested_run(store):
    train_run(store)
    final = store / "models" / "final"
    (final / "run.json").write_text(json.dumps({"mlflow_run_id": "0" * 32}))
    log_to_mlflow(OLD_RESULTS, "s", final)
    (orphan,) = [r for r in all_runs(store) if r.info.run_name != "exp-train"]
    assert orphan.data.tags[TRAIN_RUN] == "0" * 32
    assert PARENT not in orphan.data.tags  # the UI would hide it
    assert orphan.data.metrics["eval/val_loss"] == 5.5


@pytest.mark.parametrize("evaluated", [False, True])
def test_an_error_while_logging_ends_the_run_failed(store, monkeypatch, evaluated):
    run_id = train_run(store)
    final = store / "models" / "final"
    if evaluated:
        log_to_mlflow(OLD_RESULTS, "s", final)

    def broken(self, text, artifact_file):
        raise OSError("disk full")

    monkeypatch.setattr(tracking.Run, "log_text", broken)
    with pytest.raises(OSError, match="disk full"):
        log_to_mlflow(OLD_RESULTS, "s", final)
    statuses = {r.info.run_id: r.info.status for r in all_runs(store)}
    assert "RUNNING" not in statuses.values(), statuses
    if evaluated:  # the evaluation run failed; the training run keeps its first result
        assert statuses.pop(run_id) == "FINISHED"
        assert list(statuses.values()) == ["FAILED"]
    else:  # a failed first evaluation does not count: the next one goes in again
        assert statuses == {run_id: "FAILED"}
        assert EVALUATED not in client(store).get_run(run_id).data.tags


def test_resume_run_as_a_block_never_leaves_the_run_running(store):
    run_id = train_run(store)
    with pytest.raises(ValueError), tracking.resume_run(run_id, store):
        raise ValueError("boom")
    assert client(store).get_run(run_id).info.status == "FAILED"
    with tracking.resume_run(run_id, store) as run:
        assert client(store).get_run(run.run_id).info.status == "RUNNING"
    assert client(store).get_run(run_id).info.status == "FINISHED"


def test_end_run_marks_a_finished_run_failed_and_never_raises(store, capsys):
    run_id = train_run(store)
    tracking.end_run(run_id, "FAILED", store)
    assert client(store).get_run(run_id).info.status == "FAILED"
    tracking.end_run("0" * 32, "FAILED", store)  # unknown run: a warning, no exception
    assert "0" * 32 in capsys.readouterr().err
    tracking.end_run(None)  # tracking was off: nothing to do


def test_resume_run_of_an_unknown_run_raises(store):
    train_run(store)
    with pytest.raises(Exception, match="0{32}"):
        tracking.resume_run("0" * 32, store)


def test_data_stage_counts_are_one_table_not_metrics(store):
    run_id = train_run(store)
    (store / "metrics" / "filter_report.md").write_text("# Filter report\n\nmath: x 1\n")
    log_to_mlflow(OLD_RESULTS, "s", store / "models" / "final")
    c = client(store)
    metrics = c.get_run(run_id).data.metrics
    assert not [k for k in metrics if k.startswith("data/")], sorted(metrics)
    table = json.loads(Path(c.download_artifacts(run_id, "data/kept.json", str(store)))
                       .read_text())
    rows = [dict(zip(table["columns"], row, strict=True)) for row in table["data"]]
    assert {"stage": "dedup", "domain": "math", "in": 10, "kept": 9} in rows
    assert len(rows) == 4
    artifacts = {a.path for a in c.list_artifacts(run_id, "data")}
    assert {"data/ingest.json", "data/dedup.json", "data/filter_report.md"} <= artifacts


def test_eval_metrics_from_the_new_eval_json():
    m = eval_tracking.eval_metrics(new_results(2.5))
    assert m["eval/bits_per_byte"] == 2.5
    assert m["eval/val_loss_mix_weighted"] == 5.0
    assert m["eval/val_bits_per_byte_mix_weighted"] == 2.5
    assert m["eval/val_bits_per_byte_stderr_mix_weighted"] == 0.05
    assert m["eval/val_loss_token_weighted"] == 5.2
    assert m["eval/train_loss_mix_weighted"] == 4.9
    assert m["eval/train_val_gap_mix_weighted"] == 0.1
    assert m["eval_domain/bits_per_byte/zh_modern"] == 3.0
    assert m["eval_domain/bits_per_byte_stderr/math"] == 0.05
    assert not [k for k in m if "weighting" in k or "mix_weight_" in k]
    assert not [k for k in m if k.endswith(("seconds", "tokens", "tokens_token_weighted"))]
    assert all(k.startswith(("eval/", "eval_domain/")) for k in m)


def test_eval_metrics_from_the_old_eval_json():
    m = eval_tracking.eval_metrics(OLD_RESULTS)
    assert m["eval/val_loss"] == 5.5
    assert m["eval/train_loss"] == 5.4
    assert m["eval/train_val_gap"] == -0.1
    assert m["eval_domain/bits_per_byte/math"] == 2.1
    assert "eval_domain/bits_per_byte_stderr/math" not in m


def test_the_experiment_is_marked_as_model_training(store):
    train_run(store)
    exp = client(store).get_experiment_by_name(tracking.EXPERIMENT)
    assert exp.tags[KIND] == "custom_model_development"


def view_state(tag_value: str) -> dict:
    """The UI's saved-view envelope, unpacked as the UI does (deflate + base64)."""
    envelope = json.loads(tag_value)
    assert envelope["name"] == "Training" and isinstance(envelope["createdAt"], int)
    packed = envelope["state"]
    assert packed.startswith("deflate;")
    return json.loads(zlib.decompress(base64.b64decode(packed[len("deflate;"):])))


def test_the_experiment_has_a_view_with_the_training_charts_first(store):
    run_id = train_run(store)
    log_to_mlflow(new_results(), "s", store / "models" / "final")
    exp = client(store).get_experiment_by_name(tracking.EXPERIMENT)
    state = view_state(exp.tags["mlflow.sharedViewState.lmforge-training"])
    assert state["isAccordionReordered"] is True  # else the UI sorts prefixed sections first
    sections = [s["name"] for s in state["compareRunSections"]]
    assert sections[:2] == ["Model metrics", "eval"], sections
    first = state["compareRunSections"][0]["uuid"]
    charts = [c["metricKey"] for c in state["compareRunCharts"] if c["metricSectionId"] == first]
    assert charts == ["loss", "val_loss", "lr", "grad_norm", "tokens_per_sec"]
    # Every eval_domain/ metric the run has falls into a section of the view, after eval.
    logged = client(store).get_run(run_id).data.metrics
    domain_sections = {k.rsplit("/", 1)[0] for k in logged if k.startswith("eval_domain/")}
    assert domain_sections and domain_sections <= set(sections[2:]), domain_sections
    path = tracking.ui_path(exp.experiment_id)
    assert path.startswith(f"#/experiments/{exp.experiment_id}/runs?")
    assert {"workflowType=machine_learning", "compareRunsMode=CHART",
            "viewStateShareKey=lmforge-training"} <= set(path.split("?")[1].split("&"))


def test_a_view_saved_in_the_ui_under_that_name_is_kept(store):
    c = client(store)
    exp_id = c.create_experiment(tracking.EXPERIMENT)
    c.set_experiment_tag(exp_id, "mlflow.sharedViewState.lmforge-training", "mine")
    train_run(store)
    assert c.get_experiment(exp_id).tags["mlflow.sharedViewState.lmforge-training"] == "mine"


def test_an_existing_experiment_gets_the_kind_unless_one_was_chosen(store):
    c = client(store)
    exp_id = c.create_experiment(tracking.EXPERIMENT)
    train_run(store)
    assert c.get_experiment(exp_id).tags[KIND] == \
        "custom_model_development"
    c.set_experiment_tag(exp_id, KIND, "genai_development")
    train_run(store)
    assert c.get_experiment(exp_id).tags[KIND] == "genai_development"


def test_a_failing_store_never_stops_training(store, monkeypatch, capsys):
    params = load_params(store / "params.yaml")
    run = telemetry.open_run(params)
    assert run.run_id

    def broken(*args, **kwargs):
        raise OSError("database is locked")

    monkeypatch.setattr(tracking, "_FLUSH_AT", 1)
    monkeypatch.setattr(run.run.client, "log_batch", broken)
    run.log_metrics({"loss": 1.0}, 1)
    run.log_text("sample", "samples/step-000001.txt")
    run.finish("FINISHED")  # flush fails; the run must still be closed
    assert client(store).get_run(run.run_id).info.status == "FINISHED"
    assert capsys.readouterr().err.count("database is locked") == 1  # said once


def test_open_eval_run_loads_params_when_none_given(store):
    run_id = train_run(store)
    log_to_mlflow(OLD_RESULTS, "s", store / "models" / "final")
    with eval_tracking.open_eval_run(run_id) as run:
        assert run.run_id != run_id
    params = client(store).get_run(run.run_id).data.params
    expected = yaml.safe_load((store / "params.yaml").read_text())["evaluate"]
    assert params["evaluate.max_new_tokens"] == str(expected["max_new_tokens"])


@pytest.mark.parametrize("value", ["off", "OFF", "0", "false", "no", "disabled"])
def test_tracking_is_off_only_when_asked(monkeypatch, capsys, value):
    monkeypatch.setenv("LMFORGE_TRACKING", value)
    assert not tracking.tracking_enabled()
    for on in ("on", "1", "true", ""):
        monkeypatch.setenv("LMFORGE_TRACKING", on)
        assert tracking.tracking_enabled()
    monkeypatch.delenv("LMFORGE_TRACKING")
    assert tracking.tracking_enabled()
    assert capsys.readouterr().err == ""


def test_a_misspelt_switch_keeps_tracking_on_and_says_so(monkeypatch, capsys):
    monkeypatch.setenv("LMFORGE_TRACKING", "of")
    assert tracking.tracking_enabled()
    assert capsys.readouterr().err == ("tracking: LMFORGE_TRACKING='of' is not on or off; "
                                       "tracking stays on\n")


def test_with_tracking_off_no_stage_writes_to_the_store(store, monkeypatch, capsys):
    """A run tracked before, evaluated and scored with tracking off: the store is as the
    training left it, and each stage says it did not log."""
    from lmforge.evaluate import harness
    from lmforge.mixture import report

    run_id = train_run(store)
    before = client(store).get_run(run_id)
    monkeypatch.setenv("LMFORGE_TRACKING", "off")
    train = telemetry.open_run(load_params(store / "params.yaml"), stage="sft")
    assert isinstance(train, telemetry.NullRun) and train.run_id is None
    # A tracked run resumed untracked keeps its run's id (checkpoints, run.json) for a
    # later tracked resume, and leaves the run as it was, even when the stage fails.
    resumed = telemetry.open_run(load_params(store / "params.yaml"), run_id, stage="sft")
    assert isinstance(resumed, telemetry.NullRun) and resumed.run_id == run_id
    tracking.end_run(run_id, "FAILED", store)
    log_to_mlflow(new_results(2.5), "samples", store / "models" / "final")
    harness.log_to_mlflow({"models": {"base": {"model_dir": str(store / "models" / "final"),
                                               "tasks": {"t": {"acc": 0.5}}}}}, "md")
    report.log_to_mlflow(load_params(store / "params.yaml"), None)  # never looked at
    after = client(store).get_run(run_id)
    assert len(all_runs(store)) == 1
    assert after.data.metrics == before.data.metrics and after.data.tags == before.data.tags
    assert after.info.status == "FINISHED"
    out = capsys.readouterr()
    assert out.err == "sft: MLflow tracking is off (LMFORGE_TRACKING=off)\n" * 2
    assert out.out.splitlines() == [
        "evaluate: MLflow tracking is off (LMFORGE_TRACKING=off); not logging",
        "harness: MLflow tracking is off (LMFORGE_TRACKING=off); not logging",
        "mix fit: MLflow tracking is off (LMFORGE_TRACKING=off); not logging"]


def test_a_stage_with_tracking_off_never_imports_mlflow(tmp_path):
    """The switch's point: MLflow's start-up (seconds) is not paid."""
    import subprocess
    import sys

    code = ("import sys\n"
            "from lmforge.config import Params\n"
            "from lmforge.evaluate.tracking import log_evaluation\n"
            "from lmforge.train.telemetry import open_run\n"
            "open_run(Params())\n"
            "log_evaluation('evaluate', __import__('pathlib').Path('.'), print)\n"
            "assert 'mlflow' not in sys.modules, 'mlflow imported'\n")
    env = {**__import__("os").environ, "LMFORGE_TRACKING": "off"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "MLflow tracking is off" in proc.stderr and "not logging" in proc.stdout
