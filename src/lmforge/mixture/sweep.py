"""``lmforge mix sweep``: one small proxy experiment per sampled mixture, queued in DVC.

RegMix (Liu et al. 2024): train many tiny proxies, each on its own mixture, on the same
small token budget; a law fitted to their validation losses then predicts the best
mixture (``lmforge mix fit``). Each proxy is ``dvc exp run --queue evaluate -S
mix.weights.<domain>=...`` plus the proxy's model and budget (``mix_sweep`` in
params.yaml), so only mix -> tokenizer -> shards -> train -> evaluate run; the data
stages before ``mix`` come from the cache.

The tokenizer is frozen for the sweep: the workspace's ``models/tokenizer/tokenizer.model``
is copied to ``models/mix_sweep/<name>/tokenizer.model`` once and every proxy reuses it
(``tokenizer.init_from``) instead of training one on its own mixture. The proxies then
see the same token ids, their val sets are the same documents (mix splits val before it
weights), and bits-per-byte compares them whatever the tokenizer.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lmforge.config import MixSweepConfig, Params
from lmforge.errors import InputError
from lmforge.experiments import (
    dvc,
    experiments,
    queue_experiment,
    start_queue,
    wait_for_queue,
)
from lmforge.mixture.space import sample_mixtures

MIX_METRICS = Path("metrics/mix.json")
TOKENIZER = Path("models/tokenizer/tokenizer.model")
SWEEPS = Path("models/mix_sweep")  # <name>/tokenizer.model: a sweep's frozen tokenizer
# Stages that must be up to date before queueing, or every proxy would rerun them.
UPSTREAM = ("ingest", "filter", "dedup")


@dataclass
class DomainSizes:
    """Per domain: the train characters available (unique text) and its natural share."""

    domains: list[str]
    available: np.ndarray  # characters, one entry per domain
    written: float  # characters the mix stage wrote to train (repeats included)

    @property
    def natural(self) -> dict[str, float]:
        return dict(zip(self.domains, (self.available / self.available.sum()).tolist(),
                        strict=True))


def domain_sizes(mix_metrics: Path = MIX_METRICS) -> DomainSizes:
    """Unique train text per domain, from the workspace's ``metrics/mix.json``: a domain
    repeated e times for its share wrote e times its text (``train_chars / epochs``)."""
    try:
        domains = json.loads(mix_metrics.read_text(encoding="utf-8"))["domains"]
    except FileNotFoundError:
        raise InputError(f"{mix_metrics}: missing; run `dvc repro mix` first (the sweep "
                         "samples around each domain's share of the available text)") from None
    names = sorted(domains)
    available = []
    for d in names:
        m = domains[d]
        # A domain with weight 0 wrote nothing; its kept documents are then its whole
        # text, which mix.json does not hold: count it as unknown (zero), so no mixture
        # giving it weight is feasible rather than an invented size.
        available.append(m["train_chars"] / m["epochs"] if m.get("epochs") else 0.0)
    written = float(sum(domains[d]["train_chars"] for d in names))
    return DomainSizes(names, np.array(available, dtype=np.float64), written)


def proxy_mixtures(cfg: MixSweepConfig, sizes: DomainSizes) -> np.ndarray:
    """``cfg.proxies`` mixtures (rows over ``sizes.domains``); proxy i's comes from its own
    seeded generator, so a longer sweep (more proxies) keeps the first ones."""
    rows = [sample_mixtures(1, sizes.domains, sizes.natural, cfg.concentration, cfg.bounds,
                            np.random.default_rng([cfg.seed, i]))[0]
            for i in range(cfg.proxies)]
    return np.stack(rows)


def proxy_name(cfg: MixSweepConfig, i: int) -> str:
    return f"{cfg.name}-{i:02d}"


def proxy_sets(cfg: MixSweepConfig, tokenizer: Path) -> list[str]:
    """The ``-S`` overrides every proxy shares: model, budget, no extras, frozen tokenizer."""
    return [f"model.{k}={v}" for k, v in cfg.proxy_model.items()] + [f"train.max_steps={cfg.max_steps}", f"train.micro_batch_size={cfg.micro_batch_size}",
             "train.grad_accum_steps=1", "train.nproc=1", "train.probe_micro_batch=false",
             # Compiling costs more than a proxy's whole run; cadences change no result.
             "train.compile=false", "train.eval_every=0", "train.sample_every=0",
             "train.light_every=0", f"train.ckpt_every={cfg.max_steps}",
             f"evaluate.max_batches={cfg.eval_batches}", "evaluate.max_new_tokens=8",
             # A share of a few documents misses its target by a document; the fit uses
             # the shares each proxy achieved, so a shortfall costs nothing there.
             "mix.max_shortfall=1.0",
             f"tokenizer.init_from={tokenizer.resolve()}"]


def weight_sets(domains: list[str], mixture: np.ndarray) -> list[str]:
    return [f"mix.weights.{d}={w:.6f}" for d, w in zip(domains, mixture, strict=True)]


def freeze_tokenizer(name: str, log: Callable[[str], None]) -> Path:
    """Sweep ``name``'s tokenizer: the workspace's, copied at its first run and kept, so
    proxies queued by a later rerun see the same ids as the first ones."""
    frozen = SWEEPS / name / "tokenizer.model"
    if not TOKENIZER.is_file():
        raise InputError(f"{TOKENIZER}: missing; run `dvc repro tokenizer` first")
    if not frozen.is_file():
        frozen.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(TOKENIZER, frozen)
        log(f"mix sweep: tokenizer frozen for the sweep as {frozen}")
    elif frozen.read_bytes() != TOKENIZER.read_bytes():
        log(f"mix sweep: {TOKENIZER} changed since sweep {name} froze {frozen}; its proxies "
            "keep the frozen one (set mix_sweep.name to start a sweep on the new one)")
    return frozen


def check_upstream() -> None:
    """The stages before mix must be up to date, or each proxy would rerun them."""
    stale = json.loads(dvc("status", "--json", *UPSTREAM) or "{}")
    if stale:
        raise InputError(f"stage(s) {', '.join(sorted(stale))} are not up to date; run "
                         "`dvc repro mix` first, or every proxy reruns them")


def run_sweep(params: Params, jobs: int | None = None, dry_run: bool = False,
              log: Callable[[str], None] = print) -> list[str]:
    """Queue the proxies not yet run, run the queue, wait; the proxies' names."""
    cfg = params.mix_sweep
    sizes = domain_sizes()
    mixtures = proxy_mixtures(cfg, sizes)
    names = [proxy_name(cfg, i) for i in range(cfg.proxies)]
    if dry_run:
        for name, mixture in zip(names, mixtures, strict=True):
            log(f"{name}: " + " ".join(weight_sets(sizes.domains, mixture)))
        return names
    check_upstream()
    shared = proxy_sets(cfg, freeze_tokenizer(cfg.name, log))
    done = {n: e["state"] for n, e in experiments().items() if n in names}
    queued = 0
    for name, mixture in zip(names, mixtures, strict=True):
        if done.get(name) in ("success", "queued", "running"):
            continue  # a rerun after a kill goes on where the sweep was
        if name in done:  # failed: remove it, so its name can be queued again
            dvc("exp", "remove", name)
        queue_experiment(name, weight_sets(sizes.domains, mixture) + shared, ("evaluate",))
        queued += 1
    log(f"mix sweep: {queued} proxies queued, {len(names) - queued} already there; "
        f"running {jobs or cfg.jobs} at a time")
    start_queue(jobs or cfg.jobs)
    wait_for_queue(report=lambda n: log(f"mix sweep: {n} proxies queued or running"))
    states = {n: e["state"] for n, e in experiments().items() if n in names}
    failed = sorted(n for n in names if states.get(n) != "success")
    if failed:
        log(f"mix sweep: {len(failed)} proxies did not succeed ({', '.join(failed)}); "
            f"`dvc queue logs <name>` says why; rerun `lmforge mix sweep` to retry them")
    return names
