"""Post-training sections: the packed SFT and preference data, and the sft and dpo runs."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from lmforge.config.checks import below_one, key, non_negative, positive
from lmforge.config.train import TrainConfig
from lmforge.errors import ConfigError


@dataclass
class PackedDataConfig:
    """Records -> masked, packed token shards: what the sft_data and dpo_data sections
    share (each names its own default ``sources``)."""

    # JSON-lines files (globs) of the records.
    sources: list[str] = field(default_factory=list)
    # Packed row length: no example (no pair) crosses a row.
    seq_len: int = 256
    # Share of examples held out for the val figures during training (by a seeded hash).
    val_fraction: float = 0.05
    max_record_bytes: int = 64 * 1024 * 1024
    seed: int = 1234

    def validate(self) -> None:
        if not self.sources:
            raise ConfigError(f"{key(self, 'sources')}: give at least one file or glob")
        positive(self, "seq_len", "max_record_bytes")
        if not 0 < self.val_fraction < 0.5:
            raise ConfigError(f"{key(self, 'val_fraction')}: {self.val_fraction} must be in "
                              "(0, 0.5)")


@dataclass
class SftDataConfig(PackedDataConfig):
    """Instruction/chat records -> masked, packed token shards (the sft_data stage).

    ``sources``: chat ``messages``, Alpaca, or prompt/completion records; ``seq_len`` is
    the fine-tuning context.
    """

    sources: list[str] = field(
        default_factory=lambda: ["data/instructions/demo/train.jsonl.gz"])


@dataclass
class TuningConfig(TrainConfig):
    """What the sft and dpo sections share: the train loop's knobs, with the peak
    learning rate spelled ``lr`` (``max_lr`` in ``train``), a model to start from, and
    fine-tuning's defaults."""

    YAML_NAMES: ClassVar[dict[str, str]] = {"max_lr": "lr"}

    warmup: float = 0.1
    weight_decay: float = 0.0

    def validate(self) -> None:
        super().validate()
        if not self.init_from:
            default = next(f.default for f in dataclasses.fields(self) if f.name == "init_from")
            raise ConfigError(f"{key(self, 'init_from')}: name the model to start from (e.g. "
                              f"{default})")


@dataclass
class SftConfig(TuningConfig):
    """Supervised fine-tuning: the train loop's knobs, plus replay and document masking."""

    max_steps: int = 150
    max_lr: float = 1e-3
    # The model fine-tuning starts from (a model dir or a step-*.pt checkpoint).
    init_from: str | None = "models/final"
    # Share of each batch's rows drawn from the pretraining shards (the notes' 9:1 to
    # 7:3 is 0.1 to 0.3): general text keeps the model from forgetting it.
    replay: float = 0.0
    # Attention stops at example boundaries in packed rows (positions restart at 0).
    doc_mask: bool = True

    def validate(self) -> None:
        super().validate()
        below_one(self, "replay")


@dataclass
class DpoDataConfig(PackedDataConfig):
    """Preference pairs -> masked, packed token shards (the dpo_data stage).

    ``sources``: prompt/chosen/rejected records (TRL's shape: strings or message lists);
    bad records are rejected with a reason and counted. Each packed row holds whole
    pairs (chosen, then rejected).
    """

    sources: list[str] = field(
        default_factory=lambda: ["data/preferences/demo/train.jsonl.gz"])


# dpo.loss's choices, in the order the docs give them.
PREFERENCE_LOSSES: tuple[str, ...] = ("sigmoid", "ipo", "dpop", "simpo")


@dataclass
class DpoConfig(TuningConfig):
    """Direct preference optimisation: the train loop's knobs, plus beta, the preference
    loss and pretraining replay.

    The policy starts from ``init_from`` (the SFT model); the reference is that same
    model, frozen, its log-probabilities computed once per pair and cached (SimPO needs
    none). Defaults train today's DPO: ``loss: sigmoid``, no NLL term, no replay.
    """

    max_steps: int = 100
    max_lr: float = 5e-5
    init_from: str | None = "models/sft"
    # The KL penalty's strength: larger keeps the policy closer to the reference.
    # (Attention always restarts at each sequence of a packed row: a rejected response
    # must never see its pair's chosen one.)
    beta: float = 0.1
    # Weight of the chosen responses' NLL (per token) added to the loss: DPO + NLL, as
    # RPO (Pang et al. 2024) and Llama 3 use it; it keeps the likelihood of the preferred
    # answers from falling and the policy nearer its start. 0 = plain DPO.
    nll_weight: float = 0.0
    # The preference loss (lmforge.train.preference_losses): sigmoid (DPO), ipo (Azar et
    # al. 2023), dpop (DPO-Positive, Pal et al. 2024) or simpo (Meng et al. 2024:
    # reference-free, length-normalised; beta is its own scale there, ~2).
    loss: Literal["sigmoid", "ipo", "dpop", "simpo"] = "sigmoid"
    # dpop: the weight of the penalty when the chosen answer's log-prob falls below the
    # reference's (the paper's lambda).
    dpop_lambda: float = 50.0
    # simpo: the target margin gamma between the chosen and rejected rewards.
    simpo_gamma: float = 0.5
    # Share of each batch's rows drawn from the pretraining shards, as sft.replay; their
    # mean next-token loss, times replay_weight, is added to the preference loss (PPO-ptx
    # of InstructGPT, applied to DPO): it guards the text the forgetting figure measures.
    replay: float = 0.0
    # The replay rows' loss weight: the preference loss is per pair, the replay loss per
    # token, so the share of rows cannot set it as in sft.
    replay_weight: float = 1.0

    def validate(self) -> None:
        super().validate()
        if not self.beta > 0:
            raise ConfigError(f"{key(self, 'beta')}: {self.beta} must be > 0")
        if self.batch_sampling != "shuffled":
            raise ConfigError(f"{key(self, 'batch_sampling')}: only shuffled (preference pairs have "
                              "no domains to stratify)")
        if self.loss not in PREFERENCE_LOSSES:
            raise ConfigError(f"{key(self, 'loss')}: {self.loss!r} is not one of "
                              f"{', '.join(PREFERENCE_LOSSES)}")
        non_negative(self, "nll_weight", "dpop_lambda", "simpo_gamma")
        below_one(self, "replay")
        positive(self, "replay_weight")

    def identity_omits(self) -> set[str]:
        """Keys left out of a run's identity (``lmforge.train.checkpoint``): those that
        change nothing in this run -- a loss's own knob under another loss, the replay
        weight without replay -- and the loss and replay at the values every run had
        before they existed, so such a run still resumes."""
        omit = set()
        if self.loss == "sigmoid":
            omit.add("loss")
        if self.loss != "dpop":
            omit.add("dpop_lambda")
        if self.loss != "simpo":
            omit.add("simpo_gamma")
        if self.replay == 0:
            omit |= {"replay", "replay_weight"}
        return omit
