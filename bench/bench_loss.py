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

``--probe``: what ``train.fused_loss: auto`` compares (lmforge.train.loss_choice), at
issue 44's GPT-2 small shape (vocab 50,304, width 768, 16 x 1,024 tokens) and a Llama-3
vocabulary, under bf16 autocast and torch.compile on CUDA (fp32 and eager on a CPU):
each candidate's median forward + backward (its probe), the path auto would take, and
each path's loss and gradients against fp32 ``F.cross_entropy`` of the whole logits
(relative error, the largest over loss, d x and d W). ``--json PATH`` writes them.

    .venv/bin/python bench/bench_loss.py --probe --device cuda --json loss_probe.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from lmforge.model.loss import balanced_chunk, default_chunk_tokens, linear_cross_entropy
from lmforge.train import loss_choice
from lmforge.train.compiler import compile_support
from lmforge.train.precision import resolve_precision

SHAPES = [("demo 8k", 8192, 256, 4096), ("SmolLM2 49k", 49152, 576, 1024),
          ("Llama 3 128k", 128256, 1024, 512)]
BUDGETS = [1 << 20, 1 << 22, 1 << 24, 1 << 26]
# --probe: (name, vocab, width, tokens on CUDA); a CPU takes an eighth of the tokens.
PROBE_SHAPES = [("GPT-2 small 50k", 50304, 768, 16 * 1024), ("Llama 3 128k", 128256, 2048, 8192)]


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


def path_error(name: str, probe: loss_choice.HeadProbe) -> float:
    """Largest relative error of path ``name``'s loss, d x and d W (under the probe's
    autocast) against fp32 ``F.cross_entropy`` of the whole logits, on random inputs."""
    gen = torch.Generator(device=probe.device).manual_seed(1)
    x = torch.randn(probe.tokens, probe.width, device=probe.device, generator=gen)
    w = torch.randn(probe.vocab, probe.width, device=probe.device, generator=gen) * 0.02
    t = torch.randint(probe.vocab, (probe.tokens,), device=probe.device, generator=gen)
    t[::7] = -100
    path = loss_choice.loss_fn(name, 0.0, 0.0)
    ref = _loss_and_grads(lambda a, b: F.cross_entropy(a @ b.t(), t), x, w,
                          contextlib.nullcontext())
    got = _loss_and_grads(lambda a, b: path(a, b, t), x, w, probe.precision.autocast())
    return max(float((b - a).abs().max() / a.abs().max().clamp(min=1e-12))
               for a, b in zip(ref, got, strict=True))


def _loss_and_grads(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                    x: torch.Tensor, w: torch.Tensor,
                    ctx: contextlib.AbstractContextManager) -> list[torch.Tensor]:
    xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
    with ctx:
        loss = fn(xa, wa)
    loss.backward()
    return [loss.detach().float(), xa.grad.float(), wa.grad.float()]


def probe_paths(device: torch.device, out: Path | None) -> None:
    """``--probe``: each candidate's timing, auto's choice and each path's error."""
    precision = resolve_precision("auto", device)
    compiled = compile_support(device) is None
    rows = []
    for name, vocab, width, tokens in PROBE_SHAPES:
        tokens = tokens if device.type == "cuda" else tokens // 8
        probe = loss_choice.HeadProbe(vocab, width, tokens, torch.float32, True,
                                      torch.float32, device, precision, compiled)
        seconds = loss_choice.probe_seconds(loss_choice.candidates(True), probe)
        chosen, why = loss_choice.choose(seconds)
        errors = {path: path_error(path, probe) for path, s in seconds.items()
                  if s is not None}
        print(f"{name}: V={vocab} d={width}, {tokens:,} tokens, {precision.name}, "
              f"{'compiled' if compiled else 'eager'} on {device}: the probe picks {chosen} "
              f"({why}); relative error vs fp32 "
              + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()), flush=True)
        rows.append({"shape": name, "vocab": vocab, "width": width, "tokens": tokens,
                     "precision": precision.name, "compiled": compiled,
                     "device": torch.cuda.get_device_name(device) if device.type == "cuda"
                     else "cpu", "seconds": seconds, "auto": chosen, "rel_error": errors})
    if out is not None:
        out.write_text(json.dumps({"torch": torch.__version__, "rows": rows}, indent=2) + "\n",
                       encoding="utf-8")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--train-head", action="store_true")
    ap.add_argument("--probe", action="store_true",
                    help="time what fused_loss: auto compares, and check each path")
    ap.add_argument("--device", default="cpu", help="with --probe: cpu or cuda")
    ap.add_argument("--json", type=Path, default=None, help="with --probe: write the figures")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.probe:
        probe_paths(torch.device(args.device), args.json)
        return
    for name, vocab, width, tokens in SHAPES:
        rows = one_shape(vocab, width, tokens, args.repeats, args.train_head)
        plain = rows[0][1]
        print(f"{name}: V={vocab} d={width}, {tokens} tokens, {args.threads} threads, "
              f"head {'trained' if args.train_head else 'frozen'} (best of {args.repeats})")
        for label, secs in rows:
            print(f"  {label:<28} {secs:6.3f} s  plain/this {plain / secs:5.2f}x", flush=True)


if __name__ == "__main__":
    main()
