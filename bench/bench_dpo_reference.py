"""A DPO optimizer step with the reference cached vs recomputed every step, on CPU.

The dpo stage scores each pair under the frozen reference once and caches the result
(``lmforge.train.preference.DpoObjective``), so a step whose pairs are cached runs the
policy alone. This measures what that saves: the real loop's ``optimizer_step`` with a
``DpoObjective`` whose cache is warm (every pair of the batches already scored) against
the same objective with its cache emptied before each step, which is what computing the
reference in every step costs. Both run eager, on the same batches, in interleaved
rounds; the headline is the ratio recomputed / cached of the median step time.

Data: the demo's packed pairs and SFT model (run ``dvc repro dpo_data sft`` first), or
``--pairs DIR --model DIR``.

    .venv/bin/python bench/bench_dpo_reference.py [--steps 4] [--rounds 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from lmforge.model.saved import extend_context, load_model
from lmforge.shards.loader import ShardSet
from lmforge.train.distributed import DistEnv
from lmforge.train.loop import make_reproducible
from lmforge.train.precision import resolve_precision
from lmforge.train.preference import DpoObjective, PairLoader
from lmforge.train.step import optimizer_step

CPU = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


class Batches:
    """Hands out the same prepared batches each round (a loader for ``optimizer_step``)."""

    def __init__(self, batches: list) -> None:
        self.batches, self.i = batches, 0

    def next_batch(self):
        batch = self.batches[self.i % len(self.batches)]
        self.i += 1
        return batch


def timed_steps(policy: torch.nn.Module, objective: DpoObjective, batches: list,
                cold: bool) -> float:
    """Seconds per optimizer step over ``batches`` (cache emptied before each if ``cold``)."""
    model = copy.deepcopy(policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    precision = resolve_precision("fp32", CPU.device)
    loader = Batches(batches)
    start = time.perf_counter()
    for _ in batches:
        if cold:
            for values in objective.cache.values():
                values.fill_(float("nan"))
        optimizer_step(model, None, model, opt, precision.grad_scaler(), precision, loader,
                       1, 1.0, CPU, objective)
    return (time.perf_counter() - start) / len(batches)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", default="data/dpo/train", help="packed pair shards")
    parser.add_argument("--model", default="models/sft", help="policy start and reference")
    parser.add_argument("--micro", type=int, default=16, help="rows per step")
    parser.add_argument("--steps", type=int, default=4, help="steps per round and mode")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    make_reproducible(CPU.device)

    shards = ShardSet(args.pairs)
    seq_len = int(shards.manifest["seq_len"])
    policy = extend_context(load_model(args.model)[0], seq_len).train()
    reference = extend_context(load_model(args.model)[0], seq_len).eval()
    reference.requires_grad_(False)
    loader = PairLoader(shards, seq_len, args.micro, seed=0)
    batches = [loader.next_batch() for _ in range(args.steps)]
    # Two objectives: one whose cache stays warm, one emptied before each of its steps.
    warm = DpoObjective(0.1, reference, len(shards.doc_ends), 1)
    cold = DpoObjective(0.1, reference, len(shards.doc_ends), 1)
    timed_steps(policy, warm, batches, cold=False)  # warm-up: scores every pair once
    timed_steps(policy, cold, batches, cold=True)
    assert not any(torch.isnan(warm.cache["train"][batch[3][batch[1] >= 0]]).any()
                   for batch in batches), "the warm cache misses a pair"

    times: dict[str, list[float]] = {"cached": [], "recomputed": []}
    for _ in range(args.rounds):
        times["cached"].append(timed_steps(policy, warm, batches, cold=False))
        times["recomputed"].append(timed_steps(policy, cold, batches, cold=True))
    cached, recomputed = (statistics.median(times[k]) for k in ("cached", "recomputed"))
    tokens = args.micro * seq_len
    print(f"DPO step, {args.micro} rows x {seq_len} tokens, {args.threads} threads, eager, "
          f"median of {args.rounds} rounds x {args.steps} steps")
    print(f"  reference cached     {cached * 1e3:8.1f} ms/step  {tokens / cached:8,.0f} tok/s")
    print(f"  reference recomputed {recomputed * 1e3:8.1f} ms/step  "
          f"{tokens / recomputed:8,.0f} tok/s")
    print(f"  recomputed / cached: {recomputed / cached:.2f}x the step time")


if __name__ == "__main__":
    main()
