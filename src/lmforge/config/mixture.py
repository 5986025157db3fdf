"""The ``mix_sweep`` section: proxy experiments that choose ``mix.weights``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from lmforge.config.checks import key, non_negative, positive
from lmforge.errors import ConfigError


@dataclass
class MixSweepConfig:
    """``lmforge mix sweep`` / ``mix fit``: choose ``mix.weights`` by proxy experiments
    (RegMix, Data Mixing Laws). Read by those commands only, never by a stage."""

    proxies: int = 16
    seed: int = 0
    # Mixtures come from a Dirichlet around each domain's natural share (its share of the
    # text available for training), alpha = concentration x share: larger = nearer it.
    concentration: float = 3.0
    bounds: dict[str, list[float]] = field(default_factory=dict)  # domain: [min, max] share
    # A proxy is the model section with these keys replaced, trained max_steps steps of
    # micro_batch_size windows, and scored on evaluate.max_batches = eval_batches.
    proxy_model: dict[str, int] = field(default_factory=lambda: {
        "n_layer": 2, "n_head": 4, "n_embd": 128})
    max_steps: int = 150
    micro_batch_size: int = 8
    eval_batches: int = 32
    jobs: int = 1  # proxies run at once (dvc queue start -j)
    name: str = "mixsweep"  # experiment names: <name>-00, <name>-01, ...
    # What the chosen mixture minimises: "weighted" = the val bits-per-byte of the domains
    # weighted by objective_weights (empty = equally), the same weights for every proxy;
    # "target" = target_domain's bits-per-byte, no other domain's more than max_increase
    # (a fraction) above its value predicted for today's mix.weights.
    objective: Literal["weighted", "target"] = "weighted"
    objective_weights: dict[str, float] = field(default_factory=dict)
    target_domain: str | None = None
    max_increase: float = 0.02
    candidates: int = 100_000  # mixtures the fitted law scores
    top_k: int = 100  # the recommendation averages the best top_k of them (RegMix)
    # Below this held-out rank correlation the fit is reported, not recommended from.
    min_rank_corr: float = 0.6

    def validate(self) -> None:
        positive(self, "proxies", "max_steps", "micro_batch_size", "eval_batches", "jobs",
                  "candidates", "top_k", "concentration")
        non_negative(self, "max_increase")
        if self.objective == "target" and not self.target_domain:
            raise ConfigError(f"{key(self, 'target_domain')}: name the domain that objective: "
                              "target minimises")
        for domain, pair in self.bounds.items():
            if len(pair) != 2 or not 0 <= pair[0] <= pair[1] <= 1:
                raise ConfigError(f"{key(self, 'bounds')}.{domain}: {pair} must be [min, max] "
                                  "with 0 <= min <= max <= 1")
        if not -1 <= self.min_rank_corr <= 1:
            raise ConfigError(f"{key(self, 'min_rank_corr')}: {self.min_rank_corr} must be in "
                              "[-1, 1]")
