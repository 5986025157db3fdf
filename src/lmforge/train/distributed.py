"""Process setup: device, threads, and DDP under ``torchrun`` (gloo on CPU, nccl on GPU)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist

from lmforge.errors import ConfigError
from lmforge.parallel import resolve_workers

T = TypeVar("T")


@dataclass
class DistEnv:
    """Where this process sits: ``rank`` of ``world_size``, on ``device``."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def under_torchrun() -> bool:
    """True when torchrun (torch.distributed.run) started this process."""
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def relaunch_under_torchrun(nproc: int, module: str) -> int:
    """Run ``python -m module`` as ``nproc`` local processes; return torchrun's exit code."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", "-m", module]
    print(f"train: launching {nproc} processes: {' '.join(cmd[1:])}", flush=True)
    return subprocess.call(cmd)


def resolve_device(requested: str, local_rank: int = 0) -> torch.device:
    """``auto`` = the local CUDA device if there is one, else the CPU."""
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(requested)
    except RuntimeError:
        raise ConfigError(f"train.device: {requested!r} is not a torch device") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("train.device: cuda was asked for but no GPU is visible")
        device = torch.device("cuda", local_rank if device.index is None else device.index)
        torch.cuda.set_device(device)
        # TF32 tensor cores for fp32 matmuls (the fp32 path; bf16 autocast is unaffected).
        torch.set_float32_matmul_precision("high")
    return device


def setup(requested_device: str, num_threads: int) -> DistEnv:
    """Pick the device, set CPU threads, and join the process group under torchrun."""
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    device = resolve_device(requested_device, local_rank)
    if device.type == "cpu":
        # Processes on one host share its cores; oversubscribing them slows every one.
        threads = num_threads or max(1, resolve_workers(0) // max(1, local_world))
        torch.set_num_threads(threads)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return DistEnv(rank, world, local_rank, device)


def teardown() -> None:
    """Leave the process group (if one was joined)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def all_gather_objects(obj: object, env: DistEnv) -> list[object]:
    """Every rank's ``obj``, indexed by rank (just ``[obj]`` in a single process)."""
    if not env.distributed:
        return [obj]
    out: list[object] = [None] * env.world_size
    dist.all_gather_object(out, obj)
    return out


def rank_batches(batches: Iterable[T], env: DistEnv, lockstep: bool
                 ) -> Iterator[tuple[T, bool]]:
    """This rank's share of ``batches`` (every world_size-th), streamed, as (batch, True).

    With ``lockstep`` (a sharded model, whose forward is a collective) a rank short of a
    batch then gets the first batch again as (batch, False), uncounted, until it has run
    as many forwards as the busiest rank.
    """
    first, total, mine = None, 0, 0
    for i, batch in enumerate(batches):
        first = batch if first is None else first
        total += 1
        if i % env.world_size == env.rank:
            mine += 1
            yield batch, True
    if lockstep and first is not None:
        for _ in range(-(-total // env.world_size) - mine):
            yield first, False
