"""Evaluation sections: evaluate, evaluate_post and harness."""

from __future__ import annotations

from dataclasses import dataclass, field

from lmforge.config.checks import key, non_negative, positive
from lmforge.errors import ConfigError


@dataclass
class EvaluateConfig:
    # Val windows to score; 0 = a full pass over the val shards.
    max_batches: int = 0
    batch_size: int = 16
    # Windows of train data scored for the train/val gap.
    train_batches: int = 20
    prompts: list[str] = field(default_factory=lambda: ["It is a truth universally"])
    temperatures: list[float] = field(default_factory=lambda: [0.0, 0.8])
    max_new_tokens: int = 64
    top_k: int = 50
    seed: int = 7

    def validate(self) -> None:
        non_negative(self, "max_batches", "train_batches", "top_k")
        positive(self, "batch_size", "max_new_tokens")
        if not all(t >= 0 for t in self.temperatures):  # NaN fails this too
            raise ConfigError(f"{key(self, 'temperatures')}: temperatures must be numbers >= 0")
        if not all(self.prompts):
            raise ConfigError(f"{key(self, 'prompts')}: a prompt is empty")


@dataclass
class HarnessConfig:
    """lm-evaluation-harness on our models, offline, over task files shipped in the repo."""

    # lm-eval YAML task files over local JSONL (nothing is downloaded).
    task_dir: str = "data/tasks/demo"
    tasks: list[str] = field(default_factory=list)  # empty = every task in task_dir
    # Label -> model directory; each is exported to Hugging Face format and evaluated.
    models: dict[str, str] = field(default_factory=lambda: {
        "base": "models/final", "sft": "models/sft", "dpo": "models/dpo"})
    batch_size: int = 32
    limit: int = 0  # items per task; 0 = all
    device: str = "auto"

    def validate(self) -> None:
        positive(self, "batch_size")
        non_negative(self, "limit")
        if not self.models:
            raise ConfigError(f"{key(self, 'models')}: name at least one model directory")


@dataclass
class EvaluatePostConfig:
    """The evaluate_post stage: held-out tasks, forgetting, chat samples."""

    test: str = "data/instructions/demo/test.jsonl.gz"
    # Multiple-choice records (`choices`, `answer`); null = none.
    test_mc: str | None = "data/instructions/demo/test_mc.jsonl.gz"
    # Held-out preference pairs (prompt/chosen/rejected); null = none.
    test_pref: str | None = "data/preferences/demo/test.jsonl.gz"
    batch_size: int = 16
    # User messages answered by the base and the fine-tuned model in metrics/post_samples.md.
    prompts: list[str] = field(default_factory=lambda: ["Give the antonym of the adjective \"hot\"."])
    max_new_tokens: int = 48

    def validate(self) -> None:
        positive(self, "batch_size", "max_new_tokens")
