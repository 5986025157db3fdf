"""``init_from`` (``train``, ``sft``, ``dpo``): start a run from trained weights.

The source is a model directory (the train stage's ``models/final``, or what
``lmforge import hf`` wrote) or a ``step-*.pt`` checkpoint. Only the weights are taken:
the optimizer, schedule and data order start fresh, as continued pretraining on new
data does. The architecture must match ``params.yaml``'s model section (the context
length may differ: RoPE has no learned positions) and the tokenizer must be the one the
shards were encoded with, or the token ids would mean different things.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import torch

from lmforge.config import ModelConfig, from_dict
from lmforge.errors import InputError
from lmforge.model.llama import Llama
from lmforge.model.saved import WEIGHTS, load_model, read_config

# Fields that change how a model trains or how far it reads, not what its weights mean.
# zero_init_proj: an init only, which weights loaded on top of it replace.
_FREE = {"seq_len", "dropout", "doc_mask", "zero_init_proj"}


# Every message names the params.yaml key that was set (``key``): train.init_from,
# sft.init_from or dpo.init_from.
TRAIN_KEY = "train.init_from"


def ensure_outside(source: str | Path, directory: str | Path, why: str,
                   key: str = TRAIN_KEY) -> None:
    """One-line error when ``source`` lies in ``directory`` (a folder the run rewrites)."""
    src, d = Path(source).resolve(), Path(directory).resolve()
    if src == d or d in src.parents:
        raise InputError(f"{key}: {source} is inside {directory}, {why}; copy it "
                         f"elsewhere (e.g. models/base) and point {key} there")


def weights_sha256(source: str | Path, key: str = TRAIN_KEY) -> str:
    """sha256 of the source's weights file: part of the run fingerprint."""
    path = Path(source)
    path = path / WEIGHTS if path.is_dir() else path
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    except OSError as e:
        raise InputError(f"{key}: {path}: {e.strerror or e}") from None
    return h.hexdigest()


def source_architecture(source: str | Path, key: str = TRAIN_KEY
                        ) -> tuple[ModelConfig, int]:
    """(model config, vocab size) of the weights ``source`` holds: a model directory's
    ``config.json``, or a ``step-*.pt`` checkpoint's recorded config (memory-mapped, so
    its tensors are not read)."""
    path = Path(source)
    if not path.exists():
        raise InputError(f"{key}: {source}: no such file or directory")
    try:
        if path.is_dir():
            cfg, vocab, _ = read_config(path)
            return cfg, vocab
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        cfg = from_dict(ModelConfig, state["model_config"], "model.")
        return cfg, int(state["vocab_size"])
    except InputError as e:
        raise InputError(f"{key}: {e}") from None
    except Exception as e:  # torch.load raises many kinds for a file that is not its own
        first = (str(e).strip().splitlines() or [""])[0][:120]
        raise InputError(f"{key}: {path}: not a model directory or full checkpoint "
                         f"({type(e).__name__}: {first})") from None


def adopt_architecture(ours: ModelConfig, shard_vocab: int, source: str | Path,
                       key: str = TRAIN_KEY) -> tuple[ModelConfig, int, str | None]:
    """The run's architecture when it starts from ``source``: the source's, with the
    run's own context length, dropout and document masking (RoPE has no learned
    positions). So a model section need not restate an imported model's 16 keys.

    Returns (config, vocab size, a note naming the params.yaml model keys that differ
    from the source and so are not used, or None). The vocabulary is the source's: an
    embedding may have more rows than the tokenizer has ids (Qwen pads to a multiple of
    128), never fewer.
    """
    theirs, vocab = source_architecture(source, key)
    if vocab < shard_vocab:
        raise InputError(f"{key}: {source} has vocab_size {vocab}, the shards "
                         f"{shard_vocab}: the tokenizer has ids the model has no row for")
    adopted = dataclasses.replace(theirs, **{f: getattr(ours, f) for f in _FREE})
    mine, other = dataclasses.asdict(ours), dataclasses.asdict(adopted)
    for fields, n_head in ((mine, ours.n_head), (other, theirs.n_head)):
        fields["n_kv_head"] = fields["n_kv_head"] or n_head  # unset = one per query head
    ignored = [f"model.{f}" for f in mine if mine[f] != other[f]]
    note = (f"train: the architecture is {source}'s ({theirs.family}, {theirs.n_layer} "
            f"layers, {theirs.n_embd} wide); params.yaml's {', '.join(ignored)} "
            "are not used") if ignored else None
    return adopted, vocab, note


def warm_start(model: Llama, source: str | Path, tokenizer_sha256: str,
               key: str = TRAIN_KEY) -> str:
    """Copy ``source``'s weights into ``model``; return a one-line description."""
    source = Path(source)
    if not source.exists():
        raise InputError(f"{key}: {source}: no such file or directory")
    try:
        init, config = load_model(source)
    except InputError as e:  # e.g. a light snapshot or a bare safetensors file
        raise InputError(f"{key}: {e}") from None
    note = _check_source(model.config, model.vocab_size, init.config, init.vocab_size,
                         config, source, tokenizer_sha256, key)
    target = model.state_dict()
    with torch.no_grad():
        for name, tensor in init.state_dict().items():
            target[name].copy_(tensor)
    return f"train: weights from {source}, {init.num_params():,} parameters{note}"


def check_model_dir(ours: ModelConfig, our_vocab: int, source: str | Path,
                    tokenizer_sha256: str, key: str = TRAIN_KEY) -> str:
    """What :func:`warm_start` checks, from ``source``'s config alone (a model directory
    whose weights are then read a slice at a time); returns warm_start's line."""
    theirs, their_vocab, config = read_config(source)
    note = _check_source(ours, our_vocab, theirs, their_vocab, config, Path(source),
                         tokenizer_sha256, key)
    return f"train: weights from {source}, read shard by shard{note}"


def _check_source(ours: ModelConfig, our_vocab: int, theirs: ModelConfig, their_vocab: int,
                  config: dict, source: Path, tokenizer_sha256: str, key: str) -> str:
    """Architecture and tokenizer of the source against the run's; a note for the log."""
    _check_architecture(ours, our_vocab, theirs, their_vocab, source, key)
    recorded = config.get("tokenizer_sha256")
    if recorded and tokenizer_sha256 and recorded != tokenizer_sha256:
        raise InputError(
            f"{key}: {source} was trained with tokenizer {recorded[:12]}, the shards "
            f"use {tokenizer_sha256[:12]}; set tokenizer.init_from to its folder (its tokenizer) "
            "and rebuild the shards")
    return "" if recorded else " (its tokenizer is unrecorded: not checked)"


def _check_architecture(ours: ModelConfig, our_vocab: int, theirs: ModelConfig,
                        their_vocab: int, source: Path, key: str) -> None:
    if their_vocab != our_vocab:
        raise InputError(f"{key}: {source} has vocab_size {their_vocab}, the shards "
                         f"{our_vocab}")
    mine, other = dataclasses.asdict(ours), dataclasses.asdict(theirs)
    for fields in (mine, other):  # unset = as many key/value heads as query heads
        fields["n_kv_head"] = fields["n_kv_head"] or fields["n_head"]
    for field in mine:
        if field not in _FREE and mine[field] != other[field]:
            raise InputError(f"{key}: {source} has model.{field} {other[field]!r}, "
                             f"params.yaml {mine[field]!r}")
