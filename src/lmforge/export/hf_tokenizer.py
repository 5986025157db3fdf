"""Our sentencepiece model -> Hugging Face tokenizer files that encode to the same ids.

``transformers`` builds the ``tokenizers`` pipeline from the model proto itself
(``SpmConverter.build_tokenizer_from_spm_proto``), following its normaliser spec: with
our lossless settings that is no normaliser rewrite, no dummy prefix, whitespace runs
kept, byte fallback. BPE models encode to exactly sentencepiece's ids; unigram models
decode identically but may break Viterbi ties differently on a few tokens.

Reserved tokens (control pieces beyond BOS/EOS/PAD, such as the chat markers that
``tokenizer.train.train_model(reserved_tokens=...)`` adds) become additional special
tokens at their own ids, so a chat template's text encodes to the marker ids. Unlike
sentencepiece, Hugging Face then also matches them inside text (its usual behaviour for
special tokens, as with any chat model's markers).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from sentencepiece import sentencepiece_model_pb2 as model_pb2

from lmforge.errors import InputError, LmforgeError
from lmforge.io import write_json

TOKENIZER_MODEL = "tokenizer.model"


def read_proto(path: Path) -> model_pb2.ModelProto:
    """Parse a sentencepiece model file, with a one-line error for a bad one."""
    proto = model_pb2.ModelProto()
    try:
        proto.ParseFromString(path.read_bytes())
    except OSError as e:
        raise InputError(f"{path}: cannot read tokenizer model ({e.strerror})") from None
    except Exception as e:  # protobuf's DecodeError
        raise InputError(f"{path}: not a sentencepiece model ({e})") from None
    if not proto.pieces:
        raise InputError(f"{path}: not a sentencepiece model (no pieces)")
    return proto


def fits_llama_tokenizer(proto: model_pb2.ModelProto) -> bool:
    """Whether ``LlamaTokenizer``'s fixed pipeline (BPE, no normaliser) reproduces ``proto``.

    transformers 5 rebuilds a ``LlamaTokenizer`` from vocab + merges on load, dropping any
    normaliser; so only a plain BPE model may claim that class.
    """
    spec = proto.normalizer_spec
    return (proto.trainer_spec.model_type == model_pb2.TrainerSpec.BPE
            and not spec.precompiled_charsmap and not spec.add_dummy_prefix
            and not spec.remove_extra_whitespaces)


def write_hf_tokenizer(sp_path: Path, out_dir: Path, special: dict[str, int],
                       max_length: int, chat_template: str | None = None) -> None:
    """Write tokenizer.model, tokenizer.json, tokenizer_config.json, special_tokens_map.json.

    ``chat_template`` goes into tokenizer_config.json (which transformers 4 and 5 both
    read), not into the ``chat_template.jinja`` file that transformers 5 would save.
    """
    try:
        from transformers import LlamaTokenizer, PreTrainedTokenizerFast
        from transformers.convert_slow_tokenizer import SpmConverter
    except ImportError:
        raise LmforgeError("export hf: converting the tokenizer needs transformers>=5 "
                           "(pip install 'transformers>=5')") from None
    proto = read_proto(sp_path)
    bpe = proto.trainer_spec.model_type == model_pb2.TrainerSpec.BPE
    pieces = [p.piece for p in proto.pieces]
    vocab: Any = ({p: i for i, p in enumerate(pieces)} if bpe
                  else [(p.piece, p.score) for p in proto.pieces])
    dummy_prefix = proto.normalizer_spec.add_dummy_prefix
    # legacy=True is the mode that prefixes like sentencepiece does (once per text, even
    # when it already starts with a space); without a dummy prefix the flag has no effect.
    backend = SpmConverter.build_tokenizer_from_spm_proto(proto, vocab, legacy=dummy_prefix)
    if backend is None:
        raise InputError(f"{sp_path}: transformers cannot convert this sentencepiece model")
    llama = fits_llama_tokenizer(proto)
    cls = LlamaTokenizer if llama else PreTrainedTokenizerFast
    tokens = special_tokens(pieces, special)
    tok = cls(tokenizer_object=backend, **tokens, add_bos_token=False, add_eos_token=False,
              legacy=False, add_prefix_space=dummy_prefix, model_max_length=max_length,
              clean_up_tokenization_spaces=False)
    reserved = reserved_tokens(proto, special)
    if reserved:  # pieces already in the vocabulary: they keep their ids
        tok.add_special_tokens({"additional_special_tokens": reserved})
    tok.save_pretrained(str(out_dir))
    shutil.copyfile(sp_path, out_dir / TOKENIZER_MODEL)
    # Pin what the reading side must not guess: the class (transformers 4 knows neither
    # "TokenizersBackend" nor defaults without these keys), and no BOS/EOS added, since
    # our shards put an EOS after each document and no BOS before it by default.
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config.update(tokenizer_class="LlamaTokenizer" if llama else "PreTrainedTokenizerFast",
                  add_bos_token=False, add_eos_token=False, legacy=False,
                  add_prefix_space=dummy_prefix)
    if chat_template is not None:
        config["chat_template"] = chat_template
    write_json(config_path, config)
    write_json(out_dir / "special_tokens_map.json",
               {**tokens, "additional_special_tokens": reserved} if reserved else tokens)


def special_tokens(pieces: list[str], special: dict[str, int]) -> dict[str, str]:
    """``{"bos_token": "<s>", ...}`` for the special ids the model has (-1 = none)."""
    out = {}
    for name in ("bos", "eos", "unk", "pad"):
        token_id = special.get(name, -1)
        if 0 <= token_id < len(pieces):
            out[f"{name}_token"] = pieces[token_id]
    return out


def reserved_tokens(proto: model_pb2.ModelProto, special: dict[str, int]) -> list[str]:
    """Control pieces other than the special ids (BOS/EOS/PAD), in id order."""
    spec = proto.trainer_spec
    taken = {*special.values(), spec.bos_id, spec.eos_id, spec.pad_id, spec.unk_id}
    return [p.piece for i, p in enumerate(proto.pieces)
            if p.type == model_pb2.ModelProto.SentencePiece.CONTROL and i not in taken]
