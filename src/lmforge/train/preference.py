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

``dpo.loss`` picks the pair loss (``lmforge.train.preference_losses``: DPO's sigmoid,
IPO, DPO-Positive, or SimPO, which needs no reference at all: then the reference is
never built, run or cached). With ``dpo.replay`` a share of each batch's rows are
pretraining windows (document -1 throughout); their mean next-token loss per token,
times ``dpo.replay_weight``, is added to the pairs' mean loss (InstructGPT's PPO-ptx).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from lmforge.config import DpoConfig, Params
from lmforge.model.llama import Llama
from lmforge.model.loss import IGNORE_INDEX
from lmforge.train.distributed import DistEnv, rank_batches
from lmforge.train.fsdp import is_sharded
from lmforge.train.precision import Precision
from lmforge.train.preference_losses import dpo_loss, dpop_loss, ipo_loss, simpo_loss
from lmforge.train.replay import ReplayLoader

# What pair_figures sums per batch; the first counts the pairs the others are sums over.
PAIR_STATS = ("pairs", "reward_margin", "reward_accuracy", "reward_chosen", "reward_rejected",
              "logp_chosen", "logp_rejected", "nll_chosen")
# With replay, after them: the replay rows' summed next-token loss and their target
# tokens, so that the logged ``replay_loss`` is the mean per replay token.
REPLAY_STATS = ("replay_loss", "replay_tokens")


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


class ReplayRows:
    """Pretraining windows shaped as pair rows, ``(inputs, targets, positions, docs)`` with
    every document -1 (no pair), for ``ReplayLoader`` to interleave with the pairs."""

    def __init__(self, windows: Any) -> None:
        self.windows = windows
        self.shards = windows.shards

    def next_batch(self) -> tuple[torch.Tensor, ...]:
        inputs, targets, positions = self.windows.next_batch()
        return inputs, targets, positions, torch.full_like(targets, -1)

    def state_dict(self) -> dict:
        return self.windows.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.windows.load_state_dict(state)


class DpoObjective:
    """The loop's objective for preference training: per-pair loss from the policy and
    cached references, plus the replay rows' next-token loss when there are any.

    ``reference`` is the frozen model the policy started from (None for SimPO, which
    has no reference). It scores each pair once (``_reference``); at evaluation it also
    gives the exact per-token KL(policy || reference) over the val responses.

    ``loss`` is ``dpo.loss`` (``dpop_lambda``, ``simpo_gamma`` its knobs). With
    ``replay_weight`` > 0 the batches hold replay rows (``make_loader``) and the loss has
    two parts, each a mean over its own items: ``count`` gives (pairs, replay tokens) and
    ``loss`` the two means, which the optimizer step weighs by their shares of the
    step's pairs and replay tokens (``lmforge.train.step``).
    """

    def __init__(self, beta: float, reference: Llama | None, train_docs: int, val_docs: int,
                 nll_weight: float = 0.0, *, loss: str = "sigmoid", dpop_lambda: float = 50.0,
                 simpo_gamma: float = 0.5, replay_weight: float = 0.0) -> None:
        if (reference is None) != (loss == "simpo"):
            raise ValueError(f"dpo.loss {loss}: " + ("needs a reference model" if reference
                                                     is None else "takes no reference model"))
        self.beta = beta
        self.nll_weight = nll_weight
        self.kind, self.dpop_lambda, self.simpo_gamma = loss, dpop_lambda, simpo_gamma
        self.replay_weight = replay_weight
        self.stats = PAIR_STATS + (REPLAY_STATS if replay_weight else ())
        # The logged replay_loss is a mean per replay token, not per pair.
        self.stat_denominators = {"replay_loss": "replay_tokens"} if replay_weight else {}
        self.reference = reference
        # FSDP: a sharded reference (and policy) runs forwards in step on every rank.
        self.lockstep = reference is not None and is_sharded(reference)
        # Summed response log-prob per document under the reference; NaN = not yet scored.
        self.cache = {"train": torch.full((train_docs,), float("nan"), dtype=torch.float64),
                      "val": torch.full((val_docs,), float("nan"), dtype=torch.float64)}

    @classmethod
    def from_config(cls, cfg: DpoConfig, reference: Llama | None, train_docs: int,
                    val_docs: int) -> DpoObjective:
        """The objective ``dpo`` params describe (replay rows when ``cfg.replay`` > 0)."""
        return cls(cfg.beta, reference, train_docs, val_docs, cfg.nll_weight, loss=cfg.loss,
                   dpop_lambda=cfg.dpop_lambda, simpo_gamma=cfg.simpo_gamma,
                   replay_weight=cfg.replay_weight if cfg.replay > 0 else 0.0)

    def make_loader(self, data: Any, seq_len: int, batch_size: int, seed: int,
                    env: DistEnv, doc_mask: bool) -> Any:
        """Pair rows; with replay, ``data.replay_share`` of the rows pretraining windows
        of the same length, interleaved as sft's replay is (``ReplayLoader``)."""
        if not self.replay_weight:
            return PairLoader(data.train, seq_len, batch_size, seed, env.rank, env.world_size)
        if data.replay is None or not data.replay_share:
            raise ValueError("a DPO objective with replay needs data.replay and its share")
        pairs = PairLoader(data.train, seq_len, 1, seed, env.rank, env.world_size)
        windows = data.make_loader(data.replay, seq_len, 1, seed + 1, rank=env.rank,
                                   world_size=env.world_size, return_doc_info=True)
        return ReplayLoader(pairs, ReplayRows(windows), data.replay_share, batch_size)

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

    def count(self, batch: list[torch.Tensor]) -> int | tuple[int, int]:
        """Pairs in the micro-batch; with replay, (pairs, replay target tokens)."""
        targets, docs = batch[1], batch[3]
        if not self.replay_weight:
            return len(torch.unique(docs[targets != IGNORE_INDEX])) // 2
        replay = docs[:, 0] < 0
        pairs = len(torch.unique(docs[~replay][targets[~replay] != IGNORE_INDEX])) // 2
        return pairs, int((targets[replay] != IGNORE_INDEX).sum())

    def loss(self, model: torch.nn.Module, batch: list[torch.Tensor]
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean pair loss, the ``stats`` sums); with replay, both means (``count``)."""
        if self.replay_weight:
            return self._loss_with_replay(model, batch)
        inputs, targets, positions, docs = batch
        ref = self._train_reference(inputs, targets, positions, docs)
        logits = model(inputs, positions=positions)
        losses, stats = self.pair_figures(logits, targets, docs, ref)
        return losses.mean(), stats

    def _loss_with_replay(self, model: torch.nn.Module, batch: list[torch.Tensor]
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the pairs' mean loss and ``replay_weight`` x the replay rows' mean next-token
        loss per token, stacked; the stats, the replay sums last). One forward for all
        rows; a part with no items in this micro-batch is 0 (the step weighs it 0)."""
        inputs, targets, positions, docs = batch
        replay = docs[:, 0] < 0  # a replay row's documents are -1 throughout
        # The pair figures and the reference see the pair rows' targets only.
        pair_targets = targets.masked_fill(replay[:, None], IGNORE_INDEX)
        ref = self._train_reference(inputs, pair_targets, positions, docs)
        logits = model(inputs, positions=positions)
        losses, stats = self.pair_figures(logits, pair_targets, docs, ref)
        nll = -token_logps(logits[replay], targets[replay]).sum()
        tokens = (targets[replay] != IGNORE_INDEX).sum()
        pref = losses.mean() if len(losses) else losses.sum()
        parts = torch.stack([pref, self.replay_weight * nll / tokens.clamp(min=1)])
        return parts, torch.cat([stats, torch.stack([nll.detach(), tokens.to(nll.dtype)])])

    def _train_reference(self, inputs: torch.Tensor, targets: torch.Tensor,
                         positions: torch.Tensor, docs: torch.Tensor) -> torch.Tensor | None:
        """The train split's reference cache with this batch scored; None without one."""
        if self.reference is None:
            return None
        return self._reference("train", inputs, targets, positions, docs)

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
                     ref: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(per-pair losses, the ``PAIR_STATS`` sums) of one batch; ``ref``: log-probs by
        doc (None for SimPO).

        A pair's loss is ``dpo.loss``'s, plus ``nll_weight`` times its chosen response's
        NLL per token (``nll_chosen``, logged either way).
        """
        ids, logps = sequence_logps(logits, targets, docs)
        pairs, pol_c, pol_r = split_pairs(ids, logps)
        lengths = torch.unique(docs[targets != IGNORE_INDEX], return_counts=True)[1]
        nll_c = -pol_c / lengths[ids % 2 == 0].to(pol_c.dtype)
        losses, rew_c, rew_r = self.pair_losses(pairs, pol_c, pol_r, ref,
                                                lengths[ids % 2 == 0], lengths[ids % 2 == 1])
        if self.nll_weight:
            losses = losses + self.nll_weight * nll_c
        margin = (rew_c - rew_r).detach()
        stats = torch.stack([torch.tensor(float(len(pairs)), device=logps.device),
                             margin.sum(), (margin > 0).float().sum(), rew_c.detach().sum(),
                             rew_r.detach().sum(), pol_c.detach().sum(), pol_r.detach().sum(),
                             nll_c.detach().sum()])
        return losses, stats

    def pair_losses(self, pairs: torch.Tensor, pol_c: torch.Tensor, pol_r: torch.Tensor,
                    ref: torch.Tensor | None, len_c: torch.Tensor, len_r: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-pair (loss, chosen reward, rejected reward) of ``dpo.loss``, from the
        policy's summed log-probs, the reference's (looked up by pair in ``ref``) and the
        responses' token counts (SimPO's length normalisation)."""
        if self.kind == "simpo":
            return simpo_loss(pol_c, pol_r, len_c.to(pol_c.dtype), len_r.to(pol_r.dtype),
                              self.beta, self.simpo_gamma)
        chosen = 2 * pairs.cpu()
        ref_c = ref[chosen].to(pol_c.device, torch.float32)
        ref_r = ref[chosen + 1].to(pol_c.device, torch.float32)
        if self.kind == "ipo":
            return ipo_loss(pol_c, pol_r, ref_c, ref_r, self.beta)
        if self.kind == "dpop":
            return dpop_loss(pol_c, pol_r, ref_c, ref_r, self.beta, self.dpop_lambda)
        return dpo_loss(pol_c, pol_r, ref_c, ref_r, self.beta)

    @torch.no_grad()
    def evaluate(self, model: Llama, data: Any, params: Params, precision: Precision,
                 env: DistEnv) -> dict[str, float]:
        """Val loss, reward accuracy, reward margin, and (with a reference) KL to it per
        response token, over ``eval_batches`` batches of val pair rows (all with 0)."""
        model.eval()
        sums = torch.zeros(len(PAIR_STATS) + 3, dtype=torch.float64, device=env.device)
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
                ref_logits = (None if self.reference is None
                              else self.reference(inputs, positions=positions))
            if not counted:
                continue
            ref = (None if ref_logits is None else
                   self._reference("val", inputs, targets, positions, docs, ref_logits))
            losses, stats = self.pair_figures(logits, targets, docs, ref)
            kl, tokens = (0.0, 0) if ref_logits is None else kl_per_token(logits, ref_logits,
                                                                          targets)
            sums += torch.cat([stats.double(), torch.tensor(
                [losses.sum().item(), kl, tokens], dtype=torch.float64, device=env.device)])
        if env.distributed:
            import torch.distributed as dist

            dist.all_reduce(sums)
        model.train()
        return self._val_figures(sums.tolist())

    def _val_figures(self, totals: list[float]) -> dict[str, float]:
        """The val means from ``evaluate``'s sums; no KL without a reference (SimPO)."""
        n = totals[0] or float("nan")
        figures = {"val_loss": totals[len(PAIR_STATS)] / n,
                   "val_reward_accuracy": totals[PAIR_STATS.index("reward_accuracy")] / n,
                   "val_reward_margin": totals[PAIR_STATS.index("reward_margin")] / n}
        if self.reference is not None:
            figures["val_kl_per_token"] = totals[-2] / (totals[-1] or float("nan"))
        return figures


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
