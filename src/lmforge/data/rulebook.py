"""The registry of filter rules: a name, a measurement, a threshold key, a direction.

In the spirit of datatrove's filter blocks, but one rule measures one property, so
the metrics count rejections per rule and a user switches rules on and off by name.
A rule's measurement may return None ("does not apply to this text", e.g. average
word length of Chinese text), which never rejects.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from lmforge.data.rule_names import RULE_GROUP
from lmforge.data.textview import TextView

Measure = Callable[[TextView, Mapping[str, Any]], "float | None"]


@dataclass(frozen=True)
class Rule:
    """``measure(view, settings)`` compared with ``settings[threshold]``.

    ``threshold=None`` makes a yes/no rule that rejects any value above 0.
    ``prose`` rules judge natural-language text; code domains skip them unless their
    rule list names them.
    """

    name: str
    measure: Measure
    threshold: str | None
    reject_below: bool = False  # True: a value under the threshold fails (a minimum)
    prose: bool = True
    group: str = "basic"

    def fails(self, value: float | None, limit: float | None) -> bool:
        """Whether ``value`` is on the wrong side of ``limit``."""
        if value is None:
            return False
        if limit is None:
            return value > 0
        return value < limit if self.reject_below else value > limit


RULES: dict[str, Rule] = {}


def rule(name: str, threshold: str | None, *, reject_below: bool = False, prose: bool = True,
         group: str = "basic") -> Callable[[Measure], Measure]:
    """Register ``measure`` as rule ``name`` checked against ``filter.<threshold>``."""

    def register(measure: Measure) -> Measure:
        if name in RULES:
            raise ValueError(f"filter rule '{name}' is registered twice")
        if RULE_GROUP.get(name) != group:  # config checks params.yaml against those names
            raise ValueError(f"filter rule '{name}': declare it in group '{group}' of "
                             f"lmforge.data.rule_names.RULE_GROUPS")
        RULES[name] = Rule(name, measure, threshold, reject_below, prose, group)
        return measure

    return register


def groups() -> dict[str, list[str]]:
    """Group name -> its rules, in registration order (``gopher_quality``, ``c4`` ...)."""
    out: dict[str, list[str]] = {}
    for r in RULES.values():
        out.setdefault(r.group, []).append(r.name)
    return out
