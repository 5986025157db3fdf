"""The quick self-check: passes on a sound setup, names the check that breaks."""

from __future__ import annotations

import argparse

import pytest
import torch
import torch.nn.functional as F
from test_train_loop import REPO, make_inputs, open_data, tiny_params

from lmforge.config import ModelConfig, Params
from lmforge.errors import LmforgeError
from lmforge.model import llama
from lmforge.train.cli import add_train_parser
from lmforge.train.selfcheck import self_check


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return make_inputs(tmp_path_factory.mktemp("selfcheck"))


def doc_params() -> Params:
    params = tiny_params()
    params.model = ModelConfig(n_layer=2, n_head=4, n_embd=64, seq_len=32, doc_mask=True)
    return params


@pytest.mark.parametrize("make_params", [tiny_params, doc_params])
def test_self_check_passes_on_a_sound_setup(inputs, make_params):
    report = self_check(make_params(), open_data(inputs), "cpu")
    assert report.ok, report.table()
    names = [c.name for c in report.checks]
    assert {"batch shapes", "targets shifted", "initial loss", "ignore_index", "causal mask",
            "finite loss/grads", "two optimizer steps"} <= set(names)
    assert ("document mask" in names) == make_params().model.doc_mask
    assert all(c.seconds >= 0 for c in report.checks) and "FAIL" not in report.table()


def test_a_leaky_causal_mask_is_named(inputs, monkeypatch):
    real = F.scaled_dot_product_attention

    def leaky(q, k, v, attn_mask=None, is_causal=False, **kw):
        return real(q, k, v, **kw)  # attends to the future

    monkeypatch.setattr(llama.F, "scaled_dot_product_attention", leaky)
    report = self_check(tiny_params(), open_data(inputs), "cpu")
    assert not report.ok and report.failed.name == "causal mask"
    assert report.error_line().startswith("train self-check failed: causal mask:")
    assert report.checks[-1].name == "causal mask"  # it stops at the first failure


def test_a_bad_initialisation_is_named(inputs, monkeypatch):
    original = llama.Llama.reset_parameters

    def loud(self):
        original(self)
        with torch.no_grad():
            self.lm_head.weight.mul_(100.0)

    monkeypatch.setattr(llama.Llama, "reset_parameters", loud)
    report = self_check(tiny_params(), open_data(inputs), "cpu")
    assert report.failed.name == "initial loss" and "ln(vocab)" in report.failed.detail


def test_train_command_exits_with_one_line_naming_the_check(inputs, monkeypatch, capsys):
    import yaml

    from lmforge.cli import main as _  # noqa: F401  (the command line the lead wires up)

    root = inputs.train_shards.parents[2]
    params_file = root / "params.yaml"
    params = yaml.safe_load((REPO / "params.yaml").read_text(encoding="utf-8"))
    params["model"] = {"n_layer": 2, "n_head": 4, "n_embd": 64, "seq_len": 32}
    params["train"] = {"micro_batch_size": 4, "max_lr": 3e-3, "warmup": 3}
    params_file.write_text(yaml.safe_dump(params), encoding="utf-8")
    monkeypatch.chdir(root)
    parser = argparse.ArgumentParser()
    add_train_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["train", "--self-check", "--params", str(params_file)])
    args.func(args)
    assert "two optimizer steps" in capsys.readouterr().out

    monkeypatch.setattr(llama, "linear_cross_entropy", lambda x, *a: x.sum() * float("nan"))
    with pytest.raises(LmforgeError, match=r"^train self-check failed: initial loss"):
        args.func(args)


def test_an_optimizer_step_dearer_than_forward_and_backward_is_said_in_one_line(
        inputs, monkeypatch):
    """The self-check times a forward+backward and an optimizer step apart and warns
    (passes, marked warn) when the step costs more: Muon's bf16 Newton-Schulz on a CPU
    without bf16 units was 9x its forward+backward."""
    import time

    from lmforge.train import selfcheck

    real = selfcheck.build_optimizer

    def slow(*args, **kwargs):
        opt = real(*args, **kwargs)
        step = opt.step
        opt.step = lambda: (time.sleep(0.3), step())[1]  # ~100x the tiny model's pass
        return opt

    params = tiny_params(optimizer="muon")
    fast = self_check(params, open_data(inputs), "cpu")
    cost = next(c for c in fast.checks if c.name == "optimizer step cost")
    assert cost.ok and "forward+backward" in cost.detail
    monkeypatch.setattr(selfcheck, "build_optimizer", slow)
    report = self_check(params, open_data(inputs), "cpu")
    assert report.ok and report.checks[-1].warn
    (line,) = report.warnings()
    assert line.startswith("train self-check: optimizer step cost: optimizer step 0.3")
    assert "train.optimizer: adamw" in line and "\n" not in line
    assert " warn " in report.table()
