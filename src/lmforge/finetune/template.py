"""The chat template: turns -> token ids and a loss mask, and the same as a Hugging Face
``chat_template``.

Markers. ``<|system|>``, ``<|user|>``, ``<|assistant|>`` open a turn and ``<|end|>``
closes it (the names Phi-3 and Zephyr use, so the text reads familiarly). The tokenizer
reserves them as sentencepiece *control* symbols (``tokenizer.train.train_model(...,
reserved_tokens=CHAT_MARKERS)``, ids 4-7): one piece each at a fixed id, inserted here by
id, and never produced by encoding text. So a marker typed inside a message -- "<|user|>"
in a user's question, or in pretraining text about chat models -- stays ordinary text
pieces and cannot open or close a turn; such records are kept, not escaped or rejected.
(A user-defined symbol would be matched inside text, and sentencepiece has no way to
switch that off per call.) Hugging Face tokenizers do match special tokens inside text,
so there ``apply_chat_template`` gives the marker id for such a message: ours and theirs
agree on every conversation whose contents hold no marker string.

With a Hugging Face ``tokenizer.json`` (``lmforge.tokenizer.hf``) the markers must be
*special* added tokens. Our backend encodes text with ``encode_special_tokens`` on, so
a special token is never matched inside text -- the same rule as a control symbol, and
the template's rules hold unchanged: markers are inserted by id, a marker typed in a
message stays text. A marker added as a non-special token would be matched inside text,
so it is refused, as a sentencepiece user-defined symbol is. A tokenizer without the
markers (a base model's own, such as Qwen's or Llama 3's) is refused in one line: its own
chat template is another matter. A tokenizer without BOS starts the conversation at its
first marker.

Layout: ``BOS``, then per turn ``marker content <|end|>``, with nothing between -- no
newline after the marker or after ``<|end|>``. The marker ids delimit turns already; a
newline would cost a token per marker, and, since the Hugging Face template's text is
encoded as one segment between markers, a newline could merge with the content's first
characters into one token, which would blur where the loss mask starts and make the two
encodings differ. Each content is encoded on its own, so no token straddles a boundary;
with the pipeline's identity normalisation there is no dummy prefix and no whitespace
rewriting, so a content's ids do not depend on what precedes it. (A tokenizer with a
dummy prefix, ``normalization: nfkc``, is refused: sentencepiece would put a space piece
before every content and Hugging Face only before the first.)

Loss mask: 1 exactly on each assistant turn's content tokens and its closing ``<|end|>``
(so the model learns to stop), 0 on BOS, on every marker that opens a turn, and on
system and user turns. No EOS follows the conversation: ``<|end|>`` after the last
assistant turn is where generation stops.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from lmforge.config import CHAT_MARKERS
from lmforge.errors import InputError
from lmforge.finetune.model_template import (
    ModelTemplate,
    TemplateError,
    read_template,
    special_tokens,
    stop_token_ids,
)
from lmforge.finetune.records import ASSISTANT, ROLES, SYSTEM, USER, ReadResult, Turn
from lmforge.tokenizer import Tokenizer

# The tokens the tokenizer reserves (tokenizer.reserved_tokens), in id order (4-7).
SYSTEM_MARKER, USER_MARKER, ASSISTANT_MARKER, END_MARKER = CHAT_MARKERS
ROLE_MARKERS = {SYSTEM: SYSTEM_MARKER, USER: USER_MARKER, ASSISTANT: ASSISTANT_MARKER}

# Reasons a conversation is rejected when rendered.
TOO_LONG = "too_long"
EMPTY_MASK = "empty_mask"

# The same text as ``render_text``; the tokenizer's bos_token is "<s>".
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('role must be system, user or assistant, not ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


_MARKER_IDS: dict[str, dict[str, int]] = {}  # by tokenizer sha256: checked once


def marker_ids(tokenizer: Tokenizer) -> dict[str, int]:
    """``{marker: id}``; an ``InputError`` if the tokenizer cannot carry the template."""
    if tokenizer.sha256 not in _MARKER_IDS:
        _MARKER_IDS[tokenizer.sha256] = _check_tokenizer(tokenizer)
    return _MARKER_IDS[tokenizer.sha256]


def _check_tokenizer(tokenizer: Tokenizer) -> dict[str, int]:
    name = f"tokenizer {tokenizer.sha256[:12]}"
    ids = {}
    for marker in CHAT_MARKERS:
        token_id = tokenizer.token_to_id(marker)
        if token_id is None:
            raise InputError(f"{name}: no chat marker {marker}; train the tokenizer with "
                             "the chat markers in tokenizer.reserved_tokens (the default), "
                             "or use a tokenizer that has them as special tokens")
        if not tokenizer.is_special(token_id):
            kind = ("a control symbol" if tokenizer.backend == "sentencepiece"
                    else "a special token")
            raise InputError(f"{name}: chat marker {marker} is not {kind}, so "
                             "text containing it would encode to it")
        ids[marker] = token_id
    if tokenizer.adds_prefix:
        raise InputError(f"{name}: adds a dummy prefix or drops whitespace (normalization: "
                         "nfkc, or a prefix space); the chat template needs normalization: "
                         "identity")
    return ids


def render_text(turns: Sequence[Turn], add_generation_prompt: bool = False,
                bos: str = "<s>") -> str:
    """The conversation as text, exactly as ``CHAT_TEMPLATE`` writes it."""
    text = bos + "".join(f"{ROLE_MARKERS[role]}{content}{END_MARKER}" for role, content in turns)
    return text + ASSISTANT_MARKER if add_generation_prompt else text


def render(turns: Sequence[Turn], tokenizer: Tokenizer) -> tuple[list[int], list[int]]:
    """(ids, loss_mask) of a conversation; the mask is 1 on assistant content + ``<|end|>``."""
    markers = marker_ids(tokenizer)
    end = markers[END_MARKER]
    contents = tokenizer.encode_batch([content for _, content in turns], num_threads=1)
    # A tokenizer without BOS (Qwen's) starts with the first marker.
    ids, mask = ([tokenizer.bos_id], [0]) if tokenizer.bos_id >= 0 else ([], [])
    for (role, _), content_ids in zip(turns, contents, strict=True):
        if role not in ROLES:
            raise ValueError(f"role {role!r} is not system, user or assistant")
        learn = 1 if role == ASSISTANT else 0
        ids.append(markers[ROLE_MARKERS[role]])
        mask.append(0)
        ids.extend(content_ids)
        ids.append(end)
        mask.extend([learn] * (len(content_ids) + 1))
    return ids, mask


def generation_prompt(turns: Sequence[Turn], tokenizer: Tokenizer) -> list[int]:
    """The ids to generate the next assistant turn from: ``render`` + ``<|assistant|>``.

    Generation should stop at ``<|end|>`` (``marker_ids(tokenizer)[END_MARKER]``).
    """
    ids, _ = render(turns, tokenizer)
    return ids + [marker_ids(tokenizer)[ASSISTANT_MARKER]]


def check_rendered(ids: Sequence[int], mask: Sequence[int], max_tokens: int | None
                   ) -> tuple[str, str] | None:
    """(reason, detail) when a rendered conversation must not be trained on, else None."""
    if not any(mask):
        return EMPTY_MASK, f"no assistant token to learn in {len(ids)} tokens"
    if max_tokens is not None and len(ids) > max_tokens:
        return TOO_LONG, f"{len(ids)} tokens > max_tokens={max_tokens}"
    return None


@dataclass(frozen=True)
class Rendered:
    """A record rendered: ``ids``/``mask`` the whole conversation, or with ``parts`` (a
    template that rewrites earlier turns: ``ModelTemplate.examples``) the last of its
    per-turn examples, which ``parts`` lists in order."""

    file: str
    line: int
    ids: list[int]
    mask: list[int]
    parts: tuple[tuple[list[int], list[int]], ...] = ()


class OwnFormat:
    """Our template (the markers above) behind the interface a model's own template has
    (:class:`~lmforge.finetune.model_template.ModelTemplate`): ``render``,
    ``generation_prompt``, ``stop_ids``, ``pad_id``."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.markers = marker_ids(tokenizer)  # one clear line when it lacks them
        self.where = "lmforge's chat template"

    def render(self, turns: Sequence[Turn]) -> tuple[list[int], list[int]]:
        return render(turns, self.tokenizer)

    def examples(self, turns: Sequence[Turn]) -> list[tuple[list[int], list[int]]]:
        """Our template never rewrites earlier turns: the conversation as one example."""
        return [self.render(turns)]

    def generation_prompt(self, turns: Sequence[Turn]) -> list[int]:
        return generation_prompt(turns, self.tokenizer)

    @property
    def stop_ids(self) -> frozenset[int]:
        return frozenset({self.markers[END_MARKER]})

    @property
    def pad_id(self) -> int:
        return self.markers[END_MARKER]


ChatFormat = OwnFormat | ModelTemplate
# By tokenizer sha256 and template text: building one renders a probe conversation.
_FORMATS: dict[tuple[str, str | None], ChatFormat] = {}


def chat_format(tokenizer: Tokenizer) -> ChatFormat:
    """How conversations are rendered for ``tokenizer``'s model: the model's own template
    when the tokenizer's folder holds one (an imported chat model's, as ``import hf`` and
    the tokenizer stage copy it), else ours (models lmforge trained)."""
    folder = Path(tokenizer.name).parent
    found = read_template(folder) if tokenizer.backend == "hf" else None
    key = (tokenizer.sha256, found[0] if found else None)
    if key not in _FORMATS:
        if found is None:
            _FORMATS[key] = OwnFormat(tokenizer)
        else:
            texts = tokenizer.special_texts()
            eos = {tokenizer.eos_id} if tokenizer.eos_id >= 0 else set()
            _FORMATS[key] = ModelTemplate(
                found[0], found[1], tokenizer.encode_markup,
                frozenset(tokenizer.token_to_id(t) for t in texts), special_tokens(folder),
                frozenset(eos | stop_token_ids(folder)), texts)
    return _FORMATS[key]


def render_all(result: ReadResult, tokenizer: Tokenizer, max_tokens: int | None
               ) -> list[Rendered]:
    """Render every kept example with the model's chat format (:func:`chat_format`); one
    that fails ``check_rendered``, or that the template cannot render with a well-placed
    mask, moves to the rejects.

    ``result`` is updated in place (its examples, rejects and counts), so
    ``in == kept + rejected`` still holds.
    """
    fmt = chat_format(tokenizer)
    kept, out = [], []
    for ex in result.examples:
        try:
            parts = fmt.examples(ex.turns)
            bad = next(filter(None, (check_rendered(i, m, max_tokens) for i, m in parts)),
                       None)
        except TemplateError as e:
            bad = (e.reason, e.detail)
        if bad is not None:
            result.counts.n_in -= 1  # counted again by reject()
            result.counts.kept -= 1
            result.reject(ex.file, ex.line, *bad)
            continue
        kept.append(ex)
        ids, mask = parts[-1]
        out.append(Rendered(ex.file, ex.line, ids, mask, tuple(parts) if len(parts) > 1
                            else ()))
    result.examples = kept
    result.check()
    return out
