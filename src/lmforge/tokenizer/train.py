"""Train a sentencepiece model from an in-memory sample, losslessly by default."""

from __future__ import annotations

import io
import time
from collections.abc import Iterable, Iterator, Sequence

import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2 as model_pb2

from lmforge.config import TokenizerConfig
from lmforge.errors import ConfigError
from lmforge.parallel import resolve_workers

UNK_ID, BOS_ID, EOS_ID, PAD_ID = 0, 1, 2, 3


def sentence_pieces(texts: Iterable[str], max_bytes: int) -> Iterator[str]:
    """Yield each text, cut into pieces of at most ``max_bytes`` UTF-8 bytes.

    sentencepiece skips a sentence longer than ``max_sentence_length`` bytes, so long
    documents are cut -- at line ends where possible, inside a line only when the line
    itself is too long -- instead of silently lost.
    """
    for text in texts:
        if len(text) * 4 <= max_bytes or len(text.encode("utf-8")) <= max_bytes:
            if text:
                yield text
            continue
        piece: list[str] = []
        size = 0
        for line in text.splitlines(keepends=True):
            n = len(line.encode("utf-8"))
            if size + n > max_bytes and piece:
                yield "".join(piece)
                piece, size = [], 0
            if n > max_bytes:
                yield from _cut_line(line, max_bytes)
                continue
            piece.append(line)
            size += n
        if piece:
            yield "".join(piece)


def _cut_line(line: str, max_bytes: int) -> Iterator[str]:
    """Cut one over-long line at character boundaries into <= ``max_bytes`` pieces."""
    data = line.encode("utf-8")
    start = 0
    while start < len(data):
        end = min(start + max_bytes, len(data))
        # Back off to a UTF-8 character boundary (continuation bytes are 0b10xxxxxx).
        while end < len(data) and (data[end] & 0xC0) == 0x80:
            end -= 1
        yield data[start:end].decode("utf-8")
        start = end


def trainer_options(cfg: TokenizerConfig, reserved_tokens: Sequence[str] = ()) -> dict:
    """sentencepiece trainer keyword arguments for a tokenizer config.

    ``reserved_tokens`` (e.g. ``lmforge.finetune.template.CHAT_MARKERS``) become
    sentencepiece *control* symbols with fixed ids right after the four special ids
    (4, 5, ... in the order given): single pieces that encoding text never produces --
    the text "<|end|>" encodes to ordinary pieces -- and that decoding renders as "",
    like <s> and </s>. Only code that inserts them by id (the chat template) emits them,
    so web text that happens to contain a marker cannot inject one into the shards.
    None by default: the model is byte-identical to one trained without the argument.
    """
    opts = dict(
        model_type=cfg.model_type,
        vocab_size=cfg.vocab_size,
        character_coverage=cfg.character_coverage,
        byte_fallback=cfg.byte_fallback,
        split_digits=cfg.split_digits,
        max_sentence_length=cfg.max_sentence_length,
        num_threads=resolve_workers(cfg.num_threads),
        unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID, pad_id=PAD_ID,
        # The sample is already chosen: use every sentence, in the order given.
        input_sentence_size=0,
        shuffle_input_sentence=False,
        minloglevel=2,
    )
    if reserved_tokens:
        opts["control_symbols"] = _checked_reserved(reserved_tokens)
    if cfg.normalization == "identity":
        # Lossless: no rewriting, whitespace runs kept (code indentation), no added space.
        opts.update(normalization_rule_name="identity", remove_extra_whitespaces=False,
                    add_dummy_prefix=False, allow_whitespace_only_pieces=True)
    else:
        opts.update(normalization_rule_name="nmt_nfkc", remove_extra_whitespaces=True,
                    add_dummy_prefix=True)
    return opts


def _checked_reserved(tokens: Sequence[str]) -> list[str]:
    """The reserved tokens as a list, or a one-line error for one sentencepiece would refuse
    or silently merge (empty, whitespace inside, repeated, or one of the special pieces)."""
    out: list[str] = []
    for token in tokens:
        if not isinstance(token, str) or not token or any(c.isspace() for c in token):
            raise ConfigError(f"tokenizer: reserved token {token!r} must be a non-empty "
                              "string without whitespace")
        if token in out or token in ("<unk>", "<s>", "</s>", "<pad>"):
            raise ConfigError(f"tokenizer: reserved token {token!r} is repeated or special")
        out.append(token)
    return out


def train_model(texts: Iterable[str], cfg: TokenizerConfig,
                reserved_tokens: Sequence[str] | None = None) -> tuple[bytes, float]:
    """Train on ``texts``; return the serialized model and the training seconds.

    ``reserved_tokens``: see ``trainer_options``; None = ``cfg.reserved_tokens``.
    """
    if reserved_tokens is None:
        reserved_tokens = cfg.reserved_tokens
    spm.set_random_generator_seed(cfg.seed)
    buf = io.BytesIO()
    start = time.perf_counter()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=sentence_pieces(texts, cfg.max_sentence_length),
            model_writer=buf, **trainer_options(cfg, reserved_tokens))
    except RuntimeError as e:
        # e.g. "Vocabulary size too high" for unigram on a small sample.
        raise ConfigError(f"tokenizer: sentencepiece training failed: "
                          f"{str(e).strip().splitlines()[-1]}") from None
    seconds = time.perf_counter() - start
    return _canonical(buf.getvalue()), seconds


def _canonical(model: bytes) -> bytes:
    """Drop the thread count from a BPE model's stored trainer spec.

    BPE training gives the same pieces on any number of threads (checked), so the model
    file -- and the tokenizer hash every shard carries -- should not change with the
    machine. Unigram results do depend on the thread count, so it stays recorded there.
    """
    proto = model_pb2.ModelProto()
    proto.ParseFromString(model)
    if proto.trainer_spec.model_type != model_pb2.TrainerSpec.BPE:
        return model
    proto.trainer_spec.num_threads = 0
    return proto.SerializeToString(deterministic=True)


def vocab_text(model: bytes) -> str:
    """The ``.vocab`` file sentencepiece writes beside a model: ``piece<TAB>score`` lines."""
    proto = model_pb2.ModelProto()
    proto.ParseFromString(model)
    return "".join(f"{p.piece}\t{p.score:g}\n" for p in proto.pieces)
