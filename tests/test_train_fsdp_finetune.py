"""strategy: fsdp for fine-tuning under two gloo ranks on CPU: LoRA on a warm-started
model and DPO with a sharded reference (with and without pretraining replay) follow the
DDP trajectory, and the model handed on is the whole one (adapters included) that DDP
hands on."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from chat_tokenizer import train as train_tokenizer
from safetensors.torch import load_file
from test_dpo import SEQ, good_pairs, lines
from test_train_loop import start_ranks, wait_ranks

from lmforge.config import DpoDataConfig, ModelConfig
from lmforge.finetune.build_pairs import build_pairs
from lmforge.model import Llama
from lmforge.model.saved import save_model
from lmforge.shards.loader import ShardSet
from lmforge.shards.writer import write_shards

pytestmark = pytest.mark.slow

# One run of the loop on the packed pairs, as each rank runs it. argv: strategy, mode
# (sft-lora: next-token loss on the responses, LoRA on the warm-started model; dpo: the
# full model against a frozen reference; dpo-replay: the same with a quarter of the rows
# from pretraining shards), output directory.
_RUN = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    import torch
    from lmforge.config import DpoConfig, LoraConfig, ModelConfig, Params
    from lmforge.model.lora import lora_modules, merge_lora
    from lmforge.model.saved import load_model
    from lmforge.shards.loader import ShardSet
    from lmforge.train.distributed import setup, teardown
    from lmforge.train.dpo import make_objective
    from lmforge.train.fsdp import is_sharded
    from lmforge.train.loop import open_shard_data, train

    strategy, mode, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    env = setup("cpu", 1)
    data = open_shard_data("pairs/train", "pairs/val")
    lora = LoraConfig(rank=4, alpha=8.0, targets=["attn", "w2"]) if mode == "sft-lora" else None
    cfg = DpoConfig(max_steps=8, micro_batch_size=4, max_lr=3e-3, warmup=2, log_every=1,
                    eval_every=4, eval_batches=0, ckpt_every=4, keep_last=2, num_threads=1,
                    compile=False, beta=0.5, init_from="base", strategy=strategy, lora=lora,
                    seed=3, replay=0.25 if mode == "dpo-replay" else 0.0)
    params = Params(model=load_model("base")[0].config, train=cfg, dpo=cfg)
    if cfg.replay:
        data.replay, data.replay_share = ShardSet("shards/train"), cfg.replay
    if mode != "sft-lora":  # the stage's reference: under fsdp built sharded from base's rows
        data.objective = make_objective(params, params, data, env)
        assert is_sharded(data.objective.reference) == (strategy == "fsdp")
    result = train(params, data, out / "checkpoints", "t" * 64, env, track=False)
    if env.is_main:
        adapters = len(lora_modules(result.model))
        torch.save(merge_lora(result.model).state_dict(), out / "final.pt")
        (out / "result.json").write_text(json.dumps(
            {"history": result.history, "metrics": result.metrics, "adapters": adapters}))
    teardown()
""")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """Packed preference pairs and a base model to start from."""
    root = tmp_path_factory.mktemp("finetune")
    tokenizer = train_tokenizer(root / "tokenizer.model")
    (root / "p.jsonl").write_bytes(lines(*good_pairs(32)))
    build_pairs(DpoDataConfig(sources=[str(root / "p.jsonl")], seq_len=SEQ, val_fraction=0.2),
                tokenizer, root / "pairs")
    torch.manual_seed(11)
    base = Llama(ModelConfig(n_layer=2, n_head=2, n_embd=32, seq_len=SEQ, doc_mask=True),
                 ShardSet(root / "pairs" / "train").vocab_size)
    save_model(base, root / "base", tokenizer)
    rng = np.random.default_rng(2)  # pretraining documents for replay
    write_shards(root / "shards" / "train",
                 [[int(t) for t in rng.integers(8, base.vocab_size, 150)] for _ in range(20)],
                 base.vocab_size)
    (root / "run.py").write_text(_RUN, encoding="utf-8")
    return root


def run(workdir: Path, strategy: str, mode: str) -> tuple[dict, dict[str, torch.Tensor]]:
    out = workdir / f"{mode}-{strategy}"
    outs = wait_ranks(start_ranks(workdir, ["run.py", strategy, mode, str(out)]))
    assert f"x2 ({strategy})" in outs[0], outs[0]
    return (json.loads((out / "result.json").read_text()),
            torch.load(out / "final.pt", weights_only=True))


def assert_same_run(a: tuple[dict, dict], b: tuple[dict, dict], figures: tuple[str, ...]):
    (ra, wa), (rb, wb) = a, b
    assert [r["step"] for r in ra["history"]] == [r["step"] for r in rb["history"]]
    assert len(ra["history"]) == 8
    for row_a, row_b in zip(ra["history"], rb["history"], strict=True):
        for name in figures:
            if name in row_a:
                assert abs(row_a[name] - row_b[name]) < 1e-5, (name, row_a, row_b)
    for name in ("val_loss", "train_loss"):
        assert abs(ra["metrics"][name] - rb["metrics"][name]) < 1e-5, name
    assert ra["adapters"] == rb["adapters"]
    assert wa.keys() == wb.keys()
    for name in wa:
        assert torch.allclose(wa[name], wb[name], atol=1e-5), name


def test_lora_on_a_warm_started_model_follows_ddp(workdir):
    ddp, fsdp = run(workdir, "ddp", "sft-lora"), run(workdir, "fsdp", "sft-lora")
    assert_same_run(ddp, fsdp, ("loss", "grad_norm", "val_loss"))
    assert fsdp[0]["adapters"] == 2 * 5  # wq wk wv wo w2 in each of the two blocks
    # The adapters trained, the frozen base did not: the merged model differs from the
    # base in the adapted layers only.
    base, merged = load_file(workdir / "base" / "model.safetensors"), fsdp[1]
    changed = {name for name in base if not torch.equal(base[name], merged[name])}
    assert changed == {f"layers.{i}.{part}.weight" for i in range(2)
                       for part in ("attn.wq", "attn.wk", "attn.wv", "attn.wo", "mlp.w2")}


def test_dpo_with_a_sharded_reference_follows_ddp(workdir):
    ddp, fsdp = run(workdir, "ddp", "dpo"), run(workdir, "fsdp", "dpo")
    assert_same_run(ddp, fsdp, ("loss", "grad_norm", "reward_margin", "reward_accuracy",
                                "val_loss", "val_reward_accuracy", "val_kl_per_token"))
    assert fsdp[0]["metrics"]["val_kl_per_token"] > 0


def test_dpo_with_replay_under_fsdp_follows_ddp(workdir):
    """Replay rows on each rank, the step's pairs and replay tokens counted over both."""
    ddp, fsdp = run(workdir, "ddp", "dpo-replay"), run(workdir, "fsdp", "dpo-replay")
    assert_same_run(ddp, fsdp, ("loss", "grad_norm", "reward_margin", "replay_loss",
                                "val_loss", "val_kl_per_token"))
    assert all(row["replay_loss"] > 0 for row in fsdp[0]["history"])
