"""How much general ability a fine-tuned model lost: base vs tuned val figures per domain.

Both models are scored on the same pretraining val split (``score_split(...).as_dict``);
a domain's change counts as forgetting only when it is larger than the noise, measured by
the two figures' standard errors (bootstrap over documents, lmforge.evaluate.scoring)
in the one z-test of lmforge.evaluate.stats, here one-sided: only a rise is forgetting.
"""

from __future__ import annotations

import math
from typing import Any

from lmforge.evaluate.report import fig
from lmforge.evaluate.stats import SIGNIFICANT_Z, z_score


def forgetting_rows(base: dict[str, Any], tuned: dict[str, Any],
                    figure: str = "bits_per_byte") -> list[dict[str, Any]]:
    """One row per domain scored in both, then the mixture-weighted and token-weighted
    overall rows: base, tuned, their stderrs, the change (tuned - base) and its z."""
    rows = []
    for name in sorted(set(base["domains"]) & set(tuned["domains"])):
        rows.append(_row(name, base["domains"][name], tuned["domains"][name], figure))
    for overall in ("mix_weighted", "token_weighted"):
        if overall in base and overall in tuned:
            rows.append(_row(overall, base[overall], tuned[overall], figure))
    return rows


def _row(name: str, b: dict[str, Any], t: dict[str, Any], figure: str) -> dict[str, Any]:
    se_b = b.get(f"{figure}_stderr", float("nan"))
    se_t = t.get(f"{figure}_stderr", float("nan"))
    delta = t[figure] - b[figure]
    z = z_score(delta, se_b, se_t)
    return {"domain": name, "base": b[figure], "base_stderr": se_b, "tuned": t[figure],
            "tuned_stderr": se_t, "change": delta, "z": z,
            "forgot": bool(math.isfinite(z) and z > SIGNIFICANT_Z)}


def forgetting_markdown(rows: list[dict[str, Any]], figure: str = "bits_per_byte") -> str:
    """The rows as a markdown table (what the README and MLflow show)."""
    lines = [f"| domain | base {figure} | tuned {figure} | change | z | forgotten |",
             "|---|---:|---:|---:|---:|---|"]
    for r in rows:
        # Without error bars (the token-weighted figure has none) there is no verdict.
        known = math.isfinite(r["z"])
        z = f"{r['z']:+.1f}" if known else "n/a"
        verdict = ("yes" if r["forgot"] else "no") if known else "n/a"
        lines.append(f"| {r['domain']} | {fig(r['base'], r['base_stderr'], 4)} | "
                     f"{fig(r['tuned'], r['tuned_stderr'], 4)} | {r['change']:+.4f} | "
                     f"{z} | {verdict} |")
    return "\n".join(lines) + "\n"
