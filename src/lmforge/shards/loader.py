"""Training and evaluation batches from a shards directory.

The token stream is every shard's tokens concatenated in manifest order. Training
windows are ``seq_len + 1`` tokens at stride ``seq_len`` (so inputs and shifted targets
come from one read), visited without replacement in a permutation seeded with
``seed + epoch``. The loader's whole state is one cursor -- windows handed out so far,
over all ranks -- stored as ``(epoch, position)``: restoring it replays exactly the
batches an uninterrupted run would have drawn, also after a change of world size.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lmforge.errors import ConfigError, InputError
from lmforge.shards.format import (
    check_shard,
    file_sha256,
    open_tokens,
    read_header,
    read_index,
    read_manifest,
)
from lmforge.shards.format import verify_checksums as _verify_shard

IGNORE_INDEX = -100  # target value the loss skips (torch cross_entropy's default)


class ShardSet:
    """A shards directory, memory-mapped and validated against its manifest.

    Opening checks every shard's header (magic, version, size, tokenizer hash, counts)
    and index; ``verify_checksums=True`` also reads every byte and compares sha256.
    """

    def __init__(self, path: str | Path, verify_checksums: bool = False) -> None:
        self.path = Path(path)
        self.manifest: dict[str, Any] = read_manifest(self.path)
        m = self.manifest
        self.vocab_size: int = int(m["vocab_size"])
        self.dtype: np.dtype = np.dtype(m["dtype"])
        self.tokenizer_sha256: str = m["tokenizer_sha256"]
        self.domain_names: list[str] = [m["domains"][str(i)] for i in range(len(m["domains"]))]
        # Fine-tuning shards: which tokens are training targets (see ShardWriter).
        self.has_loss_mask: bool = bool(m.get("loss_mask"))
        self._tokens: list[np.ndarray] = []
        self._masks: list[np.ndarray] = []
        ends, nbytes, domains = [], [], []
        offset = 0
        for entry in m["shards"]:
            bin_path = self.path / entry["file"]
            idx_path = self.path / entry.get("index", Path(entry["file"]).with_suffix(".idx"))
            header = read_header(bin_path)
            check_shard(header, bin_path, m, entry)
            tokens = open_tokens(bin_path, header)
            index = read_index(idx_path, header.num_docs, header.num_tokens,
                               len(self.domain_names))
            if verify_checksums:
                _verify_shard(bin_path, idx_path, entry, tokens, self.vocab_size)
            self._tokens.append(tokens)
            if self.has_loss_mask:
                self._masks.append(_open_mask(self.path, entry, header.num_tokens,
                                              verify_checksums))
            ends.append(index.ends.astype(np.int64) + offset)
            nbytes.append(index.nbytes)
            domains.append(index.domains)
            offset += header.num_tokens
        self.num_tokens: int = offset
        if self.num_tokens == 0:
            raise InputError(f"{self.path}: the shard set holds no tokens")
        # Start offset of each shard in the concatenated stream, plus the total at the end.
        self._offsets = np.cumsum([0] + [len(t) for t in self._tokens]).astype(np.int64)
        self.doc_ends: np.ndarray = np.concatenate(ends)  # global end offset per document
        self.doc_bytes: np.ndarray = np.concatenate(nbytes)
        self.doc_domains: np.ndarray = np.concatenate(domains).astype(np.int64)
        self._doc_starts: np.ndarray | None = None  # built on first use

    def target_tokens(self) -> int:
        """Tokens that are training targets: all of them, or the loss mask's ones."""
        if not self.has_loss_mask:
            return self.num_tokens
        return sum(int(np.count_nonzero(m)) for m in self._masks)

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)`` of the concatenated stream as int64."""
        return self._read(self._tokens, start, stop)

    def windows(self, starts: np.ndarray, length: int) -> np.ndarray:
        """``(len(starts), length)`` int64 tokens: one row per window start."""
        return self._windows(self._tokens, starts, length)

    def mask_windows(self, starts: np.ndarray, length: int) -> np.ndarray:
        """``(len(starts), length)`` bool: which tokens are training targets (all of them
        in a set without loss masks)."""
        if not self.has_loss_mask:
            return np.ones((len(starts), length), dtype=bool)
        return self._windows(self._masks, starts, length).astype(bool)

    def _read(self, arrays: list[np.ndarray], start: int, stop: int) -> np.ndarray:
        if not 0 <= start <= stop <= self.num_tokens:
            raise IndexError(f"token range [{start}, {stop}) outside [0, {self.num_tokens})")
        first = int(np.searchsorted(self._offsets, start, "right")) - 1
        parts = []
        s = first
        while start < stop:
            lo = start - int(self._offsets[s])
            hi = min(stop, int(self._offsets[s + 1])) - int(self._offsets[s])
            parts.append(np.asarray(arrays[s][lo:hi], dtype=np.int64))
            start += hi - lo
            s += 1
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    def _windows(self, arrays: list[np.ndarray], starts: np.ndarray,
                 length: int) -> np.ndarray:
        starts = np.asarray(starts, dtype=np.int64)
        out = np.empty((len(starts), length), dtype=np.int64)
        first = np.searchsorted(self._offsets, starts, "right") - 1
        last = np.searchsorted(self._offsets, starts + length - 1, "right") - 1
        inside = first == last
        ar = np.arange(length, dtype=np.int64)
        for s in np.unique(first[inside]):
            rows = np.flatnonzero(inside & (first == s))
            local = starts[rows] - self._offsets[s]
            out[rows] = arrays[s][local[:, None] + ar]
        # Windows that straddle a shard boundary are rare: one per boundary at most.
        for row in np.flatnonzero(~inside):
            out[row] = self._read(arrays, int(starts[row]), int(starts[row]) + length)
        return out

    def doc_of(self, positions: np.ndarray) -> np.ndarray:
        """Index of the document each token position belongs to (same shape, int64)."""
        return np.searchsorted(self.doc_ends, positions, "right")

    def domain_of(self, positions: np.ndarray) -> np.ndarray:
        """Domain code of the document each token position belongs to (int64)."""
        return self.doc_domains[self.doc_of(positions)]

    def domain_shares(self) -> dict[str, dict[str, float]]:
        """Each domain's share of this split's tokens and of its bytes (the mixture).

        On the train split these are the mixture the model was trained on: the weights
        of the mixture-weighted val figures (lmforge.evaluate.scoring).
        """
        totals = self.manifest["totals"]
        live = {d: t for d, t in totals.items() if t.get("tokens")}
        tokens = sum(t["tokens"] for t in live.values())
        nbytes = sum(t["bytes"] for t in live.values())
        return {d: {"tokens": t["tokens"] / tokens, "bytes": t["bytes"] / nbytes if nbytes
                    else 0.0} for d, t in sorted(live.items())}

    def doc_starts(self) -> np.ndarray:
        """Global start offset of every document (int64)."""
        return np.concatenate([[0], self.doc_ends[:-1]]).astype(np.int64)

    def positions_in_doc(self, positions: np.ndarray) -> np.ndarray:
        """Offset of each token position from the start of its document (same shape).

        0 marks a document's first token, so a window's document boundaries are where
        this is 0, and ``cumsum(pos == 0)`` numbers its documents.
        """
        if self._doc_starts is None:
            self._doc_starts = self.doc_starts()
        positions = np.asarray(positions, dtype=np.int64)
        return positions - self._doc_starts[self.doc_of(positions)]


def mixture_mean(values: dict[str, float], weights: dict[str, float]) -> float:
    """Per-domain ``values`` weighted by ``weights`` (a split's ``domain_shares``),
    renormalised over the domains that have both; NaN when none has."""
    live = [d for d in values if weights.get(d, 0) > 0]
    total = sum(weights[d] for d in live)
    if not total:
        return float("nan")
    return sum(weights[d] / total * values[d] for d in live)


class WindowLoader:
    """Seeded, resumable, rank-sharded training batches of ``seq_len + 1``-token windows.

    Rank ``r`` of ``world_size`` takes every ``world_size``-th window of the epoch's
    permutation, so the ranks are disjoint and together cover every window once per
    epoch. With ``align_to_docs`` every window starts at a document start or at a
    multiple of ``seq_len`` inside a long document, so no document begins mid-window
    without its first tokens being seen as context somewhere.

    With ``return_doc_info`` ``next_batch`` also returns, for every input token, its
    position within its document (``(B, T)`` int64; 0 at each document start): the
    position ids and document boundaries that attention masked per document needs.

    With ``stratified`` each epoch's order is :func:`stratified_order` instead of a plain
    permutation: any run of consecutive windows -- a micro-batch, a rank's share, an
    optimizer step's batch over ranks and accumulation -- holds each domain in its share
    of the split's windows (within a window or two), not only the epoch as a whole. It is
    still a seeded permutation of the same windows, so the cursor resumes it exactly.
    """

    def __init__(self, shards: ShardSet, seq_len: int, batch_size: int, seed: int,
                 rank: int = 0, world_size: int = 1, align_to_docs: bool = False,
                 return_doc_info: bool = False, stratified: bool = False) -> None:
        if seq_len <= 0 or batch_size <= 0:
            raise ConfigError(f"seq_len ({seq_len}) and batch_size ({batch_size}) must be > 0")
        if not 0 <= rank < world_size:
            raise ConfigError(f"rank {rank} is outside world_size {world_size}")
        self.shards = shards
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.align_to_docs = align_to_docs
        self.return_doc_info = return_doc_info
        self.stratified = stratified
        self._starts = _doc_aligned_starts(shards, seq_len) if align_to_docs else None
        self.num_windows = (len(self._starts) if self._starts is not None
                            else (shards.num_tokens - 1) // seq_len)
        if self.num_windows == 0:
            raise InputError(f"{shards.path}: {shards.num_tokens} tokens are fewer than one "
                             f"window of seq_len + 1 = {seq_len + 1}")
        self._cursor = 0  # windows handed out so far, over all ranks and epochs
        self._perms: dict[int, np.ndarray] = {}
        self.last_starts = np.zeros(0, np.int64)  # stream offsets of the last batch's windows

    @property
    def epoch(self) -> int:
        """The epoch the next window comes from."""
        return self._cursor // self.num_windows

    def next_batch(self) -> tuple[torch.Tensor, ...]:
        """``(inputs, targets)``, each ``(batch_size, seq_len)`` int64; targets = inputs + 1.

        With ``return_doc_info``: ``(inputs, targets, positions)``, ``positions`` being
        each input token's offset within its document.
        """
        steps = np.arange(self.batch_size, dtype=np.int64)
        cursors = self._cursor + steps * self.world_size + self.rank
        epochs, slots = np.divmod(cursors, self.num_windows)
        windows = np.empty(self.batch_size, dtype=np.int64)
        for e in np.unique(epochs):
            sel = epochs == e
            windows[sel] = self._permutation(int(e))[slots[sel]]
        starts = self._starts[windows] if self._starts is not None else windows * self.seq_len
        tokens = self.shards.windows(starts, self.seq_len + 1)
        self._cursor += self.batch_size * self.world_size
        self.last_starts = starts
        targets = masked_targets(self.shards, tokens[:, 1:], starts + 1)
        batch = (torch.from_numpy(np.ascontiguousarray(tokens[:, :-1])),
                 torch.from_numpy(np.ascontiguousarray(targets)))
        if not self.return_doc_info:
            return batch
        ar = np.arange(self.seq_len, dtype=np.int64)
        return (*batch, torch.from_numpy(self.shards.positions_in_doc(starts[:, None] + ar)))

    def state_dict(self) -> dict:
        """The position as plain ints (safe for ``torch.load(weights_only=True)``)."""
        epoch, position = divmod(self._cursor, self.num_windows)
        state = {"epoch": int(epoch), "position": int(position),
                 "num_windows": int(self.num_windows), "seq_len": int(self.seq_len),
                 "seed": int(self.seed), "align_to_docs": int(self.align_to_docs)}
        if self.stratified:  # absent when off: shuffled checkpoints read as before
            state["stratified"] = 1
        return state

    def load_state_dict(self, state: dict) -> None:
        """Resume at a saved position; refuse a state from a different window layout."""
        for key in ("seq_len", "seed", "num_windows", "align_to_docs"):
            mine = int(getattr(self, key))
            if key in state and int(state[key]) != mine:
                raise ConfigError(f"loader state has {key}={state[key]} but this loader has "
                                  f"{key}={mine}; the data or its layout changed since the "
                                  "checkpoint")
        if int(state.get("stratified", 0)) != int(self.stratified):
            raise ConfigError(f"loader state has stratified={int(state.get('stratified', 0))} "
                              f"but this loader has stratified={int(self.stratified)}; the "
                              "batch order changed since the checkpoint")
        self._cursor = int(state["epoch"]) * self.num_windows + int(state["position"])

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            # Keep the current and next epoch only: a batch spans at most two.
            self._perms = {e: p for e, p in self._perms.items() if e >= epoch - 1}
            rng = np.random.default_rng(self.seed + epoch)
            self._perms[epoch] = (stratified_order(self.window_domains(), rng)
                                  if self.stratified else rng.permutation(self.num_windows))
        return self._perms[epoch]

    def window_domains(self) -> np.ndarray:
        """Domain code of each window (that of its first target token), int64."""
        starts = (self._starts if self._starts is not None
                  else np.arange(self.num_windows, dtype=np.int64) * self.seq_len)
        return self.shards.domain_of(starts + 1)


def stratified_order(domains: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A permutation of ``range(len(domains))`` in which every run of consecutive entries
    holds each domain in its overall share, to within about one entry per domain.

    Systematic sampling: each domain's entries are shuffled, the k-th of a domain with n
    entries gets the key ``(k + u) / n`` (``u`` one uniform offset per domain), and the
    order is by key. A domain's keys are evenly spaced 1/n apart, so any stretch of keys
    holds its share of them, give or take one.
    """
    keys = np.empty(len(domains), dtype=np.float64)
    for d in np.unique(domains):
        members = rng.permutation(np.flatnonzero(domains == d))
        keys[members] = (np.arange(len(members)) + rng.random()) / len(members)
    return np.argsort(keys, kind="stable")


def masked_targets(shards: ShardSet, targets: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """``targets`` with ``IGNORE_INDEX`` where the set's loss mask says "context only"
    (``starts``: stream offset of each row's first target)."""
    if not shards.has_loss_mask:
        return targets
    keep = shards.mask_windows(starts, targets.shape[1])
    return np.where(keep, targets, IGNORE_INDEX)


def _open_mask(directory: Path, entry: dict[str, Any], num_tokens: int,
               verify: bool) -> np.ndarray:
    """Memory-map a shard's loss mask after checking its size (and sha256 if asked)."""
    if "mask" not in entry:
        raise InputError(f"{directory}: the manifest says loss_mask but {entry['file']} "
                         "names no mask file")
    path = directory / entry["mask"]
    size = path.stat().st_size if path.is_file() else -1
    if size != num_tokens:
        raise InputError(f"{path}: loss mask of {size} bytes for a shard of {num_tokens} "
                         "tokens; the shard set is incomplete or corrupt")
    if verify and file_sha256(path) != entry.get("mask_sha256"):
        raise InputError(f"{path}: sha256 does not match the manifest; the mask is corrupt")
    if num_tokens == 0:
        return np.zeros(0, np.uint8)
    return np.memmap(path, dtype=np.uint8, mode="r", shape=(num_tokens,))


def _doc_aligned_starts(shards: ShardSet, seq_len: int) -> np.ndarray:
    """Window starts at each document start, then every ``seq_len`` inside long documents."""
    starts = shards.doc_starts()
    lengths = shards.doc_ends - starts
    # Windows a document needs so each of its tokens after the first is a target once.
    counts = np.maximum(1, -(-(lengths - 1) // seq_len))
    group_first = np.repeat(np.cumsum(counts) - counts, counts)
    k = np.arange(int(counts.sum()), dtype=np.int64) - group_first
    out = np.repeat(starts, counts) + k * seq_len
    return out[out + seq_len + 1 <= shards.num_tokens]


def eval_batches(shards: ShardSet, seq_len: int, batch_size: int, max_batches: int = 0,
                 return_doc_info: bool = False) -> Iterator[dict[str, torch.Tensor]]:
    """Deterministic evaluation batches; every token after the first is a target once.

    Windows of ``seq_len + 1`` tokens at stride ``seq_len``; the final partial window is
    padded (input 0, target ``IGNORE_INDEX``, domain -1, doc -1). Yields ``input``,
    ``target``, ``domain`` (the domain code of each target token) and ``doc`` (the index
    of its document in the split), all ``(B, seq_len)`` int64;
    the last batch may be smaller. ``max_batches > 0`` scores that many batches of
    windows spread evenly over the stream instead of a full pass. ``return_doc_info`` adds
    ``positions``: each input token's offset within its document (0 in the padding).
    """
    if seq_len <= 0 or batch_size <= 0:
        raise ConfigError(f"seq_len ({seq_len}) and batch_size ({batch_size}) must be > 0")
    n = shards.num_tokens
    full = (n - 1) // seq_len
    tail = (n - 1) - full * seq_len  # targets left after the last full window
    if max_batches > 0 and max_batches * batch_size < full + (tail > 0):
        picks = np.linspace(0, full - 1, max_batches * batch_size) if full else np.zeros(0)
        starts = np.unique(np.round(picks).astype(np.int64)) * seq_len
        tail = 0
    else:
        starts = np.arange(full, dtype=np.int64) * seq_len
    ar = np.arange(seq_len, dtype=np.int64)
    rows = len(starts) + (tail > 0)
    for lo in range(0, rows, batch_size):
        batch_starts = starts[lo:lo + batch_size]
        tokens = shards.windows(batch_starts, seq_len + 1)
        inp = tokens[:, :-1]
        tgt = masked_targets(shards, tokens[:, 1:], batch_starts + 1)
        doc = shards.doc_of(batch_starts[:, None] + 1 + ar)
        dom = shards.doc_domains[doc]
        if lo + batch_size >= rows and tail > 0:
            t_inp, t_tgt, t_dom, t_doc = _tail_window(shards, full * seq_len, tail, seq_len)
            inp, tgt, dom, doc = (np.concatenate([inp, t_inp]), np.concatenate([tgt, t_tgt]),
                                  np.concatenate([dom, t_dom]), np.concatenate([doc, t_doc]))
        out = {"input": torch.from_numpy(np.ascontiguousarray(inp)),
               "target": torch.from_numpy(np.ascontiguousarray(tgt)),
               "domain": torch.from_numpy(np.ascontiguousarray(dom)),
               "doc": torch.from_numpy(np.ascontiguousarray(doc))}
        if return_doc_info:
            pos = shards.positions_in_doc(batch_starts[:, None] + ar)
            if len(pos) < len(inp):  # the padded tail window
                t_pos = np.zeros((1, seq_len), np.int64)
                t_pos[0, :tail] = shards.positions_in_doc(full * seq_len + ar[:tail])
                pos = np.concatenate([pos, t_pos])
            out["positions"] = torch.from_numpy(pos)
        yield out


def _tail_window(shards: ShardSet, start: int, tail: int, seq_len: int
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The last, partial window as padded ``(1, seq_len)`` input/target/domain/doc rows."""
    tokens = shards.read(start, start + tail + 1)
    inp = np.zeros((1, seq_len), np.int64)
    tgt = np.full((1, seq_len), IGNORE_INDEX, np.int64)
    dom = np.full((1, seq_len), -1, np.int64)
    doc = np.full((1, seq_len), -1, np.int64)
    inp[0, :tail] = tokens[:-1]
    tgt[0, :tail] = masked_targets(shards, tokens[None, 1:], np.array([start + 1]))[0]
    doc[0, :tail] = shards.doc_of(start + 1 + np.arange(tail, dtype=np.int64))
    dom[0, :tail] = shards.doc_domains[doc[0, :tail]]
    return inp, tgt, dom, doc
