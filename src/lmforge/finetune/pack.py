"""Pack rendered conversations into rows of exactly ``seq_len`` tokens.

Each row holds whole conversations (none is ever split, so every answer sees its whole
prompt) chosen by best-fit decreasing, then padding: pad tokens with loss mask 0,
appended to the row's last conversation. Rows are written back to back, plus one final
pad token, so the loader's windows of ``seq_len + 1`` tokens at stride ``seq_len`` are
exactly the rows: each window's last target is the next row's BOS, masked. With document
masking (``sft.doc_mask``) attention and positions restart at every conversation, so
packing changes nothing a conversation sees; without it, a conversation also attends to
the ones before it in its row.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from lmforge.finetune.template import Rendered


@dataclass
class Packed:
    """Rows as one token stream with per-conversation lengths and a loss mask."""

    tokens: np.ndarray  # int64, rows * seq_len + 1
    mask: np.ndarray  # uint8, same length: 1 where a token is a training target
    doc_lengths: np.ndarray  # int64, per conversation (padding counted in the row's last)
    doc_bytes: np.ndarray  # int64, UTF-8 bytes of each conversation's assistant text
    rows: int
    pad_tokens: int


def split_by_hash(items: Sequence[Rendered], val_fraction: float, seed: int
                  ) -> tuple[list[int], list[int]]:
    """Indices of train and val items: val when a seeded hash of the ids is below the share.

    By content, so the split does not move when files are renamed or reordered, and
    duplicate conversations land on the same side.
    """
    train, val = [], []
    for i, item in enumerate(items):
        digest = hashlib.sha256(f"{seed}:{item.ids}".encode()).digest()
        (val if int.from_bytes(digest[:8], "big") / 2**64 < val_fraction else train).append(i)
    return train, val


def bins_best_fit(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Group item indices into bins of total length <= capacity, best-fit decreasing.

    Ties keep input order, so the packing is deterministic. Each item must fit a bin.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])  # stable
    bins: list[list[int]] = []
    # by_room[r]: bins with exactly r tokens of room left (a stack; the newest first)
    by_room: list[list[int]] = [[] for _ in range(capacity + 1)]
    room: list[int] = []
    for i in order:
        n = lengths[i]
        if n > capacity:
            raise ValueError(f"item {i} has {n} tokens > capacity {capacity}")
        fit = next((r for r in range(n, capacity + 1) if by_room[r]), None)
        if fit is None:
            b = len(bins)
            bins.append([])
            room.append(capacity)
        else:
            b = by_room[fit].pop()
        bins[b].append(i)
        room[b] -= n
        by_room[room[b]].append(b)
    return bins


def pack(items: Sequence[Rendered], seq_len: int, pad_id: int,
         reply_bytes: Sequence[int]) -> Packed:
    """Pack ``items`` into rows of ``seq_len`` tokens (see the module docstring)."""
    bins = bins_best_fit([len(it.ids) for it in items], seq_len)
    return pack_groups(items, bins, seq_len, pad_id, reply_bytes)


def pack_groups(items: Sequence[Rendered], groups: Sequence[Sequence[int]], seq_len: int,
                pad_id: int, reply_bytes: Sequence[int]) -> Packed:
    """One row per group of item indices (in that order), padded to ``seq_len``."""
    tokens: list[np.ndarray] = []
    masks: list[np.ndarray] = []
    lengths: list[int] = []
    nbytes: list[int] = []
    pad_total = 0
    for members in groups:
        used = 0
        for i in members:
            tokens.append(np.asarray(items[i].ids, np.int64))
            masks.append(np.asarray(items[i].mask, np.uint8))
            lengths.append(len(items[i].ids))
            nbytes.append(int(reply_bytes[i]))
            used += len(items[i].ids)
        if used > seq_len:
            raise ValueError(f"a row of {used} tokens > seq_len {seq_len}")
        pad = seq_len - used
        tokens.append(np.full(pad, pad_id, np.int64))
        masks.append(np.zeros(pad, np.uint8))
        lengths[-1] += pad
        pad_total += pad
    # The final pad token: the last row's window needs its seq_len + 1-th token.
    tokens.append(np.array([pad_id], np.int64))
    masks.append(np.zeros(1, np.uint8))
    if lengths:
        lengths[-1] += 1
    pad_total += 1
    return Packed(np.concatenate(tokens), np.concatenate(masks),
                  np.asarray(lengths, np.int64), np.asarray(nbytes, np.int64), len(groups),
                  pad_total)
