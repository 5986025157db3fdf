"""DVC stage ``sft``: data/sft (+ data/shards/train for replay) + sft.init_from -> models/sft."""

from lmforge.config import Params
from lmforge.stage import repo_root, run_stage
from lmforge.train.sft import SftPaths, run_sft_stage


def main(params: Params) -> None:
    # Checkpoints go to the original repo's models/checkpoints/<run>/, as train's do.
    run_sft_stage(params, SftPaths(checkpoints=repo_root() / "models" / "checkpoints"))


if __name__ == "__main__":
    run_stage(main)
