"""The fused loss (``lmforge.model.loss.linear_cross_entropy``) against the plain path.

For each vocabulary (the demo's 8k, SmolLM2's 49k, Llama 3's 128k, with their widths and a
micro-batch of tokens like a step's), times forward + backward of the loss of
``x @ W.T`` against random targets, in the same process and threads:

- ``plain``: ``F.cross_entropy(x @ W.T, t)`` -- the whole ``tokens x V`` logits, what a
  transformers model does;
- ``fused`` at chunks of 2^20, 2^22, 2^24 and 2^26 logits, and at ``default`` (what
  ``linear_cross_entropy`` picks: ``default_chunk_tokens``, balanced).

Prints the best of ``--repeats`` seconds and plain/this for each. The head is frozen
(a LoRA step: only ``x`` needs a gradient) unless ``--train-head``.

    .venv/bin/python bench/bench_loss.py [--repeats 3] [--threads 2] [--train-head]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from lmforge.model.loss import balanced_chunk, default_chunk_tokens, linear_cross_entropy

SHAPES = [("demo 8k", 8192, 256, 4096), ("SmolLM2 49k", 49152, 576, 1024),
          ("Llama 3 128k", 128256, 1024, 512)]
BUDGETS = [1 << 20, 1 << 22, 1 << 24, 1 << 26]


def best_of(fn: Callable[[], None], repeats: int) -> float:
    """Fewest seconds of ``repeats`` calls of ``fn``."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def one_shape(vocab: int, width: int, tokens: int, repeats: int, train_head: bool
              ) -> list[tuple[str, float]]:
    """(label, seconds) of the plain loss and of the fused one at each chunk."""
    torch.manual_seed(0)
    x = torch.randn(tokens, width, requires_grad=True)
    w = (torch.randn(vocab, width) * 0.02).requires_grad_(train_head)
    t = torch.randint(0, vocab, (tokens,))
    rows = [("plain", best_of(lambda: F.cross_entropy(x @ w.t(), t).backward(), repeats))]
    chunks = [(f"2^{b.bit_length() - 1}", max(1, b // vocab)) for b in BUDGETS]
    chunks.append(("default", balanced_chunk(tokens, default_chunk_tokens(vocab, "cpu"))))
    for label, chunk in chunks:
        secs = best_of(lambda c=chunk: linear_cross_entropy(x, w, t, chunk_tokens=c).backward(),
                       repeats)
        rows.append((f"fused {label} ({chunk} tok)", secs))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--train-head", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    for name, vocab, width, tokens in SHAPES:
        rows = one_shape(vocab, width, tokens, args.repeats, args.train_head)
        plain = rows[0][1]
        print(f"{name}: V={vocab} d={width}, {tokens} tokens, {args.threads} threads, "
              f"head {'trained' if args.train_head else 'frozen'} (best of {args.repeats})")
        for label, secs in rows:
            print(f"  {label:<28} {secs:6.3f} s  plain/this {plain / secs:5.2f}x", flush=True)


if __name__ == "__main__":
    main()
