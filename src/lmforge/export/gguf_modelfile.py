"""An Ollama ``Modelfile`` beside an exported ``.gguf``: FROM, the chat template in
Ollama's Go-template syntax, and the stop tokens.

Ollama renders prompts with its own Go templates, not the Jinja ``tokenizer.chat_template``
in the file, so the template is translated here for the layouts we know: lmforge's chat
markers (our SFT/DPO models) and ChatML (Qwen, SmolLM2). A ChatML template that writes a
default system message when the conversation has none (SmolLM2's, Qwen2.5's) keeps it as
the Modelfile's ``SYSTEM``, which Ollama puts first in such a conversation. A base model
gets FROM alone; another template gets FROM and the stop tokens, with a comment saying
the TEMPLATE is the user's to write.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from lmforge.finetune.records import USER
from lmforge.finetune.template import CHAT_TEMPLATE, OwnFormat, chat_format
from lmforge.tokenizer import Tokenizer

# First line of every Modelfile we write: the proof that a later export may replace it.
HEADER = "# Ollama Modelfile written by lmforge export gguf"
OURS = ("{{- range .Messages }}<|{{ .Role }}|>{{ .Content }}<|end|>{{ end }}"
        "<|assistant|>")
CHATML = ("{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n"
          "{{ end }}<|im_start|>assistant\n")
_PROBE = "\x00probe"


def modelfile_path(gguf_path: Path) -> Path:
    """``model.gguf`` -> ``model.Modelfile`` (one per exported file, so several types of
    one model can sit in one folder)."""
    return gguf_path.with_suffix(".Modelfile")


def modelfile_text(gguf_path: Path, chat_template: str | None, stops: Sequence[str],
                   bos: str | None, tok_path: Path) -> str:
    """The Modelfile for ``gguf_path`` (FROM is relative: Ollama resolves it beside the
    Modelfile); ``stops``: one ``PARAMETER stop`` each, the end of turn first."""
    lines = [HEADER, f"FROM ./{gguf_path.name}"]
    template, system = _template(chat_template, bos, tok_path)
    if chat_template is not None and template is None:
        lines.append("# The model's chat template is neither lmforge's nor ChatML: write its "
                     "TEMPLATE in Ollama's syntax (https://ollama.com/blog/modelfile).")
    if system is not None:
        lines.append(f'SYSTEM """{system}"""')
    if template is not None:
        lines.append(f'TEMPLATE """{template}"""')
    lines += [f'PARAMETER stop "{stop}"' for stop in stops]
    return "\n".join(lines) + "\n"


def _template(chat_template: str | None, bos: str | None, tok_path: Path
              ) -> tuple[str | None, str | None]:
    """(Ollama TEMPLATE, default SYSTEM) for the model's chat template, or Nones."""
    if chat_template is None:
        return None, None
    if chat_template == CHAT_TEMPLATE:
        return (bos or "") + OURS, None
    if "<|im_start|>" not in chat_template or "<|im_end|>" not in chat_template:
        return None, None
    fmt = chat_format(Tokenizer.load(tok_path))
    if isinstance(fmt, OwnFormat):
        return None, None
    text = fmt.text([(USER, _PROBE)], add_generation_prompt=True)
    head = text.split("<|im_start|>user\n")[0]
    prefix = "<|im_start|>system\n"
    system = (head.removeprefix(prefix).removesuffix("<|im_end|>\n")
              if head.startswith(prefix) else None)
    return CHATML, system
