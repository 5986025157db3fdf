"""The train stage end to end: launch, check inputs, train, write the final model."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmforge.config import Params
from lmforge.errors import InputError, LmforgeError
from lmforge.io import write_json, write_text
from lmforge.model.saved import save_model
from lmforge.tokenizer import Tokenizer
from lmforge.tokenizer.files import find_tokenizer, tokenizer_sha256
from lmforge.train import distributed
from lmforge.train.loop import TrainResult, open_shard_data, train
from lmforge.train.warm_start import ensure_outside

TSV_COLUMNS = ("step", "loss", "lr", "grad_norm", "tokens_per_sec")
# Val loss is measured every eval_every steps only: a file of its own, so that plots draw
# it as a line through the measured points instead of dropping to zero in between.
VAL_TSV_COLUMNS = ("step", "val_loss")


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
    if relaunched(params.train.nproc, module, "train"):
        return
    if params.train.init_from:  # DVC deletes a stage's outputs before it runs it
        ensure_outside(params.train.init_from, paths.final, "an output of this stage")
    env = distributed.setup(params.train.device, params.train.num_threads)
    try:
        if find_tokenizer(paths.tokenizer) is None:
            raise InputError(f"{paths.tokenizer}: no tokenizer (run the tokenizer stage)")
        tokenizer_sha = tokenizer_sha256(paths.tokenizer)
        data = open_shard_data(paths.train_shards, paths.val_shards)
        for where, shards in ((paths.train_shards, data.train), (paths.val_shards, data.val)):
            if shards.tokenizer_sha256 != tokenizer_sha:
                raise InputError(
                    f"{where}: tokenized with tokenizer "
                    f"{shards.tokenizer_sha256[:12]}, but {paths.tokenizer} is "
                    f"{tokenizer_sha[:12]}; rerun the shards stage")
        if params.train.self_check and env.is_main:
            _run_self_check(params, data, env)
        special = special_ids(paths.tokenizer)
        result = train(params, data, paths.checkpoints, tokenizer_sha, env,
                       prompts=sample_prompts(paths.tokenizer, params.train.sample_prompts,
                                              special),
                       decode=_decoder(paths.tokenizer))
        if env.is_main:
            with failing_run_on_error(result, paths.checkpoints):
                write_outputs(result, paths, special, tokenizer_sha)
    finally:
        distributed.teardown()


def relaunched(nproc: int, module: str, stage: str) -> bool:
    """With ``nproc > 1`` outside torchrun, run ``module`` under torchrun; True if it did."""
    if nproc <= 1 or distributed.under_torchrun():
        return False
    code = distributed.relaunch_under_torchrun(nproc, module)
    if code:
        raise LmforgeError(f"{stage}: torchrun exited with status {code}")
    return True


@contextlib.contextmanager
def failing_run_on_error(result: TrainResult, checkpoints: Path) -> Iterator[None]:
    """Writing a finished run's outputs: if that fails, so did the run.

    The loop closed the run FINISHED; without its outputs it is not, in MLflow or in
    its run.json.
    """
    try:
        yield
    except BaseException:
        from lmforge.tracking import end_run
        from lmforge.train.runs import run_dir, update_run

        end_run(result.run_id, "FAILED")
        update_run(run_dir(checkpoints, result.fingerprint), status="failed")
        raise


def _run_self_check(params: Params, data: Any, env: Any) -> None:
    """The quick self-check before training; a failure stops the stage with one line."""
    from lmforge.train.selfcheck import self_check

    report = self_check(params, data, env.device)
    print(report.table(), flush=True)
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


def special_ids(tokenizer: Path) -> dict[str, int]:
    """bos/eos/pad/unk ids of the tokenizer (-1 where it has none)."""
    return Tokenizer.load(tokenizer).special_ids()


def _decoder(tokenizer: Path) -> Any:
    return Tokenizer.load(tokenizer).decode


def write_outputs(result: TrainResult, paths: TrainPaths, special: dict[str, int],
                  tokenizer_sha: str) -> None:
    """models/final (+ run.json), metrics/train.json, plots/train.tsv and plots/val.tsv."""
    save_model(result.model, paths.final, paths.tokenizer, special_ids=special,
               tokenizer_sha256=tokenizer_sha, fingerprint=result.fingerprint)
    write_json(paths.final / "run.json", {"mlflow_run_id": result.run_id})
    write_json(paths.metrics, result.metrics)
    write_text(paths.plots, history_tsv(result.history))
    write_text(paths.val_plots, history_tsv(
        [r for r in result.history if r.get("val_loss") is not None], VAL_TSV_COLUMNS))


def history_tsv(rows: list[dict[str, Any]], columns: tuple[str, ...] = TSV_COLUMNS) -> str:
    """The curves as TSV, one row per logged step."""
    lines = ["\t".join(columns)]
    for row in rows:
        lines.append("\t".join(_cell(row.get(c)) for c in columns))
    return "\n".join(lines) + "\n"


def _cell(value: Any) -> str:
    if value is None:
        return ""
    return str(value) if isinstance(value, int) else f"{value:.6g}"
