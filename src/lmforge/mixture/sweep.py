"""``lmforge mix sweep``: one small proxy experiment per sampled mixture, queued in DVC.

RegMix (Liu et al. 2024): train many tiny proxies, each on its own mixture, on the same
small token budget; a law fitted to their validation losses then predicts the best
mixture (``lmforge mix fit``). Each proxy is ``dvc exp run --queue evaluate -S
mix.weights.<domain>=...`` plus the proxy's model and budget (``mix_sweep`` in
params.yaml), so only mix -> tokenizer -> shards -> train -> evaluate run; the data
stages before ``mix`` come from the cache.

The tokenizer is frozen for the sweep: the workspace's ``models/tokenizer/`` files
(``tokenizer.model``, or ``tokenizer.json`` and its companions) are copied to
``models/mix_sweep/<name>/`` once and every proxy reuses them
(``tokenizer.init_from``) instead of training one on its own mixture. The proxies then
see the same token ids, their val sets are the same documents (mix splits val before it
weights), and bits-per-byte compares them whatever the tokenizer.

A proxy is defined by the settings it trains with: the params.yaml sections of the stages
it runs and reads from (with the sweep's overrides), the sampling settings that chose its
mixture and the frozen tokenizer. Their hash, the sweep's key, is part of every proxy's
name (``<name>-<key>-NN``), so a rerun after any of them changed queues new proxies
rather than counting the old ones as done, and ``mix fit`` fits only the proxies of
today's settings (:func:`proxy_settings`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from lmforge.config import MixSweepConfig, Params, TrainConfig
from lmforge.errors import InputError
from lmforge.experiments import (
    dvc,
    experiments,
    queue_experiment,
    start_queue,
    wait_for_queue,
)
from lmforge.mixture.space import sample_mixtures
from lmforge.stage_deps import SWEEP_TOKENIZERS
from lmforge.tokenizer.files import copy_tokenizer, find_tokenizer, locate_tokenizer
from lmforge.train.checkpoint import NON_RUN_KEYS

MIX_METRICS = Path("metrics/mix.json")
TOKENIZER = Path("models/tokenizer")  # the tokenizer stage's folder, either backend
# <name>/tokenizer.model (or tokenizer.json and its companions): a sweep's frozen tokenizer.
# The tokenizer stage exempts this folder from its init_from-is-a-dep check (a proxy's
# dvc.yaml cannot list it; frozen copies are never edited): stage_deps.py says why.
SWEEPS = Path(SWEEP_TOKENIZERS)
PARAMS = Path("params.yaml")
# Stages that must be up to date before queueing, or every proxy would rerun them.
UPSTREAM = ("ingest", "filter", "dedup")
# The params.yaml sections a proxy's result depends on: the stages it runs (mix to
# evaluate) and those whose outputs it reads ...
DEFINING = (*UPSTREAM, "mix", "tokenizer", "shards", "model", "train", "evaluate")
# ... less what only changes how a run is observed or how fast it goes (the same rule as
# a training run's fingerprint), the per-proxy mixture, and the frozen tokenizer's path
# (its bytes count instead).
NOT_DEFINING = {
    "train": NON_RUN_KEYS - {"init_from"},
    "evaluate": {"prompts", "temperatures", "max_new_tokens", "top_k", "seed"},
    "mix": {"weights"},
    "tokenizer": {"init_from"},
}
# The mix_sweep settings a proxy's mixture is drawn with.
SAMPLING = ("seed", "concentration", "bounds")


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


def proxy_name(cfg: MixSweepConfig, key: str, i: int) -> str:
    """Proxy ``i`` of the sweep whose settings hash to ``key``."""
    return f"{cfg.name}-{key}-{i:02d}"


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Nested mappings as ``{"a.b.c": value}`` (lists are values), as ``-S`` names keys."""
    if not isinstance(tree, dict):
        return {prefix: tree} if prefix else {}
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        flat.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def defines(key: str) -> bool:
    """Whether the flat params.yaml key ``key`` changes what a proxy computes."""
    section, _, rest = key.partition(".")
    field = rest.split(".")[0]
    return (section in DEFINING and field != "num_workers"
            and field not in NOT_DEFINING.get(section, ()))


def recorded_settings(raw: dict[str, Any]) -> dict[str, Any]:
    """The defining settings in a params.yaml as DVC records it for an experiment: its
    sections' values (:func:`defines`) and the mixture's sampling settings."""
    settings = {k: v for k, v in flatten({s: raw.get(s) for s in DEFINING}).items()
                if defines(k)}
    sampling = raw.get("mix_sweep") or {}
    settings.update({f"mix_sweep.{n}": sampling.get(n) for n in SAMPLING})
    return settings


def proxy_settings(raw: dict[str, Any], shared: list[str], cfg: MixSweepConfig,
                   tokenizer: Path) -> dict[str, Any]:
    """The settings every proxy of the sweep shares, flat: the workspace's ``raw``
    params.yaml with the ``shared`` ``-S`` overrides applied (as DVC records each proxy's
    params), the settings its mixture is sampled with, and the tokenizer's sha256."""
    settings = recorded_settings(raw)
    for override in shared:
        key, _, text = override.partition("=")
        if defines(key):
            settings[key] = yaml.safe_load(text)
    settings.update({f"mix_sweep.{n}": getattr(cfg, n) for n in SAMPLING})
    settings["tokenizer.frozen_sha256"] = hashlib.sha256(tokenizer.read_bytes()).hexdigest()
    return settings


def setting_changes(recorded: dict[str, Any], today: dict[str, Any], most: int = 4) -> str:
    """``train.max_steps 150 -> 600, ...``: how a proxy's recorded settings differ from
    today's (the tokenizer's bytes are not in a DVC record)."""
    keys = sorted(k for k in set(recorded) | set(today)
                  if k != "tokenizer.frozen_sha256" and recorded.get(k) != today.get(k))
    shown = [f"{k} {recorded.get(k)!r} -> {today.get(k)!r}" for k in keys[:most]]
    if len(keys) > most:
        shown.append(f"{len(keys) - most} more")
    return ", ".join(shown) or "the same params.yaml values: another frozen tokenizer"


def settings_key(settings: dict[str, Any]) -> str:
    """Eight hex digits of the settings' sha256: the part of a proxy's name they decide."""
    blob = json.dumps(settings, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:8]


def read_params_yaml(path: Path = PARAMS) -> dict[str, Any]:
    """The workspace's params.yaml as written (what ``dvc exp run`` starts from)."""
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except FileNotFoundError:
        raise InputError(f"{path}: missing; run lmforge from the repository root") from None


def sweep_settings(params: Params, tokenizer: Path) -> tuple[str, dict[str, Any]]:
    """(key, settings) of today's sweep (``params.mix_sweep``) with its frozen
    ``tokenizer``."""
    cfg = params.mix_sweep
    settings = proxy_settings(read_params_yaml(), proxy_sets(params, tokenizer), cfg, tokenizer)
    return settings_key(settings), settings


def proxy_warmup(train: TrainConfig) -> float:
    """The proxies' warmup: the real run's share of its steps (a warmup given in steps
    could be as long as a proxy's whole run)."""
    return train.warmup if train.warmup < 1 else train.warmup / train.max_steps


def proxy_sets(params: Params, tokenizer: Path) -> list[str]:
    """The ``-S`` overrides every proxy shares: model, budget, no extras, frozen tokenizer."""
    cfg = params.mix_sweep
    return [f"model.{k}={v}" for k, v in cfg.proxy_model.items()] + [
             f"train.max_steps={cfg.max_steps}", f"train.micro_batch_size={cfg.micro_batch_size}",
             f"train.warmup={proxy_warmup(params.train):.6g}",
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


def sweep_tokenizer(name: str) -> Path:
    """The tokenizer sweep ``name``'s proxies use: its frozen copy, or before the first
    run the workspace's one that will be frozen (the defining file, either backend)."""
    frozen = find_tokenizer(SWEEPS / name)
    return frozen if frozen is not None else _workspace_tokenizer()


def _workspace_tokenizer() -> Path:
    found = find_tokenizer(TOKENIZER)
    if found is None:
        raise InputError(f"{TOKENIZER}: missing; run `dvc repro tokenizer` first")
    return found


def freeze_tokenizer(name: str, log: Callable[[str], None]) -> Path:
    """Sweep ``name``'s tokenizer: the workspace's, copied whole (its files, whichever
    backend) at its first run and kept, so proxies queued by a later rerun see the same
    ids as the first ones. Returns the frozen defining file."""
    current = _workspace_tokenizer()
    frozen = find_tokenizer(SWEEPS / name)
    if frozen is None:
        (SWEEPS / name).mkdir(parents=True, exist_ok=True)
        copy_tokenizer(current, SWEEPS / name)
        frozen = locate_tokenizer(SWEEPS / name)
        log(f"mix sweep: tokenizer frozen for the sweep as {frozen}")
    elif frozen.read_bytes() != current.read_bytes():
        log(f"mix sweep: {current} changed since sweep {name} froze {frozen}; its proxies "
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
    if dry_run:  # the names and mixtures it would queue; nothing frozen or queued
        key, _ = sweep_settings(params, sweep_tokenizer(cfg.name))
        names = [proxy_name(cfg, key, i) for i in range(cfg.proxies)]
        for name, mixture in zip(names, mixtures, strict=True):
            log(f"{name}: " + " ".join(weight_sets(sizes.domains, mixture)))
        return names
    check_upstream()
    tokenizer = freeze_tokenizer(cfg.name, log)
    shared = proxy_sets(params, tokenizer)
    key, _ = sweep_settings(params, tokenizer)
    names = [proxy_name(cfg, key, i) for i in range(cfg.proxies)]
    done = {n: e["state"] for n, e in experiments().items() if n in names}
    queued = 0
    for name, mixture in zip(names, mixtures, strict=True):
        if done.get(name) in ("success", "queued", "running"):
            continue  # a rerun after a kill goes on where the sweep was
        if name in done:  # failed: remove it, so its name can be queued again
            dvc("exp", "remove", name)
        queue_experiment(name, weight_sets(sizes.domains, mixture) + shared, ("evaluate",))
        queued += 1
    there = len(names) - queued
    if all(done.get(n) == "success" for n in names):  # nothing was queued either
        # Every proxy has run: no queue workers to start (seconds each) or wait for.
        log(f"mix sweep: settings {key}: 0 proxies queued, {there} already there")
        return names
    log(f"mix sweep: settings {key}: {queued} proxies queued, {there} already there; "
        f"running {jobs or cfg.jobs} at a time")
    start_queue(jobs or cfg.jobs)
    wait_for_queue(report=lambda n: log(f"mix sweep: {n} proxies queued or running"))
    states = {n: e["state"] for n, e in experiments().items() if n in names}
    failed = sorted(n for n in names if states.get(n) != "success")
    if failed:
        log(f"mix sweep: {len(failed)} proxies did not succeed ({', '.join(failed)}); "
            f"`dvc queue logs <name>` says why; rerun `lmforge mix sweep` to retry them")
    return names
