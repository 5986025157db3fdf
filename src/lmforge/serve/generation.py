"""A job's token stream run on a worker thread, its text handed to the event loop.

The worker reuses ``lmforge chat``'s ``stream_reply`` (whole-reply decoding that holds
back a half-formed character, stop at the first stop id) with a text sink in place of
the terminal: the sink holds back what may be the start of a ``stop`` string and ends
the reply at one. The worker checks the ticket's ``cancel`` before every token, so a
client that goes away stops its generation within a token.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Generator
from concurrent.futures import Executor
from dataclasses import dataclass, field

from lmforge.chat import stream_reply
from lmforge.serve.slots import Ticket
from lmforge.tokenizer import Tokenizer

_END = object()  # the worker's last event


@dataclass
class Job:
    """What to run: the token stream (from ``generate``) and how to end and decode it."""

    tokens: Generator[int, None, None]
    tokenizer: Tokenizer
    stop_ids: set[int]
    stops: list[str] = field(default_factory=list)
    prompt_tokens: int = 0


@dataclass
class Outcome:
    """How a finished job ended: OpenAI's ``finish_reason`` and the tokens generated
    (a stop id counts: the model produced it)."""

    finish_reason: str
    completion_tokens: int


class _StopFound(Exception):
    """A stop string appeared: the reply ends before it."""


class TextSink:
    """The ``out`` that ``stream_reply`` writes to: passes the text on to ``emit`` but
    holds back a tail that may begin a stop string, and ends the reply at one."""

    def __init__(self, emit: Callable[[str], None], stops: list[str]) -> None:
        self.emit, self.stops = emit, stops
        self.text, self.sent = "", 0

    def write(self, s: str) -> int:
        """Take more of the reply; raise ``_StopFound`` once a stop string is in it."""
        self.text += s
        # Nothing sent can begin a stop string (it was held back), so look from there.
        hits = [i for i in (self.text.find(stop, self.sent) for stop in self.stops) if i >= 0]
        if hits:
            self._send(min(hits))
            raise _StopFound
        held = max((k for stop in self.stops for k in range(1, len(stop))
                    if self.text.endswith(stop[:k])), default=0)
        self._send(len(self.text) - held)
        return len(s)

    def flush(self) -> None:
        """Nothing buffered beyond what ``write`` holds back on purpose."""

    def finish(self) -> None:
        """The reply ended without a stop string: send what was held back."""
        self._send(len(self.text))

    def _send(self, end: int) -> None:
        if end > self.sent:
            self.emit(self.text[self.sent:end])
            self.sent = end


def run_job(job: Job, emit: Callable[[str], None], cancel: threading.Event) -> Outcome:
    """Generate ``job`` on this (worker) thread, handing each new piece of text to
    ``emit``, until a stop id, a stop string, ``max_tokens`` or ``cancel``."""
    count = 0

    def counted() -> Generator[int, None, None]:
        nonlocal count
        for token in job.tokens:
            if cancel.is_set():
                return
            count += 1
            yield token

    sink = TextSink(emit, job.stops)
    try:
        ids = stream_reply(counted(), job.tokenizer, job.stop_ids, sink)  # type: ignore[arg-type]
    except _StopFound:
        return Outcome("stop", count)
    finally:
        job.tokens.close()  # generate's cleanup now, on this thread
    sink.finish()
    if cancel.is_set():
        return Outcome("cancelled", count)
    return Outcome("stop" if ids and ids[-1] in job.stop_ids else "length", count)


class Generation:
    """One request's generation, seen from the event loop: ``deltas`` waits for the
    model, runs the job on ``executor`` and yields its text; ``outcome`` after."""

    def __init__(self, job: Job, ticket: Ticket, executor: Executor) -> None:
        self.job, self.ticket, self.executor = job, ticket, executor
        self.outcome: Outcome | None = None

    async def deltas(self) -> AsyncIterator[str]:
        """The answer's text, piece by piece, as the worker makes it."""
        await self.ticket.acquire()
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def emit(text: object) -> None:  # on the worker thread
            loop.call_soon_threadsafe(events.put_nowait, text)

        def work() -> Outcome:
            try:
                return run_job(self.job, emit, self.ticket.cancel)
            finally:
                emit(_END)

        worker = loop.run_in_executor(self.executor, work)
        self.ticket.running(worker)
        while (item := await events.get()) is not _END:
            yield item  # type: ignore[misc]
        self.outcome = await worker  # re-raises what failed in the worker

    def close(self) -> None:
        """The request is over: stop the worker if it still runs, free the place."""
        self.ticket.close()
