"""The served models: names the API knows, each loaded once, with its queue.

A request names a model; only names from this list are looked up, so nothing a client
sends ever reaches the filesystem. By default the pipeline's three models are served
(those that exist): ``final`` (pretrained), ``sft`` and ``dpo``; ``--model NAME=PATH``
replaces that list with its own (an imported open model included).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmforge.chat import load_chat_model
from lmforge.errors import InputError
from lmforge.finetune.template import ChatFormat, chat_format
from lmforge.headline import HEADLINE_JSON
from lmforge.model.llama import Llama
from lmforge.serve.slots import ModelSlots
from lmforge.tokenizer import Tokenizer

DEFAULT_MODELS = {"base": "models/final", "sft": "models/sft", "dpo": "models/dpo"}
# Names as model ids are usually written (llama3.2:1b, smollm2-360m-instruct): no slash,
# no spaces, so that a name is never mistaken for a path.
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,63}")


@dataclass
class ServedModel:
    """One model as served: its weights, tokenizer, chat format (None: completions only)
    and the queue in front of it."""

    name: str
    path: Path
    model: Llama
    tokenizer: Tokenizer
    chat: ChatFormat | None
    chat_problem: str | None
    slots: ModelSlots
    created: int
    headline: dict[str, Any] | None = None


def parse_specs(specs: list[str]) -> dict[str, Path]:
    """``NAME=PATH`` strings as {name: path}; a bad or repeated name is one line."""
    out: dict[str, Path] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not path:
            raise InputError(f"--model {spec!r}: expected NAME=PATH (e.g. sft=models/sft)")
        if not NAME.fullmatch(name):
            raise InputError(f"--model {spec!r}: a name is letters, digits and . _ : - "
                             "(at most 64, no slash)")
        if name in out:
            raise InputError(f"--model {name}: given twice")
        out[name] = Path(path)
    return out


def default_specs(root: Path = Path(".")) -> dict[str, Path]:
    """The pipeline's models that exist under ``root`` (InputError if none does)."""
    found = {name: root / path for name, path in DEFAULT_MODELS.items()
             if (root / path).exists()}
    if not found:
        raise InputError(f"no models to serve: none of {', '.join(DEFAULT_MODELS.values())} "
                         "exists (run the pipeline, or pass --model NAME=PATH)")
    return found


def load_models(specs: dict[str, Path], device: str | None, queue_size: int,
                root: Path = Path(".")) -> dict[str, ServedModel]:
    """Load every model of ``specs`` (a missing path is one line, before any loading);
    ``root`` is the pipeline's folder, for the headline figures."""
    for name, path in specs.items():
        if not path.exists():
            raise InputError(f"{path}: no such model (--model {name}={path})")
    served = {}
    for name, path in specs.items():
        model, tokenizer = load_chat_model(path, device=device)
        try:
            fmt, problem = chat_format(tokenizer), None
        except InputError as e:  # a base model on a tokenizer without chat markers
            fmt, problem = None, str(e)
        served[name] = ServedModel(name, path, model, tokenizer, fmt, problem,
                                   ModelSlots(name, queue_size), int(path.stat().st_mtime),
                                   headline_figures(path, root))
    return served


def headline_figures(path: Path, root: Path = Path(".")) -> dict[str, Any] | None:
    """The figures ``metrics/headline.json`` under ``root`` gives the model at ``path``
    (None: not one of the pipeline's models, or no figures yet)."""
    keys = {(root / folder).resolve(): key for key, folder in DEFAULT_MODELS.items()}
    key = keys.get(path.resolve())
    try:
        figures = json.loads((root / HEADLINE_JSON).read_text(encoding="utf-8"))
    except (OSError, ValueError):  # not run yet, or being rewritten: the page does without
        return None
    found = figures.get(key) if key and isinstance(figures, dict) else None
    return found if isinstance(found, dict) else None
