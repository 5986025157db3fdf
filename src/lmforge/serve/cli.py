"""``lmforge serve``: the command line, the loopback rule, and uvicorn."""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys

from lmforge.errors import LmforgeError

DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8000
KEY_ENV = "LMFORGE_API_KEY"  # a key kept out of the process list (and shell history)


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` only accepts connections from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def check_settings(args: argparse.Namespace) -> None:
    """One-line refusals before anything is loaded: no key on a non-loopback address,
    limits that make no sense."""
    if not is_loopback(args.host) and not args.api_key:
        raise LmforgeError(f"serve: --host {args.host} is not loopback; give --api-key (or "
                           f"{KEY_ENV}) so that only clients with the key are answered")
    for flag, value, least in (("--port", args.port, 0), ("--max-tokens", args.max_tokens, 1),
                               ("--max-body-bytes", args.max_body_bytes, 1),
                               ("--queue-size", args.queue_size, 0)):
        if value < least:
            raise LmforgeError(f"serve: {flag} must be at least {least}, not {value}")


def cmd_serve(args: argparse.Namespace) -> None:
    """Load the models and serve them until Ctrl-C."""
    import uvicorn

    from lmforge.serve.app import ServeSettings, create_app
    from lmforge.serve.models import default_specs, load_models, parse_specs

    check_settings(args)
    specs = parse_specs(args.model) if args.model else default_specs()
    models = load_models(specs, args.device, args.queue_size)
    settings = ServeSettings(api_key=args.api_key or None, max_body_bytes=args.max_body_bytes,
                             max_tokens_cap=args.max_tokens, queue_size=args.queue_size)
    for m in models.values():
        kind = "chat + completions" if m.chat is not None else "completions only"
        print(f"serve: {m.name} = {m.path} ({kind})", file=sys.stderr)
    print(f"serve: http://{args.host}:{args.port}/v1", file=sys.stderr)
    uvicorn.run(create_app(models, settings), host=args.host, port=args.port,
                log_level=args.log_level)


def add_serve_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``serve [--model NAME=PATH ...] [--host H] [--port P] [--api-key K] ...``."""
    s = subparsers.add_parser("serve", help="serve models over an OpenAI-compatible HTTP API")
    s.add_argument("--model", action="append", default=[], metavar="NAME=PATH",
                   help="a model to serve under NAME (repeat); default: models/final, "
                        "models/sft and models/dpo as base, sft and dpo (those that exist)")
    s.add_argument("--host", default=DEFAULT_HOST,
                   help=f"address to bind (default {DEFAULT_HOST}; any other needs --api-key)")
    s.add_argument("--port", type=int, default=DEFAULT_PORT)
    s.add_argument("--api-key", default=os.environ.get(KEY_ENV),
                   help=f"clients must send 'Authorization: Bearer KEY' (default ${KEY_ENV})")
    s.add_argument("--max-tokens", type=int, default=1024,
                   help="cap on a request's max_tokens (past it: 400)")
    s.add_argument("--max-body-bytes", type=int, default=1 << 20,
                   help="cap on a request body (past it: 413)")
    s.add_argument("--queue-size", type=int, default=8,
                   help="requests that may wait for a busy model (past it: 429)")
    s.add_argument("--device", default=None, help="default: cuda when there is one, else cpu")
    s.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    s.set_defaults(func=cmd_serve)
