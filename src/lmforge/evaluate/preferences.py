"""Held-out preference pairs: does a model prefer the chosen response to the rejected one?

Each response is scored as the assistant reply to the pair's prompt, teacher-forced: the
summed log-probability of its tokens and the closing ``<|end|>`` (exactly what DPO sums).

* ``pref_accuracy``: the share of pairs whose chosen response is the more likely one
  (``log p(chosen) > log p(rejected)``): a figure every model has, base, SFT or DPO.
* ``reward_accuracy``: DPO's own figure, for a model against its reference: the share of
  pairs whose implicit reward margin ``(log pi - log ref)(chosen) - (log pi - log ref)
  (rejected)`` is > 0. The reference itself scores 0 margin on every pair.
* ``logp_margin``: the mean of ``log p(chosen) - log p(rejected)``, in nats.

Chance is 0.5 for both accuracies; ties count as not preferred.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lmforge.errors import InputError
from lmforge.evaluate.sequences import SequenceSet, model_seq_len, score_sequences
from lmforge.evaluate.stats import by_task, proportion
from lmforge.finetune.preferences import Pair, parse_pair
from lmforge.finetune.records import read_examples
from lmforge.tokenizer import Tokenizer


def read_pairs(path: str | Path) -> tuple[list[Pair], list[str]]:
    """The pairs of a preference file and each one's ``task`` (or "all"); a bad record is
    an error naming the file and line (a test set is read whole or not at all)."""
    result = read_examples([path], parse=lambda obj: (parse_pair(obj),
                                                      str(obj.get("task", "all"))))
    if result.rejects:
        raise InputError(result.rejects[0].message()
                         + f" ({len(result.rejects)} bad records in {path})")
    return [ex.turns[0] for ex in result.examples], [ex.turns[1] for ex in result.examples]


def pair_logps(model: torch.nn.Module, tokenizer: Tokenizer, pairs: Sequence[Pair],
               batch_size: int, device: str | torch.device = "cpu") -> np.ndarray:
    """``(n, 2)`` summed log-probs of (chosen, rejected) replies, each after its prompt."""
    seqs = SequenceSet(model_seq_len(model))
    index = np.zeros((len(pairs), 2), dtype=np.int64)
    for i, pair in enumerate(pairs):
        for side, response in enumerate((pair.chosen, pair.rejected)):
            if len(response) != 1:
                raise InputError(f"pair {i}: a multi-turn response; scoring takes one reply")
            index[i, side] = seqs.add(pair.prompt, response[0][1], tokenizer, f"pair {i}")
    scores = score_sequences(model, seqs.ids, seqs.starts, batch_size, device)
    return -scores.nats[index]


def preference_scores(logps: dict[str, np.ndarray], tasks: Sequence[str],
                      references: dict[str, str]) -> dict[str, Any]:
    """Per model: overall and per-task ``pref_accuracy`` (+ stderr), ``logp_margin``, and
    ``reward_accuracy`` against ``references[model]`` where it has one."""
    out: dict[str, Any] = {}
    for model, lp in logps.items():
        ref = references.get(model)
        out[model] = by_task(tasks, lambda sel, lp=lp, ref=ref: _figures(
            lp[sel], None if ref is None else logps[ref][sel], ref))
    return out


def _figures(lp: np.ndarray, ref_lp: np.ndarray | None, ref: str | None) -> dict[str, Any]:
    """One group of pairs' figures from its ``(n, 2)`` log-probs (and its reference's)."""
    margin = lp[:, 0] - lp[:, 1]
    acc, acc_se = proportion(margin > 0)
    fig = {"n": len(lp), "pref_accuracy": acc, "pref_accuracy_stderr": acc_se,
           "logp_margin": float(margin.mean()) if len(margin) else math.nan}
    if ref_lp is not None:
        reward = (lp[:, 0] - ref_lp[:, 0]) - (lp[:, 1] - ref_lp[:, 1])
        racc, racc_se = proportion(reward > 0)
        fig.update(reward_accuracy=racc, reward_accuracy_stderr=racc_se, reference=ref)
    return fig


def preferences_markdown(scores: dict[str, Any]) -> str:
    """Per task and model: preference accuracy (reward accuracy where there is one)."""
    models = list(scores)
    first = scores[models[0]]
    rewarded = [m for m in models if "reward_accuracy" in scores[m]["overall"]]
    header = ([f"{m} pref acc" for m in models] + [f"{m} reward acc" for m in rewarded])
    lines = ["| task | n | " + " | ".join(header) + " |",
             "|---|---:|" + "---:|" * len(header)]
    for task in ["overall", *first["tasks"]]:
        figs = {m: (scores[m]["overall"] if task == "overall" else scores[m]["tasks"][task])
                for m in models}
        cells = [f"{figs[m]['pref_accuracy']:.3f}" for m in models]
        cells += [f"{figs[m]['reward_accuracy']:.3f}" for m in rewarded]
        lines.append(f"| {task} | {figs[models[0]]['n']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n\nChance is 0.500 for both accuracies.\n"
