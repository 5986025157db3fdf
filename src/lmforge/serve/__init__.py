"""``lmforge serve``: the pipeline's models behind an OpenAI-compatible HTTP API.

``POST /v1/chat/completions`` and ``POST /v1/completions`` (streamed as server-sent
events when ``stream`` is set) and ``GET /v1/models``, on Starlette + uvicorn. Chat goes
through each model's own chat template and stops at its end-of-turn token, as
``lmforge chat`` does (the same ``ChatSession`` renders the prompt and samples).

Modules: ``cli`` (the command), ``app`` (routes, auth, body limits), ``models`` (the
served list), ``schemas`` (request fields, response bodies), ``jobs`` (a request as a
prompt and a token stream), ``generation`` (the worker thread and its stream of text),
``slots`` (one generation per model, a bounded queue), ``errors`` (OpenAI's error shape).
"""
