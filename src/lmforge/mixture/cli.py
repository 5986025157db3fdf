"""``lmforge mix sweep | fit | score``: choose ``mix.weights`` by proxy experiments."""

from __future__ import annotations

import argparse
import dataclasses
import functools

from lmforge.config import load_params


def cmd_sweep(args: argparse.Namespace) -> None:
    from lmforge.mixture.sweep import run_sweep

    params = load_params(args.params)
    if args.proxies is not None:
        params.mix_sweep = dataclasses.replace(params.mix_sweep, proxies=args.proxies)
        params.mix_sweep.validate()
    # Flushed: the sweep runs for many minutes, often with its output in a file.
    run_sweep(params, jobs=args.jobs, dry_run=args.dry_run,
              log=functools.partial(print, flush=True))


def cmd_fit(args: argparse.Namespace) -> None:
    from lmforge.mixture.report import run_fit

    run_fit(load_params(args.params))


def cmd_score(args: argparse.Namespace) -> None:
    from lmforge.mixture.report import run_score

    run_score(load_params(args.params), args.experiments)


def add_mix_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``mix`` and its subcommands (settings: ``mix_sweep`` in params.yaml)."""
    p = subparsers.add_parser("mix", help="choose mix.weights by proxy experiments (RegMix)")
    p.add_argument("--params", default="params.yaml", help="params file (default: params.yaml)")
    sub = p.add_subparsers(dest="mix_command", required=True)
    s = sub.add_parser("sweep", help="queue and run one small proxy experiment per sampled "
                                     "mixture (dvc exp run --queue; reruns go on where it was)")
    s.add_argument("--proxies", type=int, default=None, help="default: mix_sweep.proxies")
    s.add_argument("--jobs", type=int, default=None, help="default: mix_sweep.jobs")
    s.add_argument("--dry-run", action="store_true", help="print the mixtures, queue nothing")
    s.set_defaults(func=cmd_sweep)
    f = sub.add_parser("fit", help="fit mixture -> val bits-per-byte on the finished proxies, "
                                   "check it on held-out proxies, recommend mix.weights")
    f.set_defaults(func=cmd_fit)
    c = sub.add_parser("score", help="the objective measured for the workspace and for "
                                     "named experiments (e.g. a confirmation run)")
    c.add_argument("experiments", nargs="*", help="experiment names")
    c.set_defaults(func=cmd_score)
    return p
