"""A model's own chat template: the Jinja text an open model ships (``chat_template.jinja``,
or ``chat_template`` in ``tokenizer_config.json``), rendered as transformers renders it,
so fine-tuning and chat read conversations the way the model was tuned to read them.

Ids: the rendered text encoded with the model's tokenizer, special tokens in the text
matched as such and nothing added around it, which is what ``apply_chat_template(...,
tokenize=True)`` gives (tested against it).

Loss mask, by prefixes: for each assistant turn ``k`` the conversation up to it is
rendered with the generation prompt (``<|im_start|>assistant\\n`` in ChatML, the header
``<|start_header_id|>assistant<|end_header_id|>\\n\\n`` in Llama 3) and again with that
turn; the ids between the two are the turn, and the mask covers them up to and including
its end-of-turn token -- the last special token of the span (``<|im_end|>``,
``<|eot_id|>``) -- so the model learns to stop, but not the newline some templates put
after it. This needs each rendering to be a prefix of the next, in ids; a template that
rewrites earlier turns when a later one follows (Qwen3's drops the reasoning of earlier
assistant turns) breaks that: ``render`` refuses such a conversation with the reason
``template_not_prefix`` rather than put a mask in the wrong place, and fine-tuning data
(``examples``) trains it as one example per assistant turn, each rendered as the model
sees it when it writes that turn.

A message holding a special token's text (``<|im_end|>`` typed in a question) would, as
in transformers, encode to that token and so close a turn the writer never closed: such
a conversation is rejected with the reason ``special_token_in_text`` (counted, as every
reject), so our ids equal ``apply_chat_template``'s on everything that is kept.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from lmforge.errors import InputError
from lmforge.finetune.records import ASSISTANT, Turn

TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"
NOT_PREFIX = "template_not_prefix"
SPECIAL_IN_TEXT = "special_token_in_text"
# What transformers hands a template besides the messages (its special tokens map).
SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


class TemplateError(InputError):
    """A conversation this template cannot render with a well-placed loss mask: a
    record is rejected for it (``reason``), a chat message refused in one line."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


def read_template(directory: str | Path) -> tuple[str, str] | None:
    """(template, where it came from) for a tokenizer or model folder, or None.

    ``chat_template.jinja`` first (transformers 5 writes it), then ``chat_template`` in
    ``tokenizer_config.json`` (a string, or a list of named templates: ``default``).
    """
    directory = Path(directory)
    jinja = directory / TEMPLATE_FILE
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8"), str(jinja)
    config = directory / TOKENIZER_CONFIG
    if not config.is_file():
        return None
    try:
        value = json.loads(config.read_text(encoding="utf-8")).get("chat_template")
    except (json.JSONDecodeError, AttributeError, UnicodeDecodeError) as e:
        raise InputError(f"{config}: unreadable ({e})") from None
    if isinstance(value, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
    return (value, f"{config}: chat_template") if isinstance(value, str) and value else None


def special_tokens(directory: str | Path) -> dict[str, str]:
    """``{"bos_token": "<|im_start|>", ...}`` from ``tokenizer_config.json`` (strings or
    ``{"content": ...}`` entries), as the template sees them; absent ones are left out."""
    config = Path(directory) / TOKENIZER_CONFIG
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return {}
    out = {}
    for name in SPECIAL_NAMES:
        value = data.get(name)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            out[name] = value
    return out


def stop_token_ids(directory: str | Path) -> set[int]:
    """The EOS ids ``generation_config.json`` lists (one or several), if it is there."""
    path = Path(directory) / "generation_config.json"
    try:
        value = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
    except (OSError, json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        return set()
    values = value if isinstance(value, list) else [value]
    return {v for v in values if isinstance(v, int) and not isinstance(v, bool)}


def _environment() -> ImmutableSandboxedEnvironment:
    """The sandbox transformers renders chat templates in (trim_blocks, lstrip_blocks,
    loop controls, its ``tojson``, ``raise_exception`` and ``strftime_now``)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


@dataclass
class ModelTemplate:
    """A chat template with the tokenizer it renders for.

    ``encode`` turns text into ids (special tokens in the text matched, none added);
    ``special_ids`` are the tokenizer's special (added) token ids and ``special_texts``
    their strings (refused inside a message); ``stop_ids`` are the ids generation stops
    at (the configured EOS ids; the end-of-turn token found by rendering a probe
    conversation is added at construction).
    """

    template: str
    where: str
    encode: Callable[[str], list[int]]
    special_ids: frozenset[int]
    tokens: dict[str, str]
    stop_ids: frozenset[int] = frozenset()
    special_texts: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        try:
            self._compiled = _environment().from_string(self.template)
        except jinja2.TemplateError as e:
            raise InputError(f"{self.where}: not a valid Jinja template ({e})") from None
        self._end = self._find_end_of_turn()
        self.stop_ids = frozenset(self.stop_ids) | {self._end}

    def text(self, turns: Sequence[Turn], add_generation_prompt: bool = False) -> str:
        """The conversation as the template writes it."""
        for i, (_, content) in enumerate(turns):
            found = next((t for t in self.special_texts if t in content), None)
            if found is not None:
                raise TemplateError(SPECIAL_IN_TEXT, f"turn {i + 1} holds {found!r}, which "
                                    "would encode to the special token")
        messages = [{"role": role, "content": content} for role, content in turns]
        try:
            return self._compiled.render(messages=messages, tools=None, documents=None,
                                         add_generation_prompt=add_generation_prompt,
                                         **self.tokens)
        except jinja2.TemplateError as e:  # raise_exception() in the template, or a bug
            raise TemplateError("template_error", str(e)) from None

    def render(self, turns: Sequence[Turn]) -> tuple[list[int], list[int]]:
        """(ids, loss_mask): 1 on each assistant turn's content and end-of-turn token."""
        ids = self.encode(self.text(turns))
        mask = [0] * len(ids)
        for k, (role, _) in enumerate(turns):
            if role != ASSISTANT:
                continue
            start, end = self._turn_span(turns, k, ids)
            for i in range(start, end):
                mask[i] = 1
        return ids, mask

    def examples(self, turns: Sequence[Turn]) -> list[tuple[list[int], list[int]]]:
        """The (ids, loss_mask) pairs a conversation trains as: itself, as :meth:`render`
        writes it; or, when the template rewrites earlier turns once a later one follows
        (Qwen3 drops the reasoning block of every assistant turn but the last), one
        example per assistant turn -- the conversation up to that turn, the mask on that
        turn alone -- which is the text the model sees when it writes that turn."""
        try:
            return [self.render(turns)]
        except TemplateError as e:
            if e.reason != NOT_PREFIX:
                raise
        out = []
        for k, (role, _) in enumerate(turns):
            if role != ASSISTANT:
                continue
            ids = self.encode(self.text(turns[:k + 1]))
            start, end = self._turn_span(turns, k, ids)
            out.append((ids, [0] * start + [1] * (end - start) + [0] * (len(ids) - end)))
        return out

    def generation_prompt(self, turns: Sequence[Turn]) -> list[int]:
        """The ids the next assistant turn is generated from."""
        return self.encode(self.text(turns, add_generation_prompt=True))

    @property
    def pad_id(self) -> int:
        """An id to pad packed rows with (never a target): the end of turn."""
        return self.end_of_turn_id()

    def end_of_turn_id(self) -> int:
        """The token that closes an assistant turn."""
        return self._end

    def _find_end_of_turn(self) -> int:
        """The end-of-turn token, read off a rendered probe conversation."""
        probe = [("user", "Hi"), (ASSISTANT, "Hello")]
        before = self.generation_prompt(probe[:1])
        after = self.encode(self.text(probe))
        ends = [t for t in after[len(before):] if t in self.special_ids]
        if not ends:
            raise InputError(f"{self.where}: an assistant turn ends in no special token, so "
                             "there is no end-of-turn to learn or to stop generation at")
        return ends[-1]

    def _turn_span(self, turns: Sequence[Turn], k: int, ids: list[int]) -> tuple[int, int]:
        """[start, end) of assistant turn ``k`` in ``ids``, end just past its last special
        token (its end of turn)."""
        before = self.generation_prompt(turns[:k])
        after = self.encode(self.text(turns[:k + 1]))
        if after[:len(before)] != before or ids[:len(after)] != after:
            raise TemplateError(NOT_PREFIX, f"turn {k + 1}: the template renders the "
                                "conversation before this turn differently once it follows")
        span = after[len(before):]
        last = max((i for i, t in enumerate(span) if t in self.special_ids), default=None)
        end = len(before) + (last + 1 if last is not None else len(span))
        return len(before), end
