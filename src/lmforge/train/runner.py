"""One runner for the training stages (train, sft, dpo): relaunch under torchrun, check
the tokenizer, open the data, train, write the outputs, and mark the run failed when
that fails. A ``StageSpec`` says what differs: the params section, the paths, how the
data opens, the params and objective the loop trains with, and what it writes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmforge.config import Params
from lmforge.errors import InputError, LmforgeError
from lmforge.io import write_text
from lmforge.stage_deps import require_dependency
from lmforge.tokenizer import Tokenizer
from lmforge.tokenizer.files import find_tokenizer, tokenizer_sha256
from lmforge.train import distributed
from lmforge.train.distributed import DistEnv
from lmforge.train.loop import TrainResult, train
from lmforge.train.objectives import Objective, TrainData
from lmforge.train.warm_start import ensure_outside

TSV_COLUMNS = ("step", "loss", "lr", "grad_norm", "tokens_per_sec")
# Val loss is measured every eval_every steps only: a file of its own, so that plots draw
# it as a line through the measured points instead of dropping to zero in between.
VAL_TSV_COLUMNS = ("step", "val_loss")


def _same_params(params: Params, data: TrainData, tokenizer_sha: str) -> Params:
    return params


@dataclass
class StageSpec:
    """A training stage: where it reads and writes, its data, objective and outputs."""

    section: str  # train | sft | dpo: the params section, and the MLflow run's stage
    module: str  # the stage's entry point, which torchrun relaunches
    tokenizer: Path
    checkpoints: Path
    final: Path  # the model it writes (``init_from`` must lie outside it)
    # (params, tokenizer sha256) -> the shard sets, checked against the tokenizer.
    open_data: Callable[[Params, str], TrainData]
    # (params, data, result, tokenizer sha256): the model, metrics and curves.
    write_outputs: Callable[[Params, TrainData, TrainResult, str], None]
    # (params, data, tokenizer sha256) -> the params the loop trains with.
    loop_params: Callable[[Params, TrainData, str], Params] = _same_params
    # (params, loop params, data, env) -> the objective; None: next-token prediction.
    objective: Callable[[Params, Params, TrainData, DistEnv], Objective] | None = None
    # (params, data, env) -> more ``train`` arguments (pretraining: its self-check runs
    # here, and the sample prompts come back).
    before_training: Callable[[Params, TrainData, DistEnv], dict[str, Any]] | None = None


def run_training_stage(params: Params, spec: StageSpec) -> None:
    """Run the stage ``spec`` describes as params say; with ``nproc > 1`` re-launch
    through torchrun first (each rank then runs it; rank 0 writes the outputs)."""
    cfg = getattr(params, spec.section)
    # Under DVC, init_from must be a dep of this stage (else editing it leaves `dvc status`
    # clean): checked first, before torchrun or any work. Every rank checks the same.
    require_dependency(spec.section, cfg.init_from)
    if relaunched(cfg.nproc, spec.module, spec.section):
        return
    if cfg.init_from:  # DVC deletes a stage's outputs before it runs it
        ensure_outside(cfg.init_from, spec.final, "an output of this stage",
                       f"{spec.section}.init_from")
    env = distributed.setup(cfg.device, cfg.num_threads)
    try:
        tokenizer_sha = check_tokenizer(spec.tokenizer)
        data = spec.open_data(params, tokenizer_sha)
        run_params = spec.loop_params(params, data, tokenizer_sha)
        if spec.objective is not None:
            data.objective = spec.objective(params, run_params, data, env)
        extra = spec.before_training(params, data, env) if spec.before_training else {}
        result = train(run_params, data, spec.checkpoints, tokenizer_sha, env,
                       stage=spec.section, **extra)
        if env.is_main:
            with failing_run_on_error(result, spec.checkpoints):
                spec.write_outputs(params, data, result, tokenizer_sha)
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


def check_tokenizer(tokenizer: Path) -> str:
    """The tokenizer's sha256; a one-line error when there is none."""
    if find_tokenizer(tokenizer) is None:
        raise InputError(f"{tokenizer}: no tokenizer (run the tokenizer stage)")
    return tokenizer_sha256(tokenizer)


def special_ids(tokenizer: Path) -> dict[str, int]:
    """bos/eos/pad/unk ids of the tokenizer (-1 where it has none)."""
    return Tokenizer.load(tokenizer).special_ids()


def check_tokenized(shard_sets: list[tuple[Path, Any]], tokenizer: Path, tokenizer_sha: str,
                    rerun: str) -> None:
    """Every (path, shard set) was tokenized with ``tokenizer``; else name the stage
    to ``rerun``. A set that is None (no replay) is skipped."""
    for where, shards in shard_sets:
        if shards is not None and shards.tokenizer_sha256 != tokenizer_sha:
            raise InputError(f"{where}: tokenized with tokenizer {shards.tokenizer_sha256[:12]}"
                             f", but {tokenizer} is {tokenizer_sha[:12]}; rerun {rerun}")


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


def write_curves(history: list[dict[str, Any]], plots: Path, val_plots: Path,
                 columns: tuple[str, ...] = TSV_COLUMNS,
                 val_columns: tuple[str, ...] = VAL_TSV_COLUMNS) -> None:
    """plots/<stage>.tsv (one row per logged step) and plots/<stage>_val.tsv (one row per
    val measurement)."""
    write_text(plots, history_tsv(history, columns))
    write_text(val_plots, history_tsv(
        [r for r in history if r.get("val_loss") is not None], val_columns))


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
