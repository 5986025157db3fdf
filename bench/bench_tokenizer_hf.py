"""Batch encode of lmforge's Hugging Face tokenizer backend against ``tokenizers`` itself.

On the demo corpus (``data/raw/demo``, every domain), in the same run and alternating:

- ``library``: ``tokenizers.Tokenizer.encode_batch(texts, add_special_tokens=False)`` on
  texts already in memory, ids taken from each ``Encoding`` -- the library's own batch
  encode, as a user of transformers' fast tokenizers gets it;
- ``ours``: ``lmforge.tokenizer.Tokenizer.load(...).encode_batch(texts)`` on the same
  texts (``num_threads=0``: the library's thread pool).

Both give the same ids (checked). The tokenizer is a byte-level BPE trained here on the
demo text with the Llama 3 pre-tokenizer (``--vocab``), or ``--tokenizer`` (a
tokenizer.json or a folder, e.g. SmolLM2's). Prints docs/s and tokens/s of each and the
ratio ours/library of the best of ``--repeats`` (target >= 0.90) and the median of the
back-to-back pairs.

    .venv/bin/python bench/bench_tokenizer_hf.py [--tokenizer PATH] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tokenizers import Tokenizer as RustTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import demo_docs  # noqa: E402

from lmforge.tokenizer import Tokenizer  # noqa: E402
from lmforge.tokenizer.files import locate_tokenizer  # noqa: E402


def train_demo_tokenizer(texts: list[str], out: Path, vocab: int) -> Path:
    """A Llama-3-style byte-level BPE trained on ``texts``, saved as ``out/tokenizer.json``."""
    from tokenizers import Regex, decoders, models, pre_tokenizers, trainers

    split = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
             r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
    tok = RustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|end_of_text|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    return out


def time_library(rust: RustTokenizer, texts: list[str]) -> tuple[float, int]:
    t0 = time.perf_counter()
    ids = [e.ids for e in rust.encode_batch(texts, add_special_tokens=False)]
    return time.perf_counter() - t0, sum(map(len, ids))


def time_ours(tok: Tokenizer, texts: list[str]) -> tuple[float, int]:
    t0 = time.perf_counter()
    ids = tok.encode_batch(texts)
    return time.perf_counter() - t0, sum(map(len, ids))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", help="tokenizer.json or a folder (default: train one)")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    texts = [t for _, t in demo_docs()]
    with tempfile.TemporaryDirectory() as tmp:
        path = (Path(args.tokenizer) if args.tokenizer
                else train_demo_tokenizer(texts, Path(tmp) / "tok", args.vocab))
        ours = Tokenizer.load(path)
        rust = RustTokenizer.from_file(str(locate_tokenizer(path)))
        rust.encode_special_tokens = True  # as ours encodes text
        want = [e.ids for e in rust.encode_batch(texts, add_special_tokens=False)]
        assert ours.encode_batch(texts) == want, "ids differ"
        lib, mine = [], []
        for _ in range(args.repeats):  # alternate, so both see the same disturbances
            lib.append(time_library(rust, texts))
            mine.append(time_ours(ours, texts))
    tokens = lib[0][1]
    chars = sum(map(len, texts))
    best_lib, best_ours = min(s for s, _ in lib), min(s for s, _ in mine)
    pairs = [a / b for (a, _), (b, _) in zip(lib, mine, strict=True)]
    print(f"tokenizer: {path} (vocab {ours.vocab_size}); {len(texts)} docs, {chars:,} chars, "
          f"{tokens:,} tokens")
    print(f"library  tokenizers.encode_batch  {len(texts) / best_lib:10.0f} docs/s "
          f"{tokens / best_lib:12.0f} tokens/s")
    print(f"ours     Tokenizer.encode_batch   {len(texts) / best_ours:10.0f} docs/s "
          f"{tokens / best_ours:12.0f} tokens/s")
    print(f"ratio ours/library: best {best_lib / best_ours:.3f}, median of pairs "
          f"{statistics.median(pairs):.3f} (target >= 0.90)")


if __name__ == "__main__":
    main()
