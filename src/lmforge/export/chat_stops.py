"""Where a chat model's reply ends, as both exports write it.

The end of turn is the chat template's own: ``<|end|>`` for lmforge's template, or the
token an imported model's template closes an assistant turn with, read off a rendered
conversation (:meth:`~lmforge.finetune.model_template.ModelTemplate.end_of_turn_id`).
It is not "the stop id that is not EOS": Qwen2.5/Qwen3-Instruct's EOS *is* its end of
turn (``<|im_end|>``), as Llama 3.1 Instruct's is (``<|eot_id|>``), and the other ids
their generation_config.json stops at (``<|endoftext|>``, ``<|end_of_text|>``,
``<|eom_id|>``) close a document or a tool call, not a reply.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lmforge.errors import InputError
from lmforge.finetune.model_template import ModelTemplate, read_template
from lmforge.finetune.template import CHAT_TEMPLATE, END_MARKER, chat_format
from lmforge.tokenizer import Tokenizer


@dataclass(frozen=True)
class ChatStops:
    """A chat model's template and the ids its replies stop at."""

    template: str  # the Jinja chat template (lmforge's own, or the model's)
    own: bool  # whether it is lmforge's template (a tokenizer with our chat markers)
    end: int  # the end-of-turn id
    ids: tuple[int, ...]  # every id the template's turns stop at, the end of turn first


def chat_stops(tok_path: Path) -> ChatStops | None:
    """The chat template and stop ids of the tokenizer at ``tok_path``; None for a base
    model (no template of its own and no lmforge chat markers)."""
    tokenizer = Tokenizer.load(tok_path)
    try:
        fmt = chat_format(tokenizer)
    except InputError:
        # chat_format falls back to lmforge's template, which needs the chat markers;
        # a tokenizer without them and without a template of its own is a base model's.
        if tokenizer.backend == "hf" and read_template(tok_path.parent) is not None:
            raise  # a template of its own that cannot be used: say why, do not drop it
        return None
    if isinstance(fmt, ModelTemplate):
        end = fmt.end_of_turn_id()
        template, own = fmt.template, False
    else:
        end, template, own = fmt.markers[END_MARKER], CHAT_TEMPLATE, True
    # The template's stop ids hold the tokenizer's EOS and those generation_config.json
    # lists (an imported model's); the end of turn leads, the rest in id order.
    return ChatStops(template, own, end, (end, *sorted(set(fmt.stop_ids) - {end})))

