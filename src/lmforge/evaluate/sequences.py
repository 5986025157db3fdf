"""Teacher-forced scoring of token sequences: a reply's summed nats after its prompt.

Everything here is one forward pass per batch of sequences, right-padded (causal
attention keeps padding out of every scored position), with no sampling loop: the
held-out tasks (lmforge.evaluate.tasks) and preference pairs
(lmforge.evaluate.preferences) are both sets of (prompt, reply) sequences scored here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from lmforge.errors import InputError
from lmforge.finetune.records import ASSISTANT, Turn
from lmforge.finetune.template import chat_format
from lmforge.model.llama import Llama
from lmforge.model.loss import IGNORE_INDEX
from lmforge.tokenizer import Tokenizer

# The right-padding id: any valid id does, causal attention never lets a scored
# position see it.
PAD_ID = 0




@dataclass
class SequenceScores:
    """Per sequence: summed nats of the scored tokens, their count, ``misses``: how many
    are not the argmax of the logits before them, and ``greedy``: whether none is."""

    nats: np.ndarray
    tokens: np.ndarray
    misses: np.ndarray
    greedy: np.ndarray


@dataclass
class SequenceSet:
    """Token sequences to score, deduplicated (an accepted answer is often the reference
    reply), each with the index of its first scored token."""

    max_len: int | None
    ids: list[list[int]] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    index: dict[tuple[int, ...], int] = field(default_factory=dict)

    def add(self, prompt: Sequence[Turn], reply: str, tokenizer: Tokenizer,
            where: str) -> int:
        """The index of ``prompt`` + ``reply`` as the assistant turn (added if new)."""
        ids, start = reply_sequence(prompt, reply, tokenizer)
        # The last token is only a target, never an input.
        if self.max_len is not None and len(ids) - 1 > self.max_len:
            raise InputError(f"{where}: {len(ids)} tokens with the reply, more than the "
                             f"model's seq_len {self.max_len} + 1")
        key = tuple(ids)
        if key not in self.index:
            self.index[key] = len(self.ids)
            self.ids.append(ids)
            self.starts.append(start)
        return self.index[key]


def reply_sequence(prompt: Sequence[Turn], reply: str, tokenizer: Tokenizer
                   ) -> tuple[list[int], int]:
    """(ids, start): ``prompt`` + ``reply`` rendered, and where the reply's tokens start.

    ``ids[start:]`` are the reply's content ids and its end-of-turn token (``<|end|>``,
    ``<|im_end|>``): the SFT loss mask of the last turn, in the model's chat format;
    what a template writes after it (a newline) is left off. The generation prompt must
    be an exact prefix; it is checked rather than assumed.
    """
    fmt = chat_format(tokenizer)
    head = fmt.generation_prompt(prompt)
    ids, mask = fmt.render((*prompt, (ASSISTANT, reply)))
    end = len(mask) - mask[::-1].index(1) if any(mask) else len(mask)
    ids, mask = ids[:end], mask[:end]
    if ids[:len(head)] != head or not all(mask[len(head):]):
        raise InputError(f"{fmt.where}: the generation prompt is not a prefix of the "
                         "conversation, so a reply's tokens cannot be told apart")
    return ids, len(head)


def model_seq_len(model: torch.nn.Module) -> int | None:
    """The model's context length (``config.seq_len``), or None when it has none."""
    config = getattr(model, "config", None)
    return getattr(config, "seq_len", None)


@torch.no_grad()
def score_sequences(model: torch.nn.Module, sequences: Sequence[Sequence[int]],
                    starts: Sequence[int], batch_size: int,
                    device: str | torch.device = "cpu") -> SequenceScores:
    """Teacher-forced scores of ``sequences[i][starts[i]:]`` given what precedes it.

    One forward pass per batch of ``batch_size`` sequences, right-padded to the batch's
    longest; the sequences are batched by length (longest first) so little is padding.
    ``greedy`` uses ``torch.argmax`` (the first maximum on ties), as
    ``lmforge.model.generate.sample_next`` at temperature 0 does.
    """
    n = len(sequences)
    nats, tokens = np.zeros(n), np.zeros(n, dtype=np.int64)
    misses = np.zeros(n, dtype=np.int64)
    if any(not 0 < s < len(seq) for s, seq in zip(starts, sequences, strict=True)):
        raise ValueError("each start must be past the first token and within its sequence")
    device = torch.device(device)
    order = sorted(range(n), key=lambda i: -len(sequences[i]))
    was_training = model.training
    model.eval()
    try:
        for first in range(0, n, batch_size):
            rows = order[first:first + batch_size]
            x, y = _batch([sequences[i] for i in rows], [starts[i] for i in rows])
            b_nats, b_tokens, b_misses = _score_batch(model, x.to(device), y.to(device))
            nats[rows], tokens[rows], misses[rows] = b_nats, b_tokens, b_misses
    finally:
        model.train(was_training)
    return SequenceScores(nats, tokens, misses, misses == 0)


def _batch(seqs: list[Sequence[int]], starts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs (B, T) right-padded with ``PAD_ID`` and targets (B, T): the next token where
    it is scored, ``IGNORE_INDEX`` elsewhere."""
    width = max(len(s) for s in seqs) - 1
    x = torch.full((len(seqs), width), PAD_ID, dtype=torch.long)
    y = torch.full((len(seqs), width), IGNORE_INDEX, dtype=torch.long)
    for row, (seq, start) in enumerate(zip(seqs, starts, strict=True)):
        ids = torch.as_tensor(seq, dtype=torch.long)
        x[row, :len(seq) - 1] = ids[:-1]
        # The logits at position t predict token t + 1.
        y[row, start - 1:len(seq) - 1] = ids[start:]
    return x, y


def _score_batch(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row: summed nats, scored tokens, and tokens that are not the argmax."""
    keep = y != IGNORE_INDEX
    picked, target = scored_logits(model, x, keep), y[keep]
    token_nats = F.cross_entropy(picked.float(), target, reduction="none")
    misses = (torch.argmax(picked, dim=-1) != target).double()  # argmax in the model's dtype
    row = keep.nonzero()[:, 0]
    size = x.size(0)
    sums = torch.zeros(size, dtype=torch.float64, device=x.device).index_add_(
        0, row, token_nats.double())
    wrong = torch.zeros(size, dtype=torch.float64, device=x.device).index_add_(0, row, misses)
    return (sums.cpu().numpy(), keep.sum(1).cpu().numpy(), wrong.cpu().numpy())


def scored_logits(model: torch.nn.Module, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """The logits (N, V) at the N positions where ``keep`` (B, T) is true.

    For a ``Llama`` the output layer runs on those positions only: it is ~40 % of the
    5M demo model's FLOPs and a quarter of the positions are scored (a reply after
    its prompt). A forward hook hands the final norm's output at those positions to
    ``lm_head``, so ``model(x)`` returns (N, V); the shape is checked, so a forward
    that no longer ends in ``norm -> lm_head`` fails loudly rather than scoring wrong
    rows. Any other model is called plainly and indexed.
    """
    norm = getattr(model, "norm", None)
    if not isinstance(model, Llama) or not isinstance(norm, torch.nn.Module):
        logits = model(x)
        return (logits[0] if isinstance(logits, tuple) else logits)[keep]
    handle = norm.register_forward_hook(lambda _module, _inputs, out: out[keep])
    try:
        logits = model(x)
    finally:
        handle.remove()
    if logits.dim() != 2 or logits.size(0) != int(keep.sum()):
        raise AssertionError(f"Llama.forward no longer ends in norm -> lm_head "
                             f"(logits {tuple(logits.shape)})")
    return logits
