"""What the loop trains: the data it reads and the objective a micro-batch's loss comes from.

An objective tells the loop what one micro-batch weighs (``count``: its share of the
step is count / the step's total), its mean loss, and the val figures. Pretraining and
SFT share ``NextToken`` (SFT's masked targets are ``IGNORE_INDEX`` in the rows, so the
same mean over target tokens is the masked loss); DPO's is
``lmforge.train.preference.DpoObjective``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lmforge.config import Params
from lmforge.model.llama import Llama
from lmforge.model.loss import IGNORE_INDEX
from lmforge.shards.loader import mixture_mean
from lmforge.train.distributed import DistEnv, rank_batches
from lmforge.train.fsdp import is_sharded
from lmforge.train.precision import Precision
from lmforge.train.replay import ReplayLoader


class Objective(Protocol):
    """What the loop asks of an objective (``NextToken``, ``DpoObjective``).

    ``stats`` names the extra per-step sums ``loss`` returns, the first counting the
    items the others are sums over (means are sum / count; an objective may name another
    denominator for some in ``stat_denominators``, ``{stat: the stat it is a mean over}``,
    and those denominators are not logged themselves). An objective with state to
    checkpoint (DPO's reference cache) also has ``state_dict`` / ``load_state_dict`` and,
    for a resume on another number of ranks, ``merge_state_dicts``.
    """

    stats: tuple[str, ...]

    def make_loader(self, data: TrainData, seq_len: int, batch_size: int, seed: int,
                    env: DistEnv, doc_mask: bool) -> Any:
        """This rank's training batches (each a list of tensors)."""
        ...

    def count(self, batch: list[torch.Tensor]) -> int | tuple[int, ...]:
        """What the micro-batch weighs: its items the loss is a mean over (a loss of
        parts: one count per part)."""
        ...

    def loss(self, model: torch.nn.Module, batch: list[torch.Tensor]
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(mean loss over the batch's items -- a loss of parts: a 1-D tensor of the
        parts' means --, per-step stat sums or None)."""
        ...

    def evaluate(self, model: Llama, data: TrainData, params: Params, precision: Precision,
                 env: DistEnv) -> dict[str, float]:
        """The val figures, ``val_loss`` among them."""
        ...


@dataclass
class TrainData:
    """What the loop reads: the train/val shard sets and the loader functions for them."""

    train: Any  # lmforge.shards.loader.ShardSet (or anything with the same attributes)
    val: Any
    make_loader: Callable[..., Any]  # WindowLoader(shards, seq_len, batch_size, seed, rank, ws)
    eval_batches: Callable[..., Iterable[dict]]  # eval_batches(shards, seq_len, bs, max_batches)
    # Fine-tuning: pretraining shards whose windows fill ``replay_share`` of the rows.
    replay: Any = None
    replay_share: float = 0.0
    # What a micro-batch's loss is and how val is scored; None = next-token prediction.
    objective: Objective | None = None


def open_shard_data(train_dir: str | Path, val_dir: str | Path) -> TrainData:
    """The real shard sets and loader of ``lmforge.shards.loader``."""
    from lmforge.shards.loader import ShardSet, WindowLoader, eval_batches

    return TrainData(ShardSet(train_dir), ShardSet(val_dir), WindowLoader, eval_batches)


class NextToken:
    """The objective of pretraining and SFT: mean cross-entropy over the target tokens."""

    stats: tuple[str, ...] = ()

    def make_loader(self, data: TrainData, seq_len: int, batch_size: int, seed: int,
                    env: DistEnv, doc_mask: bool, stratified: bool = False) -> Any:
        """This rank's training batches (``stratified``: see ``train.batch_sampling``)."""
        return open_loader(data, seq_len, batch_size, seed, env, doc_mask, stratified)

    def count(self, batch: list[torch.Tensor]) -> int:
        """Target tokens in the micro-batch."""
        return int((batch[1] != IGNORE_INDEX).sum())

    def loss(self, model: torch.nn.Module, batch: list[torch.Tensor]
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(mean loss over the batch's targets, None: no extra stats)."""
        extra = {"positions": batch[2]} if len(batch) > 2 else {}
        _, loss = model(batch[0], batch[1], **extra)
        return loss, None

    def evaluate(self, model: Llama, data: TrainData, params: Params, precision: Precision,
                 env: DistEnv) -> dict[str, float]:
        """``{"val_loss": mixture-weighted val loss}``."""
        return {"val_loss": evaluate_loss(model, data, params, precision, env)}


def open_loader(data: TrainData, seq_len: int, batch_size: int, seed: int, env: DistEnv,
                doc_mask: bool, stratified: bool = False) -> Any:
    """This rank's training batches: the train shards, or with replay both shard sets.

    ``stratified``: every batch's domain shares follow the mixture (each set's own, with
    replay: its rows are drawn one at a time in stratified order)."""
    options = {"return_doc_info": True} if doc_mask else {}
    if stratified:
        options["stratified"] = True
    if data.replay is None or data.replay_share == 0:
        return data.make_loader(data.train, seq_len, batch_size, seed, rank=env.rank,
                                world_size=env.world_size, **options)
    rows = [data.make_loader(shards, seq_len, 1, seed + i, rank=env.rank,
                             world_size=env.world_size, **options)
            for i, shards in enumerate((data.train, data.replay))]
    return ReplayLoader(*rows, data.replay_share, batch_size)


@torch.no_grad()
def evaluate_loss(model: Llama, data: TrainData, params: Params, precision: Precision,
                  env: DistEnv) -> float:
    """Val loss over ``train.eval_batches`` deterministic batches, mixture-weighted.

    Each domain's mean loss is weighted by its share of the train split's tokens, as the
    evaluate stage's headline is: the figure compares with the training loss, whatever
    share of the val split each domain happens to have.
    """
    model.eval()
    names = list(data.val.domain_names)
    sums = torch.zeros(2, len(names), dtype=torch.float64, device=env.device)
    doc_info = {"return_doc_info": True} if params.model.doc_mask else {}
    batches = data.eval_batches(data.val, params.model.seq_len, params.train.micro_batch_size,
                                max_batches=params.train.eval_batches, **doc_info)
    # Ranks split the batches, then sum; a sharded model's ranks run in step.
    for batch, counted in rank_batches(batches, env, lockstep=is_sharded(model)):
        inputs = torch.as_tensor(batch["input"]).to(env.device)
        targets = torch.as_tensor(batch["target"]).to(env.device)
        domains = torch.as_tensor(batch["domain"]).to(env.device).flatten()
        positions = batch.get("positions")
        with precision.autocast():
            logits = model(inputs, positions=None if positions is None
                           else torch.as_tensor(positions).to(env.device))
        # Plain cross-entropy, so val loss stays comparable when label smoothing is on.
        nats = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(),
                               ignore_index=IGNORE_INDEX, reduction="none")
        keep = (targets.flatten() != IGNORE_INDEX) & counted
        sums[0].index_add_(0, domains[keep], nats[keep].double())
        sums[1].index_add_(0, domains[keep], torch.ones_like(nats[keep], dtype=torch.float64))
    if env.distributed:
        dist.all_reduce(sums)
    model.train()
    losses = {d: n / t for d, n, t in zip(names, *sums.tolist(), strict=True) if t}
    shares = data.train.domain_shares()
    return mixture_mean(losses, {d: w["tokens"] for d, w in shares.items()})
