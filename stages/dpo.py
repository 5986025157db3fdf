"""DVC stage ``dpo``: data/dpo + dpo.init_from (the SFT model) -> models/dpo."""

from lmforge.config import Params
from lmforge.stage import repo_root, run_stage
from lmforge.train.dpo import DpoPaths, run_dpo_stage


def main(params: Params) -> None:
    # Checkpoints go to the original repo's models/checkpoints/<run>/, as train's do.
    run_dpo_stage(params, DpoPaths(checkpoints=repo_root() / "models" / "checkpoints"))


if __name__ == "__main__":
    run_stage(main)
