"""Quality filtering of one document: the rules a domain runs, with thresholds resolved.

The rules live in ``rules_basic`` (the practice notes), ``rules_gopher``, ``rules_c4``
and ``rules_fineweb``. A domain's kind (``lmforge.data.kinds``) gives the rules that fit
its text and moves some thresholds; ``filter.rules`` narrows the set, ``skip`` takes
rules out, and ``filter.domains.<domain>`` overrides any setting for one domain. The
names alone are in ``rule_names``, which config validates against without importing
the rules.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from lmforge.config import FilterConfig
from lmforge.data import kinds, rules_basic, rules_c4, rules_code, rules_fineweb, rules_gopher  # noqa: F401 (register)
from lmforge.data.rule_names import unknown_rules
from lmforge.data.rulebook import RULES, Rule, groups
from lmforge.data.textview import TextView

__all__ = ["RULES", "DomainRules", "domain_rules", "expand_rules", "unknown_rules"]


def expand_rules(names: list[str]) -> list[str]:
    """Rule names with group names (``gopher_quality``, ``c4`` ...) replaced by their rules."""
    by_group = groups()
    out: list[str] = []
    for name in names:
        for r in by_group.get(name, [name]) if name not in RULES else [name]:
            if r not in out:
                out.append(r)
    return out


@dataclass(frozen=True)
class DomainRules:
    """The rules one domain runs and every filter setting, resolved for that domain."""

    rules: tuple[Rule, ...]
    settings: dict[str, Any]

    @property
    def limits(self) -> dict[str, Any]:
        """Each rule's threshold by key (None for yes/no rules)."""
        return {r.threshold: self.settings[r.threshold] for r in self.rules if r.threshold}

    def first_failure(self, text: str) -> tuple[str, float] | None:
        """(rule name, measured value) of the first rule that rejects ``text``, or None."""
        view = TextView(text)
        for r in self.rules:
            value = r.measure(view, self.settings)
            if r.fails(value, self.settings[r.threshold] if r.threshold else None):
                return r.name, float(value)
        return None

    def failures(self, text: str) -> tuple[str, ...]:
        """The names of every rule that rejects ``text``, in run order (the loss guard's
        advice needs them all, not only the first)."""
        view = TextView(text)
        out = []
        for r in self.rules:
            value = r.measure(view, self.settings)
            if r.fails(value, self.settings[r.threshold] if r.threshold else None):
                out.append(r.name)
        return tuple(out)


_DEFAULTS = FilterConfig()


def domain_rules(cfg: FilterConfig, domain: str) -> DomainRules:
    """Resolve the rules and settings of ``domain``.

    Rules: the domain's own ``rules`` list as given; otherwise its kind's rules, narrowed
    to ``filter.rules`` when that is set; then ``skip`` takes rules out. Settings: the
    domain's override, else the global value, except that a key still at its default
    takes the kind's value (``kinds.KIND_SETTINGS``).
    """
    override = cfg.domains.get(domain)
    given = {k: v for k, v in dataclasses.asdict(override).items() if v is not None} \
        if override is not None else {}
    kind = given.get("kind", cfg.kind)
    by_kind = kinds.KIND_SETTINGS[kind]
    settings: dict[str, Any] = {}
    for f in dataclasses.fields(cfg):
        if f.name in ("domains", "num_workers"):
            continue
        value = getattr(cfg, f.name)
        if f.name in by_kind and value == getattr(_DEFAULTS, f.name):
            value = by_kind[f.name]
        settings[f.name] = given.get(f.name, value)
    skipped = set(expand_rules(settings["skip"]))
    if "rules" in given:
        names = expand_rules(given["rules"])
    else:
        names = list(kinds.KIND_RULES[kind])
        if cfg.rules is not None:
            narrowed = set(expand_rules(cfg.rules))
            names = [n for n in names if n in narrowed]
    return DomainRules(tuple(RULES[n] for n in names if n not in skipped), settings)
