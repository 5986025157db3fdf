"""``lmforge ...``: the commands a user runs by hand beside the DVC pipeline."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from lmforge.errors import InputError, LmforgeError

# Each command's parser is built by its own module, and most of those import torch
# (2-3 s). Only the command given is imported, so `lmforge mix fit` or `lmforge filter
# report` start in well under a second; `lmforge --help` builds them all to list them.
# name -> "module:function", the function adding the command's parser to the subparsers.
COMMANDS: dict[str, str] = {
    "chat": "lmforge.chat:add_chat_parser",
    "export": "lmforge.cli:_add_export_parsers",
    "import": "lmforge.export.hf:add_import_parser",
    "inspect": "lmforge.shards.inspect:add_inspect_parser",
    "train": "lmforge.train.cli:add_train_parser",
    "checkpoints": "lmforge.train.checkpoints_cli:add_checkpoints_parser",
    "filter": "lmforge.data.filter_cli:add_filter_parser",
    "eval": "lmforge.evaluate.harness_cli:add_eval_parser",
    "plan": "lmforge.plan.cli:add_plan_parser",
    "mix": "lmforge.mixture.cli:add_mix_parser",
    "serve": "lmforge.serve.cli:add_serve_parser",
}


def cmd_generate(args: argparse.Namespace) -> None:
    """Stream a continuation of each prompt from a trained model."""
    import torch

    from lmforge.model import load_model
    from lmforge.model.generate import generate
    from lmforge.tokenizer import Tokenizer

    model_dir = Path(args.model)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model, _ = load_model(model_dir, device=device)
    # A final model dir carries its tokenizer; a checkpoint uses the pipeline's.
    default_tok = model_dir if model_dir.is_dir() else Path("models/tokenizer")
    tokenizer = Tokenizer.load(args.tokenizer or default_tok)
    prompts = list(args.prompt)
    if args.file:
        try:
            text = Path(args.file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise InputError(f"{args.file}: cannot read prompts ({e})") from None
        prompts += [p for p in text.split("\n\n") if p]
    if any(not p for p in prompts):
        raise InputError("generate: a prompt is empty")
    if not prompts:
        raise LmforgeError("generate: give a prompt (argument) or --file")
    for i, prompt in enumerate(prompts):
        if i:
            print("\n" + "-" * 40)
        ids = torch.tensor([tokenizer.encode(prompt)], dtype=torch.long, device=device)
        gen = torch.Generator(device=device).manual_seed(args.seed)
        sys.stdout.write(prompt)
        out: list[int] = []
        printed = ""
        for token in generate(model, ids, args.max_new_tokens, temperature=args.temperature,
                              top_k=args.top_k, top_p=args.top_p,
                              eos_id=tokenizer.eos_id, generator=gen):
            out.append(token)
            # Decode the whole continuation each time: byte-fallback pieces only form
            # a character together, so print the stable prefix that grew.
            text = tokenizer.decode(out)
            if not text.endswith("\ufffd"):
                sys.stdout.write(text[len(printed):])
                sys.stdout.flush()
                printed = text
        sys.stdout.write(tokenizer.decode(out)[len(printed):] + "\n")


def _add_export_parsers(sub: argparse._SubParsersAction) -> None:
    """``lmforge export hf|gguf``: the formats share one ``export`` command."""
    from lmforge.export.gguf import add_gguf_parser
    from lmforge.export.hf import add_export_parser

    add_gguf_parser(add_export_parser(sub))


def _add_generate_parser(sub: argparse._SubParsersAction) -> None:
    g = sub.add_parser("generate", help="generate text from a trained model")
    g.add_argument("prompt", nargs="*", help="prompt text (several allowed)")
    g.add_argument("--model", default="models/final",
                   help="models/final, or a checkpoint file under models/checkpoints/<run>/")
    g.add_argument("--tokenizer", default=None,
                   help="tokenizer.model, tokenizer.json or a folder with one (default: the "
                        "one beside the model)")
    g.add_argument("--file", help="read prompts from a file, separated by blank lines")
    g.add_argument("--max-new-tokens", type=int, default=200)
    g.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=50, help="0 = off")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--device", default=None)
    g.set_defaults(func=cmd_generate)


def _command_adder(name: str) -> Callable[[argparse._SubParsersAction], object]:
    module, _, function = COMMANDS[name].partition(":")
    return getattr(importlib.import_module(module), function)


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The ``lmforge`` parser: every command's, or only that of the command ``argv`` names."""
    parser = argparse.ArgumentParser(prog="lmforge", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    first = argv[0] if argv else None
    _add_generate_parser(sub)
    if first in COMMANDS:
        _command_adder(first)(sub)
    elif first != "generate":  # --help, no command or a misspelt one: list them all
        for name in COMMANDS:
            _command_adder(name)(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``lmforge`` console script."""
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    try:
        args.func(args)
    except LmforgeError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except BrokenPipeError:  # `lmforge generate ... | head`
        sys.exit(0)


if __name__ == "__main__":
    main()
