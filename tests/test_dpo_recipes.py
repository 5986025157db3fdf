"""The preference losses (dpo.loss), pretraining replay during DPO (dpo.replay) and their
keys: each loss against its paper's formula, today's DPO bit for bit at the defaults,
replay rows and their weight, exact resume with replay."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_dpo import (
    CPU,
    SEQ,
    assert_resumed_the_same,
    direct_terms,
    dpo_params,
    good_pairs,
    lines,
    tiny_model,
    unpacked_logps,
)

from lmforge.config import DpoConfig, DpoDataConfig, Params, from_dict
from lmforge.config.post_training import PREFERENCE_LOSSES
from lmforge.errors import ConfigError, InputError
from lmforge.finetune.build_pairs import build_pairs
from lmforge.model.loss import IGNORE_INDEX
from lmforge.shards.loader import ShardSet, eval_batches
from lmforge.shards.writer import write_shards
from lmforge.train import checkpoint as ckpt
from lmforge.train import runs
from lmforge.train.dpo import DpoPaths, make_objective, open_dpo_data
from lmforge.train.loop import TrainData, open_shard_data, train
from lmforge.train.precision import resolve_precision
from lmforge.train.preference import (
    DpoObjective,
    PairLoader,
    sequence_logps,
    split_pairs,
)
from lmforge.train.preference_losses import dpo_loss, dpop_loss, ipo_loss, simpo_loss
from lmforge.train.step import optimizer_step


@pytest.fixture(scope="module")
def pair_data(chat_tokenizer, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("pairs")
    (root / "p.jsonl").write_bytes(lines(*good_pairs(160)))
    cfg = DpoDataConfig(sources=[str(root / "p.jsonl")], seq_len=SEQ, val_fraction=0.2)
    build_pairs(cfg, chat_tokenizer, root / "dpo")
    return root / "dpo"


@pytest.fixture(scope="module")
def pretraining(pair_data, tmp_path_factory) -> Path:
    """Pretraining shards in the pairs' vocabulary: plain documents, no loss mask."""
    pairs = ShardSet(pair_data / "train")
    rng = np.random.default_rng(5)
    docs = [[int(t) for t in rng.integers(8, pairs.vocab_size, int(rng.integers(30, 200)))]
            for _ in range(60)]
    root = tmp_path_factory.mktemp("shards") / "train"
    write_shards(root, docs, pairs.vocab_size, tokenizer_sha256=pairs.tokenizer_sha256)
    return root


# --------------------------------------------------------------------------- the formulas

# Four hand-made pairs: summed response log-probs of policy and reference, and lengths.
# The chosen answer sits above its reference in pairs 0 and 2, below it in 1 and 3.
PC, PR = [-3.0, -10.0, -7.4, -2.6], [-5.0, -9.0, -7.0, -6.5]
RC, RR = [-4.0, -8.0, -7.5, -2.5], [-4.0, -9.5, -6.0, -6.0]
LC, LR = [3, 10, 5, 2], [5, 6, 5, 9]
BETA, LAMBDA, GAMMA = 0.3, 4.0, 0.5


def sig(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def written_out(kind: str, i: int) -> tuple[float, float, float]:
    """(loss, d loss / d log pi(y_w), d loss / d log pi(y_l)) of pair ``i``, by hand."""
    pc, pr, rc, rr = PC[i], PR[i], RC[i], RR[i]
    h = (pc - rc) - (pr - rr)
    if kind == "sigmoid":  # -log sigmoid(beta h)
        z = BETA * h
        return -math.log(sig(z)), -BETA * sig(-z), BETA * sig(-z)
    if kind == "ipo":  # (h - 1/(2 beta))^2
        d = h - 1 / (2 * BETA)
        return d * d, 2 * d, -2 * d
    if kind == "dpop":  # -log sigmoid(beta (h - lambda max(0, log ref(y_w) - log pi(y_w))))
        below = rc > pc
        z = BETA * (h - LAMBDA * max(0.0, rc - pc))
        return -math.log(sig(z)), -sig(-z) * BETA * (1 + LAMBDA * below), sig(-z) * BETA
    # simpo: -log sigmoid(beta/|y_w| log pi(y_w) - beta/|y_l| log pi(y_l) - gamma)
    z = BETA * pc / LC[i] - BETA * pr / LR[i] - GAMMA
    return -math.log(sig(z)), -sig(-z) * BETA / LC[i], sig(-z) * BETA / LR[i]


def library(kind: str, pc: torch.Tensor, pr: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rc, rr = torch.tensor(RC), torch.tensor(RR)
    if kind == "sigmoid":
        return dpo_loss(pc, pr, rc, rr, BETA)
    if kind == "ipo":
        return ipo_loss(pc, pr, rc, rr, BETA)
    if kind == "dpop":
        return dpop_loss(pc, pr, rc, rr, BETA, LAMBDA)
    return simpo_loss(pc, pr, torch.tensor(LC, dtype=torch.float32),
                      torch.tensor(LR, dtype=torch.float32), BETA, GAMMA)


@pytest.mark.parametrize("kind", PREFERENCE_LOSSES)
def test_each_loss_is_its_papers_formula_in_value_and_gradient(kind):
    pc = torch.tensor(PC, requires_grad=True)
    pr = torch.tensor(PR, requires_grad=True)
    losses, rew_c, rew_r = library(kind, pc, pr)
    losses.sum().backward()
    for i in range(4):
        value, d_chosen, d_rejected = written_out(kind, i)
        assert losses[i].item() == pytest.approx(value, rel=1e-5), (kind, i)
        assert pc.grad[i].item() == pytest.approx(d_chosen, rel=1e-5, abs=1e-7), (kind, i)
        assert pr.grad[i].item() == pytest.approx(d_rejected, rel=1e-5, abs=1e-7), (kind, i)
    # Rewards: DPO's implicit beta * (log pi - log ref) wherever there is a reference;
    # SimPO's own beta * mean log-prob per token.
    if kind == "simpo":
        want_c = [BETA * p / n for p, n in zip(PC, LC, strict=True)]
        want_r = [BETA * p / n for p, n in zip(PR, LR, strict=True)]
    else:
        want_c = [BETA * (p - r) for p, r in zip(PC, RC, strict=True)]
        want_r = [BETA * (p - r) for p, r in zip(PR, RR, strict=True)]
    assert rew_c.tolist() == pytest.approx(want_c, rel=1e-5)
    assert rew_r.tolist() == pytest.approx(want_r, rel=1e-5)


def test_dpop_differs_from_dpo_only_where_the_chosen_answer_fell_below_the_reference():
    pc, pr = torch.tensor(PC), torch.tensor(PR)
    rc, rr = torch.tensor(RC), torch.tensor(RR)
    plain = dpo_loss(pc, pr, rc, rr, BETA)[0]
    positive = dpop_loss(pc, pr, rc, rr, BETA, LAMBDA)[0]
    below = torch.tensor(RC) > torch.tensor(PC)
    assert below.tolist() == [False, True, False, True]
    assert torch.equal(positive[~below], plain[~below])
    assert bool((positive[below] > plain[below]).all())
    # IPO is at its minimum, 0, exactly at the margin 1/(2 beta).
    h = torch.tensor([1 / (2 * BETA)])
    assert ipo_loss(h, torch.zeros(1), torch.zeros(1), torch.zeros(1), BETA)[0].item() == 0


def objective_for(kind: str, ref_model: Any, shards: ShardSet, **kw: Any) -> DpoObjective:
    return DpoObjective(BETA, None if kind == "simpo" else ref_model, len(shards.doc_ends), 1,
                        kw.pop("nll_weight", 0.0), loss=kind, dpop_lambda=LAMBDA,
                        simpo_gamma=GAMMA, **kw)


@pytest.mark.parametrize("kind", ["ipo", "dpop", "simpo"])
def test_each_loss_on_packed_rows_matches_each_sequence_scored_alone(pair_data, kind):
    """Through the objective: the loss and its gradients over the model's weights equal
    the formula applied to every sequence run through the model on its own."""
    shards = ShardSet(pair_data / "train")
    batch = list(PairLoader(shards, SEQ, 4, seed=0).next_batch())
    policy, ref_model = tiny_model(shards.vocab_size, 0), tiny_model(shards.vocab_size, 1)
    objective = objective_for(kind, ref_model, shards)
    loss, stats = objective.loss(policy, batch)
    grads = torch.autograd.grad(loss, list(policy.parameters()))

    pol, ref, length, pairs = direct_terms(policy, ref_model, batch)
    terms = []
    for p in pairs:
        c, r = 2 * p, 2 * p + 1
        h = (pol[c] - ref[c]) - (pol[r] - ref[r])
        if kind == "ipo":
            terms.append((h - 1 / (2 * BETA)) ** 2)
        elif kind == "dpop":
            penalty = LAMBDA * torch.clamp(ref[c] - pol[c], min=0)
            terms.append(-F.logsigmoid(BETA * (h - penalty)))
        else:
            terms.append(-F.logsigmoid(BETA * pol[c] / length[c] - BETA * pol[r] / length[r]
                                       - GAMMA))
    direct = torch.stack(terms).mean()
    direct_grads = torch.autograd.grad(direct, list(policy.parameters()))
    assert stats[0].item() == len(pairs) == objective.count(batch) > 1
    assert torch.allclose(loss, direct, atol=1e-5), (loss, direct)
    for g, want in zip(grads, direct_grads, strict=True):
        assert torch.allclose(g, want, atol=1e-5, rtol=1e-4)
    if kind == "dpop":  # the batch exercises both sides of the penalty's hinge
        below = [bool(ref[2 * p] > pol[2 * p]) for p in pairs]
        assert any(below) and not all(below)
    if kind == "simpo":  # reference-free: nothing was scored or cached
        assert bool(torch.isnan(objective.cache["train"]).all())


def test_simpo_builds_no_reference(monkeypatch):
    import lmforge.train.dpo as dpo_stage

    def refuse(*a: Any, **k: Any) -> None:
        raise AssertionError("SimPO built a reference model")

    monkeypatch.setattr(dpo_stage, "build_reference", refuse)
    data = SimpleNamespace(train=SimpleNamespace(doc_ends=[2, 4]),
                           val=SimpleNamespace(doc_ends=[2]))
    params = Params(dpo=DpoConfig(loss="simpo", beta=2.0))
    objective = make_objective(params, params, data, CPU)
    assert objective.reference is None and objective.kind == "simpo"
    with pytest.raises(ValueError, match="needs a reference"):
        DpoObjective(0.1, None, 4, 2)


# --------------------------------------------------------------- today's DPO, bit for bit

class TodaysDpo:
    """DPO as the dpo stage trained it before dpo.loss and dpo.replay existed (commit
    b329baa: ``DpoObjective.loss`` and ``pair_figures`` with ``dpo_loss``), written out
    here so that the defaults are held to that arithmetic, not to themselves. The
    reference log-probs come prefilled: the values the objective under test caches."""

    stats = ("pairs", "reward_margin", "reward_accuracy", "reward_chosen", "reward_rejected",
             "logp_chosen", "logp_rejected", "nll_chosen")

    def __init__(self, beta: float, ref: torch.Tensor, nll_weight: float) -> None:
        self.beta, self.ref, self.nll_weight = beta, ref, nll_weight

    def make_loader(self, data: Any, seq_len: int, batch_size: int, seed: int, env: Any,
                    doc_mask: bool) -> PairLoader:
        return PairLoader(data.train, seq_len, batch_size, seed, env.rank, env.world_size)

    def count(self, batch: list[torch.Tensor]) -> int:
        targets, docs = batch[1], batch[3]
        return len(torch.unique(docs[targets != IGNORE_INDEX])) // 2

    def loss(self, model: Any, batch: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets, positions, docs = batch
        logits = model(inputs, positions=positions)
        ids, logps = sequence_logps(logits, targets, docs)
        pairs, pol_c, pol_r = split_pairs(ids, logps)
        lengths = torch.unique(docs[targets != IGNORE_INDEX], return_counts=True)[1]
        nll_c = -pol_c / lengths[ids % 2 == 0].to(pol_c.dtype)
        chosen = 2 * pairs.cpu()
        ref_c = self.ref[chosen].to(logps.device, torch.float32)
        ref_r = self.ref[chosen + 1].to(logps.device, torch.float32)
        rew_c = self.beta * (pol_c - ref_c)
        rew_r = self.beta * (pol_r - ref_r)
        losses = -F.logsigmoid(rew_c - rew_r)
        if self.nll_weight:
            losses = losses + self.nll_weight * nll_c
        margin = (rew_c - rew_r).detach()
        stats = torch.stack([torch.tensor(float(len(pairs)), device=logps.device),
                             margin.sum(), (margin > 0).float().sum(), rew_c.detach().sum(),
                             rew_r.detach().sum(), pol_c.detach().sum(), pol_r.detach().sum(),
                             nll_c.detach().sum()])
        return losses.mean(), stats

    def evaluate(self, *args: Any) -> dict[str, float]:
        return {"val_loss": 0.0}


@torch.no_grad()
def reference_logps(model: Any, shards: ShardSet) -> torch.Tensor:
    """Every document's summed response log-prob under ``model`` (float64, by document)."""
    out = torch.full((len(shards.doc_ends),), float("nan"), dtype=torch.float64)
    for b in eval_batches(shards, SEQ, 8, return_doc_info=True):
        logits = model(b["input"], positions=b["positions"])
        ids, sums = sequence_logps(logits, b["target"], b["doc"])
        out[ids] = sums.double()
    return out


@pytest.mark.parametrize("nll_weight", [0.0, 0.5])
def test_the_defaults_train_todays_dpo_bit_for_bit(pair_data, tmp_path, nll_weight):
    """``loss: sigmoid`` without replay: the same weights, losses and logged figures as
    the code before them, step for step; and the run keeps its fingerprint (the new keys
    at their defaults are not part of its identity), so its checkpoints still resume."""
    data_dir = pair_data
    params = dpo_params(seed=7, max_steps=8, eval_every=0, nll_weight=nll_weight)
    assert params.train.loss == "sigmoid" and params.train.replay == 0
    results = []
    for todays in (True, False):
        data: TrainData = open_shard_data(data_dir / "train", data_dir / "val")
        ref = tiny_model(data.train.vocab_size, 7).requires_grad_(False).eval()
        prefilled = reference_logps(ref, data.train)
        if todays:
            data.objective = TodaysDpo(0.5, prefilled, nll_weight)
        else:
            data.objective = DpoObjective(0.5, ref, len(data.train.doc_ends),
                                          len(data.val.doc_ends), nll_weight)
            data.objective.load_state_dict({"train": prefilled,
                                            "val": data.objective.cache["val"]})
        results.append(train(params, data, tmp_path / str(todays), "t" * 64, CPU,
                             track=False, log=lambda _: None, stage="dpo"))
    old, new = results
    for name, tensor in old.model.state_dict().items():
        assert torch.equal(new.model.state_dict()[name], tensor), name
    keys = ("loss", "grad_norm", *TodaysDpo.stats[1:])
    assert [[row[k] for k in keys] for row in new.history] == \
        [[row[k] for k in keys] for row in old.history]
    assert len(new.history) == 2 and "replay_loss" not in new.history[0]
    identity = ckpt.run_identity(params.model, params.train, 1, {}, {}, "t" * 64)
    assert not {"loss", "replay", "replay_weight", "dpop_lambda",
                "simpo_gamma"} & set(identity["train"])


def test_a_key_that_shapes_the_run_is_in_its_identity_and_only_then():
    def train_keys(**kw: Any) -> set[str]:
        identity = ckpt.run_identity(dpo_params().model, DpoConfig(**kw), 1, {}, {}, "t")
        return set(identity["train"])

    assert {"loss", "dpop_lambda"} <= train_keys(loss="dpop")
    assert "simpo_gamma" not in train_keys(loss="dpop")
    assert {"loss", "simpo_gamma"} <= train_keys(loss="simpo")
    assert "dpop_lambda" not in train_keys(loss="simpo", dpop_lambda=3.0)
    assert {"replay", "replay_weight"} <= train_keys(replay=0.25)
    assert "replay_weight" not in train_keys(replay_weight=2.0)
    assert ckpt.fingerprint_of(ckpt.run_identity(dpo_params().model, DpoConfig(replay=0.25),
                                                 1, {}, {}, "t")) != \
        ckpt.fingerprint_of(ckpt.run_identity(dpo_params().model, DpoConfig(), 1, {}, {}, "t"))


# --------------------------------------------------------------------------- replay

def replay_data(pair_data: Path, pretraining: Path, share: float) -> TrainData:
    data = open_shard_data(pair_data / "train", pair_data / "val")
    data.replay, data.replay_share = ShardSet(pretraining), share
    return data


def test_replay_rows_are_next_token_windows_of_the_pretraining_shards(pair_data,
                                                                      pretraining):
    data = replay_data(pair_data, pretraining, 0.25)
    shards = data.train
    objective = objective_for("sigmoid", tiny_model(shards.vocab_size, 1), shards,
                              replay_weight=1.0)
    loader = objective.make_loader(data, SEQ, 4, 0, CPU, True)
    pre = ShardSet(pretraining)
    tokens = pre.read(0, pre.num_tokens)
    plain_pairs = PairLoader(shards, SEQ, 1, seed=0)  # the pair rows, in their own order
    replay_rows = 0
    for _ in range(5):
        inputs, targets, positions, docs = loader.next_batch()
        for row in range(4):
            if docs[row, 0] >= 0:  # a pair row: the pair loader's next one, unchanged
                want = plain_pairs.next_batch()
                assert torch.equal(inputs[row], want[0][0]) and torch.equal(docs[row], want[3][0])
                continue
            replay_rows += 1
            assert bool((docs[row] == -1).all())
            # A window of the pretraining stream, every target the next input token.
            starts = [s for s in range(0, len(tokens) - SEQ, SEQ)
                      if np.array_equal(tokens[s:s + SEQ], inputs[row].numpy())]
            assert len(starts) == 1
            start = starts[0]
            assert np.array_equal(targets[row].numpy(), tokens[start + 1:start + SEQ + 1])
            assert torch.equal(positions[row], torch.from_numpy(
                pre.positions_in_doc(start + np.arange(SEQ))))
    assert replay_rows == 5  # a quarter of 20 rows
    pairs, replay_tokens = objective.count([inputs, targets, positions, docs])
    assert replay_tokens == SEQ * int((docs[:, 0] < 0).sum()) and pairs > 0


@pytest.mark.parametrize(("batch", "share", "accum"), [(4, 0.2, 3), (1, 0.5, 4)])
def test_a_step_adds_the_replay_rows_mean_token_loss_times_its_weight(
        pair_data, pretraining, batch, share, accum):
    """One optimizer step's update is that of: the mean preference loss over all the
    step's pairs + replay_weight x the mean next-token loss over all its replay tokens,
    however pairs and replay rows fall into micro-batches (some with no replay row, or
    with replay rows only)."""
    weight = 0.7
    data = replay_data(pair_data, pretraining, share)
    vocab = data.train.vocab_size
    ref_model = tiny_model(vocab, 1)
    objective = objective_for("sigmoid", ref_model, data.train, replay_weight=weight)
    batches = [list(b) for b in _draw(objective, data, batch, accum)]
    counts = [objective.count(b) for b in batches]
    assert any(c[1] == 0 for c in counts) or any(c[0] == 0 for c in counts)

    policy = tiny_model(vocab, 0)
    pref_terms, replay_nll, replay_tokens = [], [], 0
    for b in batches:
        inputs, targets, positions, docs = b
        replay = docs[:, 0] < 0
        if (~replay).any():
            pair_batch = [t[~replay] for t in b]
            pol = unpacked_logps(policy, pair_batch)
            with torch.no_grad():
                ref = unpacked_logps(ref_model, pair_batch)
            for p in sorted({d // 2 for d in pol}):
                c, r = 2 * p, 2 * p + 1
                pref_terms.append(-F.logsigmoid(BETA * ((pol[c] - ref[c]) - (pol[r] - ref[r]))))
        if replay.any():
            logp = F.log_softmax(policy(inputs[replay], positions=positions[replay]), -1)
            replay_nll.append(-logp.gather(-1, targets[replay].unsqueeze(-1)).sum())
            replay_tokens += int(replay.sum()) * SEQ
    direct = torch.stack(pref_terms).mean() + weight * torch.stack(replay_nll).sum() / replay_tokens
    want = torch.autograd.grad(direct, list(policy.parameters()))

    before = [p.detach().clone() for p in policy.parameters()]
    sgd = torch.optim.SGD(policy.parameters(), lr=1.0)
    prec = resolve_precision("fp32", CPU.device)
    loss, _, stats = optimizer_step(policy, None, policy, sgd, prec.grad_scaler(), prec,
                                    _draw(objective, data, batch, accum), accum, 0.0, CPU,
                                    objective)
    assert loss == pytest.approx(direct.item(), rel=1e-5)
    assert stats["replay_tokens"] == replay_tokens
    assert stats["replay_loss"] / replay_tokens == pytest.approx(
        torch.stack(replay_nll).sum().item() / replay_tokens, rel=1e-5)
    for b0, p, g in zip(before, policy.parameters(), want, strict=True):
        assert torch.allclose(b0 - p.detach(), g, atol=1e-5, rtol=1e-4)


def _draw(objective: DpoObjective, data: TrainData, batch: int, accum: int) -> Queued:
    """The first ``accum`` micro-batches of the objective's loader, as a loader."""
    return Queued(objective.make_loader(data, SEQ, batch, 0, CPU, True), accum)


class Queued:
    """A loader handing out batches drawn beforehand from another one."""

    def __init__(self, loader: Any, n: int) -> None:
        self.shards = loader.shards
        self.queue = [loader.next_batch() for _ in range(n)]

    def __iter__(self):
        return iter(self.queue)

    def next_batch(self) -> tuple[torch.Tensor, ...]:
        return self.queue.pop(0)


def run_with_replay(pair_data: Path, pretraining: Path, ckpt_dir: Path, logs: list[str],
                    **kw: Any) -> Any:
    params = dpo_params(seed=7, replay=0.25, replay_weight=0.5, **kw)
    data = replay_data(pair_data, pretraining, params.train.replay)
    ref = tiny_model(data.train.vocab_size, 7).requires_grad_(False).eval()
    data.objective = DpoObjective.from_config(params.train, ref, len(data.train.doc_ends),
                                              len(data.val.doc_ends))
    return train(params, data, ckpt_dir, "t" * 64, CPU, track=False, log=logs.append,
                 stage="dpo")


def test_a_run_with_replay_logs_its_loss_and_resumes_bit_identical(pair_data, pretraining,
                                                                   tmp_path):
    logs: list[str] = []
    result = run_with_replay(pair_data, pretraining, tmp_path / "ck", logs)
    first = result.history[0]
    # The replay loss is its own figure, a mean per replay token (near log(vocab) for
    # random tokens), beside every DPO figure; its denominator is not logged.
    assert 0 < first["replay_loss"] < 2 * math.log(ShardSet(pretraining).vocab_size)
    assert "replay_tokens" not in first and "reward_accuracy" in first
    assert any("| replay_loss" in line for line in logs)
    assert result.metrics["val_reward_accuracy"] > 0.9
    run_dir = tmp_path / "ck" / runs.run_id(result.fingerprint)
    state = torch.load(run_dir / "step-000008.pt", weights_only=True)
    assert state["ranks"][0]["loader"]["replay_rows"] == 8 * 4 // 4  # a quarter of the rows
    (run_dir / "step-000012.pt").unlink()
    resumed = run_with_replay(pair_data, pretraining, tmp_path / "ck", logs)
    assert any("resuming from" in line and "step-000008" in line for line in logs)
    assert_resumed_the_same(resumed, result)
    # Replay shards and their share are part of the run: a plain run is another one.
    plain = dpo_params(seed=7)
    assert ckpt.fingerprint_of(ckpt.run_identity(
        plain.model, plain.train, 1, {}, {}, "t" * 64)) != ckpt.fingerprint_of(
        ckpt.run_identity(plain.model, dataclasses.replace(plain.train, replay=0.25),
                          1, {}, {}, "t" * 64))


@pytest.mark.parametrize(("kind", "beta"), [("ipo", 0.5), ("dpop", 0.5), ("simpo", 2.0)])
def test_each_loss_trains_the_preference_through_the_loop(pair_data, tmp_path, kind, beta):
    data = open_shard_data(pair_data / "train", pair_data / "val")
    ref = tiny_model(data.train.vocab_size, 7).requires_grad_(False).eval()
    params = dpo_params(seed=7, loss=kind, beta=beta, eval_every=0, ckpt_every=100)
    data.objective = DpoObjective.from_config(params.train, None if kind == "simpo" else ref,
                                              len(data.train.doc_ends), len(data.val.doc_ends))
    result = train(params, data, tmp_path, "t" * 64, CPU, track=False, log=lambda _: None,
                   stage="dpo")
    m = result.metrics
    assert m["val_reward_accuracy"] > 0.9 and m["val_reward_margin"] > 0
    assert ("val_kl_per_token" in m) == (kind != "simpo")
    assert result.history[-1]["reward_margin"] > result.history[0]["reward_margin"]


# --------------------------------------------------------------------------- config, data

@pytest.mark.parametrize(("kw", "key"), [
    ({"loss": "kto"}, "dpo.loss"), ({"dpop_lambda": -1.0}, "dpo.dpop_lambda"),
    ({"simpo_gamma": -0.1}, "dpo.simpo_gamma"), ({"replay": 1.0}, "dpo.replay"),
    ({"replay": -0.1}, "dpo.replay"), ({"replay_weight": 0.0}, "dpo.replay_weight")])
def test_each_new_key_is_checked_in_one_line_naming_it(kw, key):
    with pytest.raises(ConfigError, match=f"^{key}: ") as e:
        DpoConfig(**kw).validate()
    assert "\n" not in str(e.value)
    if "loss" in kw:  # read from params.yaml: the same one line
        with pytest.raises(ConfigError, match="^dpo.loss: 'kto' is not one of sigmoid, ipo"):
            from_dict(DpoConfig, {"loss": "kto"}, "dpo.")


def test_the_defaults_are_todays_dpo_and_the_choices_match_the_docs():
    cfg = DpoConfig()
    assert (cfg.loss, cfg.replay, cfg.nll_weight) == ("sigmoid", 0.0, 0.0)
    import typing

    hints = typing.get_type_hints(DpoConfig)
    assert typing.get_args(hints["loss"]) == PREFERENCE_LOSSES
    docs = (Path(__file__).resolve().parents[1] / "docs" / "post-training.md").read_text()
    for kind in PREFERENCE_LOSSES:
        assert f"`{kind}`" in docs


def test_replay_shards_are_required_and_checked_against_the_tokenizer(pair_data, pretraining,
                                                                      chat_tokenizer,
                                                                      tmp_path):
    sha = ShardSet(pair_data / "train").tokenizer_sha256
    paths = DpoPaths(train_shards=pair_data / "train", val_shards=pair_data / "val",
                     replay_shards=pretraining, tokenizer=chat_tokenizer)
    assert open_dpo_data(paths, sha).replay is None  # no replay: never opened
    data = open_dpo_data(paths, sha, 0.25)
    assert data.replay_share == 0.25 and data.replay.num_tokens > 0
    missing = DpoPaths(train_shards=pair_data / "train", val_shards=pair_data / "val",
                       replay_shards=tmp_path / "none")
    with pytest.raises(InputError, match=r"none: no pretraining shards for dpo.replay"):
        open_dpo_data(missing, sha, 0.25)
    other = tmp_path / "other"
    write_shards(other, [[9, 10, 11] * 50], data.train.vocab_size, tokenizer_sha256="f" * 64)
    with pytest.raises(InputError, match="tokenized with tokenizer ffffffffffff"):
        open_dpo_data(DpoPaths(train_shards=pair_data / "train", val_shards=pair_data / "val",
                               replay_shards=other), sha, 0.25)


def test_the_summary_names_loss_and_replay_and_leaves_out_a_kl_it_lacks(tmp_path):
    from lmforge.summary import post_training_lines

    plain = {"mode": "full", "beta": 0.05, "steps": 70, "train_pairs": 4633,
             "val_reward_accuracy": 0.69, "val_kl_per_token": 1.7365, "wall_seconds": 124}
    (tmp_path / "dpo.json").write_text(json.dumps(plain), encoding="utf-8")
    # The line the demo has always printed (docs/results.md), at the defaults.
    assert post_training_lines(tmp_path) == [
        "dpo       full, beta 0.05, 70 steps, 4,633 pairs; val reward accuracy 0.690, "
        "KL to reference 1.7365/token, 124 s"]
    simpo = {**plain, "loss": "simpo", "beta": 2.0, "replay_row_share": 0.25}
    del simpo["val_kl_per_token"]
    (tmp_path / "dpo.json").write_text(json.dumps(simpo), encoding="utf-8")
    assert post_training_lines(tmp_path) == [
        "dpo       full, simpo loss, beta 2, 70 steps, 4,633 pairs, replay 0.25 of rows; "
        "val reward accuracy 0.690, 124 s"]
    # As make demo runs it, a module (a helper defined below its __main__ block was
    # missing there though every import found it).
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / "dpo.json").write_text(json.dumps(simpo), encoding="utf-8")
    src = str(Path(__file__).resolve().parents[1] / "src")
    done = subprocess.run([sys.executable, "-m", "lmforge.summary"], cwd=tmp_path,
                          capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": src})
    assert done.returncode == 0 and "simpo loss" in done.stdout, done.stderr


def test_the_checkpoints_command_counts_dpo_replay_shards_in_the_run_it_expects(
        pair_data, pretraining):
    """``lmforge checkpoints`` tells which run params.yaml trains: with dpo.replay that
    run's data includes the pretraining shards, as the loop's identity does."""
    from lmforge.train.checkpoints_cli import current_sft_identity

    manifest = json.loads((pretraining / "manifest.json").read_text(encoding="utf-8"))
    for share in (0.0, 0.25):
        params = Params(dpo=DpoConfig(replay=share))
        identity = current_sft_identity(params, pair_data, pretraining.parent,
                                        Path("no-tokenizer"), stage="dpo")
        if share:
            assert identity["data"][-1] == ckpt.manifest_digest(manifest)
            assert identity["train"]["replay"] == share
        assert len(identity["data"]) == (3 if share else 2)


def test_the_dpo_stage_trains_simpo_with_replay_and_says_so(pair_data, pretraining,
                                                            chat_tokenizer, tmp_path):
    """The stage end to end: replay shards opened, no reference, the recipe in
    metrics/dpo.json and the replay loss in plots/dpo.tsv."""
    from lmforge.model.saved import save_model
    from lmforge.tokenizer.files import tokenizer_sha256
    from lmforge.train.dpo import run_dpo_stage

    vocab = ShardSet(pair_data / "train").vocab_size
    save_model(tiny_model(vocab, 3), tmp_path / "base", chat_tokenizer,
               tokenizer_sha256=tokenizer_sha256(chat_tokenizer))
    paths = DpoPaths(train_shards=pair_data / "train", val_shards=pair_data / "val",
                     replay_shards=pretraining, tokenizer=chat_tokenizer,
                     checkpoints=tmp_path / "ck", final=tmp_path / "dpo",
                     metrics=tmp_path / "dpo.json", plots=tmp_path / "dpo.tsv",
                     val_plots=tmp_path / "dpo_val.tsv")
    cfg = DpoConfig(init_from=str(tmp_path / "base"), loss="simpo", beta=2.0, replay=0.25,
                    max_steps=4, micro_batch_size=4, warmup=1, log_every=2, eval_every=0,
                    eval_batches=1, ckpt_every=4, num_threads=1, compile=False, device="cpu")
    run_dpo_stage(Params(dpo=cfg), paths)
    metrics = json.loads(paths.metrics.read_text(encoding="utf-8"))
    assert (metrics["loss"], metrics["simpo_gamma"]) == ("simpo", 0.5)
    assert (metrics["replay_row_share"], metrics["replay_weight"]) == (0.25, 1.0)
    assert "val_kl_per_token" not in metrics and "dpop_lambda" not in metrics
    header, *rows = paths.plots.read_text(encoding="utf-8").splitlines()
    assert header.split("\t")[-1] == "replay_loss" and len(rows) == 2
    assert all(float(row.split("\t")[-1]) > 0 for row in rows)
    assert (paths.final / "model.safetensors").is_file()
