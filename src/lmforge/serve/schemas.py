"""The request fields this server honours, and the response bodies it sends.

Requests are checked by pydantic models that forbid every other field, so a field we do
not honour (``tools``, ``logprobs``, ``frequency_penalty`` ...) is refused by name rather
than silently ignored; ``n`` must be 1. ``parse`` turns the first problem into one line.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from lmforge.serve.errors import ApiError

# torch.Generator.manual_seed takes a signed or unsigned 64-bit seed.
SEED_MIN, SEED_MAX = -(2 ** 63), 2 ** 64 - 1
MAX_STOPS = 4  # as OpenAI's API


class _Strict(BaseModel):
    # strict: "0.5" is not a number and 1 is not a bool; extra: unknown fields refused.
    model_config = ConfigDict(extra="forbid", strict=True)


class TextPart(_Strict):
    """One part of a message's content; only text is understood."""

    type: Literal["text"]
    text: str


class Message(_Strict):
    """One chat message."""

    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]

    def text(self) -> str:
        """The content as one string (text parts joined)."""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(_Strict):
    """``stream_options``: usage always comes in the last chunk, asked for or not."""

    include_usage: bool = True


class _Sampling(_Strict):
    """The fields both endpoints honour."""

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)  # OpenAI's default and range
    top_p: float = Field(default=1.0, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError(f"only n=1 is served, not {n}")
        return n

    @field_validator("stop")
    @classmethod
    def _stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop sequences, not {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("a stop sequence is empty")
        return stop

    def stops(self) -> list[str]:
        """The stop sequences as a list."""
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class ChatRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)  # the newer name


class CompletionRequest(_Sampling):
    """``POST /v1/completions``."""

    prompt: str | list[str]

    def text(self) -> str:
        """The one prompt (a list must hold exactly one)."""
        if isinstance(self.prompt, str):
            return self.prompt
        if len(self.prompt) != 1:
            raise ApiError(400, f"'prompt': one prompt per request, not {len(self.prompt)}",
                           param="prompt")
        return self.prompt[0]


def parse(data: dict[str, Any], cls: type[_Strict]) -> Any:
    """``data`` as a ``cls`` request; the first problem as a one-line 400."""
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        if first["type"] == "extra_forbidden":
            raise ApiError(400, f"unsupported field '{where}': this server does not honour it",
                           param=where, code="unsupported_field") from None
        if first["type"] == "missing":
            raise ApiError(400, f"missing required field '{where}'", param=where) from None
        message = first["msg"].removeprefix("Value error, ")
        raise ApiError(400, f"'{where}': {message}", param=where) from None


def new_id(prefix: str) -> str:
    """A response id as OpenAI writes them (``chatcmpl-...``, ``cmpl-...``)."""
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """The usage object of an answer."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def chat_body(rid: str, model: str, text: str, finish: str, use: dict[str, int]
              ) -> dict[str, Any]:
    """A whole ``chat.completion``."""
    return {"id": rid, "object": "chat.completion", "created": int(time.time()),
            "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "logprobs": None, "finish_reason": finish}],
            "usage": use}


def chat_chunk(rid: str, model: str, delta: dict[str, str], finish: str | None = None,
               use: dict[str, int] | None = None) -> dict[str, Any]:
    """One ``chat.completion.chunk`` (the last one has ``finish_reason`` and usage)."""
    chunk = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()),
             "model": model,
             "choices": [{"index": 0, "delta": delta, "logprobs": None,
                          "finish_reason": finish}]}
    if use is not None:
        chunk["usage"] = use
    return chunk


def completion_body(rid: str, model: str, text: str, finish: str | None,
                    use: dict[str, int] | None) -> dict[str, Any]:
    """A ``text_completion``: the whole answer, or one streamed chunk of it."""
    body = {"id": rid, "object": "text_completion", "created": int(time.time()),
            "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}
    if use is not None:
        body["usage"] = use
    return body
