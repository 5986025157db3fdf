"""``lmforge eval harness``: lm-eval on models of your choice, defaults from params.yaml."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from lmforge.errors import InputError


def cmd_harness(args: argparse.Namespace) -> None:
    """Run lm-eval's tasks on the models and print the table (and write --out-json)."""
    from lmforge.config import HarnessConfig, load_params
    from lmforge.evaluate.harness import harness_markdown, headline, run_harness
    from lmforge.io import write_json

    cfg = load_params(args.params).harness if Path(args.params).is_file() else HarnessConfig()
    if args.model:
        labels = args.label or [Path(m).name for m in args.model]
        if len(labels) != len(args.model):
            raise InputError(f"eval harness: {len(args.label)} --label for "
                             f"{len(args.model)} --model; give one each (or none)")
        if len(set(labels)) != len(labels):
            raise InputError(f"eval harness: labels must differ ({', '.join(labels)}); "
                             "name them with --label")
        models = {lb: Path(m) for lb, m in zip(labels, args.model, strict=True)}
    else:
        if args.label:
            raise InputError("eval harness: --label needs --model")
        models = {lb: Path(m) for lb, m in cfg.models.items()
                  if (Path(m) / "model.safetensors").is_file()}
        skipped = sorted(set(cfg.models) - set(models))
        if not models:
            raise InputError(f"{args.params}: none of harness.models is trained yet "
                             f"({', '.join(str(m) for m in cfg.models.values())})")
        if skipped:
            print(f"eval harness: skipping {', '.join(skipped)} (not trained yet)",
                  file=sys.stderr)
    tasks = [t for t in args.tasks.split(",") if t] if args.tasks is not None else cfg.tasks
    started = time.perf_counter()
    result = run_harness(models, Path(args.task_dir or cfg.task_dir), tasks,
                         args.batch_size or cfg.batch_size,
                         cfg.limit if args.limit is None else args.limit,
                         args.device or cfg.device)
    print(harness_markdown(result), end="")
    print(f"({time.perf_counter() - started:.1f} s)")
    if args.out_json:
        write_json(args.out_json, headline(result))


def add_eval_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``eval harness [--model DIR ...] [--label L ...] [--tasks a,b] ...``."""
    ev = subparsers.add_parser("eval", help="evaluate models outside the pipeline")
    kinds = ev.add_subparsers(dest="kind", required=True)
    h = kinds.add_parser("harness", help="lm-evaluation-harness (lm-eval) tasks, offline",
                         description="Export each model to Hugging Face format and run "
                                     "lm-eval's tasks from a task folder on it; defaults "
                                     "from params.yaml's harness section.")
    h.add_argument("--model", action="append", default=[],
                   help="our model folder (repeat for several; default: harness.models "
                        "that are trained)")
    h.add_argument("--label", action="append", default=[],
                   help="a column name per --model (default: the folder's name)")
    h.add_argument("--tasks", default=None, help="comma-separated task names (default: "
                                                 "harness.tasks, empty = all)")
    h.add_argument("--task-dir", default=None, help="folder of lm-eval YAML task files")
    h.add_argument("--limit", type=int, default=None, help="items per task (0 = all)")
    h.add_argument("--batch-size", type=int, default=None)
    h.add_argument("--device", default=None, help="auto, cpu, cuda, ...")
    h.add_argument("--out-json", default=None, help="also write the figures as JSON here")
    h.add_argument("--params", default="params.yaml", help=argparse.SUPPRESS)
    h.set_defaults(func=cmd_harness)
