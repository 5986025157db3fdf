"""The training loop's section (``train``), the base of ``sft`` and ``dpo``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from lmforge.config.checks import (
    below_one,
    check_child,
    fraction,
    key,
    non_negative,
    positive,
)
from lmforge.config.model import LoraConfig
from lmforge.errors import ConfigError


@dataclass
class TrainConfig:
    max_steps: int = 1000
    micro_batch_size: int = 16
    grad_accum_steps: int = 1
    max_lr: float = 1e-3
    min_lr_ratio: float = 0.1
    # Warmup in optimizer steps; if < 1 it is a fraction of max_steps.
    warmup: float = 0.05
    schedule: Literal["cosine", "linear", "wsd"] = "cosine"
    # wsd only: the share of max_steps spent in the final decay.
    decay_fraction: float = 0.2
    weight_decay: float = 0.1
    decay_embeddings: bool = False
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    # true: the loss straight from the hidden states in cache-sized chunks, never building
    # the B x T x vocab logits (model/loss.py); false: plain lm_head + cross_entropy; auto:
    # chunked on CPU, on CUDA the fastest path that fits, by a timed probe (train/loss_choice.py).
    fused_loss: Literal["auto", True, False] = "auto"
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    device: str = "auto"
    # torch.compile the training step: auto = wherever Inductor can build (train/compiler.py).
    compile: Literal["auto", True, False] = "auto"
    activation_checkpointing: bool = False
    # Stop after this many consecutive non-finite steps.
    max_bad_steps: int = 5
    log_every: int = 10
    eval_every: int = 200
    eval_batches: int = 20
    sample_every: int = 0  # 0 = never during training
    # Prompts continued every sample_every steps (MLflow text artifacts); none = from BOS.
    sample_prompts: list[str] = field(default_factory=list)
    # Start from these weights instead of a random init (continued pretraining): a model
    # dir (models/final, `lmforge import hf` output) or a step-*.pt checkpoint.
    init_from: str | None = None
    # Run the quick self-check (10 batches, 2 optimizer steps) before training.
    self_check: bool = False
    # CUDA only: find the largest micro-batch that fits; accumulation keeps the global batch.
    probe_micro_batch: bool = False
    ckpt_every: int = 200
    light_every: int = 0  # model-only checkpoints; 0 = none
    keep_last: int = 2
    seed: int = 1337
    # Number of processes (torchrun --nproc_per_node); 1 = plain python.
    nproc: int = 1
    # With several processes: ddp (each rank holds the whole model and optimizer state)
    # or fsdp (FSDP2: both sharded over the ranks; lmforge.train.fsdp).
    strategy: Literal["ddp", "fsdp"] = "ddp"
    num_threads: int = 0  # torch intra-op threads on CPU; 0 = all cores
    # Train LoRA adapters on a frozen model instead of every weight (null = all weights).
    lora: LoraConfig | None = None
    # adamw, or muon: torch.optim.Muon on the blocks' 2-D weights (attention and MLP
    # matrices), AdamW (max_lr, betas, weight_decay above) on the rest (lmforge.train.optim).
    optimizer: Literal["adamw", "muon"] = "adamw"
    # Muon's peak learning rate, following the same schedule as max_lr.
    muon_lr: float = 0.02
    muon_momentum: float = 0.95  # Nesterov momentum
    # Decoupled: each step multiplies the weights by 1 - lr * muon_weight_decay.
    muon_weight_decay: float = 0.0
    # original: lr * sqrt(max(1, rows/cols)) (Keller Jordan's); match_rms_adamw:
    # lr * 0.2 * sqrt(max(rows, cols)) (Moonshot's; then muon_lr is an AdamW-sized rate).
    muon_adjust_lr: Literal["original", "match_rms_adamw"] = "original"
    # shuffled: windows in a seeded permutation (the mixture holds over the run); stratified:
    # every batch's domain shares follow the mixture too (lmforge.shards.loader).
    batch_sampling: Literal["shuffled", "stratified"] = "shuffled"

    def validate(self) -> None:
        check_child(self, "lora")
        self._check_optimizer()
        positive(self, "max_steps", "micro_batch_size", "grad_accum_steps", "log_every",
                  "eval_batches", "ckpt_every", "keep_last", "nproc", "max_bad_steps")
        non_negative(self, "eval_every", "sample_every", "light_every", "num_threads",
                      "weight_decay", "label_smoothing", "z_loss", "warmup")
        if not 0 < self.max_lr < 1:
            raise ConfigError(f"{key(self, 'max_lr')}: "
                              f"{self.max_lr} must be in (0, 1)")
        fraction(self, "min_lr_ratio", "decay_fraction")
        below_one(self, "beta1", "beta2")
        self._check_warmup()
        non_negative(self, "grad_clip")
        below_one(self, "label_smoothing")
        if self.strategy == "fsdp" and self.probe_micro_batch:
            # Each rank probes alone; under FSDP every forward is a collective.
            raise ConfigError(f"{key(self, 'probe_micro_batch')}: not with strategy fsdp "
                              "(every rank would probe alone); `lmforge plan` gives the "
                              "micro-batch that fits")

    def _check_optimizer(self) -> None:
        """Muon's own knobs, and the one strategy it does not support."""
        if not 0 < self.muon_lr < 1:
            raise ConfigError(f"{key(self, 'muon_lr')}: {self.muon_lr} must be in (0, 1)")
        below_one(self, "muon_momentum")
        non_negative(self, "muon_weight_decay")
        if self.optimizer == "muon" and self.strategy == "fsdp":
            # Newton-Schulz needs the whole matrix; on a row shard it would orthogonalise
            # each rank's rows alone: a silently different update.
            raise ConfigError(f"{key(self, 'optimizer')}: muon is not supported with "
                              f"{key(self, 'strategy')}: fsdp (Newton-Schulz needs whole "
                              "matrices); use strategy ddp or optimizer adamw")

    def _check_warmup(self) -> None:
        """The warmup must leave the decay at least one step (a run of one step has none
        and trains at the peak): a warmup that ends on the last step never decays."""
        steps, warmup = self.max_steps, self.warmup_steps()
        if warmup > steps or (steps > 1 and warmup == steps):
            given = (f"{self.warmup:g} of {steps} steps rounds to {warmup} steps" if
                     self.warmup < 1 else f"{warmup} steps")
            raise ConfigError(
                f"{key(self, 'warmup')}: {given}, which leaves no step of "
                f"{key(self, 'max_steps')}="
                f"{steps} to decay; warm up over at most {max(steps - 1, 1)} steps")

    def warmup_steps(self) -> int:
        """Warmup in optimizer steps (``warmup`` may be given as a fraction of max_steps)."""
        return int(round(self.warmup * self.max_steps)) if self.warmup < 1 else int(self.warmup)
