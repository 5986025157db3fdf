"""DPO: preference records, packed pair rows, the loss, the reference cache, a run."""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lmforge.config import DpoConfig, DpoDataConfig, ModelConfig, Params
from lmforge.errors import ConfigError
from lmforge.evaluate.preferences import pair_logps, preference_scores, read_pairs
from lmforge.finetune.build_pairs import build_pairs
from lmforge.finetune.preferences import render_response
from lmforge.model import Llama
from lmforge.model.loss import IGNORE_INDEX
from lmforge.shards.loader import ShardSet, eval_batches
from lmforge.tokenizer import Tokenizer
from lmforge.train import runs
from lmforge.train.distributed import DistEnv
from lmforge.train.loop import TrainData, open_shard_data, train
from lmforge.train.preference import (
    DpoObjective,
    PairLoader,
    dpo_loss,
    sequence_logps,
    split_pairs,
)

CPU = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
SEQ = 96


def lines(*objs) -> bytes:
    return "\r\n".join(json.dumps(o, ensure_ascii=False) for o in objs).encode() + b"\r\n"


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def reply(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


@pytest.fixture(scope="module")
def tokenizer(chat_tokenizer) -> Path:
    return chat_tokenizer


def good_pairs(n: int) -> list[dict]:
    """Learnable pairs: the chosen reply always says "yes", the rejected one "no"."""
    return [{"prompt": user(f"question {i}"), "chosen": reply(f"yes {i}"),
             "rejected": reply(f"no {i} no")} for i in range(n)]


@pytest.fixture(scope="module")
def pair_data(tokenizer, tmp_path_factory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("pairs")
    (root / "p.jsonl").write_bytes(lines(*good_pairs(160)))
    cfg = DpoDataConfig(sources=[str(root / "p.jsonl")], seq_len=SEQ, val_fraction=0.2)
    return root / "dpo", build_pairs(cfg, tokenizer, root / "dpo")


def test_every_shape_is_read_and_every_bad_record_counted(tokenizer, tmp_path):
    good = [rec for i in range(8) for rec in (
        {"prompt": f"plain string prompt {i}", "chosen": "good", "rejected": "bad"},
        {"prompt": [*user(f"first {i}"), *reply("earlier answer"), *user("second")],
         "chosen": reply("good two"), "rejected": reply("bad two")},
        # TRL's implicit prompt: two whole conversations sharing their first turns.
        {"chosen": [*user(f"shared {i}"), *reply("good three")],
         "rejected": [*user(f"shared {i}"), *reply("bad three")]})]
    bad = [{"prompt": "p", "chosen": "same", "rejected": "same"},          # identical_pair
           {"prompt": "p", "chosen": "x"},                                 # unknown_format
           {"prompt": "p", "chosen": "", "rejected": "y"},                 # empty_assistant
           {"prompt": "p", "chosen": [{"role": "robot", "content": "x"}],  # bad_role
            "rejected": "y"},
           {"prompt": "long " * 300, "chosen": "a", "rejected": "b"}]      # too_long
    with gzip.open(tmp_path / "p.jsonl.gz", "wb") as f:
        f.write(b"\xef\xbb\xbf" + lines(*good, *bad))  # BOM and CRLF, as other tools write
    m = build_pairs(DpoDataConfig(sources=[str(tmp_path / "*.gz")], seq_len=SEQ,
                                  val_fraction=0.25), tokenizer, tmp_path / "dpo")
    c = m["counts"]
    assert c["in"] == 29 and c["kept"] == 24
    assert set(c["rejected"]) == {"identical_pair", "unknown_format", "empty_assistant",
                                  "bad_role", "too_long"}
    assert all(r.startswith(f"rejected {tmp_path}/p.jsonl.gz:") for r in m["first_rejects"])
    assert m["train"]["pairs"] + m["val"]["pairs"] == 24

    tok = Tokenizer.load(tokenizer)
    shards = ShardSet(tmp_path / "dpo" / "train")
    scored = {}
    for batch in eval_batches(shards, SEQ, 64):
        for t, d in zip(batch["target"].flatten().tolist(), batch["doc"].flatten().tolist(),
                        strict=True):
            if t != IGNORE_INDEX:
                scored.setdefault(d, []).append(t)
    texts = {d: tok.decode([t for t in ids if t >= 8]) for d, ids in scored.items()}
    assert len(texts) == 2 * m["train"]["pairs"]  # every document scored: 2 per pair
    for d, text in texts.items():  # chosen = even documents, rejected = odd
        assert ("good" in text) == (d % 2 == 0) and ("bad" in text) == (d % 2 == 1), text
        # Prompt tokens never count, an assistant turn inside the prompt included.
        assert "earlier" not in text and "shared" not in text and "string" not in text


def test_response_mask_starts_after_the_prompt(tokenizer):
    tok = Tokenizer.load(tokenizer)
    prompt = (("user", "q"), ("assistant", "earlier"), ("user", "again"))
    ids, mask = render_response(prompt, (("assistant", "now"),), tok)
    scored = [i for i, m in zip(ids, mask, strict=True) if m]
    assert tok.decode([i for i in scored if i >= 8]) == "now" and sum(mask) == len(scored)


def test_sequence_logps_sum_response_targets_only():
    torch.manual_seed(0)
    logits = torch.randn(2, 6, 11)
    targets = torch.tensor([[IGNORE_INDEX, 3, 4, IGNORE_INDEX, 5, 6],
                            [IGNORE_INDEX, IGNORE_INDEX, 1, 2, IGNORE_INDEX, 7]])
    docs = torch.tensor([[0, 0, 0, 1, 1, 1], [2, 2, 2, 3, 3, 3]])
    ids, sums = sequence_logps(logits, targets, docs)
    logp = F.log_softmax(logits, -1)
    want = [logp[0, 1, 3] + logp[0, 2, 4], logp[0, 4, 5] + logp[0, 5, 6],
            logp[1, 2, 1], logp[1, 3, 2] + logp[1, 5, 7]]
    assert ids.tolist() == [0, 1, 2, 3]
    assert torch.allclose(sums, torch.stack(want), atol=1e-6)
    # Whatever the model says at prompt positions changes nothing.
    noisy = logits.clone()
    noisy[targets == IGNORE_INDEX] = torch.randn_like(noisy[targets == IGNORE_INDEX]) * 100
    assert torch.allclose(sequence_logps(noisy, targets, docs)[1], sums)
    pairs, c, r = split_pairs(ids, sums)
    assert pairs.tolist() == [0, 1] and torch.equal(c, sums[[0, 2]])
    with pytest.raises(ValueError, match="part of a pair"):
        split_pairs(ids[:3], sums[:3])


def tiny_model(vocab: int, seed: int = 0) -> Llama:
    torch.manual_seed(seed)
    return Llama(ModelConfig(n_layer=2, n_head=2, n_embd=32, seq_len=SEQ, doc_mask=True),
                 vocab)


def unpacked_logps(model: Llama, batch: list[torch.Tensor]) -> dict[int, torch.Tensor]:
    """Each document's response log-prob, run through the model on its own (no packing)."""
    inputs, targets, positions, docs = batch  # docs: the document of each *target*
    out = {}
    for d in torch.unique(docs[targets != IGNORE_INDEX]).tolist():
        row = int((docs == d).any(dim=1).nonzero()[0])
        cols = (docs[row] == d).nonzero().flatten()
        # The first such column's input is the previous document's last token, unless
        # the document opens the row.
        first = int(cols[0]) + (0 if positions[row, cols[0]] == 0 else 1)
        x = inputs[row, first:int(cols[-1]) + 1].unsqueeze(0)
        y = targets[row, first:int(cols[-1]) + 1].unsqueeze(0)
        logp = F.log_softmax(model(x).float(), -1)
        keep = y != IGNORE_INDEX
        out[d] = logp[0][keep[0]].gather(-1, y[keep].unsqueeze(-1)).sum()
    return out


def direct_terms(policy: Llama, ref_model: Llama, batch: list[torch.Tensor]
                 ) -> tuple[dict, dict, dict, list[int]]:
    """What a direct computation of a preference loss needs, every sequence run on its
    own: the policy's and the reference's response log-probs per document, each
    document's response length, and the pair numbers (documents 2p chosen, 2p+1 rejected)."""
    pol = unpacked_logps(policy, batch)
    with torch.no_grad():
        ref = unpacked_logps(ref_model, batch)
    targets, docs = batch[1], batch[3]
    length = {d: int(((docs == d) & (targets != IGNORE_INDEX)).sum()) for d in pol}
    return pol, ref, length, sorted({d // 2 for d in pol})


@pytest.mark.parametrize("nll_weight", [0.0, 0.5])
def test_dpo_loss_and_gradients_match_a_direct_computation(pair_data, tokenizer, nll_weight):
    directory, _ = pair_data
    shards = ShardSet(directory / "train")
    batch = list(PairLoader(shards, SEQ, 4, seed=0).next_batch())
    vocab = shards.vocab_size
    policy, ref_model = tiny_model(vocab, 0), tiny_model(vocab, 1)
    beta = 0.3
    objective = DpoObjective(beta, ref_model, len(shards.doc_ends), 1, nll_weight)
    loss, stats = objective.loss(policy, batch)
    grads = torch.autograd.grad(loss, list(policy.parameters()))

    # Direct: every sequence on its own, log-probs summed by hand, the paper's formula.
    # With nll_weight, plus that times the chosen reply's mean NLL per token (RPO).
    pol, ref, length, pairs = direct_terms(policy, ref_model, batch)
    terms = [-F.logsigmoid(beta * ((pol[2 * p] - ref[2 * p]) - (pol[2 * p + 1] - ref[2 * p + 1])))
             - nll_weight * pol[2 * p] / length[2 * p] for p in pairs]
    direct = torch.stack(terms).mean()
    direct_grads = torch.autograd.grad(direct, list(policy.parameters()))
    assert stats[0].item() == len(pairs) == objective.count(batch) > 1
    assert torch.allclose(loss, direct, atol=1e-5), (loss, direct)
    for g, h in zip(grads, direct_grads, strict=True):
        assert torch.allclose(g, h, atol=1e-5, rtol=1e-4)
    # dpo_loss itself, on plain numbers: -log sigmoid(beta * margin).
    losses, rc, rr = dpo_loss(torch.tensor([-3.0]), torch.tensor([-5.0]),
                              torch.tensor([-4.0]), torch.tensor([-4.0]), 0.5)
    assert math.isclose(losses.item(), math.log1p(math.exp(-0.5 * 2.0)), rel_tol=1e-6)
    assert rc.item() == pytest.approx(0.5) and rr.item() == pytest.approx(-0.5)


def test_the_reference_cache_gives_the_loss_recomputing_gives(pair_data):
    directory, _ = pair_data
    shards = ShardSet(directory / "train")
    loader = PairLoader(shards, SEQ, 4, seed=0)
    batches = [list(loader.next_batch()) for _ in range(3)]
    policy, ref_model = tiny_model(shards.vocab_size, 0), tiny_model(shards.vocab_size, 1)
    cached = DpoObjective(0.1, ref_model, len(shards.doc_ends), 1)
    first = [cached.loss(policy, b)[0].item() for b in batches]
    scored = int((~torch.isnan(cached.cache["train"])).sum())
    assert scored == sum(2 * cached.count(b) for b in batches)  # only the pairs seen

    class Refuses(torch.nn.Module):
        def forward(self, *a, **k):
            raise AssertionError("the reference ran again for a cached pair")

    cached.reference = Refuses()
    again = [cached.loss(policy, b)[0].item() for b in batches]
    fresh = DpoObjective(0.1, ref_model, len(shards.doc_ends), 1)
    recomputed = [fresh.loss(policy, b)[0].item() for b in reversed(batches)][::-1]
    assert again == first
    assert np.allclose(recomputed, first, rtol=0, atol=1e-6)


def dpo_params(**kw) -> Params:
    cfg = dict(max_steps=12, micro_batch_size=4, max_lr=3e-3, warmup=2, log_every=4,
               eval_every=6, eval_batches=0, ckpt_every=4, keep_last=3, num_threads=1,
               compile=False, beta=0.5, init_from=None)
    cfg.update(kw)
    return Params(model=ModelConfig(n_layer=2, n_head=2, n_embd=32, seq_len=SEQ,
                                    doc_mask=True),
                  train=DpoConfig(**cfg))


def run_dpo(directory: Path, ckpt_dir: Path, logs: list[str]) -> object:
    data: TrainData = open_shard_data(directory / "train", directory / "val")
    ref = tiny_model(data.train.vocab_size, 7)  # the policy starts from the same weights
    ref.requires_grad_(False)
    data.objective = DpoObjective(0.5, ref.eval(), len(data.train.doc_ends),
                                  len(data.val.doc_ends))
    params = dpo_params(seed=7)
    return train(params, data, ckpt_dir, "t" * 64, CPU, track=False, log=logs.append,
                 stage="dpo")


def test_a_dpo_run_learns_the_preference_logs_it_and_resumes_exactly(pair_data, tmp_path):
    directory, _ = pair_data
    logs: list[str] = []
    result = run_dpo(directory, tmp_path / "ck", logs)
    m = result.metrics
    assert m["val_reward_accuracy"] > 0.9 and m["val_loss"] < math.log(2)
    assert m["val_kl_per_token"] > 0 and m["val_reward_margin"] > 0
    first, last = result.history[0], result.history[-1]
    assert first["step"] == 4 and "reward_accuracy" in first and "logp_chosen" in first
    assert last["reward_margin"] > first["reward_margin"]
    assert any("| reward_accuracy" in line for line in logs)
    # Killed after step 8 and resumed: the reference cache comes back with the
    # checkpoint, and the run ends bit-identical to the unbroken one.
    run_dir = tmp_path / "ck" / runs.run_id(result.fingerprint)
    state = torch.load(run_dir / "step-000008.pt", weights_only=True)
    cache = state["ranks"][0]["objective"]["train"]
    assert 0 < int((~torch.isnan(cache)).sum()) <= len(cache)
    (run_dir / "step-000012.pt").unlink()
    resumed = run_dpo(directory, tmp_path / "ck", logs)
    assert any("resuming from" in line and "step-000008" in line for line in logs)
    assert_resumed_the_same(resumed, result)


def assert_resumed_the_same(resumed, straight) -> None:
    """A resumed run ended as the unbroken one: every weight, every logged figure but
    the wall-clock speed."""
    for name, tensor in straight.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[name], tensor), name

    def figures(history: list[dict]) -> list[dict]:
        return [{k: v for k, v in row.items() if k != "tokens_per_sec"} for row in history]

    assert figures(resumed.history) == figures(straight.history)


def test_beta_must_be_positive_and_init_from_given():
    with pytest.raises(ConfigError, match="dpo.beta"):
        DpoConfig(beta=0.0).validate()
    with pytest.raises(ConfigError, match="dpo.init_from"):
        DpoConfig(init_from=None).validate()
    with pytest.raises(ConfigError, match="dpo.nll_weight"):
        DpoConfig(nll_weight=-1.0).validate()


def test_preference_scores_of_models_and_against_a_reference(tokenizer, tmp_path):
    logps = {"sft": np.array([[-5.0, -4.0], [-3.0, -6.0], [-2.0, -2.0], [-9.0, -1.0]]),
             "dpo": np.array([[-4.0, -6.0], [-3.0, -7.0], [-2.5, -2.0], [-8.0, -1.5]])}
    s = preference_scores(logps, ["a", "a", "b", "b"], {"dpo": "sft"})
    assert s["sft"]["overall"]["pref_accuracy"] == 0.25  # a tie is not a preference
    assert s["dpo"]["overall"]["pref_accuracy"] == 0.5
    # Reward margins vs sft: (1 - -2) = 3, (0 - -1) = 1, (-0.5 - 0) < 0, (1 - -0.5) > 0.
    assert s["dpo"]["overall"]["reward_accuracy"] == 0.75
    assert s["dpo"]["tasks"]["b"]["n"] == 2 and "reward_accuracy" not in s["sft"]["overall"]
    # pair_logps scores each reply after its prompt, as the assistant turn.
    (tmp_path / "t.jsonl").write_bytes(lines(*good_pairs(3)))
    pairs, tasks = read_pairs(tmp_path / "t.jsonl")
    tok = Tokenizer.load(tokenizer)
    model = tiny_model(tok.vocab_size)
    lp = pair_logps(model, tok, pairs, batch_size=2)
    ids, mask = render_response(pairs[0].prompt, pairs[0].chosen, tok)
    with torch.no_grad():
        logp = F.log_softmax(model(torch.tensor([ids[:-1]])), -1)[0]
    want = sum(logp[i - 1, ids[i]].item() for i in range(len(ids)) if mask[i])
    assert tasks == ["all"] * 3 and lp.shape == (3, 2)
    assert lp[0, 0] == pytest.approx(want, abs=1e-4)
