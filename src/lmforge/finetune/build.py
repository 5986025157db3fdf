"""The sft_data stage's work: instruction records -> masked, packed shard sets.

Records (chat ``messages``, Alpaca, prompt/completion) are rendered with the chat
template (loss mask on assistant tokens only), split train/val by a seeded hash of the
content, and packed into rows of ``seq_len`` tokens (``lmforge.finetune.pack``). Every
record in is kept or rejected with a reason.
"""

from __future__ import annotations

import glob
from pathlib import Path
from typing import Any

import numpy as np

from lmforge.config import SftDataConfig
from lmforge.errors import InputError
from lmforge.finetune.pack import Packed, pack, split_by_hash
from lmforge.finetune.records import ASSISTANT, Example, read_examples
from lmforge.finetune.template import Rendered, chat_format, render_all
from lmforge.io import atomic_dir
from lmforge.shards.writer import ShardWriter
from lmforge.tokenizer import Tokenizer
from lmforge.tokenizer.files import find_tokenizer

DOMAIN = "instructions"
SHOW_REJECTS = 10


def source_files(patterns: list[str], key: str = "sft_data.sources") -> list[Path]:
    """The files ``key`` names, in order; a pattern matching nothing is an error."""
    files: list[Path] = []
    for pattern in patterns:
        matched = sorted(glob.glob(pattern, recursive=True))
        if not matched:
            raise InputError(f"{key}: {pattern} matches no file")
        files.extend(Path(m) for m in matched if Path(m) not in files)
    return files


def write_split(directory: Path, packed: Packed, tok: Tokenizer, seq_len: int,
                **extra: Any) -> dict[str, Any]:
    """One split as a masked shard set (``extra`` goes into its manifest); its manifest."""
    writer = ShardWriter(directory, tok.vocab_size, tok.sha256, [DOMAIN],
                         shard_tokens=1 << 30, loss_mask=True)
    writer.add(packed.tokens, packed.doc_lengths, packed.doc_bytes,
               np.zeros(len(packed.doc_lengths), np.int64), packed.mask)
    return writer.close({"rows": packed.rows, "seq_len": seq_len, **extra})


def split_metrics(packed: Packed, seq_len: int) -> dict[str, Any]:
    targets = int(packed.mask.sum())
    return {"examples": len(packed.doc_lengths), "rows": packed.rows,
            "tokens": len(packed.tokens), "target_tokens": targets,
            "target_share": round(targets / len(packed.tokens), 4),
            "pad_share": round(packed.pad_tokens / (packed.rows * seq_len + 1), 4)}


def expand_parts(rendered: list[Rendered], examples: list[Example]
                 ) -> tuple[list[Rendered], list[int], list[int]]:
    """One item per training example -- a record, or each of its per-turn parts (a
    template that rewrites earlier turns) -- with the UTF-8 bytes of the answers it
    learns and the index of the record it came from."""
    items, nbytes, origin = [], [], []
    for i, (r, ex) in enumerate(zip(rendered, examples, strict=True)):
        answers = [len(c.encode()) for role, c in ex.turns if role == ASSISTANT]
        if not r.parts:
            items.append(r)
            nbytes.append(sum(answers))
            origin.append(i)
            continue
        for (ids, mask), answer in zip(r.parts, answers, strict=True):  # one per answer
            items.append(Rendered(r.file, r.line, ids, mask))
            nbytes.append(answer)
            origin.append(i)
    return items, nbytes, origin


def build(cfg: SftDataConfig, tokenizer_path: Path, out: Path) -> dict[str, Any]:
    """Read, render, split, pack and write; return metrics/sft_data.json."""
    if find_tokenizer(tokenizer_path) is None:
        raise InputError(f"{tokenizer_path}: no tokenizer (run the tokenizer stage)")
    tok = Tokenizer.load(tokenizer_path)
    fmt = chat_format(tok)  # the model's template, or ours: one clear line if neither
    result = read_examples(source_files(cfg.sources), cfg.max_record_bytes)
    rendered = render_all(result, tok, max_tokens=cfg.seq_len)
    if not rendered:
        raise InputError(f"sft_data.sources: no usable example in {cfg.sources} "
                         f"({sum(result.counts.rejected.values())} rejected)")
    # Split by record, then expand: a record's per-turn examples stay on one side.
    train_idx, val_idx = split_by_hash(rendered, cfg.val_fraction, cfg.seed)
    rendered, reply_bytes, origin = expand_parts(rendered, result.examples)
    val_records = set(val_idx)
    train_idx = [j for j, i in enumerate(origin) if i not in val_records]
    val_idx = [j for j, i in enumerate(origin) if i in val_records]
    if not val_idx or not train_idx:
        raise InputError(f"sft_data: {len(rendered)} examples are too few to hold out "
                         f"val_fraction={cfg.val_fraction} (train {len(train_idx)}, val "
                         f"{len(val_idx)})")
    pad = fmt.pad_id  # any id: padding is never a target
    metrics: dict[str, Any] = {"counts": result.counts.as_dict(), "seq_len": cfg.seq_len}
    with atomic_dir(out) as tmp:
        for split, idx in (("train", train_idx), ("val", val_idx)):
            packed = pack([rendered[i] for i in idx], cfg.seq_len, pad,
                          [reply_bytes[i] for i in idx])
            write_split(tmp / split, packed, tok, cfg.seq_len)
            metrics[split] = split_metrics(packed, cfg.seq_len)
    lengths = sorted(len(r.ids) for r in rendered)
    metrics["example_tokens"] = {"mean": round(sum(lengths) / len(lengths), 1),
                                 "median": lengths[len(lengths) // 2], "max": lengths[-1]}
    metrics["files"] = [str(f) for f in source_files(cfg.sources)]
    metrics["first_rejects"] = [r.message() for r in result.rejects[:SHOW_REJECTS]]
    return metrics

