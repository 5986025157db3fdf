"""DVC stage ``train``: shards + tokenizer -> models/checkpoints, models/final, metrics."""

from lmforge.config import Params
from lmforge.stage import run_stage
from lmforge.train.pipeline import TrainPaths, run_train_stage


def main(params: Params) -> None:
    # Paths stay relative to the working directory: a queued `dvc exp run` works in a
    # temp copy of the repo, while DVC_ROOT (used only for the MLflow store) names the
    # original one.
    run_train_stage(params, TrainPaths())


if __name__ == "__main__":
    run_stage(main)
