"""A model's tokenizer as GGUF metadata (``tokenizer.ggml.*``), the way llama.cpp reads it.

Two vocabularies, one per tokenizer backend:

- our sentencepiece ``tokenizer.model`` -> the ``llama`` model: every piece with its score
  (llama.cpp merges the adjacent pair whose joined piece scores highest, as
  sentencepiece's BPE does) and its type (the proto's own numbering: normal, unknown,
  control, user-defined, unused, byte). Byte-fallback pieces ``<0xNN>`` are typed BYTE, so
  llama.cpp decodes them to bytes. ``add_space_prefix`` and ``remove_extra_whitespaces``
  follow the proto's normaliser spec; a normaliser that rewrites text (``nmt_nfkc``) is
  refused, since llama.cpp applies none and would encode such text to other ids.
- a Hugging Face byte-level BPE ``tokenizer.json`` -> the ``gpt2`` model: tokens by id,
  the merges, and ``tokenizer.ggml.pre``, the name of the pre-tokenizer regex llama.cpp
  splits text with. llama.cpp's converter picks that name by hashing the tokenization of
  a test string with known tokenizers; we read the pre-tokenizer itself
  (:data:`PRE_TOKENIZERS`), which also names a tokenizer trained from scratch with a
  known regex. Any other layout is refused in one line.

Both: BOS/EOS/UNK/PAD ids, the end-of-turn id (the chat template's own: ``<|end|>`` for
our chat markers, ``<|im_end|>``/``<|eot_id|>`` for Qwen/Llama 3 Instruct, which is
their EOS too; :mod:`lmforge.export.chat_stops`) and ``tokenizer.chat_template``; no
BOS is added when text is tokenized, as ``lmforge generate`` adds none (chat templates
write their BOS themselves).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from sentencepiece import sentencepiece_model_pb2 as model_pb2

from lmforge.errors import InputError
from lmforge.export.chat_stops import chat_stops
from lmforge.export.hf_tokenizer import read_proto
from lmforge.tokenizer.files import is_hf_file

# gguf.TokenType's values (the sentencepiece proto's numbering too).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Hugging Face pre-tokenizer regexes -> llama.cpp's name for the same split
# (llama-vocab.cpp). A byte-level pre-tokenizer with its default (GPT-2) regex is "gpt-2".
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
           r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
          r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = {("split", _LLAMA3): "llama-bpe", ("split", _QWEN2): "qwen2",
                  ("digits", "bytelevel"): "smollm", ("bytelevel",): "gpt-2"}


@dataclass
class Vocab:
    """What :func:`write_vocab` puts in the file."""

    model: str  # "llama" | "gpt2"
    pre: str
    tokens: list[str]
    types: list[int]
    scores: list[float] | None = None
    merges: list[str] = field(default_factory=list)
    special: dict[str, int] = field(default_factory=dict)  # bos/eos/unk/pad/eot -> id
    add_space_prefix: bool | None = None
    remove_extra_whitespaces: bool | None = None
    chat_template: str | None = None
    # Ollama's PARAMETER stop lines: the end of turn first, then every other stop token
    stop_tokens: list[str] = field(default_factory=list)


def read_vocab(tok_path: Path, special: dict[str, int], n_vocab: int) -> Vocab:
    """The GGUF vocabulary of the tokenizer file ``tok_path`` for an embedding of
    ``n_vocab`` rows (ids past the tokenizer's are padded as unused ``[PADn]`` tokens)."""
    vocab = _hf_vocab(tok_path) if is_hf_file(tok_path) else _sp_vocab(tok_path)
    if len(vocab.tokens) > n_vocab:
        raise InputError(f"{tok_path}: {len(vocab.tokens)} tokens, but the model's embedding "
                         f"has {n_vocab} rows")
    for i in range(len(vocab.tokens), n_vocab):
        vocab.tokens.append(f"[PAD{i}]")
        vocab.types.append(UNUSED)
        if vocab.scores is not None:
            vocab.scores.append(-1000.0)
    vocab.special.update({k: v for k, v in special.items()
                          if k in ("bos", "eos", "unk", "pad") and v is not None and v >= 0})
    _add_chat(vocab, tok_path)
    return vocab


def _sp_vocab(path: Path) -> Vocab:
    proto = read_proto(path)
    spec = proto.normalizer_spec
    if spec.precompiled_charsmap or spec.name not in ("identity", ""):
        raise InputError(f"{path}: normaliser '{spec.name}' rewrites text before encoding, "
                         "and llama.cpp applies none (train the tokenizer with "
                         "normalization: identity)")
    if proto.trainer_spec.model_type != model_pb2.TrainerSpec.BPE:
        kind = model_pb2.TrainerSpec.ModelType.Name(proto.trainer_spec.model_type)
        raise InputError(f"{path}: a sentencepiece {kind} model; llama.cpp's 'llama' "
                         "vocabulary encodes by BPE merges (tokenizer.model_type: bpe)")
    if not proto.trainer_spec.byte_fallback:
        # llama.cpp spells a character outside the pieces as byte pieces, and has no
        # unknown-token path for it.
        raise InputError(f"{path}: no byte-fallback pieces, which llama.cpp needs for text "
                         "outside the vocabulary (tokenizer.byte_fallback: true)")
    return Vocab(model="llama", pre="default", tokens=[p.piece for p in proto.pieces],
                 types=[int(p.type) for p in proto.pieces],
                 scores=[float(p.score) for p in proto.pieces],
                 add_space_prefix=spec.add_dummy_prefix,
                 remove_extra_whitespaces=spec.remove_extra_whitespaces)


def _hf_vocab(path: Path) -> Vocab:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(f"{path}: unreadable tokenizer.json ({e})") from None
    model = data.get("model") or {}
    if model.get("type") != "BPE" or (data.get("decoder") or {}).get("type") != "ByteLevel":
        raise InputError(f"{path}: a {model.get('type')} tokenizer without a byte-level "
                         "decoder; GGUF export writes byte-level BPE (llama.cpp's 'gpt2') only")
    pre = pre_tokenizer_name(data.get("pre_tokenizer"), path)
    by_id = {int(i): t for t, i in model["vocab"].items()}
    types = dict.fromkeys(by_id, NORMAL)
    for added in data.get("added_tokens") or []:
        by_id[int(added["id"])] = added["content"]
        types[int(added["id"])] = CONTROL if added.get("special") else USER_DEFINED
    size = max(by_id) + 1
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(size)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    return Vocab(model="gpt2", pre=pre, tokens=tokens,
                 types=[types.get(i, UNUSED) for i in range(size)], merges=merges)


def pre_tokenizer_name(pre: dict | None, where: Path) -> str:
    """llama.cpp's name (``tokenizer.ggml.pre``) for a tokenizer.json pre-tokenizer."""
    steps = (pre.get("pretokenizers") or []) if pre and pre.get("type") == "Sequence" else [pre]
    key: list[str] = []
    for step in steps:
        kind = (step or {}).get("type")
        if kind == "Split":
            key += ["split", (step.get("pattern") or {}).get("Regex", "")]
        elif kind == "ByteLevel" and step.get("use_regex", True):
            key.append("bytelevel")
        elif kind == "Digits" and step.get("individual_digits"):
            key.append("digits")
        elif kind != "ByteLevel":
            key.append(str(kind))
    name = PRE_TOKENIZERS.get(tuple(key))
    if name is None:
        raise InputError(f"{where}: pre-tokenizer {' + '.join(map(str, key))[:80]} has no "
                         "llama.cpp counterpart (known: Llama 3, Qwen2, SmolLM, GPT-2 splits)")
    return name


def _add_chat(vocab: Vocab, tok_path: Path) -> None:
    """The chat template, end-of-turn id and stop tokens: ours when the tokenizer has our
    chat markers, the model's own when its folder brings one, none for a base model."""
    stops = chat_stops(tok_path)
    if stops is None:
        return
    vocab.chat_template = stops.template
    vocab.special["eot"] = stops.end
    vocab.stop_tokens = [vocab.tokens[i] for i in stops.ids]


def write_vocab(writer, vocab: Vocab) -> None:  # writer: gguf.GGUFWriter
    """Add ``vocab``'s ``tokenizer.ggml.*`` keys (and the chat template) to ``writer``."""
    writer.add_tokenizer_model(vocab.model)
    writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.types)
    if vocab.scores is not None:
        writer.add_token_scores(vocab.scores)
    if vocab.merges:
        writer.add_token_merges(vocab.merges)
    setters = {"bos": writer.add_bos_token_id, "eos": writer.add_eos_token_id,
               "unk": writer.add_unk_token_id, "pad": writer.add_pad_token_id,
               "eot": writer.add_eot_token_id}
    for name, token_id in vocab.special.items():
        setters[name](token_id)
    writer.add_add_bos_token(False)
    writer.add_add_eos_token(False)
    if vocab.add_space_prefix is not None:
        writer.add_add_space_prefix(vocab.add_space_prefix)
    if vocab.remove_extra_whitespaces is not None:
        writer.add_remove_extra_whitespaces(vocab.remove_extra_whitespaces)
    if vocab.chat_template is not None:
        writer.add_chat_template(vocab.chat_template)
