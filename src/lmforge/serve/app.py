"""The HTTP app: routes, the API key, the body and ``max_tokens`` caps, error bodies.

The page at ``/`` (``page_routes``) needs no key: it holds nothing but the page; its
requests to the API carry the key the user types into it.

Every failure leaves as OpenAI's error object with one line of reason: a bad request 400,
a wrong or missing key 401, an unknown model or route 404, a body past the cap 413, a
full queue 429 (with ``Retry-After``). Streams are server-sent events: ``data: {...}``
chunks, the last with ``finish_reason`` and usage, then ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from lmforge.serve.errors import ApiError, error_body
from lmforge.serve.generation import Generation, Job
from lmforge.serve.jobs import chat_job, completion_job
from lmforge.serve.models import ServedModel
from lmforge.serve.page_routes import page_routes
from lmforge.serve.schemas import (
    ChatRequest,
    CompletionRequest,
    chat_body,
    chat_chunk,
    completion_body,
    new_id,
    parse,
    usage,
)

# How often a non-streamed request asks whether its client is still there: a hang-up
# stops its generation within this (and a token); a request still waiting for the model
# asks less often: with every request of a full queue (32 a model) asking every 0.1 s, one
# load run answered 9.3 requests a second against 10.2-10.7 without asking (two cores).
DISCONNECT_POLL_S = 0.1
WAITING_POLL_S = 1.0
CLIENT_GONE = 499  # nginx's status for a request its client closed; nobody receives it


@dataclass(frozen=True)
class ServeSettings:
    """The server's limits and key."""

    api_key: str | None = None
    max_body_bytes: int = 1 << 20
    max_tokens_cap: int = 1024
    chat_max_tokens: int = 256  # when a chat request gives none (lmforge chat's default)
    completion_max_tokens: int = 16  # OpenAI's default for completions
    queue_size: int = 8


def create_app(models: dict[str, ServedModel], settings: ServeSettings) -> Starlette:
    """The Starlette app serving ``models``."""
    app = Starlette(
        routes=[*page_routes(),
                Route("/v1/models", list_models, methods=["GET"]),
                Route("/v1/chat/completions", chat_completions, methods=["POST"]),
                Route("/v1/completions", completions, methods=["POST"])],
        exception_handlers={ApiError: _api_error, HTTPException: _http_error,
                            Exception: _server_error})
    app.state.models, app.state.settings = models, settings
    # One worker thread per model: a model generates one answer at a time anyway.
    app.state.executor = ThreadPoolExecutor(max(1, len(models)), thread_name_prefix="serve")
    return app


async def list_models(request: Request) -> Response:
    """``GET /v1/models``: the served names."""
    _check_key(request)
    models: dict[str, ServedModel] = request.app.state.models
    return JSONResponse({"object": "list", "data": [_model_entry(m) for m in models.values()]})


def _model_entry(m: ServedModel) -> dict[str, Any]:
    """One model as /v1/models lists it; beside OpenAI's fields (clients ignore extra
    ones), whether it chats and its headline figures, for the page."""
    entry = {"id": m.name, "object": "model", "created": m.created, "owned_by": "lmforge",
             "chat": m.chat is not None}
    if m.headline is not None:
        entry["headline"] = m.headline
    return entry


async def chat_completions(request: Request) -> Response:
    """``POST /v1/chat/completions``."""
    served, req, max_tokens = await _request(request, ChatRequest)
    if req.max_completion_tokens is not None:
        if req.max_tokens is not None:
            raise ApiError(400, "give max_tokens or max_completion_tokens, not both",
                           param="max_completion_tokens")
        max_tokens = _max_tokens(request, req.max_completion_tokens, "max_completion_tokens", 0)
    job = chat_job(served, req, max_tokens)
    rid = new_id("chatcmpl")

    def chunk(text: str) -> dict[str, Any]:
        return chat_chunk(rid, served.name, {"content": text})

    def last(text: str, finish: str, use: dict[str, int]) -> dict[str, Any]:
        if req.stream:
            return chat_chunk(rid, served.name, {}, finish, use)
        return chat_body(rid, served.name, text, finish, use)

    first = chat_chunk(rid, served.name, {"role": "assistant", "content": ""})
    return await _answer(request, served, job, req.stream, chunk, last, first)


async def completions(request: Request) -> Response:
    """``POST /v1/completions``."""
    served, req, max_tokens = await _request(request, CompletionRequest)
    job = completion_job(served, req, max_tokens)
    rid = new_id("cmpl")

    def chunk(text: str) -> dict[str, Any]:
        return completion_body(rid, served.name, text, None, None)

    def last(text: str, finish: str, use: dict[str, int]) -> dict[str, Any]:
        return completion_body(rid, served.name, "" if req.stream else text, finish, use)

    return await _answer(request, served, job, req.stream, chunk, last, None)


async def _request(request: Request, cls: type) -> tuple[ServedModel, Any, int]:
    """The key checked, the body read and parsed, the model found, ``max_tokens`` capped."""
    _check_key(request)
    req = parse(await _read_json(request), cls)
    models: dict[str, ServedModel] = request.app.state.models
    served = models.get(req.model)
    if served is None:
        raise ApiError(404, f"model '{req.model}' is not served here (served: "
                       f"{', '.join(models)})", param="model", code="model_not_found")
    settings: ServeSettings = request.app.state.settings
    default = (settings.chat_max_tokens if cls is ChatRequest
               else settings.completion_max_tokens)
    return served, req, _max_tokens(request, req.max_tokens, "max_tokens", default)


def _max_tokens(request: Request, asked: int | None, field: str, default: int) -> int:
    """The tokens to generate: as asked (at most the cap, else a 400), or the default."""
    cap = request.app.state.settings.max_tokens_cap
    if asked is None:
        return min(default, cap)
    if asked > cap:
        raise ApiError(400, f"'{field}' is {asked}, past this server's cap of {cap}",
                       param=field)
    return asked


async def _answer(request: Request, served: ServedModel, job: Job, stream: bool,
                  chunk: Callable[[str], dict], last: Callable[[str, str, dict], dict],
                  first: dict | None) -> Response:
    """Queue ``job`` on ``served`` and answer: one body, or a stream of chunks."""
    generation = Generation(job, served.slots.reserve(), request.app.state.executor)
    if stream:
        events = _events(generation, job, chunk, last, first)
        return EventStream(events, on_close=generation.close)
    try:
        text = await _whole_answer(request, generation)
    finally:
        generation.close()
    if text is None:  # the client hung up: nobody reads this
        return Response(status_code=CLIENT_GONE)
    outcome = generation.outcome
    return JSONResponse(last(text, outcome.finish_reason,
                             usage(job.prompt_tokens, outcome.completion_tokens)))


async def _whole_answer(request: Request, generation: Generation) -> str | None:
    """The whole text of a non-streamed answer, or None when its client hangs up first.

    Nothing is sent before the answer is whole, so only asking the connection tells (a
    streamed answer learns it from its next write). On a hang-up the collection is
    cancelled, waiting for the model or generating; the caller's ``close`` then stops
    the worker and frees the place."""
    async def collect() -> str:
        return "".join([piece async for piece in generation.deltas()])

    async def hung_up() -> None:
        while not await request.is_disconnected():
            await asyncio.sleep(DISCONNECT_POLL_S if generation.ticket.generating
                                else WAITING_POLL_S)

    answer, watch = asyncio.ensure_future(collect()), asyncio.ensure_future(hung_up())
    try:
        await asyncio.wait({answer, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if answer.done():
        return answer.result()
    answer.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await answer
    return None


async def _events(generation: Generation, job: Job, chunk: Callable[[str], dict],
                  last: Callable[[str, str, dict], dict], first: dict | None
                  ) -> AsyncIterator[str]:
    """The server-sent events of a streamed answer (an error after the start is sent as
    an error event: the status line has gone already)."""
    try:
        if first is not None:
            yield _event(first)
        async for piece in generation.deltas():
            yield _event(chunk(piece))
        outcome = generation.outcome
        yield _event(last("", outcome.finish_reason,
                          usage(job.prompt_tokens, outcome.completion_tokens)))
    except Exception as e:  # noqa: BLE001 -- reported to the client, in one line
        yield _event(error_body(500, f"generation failed: {type(e).__name__}: {e}"))
    yield "data: [DONE]\n\n"


def _event(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


class EventStream(StreamingResponse):
    """A server-sent-event response that calls ``on_close`` however it ends: finished,
    failed, or the client gone (Starlette then stops iterating without closing it)."""

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001 -- ASGI's
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def _check_key(request: Request) -> None:
    """401 unless the request carries the server's key (when it has one)."""
    key = request.app.state.settings.api_key
    if key is None:
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not given:
        raise ApiError(401, "missing API key: send 'Authorization: Bearer <key>'",
                       code="invalid_api_key")
    if not hmac.compare_digest(given.strip().encode(), key.encode()):
        raise ApiError(401, "wrong API key", code="invalid_api_key")


async def _read_json(request: Request) -> dict[str, Any]:
    """The body as a JSON object, at most ``max_body_bytes`` (413 past it).

    A body somewhat past the cap is read to its end before the 413 is sent: a server that
    answers and closes while the client is still sending resets the connection, and the
    client sees that instead of the answer. One far past it (16 times) is refused unread.
    """
    cap = request.app.state.settings.max_body_bytes
    too_big = ApiError(413, f"the request body is past this server's cap of {cap} bytes",
                       code="request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > 16 * cap:
        raise too_big
    body, size = bytearray(), 0
    async for piece in request.stream():
        size += len(piece)
        if size > 16 * cap:
            raise too_big
        if size <= cap:
            body += piece
    if size > cap:
        raise too_big
    try:
        data = json.loads(body)
    except UnicodeDecodeError:
        raise ApiError(400, "the body is not UTF-8 JSON") from None
    except json.JSONDecodeError as e:
        raise ApiError(400, f"the body is not valid JSON: {e.msg} at line {e.lineno} "
                       f"column {e.colno}") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the body must be a JSON object")
    return data


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own refusals (no such route, wrong method) in OpenAI's shape."""
    assert isinstance(exc, HTTPException)
    message = {404: f"no route {request.url.path}",
               405: f"{request.method} is not allowed on {request.url.path}"}
    return JSONResponse(error_body(exc.status_code, message.get(exc.status_code, exc.detail)),
                        status_code=exc.status_code, headers=exc.headers)


async def _server_error(request: Request, exc: Exception) -> Response:
    return JSONResponse(error_body(500, f"internal error: {type(exc).__name__}: {exc}"),
                        status_code=500)
