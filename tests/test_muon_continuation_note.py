"""The advice a run prints when a trained model's weights continue under Muon."""

from __future__ import annotations

import dataclasses

from lmforge.config import LoraConfig, TrainConfig
from lmforge.train.build import muon_continuation_note


def test_a_trained_model_under_muon_gets_one_line_of_advice():
    cfg = dataclasses.replace(TrainConfig(), init_from="models/base", optimizer="muon")
    note = muon_continuation_note(cfg)
    assert note is not None and "\n" not in note
    assert "models/base" in note and "train.optimizer: adamw" in note
    assert f"train.muon_lr {cfg.muon_lr:g}" in note


def test_no_advice_from_scratch_under_adamw_or_for_adapters():
    scratch = dataclasses.replace(TrainConfig(), init_from=None, optimizer="muon")
    adamw = dataclasses.replace(TrainConfig(), init_from="models/base", optimizer="adamw")
    lora = dataclasses.replace(TrainConfig(), init_from="models/base", optimizer="muon",
                               lora=LoraConfig(rank=8))
    assert [muon_continuation_note(c) for c in (scratch, adamw, lora)] == [None, None, None]
