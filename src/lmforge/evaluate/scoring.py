"""Score a split of token shards: loss, perplexity and bits-per-byte, per domain and overall.

Bits-per-byte divides the summed loss (in bits) by the UTF-8 bytes of the text that
produced the scored tokens, so it does not depend on the tokenizer and runs with
different vocabularies compare. Each token is charged the average bytes per token of its
domain (from the shard manifest); on a full pass this sums to the domain's bytes.

Two overall figures, named after what they average over:

- ``mix_weighted`` (the headline): each domain's figure weighted by its share of the
  training mixture (its share of the train split's tokens for the loss, of its bytes for
  bits-per-byte). It is the loss on text drawn like the training data, so it compares
  with the training loss, and it does not move when the val split happens to hold more
  of one domain.
- ``token_weighted``: every scored token counts once, so domains weigh by their
  accidental share of the val split.

Per-domain figures carry a standard error from a bootstrap over documents (tokens of one
document are not independent, documents are), so a difference in ``dvc metrics diff``
can be told from noise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from lmforge.shards.loader import ShardSet, eval_batches, mixture_mean

BOOTSTRAP_SAMPLES = 1000
WEIGHTING = {
    "mix_weighted": "each domain's figure weighted by its share of the training mixture "
                    "(train split tokens for loss, train split bytes for bits_per_byte), "
                    "renormalised over the domains scored",
    "token_weighted": "every scored token counts once (domains weigh by their share of "
                      "the tokens scored)",
    "stderr": f"standard error from a bootstrap over documents ({BOOTSTRAP_SAMPLES} "
              "resamples per domain); the mixture's combines the domains' as independent",
}


@dataclass
class SplitScore:
    """Summed nats and token counts per document, grouped into domains by ``as_dict``."""

    domain_names: list[str]
    bytes_per_token: list[float]
    nats: dict[int, float] = field(default_factory=dict)  # per document
    tokens: dict[int, int] = field(default_factory=dict)
    doc_domain: dict[int, int] = field(default_factory=dict)

    def add(self, token_nats: torch.Tensor, domains: torch.Tensor,
            docs: torch.Tensor | None = None) -> None:
        """Accumulate per-token losses (nats) by document (by domain when docs are unknown)."""
        domains = domains.long()
        # Without document ids, a domain is its own single "document" (no error bar).
        keys = docs.long() if docs is not None else -1 - domains
        uniq, inverse = torch.unique(keys, return_inverse=True)
        nats = torch.zeros(len(uniq), dtype=torch.float64).index_add_(
            0, inverse, token_nats.double())
        counts = torch.bincount(inverse, minlength=len(uniq))
        first = torch.full((len(uniq),), len(keys), dtype=torch.long).scatter_reduce_(
            0, inverse, torch.arange(len(keys)), "amin")
        for k, n, c, d in zip(uniq.tolist(), nats.tolist(), counts.tolist(),
                              domains[first].tolist(), strict=True):
            self.nats[k] = self.nats.get(k, 0.0) + n
            self.tokens[k] = self.tokens.get(k, 0) + c
            self.doc_domain[k] = d

    def domain_arrays(self, d: int) -> tuple[np.ndarray, np.ndarray]:
        """(nats, tokens) per document of domain ``d``."""
        keys = [k for k, dom in self.doc_domain.items() if dom == d]
        return (np.array([self.nats[k] for k in keys], dtype=np.float64),
                np.array([self.tokens[k] for k in keys], dtype=np.float64))

    def as_dict(self, mixture: dict[str, dict[str, float]] | None = None) -> dict:
        """Per-domain figures and the token-weighted (and, given ``mixture``, the
        mixture-weighted) overall ones; see the module docstring."""
        domains = {}
        for d, name in enumerate(self.domain_names):
            nats, tokens = self.domain_arrays(d)
            if tokens.sum():
                domains[name] = domain_figures(nats, tokens, self.bytes_per_token[d], seed=d)
        total_nats = sum(self.nats.values())
        total_tokens = sum(self.tokens.values())
        total_bytes = sum(m["tokens"] * self.bytes_per_token[self.domain_names.index(n)]
                          for n, m in domains.items())
        out = {"token_weighted": summary(total_nats, total_tokens, total_bytes),
               "domains": domains}
        if mixture is not None:
            out["mix_weighted"] = mix_weighted(domains, mixture)
        return out


def summary(nats: float, tokens: int, nbytes: float) -> dict:
    """loss (nats/token), perplexity, bits_per_byte and the token count."""
    loss = nats / tokens if tokens else float("nan")
    return {
        "loss": loss,
        "perplexity": math.exp(loss) if tokens else float("nan"),
        "bits_per_byte": nats / math.log(2) / nbytes if nbytes else float("nan"),
        "tokens": int(tokens),
    }


def domain_figures(nats: np.ndarray, tokens: np.ndarray, bytes_per_token: float,
                   seed: int = 0) -> dict:
    """One domain's figures from its documents' summed nats and tokens, with stderr."""
    out = summary(float(nats.sum()), int(tokens.sum()), float(tokens.sum()) * bytes_per_token)
    se = bootstrap_stderr(nats, tokens, seed)
    out["loss_stderr"] = se
    out["bits_per_byte_stderr"] = (se / math.log(2) / bytes_per_token
                                   if bytes_per_token else float("nan"))
    out["docs"] = len(tokens)
    return out


def bootstrap_stderr(nats: np.ndarray, tokens: np.ndarray, seed: int = 0,
                     samples: int = BOOTSTRAP_SAMPLES) -> float:
    """Standard error of sum(nats)/sum(tokens) when the documents are resampled.

    NaN for a single document: one document says nothing about the spread.
    """
    n = len(tokens)
    if n < 2:
        return float("nan")
    rng = np.random.default_rng(seed)
    # Resamples in blocks, so memory stays at block x n whatever the number of documents.
    block = max(1, min(samples, 2**22 // n))
    ratios = []
    for start in range(0, samples, block):
        picks = rng.integers(0, n, size=(min(block, samples - start), n))
        ratios.append(nats[picks].sum(axis=1) / np.maximum(tokens[picks].sum(axis=1), 1))
    return float(np.concatenate(ratios).std(ddof=1))


def mix_weighted(domains: dict[str, dict], mixture: dict[str, dict[str, float]]) -> dict:
    """The domains' figures weighted like the training mixture (renormalised over the
    domains both scored and trained on); stderr combines the domains' independently."""
    wt = {d: m["tokens"] for d, m in mixture.items()}
    wb = {d: m["bytes"] for d, m in mixture.items()}

    def mean(key: str, w: dict[str, float]) -> float:
        return mixture_mean({d: f[key] for d, f in domains.items()}, w)

    def stderr(key: str, w: dict[str, float]) -> float:
        live = [d for d in domains if w.get(d, 0) > 0]
        total = sum(w[d] for d in live)
        if not total:
            return float("nan")
        return math.sqrt(sum((w[d] / total * domains[d][key]) ** 2 for d in live))

    loss = mean("loss", wt)
    return {"loss": loss, "perplexity": math.exp(loss) if math.isfinite(loss) else loss,
            "bits_per_byte": mean("bits_per_byte", wb),
            "loss_stderr": stderr("loss_stderr", wt),
            "bits_per_byte_stderr": stderr("bits_per_byte_stderr", wb)}


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
        keep = (y.flatten() != -100).cpu()
        score.add(nats.cpu()[keep], batch["domain"].flatten()[keep],
                  batch["doc"].flatten()[keep])
    return score
