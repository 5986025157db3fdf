"""Preference records -> (prompt, chosen, rejected) -> two masked sequences per pair.

One JSON object per line (plain, ``.gz`` or ``.zst``; BOM and CRLF accepted), in TRL's
shapes:

* explicit prompt: ``{"prompt": P, "chosen": C, "rejected": R}``, where P is a string
  (one user turn) or a message list, and C and R are strings (one assistant turn) or
  message lists;
* implicit prompt: ``{"chosen": [...], "rejected": [...]}``, two whole conversations; the
  prompt is the turns they share at the start.

A pair renders as two conversations, prompt + chosen and prompt + rejected, each with
the chat template; the loss mask covers the response turns only (an assistant turn inside
a multi-turn prompt is context, never scored). Rejected records, with a reason each:
those of ``lmforge.finetune.records`` plus ``identical_pair`` (nothing to prefer) and,
when rendered, ``too_long`` (the pair's two sequences exceed a packed row).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from lmforge.finetune.model_template import TemplateError
from lmforge.finetune.pack import Packed, bins_best_fit, pack_groups
from lmforge.finetune.records import (
    ASSISTANT,
    EMPTY_ASSISTANT,
    LAST_NOT_ASSISTANT,
    UNKNOWN_FORMAT,
    USER,
    BadRecord,
    ReadResult,
    Turn,
    _messages,
    _string,
)
from lmforge.finetune.template import TOO_LONG, Rendered, chat_format
from lmforge.tokenizer import Tokenizer

IDENTICAL_PAIR = "identical_pair"


@dataclass(frozen=True)
class Pair:
    """A prompt and two responses to it, the first preferred."""

    prompt: tuple[Turn, ...]
    chosen: tuple[Turn, ...]
    rejected: tuple[Turn, ...]


def _turns(value: Any, where: str, role: str) -> list[Turn]:
    """A string is one turn of ``role``; a list is messages."""
    return _messages(value, where) if isinstance(value, list) else [(role, _string(value, where))]


def _check_response(turns: list[Turn], where: str) -> None:
    if not any(role == ASSISTANT and content.strip() for role, content in turns):
        raise BadRecord(EMPTY_ASSISTANT, f"{where}: no non-empty assistant turn")
    if turns[-1][0] != ASSISTANT:
        raise BadRecord(LAST_NOT_ASSISTANT, f"{where}: the last turn is {turns[-1][0]}, "
                                            "not assistant")


def parse_pair(obj: dict[str, Any]) -> Pair:
    """The pair of one record, or ``BadRecord`` with the reason."""
    if "chosen" not in obj or "rejected" not in obj:
        keys = ", ".join(sorted(obj)[:8]) or "none"
        raise BadRecord(UNKNOWN_FORMAT, f"needs 'chosen' and 'rejected' (and 'prompt', or "
                                        f"whole conversations) (keys: {keys})")
    chosen = _turns(obj["chosen"], "chosen", ASSISTANT)
    rejected = _turns(obj["rejected"], "rejected", ASSISTANT)
    if "prompt" in obj:
        prompt = _turns(obj["prompt"], "prompt", USER)
    else:  # implicit prompt: the turns both conversations start with
        shared = 0
        while (shared < min(len(chosen), len(rejected)) - 1
               and chosen[shared] == rejected[shared]):
            shared += 1
        prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
    for turns, where in ((chosen, "chosen"), (rejected, "rejected")):
        if not turns:
            raise BadRecord(EMPTY_ASSISTANT, f"{where}: no turns")
        _check_response(turns, where)
    if chosen == rejected:
        raise BadRecord(IDENTICAL_PAIR, "chosen and rejected are the same response")
    return Pair(tuple(prompt), tuple(chosen), tuple(rejected))


def render_response(prompt: Sequence[Turn], response: Sequence[Turn], tokenizer: Tokenizer
                    ) -> tuple[list[int], list[int]]:
    """(ids, mask) of prompt + response in the model's chat format; the mask covers the
    response's assistant turns (an empty prompt renders as what precedes every turn)."""
    fmt = chat_format(tokenizer)
    ids, mask = fmt.render([*prompt, *response])
    context = len(fmt.render(prompt)[0])
    return ids, [0] * context + mask[context:]


def render_pairs(result: ReadResult, tokenizer: Tokenizer, max_tokens: int
                 ) -> list[tuple[Rendered, Rendered]]:
    """Render every kept pair; one whose two sequences exceed ``max_tokens`` is rejected.

    ``result`` is updated in place, so ``in == kept + rejected`` still holds.
    """
    kept, out = [], []
    for ex in result.examples:
        pair: Pair = ex.turns
        try:
            sides = [render_response(pair.prompt, resp, tokenizer)
                     for resp in (pair.chosen, pair.rejected)]
            total = sum(len(ids) for ids, _ in sides)
            bad = ((TOO_LONG, f"chosen + rejected are {total} tokens > seq_len={max_tokens}")
                   if total > max_tokens else None)
        except TemplateError as e:
            bad = (e.reason, e.detail)
        if bad is not None:
            result.counts.n_in -= 1  # counted again by reject()
            result.counts.kept -= 1
            result.reject(ex.file, ex.line, *bad)
            continue
        kept.append(ex)
        out.append(tuple(Rendered(ex.file, ex.line, ids, mask) for ids, mask in sides))
    result.examples = kept
    result.check()
    return out


def pack_pairs(pairs: Sequence[tuple[Rendered, Rendered]], seq_len: int, pad_id: int,
               reply_bytes: Sequence[tuple[int, int]]) -> Packed:
    """Whole pairs into rows of ``seq_len``: pair k's chosen and rejected are documents
    2k and 2k+1 of the stream (in packed order), so a token's document names its pair."""
    bins = bins_best_fit([len(c.ids) + len(r.ids) for c, r in pairs], seq_len)
    items = [side for pair in pairs for side in pair]
    nbytes = [b for both in reply_bytes for b in both]
    return pack_groups(items, [[2 * p + s for p in members for s in (0, 1)] for members in bins],
                       seq_len, pad_id, nbytes)


def pair_of_docs(docs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(pair index, is_chosen) of document indices in a ``pack_pairs`` stream."""
    return docs // 2, docs % 2 == 0
