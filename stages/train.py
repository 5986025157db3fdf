"""DVC stage ``train``: shards + tokenizer -> models/checkpoints, models/final, metrics."""

from lmforge.config import Params
from lmforge.stage import repo_root, run_stage
from lmforge.train.pipeline import TrainPaths, run_train_stage


def main(params: Params) -> None:
    run_train_stage(params, TrainPaths().under(repo_root()))


if __name__ == "__main__":
    run_stage(main)
