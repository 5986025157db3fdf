"""``lmforge inspect shards DIR``: what a shard set holds, in a page of text.

Counts per domain, dtype and sizes, a histogram of document lengths in tokens, and one
decoded document per domain -- enough to see at a glance that the shards stage did what
the params asked (the right tokenizer, EOS after each document, no domain missing).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from lmforge.errors import InputError
from lmforge.shards.format import MANIFEST
from lmforge.tokenizer import Tokenizer
from lmforge.tokenizer.files import find_tokenizer

if TYPE_CHECKING:
    from lmforge.shards.loader import ShardSet

HIST_WIDTH = 40  # characters of the longest histogram bar
TOKENIZER_GUESS = Path("models/tokenizer")  # the tokenizer stage's folder, either backend


def inspect_shards(path: str | Path, tokenizer_path: str | Path | None = None, *,
                   verify: bool = False, sample_chars: int = 240) -> str:
    """A report on the shard set at ``path`` (or on each of ``path/{train,val}``).

    ``tokenizer_path`` decodes the samples; without it, ``models/tokenizer/``
    above ``path`` is used when its hash matches the shards. ``verify`` also checks every
    shard's sha256 against the manifest.
    """
    from lmforge.shards.loader import ShardSet  # torch: only when a command runs

    path = Path(path)
    if not (path / MANIFEST).is_file():
        subsets = sorted(p.parent for p in path.glob(f"*/{MANIFEST}"))
        if subsets:
            return "\n\n".join(inspect_shards(p, tokenizer_path, verify=verify,
                                              sample_chars=sample_chars) for p in subsets)
    shards = ShardSet(path, verify_checksums=verify)
    tok, note = _tokenizer_for(shards, tokenizer_path)
    lengths = np.diff(shards.doc_ends, prepend=0)
    sections = [_summary(shards, lengths, verify), _domain_table(shards, lengths),
                _length_histogram(lengths), _samples(shards, tok, note, sample_chars)]
    return "\n\n".join(sections)


def _tokenizer_for(shards: ShardSet,
                   tokenizer_path: str | Path | None) -> tuple[Tokenizer | None, str]:
    """The tokenizer that made ``shards``, or None and the reason samples show ids."""
    if tokenizer_path is None:
        guesses = [p / TOKENIZER_GUESS for p in shards.path.resolve().parents]
        tokenizer_path = next((p for p in guesses if find_tokenizer(p) is not None), None)
        if tokenizer_path is None:
            return None, "no tokenizer found; pass --tokenizer to decode"
    tok = Tokenizer.load(tokenizer_path)
    if tok.sha256 != shards.tokenizer_sha256:
        return None, (f"{tokenizer_path} is tokenizer {tok.sha256[:12]}, but these shards were "
                      f"made with {shards.tokenizer_sha256[:12]}; showing ids")
    return tok, ""


def _summary(shards: ShardSet, lengths: np.ndarray, verify: bool) -> str:
    m = shards.manifest
    nbytes = int(shards.doc_bytes.sum())
    specials = ", ".join(f"{name} {'on' if m[name] else 'off'}" for name in ("bos", "eos")
                         if name in m)
    return "\n".join([
        f"shards {shards.path}: {len(m['shards'])} file(s), format v{m['format_version']}, "
        f"{shards.dtype.name}, vocab {shards.vocab_size:,}, "
        f"tokenizer {shards.tokenizer_sha256[:12]}",
        f"{len(lengths):,} documents, {shards.num_tokens:,} tokens, {nbytes / 1e6:,.1f} MB "
        f"of text, {nbytes / max(shards.num_tokens, 1):.2f} bytes/token"
        + (f"; {specials}" if specials else ""),
        f"checksums: {'verified' if verify else 'not checked (--verify reads every byte)'}",
    ])


def _domain_table(shards: ShardSet, lengths: np.ndarray) -> str:
    n_dom = len(shards.domain_names)
    docs = np.bincount(shards.doc_domains, minlength=n_dom)
    tokens = np.bincount(shards.doc_domains, weights=lengths, minlength=n_dom)
    nbytes = np.bincount(shards.doc_domains, weights=shards.doc_bytes.astype(np.float64),
                         minlength=n_dom)
    width = max(len("domain"), *(len(d) for d in shards.domain_names))
    rows = [f"{'domain':<{width}} {'docs':>10} {'tokens':>14} {'share':>7} "
            f"{'tokens/doc':>11} {'bytes/token':>12}"]
    names = [*shards.domain_names, "all"]
    for name, d, t, b in zip(names, [*docs, docs.sum()], [*tokens, tokens.sum()],
                             [*nbytes, nbytes.sum()], strict=True):
        rows.append(f"{name:<{width}} {int(d):>10,} {int(t):>14,} "
                    f"{t / shards.num_tokens:>7.1%} {t / max(d, 1):>11,.1f} "
                    f"{b / max(t, 1):>12.2f}")
    return "\n".join(rows)


def _length_histogram(lengths: np.ndarray) -> str:
    """Documents per power-of-two length bucket, as text bars."""
    # Bucket 0 holds empty documents; bucket k >= 1 holds lengths in [2^(k-1), 2^k).
    buckets = np.zeros(len(lengths), dtype=np.int64)
    nonzero = lengths > 0
    buckets[nonzero] = np.floor(np.log2(lengths[nonzero])).astype(np.int64) + 1
    counts = np.bincount(buckets)
    first = int(np.flatnonzero(counts)[0])
    scale = HIST_WIDTH / counts.max()
    rows = [f"document length (tokens)  min {int(lengths.min()):,}  "
            f"median {float(np.median(lengths)):,.0f}  mean {float(lengths.mean()):,.1f}  "
            f"max {int(lengths.max()):,}"]
    for k in range(first, len(counts)):
        lo, hi = (0, 0) if k == 0 else (1 << (k - 1), (1 << k) - 1)
        label = f"{lo:,}" if lo == hi else f"{lo:,}-{hi:,}"
        bar = "#" * int(np.ceil(counts[k] * scale))
        rows.append(f"  {label:>15} | {bar:<{HIST_WIDTH}} {counts[k]:,}")
    return "\n".join(rows)


def _samples(shards: ShardSet, tok: Tokenizer | None, note: str, sample_chars: int) -> str:
    """The first document of each domain, decoded (escaped, so whitespace shows)."""
    rows = ["samples (first document of each domain)" + (f" -- {note}" if note else "")]
    starts = shards.doc_starts()
    for code, name in enumerate(shards.domain_names):
        hits = np.flatnonzero(shards.doc_domains == code)
        if not len(hits):
            rows.append(f"  {name}: no documents")
            continue
        i = int(hits[0])
        ids = shards.read(int(starts[i]), int(shards.doc_ends[i]))
        rows.append(f"  {name} (document {i:,}, {len(ids):,} tokens):")
        if tok is None:
            shown = " ".join(map(str, ids[:sample_chars // 6].tolist()))
            more = len(ids) > sample_chars // 6
        else:
            text = tok.decode(ids.tolist())
            shown, more = repr(text[:sample_chars]), len(text) > sample_chars
        rows.append(f"    {shown}{' ...' if more else ''}")
    return "\n".join(rows)


def cmd_inspect_shards(args: argparse.Namespace) -> None:
    """Print :func:`inspect_shards` for ``args.dir``."""
    if not Path(args.dir).exists():
        raise InputError(f"{args.dir}: no such shards directory")
    print(inspect_shards(args.dir, args.tokenizer, verify=args.verify))


def add_inspect_parser(subparsers: argparse._SubParsersAction) -> argparse._SubParsersAction:
    """Register ``inspect shards DIR [--tokenizer PATH] [--verify]``.

    Returns the ``inspect`` command's own subparsers, so other ``inspect X`` tools can be
    added beside ``shards``.
    """
    inspect = subparsers.add_parser("inspect", help="look inside pipeline outputs")
    kinds = inspect.add_subparsers(dest="what", required=True)
    p = kinds.add_parser("shards", help="counts per domain, dtype, document lengths, samples")
    p.add_argument("dir", help="a shards directory (data/shards/train), or data/shards")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer.model to decode samples (default: models/tokenizer/ "
                        "above DIR, if it made these shards)")
    p.add_argument("--verify", action="store_true", help="also check every sha256")
    p.set_defaults(func=cmd_inspect_shards)
    return kinds
