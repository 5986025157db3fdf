"""lmforge plan's compiled total (the plain loss fused by Inductor) and FSDP on one rank
(the root the only unit), checked by hand and against the peaks measured on an H200
(bench/results/gpu_h200/run2, issue 44)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from lmforge.config import ModelConfig
from lmforge.plan import Setup, plan
from lmforge.plan import memory as mem
from lmforge.plan import shapes as sh
from lmforge.plan.cli import format_table

REPO = Path(__file__).resolve().parents[1]
GPT2 = ModelConfig(n_layer=12, n_head=12, n_embd=768, seq_len=1024)
V = 50304


def test_compiled_plain_loss_keeps_the_16_bit_logits_and_their_gradient_only():
    s = Setup(GPT2, V, "bf16", fused_loss=False)
    tokens = 16 * GPT2.seq_len
    p = plan(s, 80.0, 16)
    for strategy in ("ddp", "fsdp"):
        saved = tokens * (12 * V - (2 * 2 * V + 4))  # fp32 passes gone, lse added
        assert p[strategy]["total"] - p[strategy]["total_compiled"] == saved
    fused = plan(dataclasses.replace(s, fused_loss=True), 80.0, 16)
    assert fused["ddp"]["total_compiled"] == fused["ddp"]["total"]  # nothing to fuse
    assert "total, compiled" in format_table(p, "GPT-2 small")
    assert "total, compiled" not in format_table(fused, "GPT-2 small")


def test_fsdp_on_one_rank_gathers_the_whole_model_as_one_unit():
    one = Setup(GPT2, V, "bf16", world=1)
    two = dataclasses.replace(one, world=2)
    P = sh.num_params(GPT2, V)
    assert mem.unsharded_params_bytes(one, "fsdp") == 2 * P
    assert mem.unsharded_grads_bytes(one, "fsdp") == (2 + 4) * P
    root, block = sh.root_params(GPT2, V), sh.block_params(GPT2)
    assert mem.unsharded_params_bytes(two, "fsdp") == 2 * (root + 2 * block)


@pytest.mark.parametrize("key,strategy", [("plain", "ddp"), ("fsdp", "fsdp")])
def test_the_compiled_plan_is_within_5_percent_of_the_h200s_peaks(key, strategy):
    doc = json.loads((REPO / "bench/results/gpu_h200/run2/bench_gpu_mfu.json").read_text())
    assert "plain loss" in doc[key]["how"]  # the probe took the plain loss there
    s = Setup(GPT2, doc["shape"]["vocab"], doc["precision"], fused_loss=False)
    planned = plan(s, 80.0, doc["micro"])[strategy]["total_compiled"] / 2**20
    measured = doc[key]["peak_memory_mib"]
    assert abs(planned / measured - 1) < 0.05, (planned, measured)
    eager = plan(s, 80.0, doc["micro"])[strategy]["total"] / 2**20
    assert eager / measured > 1.4  # what the eager plan said: half again too much
