"""The filter stage: apply the quality rules to every part, in parallel.

Part ``i`` of the input becomes part ``i`` of the output (possibly with fewer rows),
and its rejected documents go to ``rejects/part-i`` with the rule that fired. After the
quality rules, the PII step (``filter.pii``) redacts personal data in place or drops
the document under the rule ``pii``.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from lmforge.config import FilterConfig
from lmforge.data import filter_advice, langid, pii
from lmforge.data.counts import Counts
from lmforge.data.filter_advice import LANGUAGE_RULE, PII_RULE
from lmforge.data.filter_report import add_example, merge_examples
from lmforge.data.filters import DomainRules, domain_rules
from lmforge.data.records import list_parts, read_table, write_table
from lmforge.executor import Executor, LocalExecutor, PartLog, output_settings
from lmforge.io import files_fingerprint, resumable_dir

REJECTS_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("domain", pa.string()),
        ("source", pa.string()),
        ("rule", pa.string()),
        ("value", pa.float64()),
        ("text", pa.string()),
    ]
)


@dataclass(frozen=True)
class PartTask:
    src: str
    out: str
    rejects_out: str
    cfg: FilterConfig


@dataclass
class PartResult:
    counts: Counts
    redacted: dict[str, Counter]  # per domain: personal data replaced, by kind
    examples: dict[str, dict[str, list]]  # per domain and rule: the first rejects
    failures: dict[str, Counter]  # per domain: every rule a rejected document fails -> count
    languages: dict[str, dict[str, Counter]]  # per domain: "in" / "kept" -> language -> count


def _pii_step(text: str, rules: DomainRules) -> tuple[str, Counter | None, float]:
    """(text, kinds redacted, value): value > 0 means the document is dropped for PII."""
    mode, kinds = rules.settings["pii"], rules.settings["pii_kinds"]
    if mode == "off":
        return text, None, 0.0
    if mode == "drop":
        return text, None, float(len(pii.find(text, kinds)))
    new, found = pii.redact(text, kinds)
    return new, found, 0.0


def filter_part(task: PartTask) -> PartResult:
    """Filter one part; write the kept rows and the rejects; return the counts (worker)."""
    table = read_table(task.src)
    failures: dict[str, Counter] = {}
    languages: dict[str, dict[str, Counter]] = {}
    kept, texts, rejected, counts, redacted, examples = judge_table(table, task.cfg, failures,
                                                                    languages)
    kept = table.filter(pa.array(kept, pa.bool_()))
    if redacted:  # only then did any text change
        kept = kept.set_column(kept.schema.get_field_index("text"), "text",
                               pa.array(texts, pa.string()))
    write_table(kept, task.out)
    write_table(pa.table(rejected, schema=REJECTS_SCHEMA), task.rejects_out)
    return PartResult(counts, redacted, examples, failures, languages)


def _after_rules(text: str, rules: DomainRules, lang: str,
                 ) -> tuple[tuple[str, float] | None, str, Counter | None]:
    """(failure, text, PII redacted) of a document the rules passed: the language check
    (``filter.languages``), then the PII step."""
    wanted = rules.settings["languages"]
    if wanted and lang not in wanted:
        return (LANGUAGE_RULE, 0.0), text, None
    new_text, found, pii_value = _pii_step(text, rules)
    if pii_value > 0:
        return (PII_RULE, pii_value), text, None
    return None, (new_text if found else text), found


def _reasons(rules: DomainRules, first: str, text: str, lang: str) -> tuple[str, ...]:
    """Every reason a rejected document has (``first`` the one it was rejected for): the
    rules it fails (none when a later step rejected it, the rules passed it), then the
    language and PII steps that would reject it too."""
    failed = rules.failures(text) if first not in (LANGUAGE_RULE, PII_RULE) else ()
    return failed + filter_advice.step_reasons(rules.settings, text, lang)


def judge_table(table: pa.Table, cfg: FilterConfig, failures: dict[str, Counter] | None = None,
                languages: dict[str, dict[str, Counter]] | None = None,
                ) -> tuple[list[bool], list[str], dict, Counts, dict, dict]:
    """Run the rules, the language check and the PII step on every row: (keep mask, kept
    texts, rejects columns, counts, PII redacted per domain, rejected examples per domain
    and rule). ``failures`` (when given) gets, per domain, every rule each rejected
    document fails; ``languages`` the languages of its documents in and kept."""
    rules: dict[str, DomainRules] = {}
    counts = Counts()
    redacted: dict[str, Counter] = {}
    examples: dict[str, dict[str, list]] = {}
    keep: list[bool] = []
    texts: list[str] = []
    rejected: dict[str, list[Any]] = {name: [] for name in REJECTS_SCHEMA.names}
    languages = languages if languages is not None else {}
    cols = table.select(["id", "text", "domain", "source"]).to_pydict()
    for rid, text, domain, source in zip(cols["id"], cols["text"], cols["domain"], cols["source"], strict=True):
        if domain not in rules:
            rules[domain] = domain_rules(cfg, domain)
        c = counts[domain]
        c.n_in += 1
        lang = langid.language(text)
        langs = languages.setdefault(domain, {"in": Counter(), "kept": Counter()})
        langs["in"][lang] += 1
        failure = rules[domain].first_failure(text)
        if failure is None:
            failure, text, found = _after_rules(text, rules[domain], lang)
            if found:
                redacted.setdefault(domain, Counter()).update(found)
        keep.append(failure is None)
        if failure is None:
            c.kept += 1
            langs["kept"][lang] += 1
            texts.append(text)
            continue
        c.rejected[failure[0]] += 1
        shown = f"[{lang}] {text}" if failure[0] == LANGUAGE_RULE else text  # which language
        if failures is not None:  # every step that rejects it: what changing settings gives back
            failures.setdefault(domain, Counter())[_reasons(rules[domain], failure[0], text,
                                                            lang)] += 1
        add_example(examples, domain, failure[0], rid, float(failure[1]), shown)
        for name, value in zip(REJECTS_SCHEMA.names, (rid, domain, source, failure[0],
                                                      float(failure[1]), text), strict=True):
            rejected[name].append(value)
    return keep, texts, rejected, counts, redacted, examples


def run_filter(cfg: FilterConfig, in_dir: str | Path, out_dir: str | Path,
               examples: dict[str, dict[str, list]] | None = None,
               executor: Executor | None = None,
               failures: dict[str, Counter] | None = None) -> dict[str, Any]:
    """Filter ``in_dir``/part-* into ``out_dir``; return per-domain metrics (and fill
    ``examples`` with the first rejects per domain and rule, in input order; the metrics'
    ``fails`` count, per rule, the rejected documents it fails, and ``failures`` gets
    each domain's sets of failing rules for the loss guard's advice).

    Parts run on ``executor`` (default: the local pool); a rerun after a kill skips
    the parts already written."""
    executor = executor or LocalExecutor(cfg.num_workers)
    cfg = output_settings(cfg)
    parts = list_parts(in_dir)
    counts = Counts()
    with resumable_dir(out_dir, files_fingerprint(parts, "filter", cfg)) as tmp:
        (tmp / "rejects").mkdir(exist_ok=True)
        tasks = [PartTask(str(p), str(tmp / p.name), str(tmp / "rejects" / p.name), cfg)
                 for p in parts]
        redacted: dict[str, Counter] = {}
        failures = {} if failures is None else failures
        languages: dict[str, dict[str, Counter]] = {}
        for result in executor.map(filter_part, tasks, "filter", PartLog(tmp / ".done")):
            counts.merge(result.counts)
            for domain, found in result.failures.items():
                failures.setdefault(domain, Counter()).update(found)
            for domain, by in result.languages.items():
                mine = languages.setdefault(domain, {"in": Counter(), "kept": Counter()})
                for key in by:
                    mine[key].update(by[key])
            if examples is not None:
                merge_examples(examples, result.examples)
            for domain, found in result.redacted.items():
                redacted.setdefault(domain, Counter()).update(found)
    metrics = domain_metrics(cfg, counts, redacted, failures, languages)
    metrics["parts"] = len(parts)
    return metrics


def domain_metrics(cfg: FilterConfig, counts: Counts, redacted: dict[str, Counter],
                   failures: dict[str, Counter] | None = None,
                   languages: dict[str, dict[str, Counter]] | None = None) -> dict:
    """Counts as metrics, with each domain's kind, loss, rules and PII redactions,
    (``fails``) how many rejected documents each rule fails, first or not, and the
    languages of its documents (``languages``: in, ``languages_kept``: kept)."""
    metrics = counts.as_dict()
    for domain, c in metrics["domains"].items():
        if languages and domain in languages:
            for key, name in (("in", "languages"), ("kept", "languages_kept")):
                found = languages[domain][key]
                c[name] = dict(sorted(found.items(), key=lambda kv: (-kv[1], kv[0])))
        if failures and failures.get(domain):
            fails: Counter = Counter()
            for rules, n in failures[domain].items():  # the rules alone, not later steps
                fails.update({r: n for r in rules if filter_advice.is_rule(r)})
            c["fails"] = dict(sorted(fails.items(), key=lambda kv: (-kv[1], kv[0])))
        rules = domain_rules(cfg, domain)
        c["kind"] = rules.settings["kind"]
        c["loss"] = round(1 - c["kept"] / c["in"], 4) if c["in"] else 0.0
        c["rules"] = [r.name for r in rules.rules]
        if cfg.pii == "redact" or domain in redacted:
            c["pii_redacted"] = dict(sorted(redacted.get(domain, Counter()).items()))
    return metrics


def guarded_domains(cfg: FilterConfig, metrics: dict[str, Any]) -> list[str]:
    """The domains the loss guard stops on: above ``max_loss``, or under ``min_docs``."""
    out = []
    for domain, c in metrics["domains"].items():
        s = domain_rules(cfg, domain).settings
        share = (c["in"] - c["kept"]) / c["in"] if c["in"] else 0.0
        if share > s["max_loss"] or c["kept"] < s["min_docs"]:
            out.append(domain)
    return out


def loss_problems(cfg: FilterConfig, metrics: dict[str, Any],
                  failures: dict[str, Counter] | None = None,
                  samples: dict[str, list[str]] | None = None) -> list[str]:
    """One line per domain the rules cut too far: more than ``max_loss`` of its documents
    removed, or fewer than ``min_docs`` left; each names the rules and the change that
    keeps the domain (with ``failures`` from run_filter: the smallest skip list; with
    ``samples`` of the domain's texts: a kind that fits better), with the share kept."""
    problems = []
    for domain in guarded_domains(cfg, metrics):
        c = metrics["domains"][domain]
        s = domain_rules(cfg, domain).settings
        lost, n_in = c["in"] - c["kept"], c["in"]
        share = lost / n_in if n_in else 0.0
        by_rule = _by_rule(c, (failures or {}).get(domain))
        keep = _keep_text(cfg, domain, c, failures, samples)
        where = f"filter.domains.{domain}"
        if share > s["max_loss"]:
            accept = math.ceil(share * 20) / 20
            problems.append(
                f"filter: {domain} lost {lost:,} of {n_in:,} documents ({share:.0%}, above "
                f"max_loss {s['max_loss']}): {by_rule}; {keep}or accept the loss with "
                f"{where}.max_loss: {accept}")
        else:
            problems.append(
                f"filter: {domain} kept {c['kept']:,} of {n_in:,} documents, fewer than "
                f"min_docs {s['min_docs']} (too few for a val split): {by_rule}; {keep}"
                f"add documents, or accept it with {where}.min_docs: {c['kept']}")
    return problems


def _by_rule(c: dict[str, Any], failures: Counter | None) -> str:
    """The reasons part of a guard line: each first reason with its count, and (when the
    documents fail more than that) every rule they fail and the later steps rejecting
    them too, which a change must give back as well."""
    top = sorted(c["rejected"].items(), key=lambda kv: (-kv[1], kv[0]))
    by_rule = ", ".join(f"{r} {n:,}" for r, n in top) or "no rule"
    more = []
    if c.get("fails") and set(c["fails"]) != set(c["rejected"]) - {PII_RULE, LANGUAGE_RULE}:
        more.append("the first rule failed; every rule they fail: "
                    + ", ".join(f"{r} {n:,}" for r, n in c["fails"].items()))
    steps = filter_advice.step_counts(failures or Counter())
    # Documents a rule rejected first that a later step rejects as well.
    hidden = {r: n - c["rejected"].get(r, 0) for r, n in steps.items()}
    if any(hidden.values()):
        more.append("later steps reject them too: "
                    + ", ".join(f"{r} {n:,}" for r, n in sorted(hidden.items()) if n))
    return by_rule + (f" ({'; '.join(more)})" if more else "")


def _keep_text(cfg: FilterConfig, domain: str, c: dict[str, Any],
               failures: dict[str, Counter] | None, samples: dict[str, list[str]] | None) -> str:
    """The 'keep them with ...' clause of a guard line ('' when nothing was removed)."""
    s = domain_rules(cfg, domain).settings
    texts = (samples or {}).get(domain) or []
    verdicts = filter_advice.kind_verdicts(cfg, domain, texts) if texts else None
    known = (failures or {}).get(domain)
    fix = filter_advice.advice(cfg, domain, c, known, verdicts, len(texts))
    if c["rejected"].get(LANGUAGE_RULE) and not known:  # else the advice has the languages
        seen = [lang for lang in c.get("languages", {}) if lang not in (s["languages"] or [])][:5]
        widen = (f"filter.domains.{domain}.languages: [{', '.join([*(s['languages'] or []), *seen])}] "
                 f"({c['rejected'][LANGUAGE_RULE]:,} were in other languages)")
        fix = f"{fix} or {widen}" if fix else widen
    if fix:
        return f"keep them with {fix}, "
    rules = [r for r, _ in sorted(c["rejected"].items(), key=lambda kv: (-kv[1], kv[0]))
             if r not in (PII_RULE, LANGUAGE_RULE)]
    if rules:
        return (f"keep them with filter.domains.{domain}.skip: [{', '.join(rules)}] (or a kind "
                f"that fits the text, now {s['kind']}), ")
    if c["in"] > c["kept"]:  # only PII drops
        return "keep them with filter.pii: redact, "
    return ""  # a small domain the rules left whole: nothing to keep back
