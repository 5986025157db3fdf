"""An empty MLflow sqlite store, made once per test session and copied wherever a test's
training processes log: creating the schema (MLflow's migrations) takes seconds each time,
on the critical path of every multi-process training test."""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path


@functools.cache
def _empty_store() -> Path:
    from mlflow import MlflowClient

    directory = Path(tempfile.mkdtemp(prefix="lmforge-test-store-"))
    atexit.register(shutil.rmtree, directory, True)
    path = directory / "mlflow.db"
    MlflowClient(tracking_uri=f"sqlite:///{path}").search_experiments()
    return path


def seed_store(db: Path) -> Path:
    """``db`` as an empty MLflow store, unless it exists already (then it is kept)."""
    if not db.exists():
        db.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(_empty_store(), db)
    return db
