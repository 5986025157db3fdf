"""A request as a job: the prompt rendered and the model's token stream set up.

Chat uses ``lmforge chat``'s ``ChatSession`` as it is: the request's messages become its
system message and history, and its ``prompt_ids`` (the model's own chat template, the
oldest exchanges left out when the context is short) and ``reply_tokens`` (``generate``
with the sampling settings) give the job, which stops at the session's stop ids (the
end-of-turn token, or EOS). Completions continue the prompt as ``lmforge generate`` does.
"""

from __future__ import annotations

import random

import torch

from lmforge.chat import ChatSession
from lmforge.errors import LmforgeError
from lmforge.finetune.records import ASSISTANT, SYSTEM, USER, Turn
from lmforge.model.generate import generate
from lmforge.serve.errors import ApiError
from lmforge.serve.generation import Job
from lmforge.serve.models import ServedModel
from lmforge.serve.schemas import ChatRequest, CompletionRequest


def split_messages(request: ChatRequest) -> tuple[str | None, list[Turn], str]:
    """(system message, earlier exchanges, the last user message) of a chat request.

    The shape ``lmforge chat`` keeps: at most one system message, first; then user and
    assistant in turn; the last from the user. Anything else is a one-line 400.
    """
    messages = [(m.role, m.text()) for m in request.messages]
    system = None
    if messages[0][0] == SYSTEM:
        system, messages = messages[0][1], messages[1:]
    for i, (role, _) in enumerate(messages):
        want = USER if i % 2 == 0 else ASSISTANT
        if role != want:
            at = i + (system is not None)
            raise ApiError(400, f"messages[{at}]: expected a {want} message, not {role} "
                           "(one system message first, then user and assistant in turn)",
                           param=f"messages.{at}.role")
    if not messages or messages[-1][0] != USER:
        raise ApiError(400, "the last message must be the user's", param="messages")
    return system, messages[:-1], messages[-1][1]


def chat_job(served: ServedModel, request: ChatRequest, max_tokens: int) -> Job:
    """The job answering ``request`` with ``served``'s chat template."""
    if served.chat is None:
        raise ApiError(400, f"model '{served.name}' has no chat format ({served.chat_problem}); "
                       "use /v1/completions", param="model")
    system, history, text = split_messages(request)
    try:
        session = ChatSession(served.model, served.tokenizer, system=system,
                              max_new_tokens=max_tokens, temperature=request.temperature,
                              top_p=request.top_p, seed=_seed(request.seed))
        session.history = history
        prompt = session.prompt_ids(text)
    except (LmforgeError, ValueError) as e:  # too long for the context; a template's refusal
        raise ApiError(400, str(e), param="messages") from None
    return Job(session.reply_tokens(prompt), served.tokenizer, session.stop_ids,
               request.stops(), len(prompt))


def completion_job(served: ServedModel, request: CompletionRequest, max_tokens: int) -> Job:
    """The job continuing ``request``'s prompt (no template; stops at EOS)."""
    tokenizer = served.tokenizer
    prompt = tokenizer.encode(request.text())
    if not prompt:
        raise ApiError(400, "'prompt' is empty", param="prompt")
    eos = tokenizer.eos_id if tokenizer.eos_id >= 0 else None
    # sample_next draws on the CPU whatever the model's device: a CPU generator.
    tokens = generate(served.model, prompt, max_tokens, temperature=request.temperature,
                      top_p=request.top_p, eos_id=eos,
                      generator=torch.Generator().manual_seed(_seed(request.seed)))
    return Job(tokens, tokenizer, {eos} if eos is not None else set(), request.stops(),
               len(prompt))


def _seed(seed: int | None) -> int:
    """The request's seed, or a fresh one (OpenAI's sampling is not reproducible unless
    a seed is given)."""
    return random.randrange(2 ** 63) if seed is None else seed
