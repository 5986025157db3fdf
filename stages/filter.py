"""DVC stage: data/ingested/ -> data/filtered/ (+ rejects with the rule that fired)."""

from __future__ import annotations

from lmforge.config import Params
from lmforge.data.filter_advice import domain_samples
from lmforge.data.filter_report import render
from lmforge.data.filtering import guarded_domains, loss_problems, run_filter
from lmforge.data.report import print_report
from lmforge.errors import InputError
from lmforge.executor import make_executor
from lmforge.io import write_json, write_text
from lmforge.stage import run_stage


def main(params: Params) -> None:
    examples: dict = {}
    executor = make_executor(params.executor, params.filter.num_workers)
    failures: dict = {}
    metrics = run_filter(params.filter, "data/ingested", "data/filtered", examples, executor,
                         failures)
    # Every kind is tried on a sample of each domain the guard stops on, for its advice.
    samples = domain_samples("data/ingested", guarded_domains(params.filter, metrics))
    problems = loss_problems(params.filter, metrics, failures, samples)
    write_json("metrics/filter.json", metrics)
    write_text("metrics/filter_report.md", render(params.filter, metrics, examples, problems))
    print_report("filter", metrics)
    # Outputs, metrics and the report stay for a look; DVC records nothing for a failure.
    if problems:
        raise InputError("\nerror: ".join(problems))


if __name__ == "__main__":
    run_stage(main)
