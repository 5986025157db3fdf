"""The dpo_data stage's work: preference records -> masked shard sets of packed pairs.

Pairs (``lmforge.finetune.preferences``) are rendered with the chat template (loss mask
on the responses only), split train/val by a seeded hash of the prompt, and packed
whole into rows of ``seq_len`` tokens, chosen then rejected. Every record in is kept or
rejected with a reason.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lmforge.config import DpoDataConfig
from lmforge.errors import InputError
from lmforge.finetune.build import SHOW_REJECTS, source_files, split_metrics, write_split
from lmforge.finetune.pack import split_by_hash
from lmforge.finetune.preferences import pack_pairs, parse_pair, render_pairs
from lmforge.finetune.records import ASSISTANT, read_examples
from lmforge.finetune.template import Rendered, chat_format
from lmforge.io import atomic_dir
from lmforge.tokenizer import Tokenizer
from lmforge.tokenizer.files import find_tokenizer


def build_pairs(cfg: DpoDataConfig, tokenizer_path: Path, out: Path) -> dict[str, Any]:
    """Read, render, split and pack preference pairs; return metrics/dpo_data.json.

    Pairs are split by a seeded hash of their prompt, so pairs sharing a prompt land on
    the same side; rows hold whole pairs, chosen then rejected (``pack_pairs``).
    """
    if find_tokenizer(tokenizer_path) is None:
        raise InputError(f"{tokenizer_path}: no tokenizer (run the tokenizer stage)")
    tok = Tokenizer.load(tokenizer_path)
    fmt = chat_format(tok)  # the model's template, or ours: one clear line if neither
    files = source_files(cfg.sources, "dpo_data.sources")
    result = read_examples(files, cfg.max_record_bytes, parse=parse_pair)
    pairs = render_pairs(result, tok, max_tokens=cfg.seq_len)
    if not pairs:
        raise InputError(f"dpo_data.sources: no usable pair in {cfg.sources} "
                         f"({sum(result.counts.rejected.values())} rejected)")
    reply_bytes = [tuple(sum(len(c.encode()) for role, c in side if role == ASSISTANT)
                         for side in (ex.turns.chosen, ex.turns.rejected))
                   for ex in result.examples]
    prompts = [Rendered(c.file, c.line, c.ids[:c.mask.index(1)], []) for c, _ in pairs]
    train_idx, val_idx = split_by_hash(prompts, cfg.val_fraction, cfg.seed)
    if not val_idx or not train_idx:
        raise InputError(f"dpo_data: {len(pairs)} pairs are too few to hold out "
                         f"val_fraction={cfg.val_fraction} (train {len(train_idx)}, val "
                         f"{len(val_idx)})")
    pad = fmt.pad_id  # any id: padding is never a target
    metrics: dict[str, Any] = {"counts": result.counts.as_dict(), "seq_len": cfg.seq_len}
    with atomic_dir(out) as tmp:
        for split, idx in (("train", train_idx), ("val", val_idx)):
            packed = pack_pairs([pairs[i] for i in idx], cfg.seq_len, pad,
                                [reply_bytes[i] for i in idx])
            write_split(tmp / split, packed, tok, cfg.seq_len, pairs=len(idx))
            metrics[split] = {"pairs": len(idx), **split_metrics(packed, cfg.seq_len)}
    lengths = sorted(len(c.ids) + len(r.ids) for c, r in pairs)
    metrics["pair_tokens"] = {"mean": round(sum(lengths) / len(lengths), 1),
                              "median": lengths[len(lengths) // 2], "max": lengths[-1]}
    metrics["files"] = [str(f) for f in files]
    metrics["first_rejects"] = [r.message() for r in result.rejects[:SHOW_REJECTS]]
    return metrics
