"""The models a run trains with: the policy it starts from and, for DPO, a frozen
reference; each built whole or, with ``strategy: fsdp``, sharded over the ranks.

Under FSDP a model whose weights come from a model directory (or from nothing) is built
on the meta device and filled shard by shard, reading only this rank's rows of the
weights file; from a ``step-*.pt`` it is loaded whole on each rank first, then sharded.
"""

from __future__ import annotations

from pathlib import Path

import torch

from lmforge.config import ModelConfig, Params, TrainConfig, section_name
from lmforge.model.frozen import hold_frozen_in, resolve_base_dtype
from lmforge.model.llama import Llama
from lmforge.model.lora import apply_lora
from lmforge.model.saved import WEIGHTS, extend_context, load_checkpoint_model, load_model
from lmforge.train.distributed import DistEnv
from lmforge.train.fsdp import build_sharded, ensure_process_group, shard_model
from lmforge.train.loss_choice import static_fused_loss
from lmforge.train.warm_start import check_model_dir, source_architecture, warm_start


def build_model(params: Params, vocab: int, env: DistEnv, bf16: bool, compile_blocks: bool,
                tokenizer_sha256: str) -> tuple[Llama, str | None]:
    """The model a run starts from: initialised (or ``init_from``'s weights), with LoRA
    adapters if asked, sharded under FSDP; and the warm start's log line, if any."""
    cfg, mcfg = params.train, params.model
    source = Path(cfg.init_from) if cfg.init_from else None
    key = f"{section_name(cfg)}.init_from"
    if _fill_sharded(cfg, source):
        ensure_process_group(env)  # FSDP and DCP need one, even in a single process
        note = (check_model_dir(mcfg, vocab, source, tokenizer_sha256, key)
                if source is not None else None)
        model = build_sharded(mcfg, vocab, env, bf16, compile_blocks,
                              weights=source / WEIGHTS if source is not None else None,
                              lora=cfg.lora)
    else:
        model = Llama(mcfg, vocab).to(env.device)
        # Starting weights before adapters wrap the layers (a resumed run overwrites both).
        note = (warm_start(model, source, tokenizer_sha256, key) if source is not None
                else None)
        if cfg.lora is not None:
            lora = cfg.lora
            apply_lora(model, lora.rank, lora.alpha, lora.dropout, lora.targets)
            # After wrapping, so adapters stay fp32; resolved here too for direct callers.
            hold_frozen_in(model, _base_dtype(cfg, env))
        _shard_whole(model, cfg, env, bf16, compile_blocks)
    advice = muon_continuation_note(cfg)
    if advice:
        note = f"{note}\n{advice}" if note else advice
    model.label_smoothing, model.z_loss = cfg.label_smoothing, cfg.z_loss
    model.fused_loss = static_fused_loss(cfg.fused_loss)  # auto: a CUDA run probes later
    model.activation_checkpointing = cfg.activation_checkpointing
    return model, note


def muon_continuation_note(cfg: TrainConfig) -> str | None:
    """A line of advice when a trained model's weights continue under Muon: Muon's rate
    suits training from scratch; SmolLM2 continued on the demo corpus ended at val loss
    2.903 with Muon (muon_lr 0.01) against 2.768 with AdamW at 1e-4 (docs/open-models.md)."""
    if not cfg.init_from or cfg.lora is not None or getattr(cfg, "optimizer", "") != "muon":
        return None
    key = section_name(cfg)
    return (f"{key}: note: {cfg.init_from}'s weights continue under Muon ({key}.muon_lr "
            f"{cfg.muon_lr:g} on the matrices); a trained model usually continues best with "
            f"AdamW at a small rate ({key}.optimizer: adamw, as docs/open-models.md does)")


def build_reference(cfg: TrainConfig, model_cfg: ModelConfig, env: DistEnv,
                    bf16: bool) -> Llama:
    """The frozen model the policy starts from (``cfg.init_from``), held as the policy is.

    Under FSDP it is sharded like the policy: each rank then holds 1/world of both, and
    their forwards run on every rank together. With LoRA it is held in the dtype of the
    policy's frozen base.
    """
    source = Path(cfg.init_from)
    if _fill_sharded(cfg, source):
        # Built on meta and filled with this rank's rows of the weights file, as the
        # policy is, without the init draws that keep the policy's generator in step.
        ensure_process_group(env)
        vocab = source_architecture(source, f"{section_name(cfg)}.init_from")[1]
        reference = build_sharded(model_cfg, vocab, env, bf16, weights=source / WEIGHTS,
                                  keep_rng=False)
        return reference.requires_grad_(False).eval()
    reference = extend_context(load_reference(cfg.init_from, env.device), model_cfg.seq_len)
    if cfg.strategy == "fsdp":
        _shard_whole(reference, cfg, env, bf16)
    elif cfg.lora is not None:  # frozen as the policy's base: held alike
        hold_frozen_in(reference, _base_dtype(cfg, env))
    return reference


def load_reference(init_from: str, device: torch.device | str) -> Llama:
    """The model ``init_from`` names (a model directory or a ``step-*.pt``), frozen."""
    path = Path(init_from)
    model = (load_model(path, device=device)[0] if path.is_dir()
             else load_checkpoint_model(path, device=device)[0])
    model.requires_grad_(False)
    return model.eval()


def _fill_sharded(cfg: TrainConfig, source: Path | None) -> bool:
    """FSDP from a model directory or from scratch: built on meta, filled shard by shard."""
    return cfg.strategy == "fsdp" and (source is None or source.is_dir())


def _shard_whole(model: Llama, cfg: TrainConfig, env: DistEnv, bf16: bool,
                 compile_blocks: bool = False) -> None:
    """Under FSDP, shard a model that was built (or loaded) whole."""
    if cfg.strategy == "fsdp":
        ensure_process_group(env)
        shard_model(model, env, bf16, compile_blocks)


def _base_dtype(cfg: TrainConfig, env: DistEnv) -> str:
    """The dtype a LoRA run holds its frozen weights in, resolved for the device."""
    return resolve_base_dtype(cfg.lora.base_dtype, env.device, cfg.strategy,
                              f"{section_name(cfg)}.lora.base_dtype")
