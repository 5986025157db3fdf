"""MLflow tracking: where runs go, what they are called, and batched metric logging.

The store is local by default, ``sqlite:///<repo>/mlflow.db`` (the repo root taken from
``DVC_ROOT`` when DVC runs us, so queued experiments in temp dirs log to the same store);
``MLFLOW_TRACKING_URI`` overrides it. One MLflow run per training run, named after
``DVC_EXP_NAME`` when DVC sets it, tagged with the git revision. ``LMFORGE_TRACKING=off``
turns tracking off for a process and what it starts (``tracking_enabled``), as
``WANDB_MODE=disabled`` does for W&B: a smoke run, a test, a job whose runs nobody reads.

For MLflow 3's UI the ``lmforge`` experiment is marked as model training (not a GenAI
app) and carries a saved view, "Training", whose charts start with the training curves;
:func:`ui_path` links to it.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import os
import subprocess
import sys
import time
import zlib
from pathlib import Path
from typing import Any

from lmforge.config import Params, flatten, section_dict

EXPERIMENT = "lmforge"
# MLflow 3 shows a GenAI (traces) overview for experiments it takes for GenAI apps; this
# experiment tag says "model training", whose view is the runs and their charts.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"
# Set on a training run once its first evaluation is logged into it; later evaluations
# of the same model get runs of their own (see lmforge.evaluate.tracking).
EVALUATED_TAG = "lmforge.evaluated"
TRAIN_RUN_TAG = "lmforge.train_run_id"
PARENT_TAG = "mlflow.parentRunId"  # MLflow's own: the UI nests the run under its parent
# Per-domain eval metrics are eval_domain/<figure>/<domain>: one chart section per figure.
EVAL_DOMAIN_PREFIX = "eval_domain"
EVAL_DOMAIN_FIGURES = ("bits_per_byte", "loss", "bits_per_byte_stderr", "loss_stderr")

# MLflow 3's chart view puts every "prefix/" section before the unprefixed metrics, i.e.
# eval/ and eval_domain/ before the training curves. A saved view (an experiment tag the
# UI reads; see mlflow/server/js .../sharedViewState) fixes the order: training first.
VIEW_ID = "lmforge-training"
VIEW_TAG = f"mlflow.sharedViewState.{VIEW_ID}"
TRAINING_CHARTS = ("loss", "val_loss", "lr", "grad_norm", "tokens_per_sec")
_MODEL_METRICS = "Model metrics"  # the UI's name for the unprefixed metrics' section
# MLflow caps a batch at 1000 metrics; flushing every few hundred keeps calls rare.
_FLUSH_AT = 500
_FLUSH_SECONDS = 30.0
TRACKING_ENV = "LMFORGE_TRACKING"
_OFF = frozenset({"off", "0", "false", "no", "disabled"})
_ON = frozenset({"", "on", "1", "true", "yes", "enabled"})


def tracking_enabled() -> bool:
    """False when ``LMFORGE_TRACKING`` is ``off`` (or 0, false, no, disabled): then no
    stage opens an MLflow run, and MLflow (seconds of start-up) is never imported.

    Any other value than those and on/1/true/yes/enabled is named on stderr, and
    tracking stays on: a typo must not lose a run's record.
    """
    value = os.environ.get(TRACKING_ENV, "").strip().lower()
    if value in _OFF:
        return False
    if value not in _ON:
        print(f"tracking: {TRACKING_ENV}={os.environ[TRACKING_ENV]!r} is not on or off; "
              "tracking stays on", file=sys.stderr)
    return True


def tracking_off(stage: str) -> bool:
    """True, after one line saying so, when ``LMFORGE_TRACKING`` turns tracking off: the
    check of a stage about to log its results."""
    if tracking_enabled():
        return False
    print(f"{stage}: MLflow tracking is off ({TRACKING_ENV}=off); not logging")
    return True


def tracking_uri(root: str | os.PathLike | None = None) -> str:
    """``MLFLOW_TRACKING_URI`` if set, else the sqlite store at the repo root."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    root = Path(root or os.environ.get("DVC_ROOT") or os.getcwd()).resolve()
    return f"sqlite:///{root / 'mlflow.db'}"


def git_revision(cwd: str | os.PathLike | None = None) -> str:
    """The current commit (``+dirty`` when the work tree has changes), or ``unknown``."""
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=cwd, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return rev + ("+dirty" if dirty.strip() else "")


def _quiet_mlflow() -> None:
    # Alembic prints a dozen INFO lines when it creates the sqlite schema.
    for name in ("alembic", "mlflow"):
        logging.getLogger(name).setLevel(logging.WARNING)


class Run:
    """One MLflow run. Metrics are buffered and sent with ``log_batch``."""

    def __init__(self, client: Any, run_id: str) -> None:
        self.client = client
        self.run_id = run_id
        self._buffer: list[Any] = []
        self._last_flush = time.monotonic()

    def log_params(self, params: dict[str, Any]) -> None:
        """Log flat params (values stringified; MLflow caps a value at 6000 characters)."""
        from mlflow.entities import Param

        items = [Param(k, str(v)[:6000]) for k, v in sorted(params.items())]
        for i in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[i:i + 100])

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Queue ``metrics`` at ``step``; sent in batches, not one call per value."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._buffer.extend(Metric(k, float(v), now, step) for k, v in metrics.items())
        if len(self._buffer) >= _FLUSH_AT or time.monotonic() - self._last_flush > _FLUSH_SECONDS:
            self.flush()

    def flush(self) -> None:
        """Send queued metrics."""
        for i in range(0, len(self._buffer), 1000):
            self.client.log_batch(self.run_id, metrics=self._buffer[i:i + 1000])
        self._buffer.clear()
        self._last_flush = time.monotonic()

    def set_tags(self, tags: dict[str, str]) -> None:
        """Set run tags."""
        for k, v in tags.items():
            self.client.set_tag(self.run_id, k, v)

    def log_text(self, text: str, artifact_file: str) -> None:
        """Attach ``text`` as an artifact (e.g. ``samples/step-100.md``)."""
        self.client.log_text(self.run_id, text, artifact_file)

    def log_dict(self, obj: dict[str, Any], artifact_file: str) -> None:
        """Attach a JSON/YAML artifact."""
        self.client.log_dict(self.run_id, obj, artifact_file)

    def log_artifact(self, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        """Attach a file."""
        self.client.log_artifact(self.run_id, str(path), artifact_path)

    def log_table(self, data: dict[str, list[Any]], artifact_file: str) -> None:
        """Attach a table (columns by name) that the UI shows as a table."""
        self.client.log_table(self.run_id, data, artifact_file)

    def experiment_id(self) -> str:
        """The experiment the run belongs to."""
        return self.client.get_run(self.run_id).info.experiment_id

    def tags(self) -> dict[str, str]:
        """The run's tags as stored now."""
        return dict(self.client.get_run(self.run_id).data.tags)

    def finish(self, status: str = "FINISHED") -> None:
        """Flush and close the run (``FINISHED``, ``FAILED`` or ``KILLED``)."""
        try:
            self.flush()
        finally:  # metrics that cannot be sent must not leave the run RUNNING
            self.client.set_terminated(self.run_id, status=status)

    def __enter__(self) -> Run:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        """FINISHED after the block; FAILED (or KILLED on Ctrl-C) when it raised."""
        if exc_type is None:
            self.finish("FINISHED")
            return
        status = "KILLED" if issubclass(exc_type, KeyboardInterrupt) else "FAILED"
        with contextlib.suppress(Exception):  # the block's own error is the one to report
            self.finish(status)


def _client(root: str | os.PathLike | None = None) -> Any:
    _quiet_mlflow()
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri(root))


def _experiment_id(client: Any, root: str | os.PathLike | None) -> str:
    exp = client.get_experiment_by_name(EXPERIMENT)
    if exp is not None:
        if exp.lifecycle_stage == "deleted":  # deleted in the UI: its name stays reserved
            client.restore_experiment(exp.experiment_id)
        _mark_experiment(client, exp.experiment_id, exp.tags)
        return exp.experiment_id
    # Artifacts beside the store, by absolute path: a queued experiment runs in a temp
    # copy of the repo, and a relative location would land there and vanish.
    artifacts = Path(root or os.environ.get("DVC_ROOT") or os.getcwd()).resolve() / "mlartifacts"
    try:
        exp_id = client.create_experiment(EXPERIMENT, artifact_location=artifacts.as_uri())
        _mark_experiment(client, exp_id, {})
        return exp_id
    except Exception:
        # Created concurrently by another queued experiment; anything else is re-raised.
        exp = client.get_experiment_by_name(EXPERIMENT)
        if exp is None:
            raise
        return exp.experiment_id


def _mark_experiment(client: Any, experiment_id: str, tags: dict[str, str]) -> None:
    """Set the experiment kind and the training view where missing (a store made before
    them); what a user chose or saved in the UI under those names is left alone."""
    wanted = {EXPERIMENT_KIND_TAG: EXPERIMENT_KIND, VIEW_TAG: training_view_tag()}
    for key, value in wanted.items():
        if key in tags:
            continue
        try:
            client.set_experiment_tag(experiment_id, key, value)
        except Exception as e:  # cosmetic: must not turn tracking off
            print(f"tracking: could not set experiment tag {key} ({e})", file=sys.stderr)


def training_view_state() -> dict[str, Any]:
    """The runs page's chart layout: training curves, then eval/, then eval_domain/."""
    sections = [_MODEL_METRICS, "eval", *(f"{EVAL_DOMAIN_PREFIX}/{f}" for f in EVAL_DOMAIN_FIGURES)]
    charts = [{
        "uuid": f"{VIEW_ID}-{key}", "type": "LINE", "metricSectionId": f"{VIEW_ID}-0",
        "metricKey": key, "selectedMetricKeys": [key], "displayName": key,
        "isGenerated": True, "deleted": False, "runsCountToCompare": 20,
        "xAxisKey": "step", "xAxisScaleType": "linear", "scaleType": "linear",
        "lineSmoothness": 0, "range": {}, "yAxisKey": "metric", "yAxisExpressions": [],
        "ignoreOutliers": False, "useGlobalXaxisKey": True, "useGlobalLineSmoothing": True,
        "selectedXAxisMetricKey": "",
    } for key in TRAINING_CHARTS]
    return {
        # Reordered: the UI keeps this order and appends sections it finds later.
        "isAccordionReordered": True,
        "compareRunSections": [
            # The stderr sections start folded: they matter next to their figures only.
            {"uuid": f"{VIEW_ID}-{i}", "name": name, "display": not name.endswith("_stderr"),
             "isReordered": i == 0, "deleted": False, "isGenerated": True}
            for i, name in enumerate(sections)],
        "compareRunCharts": charts,
    }


def training_view_tag(created_ms: int | None = None) -> str:
    """The saved-view tag value: an envelope (name, times) around the compressed state."""
    state = json.dumps(training_view_state(), separators=(",", ":"))
    packed = "deflate;" + base64.b64encode(zlib.compress(state.encode())).decode("ascii")
    now = created_ms if created_ms is not None else int(time.time() * 1000)
    return json.dumps({"name": "Training", "createdAt": now, "updatedAt": now, "state": packed})


def ui_path(experiment_id: str) -> str:
    """Where in ``mlflow ui`` the training view opens: runs and their training charts.

    MLflow 3.17 picks GenAI or model-training pages per browser (a switch in the side
    bar, GenAI by default), not from the experiment; ``workflowType`` in the link sets it.
    """
    return (f"#/experiments/{experiment_id}/runs?workflowType=machine_learning"
            f"&compareRunsMode=CHART&viewStateShareKey={VIEW_ID}")


def start_run(params: Params, run_name: str | None = None,
              root: str | os.PathLike | None = None,
              tags: dict[str, str] | None = None) -> Run:
    """Open a new run named after ``DVC_EXP_NAME`` (when set), with all params logged.

    ``tags`` are added to the defaults (git revision, DVC experiment name); a
    ``mlflow.parentRunId`` among them nests the run under that one in the UI.
    """
    client = _client(root)
    name = run_name or os.environ.get("DVC_EXP_NAME") or f"train-{time.strftime('%Y%m%d-%H%M%S')}"
    all_tags = {
        "git_revision": git_revision(root),
        "dvc_exp_name": os.environ.get("DVC_EXP_NAME", ""),
        "mlflow.runName": name,
        **(tags or {}),
    }
    run = client.create_run(_experiment_id(client, root), run_name=name, tags=all_tags)
    tracked = Run(client, run.info.run_id)
    try:
        tracked.log_params(params_for_logging(params))
    except BaseException:  # a run that was never handed out would stay RUNNING
        tracked.__exit__(*sys.exc_info())
        raise
    return tracked


def resume_run(run_id: str, root: str | os.PathLike | None = None) -> Run:
    """Reopen an existing run, RUNNING again; use it as ``with resume_run(...) as run:``
    so that an error in the block ends it FAILED rather than leaving it RUNNING.

    Raises (and changes nothing) when the store has no such active run.
    """
    client = _client(root)
    if client.get_run(run_id).info.lifecycle_stage != "active":
        raise LookupError(f"MLflow run {run_id} is deleted")
    client.update_run(run_id, status="RUNNING")
    return Run(client, run_id)


def end_run(run_id: str | None, status: str = "FAILED",
            root: str | os.PathLike | None = None) -> None:
    """Set a closed run's final status after the fact; never raises, and does nothing
    with tracking off.

    For work after the training loop closed its run (writing models/final): if that
    fails, the run must not stay FINISHED while the stage failed.
    """
    if not run_id or not tracking_enabled():
        return
    try:
        _client(root).set_terminated(run_id, status=status)
    except Exception as e:  # the stage's own error is the one that matters
        print(f"tracking: could not mark MLflow run {run_id} {status} ({e})", file=sys.stderr)


def find_run(run_id: str, root: str | os.PathLike | None = None) -> Run | None:
    """The active run ``run_id`` (status unchanged), or None when the store lacks it."""
    from mlflow.exceptions import MlflowException

    client = _client(root)
    try:
        run = client.get_run(run_id)
    except MlflowException:
        return None
    return Run(client, run_id) if run.info.lifecycle_stage == "active" else None


def recorded_run_id(model_dir: str | os.PathLike) -> str | None:
    """The MLflow run a training stage recorded beside its model (``run.json``'s
    ``mlflow_run_id``); None when there is none or the file cannot be read."""
    run_file = Path(model_dir) / "run.json"
    with contextlib.suppress(ValueError, OSError):
        record = json.loads(run_file.read_text(encoding="utf-8"))
        return (record.get("mlflow_run_id") or None) if isinstance(record, dict) else None
    return None


def params_for_logging(params: Params) -> dict[str, Any]:
    """All params flattened to ``section.key`` names."""
    return flatten({name: section_dict(getattr(params, name))
                    for name in params.__dataclass_fields__})
