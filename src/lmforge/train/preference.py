"""Direct preference optimisation as an objective of the training loop.

DPO (Rafailov et al. 2023) trains a policy on pairs (prompt, chosen y_w, rejected y_l):

    loss = -log sigmoid(beta * [(log pi(y_w|x) - log ref(y_w|x)) - (log pi(y_l|x) - log ref(y_l|x))])

with log-probabilities summed over the response tokens only, and ``ref`` the frozen
model the policy starts from. ``beta * (log pi - log ref)`` is a response's implicit
reward; the reward margin is chosen's minus rejected's, and the share of pairs whose
margin is > 0 is the reward accuracy (``reward_accuracy``, as ``evaluate.preferences``
names it; evaluation's ``pref_accuracy`` is another figure: chosen the more likely).

The reference's log-probabilities never change, so each pair's are computed once, the
first time a batch holds it, and cached for the rest of the run: a run computes them for
the pairs it uses only (a short run on a large set never scores the rest), each DDP rank
for its own rows, and a step whose pairs are all cached runs the policy alone. The cache
is part of the checkpoint, so a resumed run uses the very values an unbroken one would. Data: packed rows from
the dpo_data stage, where pair k's chosen and rejected sequences are documents 2k and
2k+1 (``lmforge.finetune.preferences.pack_pairs``), so the document of a target token
names its pair and side.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from lmforge.config import Params
from lmforge.model.llama import Llama
from lmforge.model.loss import IGNORE_INDEX
from lmforge.train.distributed import DistEnv, rank_batches
from lmforge.train.fsdp import is_sharded
from lmforge.train.precision import Precision


def token_logps(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(target) per position, 0 where the target is ``IGNORE_INDEX`` (same shape)."""
    return -F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(),
                            ignore_index=IGNORE_INDEX, reduction="none").view(targets.shape)


def sequence_logps(logits: torch.Tensor, targets: torch.Tensor, docs: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(document ids, summed log-prob of each one's targets), for the documents scored.

    Only target tokens count (``IGNORE_INDEX`` marks prompts and padding), so a prompt
    token never enters a response's log-probability.
    """
    keep = targets != IGNORE_INDEX
    ids, inverse = torch.unique(docs[keep], return_inverse=True)
    sums = torch.zeros(len(ids), dtype=torch.float32, device=logits.device)
    return ids, sums.index_add(0, inverse, token_logps(logits, targets)[keep])


def split_pairs(ids: torch.Tensor, values: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pair ids, chosen values, rejected values) from per-document values.

    Documents 2k and 2k+1 are pair k's chosen and rejected; each pair must be whole.
    """
    chosen = ids % 2 == 0
    pairs = ids[chosen] // 2
    if len(ids) != 2 * len(pairs) or not torch.equal(ids[~chosen] // 2, pairs):
        raise ValueError("a batch holds part of a pair: the rows are not whole pairs "
                         "(data/dpo written by another version?)")
    return pairs, values[chosen], values[~chosen]


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor,
             ref_chosen: torch.Tensor, ref_rejected: torch.Tensor, beta: float
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair (loss, chosen reward, rejected reward), rewards = beta * (log pi - log ref)."""
    reward_chosen = beta * (policy_chosen - ref_chosen)
    reward_rejected = beta * (policy_rejected - ref_rejected)
    return -F.logsigmoid(reward_chosen - reward_rejected), reward_chosen, reward_rejected


class PairLoader:
    """Packed preference rows with each target token's document index.

    Wraps the shard ``WindowLoader`` (windows are exactly the packed rows), so shuffling,
    rank striding and the resumable state are the shard loader's; batches are
    ``(inputs, targets, positions, docs)``.
    """

    def __init__(self, shards: Any, seq_len: int, batch_size: int, seed: int,
                 rank: int = 0, world_size: int = 1) -> None:
        from lmforge.shards.loader import WindowLoader

        self.windows = WindowLoader(shards, seq_len, batch_size, seed, rank=rank,
                                    world_size=world_size, return_doc_info=True)
        self.shards = shards
        self._ar = np.arange(seq_len, dtype=np.int64)

    def next_batch(self) -> tuple[torch.Tensor, ...]:
        inputs, targets, positions = self.windows.next_batch()
        starts = self.windows.last_starts
        docs = self.shards.doc_of(starts[:, None] + 1 + self._ar)
        return inputs, targets, positions, torch.from_numpy(docs)

    def state_dict(self) -> dict:
        return self.windows.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.windows.load_state_dict(state)


class DpoObjective:
    """The loop's objective for DPO: per-pair loss from the policy and cached references.

    ``reference`` is the frozen model the policy started from. It scores each pair once
    (``_reference``); at evaluation it also gives the exact per-token KL(policy ||
    reference) over the val responses.
    """

    stats = ("pairs", "reward_margin", "reward_accuracy", "reward_chosen", "reward_rejected",
             "logp_chosen", "logp_rejected", "nll_chosen")

    def __init__(self, beta: float, reference: Llama, train_docs: int, val_docs: int,
                 nll_weight: float = 0.0) -> None:
        self.beta = beta
        self.nll_weight = nll_weight
        self.reference = reference
        # FSDP: a sharded reference (and policy) runs forwards in step on every rank.
        self.lockstep = is_sharded(reference)
        # Summed response log-prob per document under the reference; NaN = not yet scored.
        self.cache = {"train": torch.full((train_docs,), float("nan"), dtype=torch.float64),
                      "val": torch.full((val_docs,), float("nan"), dtype=torch.float64)}

    def make_loader(self, data: Any, seq_len: int, batch_size: int, seed: int,
                    env: DistEnv, doc_mask: bool) -> PairLoader:
        return PairLoader(data.train, seq_len, batch_size, seed, env.rank, env.world_size)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The reference cache (this rank's), saved with the checkpoint."""
        return {k: v.clone() for k, v in self.cache.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for split, values in state.items():
            if values.shape != self.cache[split].shape:
                raise ValueError(f"reference cache of {split} has {values.shape[0]} documents,"
                                 f" the data {self.cache[split].shape[0]}")
            self.cache[split] = values.clone()

    @staticmethod
    def merge_state_dicts(states: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Several ranks' caches as one (a resume on another number of ranks): each
        document's value from the first rank that scored it."""
        merged = {k: v.clone() for k, v in states[0].items()}
        for state in states[1:]:
            for split, values in state.items():
                empty = torch.isnan(merged[split])
                merged[split][empty] = values[empty]
        return merged

    def count(self, batch: list[torch.Tensor]) -> int:
        """Pairs in the micro-batch."""
        targets, docs = batch[1], batch[3]
        return len(torch.unique(docs[targets != IGNORE_INDEX])) // 2

    def loss(self, model: torch.nn.Module, batch: list[torch.Tensor]
             ) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets, positions, docs = batch
        ref = self._reference("train", inputs, targets, positions, docs)
        logits = model(inputs, positions=positions)
        losses, stats = self.pair_figures(logits, targets, docs, ref)
        return losses.mean(), stats

    @torch.no_grad()
    def _reference(self, split: str, inputs: torch.Tensor, targets: torch.Tensor,
                   positions: torch.Tensor, docs: torch.Tensor,
                   logits: torch.Tensor | None = None) -> torch.Tensor:
        """The cache of ``split``, with this batch's documents scored if they were not.

        Only the rows holding an unscored document run through the reference (or none:
        ``logits``, the reference's logits of the whole batch, when the caller has them).
        """
        cache = self.cache[split]
        scored = targets != IGNORE_INDEX
        missing = bool(torch.isnan(cache[docs[scored].cpu()]).any()) if scored.any() else False
        if logits is None and self.lockstep:
            # A sharded reference's forward is a collective: when any rank scores, all do.
            if not _on_any_rank(missing, inputs.device):
                return cache
            if not missing:  # one row through the reference, thrown away
                self.reference(inputs[:1], positions=positions[:1])
                return cache
        if not missing:
            return cache
        rows = torch.tensor([bool(torch.isnan(cache[docs[r][scored[r]].cpu()]).any())
                             for r in range(len(docs))], device=docs.device)
        if logits is None:
            logits = self.reference(inputs[rows], positions=positions[rows])
        else:
            logits = logits[rows]
        ids, sums = sequence_logps(logits, targets[rows], docs[rows])
        cache[ids.cpu()] = sums.double().cpu()
        return cache

    def pair_figures(self, logits: torch.Tensor, targets: torch.Tensor, docs: torch.Tensor,
                     ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(per-pair losses, the ``stats`` sums) of one batch; ``ref``: log-probs by doc.

        A pair's loss is DPO's, plus ``nll_weight`` times its chosen response's NLL per
        token (``nll_chosen``, logged either way).
        """
        ids, logps = sequence_logps(logits, targets, docs)
        pairs, pol_c, pol_r = split_pairs(ids, logps)
        lengths = torch.unique(docs[targets != IGNORE_INDEX], return_counts=True)[1]
        nll_c = -pol_c / lengths[ids % 2 == 0].to(pol_c.dtype)
        chosen = 2 * pairs.cpu()
        ref_c = ref[chosen].to(logps.device, torch.float32)
        ref_r = ref[chosen + 1].to(logps.device, torch.float32)
        losses, rew_c, rew_r = dpo_loss(pol_c, pol_r, ref_c, ref_r, self.beta)
        if self.nll_weight:
            losses = losses + self.nll_weight * nll_c
        margin = (rew_c - rew_r).detach()
        stats = torch.stack([torch.tensor(float(len(pairs)), device=logps.device),
                             margin.sum(), (margin > 0).float().sum(), rew_c.detach().sum(),
                             rew_r.detach().sum(), pol_c.detach().sum(), pol_r.detach().sum(),
                             nll_c.detach().sum()])
        return losses, stats

    @torch.no_grad()
    def evaluate(self, model: Llama, data: Any, params: Params, precision: Precision,
                 env: DistEnv) -> dict[str, float]:
        """Val DPO loss, reward accuracy, reward margin, and KL to the reference per
        response token, over ``eval_batches`` batches of val rows (all with 0)."""
        model.eval()
        sums = torch.zeros(len(self.stats) + 3, dtype=torch.float64, device=env.device)
        batches = data.eval_batches(data.val, params.model.seq_len,
                                    params.train.micro_batch_size,
                                    max_batches=params.train.eval_batches, return_doc_info=True)
        # Ranks split the batches, then sum; sharded models' ranks run in step.
        lockstep = self.lockstep or is_sharded(model)
        for batch, counted in rank_batches(batches, env, lockstep):
            inputs, targets = batch["input"].to(env.device), batch["target"].to(env.device)
            positions, docs = batch["positions"].to(env.device), batch["doc"].to(env.device)
            with precision.autocast():
                logits = model(inputs, positions=positions)
                ref_logits = self.reference(inputs, positions=positions)
            if not counted:
                continue
            ref = self._reference("val", inputs, targets, positions, docs, ref_logits)
            losses, stats = self.pair_figures(logits, targets, docs, ref)
            kl, tokens = kl_per_token(logits, ref_logits, targets)
            sums += torch.cat([stats.double(), torch.tensor(
                [losses.sum().item(), kl, tokens], dtype=torch.float64, device=env.device)])
        if env.distributed:
            import torch.distributed as dist

            dist.all_reduce(sums)
        model.train()
        totals = sums.tolist()
        n = totals[0] or float("nan")
        return {"val_loss": totals[len(self.stats)] / n,
                "val_reward_accuracy": totals[self.stats.index("reward_accuracy")] / n,
                "val_reward_margin": totals[self.stats.index("reward_margin")] / n,
                "val_kl_per_token": totals[-2] / (totals[-1] or float("nan"))}


def _on_any_rank(flag: bool, device: torch.device) -> bool:
    """True when ``flag`` is true on any rank (a collective; just ``flag`` alone)."""
    import torch.distributed as dist

    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return flag
    t = torch.tensor([int(flag)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def kl_per_token(logits: torch.Tensor, ref_logits: torch.Tensor, targets: torch.Tensor
                 ) -> tuple[float, int]:
    """Summed exact KL(policy || reference) over the target positions, and their count."""
    keep = targets != IGNORE_INDEX
    logp = F.log_softmax(logits[keep].float(), dim=-1)
    logr = F.log_softmax(ref_logits[keep].float(), dim=-1)
    return float((logp.exp() * (logp - logr)).sum()), int(keep.sum())
