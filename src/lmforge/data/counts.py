"""Per-domain counts with the identity every data stage checks: in == kept + rejected."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any


@dataclass
class DomainCounts:
    """How many records of one domain came in, were kept, and were rejected (by reason)."""

    n_in: int = 0
    kept: int = 0
    rejected: Counter = field(default_factory=Counter)

    def add(self, other: DomainCounts) -> None:
        self.n_in += other.n_in
        self.kept += other.kept
        self.rejected.update(other.rejected)

    def as_dict(self) -> dict[str, Any]:
        return {"in": self.n_in, "kept": self.kept, "rejected": dict(sorted(self.rejected.items()))}


class Counts:
    """Counts for all domains; ``check`` asserts the in == kept + rejected identity."""

    def __init__(self) -> None:
        self.domains: dict[str, DomainCounts] = {}

    def __getitem__(self, domain: str) -> DomainCounts:
        if domain not in self.domains:
            self.domains[domain] = DomainCounts()
        return self.domains[domain]

    def merge(self, other: Counts) -> None:
        for domain, c in other.domains.items():
            self[domain].add(c)

    def check(self) -> None:
        """A mismatch is a bug in the stage, never a data problem."""
        for domain, c in self.domains.items():
            total = c.kept + sum(c.rejected.values())
            assert c.n_in == total, f"{domain}: in={c.n_in} != kept+rejected={total}"

    def as_dict(self) -> dict[str, Any]:
        """``{"domains": {...}, "total": {...}}`` for a metrics JSON file."""
        self.check()
        total = DomainCounts()
        for c in self.domains.values():
            total.add(c)
        return {
            "domains": {d: self.domains[d].as_dict() for d in sorted(self.domains)},
            "total": total.as_dict(),
        }
