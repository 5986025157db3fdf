"""The dpo stage end to end: preference-optimise ``dpo.init_from`` with THE training loop.

The policy starts from the SFT model and the reference is that same model, frozen. The
reference's summed response log-probability of a pair is computed once, the first time
a batch holds the pair, and cached in the run's state (checkpointed with it); a step
whose pairs are cached runs the policy alone (``lmforge.train.preference``). ``dpo.loss``
picks the pair loss (SimPO builds no reference at all); ``dpo.replay`` mixes rows of the
pretraining shards (``data/shards/train``, as ``sft.replay``) into every batch, their
next-token loss weighted by ``dpo.replay_weight``. Checkpoints, exact resume,
precision, DDP or FSDP, the non-finite guard, LoRA and MLflow are the loop's, as for
sft; under FSDP the reference is sharded like the policy (``make_objective``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmforge.config import DpoConfig, Params
from lmforge.errors import InputError
from lmforge.io import write_json
from lmforge.model.lora import adamw_state_bytes
from lmforge.train.build import build_reference
from lmforge.train.distributed import DistEnv
from lmforge.train.loop import TrainResult
from lmforge.train.objectives import TrainData, open_shard_data
from lmforge.train.precision import resolve_precision
from lmforge.train.preference import DpoObjective
from lmforge.train.runner import StageSpec, check_tokenized, run_training_stage, write_curves
from lmforge.train.sft import base_config, save_tuned

DPO_TSV_COLUMNS = ("step", "loss", "lr", "grad_norm", "tokens_per_sec", "reward_margin",
                   "reward_accuracy", "reward_chosen", "reward_rejected", "logp_chosen",
                   "logp_rejected")
# With dpo.replay: the replay rows' next-token loss per token, after the others.
DPO_REPLAY_COLUMNS = ("replay_loss",)
DPO_VAL_COLUMNS = ("step", "val_loss", "val_reward_accuracy", "val_reward_margin",
                   "val_kl_per_token")


@dataclass
class DpoPaths:
    """Inputs and outputs of the dpo stage, relative to the repo root."""

    train_shards: Path = Path("data/dpo/train")
    val_shards: Path = Path("data/dpo/val")
    replay_shards: Path = Path("data/shards/train")
    tokenizer: Path = Path("models/tokenizer")  # a folder (or file), either backend
    checkpoints: Path = Path("models/checkpoints")
    final: Path = Path("models/dpo")
    metrics: Path = Path("metrics/dpo.json")
    plots: Path = Path("plots/dpo.tsv")
    val_plots: Path = Path("plots/dpo_val.tsv")


def loop_params(params: Params, data: TrainData, tokenizer_sha: str) -> Params:
    """The params the loop trains with: the start model's architecture, ``dpo``'s knobs,
    the packed rows' length, and attention restarting at every sequence of a row."""
    base = base_config(params.dpo.init_from, tokenizer_sha)
    seq_len = int(data.train.manifest.get("seq_len", 0)) or params.dpo_data.seq_len
    model = dataclasses.replace(base, seq_len=seq_len, doc_mask=True)
    return dataclasses.replace(params, model=model, train=params.dpo)


def open_dpo_data(paths: DpoPaths, tokenizer_sha: str, replay: float = 0.0) -> TrainData:
    """The packed preference shard sets (and with ``replay`` > 0 the pretraining shards
    whose windows fill that share of the rows), checked against the tokenizer."""
    data = open_shard_data(paths.train_shards, paths.val_shards)
    sets = [(paths.train_shards, data.train), (paths.val_shards, data.val)]
    check_tokenized(sets, paths.tokenizer, tokenizer_sha, "dpo_data")
    for where, shards in sets:
        if not shards.has_loss_mask or "pairs" not in shards.manifest:
            raise InputError(f"{where}: not preference pairs (written by the dpo_data stage?)")
    if replay > 0:
        from lmforge.shards.loader import ShardSet

        if not (paths.replay_shards / "manifest.json").is_file():
            raise InputError(f"{paths.replay_shards}: no pretraining shards for dpo.replay "
                             "(run the shards stage, or set dpo.replay: 0)")
        data.replay, data.replay_share = ShardSet(paths.replay_shards), replay
        check_tokenized([(paths.replay_shards, data.replay)], paths.tokenizer, tokenizer_sha,
                        "the shards stage")
    return data


def make_objective(params: Params, run_params: Params, data: TrainData, env: DistEnv
                   ) -> DpoObjective:
    """The DPO objective, its reference the (frozen) model the policy starts from (none
    for ``dpo.loss: simpo``).

    With ``dpo.strategy: fsdp`` the reference is sharded like the policy: each rank then
    holds 1/world of both, and their forwards run on every rank together.
    """
    reference = None
    if params.dpo.loss != "simpo":  # SimPO is reference-free: nothing to build or run
        bf16 = resolve_precision(params.dpo.precision, env.device).name == "bf16"
        reference = build_reference(params.dpo, run_params.model, env, bf16)
    return DpoObjective.from_config(params.dpo, reference, len(data.train.doc_ends),
                                    len(data.val.doc_ends))


def run_dpo_stage(params: Params, paths: DpoPaths, module: str = "stages.dpo") -> None:
    """Preference-optimise as params say; with ``dpo.nproc > 1`` under torchrun."""
    run_training_stage(params, dpo_spec(paths, module))


def dpo_spec(paths: DpoPaths, module: str = "stages.dpo") -> StageSpec:
    """DPO: preference pairs, the policy from ``dpo.init_from`` and a frozen reference."""

    def open_data(params: Params, tokenizer_sha: str) -> TrainData:
        return open_dpo_data(paths, tokenizer_sha, params.dpo.replay)

    def write(params: Params, data: TrainData, result: TrainResult, sha: str) -> None:
        write_dpo_outputs(result, params, data, paths, sha)

    return StageSpec("dpo", module, paths.tokenizer, paths.checkpoints, paths.final,
                     open_data, write, loop_params=loop_params, objective=make_objective)


def write_dpo_outputs(result: TrainResult, params: Params, data: TrainData, paths: DpoPaths,
                      tokenizer_sha: str) -> None:
    """models/dpo (merged; + adapter/ with LoRA), metrics/dpo.json, plots/dpo*.tsv."""
    cfg = params.dpo
    trained = save_tuned(result, cfg, paths.final, paths.tokenizer, tokenizer_sha)
    write_json(paths.metrics, {
        **result.metrics, "mode": "lora" if cfg.lora is not None else "full",
        "beta": cfg.beta, "nll_weight": cfg.nll_weight, **recipe_facts(cfg),
        "trainable_params": trained,
        "optimizer_state_bytes": adamw_state_bytes(trained),
        "train_pairs": data.train.manifest["pairs"], "val_pairs": data.val.manifest["pairs"]})
    columns = DPO_TSV_COLUMNS + (DPO_REPLAY_COLUMNS if cfg.replay > 0 else ())
    write_curves(result.history, paths.plots, paths.val_plots, columns, DPO_VAL_COLUMNS)


def recipe_facts(cfg: DpoConfig) -> dict[str, Any]:
    """What metrics/dpo.json records of the loss and replay: only what differs from
    plain DPO, so a run at the defaults writes the file it always did."""
    facts: dict[str, Any] = {}
    if cfg.loss != "sigmoid":
        facts["loss"] = cfg.loss
        knob = {"dpop": "dpop_lambda", "simpo": "simpo_gamma"}.get(cfg.loss)
        if knob:
            facts[knob] = getattr(cfg, knob)
    if cfg.replay > 0:
        facts.update(replay_row_share=cfg.replay, replay_weight=cfg.replay_weight)
    return facts
