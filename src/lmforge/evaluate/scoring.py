"""Score a split of token shards: loss, perplexity and bits-per-byte, overall and per domain.

Bits-per-byte is the headline: it divides the summed loss (in bits) by the UTF-8 bytes of
the text that produced the scored tokens, so it does not depend on the tokenizer and runs
with different vocabularies compare. Each token is charged the average bytes per token of
its domain (from the shard manifest); on a full pass this sums to the domain's bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from lmforge.shards.loader import ShardSet, eval_batches


@dataclass
class SplitScore:
    """Summed nats and counts, per domain; turned into metrics by ``as_dict``."""

    domain_names: list[str]
    bytes_per_token: list[float]
    nats: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.nats = [0.0] * len(self.domain_names)
        self.tokens = [0] * len(self.domain_names)

    def add(self, token_nats: torch.Tensor, domains: torch.Tensor) -> None:
        """Accumulate per-token losses (nats) grouped by domain code."""
        n = len(self.domain_names)
        nats = torch.bincount(domains, weights=token_nats.double(), minlength=n)
        counts = torch.bincount(domains, minlength=n)
        for d in range(n):
            self.nats[d] += float(nats[d])
            self.tokens[d] += int(counts[d])

    def as_dict(self) -> dict:
        """``{"loss", "perplexity", "bits_per_byte", "tokens", "domains": {...}}``."""
        def summary(nats: float, tokens: int, nbytes: float) -> dict:
            loss = nats / tokens if tokens else float("nan")
            return {
                "loss": loss,
                "perplexity": math.exp(loss) if tokens else float("nan"),
                "bits_per_byte": nats / math.log(2) / nbytes if nbytes else float("nan"),
                "tokens": tokens,
            }

        domains = {}
        for d, name in enumerate(self.domain_names):
            if self.tokens[d]:
                domains[name] = summary(self.nats[d], self.tokens[d],
                                        self.tokens[d] * self.bytes_per_token[d])
        total_bytes = sum(t * b for t, b in zip(self.tokens, self.bytes_per_token, strict=True))
        return summary(sum(self.nats), sum(self.tokens), total_bytes) | {"domains": domains}


def bytes_per_token(shards: ShardSet) -> list[float]:
    """Average UTF-8 bytes per token of each domain, from the shard manifest."""
    per_domain = shards.manifest["totals"]
    out = []
    for name in shards.domain_names:
        m = per_domain.get(name, {})
        out.append(m.get("bytes", 0) / m["tokens"] if m.get("tokens") else 0.0)
    return out


@torch.no_grad()
def score_split(model: torch.nn.Module, shards: ShardSet, seq_len: int, batch_size: int,
                max_batches: int = 0, device: str | torch.device = "cpu",
                autocast_dtype: torch.dtype | None = None) -> SplitScore:
    """A deterministic pass over ``shards`` (all of it when ``max_batches`` is 0)."""
    model.eval()
    score = SplitScore(shards.domain_names, bytes_per_token(shards))
    device = torch.device(device)
    # A model trained with document masking is scored with it too.
    doc_mask = bool(getattr(getattr(model, "config", None), "doc_mask", False))
    for batch in eval_batches(shards, seq_len, batch_size, max_batches=max_batches,
                              return_doc_info=doc_mask):
        x = batch["input"].to(device)
        y = batch["target"].to(device)
        extra = {"positions": batch["positions"].to(device)} if doc_mask else {}
        with torch.autocast(device.type, dtype=autocast_dtype or torch.float32,
                            enabled=autocast_dtype is not None):
            logits = model(x, **extra)
        logits = logits[0] if isinstance(logits, tuple) else logits
        nats = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="none",
                               ignore_index=-100)
        keep = y.flatten() != -100
        score.add(nats[keep].cpu(), batch["domain"].flatten()[keep.cpu()])
    return score
