"""DVC stage ``evaluate_post``: the base, SFT and DPO models on what each should do.

Held-out instruction tasks and preference pairs, forgetting on the pretraining val split
and chat samples (lmforge.evaluate.post); writes metrics/post.json, post_detail.json,
forgetting.md, post_tasks.md and post_samples.md, and logs them to the sft and dpo runs
in MLflow.
"""

from __future__ import annotations

from lmforge.config import Params
from lmforge.evaluate.post import run_post_evaluation
from lmforge.stage import run_stage


def main(params: Params) -> None:
    run_post_evaluation(params)


if __name__ == "__main__":
    run_stage(main)
