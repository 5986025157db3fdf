"""Replay: fine-tuning batches with a fixed share of rows from the pretraining shards.

Mixing general text into fine-tuning data is the practice notes' first remedy for
catastrophic forgetting (9:1 to 7:3, ``sft.replay`` 0.1 to 0.3). The share is by rows
(windows of ``seq_len`` tokens), interleaved evenly and without randomness: row ``n`` of
this rank comes from the pretraining shards exactly when ``floor((n + 1) * share)``
exceeds ``floor(n * share)``, so any stretch of rows holds the share to within one row,
and the loader's position is two plain counters that a checkpoint restores exactly.
A replay row is all targets, while a fine-tuning row is about a third (its prompts are
masked), so replay's share of the loss tokens is larger than its share of rows:
``metrics/sft.json`` reports both.
"""

from __future__ import annotations

import math
from typing import Any

import torch


class ReplayLoader:
    """Batches of ``batch_size`` rows from two row loaders (each yielding one row a call)."""

    def __init__(self, primary: Any, replay: Any, share: float, batch_size: int) -> None:
        if not 0 <= share < 1:
            raise ValueError(f"replay share {share} must be in [0, 1)")
        self.primary, self.replay = primary, replay
        self.share = share
        self.batch_size = batch_size
        self.shards = primary.shards  # the loop asks whether targets are masked
        self.rows = 0  # rows handed out so far on this rank
        self.replay_rows = 0

    def is_replay(self, n: int) -> bool:
        """Whether row ``n`` (0-based, this rank) comes from the pretraining shards."""
        return math.floor((n + 1) * self.share) > math.floor(n * self.share)

    def next_batch(self) -> tuple[torch.Tensor, ...]:
        """``(inputs, targets[, positions])`` as the row loaders give them, ``batch_size`` rows."""
        parts = []
        for _ in range(self.batch_size):
            use_replay = self.is_replay(self.rows)
            parts.append((self.replay if use_replay else self.primary).next_batch())
            self.rows += 1
            self.replay_rows += use_replay
        return tuple(torch.cat(column) for column in zip(*parts, strict=True))

    def state_dict(self) -> dict:
        """Both loaders' positions and the row counters (plain ints)."""
        return {"rows": self.rows, "replay_rows": self.replay_rows,
                "primary": self.primary.state_dict(), "replay": self.replay.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.rows, self.replay_rows = int(state["rows"]), int(state["replay_rows"])
        self.primary.load_state_dict(state["primary"])
        self.replay.load_state_dict(state["replay"])
