"""The filter report: per domain, per rule, how many documents it rejected, with a few
rejected examples and the measured value beside the threshold (metrics/filter_report.md),
so a user sees why before training. ``lmforge filter report`` renders it for a sample."""

from __future__ import annotations

from typing import Any

from lmforge.config import FilterConfig
from lmforge.data.filters import RULES, domain_rules

# Rejected examples kept per (domain, rule), and characters of each one shown.
EXAMPLES = 3
SNIPPET_CHARS = 160


def add_example(examples: dict[str, dict[str, list]], domain: str, rule: str, rid: str,
                value: float, text: str) -> None:
    """Keep the first EXAMPLES rejects of ``rule`` in ``domain`` (id, value, snippet)."""
    found = examples.setdefault(domain, {}).setdefault(rule, [])
    if len(found) < EXAMPLES:
        found.append([rid, value, snippet(text)])


def merge_examples(into: dict[str, dict[str, list]], more: dict[str, dict[str, list]]) -> None:
    for domain, by_rule in more.items():
        for rule, found in by_rule.items():
            kept = into.setdefault(domain, {}).setdefault(rule, [])
            kept.extend(found[: EXAMPLES - len(kept)])


def snippet(text: str) -> str:
    """The start of a text on one line (⏎ for a newline), markdown-safe."""
    short = text[:SNIPPET_CHARS].replace("\n", "⏎").replace("|", "\\|").replace("`", "'")
    return short + ("…" if len(text) > SNIPPET_CHARS else "")


def threshold_text(rule: str, settings: dict[str, Any]) -> str:
    """``min 50``, ``max 0.3``, or ``any`` for a yes/no rule."""
    if rule == "language":
        return "keep " + ", ".join(settings["languages"] or [])
    r = RULES.get(rule)
    if r is None or r.threshold is None:
        return "any" if r is not None else "-"
    return f"{'min' if r.reject_below else 'max'} {settings[r.threshold]:g}"


def language_text(c: dict[str, Any], top: int = 4) -> str:
    """``zh 61%, en 38%, ja 1%`` (the most frequent languages of a domain's documents)."""
    found = c.get("languages") or {}
    n = sum(found.values())
    shown = [f"{lang} {k / n:.0%}" for lang, k in list(found.items())[:top]]
    more = len(found) - top
    return ", ".join(shown) + (f" (+{more} more)" if more > 0 else "") if n else "-"


def render(cfg: FilterConfig, metrics: dict[str, Any], examples: dict[str, dict[str, list]],
           problems: list[str] = (), title: str = "Filter report") -> str:
    """The report as markdown: a table of domains, the loss guard's findings, then each
    domain's rules, rejections and examples."""
    lines = [f"# {title}", "",
             "Per domain: its kind, how many documents each rule rejected (the first rule "
             "that failed) and how many of the rejected documents it fails at all, and the first rejected examples with the measured value beside "
             "the threshold. Tune with `filter.domains.<domain>` (kind, skip, any threshold); "
             "see README \"Filter kinds\".", "",
             "| domain | kind | in | kept | lost | max_loss | languages (of the documents in) |",
             "|---|---|---:|---:|---:|---:|---|"]
    for domain, c in metrics["domains"].items():
        s = domain_rules(cfg, domain).settings
        loss = 1 - c["kept"] / c["in"] if c["in"] else 0.0
        flag = " **over**" if loss > s["max_loss"] else ""
        lines.append(f"| {domain} | {s['kind']} | {c['in']:,} | {c['kept']:,} | "
                     f"{loss:.1%}{flag} | {s['max_loss']:g} | {language_text(c)} |")
    if problems:
        lines += ["", "Loss guard (the filter stage stops on these):", ""]
        lines += [f"- {p}" for p in problems]
    for domain, c in metrics["domains"].items():
        rules = domain_rules(cfg, domain)
        lines += ["", f"## {domain} (kind {rules.settings['kind']})", "",
                  f"Rules run: {', '.join(r.name for r in rules.rules) or 'none'}.", ""]
        if not c["rejected"]:
            lines.append("Nothing rejected.")
            continue
        lines += ["| rule | rejected (first to fail) | fails (of the rejected) | threshold |",
                  "|---|---:|---:|---|"]
        top = sorted(c["rejected"].items(), key=lambda kv: (-kv[1], kv[0]))
        fails = c.get("fails", {})
        for rule in [r for r, _ in top] + [r for r in fails if r not in c["rejected"]]:
            n_fails = f"{fails[rule]:,}" if rule in fails else "-"  # PII, language: not rules
            lines.append(f"| {rule} | {c['rejected'].get(rule, 0):,} | {n_fails} "
                         f"| {threshold_text(rule, rules.settings)} |")
        lines.append("")
        for rule, _ in top:
            for rid, value, text in examples.get(domain, {}).get(rule, []):
                lines.append(f"- `{rule}` {value:g} ({threshold_text(rule, rules.settings)}) "
                             f"`{rid}`: {text}")
    return "\n".join(lines) + "\n"
