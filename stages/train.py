"""DVC stage ``train``: shards + tokenizer -> models/checkpoints/<run>/, models/final, metrics."""

from lmforge.config import Params
from lmforge.stage import repo_root, run_stage
from lmforge.train.pipeline import TrainPaths, run_train_stage


def main(params: Params) -> None:
    # Inputs and outputs stay relative to the working directory: a queued `dvc exp run`
    # works in a temp copy of the repo, while DVC_ROOT names the original one. The
    # checkpoints go to the original repo's models/checkpoints/<run>/ (each run in its own
    # directory): a killed queued experiment resumes like a workspace run, and
    # `lmforge checkpoints` lists every run in one place.
    run_train_stage(params, TrainPaths(checkpoints=repo_root() / "models" / "checkpoints"))


if __name__ == "__main__":
    run_stage(main)
