"""``lmforge checkpoints``: list the runs under models/checkpoints, prune them on request."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from lmforge.config import Params, flatten, load_params
from lmforge.errors import InputError
from lmforge.train import checkpoint as ckpt
from lmforge.train.runs import RunInfo, list_runs, prune_runs
from lmforge.train.telemetry import format_duration

SHARDS = Path("data/shards")
SFT = Path("data/sft")
DPO = Path("data/dpo")
TOKENIZER = Path("models/tokenizer")  # the tokenizer stage's folder, either backend


def current_identity(params: Params, shards: Path = SHARDS,
                     tokenizer: Path = TOKENIZER) -> dict[str, Any]:
    """The run identity params.yaml and the workspace's data would train now.

    Parts that cannot be known here (no shards or tokenizer built yet) are left out, so
    they are never reported as differences. The world size is ``train.nproc`` (a
    multi-node torchrun run records its own: it shows as a difference).
    """
    from lmforge.tokenizer.files import find_tokenizer, tokenizer_sha256
    from lmforge.train.warm_start import weights_sha256

    manifests = [shards / split / "manifest.json" for split in ("train", "val")]
    have_data = all(m.is_file() for m in manifests)
    loaded = [json.loads(m.read_text(encoding="utf-8")) if have_data else {}
              for m in manifests]
    identity = ckpt.run_identity(
        params.model, params.train, params.train.nproc, loaded[0], loaded[1],
        tokenizer_sha256(tokenizer) if find_tokenizer(tokenizer) else "",
        weights_sha256(params.train.init_from)
        if params.train.init_from and Path(params.train.init_from).exists() else None)
    if not have_data:
        del identity["data"]
    if find_tokenizer(tokenizer) is None:
        del identity["tokenizer_sha256"]
    return identity


def current_sft_identity(params: Params, sft: Path = SFT, shards: Path = SHARDS,
                         tokenizer: Path = TOKENIZER, stage: str = "sft") -> dict[str, Any]:
    """The identity of the fine-tuning run params.yaml's ``sft`` (or ``dpo``) section would
    train now.

    As for pretraining, parts the workspace cannot tell are left out: the base model's
    architecture without its config.json, the data without the stage's shards.
    """
    from lmforge.config import ModelConfig, from_dict
    from lmforge.tokenizer.files import find_tokenizer, tokenizer_sha256
    from lmforge.train.warm_start import weights_sha256

    cfg = params.sft if stage == "sft" else params.dpo
    replaying = cfg.replay > 0
    default_len = params.sft_data.seq_len if stage == "sft" else params.dpo_data.seq_len
    doc_mask = params.sft.doc_mask if stage == "sft" else True  # DPO always masks
    manifests = [sft / split / "manifest.json" for split in ("train", "val")]
    have_data = all(m.is_file() for m in manifests)
    loaded = [json.loads(m.read_text(encoding="utf-8")) if have_data else {}
              for m in manifests]
    replay = shards / "train" / "manifest.json"
    init = Path(cfg.init_from or "")
    base_cfg = init / "config.json"
    model = params.model
    if base_cfg.is_file():
        import dataclasses

        base = from_dict(ModelConfig, json.loads(base_cfg.read_text())["model"], "model.")
        model = dataclasses.replace(base, seq_len=int(loaded[0].get("seq_len", 0))
                                    or default_len, doc_mask=doc_mask)
    identity = ckpt.run_identity(
        model, cfg, cfg.nproc, loaded[0], loaded[1],
        tokenizer_sha256(tokenizer) if find_tokenizer(tokenizer) else "",
        weights_sha256(init) if init.exists() else None,
        replay_manifest=(json.loads(replay.read_text(encoding="utf-8"))
                         if replaying and replay.is_file() else None),
        stage=stage)
    if not have_data or (replaying and not replay.is_file()):
        del identity["data"]
    if find_tokenizer(tokenizer) is None:
        del identity["tokenizer_sha256"]
    if not base_cfg.is_file():
        del identity["model"]
    return identity


def current_identities(params: Params) -> dict[str, dict[str, Any]]:
    """What params.yaml trains now, by stage (``train``, ``sft``, ``dpo``)."""
    return {"train": current_identity(params), "sft": current_sft_identity(params),
            "dpo": current_sft_identity(params, DPO, stage="dpo")}


def _stage_of(run: RunInfo) -> str:
    return (run.record.get("identity") or {}).get("stage", "train")


def differences(run: dict[str, Any] | None, now: dict[str, Any]) -> list[str]:
    """What the run was trained with that params.yaml (and the data) no longer say."""
    if not run:
        return ["params not recorded (checkpoint of an older lmforge)"]
    was, cur = flatten(run), flatten(now)
    out = []
    for key in sorted(set(was) | set(cur)):
        if key not in cur and key.split(".")[0] in ("data", "tokenizer_sha256"):
            continue  # not built in the workspace: unknown, not different
        if was.get(key) != cur.get(key):
            if key == "data":
                out.append("data: other shards")
            elif key.endswith("sha256"):
                out.append(f"{key.removesuffix('_sha256')}: other file")
            else:
                out.append(f"{key}: {was.get(key)!r} (now {cur.get(key)!r})")
    return out


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"


def _plain(obj: Any) -> Any:
    """As run.json holds it (JSON types: tuples become lists)."""
    return json.loads(json.dumps(obj))


def current_runs(runs: list[RunInfo], now: dict[str, dict[str, Any]]) -> set[str]:
    """Runs whose recorded identity is what params.yaml and the workspace train now
    (``now``: by stage, from ``current_identities``).

    Compared field by field with run.json, not by re-hashing: a part the workspace cannot
    tell (no shards or tokenizer built yet) matches nothing, so no run is taken for the
    current one by accident.
    """
    want = {stage: _plain(ident) for stage, ident in now.items()
            if "data" in ident and "tokenizer_sha256" in ident and "model" in ident}
    return {r.id for r in runs
            if _stage_of(r) in want and r.record.get("identity") == want[_stage_of(r)]}


def runs_table(runs: list[RunInfo], now: dict[str, dict[str, Any]]) -> str:
    """One line per run: id, step, status, size, age, and how it differs from params.yaml."""
    current = current_runs(runs, now)
    lines = [f"{'run':<18} {'step':>13}  {'status':<12} {'size':>9}  {'written':>9}  "
             "differs from params.yaml"]
    for r in runs:
        steps = f"{r.last_step}/{r.record.get('max_steps') or '?'}"
        stage = _stage_of(r)
        diff = ("(this is the run params.yaml trains)" if r.id in current
                else "; ".join(differences(r.record.get("identity"), now.get(stage, {})))
                or "(same params)")
        if stage != "train":
            diff = f"[{stage}] {diff}"
        lines.append(f"{r.id:<18} {steps:>13}  {r.status:<12} {_size(r.size_bytes):>9}  "
                     f"{format_duration(r.age_seconds) + ' ago':>9}  {diff}")
    # An FSDP checkpoint's weights are in its step-*.dcp/ directory, not in the small .pt:
    # say that the sizes count them, so the column reads as what pruning a run frees.
    lines.append(f"size: all of a run's files (each step-*.pt with its step-*.dcp/ shards, "
                 f"light/ snapshots), what pruning it frees; "
                 f"{_size(sum(r.size_bytes for r in runs))} in all")
    return "\n".join(lines)


def cmd_list(args: argparse.Namespace) -> None:
    """Print the runs under the checkpoint folder."""
    runs = list_runs(args.dir)
    if not runs:
        print(f"no runs under {args.dir}")
        return
    print(runs_table(runs, current_identities(load_params(args.params))))


def cmd_prune(args: argparse.Namespace) -> None:
    """Delete runs, all but those kept (by id prefix, or 'current')."""
    runs = list_runs(args.dir)
    keep: set[str] = set()
    for wanted in args.keep:
        if wanted == "current":
            current = current_runs(runs, current_identities(load_params(args.params)))
            if not current:
                raise InputError(
                    "checkpoints prune --keep current: no run matches params.yaml and the "
                    "built shards/tokenizer (or they are not built); name the runs to keep "
                    "by id (lmforge checkpoints lists them)")
            keep.update(current)
            continue
        match = [r.id for r in runs if r.id.startswith(wanted)]
        if len(match) != 1:
            raise InputError(f"checkpoints prune --keep {wanted}: matches "
                             f"{len(match)} runs under {args.dir}; give more of the id")
        keep.update(match)
    sharded = {r.id for r in runs if _has_shards(r)}  # looked at before they go
    removed = prune_runs(args.dir, keep, dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    for r in removed:
        shards = ", .dcp shards included" if r.id in sharded else ""
        print(f"{verb} {r.id} (step {r.last_step}, {r.status}, {_size(r.size_bytes)}{shards})")
    print(f"checkpoints: {verb} {len(removed)} run(s), kept {len(runs) - len(removed)}; "
          f"{'would free' if args.dry_run else 'freed'} "
          f"{_size(sum(r.size_bytes for r in removed))}")


def _has_shards(run: RunInfo) -> bool:
    """Whether the run holds FSDP checkpoints (``step-*.dcp/`` beside their ``.pt``)."""
    return any(p.is_dir() for p in run.path.glob("step-*.dcp"))


def _location_args(suppress: bool) -> argparse.ArgumentParser:
    # On `checkpoints` and on `checkpoints prune` alike; the subcommand's copy must not
    # reset what was given before it (argparse applies subparser defaults last).
    common = argparse.ArgumentParser(add_help=False)
    default = (lambda v: argparse.SUPPRESS) if suppress else (lambda v: v)
    common.add_argument("--dir", type=Path, default=default(Path("models/checkpoints")),
                        help="the checkpoint folder (default models/checkpoints)")
    common.add_argument("--params", default=default("params.yaml"))
    return common


def add_checkpoints_parser(sub: argparse._SubParsersAction) -> None:
    """``lmforge checkpoints [prune --keep ID|current ...]``."""
    p = sub.add_parser("checkpoints", parents=[_location_args(False)],
                       help="list the training runs' checkpoints; prune them")
    p.set_defaults(func=cmd_list)
    actions = p.add_subparsers(dest="action")
    prune = actions.add_parser("prune", parents=[_location_args(True)],
                               help="delete every run but the kept ones")
    prune.add_argument("--keep", nargs="+", default=["current"],
                       help="run ids (a prefix is enough) or 'current' (the default: the "
                            "run params.yaml trains)")
    prune.add_argument("--dry-run", action="store_true", help="only say what would go")
    prune.set_defaults(func=cmd_prune)
