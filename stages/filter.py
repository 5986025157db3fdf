"""DVC stage: data/ingested/ -> data/filtered/ (+ rejects with the rule that fired)."""

from __future__ import annotations

from lmforge.config import Params
from lmforge.data.filtering import loss_problems, run_filter
from lmforge.data.report import print_report
from lmforge.errors import InputError
from lmforge.io import write_json
from lmforge.stage import run_stage


def main(params: Params) -> None:
    metrics = run_filter(params.filter, "data/ingested", "data/filtered")
    write_json("metrics/filter.json", metrics)
    print_report("filter", metrics)
    # Outputs and metrics stay for a look; DVC records nothing for a failed stage.
    problems = loss_problems(params.filter, metrics)
    if problems:
        raise InputError("\nerror: ".join(problems))


if __name__ == "__main__":
    run_stage(main)
