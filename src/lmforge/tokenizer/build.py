"""The tokenizer stage: sample mixed/train, train, write the model, score it on mixed/val;
or, with ``tokenizer.init_from``, copy an existing tokenizer (either backend) and score it."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from lmforge.config import TokenizerConfig, section_dict
from lmforge.errors import InputError
from lmforge.io import atomic_dir
from lmforge.tokenizer import Tokenizer
from lmforge.tokenizer.corpus import list_parts
from lmforge.tokenizer.files import copy_tokenizer, locate_tokenizer
from lmforge.tokenizer.hf import HFTokenizer
from lmforge.tokenizer.report import heldout_stats, vocab_stats
from lmforge.tokenizer.sample import balanced_sample
from lmforge.tokenizer.spm import SentencePieceTokenizer
from lmforge.tokenizer.train import train_model, vocab_text

MODEL_NAME = "tokenizer.model"


def build_tokenizer(train_dir: str | Path, val_dir: str | Path, out_dir: str | Path,
                    cfg: TokenizerConfig) -> dict[str, Any]:
    """Train a tokenizer on a sample of ``train_dir``; write ``out_dir``; return metrics.

    With ``cfg.init_from`` the given model is used as is (and scored the same way).
    """
    if cfg.init_from:
        return _reuse_tokenizer(cfg.init_from, val_dir, out_dir, cfg)
    train_parts, val_parts = list_parts(train_dir), list_parts(val_dir)
    t0 = time.perf_counter()
    sample = balanced_sample(train_parts, cfg.sample_chars, cfg.seed)
    sample_seconds = time.perf_counter() - t0
    if not sample.texts:
        raise InputError(f"{train_dir}: no text to train the tokenizer on")
    model, train_seconds = train_model(sample.texts, cfg)
    metrics = _write_and_score(model, val_parts, out_dir, cfg)
    metrics.update({
        "sample": {"chars": sum(sample.chars_per_domain.values()),
                   "chars_per_domain": sample.chars_per_domain,
                   "available_chars": sample.available_chars,
                   "repeated_ids_skipped": sample.repeats_skipped,
                   "peak_held_chars": sample.peak_held_chars},
        "sample_seconds": round(sample_seconds, 3),
        "train_seconds": round(train_seconds, 3),
    })
    return metrics


def _reuse_tokenizer(source: str, val_dir: str | Path, out_dir: str | Path,
                     cfg: TokenizerConfig) -> dict[str, Any]:
    """``tokenizer.init_from``: copy an existing tokenizer into ``out_dir`` as it is.

    ``source`` is a tokenizer file or a folder holding one (a model folder such as
    ``models/base`` from ``lmforge import hf``): a sentencepiece ``tokenizer.model``, or
    a Hugging Face ``tokenizer.json`` with its companion files.
    """
    try:
        path = locate_tokenizer(source)
        tok = Tokenizer.load(path)
    except InputError as e:
        raise InputError(f"tokenizer.init_from: {e}") from None
    val_parts = list_parts(val_dir)
    if isinstance(tok, SentencePieceTokenizer):
        metrics = _write_and_score(tok.model, val_parts, out_dir, cfg)
    else:
        with atomic_dir(out_dir) as tmp:
            copy_tokenizer(path, tmp)
        metrics = _score(Tokenizer.load(out_dir), val_parts, cfg)
    return _imported_metrics(metrics, tok, path, cfg)


def _imported_metrics(metrics: dict[str, Any], tok: Tokenizer, path: Path,
                      cfg: TokenizerConfig) -> dict[str, Any]:
    """What is true of an imported tokenizer: only the params the import reads (the
    training settings are unused), and its merges only where it has a merge list."""
    # Multi-character pieces are merges learned only for a BPE trained here; an imported
    # vocabulary's other multi-character pieces may be added tokens or unigram pieces.
    metrics.pop("merges_learned")
    merges = imported_merges(tok)
    if merges is not None:
        metrics["merges"] = merges
    metrics.update({"params": {"init_from": cfg.init_from, "num_threads": cfg.num_threads},
                    "init_from": str(path), "sample": None, "sample_seconds": 0.0,
                    "train_seconds": 0.0})
    return metrics


def imported_merges(tok: Tokenizer) -> int | None:
    """The merges of a BPE tokenizer: a tokenizer.json's merge list, or a sentencepiece
    BPE model's merged (multi-character normal) pieces; None for any other model."""
    if isinstance(tok, SentencePieceTokenizer):
        proto = tok.proto
        if proto.trainer_spec.model_type != proto.trainer_spec.BPE:
            return None
        # sentencepiece's BPE adds one normal piece per merge; user-defined pieces are
        # another type, and single characters are its alphabet.
        return sum(p.type == p.NORMAL and len(p.piece) > 1 for p in proto.pieces)
    model = (tok.spec.get("model") or {}) if isinstance(tok, HFTokenizer) else {}
    if model.get("type") != "BPE" or not model.get("merges"):
        return None
    return len(model["merges"])


def summary(metrics: dict[str, Any]) -> str:
    """The stage's one line: vocabulary, merges where the tokenizer has them, compression."""
    if metrics.get("init_from"):  # an import has merges only if it is a BPE
        merges, origin = metrics.get("merges"), f"reused {metrics['init_from']}"
    else:
        merges, origin = metrics["merges_learned"], f"trained in {metrics['train_seconds']} s"
    return (f"tokenizer: vocab {metrics['vocab_size']}"
            + ("" if merges is None else f", {merges} merges")
            + f", alphabet {metrics['alphabet_size']}, {metrics['chars_per_token']['all']} "
              f"chars/token, lossless={metrics['lossless']}, {origin}")


def _write_and_score(model: bytes, val_parts: list[Path], out_dir: str | Path,
                     cfg: TokenizerConfig) -> dict[str, Any]:
    """Write ``model`` (and its vocab listing) to ``out_dir``; score it on ``val_parts``."""
    with atomic_dir(out_dir) as tmp:
        (tmp / MODEL_NAME).write_bytes(model)
        (tmp / MODEL_NAME).with_suffix(".vocab").write_text(vocab_text(model), encoding="utf-8")
    return _score(SentencePieceTokenizer(model, str(Path(out_dir) / MODEL_NAME)), val_parts, cfg)


def _score(tok: Tokenizer, val_parts: list[Path], cfg: TokenizerConfig) -> dict[str, Any]:
    """The tokenizer's metrics: identity, losslessness, vocabulary and held-out stats."""
    held = heldout_stats(tok, val_parts, cfg.num_threads)
    failures = held["all"]["roundtrip_failures"]
    return {
        "params": section_dict(cfg),  # an import keeps only the keys it reads
        "backend": tok.backend,
        "sha256": tok.sha256,
        "vocab_size": tok.vocab_size,
        # Lossless by construction (no normalisation, every character encodable), and checked.
        "lossless": _lossless_by_construction(tok) and failures == 0,
        **_normalizer_note(tok),
        "roundtrip_failures": failures,
        **vocab_stats(tok),
        "chars_per_token": {d: s["chars_per_token"] for d, s in held["domains"].items()}
        | {"all": held["all"]["chars_per_token"]},
        "byte_fallback_rate": {d: s["byte_fallback_rate"] for d, s in held["domains"].items()}
        | {"all": held["all"]["byte_fallback_rate"]},
        "unk_rate": {d: s["unk_rate"] for d, s in held["domains"].items()}
        | {"all": held["all"]["unk_rate"]},
        "heldout": held,
    }


def _lossless_by_construction(tok: Tokenizer) -> bool:
    """sentencepiece: identity normalisation and byte fallback, read from the model itself.
    Hugging Face: no normalizer (the held-out round trip checks the rest)."""
    if isinstance(tok, SentencePieceTokenizer):
        return tok.normalizer is None and tok.byte_fallback
    return tok.normalizer is None


def _normalizer_note(tok: Tokenizer) -> dict[str, Any]:
    """For a normalising Hugging Face tokenizer: its normalizer and what that costs."""
    if tok.backend != "hf" or tok.normalizer is None:
        return {}
    return {"normalizer": tok.normalizer,
            "lossy": f"text that {tok.normalizer} normalisation changes does not round-trip"}
