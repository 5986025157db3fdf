"""Advice for the loss guard that works the first time.

When the rules cut a domain too far, the filter has judged every rule on each rejected
document (not only the first that failed): a document is kept back by skipping a set of
rules only when every rule it fails is in that set. From those failure sets the exact
smallest ``skip`` list that keeps the domain within ``max_loss`` and ``min_docs`` is
found; and every kind is run on a sample of the domain's documents, so a kind that fits
better is proposed with the share it keeps.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

from lmforge.config import DomainFilterConfig, FilterConfig
from lmforge.data.filters import domain_rules
from lmforge.data.kinds import KINDS
from lmforge.data.records import list_parts, read_table

# Documents per domain the kinds are tried on (the first ones, in input order).
KIND_SAMPLE = 5000
# Beyond this many distinct failing rules, the skip list is found greedily.
_EXACT_RULES = 14


def allowed_loss(n_in: int, max_loss: float, min_docs: int) -> int:
    """The fewest documents a domain of ``n_in`` must keep to pass the guard."""
    return max(n_in - math.floor(max_loss * n_in + 1e-9), min_docs)


def kept_with_skip(failures: Counter, skip: Iterable[str]) -> int:
    """Rejected documents that skipping ``skip`` keeps: those failing only those rules."""
    s = set(skip)
    return sum(n for rules, n in failures.items() if set(rules) <= s)


def smallest_skip(failures: Counter, kept: int, need: int) -> tuple[list[str], int] | None:
    """(the fewest rules to skip, documents kept then) to keep at least ``need``; among
    equally short lists the one keeping most. None when no skip list is enough (the
    documents the PII step dropped are not the rules' to give back)."""
    rules = sorted({r for sig in failures for r in sig})
    if kept + sum(failures.values()) < need:
        return None
    if len(rules) <= _EXACT_RULES:
        for size in range(1, len(rules) + 1):
            best = max(itertools.combinations(rules, size),
                       key=lambda c: (kept_with_skip(failures, c), [-rules.index(r) for r in c]))
            got = kept + kept_with_skip(failures, best)
            if got >= need:
                return list(best), got
        return None
    chosen: list[str] = []  # greedy: add the rule that keeps most, until enough
    while kept + kept_with_skip(failures, chosen) < need:
        rest = [r for r in rules if r not in chosen]
        chosen.append(max(rest, key=lambda r: kept_with_skip(failures, [*chosen, r])))
    return chosen, kept + kept_with_skip(failures, chosen)


def with_kind(cfg: FilterConfig, domain: str, kind: str) -> FilterConfig:
    """``cfg`` with ``domain`` set to ``kind`` (its other overrides kept)."""
    override = cfg.domains.get(domain) or DomainFilterConfig()
    domains = {**cfg.domains, domain: dataclasses.replace(override, kind=kind)}
    return dataclasses.replace(cfg, domains=domains)


def kind_shares(cfg: FilterConfig, domain: str, texts: list[str]) -> dict[str, float]:
    """Kind -> the share of ``texts`` its rules keep (every kind, the current one too)."""
    shares = {}
    for kind in KINDS:
        rules = domain_rules(with_kind(cfg, domain, kind), domain)
        kept = sum(rules.first_failure(t) is None for t in texts)
        shares[kind] = kept / len(texts) if texts else 0.0
    return shares


def domain_samples(in_dir: str | Path, domains: Iterable[str],
                   n: int = KIND_SAMPLE) -> dict[str, list[str]]:
    """The first ``n`` texts of each of ``domains`` in ``in_dir``'s parts."""
    want = set(domains)
    out: dict[str, list[str]] = {d: [] for d in want}
    for part in list_parts(in_dir):
        if not want:
            break
        cols = read_table(part).select(["text", "domain"]).to_pydict()
        for text, domain in zip(cols["text"], cols["domain"], strict=True):
            if domain in want:
                out[domain].append(text)
                if len(out[domain]) >= n:
                    want.discard(domain)
    return out


def advice(cfg: FilterConfig, domain: str, c: dict, failures: Counter | None,
           shares: dict[str, float] | None, n_sample: int) -> str:
    """The changes that keep ``domain`` above the guard, each with the share it keeps:
    a better kind (measured on the first ``n_sample`` documents) and the smallest skip
    list (exact, from every rule's verdict on the rejected documents)."""
    s = domain_rules(cfg, domain).settings
    where = f"filter.domains.{domain}"
    options = []
    if shares:
        need_share = allowed_loss(n_sample, s["max_loss"], 0) / n_sample if n_sample else 1.0
        fits = sorted(((v, k) for k, v in shares.items() if k != s["kind"] and v >= need_share),
                      reverse=True)
        if fits:
            of = f"its {n_sample:,}" if n_sample >= c["in"] else f"the first {n_sample:,}"
            also = "".join(f", {k} {v:.0%}" for v, k in fits[1:3])
            options.append(f"{where}.kind: {fits[0][1]} (keeps {fits[0][0]:.0%} of {of} "
                           f"documents{'; also passing: ' + also[2:] if also else ''}; kind "
                           f"{s['kind']} keeps {shares[s['kind']]:.0%})")
    if failures:
        found = smallest_skip(failures, c["kept"], allowed_loss(c["in"], s["max_loss"], s["min_docs"]))
        if found is not None:
            skip = sorted(set(s["skip"]) | set(found[0]))
            options.append(f"{where}.skip: [{', '.join(skip)}] (keeps {found[1]:,} of "
                           f"{c['in']:,}, {found[1] / c['in']:.0%})")
    return " or ".join(options)
