"""Exact resume: what a checkpoint holds besides the weights, and how a run gets it back.

Every rank's loader position, RNG state and objective state (DPO's reference cache) are
gathered into the checkpoint with the run's progress; a resumed run restores them so it
ends bit-identical to an unbroken one, also on another number of ranks (FSDP resharding).
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from lmforge.errors import LmforgeError
from lmforge.model.frozen import frozen_dtype
from lmforge.model.llama import Llama
from lmforge.model.lora import (
    checkpoint_weights,
    load_checkpoint_weights,
    lora_modules,
    lora_settings,
)
from lmforge.train import checkpoint as ckpt
from lmforge.train import runs
from lmforge.train.distributed import DistEnv, all_gather_objects
from lmforge.train.fsdp import AsyncShardSaver, load_sharded
from lmforge.train.objectives import Objective


@dataclass
class Progress:
    """How far a run got: what a checkpoint restores besides model/optimizer/loader/RNG."""

    step: int = 0
    tokens_seen: int = 0
    skipped: int = 0
    history: dict[int, dict] = field(default_factory=dict)
    run_id: str | None = None
    resumed_from: str | None = None
    wall_seconds: float = 0.0  # training time of the sessions so far
    loss_sum: float = 0.0  # the open log interval, so resumed logs match uninterrupted ones
    loss_n: int = 0
    stats: dict[str, float] = field(default_factory=dict)


@dataclass
class Live:
    """The objects a checkpoint is saved from and restored into."""

    model: Llama
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    loader: Any
    objective: Objective | None = None  # one with a state_dict has its state saved


def load_resume_state(directory: Path, fp: str, env: DistEnv,
                      log: Callable[[str], None]) -> dict[str, Any] | None:
    """Rank 0 picks the checkpoint (and cleans up); every rank then reads that file."""
    chosen: list[Any] = [None]
    found = None
    if env.is_main:
        found = ckpt.load_resumable(directory, fp, log)
        chosen[0] = str(found[1]) if found else None
    if env.distributed:
        dist.broadcast_object_list(chosen, src=0)
    if chosen[0] is None:
        return None
    state = found[0] if found else ckpt.read_checkpoint(Path(chosen[0]))
    if len(state["ranks"]) != env.world_size and state.get("sharded"):
        log(f"train: {chosen[0]} was saved by {_processes(len(state['ranks']))}, this run has "
            f"{env.world_size}: DCP reshards the weights and optimizer state, and the loader "
            "continues at the same window")
    elif len(state["ranks"]) != env.world_size:
        raise LmforgeError(f"{chosen[0]}: saved by {_processes(len(state['ranks']))}, "
                           f"this run has {env.world_size}")
    state["path"] = chosen[0]
    return state


def _processes(n: int) -> str:
    return f"{n} process" if n == 1 else f"{n} processes"


def restore(state: dict[str, Any], live: Live, env: DistEnv, seed: int = 0) -> Progress:
    """Load a checkpoint into the live objects; return the run's progress.

    ``seed``: the run's ``train.seed``, from which a rank the checkpoint did not have
    draws its RNG stream (see ``rank_state``)."""
    if state.get("sharded"):  # FSDP: every rank reads its shards from the DCP directory
        load_sharded(Path(state["path"]).parent / state["sharded"], live.model,
                     live.optimizer)
    else:
        load_checkpoint_weights(live.model, state["model"])
        live.optimizer.load_state_dict(state["optimizer"])
    if state.get("scaler"):
        live.scaler.load_state_dict(state["scaler"])
    p = state["progress"]
    mine = rank_state(state["ranks"], env.rank, env.world_size, seed, p["step"])
    live.loader.load_state_dict(mine["loader"])
    objective = live.objective
    if mine.get("objective") is not None and objective is not None:
        objective.load_state_dict(mine["objective"])
    elif mine.get("objective_parts") and hasattr(objective, "merge_state_dicts"):
        objective.load_state_dict(objective.merge_state_dicts(mine["objective_parts"]))
    apply_rng(mine["rng"], env.device)
    return Progress(p["step"], p["tokens_seen"], p["skipped"],
                    {row["step"]: row for row in p["history"]}, p["run_id"],
                    Path(state["path"]).name, p["wall_seconds"], p["loss_sum"], p["loss_n"],
                    p.get("stats", {}))


def rank_state(saved: list[dict[str, Any]], rank: int, world_size: int, seed: int,
               step: int) -> dict[str, Any]:
    """What rank ``rank`` of ``world_size`` restores from a checkpoint's per-rank states.

    The same world size: its own. Another (FSDP resharding): the loader position, which
    counts windows over all ranks, is the same on every rank; a rank the checkpoint had
    keeps its RNG stream, and a new one gets a fresh stream of its own, ``{"seed": n}``
    with ``n`` from the run's seed, the rank and the step: reusing a saved stream
    (``saved[rank % len(saved)]``) would give ranks 0 and 1 of a 1 -> 2 resume the same
    dropout masks. Deterministic, so resuming the same checkpoint twice agrees.
    """
    if len(saved) == world_size:
        return saved[rank]
    rng = (saved[rank]["rng"] if rank < len(saved)
           else {"seed": _fresh_rng_seed(seed, rank, step)})
    # Per-rank objective states (DPO's reference cache) are no rank's own any more: every
    # rank gets all of them, for the objective to merge.
    parts = [s["objective"] for s in saved if s.get("objective") is not None]
    return {"loader": saved[0]["loader"], "rng": rng, "objective_parts": parts}


def _fresh_rng_seed(seed: int, rank: int, step: int) -> int:
    """A 63-bit seed for ``(seed, rank, step)``; hashed, so it is none of the
    ``seed + rank`` seeds a fresh run starts its ranks with."""
    digest = hashlib.sha256(f"lmforge-rank-rng/{seed}/{rank}/{step}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def apply_rng(rng: dict[str, Any], device: torch.device) -> None:
    """Restore a saved RNG state, or seed every generator from a fresh ``{"seed": n}``."""
    if "seed" not in rng:
        ckpt.restore_rng(rng, device)
        return
    n = int(rng["seed"])
    random.seed(n)
    np.random.seed(n % 2**32)
    torch.manual_seed(n)  # the CPU and every CUDA generator


def save(directory: Path, fp: str, progress: Progress, live: Live, env: DistEnv,
         keep_last: int, saver: AsyncShardSaver | None = None,
         init_from: str | None = None) -> None:
    """Gather every rank's loader, RNG and objective state; rank 0 writes the checkpoint.

    With FSDP (``saver``) every rank's shards are written in the background and the
    checkpoint is committed at the next save (or ``saver.finish()``). A LoRA run's
    checkpoint holds its adapters, not another copy of the base (``init_from``)."""
    mine = {"loader": live.loader.state_dict(), "rng": ckpt.capture_rng(env.device)}
    if hasattr(live.objective, "state_dict"):  # e.g. DPO's reference cache, per rank
        mine["objective"] = live.objective.state_dict()
    ranks = all_gather_objects(mine, env)
    sharded = ckpt.sharded_path(directory, progress.step) if saver is not None else None
    if not env.is_main:
        if saver is not None and sharded is not None:  # this rank's shards, in the background
            saver.save(sharded, live.model, live.optimizer, None)
        return
    state = _checkpoint_state(fp, progress, live, ranks, sharded, init_from)

    def commit() -> None:  # the .pt is the commit point: written after the shards
        path = ckpt.save_checkpoint(directory, progress.step, state, keep_last)
        runs.update_run(directory, last_step=progress.step, last_checkpoint=path.name)

    if saver is not None and sharded is not None:
        saver.save(sharded, live.model, live.optimizer, commit)  # committed at the next save
    else:
        commit()


def _checkpoint_state(fp: str, progress: Progress, live: Live, ranks: list[Any],
                      sharded: Path | None, init_from: str | None) -> dict[str, Any]:
    """The checkpoint file's contents (rank 0)."""
    model = live.model
    p = dataclasses.asdict(progress)
    p["history"] = [progress.history[s] for s in sorted(progress.history)]
    weights = ({"model": {}, "optimizer": {}, "sharded": sharded.name} if sharded else
               {"model": checkpoint_weights(model), "optimizer": live.optimizer.state_dict()})
    if lora_modules(model) and not sharded:  # adapters only: name the base they adapt
        weights.update(lora=lora_settings(model), base=init_from,
                       base_dtype=frozen_dtype(model))
    return {
        "format": ckpt.FORMAT, "fingerprint": fp, "step": progress.step, **weights,
        "scaler": live.scaler.state_dict(), "ranks": ranks, "progress": p,
        # Enough to rebuild the model from this file alone (`lmforge generate --model`).
        "model_config": dataclasses.asdict(model.config),
        "vocab_size": model.vocab_size,
    }
