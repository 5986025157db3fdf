"""``lmforge train``: the train stage, or with ``--self-check`` only the quick self-check."""

from __future__ import annotations

import argparse
from pathlib import Path

from lmforge.train.objectives import open_shard_data
from lmforge.train.pipeline import TrainPaths, run_self_check, run_train_stage


def cmd_train(args: argparse.Namespace) -> None:
    """``lmforge train``: the train stage, or with ``--self-check`` only the self-check."""
    from lmforge.config import load_params

    params = load_params(args.params)
    paths = TrainPaths()
    if args.self_check:
        run_self_check(params, open_shard_data(paths.train_shards, paths.val_shards))
        return
    run_train_stage(params, paths)


def add_train_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``train [--self-check] [--params params.yaml]``."""
    p = subparsers.add_parser(
        "train", help="train the model (the train stage), or --self-check it in seconds")
    p.add_argument("--self-check", action="store_true",
                   help="10 batches and 2 optimizer steps: shapes, masks, initial loss, "
                        "finiteness; exits non-zero naming the failed check")
    p.add_argument("--params", default="params.yaml", type=Path,
                   help="params file (default: params.yaml)")
    p.set_defaults(func=cmd_train)
    return p
