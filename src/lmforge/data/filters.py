"""Quality filtering of one document: the rules a domain runs, with thresholds resolved.

The rules live in ``rules_basic`` (the practice notes), ``rules_gopher``, ``rules_c4``
and ``rules_fineweb``; ``filter.rules`` names rules or whole groups of them, and
``filter.domains.<domain>`` overrides any setting for one domain. The names alone are
in ``rule_names``, which config validates against without importing the rules.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from lmforge.config import FilterConfig
from lmforge.data import rules_basic, rules_c4, rules_fineweb, rules_gopher  # noqa: F401 (register)
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


def domain_rules(cfg: FilterConfig, domain: str) -> DomainRules:
    """Resolve ``filter.domains.<domain>`` over the defaults.

    A domain of ``kind: code`` that inherits the default rule list drops the prose
    rules from it; one that lists its own rules gets exactly those.
    """
    override = cfg.domains.get(domain)
    given = {k: v for k, v in dataclasses.asdict(override).items() if v is not None} \
        if override is not None else {}
    settings = {f.name: given.get(f.name, getattr(cfg, f.name))
                for f in dataclasses.fields(cfg) if f.name != "domains"}
    skipped = set(expand_rules(settings["skip"]))
    names = [n for n in expand_rules(settings["rules"]) if n not in skipped]
    if settings["kind"] == "code" and "rules" not in given:
        names = [n for n in names if not RULES[n].prose]
    return DomainRules(tuple(RULES[n] for n in names), settings)
