"""DVC stage: data/deduped/ -> data/decontam/ (the same parts, less the documents that
hold an evaluation n-gram when decontam.remove) + metrics/decontam.json and its report."""

from __future__ import annotations

from lmforge.config import Params
from lmforge.data.decontam import render, run_decontam
from lmforge.data.mix import val_ids
from lmforge.data.report import print_report
from lmforge.executor import make_executor
from lmforge.io import write_json, write_text
from lmforge.stage import run_stage


def eval_sets(params: Params) -> dict[str, str]:
    """Name -> file or folder of every evaluation set the pipeline uses, and the extras."""
    post = params.evaluate_post
    named = {"tasks": params.harness.task_dir, "sft_test": post.test,
             "sft_test_mc": post.test_mc, "pref_test": post.test_pref}
    sets = {name: path for name, path in named.items() if path}
    sets.update({f"extra:{path}": path for path in params.decontam.extra})
    return sets


def main(params: Params) -> None:
    executor = make_executor(params.executor, params.decontam.num_workers)
    held_out = val_ids(params.mix, "data/deduped", executor)  # mix's val: not trained on
    metrics = run_decontam(params.decontam, eval_sets(params), "data/deduped", "data/decontam",
                           executor, held_out)
    write_json("metrics/decontam.json", metrics)
    write_text("metrics/decontam_report.md", render(metrics))
    print_report("decontam", metrics)
    for name, s in metrics["sets"].items():
        print(f"decontam: {name}: {s['contaminated']:,} of {s['checked']:,} checked items "
              f"({s['contaminated_share']:.1%}) share a {metrics['ngram']}-gram with the "
              "training text")


if __name__ == "__main__":
    run_stage(main)
