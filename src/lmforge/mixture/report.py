"""``lmforge mix fit`` and ``mix score``: from the proxies' results to a recommended
``mix.weights``, written where DVC and MLflow show it.

Each finished proxy gives one row: the train shares its mix stage achieved (from its
``metrics/mix.json``: what it trained on, not only what was asked) and every domain's
val bits-per-byte (its ``metrics/eval.json``). ``lmforge.mixture.fit`` fits the laws,
checks them on held-out proxies and searches the mixtures the epoch caps allow.

Outputs: ``metrics/mix_fit.json`` (the report), ``metrics/mix_fit.md`` (the same for
people, with the command that confirms the recommendation), ``plots/mix_fit.tsv``
(measured vs held-out predicted objective per proxy: ``dvc plots show``), and an MLflow
run ``<name>-fit`` holding all three.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lmforge.config import MixSweepConfig, Params
from lmforge.errors import ConfigError, InputError
from lmforge.experiments import experiments
from lmforge.io import write_json, write_text
from lmforge.mixture.fit import FitReport, Objective, fit_and_search
from lmforge.mixture.space import epoch_feasible, sample_mixtures
from lmforge.mixture.sweep import (
    MIX_METRICS,
    PARAMS,
    DomainSizes,
    domain_sizes,
    recorded_settings,
    setting_changes,
    sweep_settings,
    sweep_tokenizer,
)

EVAL = "metrics/eval.json"
MIX = str(MIX_METRICS)  # as dvc exp show names it
SHARDS_METRICS = Path("metrics/shards.json")
REPORT_JSON = Path("metrics/mix_fit.json")
REPORT_MD = Path("metrics/mix_fit.md")
PLOT_TSV = Path("plots/mix_fit.tsv")


@dataclass
class Proxies:
    """The finished proxies: names, achieved shares (n x D) and val bits-per-byte (n x K)."""

    names: list[str]
    shares: np.ndarray
    bpb: np.ndarray
    eval_domains: list[str]


def objective_of(cfg: MixSweepConfig) -> Objective:
    """The ``mix_sweep`` objective settings as a :class:`Objective`."""
    if cfg.objective == "target":
        return Objective.from_dict({"kind": "target", "domain": cfg.target_domain,
                                    "max_increase": cfg.max_increase})
    return Objective.from_dict({"kind": "weighted", "weights": cfg.objective_weights or None})


def val_bpb(eval_metrics: dict[str, Any], where: str) -> dict[str, float]:
    """Every domain's val bits-per-byte in an ``eval.json``."""
    try:
        return {d: float(m["bits_per_byte"]) for d, m in eval_metrics["val"]["domains"].items()}
    except (KeyError, TypeError, ValueError):
        raise InputError(f"{where}: {EVAL} has no val.domains.<domain>.bits_per_byte") from None


def collect(params: Params, domains: list[str],
            log: Callable[[str], None] = print) -> Proxies:
    """Every finished proxy of the sweep with today's settings, as ``dvc exp show`` lists
    them (also those a ``mix sweep --proxies N`` added beyond mix_sweep.proxies). Proxies
    of the sweep trained with other settings are left out, and a line says how many and
    what differs: a fit over both would mix losses of different runs."""
    cfg = params.mix_sweep
    key, settings = sweep_settings(params, sweep_tokenizer(cfg.name))
    found = experiments()
    finished = sorted(n for n, e in found.items() if e["state"] == "success")
    ours = re.compile(rf"{re.escape(cfg.name)}-{key}-\d{{2,}}")
    # Any proxy of the sweep: named with a settings key, or (before keys) without one.
    sweep_proxy = re.compile(rf"{re.escape(cfg.name)}-(?:[0-9a-f]{{8}}-)?\d{{2,}}")
    others = [n for n in finished if sweep_proxy.fullmatch(n) and not ours.fullmatch(n)]
    left_out = ""
    if others:
        recorded = recorded_settings(found[others[-1]]["params"].get(str(PARAMS), {}))
        left_out = (f"{len(others)} proxies of sweep {cfg.name} trained with other settings "
                    f"are left out ({others[-1]}: {setting_changes(recorded, settings)})")
        log(f"mix fit: {left_out}")
    names, shares, bpbs = [], [], []
    for name in (n for n in finished if ours.fullmatch(n)):
        metrics = found[name]["metrics"]
        try:
            mixed = metrics[MIX]["domains"]
            shares.append([float(mixed[d]["achieved_share"]) if d in mixed else 0.0
                           for d in domains])
        except (KeyError, TypeError):
            raise InputError(f"experiment {name}: no {MIX} with achieved shares") from None
        bpbs.append(val_bpb(metrics.get(EVAL, {}), f"experiment {name}"))
        names.append(name)
    if not names:
        raise InputError(f"no finished proxies of sweep {cfg.name} with today's settings "
                         f"({cfg.name}-{key}-NN)" + (f"; {left_out}" if left_out else "")
                         + "; run `lmforge mix sweep`")
    eval_domains = sorted(set.intersection(*(set(b) for b in bpbs)))
    bpb = np.array([[b[d] for d in eval_domains] for b in bpbs])
    return Proxies(names, np.array(shares), bpb, eval_domains)


def train_chars(params: Params, sizes: DomainSizes) -> float:
    """Characters the real run reads: its tokens (steps x batch x context) at the train
    split's characters per token, or mix.total if that is larger; the epoch caps apply
    to this amount."""
    cfg = params.train
    tokens = cfg.max_steps * cfg.micro_batch_size * cfg.grad_accum_steps * cfg.nproc
    tokens *= params.model.seq_len
    try:
        shard_tokens = json.loads(SHARDS_METRICS.read_text(encoding="utf-8"))["train"]["tokens"]
    except (FileNotFoundError, KeyError) as e:
        raise InputError(f"{SHARDS_METRICS}: run `dvc repro shards` first ({e})") from None
    return max(float(params.mix.total or 0), tokens * sizes.written / max(shard_tokens, 1))


def search_candidates(cfg: MixSweepConfig, sizes: DomainSizes, today: np.ndarray,
                      log: Callable[[str], None]) -> np.ndarray:
    """The mixtures the fitted law scores: half around the natural shares (where the
    proxies were), half ten times as concentrated around today's ``mix.weights``: the
    moderate moves from what runs now that a capped ``target`` objective needs."""
    rng = np.random.default_rng([cfg.seed, 1 << 30])
    half = cfg.candidates // 2
    natural = sample_mixtures(cfg.candidates - half, sizes.domains, sizes.natural,
                              cfg.concentration, cfg.bounds, rng)
    try:
        near = sample_mixtures(half, sizes.domains, dict(zip(sizes.domains, today.tolist(),
                                                             strict=True)),
                               10 * cfg.concentration, cfg.bounds, rng)
    except ConfigError as e:  # e.g. today's weights outside mix_sweep.bounds
        log(f"mix fit: no candidates around today's mix.weights ({e}); natural shares only")
        return natural
    return np.concatenate([natural, near])


def run_fit(params: Params, log: Callable[[str], None] = print) -> FitReport:
    """Fit, search, write the outputs, log them to MLflow; the report."""
    cfg = params.mix_sweep
    sizes = domain_sizes()
    proxies = collect(params, sizes.domains, log)
    log(f"mix fit: {len(proxies.names)} proxies, {len(sizes.domains)} domains, "
        f"objective {cfg.objective}")
    total = sum(params.mix.weights.values())
    reference = np.array([params.mix.weights.get(d, 0.0) / total for d in sizes.domains])
    candidates = search_candidates(cfg, sizes, reference, log)
    chars = train_chars(params, sizes)

    def feasible(mixtures: np.ndarray) -> np.ndarray:  # what the real run may repeat
        return epoch_feasible(mixtures, sizes.available, chars, params.mix.max_epochs)

    report = fit_and_search(proxies.shares, proxies.bpb, sizes.domains, proxies.eval_domains,
                            objective_of(cfg), candidates, feasible, reference, cfg.top_k,
                            cfg.min_rank_corr)
    write_outputs(report, proxies, cfg, chars)
    log_to_mlflow(params, report)
    log(summary(report, cfg))
    return report


def confirm_command(report: FitReport, cfg: MixSweepConfig) -> str | None:
    """The experiment that measures the recommendation at full size."""
    if report.recommendation is None:
        return None
    sets = " ".join(f"-S mix.weights.{d}={w:.4f}" for d, w in report.recommendation.items())
    # --temp: the workspace keeps today's weights and results to compare with.
    return f"dvc exp run --temp evaluate -n {cfg.name}-confirm {sets}"


def summary(report: FitReport, cfg: MixSweepConfig) -> str:
    """The report in a few lines (printed, and the head of metrics/mix_fit.md)."""
    lines = [f"law: {report.law}, held-out rank correlation {report.rank_corr:.3f} "
             f"(trusted from {report.min_rank_corr})"]
    for law in report.laws:
        lines.append(f"  {law.name}: rank correlation {law.rank_corr:.3f}, objective mean "
                     f"abs error {law.objective_mae:.4f}" + (f" ({law.error})" if law.error
                                                            else ""))
    lines.append(f"candidates: {report.candidates:,}, feasible under the epoch caps "
                 f"{report.feasible:,}, eligible {report.eligible:,}")
    if report.recommendation is None:
        lines.append(f"no recommendation: {report.reason}")
    else:
        lines.append("recommended mix.weights: " + ", ".join(
            f"{d} {w:.3f}" for d, w in report.recommendation.items()))
        lines.append(f"predicted objective {report.predicted_objective:.4f} vs today's "
                     f"mix.weights {report.reference_objective:.4f}")
        lines.append(f"confirm: {confirm_command(report, cfg)}")
    return "\n".join(lines)


def write_outputs(report: FitReport, proxies: Proxies, cfg: MixSweepConfig,
                  chars: float) -> None:
    write_json(REPORT_JSON, {**report.to_dict(), "proxies": proxies.names,
                             "eval_domains": proxies.eval_domains, "train_chars": chars})
    rows = ["proxy\tmeasured\tpredicted"] + [
        f"{n}\t{m:.6f}\t{p:.6f}" for n, m, p in
        zip(proxies.names, report.measured_objective, report.loo_objective, strict=True)]
    write_text(PLOT_TSV, "\n".join(rows) + "\n")
    table = ["| proxy | " + " | ".join(proxies.eval_domains) + " | objective | held-out |",
             "|---" * (len(proxies.eval_domains) + 3) + "|"]
    for i, name in enumerate(proxies.names):
        table.append(f"| {name} | " + " | ".join(f"{v:.3f}" for v in proxies.bpb[i])
                     + f" | {report.measured_objective[i]:.4f} | {report.loo_objective[i]:.4f} |")
    write_text(REPORT_MD, "# Mixture fit\n\n```\n" + summary(report, cfg) + "\n```\n\n"
               "Val bits-per-byte of each proxy, its objective and the chosen law's "
               "prediction with that proxy held out:\n\n" + "\n".join(table) + "\n")


def log_to_mlflow(params: Params, report: FitReport) -> None:
    """A run ``<name>-fit``: the figures, the recommendation and the files."""
    from lmforge.tracking import start_run, tracking_off

    if tracking_off("mix fit"):
        return
    with start_run(params, run_name=f"{params.mix_sweep.name}-fit",
                   tags={"lmforge.stage": "mix_fit"}) as run:
        figures = {"rank_corr": report.rank_corr, "trusted": float(report.trusted)}
        if report.predicted_objective is not None:
            figures["predicted_objective"] = report.predicted_objective
        if report.reference_objective is not None:
            figures["reference_objective"] = report.reference_objective
        figures.update({f"recommended/{d}": w
                        for d, w in (report.recommendation or {}).items()})
        run.log_metrics({k: v for k, v in figures.items() if np.isfinite(v)}, 0)
        for path in (REPORT_JSON, REPORT_MD, PLOT_TSV):
            run.log_artifact(path, "mix_fit")


def run_score(params: Params, names: list[str], log: Callable[[str], None] = print
              ) -> dict[str, float]:
    """The objective measured for the workspace (``metrics/eval.json``) and for the named
    experiments: how a confirmation run compares with today's weights."""
    objective = objective_of(params.mix_sweep)
    found = experiments() if names else {}
    sources = {"workspace": json.loads(Path(EVAL).read_text(encoding="utf-8"))}
    for name in names:
        if name not in found or found[name]["state"] != "success":
            raise InputError(f"experiment {name}: not found among finished experiments")
        sources[name] = found[name]["metrics"].get(EVAL, {})
    scores = {}
    for label, metrics in sources.items():
        bpb = val_bpb(metrics, label)
        domains = sorted(bpb)
        value = objective.value(np.array([[bpb[d] for d in domains]]), domains)[0]
        scores[label] = float(value)
        log(f"{label}: objective {value:.4f} (" + ", ".join(
            f"{d} {bpb[d]:.3f}" for d in domains) + ")")
    return scores
