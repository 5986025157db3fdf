"""Advice for the loss guard that works the first time.

When the filter cuts a domain too far, it has judged every step on each rejected
document (not only the first that failed): every rule, and the steps after the rules,
the language check (``filter.languages``) and the PII step (``filter.pii: drop``). A
document comes back only when every step that rejects it is changed: a rule skipped,
its language added, PII redacted instead of dropped. From those reasons the exact
smallest set of changes that keeps the domain within ``max_loss`` and ``min_docs`` is
found; and every kind is run on a sample of the domain's documents, with the language
and PII steps too, so a kind that fits better is proposed with the share it keeps (and
the languages or PII setting it needs as well).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from lmforge.config import DomainFilterConfig, FilterConfig
from lmforge.data import langid, pii
from lmforge.data.filters import domain_rules
from lmforge.data.kinds import KINDS
from lmforge.data.records import list_parts, read_table

# Documents per domain the kinds are tried on (the first ones, in input order).
KIND_SAMPLE = 5000
# Beyond this many distinct reasons, the smallest set of changes is found greedily.
_EXACT_RULES = 14
# The reasons of the steps after the rules (the filter counts its rejects under them):
# a document in a language ``filter.languages`` leaves out, and one ``pii: drop`` drops.
# In a rejected document's reasons the language one carries the code: ``language:zh``.
LANGUAGE_RULE = "language"
PII_RULE = "pii"


def step_reasons(settings: dict[str, Any], text: str, lang: str) -> tuple[str, ...]:
    """The steps after the rules that reject ``text`` (of language ``lang``) whatever the
    rules say: ``language:<code>`` when ``languages`` leaves it out, ``pii`` when
    ``pii: drop`` finds personal data in it."""
    out = []
    wanted = settings["languages"]
    if wanted and lang not in wanted:
        out.append(f"{LANGUAGE_RULE}:{lang}")
    if settings["pii"] == "drop" and pii.find(text, settings["pii_kinds"]):
        out.append(PII_RULE)
    return tuple(out)


def is_rule(reason: str) -> bool:
    """Whether a reason is a quality rule's name (not the language or PII step)."""
    return reason != PII_RULE and not reason.startswith(LANGUAGE_RULE + ":")


def step_counts(failures: Counter) -> Counter:
    """Rejected documents per step after the rules (``language``, ``pii``) rejecting them."""
    out: Counter = Counter()
    for reasons, n in failures.items():
        out.update({r.split(":", 1)[0]: n for r in reasons if not is_rule(r)})
    return out


def allowed_loss(n_in: int, max_loss: float, min_docs: int) -> int:
    """The fewest documents a domain of ``n_in`` must keep to pass the guard."""
    return max(n_in - math.floor(max_loss * n_in + 1e-9), min_docs)


def kept_with_skip(failures: Counter, skip: Iterable[str]) -> int:
    """Rejected documents that changing ``skip`` keeps: those rejected only for them."""
    s = set(skip)
    return sum(n for rules, n in failures.items() if set(rules) <= s)


def smallest_skip(failures: Counter, kept: int, need: int) -> tuple[list[str], int] | None:
    """(the fewest reasons to change, documents kept then) to keep at least ``need``;
    among equally short lists the one keeping most. None when no such list is enough
    (``failures`` has every rejected document that can come back, with every reason)."""
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
    chosen: list[str] = []  # greedy: add the reason that keeps most, until enough
    while kept + kept_with_skip(failures, chosen) < need:
        rest = [r for r in rules if r not in chosen]
        chosen.append(max(rest, key=lambda r: kept_with_skip(failures, [*chosen, r])))
    return chosen, kept + kept_with_skip(failures, chosen)


def changes_text(where: str, settings: dict[str, Any], reasons: Iterable[str]) -> str:
    """``reasons`` as the settings that give their documents back, joined by ' and ':
    ``<where>.skip: [...]``, ``<where>.languages: [...]``, ``<where>.pii: redact``."""
    reasons = list(reasons)
    rules = [r for r in reasons if is_rule(r)]
    langs = [r.split(":", 1)[1] for r in reasons if r.startswith(LANGUAGE_RULE + ":")]
    parts = []
    if rules:
        parts.append(f"{where}.skip: [{', '.join(sorted(set(settings['skip']) | set(rules)))}]")
    if langs:
        parts.append(f"{where}.languages: [{', '.join([*settings['languages'], *langs])}]")
    if PII_RULE in reasons:  # redact keeps the documents and still hides the data
        parts.append(f"{where}.pii: redact")
    return " and ".join(parts)


def with_kind(cfg: FilterConfig, domain: str, kind: str) -> FilterConfig:
    """``cfg`` with ``domain`` set to ``kind`` (its other overrides kept)."""
    override = cfg.domains.get(domain) or DomainFilterConfig()
    domains = {**cfg.domains, domain: dataclasses.replace(override, kind=kind)}
    return dataclasses.replace(cfg, domains=domains)


def kind_verdicts(cfg: FilterConfig, domain: str,
                  texts: list[str]) -> dict[str, tuple[int, Counter]]:
    """Kind -> (texts it keeps, the step reasons of the texts its rules pass but the
    language or PII step rejects), for every kind, the current one too. A text the
    kind's rules reject is in neither: only another kind gives it back."""
    settings = domain_rules(cfg, domain).settings
    # The steps after the rules do not depend on the kind: judged once per text.
    lang_needed = bool(settings["languages"])
    steps = [step_reasons(settings, t, langid.language(t) if lang_needed else "")
             for t in texts]
    out = {}
    for kind in KINDS:
        rules = domain_rules(with_kind(cfg, domain, kind), domain)
        passed = Counter(s for t, s in zip(texts, steps, strict=True)
                         if rules.first_failure(t) is None)
        out[kind] = (passed.pop((), 0), passed)
    return out


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


def kind_option(cfg: FilterConfig, domain: str, c: dict,
                verdicts: dict[str, tuple[int, Counter]], n_sample: int) -> str | None:
    """The kind that keeps the domain above the guard on the sample with the fewest
    other changes (languages, PII), with the share it keeps; None when none does, or
    when the current kind needs no more changes than it (the kind is not the cause)."""
    s = domain_rules(cfg, domain).settings
    # min_docs scaled to the sample: on a whole domain it is min_docs itself.
    min_docs = math.ceil(s["min_docs"] * n_sample / c["in"]) if c["in"] else 0
    need = allowed_loss(n_sample, s["max_loss"], min_docs)
    fits = {}
    for kind, (kept, steps) in verdicts.items():
        found = ([], kept) if kept >= need else smallest_skip(steps, kept, need)
        if found is not None:
            fits[kind] = found
    # Fewest extra changes, then most kept; ties in the order the advice always had.
    others = sorted(((len(fits[k][0]), -fits[k][1], k) for k in sorted(fits, reverse=True)
                     if k != s["kind"]), key=lambda t: t[:2])
    if not others or (s["kind"] in fits and len(fits[s["kind"]][0]) <= others[0][0]):
        return None
    best = others[0][2]
    extra = fits[best][0]

    def share(kind: str) -> float:  # with the same languages / PII changes
        kept, steps = verdicts[kind]
        return (kept + kept_with_skip(steps, extra)) / n_sample

    also = ", ".join([f"{k} {share(k):.0%}" for _, _, k in others[1:] if fits[k][0] == extra][:2])
    where = f"filter.domains.{domain}"
    with_extra = f" and {changes_text(where, s, extra)}" if extra else ""
    of = f"its {n_sample:,}" if n_sample >= c["in"] else f"the first {n_sample:,}"
    return (f"{where}.kind: {best}{with_extra} (keeps {share(best):.0%} of {of} documents"
            f"{'; also passing: ' + also if also else ''}; kind {s['kind']} keeps "
            f"{share(s['kind']):.0%})")


def advice(cfg: FilterConfig, domain: str, c: dict, failures: Counter | None,
           verdicts: dict[str, tuple[int, Counter]] | None, n_sample: int) -> str:
    """The changes that keep ``domain`` above the guard, each with the share it keeps:
    a better kind (measured on the first ``n_sample`` documents, ``verdicts`` from
    kind_verdicts) and the smallest set of changes (exact, from every step's verdict on
    the rejected documents: a skip list, languages to add, PII redacted)."""
    s = domain_rules(cfg, domain).settings
    options = []
    if verdicts and n_sample:
        found_kind = kind_option(cfg, domain, c, verdicts, n_sample)
        if found_kind:
            options.append(found_kind)
    if failures:
        found = smallest_skip(failures, c["kept"], allowed_loss(c["in"], s["max_loss"], s["min_docs"]))
        if found is not None:
            options.append(f"{changes_text(f'filter.domains.{domain}', s, found[0])} (keeps "
                           f"{found[1]:,} of {c['in']:,}, {found[1] / c['in']:.0%})")
    return " or ".join(options)
