"""The dpo stage end to end: preference-optimise ``dpo.init_from`` with THE training loop.

The policy starts from the SFT model and the reference is that same model, frozen. The
reference's summed response log-probability of a pair is computed once, the first time
a batch holds the pair, and cached in the run's state (checkpointed with it); a step
whose pairs are cached runs the policy alone (``lmforge.train.preference``). Checkpoints, exact resume,
precision, DDP or FSDP, the non-finite guard, LoRA and MLflow are the loop's, as for
sft; under FSDP the reference is sharded like the policy (``make_objective``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmforge.config import Params
from lmforge.errors import InputError
from lmforge.io import write_json, write_text
from lmforge.model.frozen import hold_frozen_in, resolve_base_dtype
from lmforge.model.lora import adamw_state_bytes
from lmforge.model.saved import WEIGHTS, extend_context, load_checkpoint_model, load_model
from lmforge.tokenizer.files import find_tokenizer, tokenizer_sha256
from lmforge.train import distributed
from lmforge.train.fsdp import build_sharded, ensure_process_group, shard_model
from lmforge.train.loop import TrainData, TrainResult, open_shard_data, train
from lmforge.train.pipeline import failing_run_on_error, history_tsv, relaunched
from lmforge.train.precision import resolve_precision
from lmforge.train.preference import DpoObjective
from lmforge.train.sft import base_config, save_tuned
from lmforge.train.warm_start import ensure_outside, source_architecture

DPO_TSV_COLUMNS = ("step", "loss", "lr", "grad_norm", "tokens_per_sec", "reward_margin",
                   "pref_accuracy", "reward_chosen", "reward_rejected", "logp_chosen",
                   "logp_rejected")
DPO_VAL_COLUMNS = ("step", "val_loss", "val_pref_accuracy", "val_reward_margin",
                   "val_kl_per_token")


@dataclass
class DpoPaths:
    """Inputs and outputs of the dpo stage, relative to the repo root."""

    train_shards: Path = Path("data/dpo/train")
    val_shards: Path = Path("data/dpo/val")
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


def open_dpo_data(paths: DpoPaths, tokenizer_sha: str) -> TrainData:
    """The packed preference shard sets, checked against the tokenizer."""
    data = open_shard_data(paths.train_shards, paths.val_shards)
    for where, shards in ((paths.train_shards, data.train), (paths.val_shards, data.val)):
        if shards.tokenizer_sha256 != tokenizer_sha:
            raise InputError(f"{where}: tokenized with tokenizer {shards.tokenizer_sha256[:12]}"
                             f", but {paths.tokenizer} is {tokenizer_sha[:12]}; rerun dpo_data")
        if not shards.has_loss_mask or "pairs" not in shards.manifest:
            raise InputError(f"{where}: not preference pairs (written by the dpo_data stage?)")
    return data


def load_reference(init_from: str, device: Any) -> Any:
    """The frozen reference: the model the policy starts from."""
    path = Path(init_from)
    model = (load_model(path, device=device)[0] if path.is_dir()
             else load_checkpoint_model(path, device=device)[0])
    model.requires_grad_(False)
    return model.eval()


def make_objective(params: Params, run_params: Params, data: TrainData, env: Any
                   ) -> DpoObjective:
    """The DPO objective, its reference the (frozen) model the policy starts from.

    With ``dpo.strategy: fsdp`` the reference is sharded like the policy: each rank then
    holds 1/world of both, and their forwards run on every rank together.
    """
    source = Path(params.dpo.init_from)
    bf16 = resolve_precision(params.dpo.precision, env.device).name == "bf16"
    if params.dpo.strategy == "fsdp" and source.is_dir():
        # Built on meta and filled with this rank's rows of the weights file, as the
        # policy is, without the init draws that keep the policy's generator in step.
        ensure_process_group(env)
        vocab = source_architecture(source, "dpo.init_from")[1]  # the policy's, as loaded
        reference = build_sharded(run_params.model, vocab, env, bf16,
                                  weights=source / WEIGHTS, keep_rng=False)
        reference.requires_grad_(False).eval()
    else:
        reference = extend_context(load_reference(params.dpo.init_from, env.device),
                                   run_params.model.seq_len)
        if params.dpo.strategy == "fsdp":  # a step-*.pt: loaded whole, then sharded
            ensure_process_group(env)
            shard_model(reference, env, bf16)
        elif params.dpo.lora is not None:  # frozen as the policy's base: held alike
            hold_frozen_in(reference, resolve_base_dtype(
                params.dpo.lora.base_dtype, env.device, params.dpo.strategy,
                "dpo.lora.base_dtype"))
    return DpoObjective(params.dpo.beta, reference, len(data.train.doc_ends),
                        len(data.val.doc_ends), params.dpo.nll_weight)


def run_dpo_stage(params: Params, paths: DpoPaths, module: str = "stages.dpo") -> None:
    """Preference-optimise as params say; with ``dpo.nproc > 1`` under torchrun."""
    cfg = params.dpo
    if relaunched(cfg.nproc, module, "dpo"):
        return
    ensure_outside(cfg.init_from, paths.final, "an output of this stage", "dpo.init_from")
    env = distributed.setup(cfg.device, cfg.num_threads)
    try:
        if find_tokenizer(paths.tokenizer) is None:
            raise InputError(f"{paths.tokenizer}: no tokenizer (run the tokenizer stage)")
        tokenizer_sha = tokenizer_sha256(paths.tokenizer)
        data = open_dpo_data(paths, tokenizer_sha)
        run_params = loop_params(params, data, tokenizer_sha)
        data.objective = make_objective(params, run_params, data, env)
        result = train(run_params, data, paths.checkpoints, tokenizer_sha, env, stage="dpo")
        if env.is_main:
            with failing_run_on_error(result, paths.checkpoints):
                write_dpo_outputs(result, params, data, paths, tokenizer_sha)
    finally:
        distributed.teardown()


def write_dpo_outputs(result: TrainResult, params: Params, data: TrainData, paths: DpoPaths,
                      tokenizer_sha: str) -> None:
    """models/dpo (merged; + adapter/ with LoRA), metrics/dpo.json, plots/dpo*.tsv."""
    trained = save_tuned(result, params.dpo, paths.final, paths.tokenizer, tokenizer_sha)
    write_json(paths.metrics, {
        **result.metrics, "mode": "lora" if params.dpo.lora is not None else "full",
        "beta": params.dpo.beta, "nll_weight": params.dpo.nll_weight,
        "trainable_params": trained,
        "optimizer_state_bytes": adamw_state_bytes(trained),
        "train_pairs": data.train.manifest["pairs"], "val_pairs": data.val.manifest["pairs"]})
    write_text(paths.plots, history_tsv(result.history, DPO_TSV_COLUMNS))
    write_text(paths.val_plots, history_tsv(
        [r for r in result.history if r.get("val_loss") is not None], DPO_VAL_COLUMNS))
