"""All of params.yaml: one field per section, and the checks across sections."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from lmforge.config.checks import check, key, section_name
from lmforge.config.data import (
    DecontamConfig,
    DedupConfig,
    ExecutorConfig,
    FilterConfig,
    IngestConfig,
    MixConfig,
    ShardsConfig,
    TokenizerConfig,
)
from lmforge.config.evaluation import EvaluateConfig, EvaluatePostConfig, HarnessConfig
from lmforge.config.mixture import MixSweepConfig
from lmforge.config.model import ModelConfig
from lmforge.config.post_training import DpoConfig, DpoDataConfig, SftConfig, SftDataConfig
from lmforge.config.train import TrainConfig
from lmforge.errors import ConfigError


@dataclass
class Params:
    """All of params.yaml. Each stage validates the whole file but reads only its section."""

    ingest: IngestConfig = field(default_factory=IngestConfig)
    filter: FilterConfig = field(default_factory=FilterConfig)
    dedup: DedupConfig = field(default_factory=DedupConfig)
    decontam: DecontamConfig = field(default_factory=DecontamConfig)
    mix: MixConfig = field(default_factory=MixConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    shards: ShardsConfig = field(default_factory=ShardsConfig)
    executor: ExecutorConfig = field(default_factory=ExecutorConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    evaluate: EvaluateConfig = field(default_factory=EvaluateConfig)
    sft_data: SftDataConfig = field(default_factory=SftDataConfig)
    sft: SftConfig = field(default_factory=SftConfig)
    dpo_data: DpoDataConfig = field(default_factory=DpoDataConfig)
    dpo: DpoConfig = field(default_factory=DpoConfig)
    evaluate_post: EvaluatePostConfig = field(default_factory=EvaluatePostConfig)
    harness: HarnessConfig = field(default_factory=HarnessConfig)
    mix_sweep: MixSweepConfig = field(default_factory=MixSweepConfig)

    def validate(self) -> None:
        for f in dataclasses.fields(self):
            check(getattr(self, f.name), f.name)
        self._check_domains()

    def _check_domains(self) -> None:
        """Every section that names domains names those of ``ingest.sources``."""
        domains = {s.domain for s in self.ingest.sources}
        missing = sorted(domains - set(self.mix.weights))
        if missing:
            raise ConfigError(
                f"{key(self.mix, 'weights')}: no weight for domain(s) {', '.join(missing)} "
                f"({key(self.ingest, 'sources')} has {', '.join(sorted(domains))})"
            )
        unknown = sorted(set(self.mix.weights) - domains)
        if unknown:
            raise ConfigError(
                f"{key(self.mix, 'weights')}: domain(s) {', '.join(unknown)} appear in no ingest source"
            )
        sweep = self.mix_sweep
        named = {**sweep.bounds, **sweep.objective_weights,
                 **({sweep.target_domain: 0} if sweep.target_domain else {})}
        unknown = sorted(set(named) - domains)
        if unknown:
            raise ConfigError(
                f"{section_name(self.mix_sweep)}: domain(s) {', '.join(unknown)} appear in no ingest source")
        unknown = sorted(set(self.filter.domains) - domains)
        if unknown:
            raise ConfigError(
                f"{key(self.filter, 'domains')}: domain(s) {', '.join(unknown)} appear in no ingest source"
            )
