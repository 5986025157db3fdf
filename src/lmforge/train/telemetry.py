"""What the loop reports: MFU against the device's peak, memory, ETA, MLflow (rank 0)."""

from __future__ import annotations

import os
import resource
import sys
import time
from typing import Any

import torch

from lmforge.config import Params

# Dense bf16/fp16 tensor-core peaks (FLOP/s), matched by substring of the device name.
# Most specific names first ("H200" before "H100" is not needed, but "A100" vs "A10" is).
PEAK_FLOPS = (
    ("H200", 989e12), ("H100", 989e12), ("GH200", 989e12), ("B200", 2250e12),
    ("A100", 312e12), ("L40S", 362e12), ("A10G", 70e12), ("A10", 125e12),
    ("L4", 121e12), ("V100", 125e12), ("RTX 4090", 165e12), ("RTX 3090", 71e12),
)


def peak_flops(device: torch.device, precision: str) -> float | None:
    """The device's dense half-precision peak, or None when unknown (CPU, fp32, other GPU)."""
    if device.type != "cuda" or precision not in ("bf16", "fp16"):
        return None
    name = torch.cuda.get_device_name(device)
    for key, flops in PEAK_FLOPS:
        if key in name:
            return flops
    return None


def memory_mb(device: torch.device) -> float:
    """Peak memory: CUDA allocator high-water mark, else this process's peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10  # bytes vs KiB


def format_duration(seconds: float) -> str:
    """``1h02m``, ``3m05s``, ``42s``."""
    s = max(0, int(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


class NullRun:
    """Stands in for an MLflow run when tracking is off (``LMFORGE_TRACKING=off``, an
    unreachable store, ranks other than 0). ``run_id``: the run a resumed run was
    tracked in before, kept for its checkpoints and run.json, so that a later tracked
    resume goes on in it."""

    def __init__(self, run_id: str | None = None) -> None:
        self.run_id = run_id

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        pass

    def log_text(self, text: str, artifact_file: str) -> None:
        pass

    def finish(self, status: str = "FINISHED") -> None:
        pass


class GuardedRun:
    """An MLflow run whose failures are reported once and otherwise ignored.

    The store can fail mid-training (disk full, a locked or deleted sqlite file); the
    loop logs every few steps and finishes the run in a ``finally``, and neither may
    cost the training run.
    """

    def __init__(self, run: Any) -> None:
        self.run = run
        self.run_id: str | None = run.run_id
        self._warned = False

    def _guard(self, what: str, call: Any, *args: Any) -> None:
        try:
            call(*args)
        except Exception as e:
            if not self._warned:
                self._warned = True
                print(f"train: MLflow {what} failed ({type(e).__name__}: {e}); "
                      "training goes on", file=sys.stderr)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self._guard("logging", self.run.log_metrics, metrics, step)

    def log_text(self, text: str, artifact_file: str) -> None:
        self._guard("logging", self.run.log_text, text, artifact_file)

    def finish(self, status: str = "FINISHED") -> None:
        self._guard("finish", self.run.finish, status)


def open_run(params: Params, run_id: str | None = None, stage: str = "train") -> Any:
    """Start (or, on resume, reopen) the MLflow run; a tracking failure never stops training.

    A run of another stage than ``train`` (``sft``) is named ``<experiment>-<stage>`` and
    tagged ``lmforge.stage``, so the UI tells a fine-tuning run from its base model's.
    """
    from lmforge.tracking import TRACKING_ENV, tracking_enabled

    if not tracking_enabled():
        print(f"{stage}: MLflow tracking is off ({TRACKING_ENV}=off)", file=sys.stderr)
        return NullRun(run_id)
    try:
        from lmforge.tracking import resume_run, start_run

        if run_id:
            try:
                return GuardedRun(resume_run(run_id))
            except Exception:  # the store was reset since: open a new run instead
                pass
        if stage == "train":
            return GuardedRun(start_run(params))
        base = os.environ.get("DVC_EXP_NAME") or time.strftime("%Y%m%d-%H%M%S")
        return GuardedRun(start_run(params, run_name=f"{base}-{stage}",
                                    tags={"lmforge.stage": stage}))
    except Exception as e:  # an unreachable store must not cost a training run
        print(f"train: MLflow tracking is off ({type(e).__name__}: {e})", file=sys.stderr)
        return NullRun()
