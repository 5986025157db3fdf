"""The sft stage end to end: fine-tune ``sft.init_from`` on data/sft with THE training loop.

What differs from pretraining is data and trainable parameters only: masked targets
(assistant tokens) in packed rows, optional replay rows from the pretraining shards
(``sft.replay``), and optional LoRA adapters (``sft.lora``). Checkpoints, exact resume,
precision, DDP, the non-finite guard and MLflow are the loop's. The model is saved
merged (``models/sft``: a plain model every tool reads) and, with LoRA, the adapter too
(``models/sft/adapter``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmforge.config import ModelConfig, Params, TrainConfig
from lmforge.errors import InputError
from lmforge.io import write_json
from lmforge.model.frozen import copy_model, restore_fp32
from lmforge.model.lora import adamw_state_bytes, merge_lora, save_adapter, trainable_parameters
from lmforge.model.saved import load_model, save_model
from lmforge.shards.format import file_sha256
from lmforge.train import runner
from lmforge.train.loop import TrainResult
from lmforge.train.objectives import TrainData, open_shard_data


@dataclass
class SftPaths:
    """Inputs and outputs of the sft stage, relative to the repo root."""

    train_shards: Path = Path("data/sft/train")
    val_shards: Path = Path("data/sft/val")
    replay_shards: Path = Path("data/shards/train")
    tokenizer: Path = Path("models/tokenizer")  # a folder (or file), either backend
    checkpoints: Path = Path("models/checkpoints")
    final: Path = Path("models/sft")
    metrics: Path = Path("metrics/sft.json")
    plots: Path = Path("plots/sft.tsv")
    val_plots: Path = Path("plots/sft_val.tsv")


def loop_params(params: Params, base: ModelConfig, seq_len: int) -> Params:
    """The params the loop trains with: the base model's architecture, ``sft``'s knobs.

    Context length and document masking come from the packed rows and ``sft.doc_mask``
    (RoPE has no learned positions, so a base model trained at another length is fine).
    """
    model = dataclasses.replace(base, seq_len=seq_len, doc_mask=params.sft.doc_mask)
    return dataclasses.replace(params, model=model, train=params.sft)


def open_sft_data(params: Params, paths: SftPaths, tokenizer_sha: str) -> TrainData:
    """The fine-tuning shard sets (and the replay shards), checked against the tokenizer."""
    data = open_shard_data(paths.train_shards, paths.val_shards)
    if params.sft.replay > 0:
        from lmforge.shards.loader import ShardSet

        data.replay, data.replay_share = ShardSet(paths.replay_shards), params.sft.replay
    sets = [(paths.train_shards, data.train), (paths.val_shards, data.val),
            (paths.replay_shards, data.replay)]
    runner.check_tokenized(sets, paths.tokenizer, tokenizer_sha, "the sft_data / shards stage")
    if not data.train.has_loss_mask:
        raise InputError(f"{paths.train_shards}: no loss mask (written by the sft_data stage?)")
    return data


def base_config(init_from: str, tokenizer_sha: str) -> ModelConfig:
    """The architecture of the model fine-tuning starts from (checked by warm start too)."""
    model, config = load_model(init_from)
    theirs = config.get("tokenizer_sha256")
    if theirs and theirs != tokenizer_sha:
        raise InputError(f"sft.init_from: {init_from} was trained with tokenizer "
                         f"{theirs[:12]}, the fine-tuning data uses {tokenizer_sha[:12]}")
    return model.config


def run_sft_stage(params: Params, paths: SftPaths, module: str = "stages.sft") -> None:
    """Fine-tune as params say; with ``sft.nproc > 1`` re-launch through torchrun first."""
    runner.run_training_stage(params, sft_spec(paths, module))


def sft_spec(paths: SftPaths, module: str = "stages.sft") -> runner.StageSpec:
    """Fine-tuning: next-token prediction on the masked rows, from ``sft.init_from``."""

    def open_data(params: Params, tokenizer_sha: str) -> TrainData:
        return open_sft_data(params, paths, tokenizer_sha)

    def run_params(params: Params, data: TrainData, tokenizer_sha: str) -> Params:
        seq_len = int(data.train.manifest.get("seq_len", 0)) or params.sft_data.seq_len
        return loop_params(params, base_config(params.sft.init_from, tokenizer_sha), seq_len)

    def write(params: Params, data: TrainData, result: TrainResult, sha: str) -> None:
        write_sft_outputs(result, params, data, paths, sha)

    return runner.StageSpec("sft", module, paths.tokenizer, paths.checkpoints, paths.final,
                            open_data, write, loop_params=run_params)


def write_sft_outputs(result: TrainResult, params: Params, data: TrainData, paths: SftPaths,
                      tokenizer_sha: str) -> None:
    """models/sft (merged; + adapter/ with LoRA), metrics/sft.json, plots/sft*.tsv."""
    trained = save_tuned(result, params.sft, paths.final, paths.tokenizer, tokenizer_sha)
    write_json(paths.metrics, {**result.metrics, **sft_facts(params, data, trained)})
    runner.write_curves(result.history, paths.plots, paths.val_plots)


def save_tuned(result: TrainResult, cfg: TrainConfig, final: Path, tokenizer: Path,
               tokenizer_sha: str) -> int:
    """A fine-tuned model to ``final``: merged, plus ``adapter/`` with LoRA, and run.json.

    Returns the number of parameters that trained.
    """
    model = result.model
    trained = trainable_parameters(model)
    lora = cfg.lora is not None
    # Merged in fp32 and saved fp32, whatever dtype the frozen base was held in.
    merged = restore_fp32(merge_lora(copy_model(model))) if lora else model
    save_model(merged, final, tokenizer, special_ids=runner.special_ids(tokenizer),
               tokenizer_sha256=tokenizer_sha, fingerprint=result.fingerprint,
               init_from=cfg.init_from)
    if lora:
        init = Path(cfg.init_from or "")
        save_adapter(model, final / "adapter",
                     {"base_model_sha256": file_sha256(init / "model.safetensors")
                      if init.is_dir() else None})
    write_json(final / "run.json", {"mlflow_run_id": result.run_id})
    return trained


def sft_facts(params: Params, data: TrainData, trained: int) -> dict[str, Any]:
    """What metrics/sft.json adds to the loop's figures: what trained, and the replay mix."""
    share = params.sft.replay
    target_share = data.train.target_tokens() / data.train.num_tokens
    # A replay row is all targets; a fine-tuning row only its answers' tokens.
    replay_loss_share = share / (share + (1 - share) * target_share) if share else 0.0
    return {"mode": "lora" if params.sft.lora is not None else "full",
            "trainable_params": trained, "optimizer_state_bytes": adamw_state_bytes(trained),
            "replay_row_share": share, "replay_loss_token_share": round(replay_loss_share, 4)}

