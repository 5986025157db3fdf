"""A seeded, domain-balanced sample of documents to train the tokenizer on.

Each document gets a key from a hash of ``(seed, id)``, so the sample does not depend
on part order or worker count. One streaming pass keeps, per domain, the lowest-key
documents that reach a cap; then the budget is shared out equally ("water-filling": a
domain smaller than its share gives the rest to the others).

Memory stays flat as the corpus grows: the cap of every domain is the current water
level -- the share each domain would get from what has been seen so far. More data only
lowers that level, so text above it can never be chosen and is dropped at once. The
reservoirs together hold at most ``sample_chars`` plus one (capped) document per domain,
and the result is exactly that of keeping everything.
"""

from __future__ import annotations

import hashlib
import heapq
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from lmforge.data.records import is_repeat
from lmforge.tokenizer.corpus import iter_text_batches


def doc_key(seed: int, doc_id: str) -> int:
    """A seeded pseudo-random 64-bit key of a document id."""
    digest = hashlib.blake2b(f"{seed}\0{doc_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


@dataclass
class _Reservoir:
    """The lowest-key documents of one domain that together reach ``cap`` characters."""

    cap: int
    heap: list[tuple[int, str]] = field(default_factory=list)  # (-key, text): max-heap
    keys: set[int] = field(default_factory=set)
    chars: int = 0
    seen_chars: int = 0
    repeats: int = 0

    def offer(self, key: int, text: str) -> bool:
        """Take the document if it ranks below the cap; say whether it was taken."""
        self.seen_chars += len(text)
        if key in self.keys:  # the same id again (an up-sampled repeat)
            self.repeats += 1
            return False
        if self.chars >= self.cap and key > -self.heap[0][0]:
            return False
        # No share exceeds the cap, so a longer document is only ever used cut to it.
        text = text[:self.cap]
        heapq.heappush(self.heap, (-key, text))
        self.keys.add(key)
        self.chars += len(text)
        self.trim()
        return True

    def lower_cap(self, cap: int) -> None:
        """Lower the cap (never raise it) and drop what falls above it."""
        if cap < self.cap:
            self.cap = cap
            self.trim()

    def trim(self) -> None:
        """Drop the highest key while the rest still reach the cap."""
        while self.heap and self.chars - len(self.heap[0][1]) >= self.cap:
            neg, dropped = heapq.heappop(self.heap)
            self.keys.discard(-neg)
            self.chars -= len(dropped)

    def in_key_order(self) -> list[tuple[int, str]]:
        return sorted((-neg, text) for neg, text in self.heap)


@dataclass
class Sample:
    """The sampled texts (in key order) and how many characters each domain gave."""

    texts: list[str]
    chars_per_domain: dict[str, int]
    available_chars: dict[str, int]
    repeats_skipped: int
    peak_held_chars: int  # most characters the reservoirs held at once


def balanced_sample(parts: Iterable[Path], sample_chars: int, seed: int) -> Sample:
    """At most ``sample_chars`` characters, shared equally across domains (see module doc)."""
    reservoirs: dict[str, _Reservoir] = {}
    peak = repeats = 0
    for path in parts:
        for batch in iter_text_batches(path):
            for doc_id, text, domain in zip(batch.ids, batch.texts, batch.domains,
                                            strict=True):
                if is_repeat(doc_id):  # mix's up-sampled copy: the original is in the split
                    repeats += 1
                    continue
                res = reservoirs.get(domain)
                if res is None:
                    # A new domain starts at the current level: it lowers it, never raises.
                    cap = min((r.cap for r in reservoirs.values()), default=sample_chars)
                    res = reservoirs[domain] = _Reservoir(cap)
                if res.offer(doc_key(seed, doc_id), text):
                    peak = max(peak, sum(r.chars for r in reservoirs.values()))
                    level = _water_level({d: r.chars for d, r in reservoirs.items()},
                                         sample_chars)
                    for r in reservoirs.values():
                        r.lower_cap(level)
    shares = water_fill({d: r.chars for d, r in reservoirs.items()}, sample_chars)
    chosen: list[tuple[int, str]] = []
    taken: dict[str, int] = {}
    for domain in sorted(reservoirs):
        budget = shares[domain]
        for key, text in reservoirs[domain].in_key_order():
            if budget <= 0:
                break
            piece = text[:budget]  # the last document is cut to fit the budget exactly
            chosen.append((key, piece))
            budget -= len(piece)
        taken[domain] = shares[domain] - budget
    chosen.sort()
    return Sample(
        texts=[t for _, t in chosen],
        chars_per_domain=taken,
        available_chars={d: r.seen_chars for d, r in sorted(reservoirs.items())},
        repeats_skipped=repeats + sum(r.repeats for r in reservoirs.values()),
        peak_held_chars=peak,
    )


def _water_level(available: dict[str, int], total: int) -> int:
    """The largest share any domain gets of ``total`` (``total`` if all of it fits)."""
    shares = water_fill(available, total)
    if sum(shares.values()) < total:  # everything fits: no level caps anything yet
        return total
    return max(shares.values(), default=total)


def water_fill(available: dict[str, int], total: int) -> dict[str, int]:
    """Equal shares of ``total``; domains with less than their share take all they have."""
    shares: dict[str, int] = {}
    left = dict(available)
    budget = total
    while left:
        share = budget // len(left)
        small = {d: n for d, n in left.items() if n <= share}
        if not small:
            # Split the remainder deterministically: the first domains get one char more.
            for i, d in enumerate(sorted(left)):
                shares[d] = share + (1 if i < budget - share * len(left) else 0)
            break
        for d, n in small.items():
            shares[d] = n
            budget -= n
            del left[d]
    return shares
