"""The train stage end to end: launch, check inputs, train, write the final model."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmforge.config import Params
from lmforge.errors import LmforgeError
from lmforge.io import write_json
from lmforge.model.saved import save_model
from lmforge.tokenizer import Tokenizer
from lmforge.train.distributed import DistEnv
from lmforge.train.loop import TrainResult
from lmforge.train.objectives import TrainData, open_shard_data
from lmforge.train.runner import (
    StageSpec,
    check_tokenized,
    run_training_stage,
    special_ids,
    write_curves,
)
from lmforge.train.selfcheck import self_check

if TYPE_CHECKING:
    import torch


@dataclass
class TrainPaths:
    """Inputs and outputs of the train stage, relative to the repo root."""

    train_shards: Path = Path("data/shards/train")
    val_shards: Path = Path("data/shards/val")
    tokenizer: Path = Path("models/tokenizer")  # a folder (or file), either backend
    checkpoints: Path = Path("models/checkpoints")
    final: Path = Path("models/final")
    metrics: Path = Path("metrics/train.json")
    plots: Path = Path("plots/train.tsv")
    val_plots: Path = Path("plots/val.tsv")

    def under(self, root: Path) -> TrainPaths:
        """The same layout below ``root``."""
        return TrainPaths(*(root / p for p in vars(self).values()))


def run_train_stage(params: Params, paths: TrainPaths, module: str = "stages.train") -> None:
    """Train as params say; with ``train.nproc > 1`` re-launch through torchrun first."""
    run_training_stage(params, train_spec(paths, module))


def train_spec(paths: TrainPaths, module: str = "stages.train") -> StageSpec:
    """Pretraining: next-token prediction on the shards, from scratch or ``init_from``."""

    def open_data(params: Params, tokenizer_sha: str) -> TrainData:
        data = open_shard_data(paths.train_shards, paths.val_shards)
        check_tokenized([(paths.train_shards, data.train), (paths.val_shards, data.val)],
                        paths.tokenizer, tokenizer_sha, "the shards stage")
        return data

    def before_training(params: Params, data: TrainData, env: DistEnv) -> dict[str, Any]:
        if params.train.self_check and env.is_main:
            run_self_check(params, data, env.device)
        special = special_ids(paths.tokenizer)
        return {"prompts": sample_prompts(paths.tokenizer, params.train.sample_prompts,
                                          special),
                "decode": Tokenizer.load(paths.tokenizer).decode}

    def write(params: Params, data: TrainData, result: TrainResult, sha: str) -> None:
        write_outputs(result, paths, special_ids(paths.tokenizer), sha)

    return StageSpec("train", module, paths.tokenizer, paths.checkpoints, paths.final,
                     open_data, write, before_training=before_training)


def run_self_check(params: Params, data: TrainData, device: torch.device | None = None
                   ) -> None:
    """The quick self-check: its table, a line per warning; a failure raises one line."""
    report = self_check(params, data, device)
    print(report.table(), flush=True)
    for line in report.warnings():
        print(line, flush=True)
    if not report.ok:
        raise LmforgeError(report.error_line())


def sample_prompts(tokenizer: Path, texts: list[str],
                   special: dict[str, int]) -> list[tuple[str, list[int]]]:
    """(text, ids) per ``train.sample_prompts``, each after BOS; none = BOS alone."""
    tok = Tokenizer.load(tokenizer)
    start = special["bos"] if special["bos"] >= 0 else special["eos"]
    head = [start] if start >= 0 else []
    prompts = [(t, head + tok.encode(t)) for t in texts]
    if not prompts and head:
        prompts = [("", head)]
    return [(t, ids) for t, ids in prompts if ids]


def write_outputs(result: TrainResult, paths: TrainPaths, special: dict[str, int],
                  tokenizer_sha: str) -> None:
    """models/final (+ run.json), metrics/train.json, plots/train.tsv and plots/val.tsv."""
    save_model(result.model, paths.final, paths.tokenizer, special_ids=special,
               tokenizer_sha256=tokenizer_sha, fingerprint=result.fingerprint)
    write_json(paths.final / "run.json", {"mlflow_run_id": result.run_id})
    write_json(paths.metrics, result.metrics)
    write_curves(result.history, paths.plots, paths.val_plots)
