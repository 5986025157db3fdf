"""``lmforge chat``: talk to a fine-tuned model through its chat format.

Each user message is rendered with the conversation so far, in the model's own chat
template when its tokenizer folder has one (an imported SmolLM2, Qwen or Llama 3: ChatML
or Llama 3's headers), else ours (``generation_prompt``: BOS, ``<|role|>content<|end|>``
per turn, then ``<|assistant|>``), and the reply is streamed from ``generate`` (one
prefill, then the KV cache) until the end-of-turn token (``<|end|>``, ``<|im_end|>``,
``<|eot_id|>``) -- or the tokenizer's EOS, which also ends a document -- or
``max_new_tokens``. Greedy by default, so a conversation is reproducible.

Interactive (no ``-m``): a REPL on stdin; ``/reset`` starts over (the system message is
kept), ``/exit`` or end of input quits. One-shot (``-m`` once or more): each message is
a user turn answered in order, and only the replies are printed (or, with ``--json``,
the whole conversation as ``{"messages": [...]}``).

When the conversation outgrows the model's context, its oldest exchanges (a user turn
and the reply to it) are left out of the prompt, never the system message, so that the
prompt leaves ``max_new_tokens`` (at most half the context) for the reply; stderr says
so once. The history keeps every turn: only a finished reply changes it (adding the
exchange), so Ctrl-C or an error leaves it exactly as it was before the message.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Generator, Iterable, Iterator
from pathlib import Path
from typing import TextIO

import torch

from lmforge.errors import InputError, LmforgeError
from lmforge.finetune.records import ASSISTANT, SYSTEM, USER, Turn
from lmforge.finetune.template import chat_format
from lmforge.model.generate import generate
from lmforge.model.llama import Llama
from lmforge.tokenizer import Tokenizer

DEFAULT_MODEL = "models/sft"
RESET, EXIT = "/reset", "/exit"


class ChatSession:
    """A conversation with one model: its history, sampling settings and the stop ids."""

    def __init__(self, model: Llama, tokenizer: Tokenizer, *, system: str | None = None,
                 max_new_tokens: int = 256, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int = 0, err: TextIO | None = None) -> None:
        """Check the tokenizer has a chat format: the model's own template, or our
        markers (``InputError`` if neither)."""
        _check_settings(max_new_tokens, temperature, top_k, top_p)
        self.model, self.tokenizer = model, tokenizer
        self.format = chat_format(tokenizer)
        self.stop_ids = set(self.format.stop_ids) | (
            {tokenizer.eos_id} if tokenizer.eos_id >= 0 else set())
        self.system = system or None
        self.max_new_tokens, self.temperature = max_new_tokens, temperature
        self.top_k, self.top_p = top_k, top_p
        self.generator = torch.Generator().manual_seed(seed)  # sample_next draws on the CPU
        self.err = err
        self.history: list[Turn] = []
        self.last_ids: list[int] = []  # the last reply's ids, with its stop id if reached
        self._warned = False

    def turns(self) -> list[Turn]:
        """The system turn (if any) followed by the history."""
        return ([(SYSTEM, self.system)] if self.system else []) + self.history

    def reset(self) -> None:
        """Forget the conversation; the system message stays."""
        self.history.clear()

    def reply(self, text: str, out: TextIO | None = None) -> str:
        """Answer the user message ``text``, streaming the reply to ``out``; return it.

        Only a finished reply changes the history (it adds the exchange): on an error or
        Ctrl-C the history is left exactly as it was before the message, every old turn
        included, however many the prompt had to leave out.
        """
        tokens = self.reply_tokens(self.prompt_ids(text))
        try:
            ids = stream_reply(tokens, self.tokenizer, self.stop_ids, out)
        finally:
            tokens.close()  # generate's cleanup now, also when EOS stopped us early
        answer = self.tokenizer.decode([t for t in ids if t not in self.stop_ids])
        self.last_ids = ids
        self.history += [(USER, text), (ASSISTANT, answer)]  # one step: all or nothing
        return answer

    def prompt_ids(self, text: str) -> list[int]:
        """The generation prompt for the user message ``text`` after the history, leaving
        its oldest exchanges out until the prompt fits the context. The history itself is
        not changed (what is left out is left out of this prompt only).

        A message that cannot fit even alone is an ``InputError``.
        """
        seq_len = self.model.config.seq_len
        limit = seq_len - min(self.max_new_tokens, seq_len // 2)
        system = [(SYSTEM, self.system)] if self.system else []
        turns = [*self.history, (USER, text)]

        def without(exchanges: int) -> list[int]:  # the prompt less the oldest exchanges
            return self.format.generation_prompt(system + turns[2 * exchanges:])

        ids = without(0)
        if len(ids) <= limit:
            return ids
        # The prompt only shrinks as exchanges are left out: bisect for the fewest that
        # fit, a few renders however long the history has grown (it is never trimmed).
        lo, hi = 1, (len(turns) - 1) // 2
        ids = without(hi)  # the message alone (after the system message)
        if len(ids) > limit:
            raise InputError(f"chat: the message makes a {len(ids)}-token prompt; the model's "
                             f"{seq_len}-token context keeps {seq_len - limit} for the reply")
        while lo < hi:
            mid = (lo + hi) // 2
            mid_ids = without(mid)
            if len(mid_ids) <= limit:
                hi, ids = mid, mid_ids
            else:
                lo = mid + 1
        self._warn_once(seq_len)
        return ids

    def reply_tokens(self, prompt: list[int]) -> Generator[int, None, None]:
        """The reply's token ids from ``generate`` (KV cache) with this session's sampling
        settings; the caller closes it at the first stop id (``reply``, ``lmforge serve``)."""
        return generate(self.model, prompt, self.max_new_tokens, temperature=self.temperature,
                        top_k=self.top_k, top_p=self.top_p, generator=self.generator)

    def _warn_once(self, seq_len: int) -> None:
        """Say on stderr, once per session, that old turns are being dropped."""
        if not self._warned and self.err is not None:
            self.err.write(f"note: the conversation outgrew the model's {seq_len}-token "
                           "context; dropping its oldest turns (the system message is kept)\n")
            self.err.flush()
        self._warned = True


def _check_settings(max_new_tokens: int, temperature: float, top_k: int, top_p: float) -> None:
    """One-line errors for sampling settings ``generate`` cannot use."""
    if max_new_tokens < 1:
        raise LmforgeError(f"chat: --max-new-tokens must be at least 1, not {max_new_tokens}")
    if not temperature >= 0:  # also NaN
        raise LmforgeError(f"chat: --temperature must be >= 0, not {temperature}")
    if top_k < 0:
        raise LmforgeError(f"chat: --top-k must be >= 0, not {top_k}")
    if not 0 < top_p <= 1:
        raise LmforgeError(f"chat: --top-p must be in (0, 1], not {top_p}")


def stream_reply(tokens: Iterable[int], tokenizer: Tokenizer, stop_ids: set[int],
                 out: TextIO | None) -> list[int]:
    """Consume ``tokens`` up to (and including) a stop id, printing the text as it grows.

    The whole reply is decoded each time and the new suffix printed, holding back a
    trailing replacement character: byte-fallback pieces only form a character together.
    """
    ids: list[int] = []
    text_ids: list[int] = []
    printed = ""
    for token in tokens:
        ids.append(token)
        if token in stop_ids:
            break
        text_ids.append(token)
        text = tokenizer.decode(text_ids)
        if out is not None and not text.endswith("\ufffd"):
            out.write(text[len(printed):])
            out.flush()
            printed = text
    if out is not None:
        out.write(tokenizer.decode(text_ids)[len(printed):])
        out.flush()
    return ids


def one_shot(session: ChatSession, messages: list[str], out: TextIO,
             as_json: bool = False) -> None:
    """Answer each message in turn; print the replies (blank line between) or the JSON."""
    transcript = [{"role": r, "content": c} for r, c in session.turns()]
    for i, text in enumerate(messages):
        if not as_json and i:
            out.write("\n")
        answer = session.reply(text, None if as_json else out)
        if not as_json:
            out.write("\n")
        transcript += [{"role": USER, "content": text}, {"role": ASSISTANT, "content": answer}]
    if as_json:
        out.write(json.dumps({"messages": transcript}, ensure_ascii=False) + "\n")
    out.flush()


def repl(session: ChatSession, stdin: TextIO, out: TextIO, err: TextIO,
         prompt: str = "") -> None:
    """Read user lines from ``stdin`` and stream each reply; ``/reset``, ``/exit``, EOF."""
    for line in read_lines(stdin, out, prompt):
        text = line.strip()
        if not text:
            continue
        if text == EXIT:
            return
        if text == RESET:
            session.reset()
            err.write("(conversation cleared)\n")
            err.flush()
            continue
        try:
            session.reply(text, out)
            out.write("\n")
        except InputError as e:
            out.write("\n")
            err.write(f"error: {e}\n")
        except KeyboardInterrupt:  # Ctrl-C stops this reply, not the chat
            out.write("\n")
            err.write("(interrupted; the message was dropped)\n")
        out.flush()
        err.flush()


def read_lines(stdin: TextIO, out: TextIO, prompt: str = "") -> Iterator[str]:
    """Lines of ``stdin`` until EOF (or Ctrl-C); a terminal gets ``input``'s line editing."""
    if stdin is sys.stdin and stdin.isatty():
        while True:
            try:
                yield input(prompt)
            except (EOFError, KeyboardInterrupt):
                out.write("\n")
                return
    else:
        yield from stdin


def load_chat_model(model_dir: Path, tokenizer: str | Path | None = None,
                    device: str | None = None) -> tuple[Llama, Tokenizer]:
    """A saved model (folder or checkpoint file) and its tokenizer: the one beside the
    model unless ``tokenizer`` names another, checked against the sha256 it was trained
    with (``InputError`` if it is not that one). ``device``: cuda when there is one."""
    from lmforge.model import load_model

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model, config = load_model(model_dir, device=device)
    # A model dir carries its tokenizer; a checkpoint file uses the pipeline's.
    default_tok = model_dir if model_dir.is_dir() else Path("models/tokenizer")
    loaded = Tokenizer.load(tokenizer or default_tok)
    want = config.get("tokenizer_sha256")
    if want and loaded.sha256 != want:
        raise InputError(f"{tokenizer or default_tok}: not the tokenizer {model_dir} "
                         f"was trained with (sha256 {want[:12]})")
    return model, loaded


def load_session(args: argparse.Namespace, err: TextIO) -> ChatSession:
    """The model, its tokenizer and the settings of ``args`` as a ``ChatSession``."""
    model_dir = Path(args.model)
    if not model_dir.exists():
        raise InputError(f"{model_dir}: no such model (the sft stage writes {DEFAULT_MODEL}; "
                         "or pass --model)")
    model, tokenizer = load_chat_model(model_dir, args.tokenizer, args.device)
    return ChatSession(model, tokenizer, system=args.system,
                       max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                       top_k=args.top_k, top_p=args.top_p, seed=args.seed, err=err)


def cmd_chat(args: argparse.Namespace) -> None:
    """``lmforge chat``: one-shot with ``-m``, else interactive on stdin."""
    session = load_session(args, sys.stderr)
    if args.message:
        one_shot(session, args.message, sys.stdout, as_json=args.json)
        return
    if args.json:
        raise LmforgeError("chat: --json needs -m/--message (one-shot mode)")
    tty = sys.stdin.isatty()
    if tty:
        print(f"chatting with {args.model}: {RESET} starts over, {EXIT} or Ctrl-D quits",
              file=sys.stderr)
    repl(session, sys.stdin, sys.stdout, sys.stderr, prompt="> " if tty else "")


def add_chat_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``chat [--model DIR] [--system TEXT] [-m TEXT ...] [--json] ...``."""
    c = subparsers.add_parser("chat", help="talk to a fine-tuned model (chat template)")
    c.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"fine-tuned model folder (default {DEFAULT_MODEL}), or a checkpoint")
    c.add_argument("--tokenizer", default=None,
                   help="tokenizer.model, tokenizer.json or a folder with one (default: the "
                        "one beside the model)")
    c.add_argument("--system", default=None, help="system message for the conversation")
    c.add_argument("-m", "--message", action="append", default=[],
                   help="a user message; repeat for a scripted conversation (no REPL)")
    c.add_argument("--json", action="store_true",
                   help='with -m: print {"messages": [...]} instead of the replies')
    c.add_argument("--max-new-tokens", type=int, default=256)
    c.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    c.add_argument("--top-k", type=int, default=0, help="0 = off")
    c.add_argument("--top-p", type=float, default=1.0)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--device", default=None)
    c.set_defaults(func=cmd_chat)
