"""Markdown reports of held-out scores: a base and a tuned model's figures side by side.

``tasks_markdown`` is the held-out task table of metrics/post_tasks.md; ``fig`` is the
``value ± stderr`` cell every evaluation table uses (forgetting, preferences).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from lmforge.evaluate.stats import SIGNIFICANT_Z, significant, z_score

OVERALL = "all"  # the overall row's name in tasks_markdown


def fig(value: float, stderr: float, digits: int = 3) -> str:
    """``value ± stderr`` to ``digits`` places; the value alone when the error is unknown,
    ``n/a`` when the value is."""
    if not math.isfinite(value):
        return "n/a"
    return (f"{value:.{digits}f} ± {stderr:.{digits}f}" if math.isfinite(stderr)
            else f"{value:.{digits}f}")


def verdict(delta: float, se_base: float, se_tuned: float) -> str:
    """``yes`` when ``delta`` is beyond ``SIGNIFICANT_Z`` standard errors of the difference
    (lmforge.evaluate.stats.z_score), ``no`` when not, ``n/a`` when it cannot be told."""
    z = z_score(delta, se_base, se_tuned)
    return "n/a" if math.isnan(z) else ("yes" if significant(z) else "no")
def _rows(base: dict[str, Any], tuned: dict[str, Any]) -> Iterable[tuple[str, dict, dict]]:
    """(name, base figures, tuned figures): the tasks both have, then the overall row."""
    for task in sorted(set(base["tasks"]) & set(tuned["tasks"])):
        yield task, base["tasks"][task], tuned["tasks"][task]
    yield OVERALL, base["overall"], tuned["overall"]


def _compare_table(title: str, base: dict[str, Any] | None, tuned: dict[str, Any] | None,
                   key: str, digits: int, extra: tuple[str, ...] = (),
                   shared: tuple[str, ...] = ()) -> list[str]:
    """One markdown section: per task n, base and tuned ``key`` ± stderr, the change and
    whether it is beyond 2 standard errors; ``extra`` keys add base and tuned columns,
    ``shared`` keys (the same for both models, such as chance) one column."""
    if not base or not tuned or not base.get("tasks"):
        return []
    head = f"| task | n | base {key} | tuned {key} | change | beyond {SIGNIFICANT_Z:g} se |"
    head += "".join(f" base {e} | tuned {e} |" for e in extra)
    head += "".join(f" {s} |" for s in shared)
    lines = [f"### {title}", "", head,
             "|---|---:|---:|---:|---:|---|" + "---:|---:|" * len(extra) + "---:|" * len(shared)]
    for name, b, t in _rows(base, tuned):
        se_b, se_t = b.get(f"{key}_stderr", math.nan), t.get(f"{key}_stderr", math.nan)
        delta = t[key] - b[key]
        n = str(b["n"]) if b["n"] == t["n"] else f"{b['n']} / {t['n']}"
        row = (f"| {name} | {n} | {fig(b[key], se_b, digits)} | {fig(t[key], se_t, digits)} "
               f"| {delta:+.{digits}f} | {verdict(delta, se_b, se_t)} |")
        for e in extra:
            row += (f" {fig(b[e], b.get(f'{e}_stderr', math.nan), digits)} |"
                    f" {fig(t[e], t.get(f'{e}_stderr', math.nan), digits)} |")
        row += "".join(f" {fig(b[s], math.nan, digits)} |" for s in shared)
        lines.append(row)
    return [*lines, ""]


def tasks_markdown(base: dict[str, Any], tuned: dict[str, Any]) -> str:
    """Base vs fine-tuned, per task: exact match, response loss and multiple choice.

    ``base`` and ``tuned`` are ``score_responses(...)`` merged with ``score_choices(...)``
    (``{**responses, **choices}``); a section either lacks is left out. Multiple choice
    shows the headline ``acc`` with its significance test, then ``acc_norm`` and chance.
    """
    lines = []
    lines += _compare_table("Exact match (greedy reply is an accepted answer; higher is "
                            "better)", base.get("exact_match"), tuned.get("exact_match"),
                            "exact_match", 3)
    lines += _compare_table("Response loss (nats per reply token; lower is better)",
                            base.get("response"), tuned.get("response"), "loss", 4,
                            extra=("bits_per_byte",))
    lines += _compare_table("Token accuracy (share of reply tokens that are the greedy "
                            "choice given the reference so far; higher is better)",
                            base.get("response"), tuned.get("response"), "token_accuracy", 3)
    lines += _compare_table("Multiple choice (accuracy by log-likelihood; higher is better)",
                            base.get("multiple_choice"), tuned.get("multiple_choice"),
                            "acc", 3, extra=("acc_norm",), shared=("chance",))
    return "\n".join(lines)
